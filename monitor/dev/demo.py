"""The demo of ``fleet up --demo``: example tasks for the example lanes' scripted agent
(:mod:`worker.dev.example_agent`), steered by their payloads to show a retry, a dead letter, a
crash, a hand-off and a route; the lanes it needs; when they are all finished, and the summary of
its own run (not of what the database held before it)."""

from __future__ import annotations

import uuid
from collections.abc import Container
from pathlib import Path
from typing import Any

from worker.errors import InvalidInput
from worker.models import FINISHED_STATES, TASK_STATES, WAITING_STATES
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


# the lanes its tasks run in, and the lanes they are routed to
DEMO_LANES = sorted({lane for lane, _, _ in DEMO_TASKS} | {p["route"] for _, _, p in DEMO_TASKS if "route" in p})


def check_demo_lanes(lanes: Container[str], source: Path | None) -> None:
    """InvalidInput naming the demo's lanes that the config (``source``: its file) lacks."""
    missing = [lane for lane in DEMO_LANES if lane not in lanes]
    if missing:
        where = str(source) if source is not None else "the config"
        raise InvalidInput(f"--demo queues tasks for lanes {', '.join(DEMO_LANES)}, and {where} lacks "
                           f"{', '.join(missing)}: run it in a folder without a fleet.toml (the built-in example "
                           "lanes), or add those lanes")


def queue_demo(store: PostgresStore, lanes: Container[str]) -> str:
    """Queue the demo tasks of the configured ``lanes`` under a new key prefix; the prefix."""
    prefix = f"demo:{uuid.uuid4().hex[:6]}:"
    for i, (lane, title, payload) in enumerate(DEMO_TASKS, 1):
        if lane in lanes:
            store.enqueue(lane, f"{prefix}{i}", payload, title=title)
    return prefix


def demo_states(store: PostgresStore, prefix: str) -> dict[str, int]:
    """How many demo tasks of ``prefix`` are in each state."""
    return {str(r["state"]): int(r["n"]) for r in store.query("states_with_prefix", prefix=prefix)}


def demo_summary(store: PostgresStore, prefix: str) -> list[dict[str, Any]]:
    """fleet.lane_summary() of this demo's tasks and runs alone, per lane they touched."""
    return store.query("summary_with_prefix", prefix=prefix)


def demo_finished(states: dict[str, int]) -> bool:
    """Whether the fleet has nothing left to do for the demo: every task is finished or waits for a
    person (blocked, in review)."""
    return all(s in FINISHED_STATES or s in WAITING_STATES for s in states)


def demo_ending(states: dict[str, int]) -> str:
    """How the demo's tasks ended, in a few words: "6 done, 1 dead, 1 review (waiting for a person: …)"."""
    counts = ", ".join(f"{states[s]} {s}" for s in TASK_STATES if states.get(s)) or "no tasks"
    waiting = [s for s in TASK_STATES if states.get(s) and s in WAITING_STATES]
    if waiting:
        counts += f" (waiting for a person: `fleet tasks --state {waiting[0]}`)"
    return counts
