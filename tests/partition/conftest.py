"""The ``partition_host`` fixture: a network namespace across a veth and a relay from the test's
PostgreSQL server (tests/partition/netns.py), torn down after the test whatever happened."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from partition.netns import PartitionHost, host_or_skip


@pytest.fixture
def partition_host(pg_server: str) -> Iterator[PartitionHost]:
    """An open :class:`~partition.netns.PartitionHost` relaying to ``pg_server``; the test is
    skipped, saying why, where this machine allows no network namespace."""
    with host_or_skip(pg_server) as host:
        yield host
