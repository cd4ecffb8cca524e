"""The demo of ``fleet up --demo``: example tasks for the example lanes' scripted agent
(:mod:`worker.dev.example_agent`), steered by their payloads to show a retry, a dead letter, a
crash, a hand-off and a route; and when they are all finished."""

from __future__ import annotations

import uuid
from collections.abc import Container
from typing import Any

from worker.store.postgres import PostgresStore

DEMO_TASKS: list[tuple[str, str, dict[str, Any]]] = [
    ("docs", "write the quick start", {"steps": 3, "sleep": 0.3}),
    ("docs", "document the SQL API", {"steps": 2, "sleep": 0.3}),
    ("docs", "flaky: fails once, then passes", {"steps": 2, "sleep": 0.2, "fail_attempts": 1}),
    ("docs", "always fails: a dead letter", {"steps": 1, "sleep": 0.1, "mode": "fail"}),
    ("docs", "needs two shifts", {"steps": 6, "sleep": 1.5}),
    ("bugfix", "crashes once, then is fixed", {"steps": 2, "sleep": 0.2, "crash_attempts": 1}),
    ("bugfix", "fix the off-by-one, then review", {"steps": 2, "sleep": 0.3, "route": "review",
                                                    "route_note": "fixed the off-by-one; test added"}),
    ("bugfix", "hand off once", {"steps": 2, "sleep": 0.2, "steps_per_shift": 1}),
]


def queue_demo(store: PostgresStore, lanes: Container[str]) -> str:
    """Queue the demo tasks of the configured ``lanes`` under a new key prefix; the prefix."""
    prefix = f"demo:{uuid.uuid4().hex[:6]}:"
    for i, (lane, title, payload) in enumerate(DEMO_TASKS, 1):
        if lane in lanes:
            store.enqueue(lane, f"{prefix}{i}", payload, title=title)
    return prefix


def demo_finished(store: PostgresStore, prefix: str) -> bool:
    """Whether every demo task of ``prefix`` is finished (none is queued or running)."""
    return bool(store.query("open_tasks_with_prefix", prefix=prefix)[0]["n"] == 0)
