"""Fixtures of the SQL API tests (the helpers are in tests/sqlkit.py): a lane ``a`` and a session of
it, lanes docs and bugfix, extra connections, and the histories the plan and figure tests read."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlkit import add_lane, build_batch_history, build_long_history, open_session


@pytest.fixture
def lane(conn: psycopg.Connection) -> str:
    """Lane ``a`` (sqlkit.add_lane: lease 60 s, 3 attempts, 10 hand-offs, no limit)."""
    return add_lane(conn, "a")


@pytest.fixture
def session(conn: psycopg.Connection, lane: str) -> uuid.UUID:
    """An active session of lane ``a`` (host-1, pid 4242, 600 s)."""
    return open_session(conn, lane)


@pytest.fixture
def lanes(conn: psycopg.Connection) -> psycopg.Connection:
    """Lanes ``docs`` and ``bugfix`` (as ``lane``); the connection."""
    add_lane(conn, "docs")
    add_lane(conn, "bugfix")
    return conn


@pytest.fixture
def connect(db_url: str) -> Iterator[Callable[..., psycopg.Connection]]:
    """More connections to the test's database (closed at the end), e.g. to hold a transaction open."""
    made: list[psycopg.Connection] = []

    def make(autocommit: bool = True) -> psycopg.Connection:
        c = psycopg.connect(db_url, autocommit=autocommit)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def long_history(conn: psycopg.Connection) -> psycopg.Connection:
    """sqlkit.build_long_history: a long history and a little active work."""
    build_long_history(conn)
    return conn


@pytest.fixture
def batch_history(conn: psycopg.Connection) -> dict[str, Any]:
    """sqlkit.build_batch_history: two unbatched tasks and a batch of three."""
    return build_batch_history(conn)
