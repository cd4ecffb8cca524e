"""Capacity windows (issue #23): a pool's usage windows, their use from the runs and from the
provider's readings, and claims that look ahead into them (fleet._window_use, fleet.pool_windows,
fleet.claim, fleet.record_run's windows)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from sqlkit import (
    claim,
    complete,
    enqueue,
    one,
    open_session,
    record_run,
    refused,
    rows,
    sync_lane,
    task,
)

TOKENS_PER_TASK = 1000  # what each finished task of the tests recorded


def two_pools(conn: psycopg.Connection, *, budget: int = 5000, reserve: float = 0.0) -> None:
    """Lane `a` draws pool `first` (a 5-hour window of ``budget`` tokens) before pool `second`."""
    windows = {"five_hour": {"seconds": 18000, "budget_tokens": budget, "provider_window": "five_hour"}}
    one(conn, "select fleet.sync_pool('first', 10, %s, %s::numeric)", (Jsonb(windows), reserve))
    one(conn, "select fleet.sync_pool('second', 10)")
    one(conn, "select fleet.sync_profile('p1', 'first', '{}')")
    one(conn, "select fleet.sync_profile('p2', 'second', '{}')")
    sync_lane(conn, "a", config={"dispatch": [{"pool": "first", "profile": "p1"}, {"pool": "second", "profile": "p2"}]})


def finish(conn: psycopg.Connection, s: Any, tokens: int = TOKENS_PER_TASK, windows: Any = None) -> dict[str, Any]:
    (t,) = claim(conn, s, 1)
    report: dict[str, Any] = {"input_tokens": tokens, "output_tokens": 0}
    if windows is not None:
        report["windows"] = windows
    record_run(conn, t["lease_token"], report)
    complete(conn, t["id"], t["lease_token"])
    return t


def window(conn: psycopg.Connection, pool: str = "first") -> dict[str, Any]:
    (row,) = rows(conn, "select * from fleet.pool_windows where pool = %s", (pool,))
    return row


def test_the_window_use_equals_the_runs_of_the_pool_summed_by_hand(conn: psycopg.Connection) -> None:
    two_pools(conn)
    for _ in range(3):
        enqueue(conn, "a")
    s = open_session(conn, "a")
    pools = [finish(conn, s, tokens)["pool"] for tokens in (700, 1100, 1300)]
    assert pools == ["first"] * 3
    by_hand = one(conn, """select sum(input_tokens + cache_creation_tokens + cache_read_tokens + output_tokens)
                             from fleet.runs where pool = 'first' and started_at > now() - interval '5 hours'""")
    w = window(conn)
    assert w["used_tokens"] == by_hand == 3100 and w["source"] == "estimate"
    assert float(w["utilization"]) == 0.62 and w["budget_tokens"] == 5000
    first_start = one(conn, "select min(started_at) from fleet.runs where pool = 'first'")
    assert w["resets_at"] == first_start + timedelta(hours=5)


def test_claims_spill_before_the_window_is_crossed_and_wait_when_no_pool_has_room(conn: psycopg.Connection) -> None:
    two_pools(conn, budget=3500)
    for _ in range(6):
        enqueue(conn, "a")
    s = open_session(conn, "a")
    # three tasks of 1000 each fill 3000 of 3500: the fourth, expected to spend 1000 (the lane's
    # median), does not fit the 500 left: it goes to the second pool, before the first throttles
    pools = [finish(conn, s)["pool"] for _ in range(4)]
    assert pools == ["first", "first", "first", "second"]
    spill = rows(conn, "select detail from fleet.journal where kind = 'claimed' order by id desc limit 1")[0]["detail"]
    assert spill["window_spill"] == ["first"] and spill["pool"] == "second"
    assert window(conn)["used_tokens"] == 3000  # never crossed


def test_a_task_waits_for_the_window_to_reset_when_its_only_pool_is_full(conn: psycopg.Connection) -> None:
    windows = {"five_hour": {"seconds": 18000, "budget_tokens": 2500}}
    one(conn, "select fleet.sync_pool('only', 10, %s, 0::numeric)", (Jsonb(windows),))
    one(conn, "select fleet.sync_profile('p', 'only', '{}')")
    sync_lane(conn, "a", config={"profile": "p"})
    ids = [enqueue(conn, "a") for _ in range(3)]
    s = open_session(conn, "a")
    finish(conn, s)
    finish(conn, s)
    assert claim(conn, s, 1) == []  # 2000 of 2500 used, a task is expected to spend 1000: it waits
    waiting = task(conn, ids[2])
    reset = window(conn, "only")["resets_at"]
    assert waiting["state"] == "queued" and waiting["run_at"] == reset
    (deferred,) = rows(conn, "select detail from fleet.journal where kind = 'window_deferred'")
    assert deferred["detail"]["expected_tokens"] == 1000
    # at the reset (the first run slides out of the window) it is claimed again
    conn.execute("update fleet.runs set started_at = started_at - interval '5 hours 1 second'")
    conn.execute("update fleet.tasks set run_at = now() where id = %s", (ids[2],))
    (again,) = claim(conn, s, 1)
    assert again["id"] == ids[2] and again["pool"] == "only"


def test_a_provider_reading_wins_over_the_estimate_and_says_how_far_off_it_was(conn: psycopg.Connection) -> None:
    two_pools(conn, budget=10000)
    for _ in range(3):
        enqueue(conn, "a")
    s = open_session(conn, "a")
    finish(conn, s)  # 1000 of 10000: the estimate says 0.1
    assert float(window(conn)["utilization"]) == 0.1
    # the next run's stream carried Claude Code's reading: 0.8 full (other use of the same account)
    reading = [{"provider": "anthropic", "window": "five_hour", "status": "allowed_warning", "utilization": 0.8,
                "resets_at": "2099-01-01T00:00:00Z", "window_minutes": 300}]
    finish(conn, s, windows=reading)
    w = window(conn)
    assert w["source"] == "provider" and w["provider_status"] == "allowed_warning"
    assert float(w["provider_utilization"]) == 0.8
    assert float(w["estimate_off_by"]) == 0.6  # the runs said 0.2 when the provider said 0.8
    assert str(w["resets_at"].year) == "2099"
    # the provider's 0.8 (8000) plus what ran since: the next claim of 1000 no longer fits 10000 * 0.9?
    one(conn, "select fleet.sync_pool('first', 10, %s, 0.15::numeric)", (Jsonb({"five_hour": {
        "seconds": 18000, "budget_tokens": 10000}}),))
    (t,) = claim(conn, s, 1)
    assert t["pool"] == "second"  # 8000 + 1000 expected > 8500 (the budget less the reserve)


def test_sync_pool_refuses_a_window_without_a_length_or_a_budget(conn: psycopg.Connection) -> None:
    with refused("LF005") as e:
        one(conn, "select fleet.sync_pool('x', 1, %s)", (Jsonb({"w": {"seconds": 60}}),))
    assert "needs seconds (> 0) and a budget_tokens or budget_usd" in str(e.value)
    with refused("LF005"):
        one(conn, "select fleet.sync_pool('x', 1, null, 1.5::numeric)")
    assert one(conn, "select count(*) from fleet.pools where name = 'x'") == 0


def test_window_outcomes_count_throttles_avoided_hit_spills_and_window_hand_offs(conn: psycopg.Connection) -> None:
    two_pools(conn, budget=2500)
    for _ in range(5):
        enqueue(conn, "a")
    s = open_session(conn, "a")
    assert [finish(conn, s)["pool"] for _ in range(3)] == ["first", "first", "second"]  # the 3rd passed first over
    (t,) = claim(conn, s, 1)
    assert t["pool"] == "second"
    one(conn, "select fleet.hand_off(%s, %s, %s)", (t["id"], t["lease_token"], Jsonb({"reason": "window-closing"})))
    (t,) = claim(conn, s, 1)
    one(conn, "select fleet.throttle(%s, %s, now() + interval '1 hour', 'usage limit')", (t["id"], t["lease_token"]))
    got = {r["pool"]: r for r in rows(conn, "select * from fleet.window_outcomes(now() - interval '1 hour', now() + interval '1 second')")}
    assert (got["first"]["throttles_avoided"], got["first"]["throttles_hit"]) == (3, 0)  # claims 3, 4 and 5
    assert (got["second"]["spill_overs"], got["second"]["window_handoffs"], got["second"]["throttles_hit"]) == (3, 1, 1)
