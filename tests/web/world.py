"""A small history for the console tests, made through the store's SQL API and one real shift."""

from __future__ import annotations

import os
from typing import Any

from fleetkit import AGENT, Fleet, lane_defaults

PROFILES = {
    "pools": {"max": {"slots": 4, "windows": {"five_hour": {"hours": 5, "budget_tokens": 10_000_000}}}},
    "profiles": {"scripted": {"command": [*AGENT, "--model", "{model}"],
                              "models": {"mechanical": "m-small", "mid": "m-mid", "strong": "m-large"},
                              "pool": "max"}},
}
TIERS = ["mechanical", "mid", "strong"]
QUICK = {"steps": 1, "sleep": 0.02}


def lane(**settings: Any) -> dict[str, Any]:
    out = lane_defaults(profile="scripted", tiers=TIERS, **settings)
    del out["command"]
    return out


def claimed(fleet: Fleet, lane: str, key: str, payload: dict[str, Any] | None = None) -> tuple[int, Any]:
    """A task of ``key`` enqueued and claimed by a session of this test (no agent runs)."""
    task = fleet.enqueue(lane, key, payload or {})
    session = fleet.store.open_session(lane, "host-of-the-test", os.getpid(), None, 600)
    [got] = fleet.store.claim(session, 1)
    assert got.id == task
    return task, got.lease_token


def build(fleet: Fleet) -> dict[str, int]:
    """``reviewed``: ran to its end in a real shift, waits in review (lane work); ``gated``:
    blocked by its gate, ``doomed``: dead, ``waiting``: queued (lane other)."""
    ids: dict[str, int] = {}
    ids["reviewed"] = fleet.enqueue("work", "reviewed", QUICK)
    fleet.run_shift("work", max_tasks=1)
    assert fleet.task(ids["reviewed"])["state"] == "review"
    ids["gated"], token = claimed(fleet, "other", "gated")
    fleet.store.block(ids["gated"], token, "automation-broken", "the verify gate said: no tests ran")
    ids["doomed"], token = claimed(fleet, "other", "doomed")
    fleet.store.fail(ids["doomed"], token, "boom: the agent exited 3", retryable=False)
    ids["waiting"] = fleet.enqueue("other", "waiting", QUICK)
    return ids
