"""The dashboards group (migrations/sources/14_dashboards.sql): the operator's views in SQL —
lane_overview, stuck_tasks, session_overview, recent_repairs, dead_letters, throughput_hourly,
usage_by_lane_day — against a real PostgreSQL. Each view gets a history built with the real SQL API,
with timestamps moved by UPDATE where a figure depends on them, and its exact figures are asserted.
The hourly views are checked twice: computed live, and from the rolled-up hours (13_rollups.sql),
which must agree. Last, every view and column is documented, and a plan test at a moderate scale
asserts that the time windows are read through indexes — by the views themselves and by the named
queries the dashboards send (monitor/dashboards/queries.sql, read with the dashboards' own loader).
(The pool, review, blocked and attention views through real shifts: tests/test_dispatch.py,
tests/test_guardrails.py; here, that the pool views count transient provider errors apart.)
"""

from __future__ import annotations

import importlib.util
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from sqlkit import (
    build_throughput_history,
    cancel,
    checkpoint,
    close_session,
    complete,
    enqueue,
    expire,
    explain,
    fail,
    hand_off,
    one,
    open_session,
    pick,
    record_run,
    release,
    retry,
    roll_up,
    route,
    rows,
    set_run,
    sync_lane,
    take,
    throttle,
    transient,
    utc_hour,
    view,
)

from monitor.dashboards.reads import queries
from worker.agent.adapters import ADAPTERS
from worker.agent.prices import run_report
from worker.models import TASK_STATES

ROOT = Path(__file__).resolve().parents[2]


VIEWS = ["lane_overview", "stuck_tasks", "session_overview", "recent_repairs", "dead_letters",
         "throughput_hourly", "usage_by_lane_day", "pool_overview", "pool_accept_rate", "blocked_tasks",
         "review_queue", "review_accept_rate", "attention_tasks", "workspace_usage"]


def by(rows_: list[dict[str, Any]], key: str) -> dict[Any, dict[str, Any]]:
    out = {r[key]: r for r in rows_}
    assert len(out) == len(rows_), f"{key} repeats in {rows_}"
    return out


def forget_roll_up(conn: psycopg.Connection) -> None:
    conn.execute("delete from fleet.lane_hours; delete from fleet.lane_hours_rollup")


# ------------------------------------------------------------------------------------------------
# lane_overview


def test_lane_overview_counts_live_work_and_the_last_24_hours(conn: psycopg.Connection) -> None:
    sync_lane(conn, "a", max_running=3, max_attempts=2, max_handoffs=1, backoff_base_seconds=3600)
    sync_lane(conn, "b")
    sync_lane(conn, "c", paused=True, max_running=0)
    s1 = open_session(conn, "a", host="h1", pid=101)

    x1 = enqueue(conn, "a", "x1")
    complete(conn, x1, take(conn, s1, x1)["lease_token"])                  # done
    x2 = enqueue(conn, "a", "x2")
    assert fail(conn, x2, take(conn, s1, x2)["lease_token"]) == "queued"   # retried later (back-off)
    x3 = enqueue(conn, "a", "x3")
    assert fail(conn, x3, take(conn, s1, x3)["lease_token"]) == "queued"
    assert fail(conn, x3, take(conn, s1, x3)["lease_token"]) == "dead"     # attempt cap
    x4 = enqueue(conn, "a", "x4")
    assert hand_off(conn, x4, take(conn, s1, x4)["lease_token"], {}) == "queued"
    s2 = open_session(conn, "a", host="h2", pid=102)
    assert hand_off(conn, x4, take(conn, s2, x4)["lease_token"], {}) == "dead"  # hand-off cap
    close_session(conn, s2, "deadline")
    x5 = enqueue(conn, "a", "x5")
    take(conn, s1, x5)
    assert release(conn, x5, "lease-expired") == "queued"                  # repaired
    take(conn, s1, x5)
    assert release(conn, x5, "lease-expired") == "dead"                    # repaired at the cap
    x6 = enqueue(conn, "a", "x6")
    assert cancel(conn, x6) == "cancelled"
    assert retry(conn, x3) == "queued"                                     # operator retry: ready
    x7 = enqueue(conn, "a", "x7")
    take(conn, s1, x7)                                                     # running
    x8 = enqueue(conn, "a", "x8")
    complete(conn, x8, take(conn, s1, x8)["lease_token"])
    conn.execute("update fleet.events set ts = now() - interval '25 hours' where task_id = %s", (x8,))
    conn.execute("update fleet.runs set started_at = started_at - interval '25 hours',"
                 " ended_at = ended_at - interval '25 hours' where task_id = %s", (x8,))
    enqueue(conn, "a", "x9", run_at=datetime.now(UTC) - timedelta(seconds=300))   # ready, oldest
    enqueue(conn, "a", "x10", run_at=datetime.now(UTC) + timedelta(days=1))       # scheduled

    sb = open_session(conn, "b")
    y1 = enqueue(conn, "b", "y1")
    complete(conn, y1, take(conn, sb, y1)["lease_token"])
    close_session(conn, sb, "deadline")
    enqueue(conn, "b", "y2")
    enqueue(conn, "c", "z1")

    got = by(view(conn, "lane_overview"), "lane")
    assert list(got) == ["a", "b", "c"]
    counts = ["paused", "queued", "ready", "scheduled", "running", "slots", "idle_slots", "done_24h",
              "failed_24h", "dead_24h", "cancelled_24h", "retries_24h", "handoffs_24h", "repairs_24h",
              "operator_retries_24h", "active_sessions"]
    assert pick(got["a"], *counts) == {
        "paused": False, "queued": 4, "ready": 2, "scheduled": 2, "running": 1, "slots": 3, "idle_slots": 2,
        "done_24h": 1, "failed_24h": 3, "dead_24h": 3, "cancelled_24h": 1, "retries_24h": 3,
        "handoffs_24h": 2, "repairs_24h": 2, "operator_retries_24h": 1, "active_sessions": 1}
    assert pick(got["b"], *counts) == {
        "paused": False, "queued": 1, "ready": 1, "scheduled": 0, "running": 0, "slots": None,
        "idle_slots": None, "done_24h": 1, "failed_24h": 0, "dead_24h": 0, "cancelled_24h": 0,
        "retries_24h": 0, "handoffs_24h": 0, "repairs_24h": 0, "operator_retries_24h": 0,
        "active_sessions": 0}
    assert pick(got["c"], *counts) == {
        "paused": True, "queued": 1, "ready": 1, "scheduled": 0, "running": 0, "slots": 0, "idle_slots": 0,
        "done_24h": 0, "failed_24h": 0, "dead_24h": 0, "cancelled_24h": 0, "retries_24h": 0,
        "handoffs_24h": 0, "repairs_24h": 0, "operator_retries_24h": 0, "active_sessions": 0}
    assert 300 <= got["a"]["oldest_ready_seconds"] < 330
    assert got["c"]["oldest_ready_seconds"] < 30
    assert got["a"]["last_handoff_at"] == one(
        conn, "select created_at from fleet.lane_handoffs where session_id = %s", (s2,))
    assert got["b"]["last_handoff_at"] == one(
        conn, "select created_at from fleet.lane_handoffs where session_id = %s", (sb,))
    assert got["c"]["last_handoff_at"] is None


# ------------------------------------------------------------------------------------------------
# stuck_tasks


def test_stuck_tasks_names_each_reason(conn: psycopg.Connection) -> None:
    # a task's lease follows its session (its last heartbeat plus the lease, 60 s); the session may
    # be declared lost after 90 s of silence: between the two, a lease has run out while its
    # session is not silent yet. The tasks whose lease runs out are held by sessions of their own.
    sync_lane(conn, "s", lease_seconds=60, session_timeout_seconds=90, max_attempts=5, backoff_base_seconds=0,
              config={"stall_seconds": 600})
    sa = open_session(conn, "s", host="ha", pid=11)
    # ten stages completed an hour ago, lasting 100 s .. 1000 s: p95 = 900 + 0.55 * 100 = 955
    for i in range(1, 11):
        t = enqueue(conn, "s", f"hist-{i}")
        token = take(conn, sa, t)["lease_token"]
        complete(conn, t, token)
        set_run(conn, token, started=f"now() - interval '1 hour' - interval '{i * 100} seconds'",
                ended="now() - interval '1 hour'")

    healthy = enqueue(conn, "s", "healthy")
    take(conn, sa, healthy)
    se = open_session(conn, "s", host="he", pid=44)
    expired = enqueue(conn, "s", "expired")
    take(conn, se, expired)
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '65 seconds' where id = %s", (se,))
    sx = open_session(conn, "s", host="hx", pid=55)
    expiring = enqueue(conn, "s", "expiring")
    take(conn, sx, expiring)
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '50 seconds' where id = %s", (sx,))
    # (the claims' own lease_expires_at, never renewed, are not what the view reads)
    conn.execute("update fleet.tasks set lease_expires_at = now() - interval '1 hour' where id = %s", (healthy,))
    long_run = enqueue(conn, "s", "long-run")
    token = take(conn, sa, long_run)["lease_token"]
    set_run(conn, token, started="now() - interval '1000 seconds'")
    checkpoint(conn, long_run, token, {"step": 3})                  # progress now: not stalled
    stalled = enqueue(conn, "s", "stalled")
    token = take(conn, sa, stalled)["lease_token"]
    set_run(conn, token, started="now() - interval '700 seconds'")  # under the p95, no progress
    # (its progress clock started at the claim, "700 s ago")
    conn.execute("update fleet.tasks set last_progress_at = now() - interval '700 seconds' where id = %s",
                 (stalled,))
    retried = enqueue(conn, "s", "retried")
    first = take(conn, sa, retried)["lease_token"]
    assert fail(conn, retried, first) == "queued"
    set_run(conn, first, started="now() - interval '2000 seconds'", ended="now() - interval '1900 seconds'")
    second = take(conn, sa, retried)
    assert second["attempts"] == 2                                  # the stage began 2000 s ago

    ss = open_session(conn, "s", host="hs", pid=22)
    silent = enqueue(conn, "s", "silent")
    take(conn, ss, silent)
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '120 seconds' where id = %s", (ss,))
    sl = open_session(conn, "s", host="hl", pid=33)
    orphan = enqueue(conn, "s", "orphan")
    take(conn, sl, orphan)
    conn.execute("update fleet.sessions set state = 'lost', ended_at = now(), end_reason = 'pid-gone'"
                 " where id = %s", (sl,))

    got = by(view(conn, "stuck_tasks"), "key")
    assert {k: v["reasons"] for k, v in got.items()} == {
        "expired": ["lease-expired"],
        "expiring": ["lease-expiring"],
        "long-run": ["over-p95"],
        "stalled": ["stalled"],
        "retried": ["over-p95"],
        "silent": ["lease-expired", "session-silent"],  # silent past its timeout: past its lease too
        "orphan": ["session-lost"],
    }
    assert healthy not in {v["task_id"] for v in got.values()}
    assert all(v["lane_p95_seconds"] == Decimal("955.0") for v in got.values())
    assert 2000 <= got["retried"]["running_seconds"] < 2030
    assert got["retried"]["attempt"] == 2
    assert 1000 <= got["long-run"]["running_seconds"] < 1030
    assert 700 <= got["stalled"]["running_seconds"] < 730
    assert -6 < got["expired"]["lease_remaining_seconds"] <= -5
    assert 9 <= got["expiring"]["lease_remaining_seconds"] <= 10
    # the lease shown is the effective one: the session's last heartbeat plus the lane's lease
    for key, session in (("expired", se), ("expiring", sx), ("silent", ss)):
        assert got[key]["lease_expires_at"] == one(
            conn, "select heartbeat_at + interval '60 seconds' from fleet.sessions where id = %s", (session,))
    assert pick(got["expired"], "host", "pid", "session_state") == {"host": "he", "pid": 44, "session_state": "active"}
    assert 65 <= got["expired"]["heartbeat_age_seconds"] < 90
    assert pick(got["orphan"], "host", "pid", "session_state") == {"host": "hl", "pid": 33, "session_state": "lost"}
    assert pick(got["silent"], "host", "pid", "session_state") == {"host": "hs", "pid": 22, "session_state": "active"}
    assert 120 <= got["silent"]["heartbeat_age_seconds"] < 150
    # oldest stage first
    assert [r["key"] for r in view(conn, "stuck_tasks")][:3] == ["retried", "long-run", "stalled"]


def test_stuck_tasks_needs_ten_completions_for_a_p95(conn: psycopg.Connection) -> None:
    sync_lane(conn, "s", lease_seconds=60)
    sa = open_session(conn, "s")
    for i in range(9):
        t = enqueue(conn, "s", f"hist-{i}")
        token = take(conn, sa, t)["lease_token"]
        complete(conn, t, token)
        set_run(conn, token, started="now() - interval '2 hours'", ended="now() - interval '2 hours' + interval '10 seconds'")
    t = enqueue(conn, "s", "long")
    set_run(conn, take(conn, sa, t)["lease_token"], started="now() - interval '1 hour'")
    assert view(conn, "stuck_tasks") == []   # 9 completions: no p95 to judge by


# ------------------------------------------------------------------------------------------------
# session_overview


def test_session_overview_lists_active_and_recent_shifts(conn: psycopg.Connection) -> None:
    sync_lane(conn, "a", lease_seconds=60, backoff_base_seconds=0)
    s1 = open_session(conn, "a", host="h1", pid=101)
    for key, tokens, cost in (("t1", 100, "0.1"), ("t2", 200, "0.2")):
        t = enqueue(conn, "a", key)
        token = take(conn, s1, t)["lease_token"]
        record_run(conn, token, {"input_tokens": tokens, "output_tokens": tokens // 10, "cost_usd": cost})
        complete(conn, t, token)
    t3 = enqueue(conn, "a", "t3")
    fail(conn, t3, take(conn, s1, t3)["lease_token"])
    t4 = enqueue(conn, "a", "t4")
    take(conn, s1, t4)
    conn.execute("update fleet.sessions set started_at = now() - interval '100 seconds',"
                 " heartbeat_at = now() - interval '5 seconds' where id = %s", (s1,))

    s2 = open_session(conn, "a", host="h2", pid=102)
    t5 = enqueue(conn, "a", "t5")
    hand_off(conn, t5, take(conn, s2, t5)["lease_token"], {})
    close_session(conn, s2, "deadline")
    conn.execute("update fleet.sessions set started_at = now() - interval '2 hours',"
                 " ended_at = now() - interval '1 hour' where id = %s", (s2,))
    s3 = open_session(conn, "a", host="h3", pid=103)
    t6 = enqueue(conn, "a", "t6")
    take(conn, s3, t6)
    rows(conn, "select * from fleet.declare_session_lost(%s, 'pid-gone')", (s3,))
    s4 = open_session(conn, "a", host="h4", pid=104)
    close_session(conn, s4, "deadline")
    conn.execute("update fleet.sessions set started_at = now() - interval '30 hours',"
                 " ended_at = now() - interval '29 hours' where id = %s", (s4,))
    s5 = open_session(conn, "a", host="h5", pid=105, seconds=200_000)
    conn.execute("update fleet.sessions set started_at = now() - interval '30 hours' where id = %s", (s5,))

    got = view(conn, "session_overview")
    assert [r["session_id"] for r in got] == [s1, s5, s3, s2]   # active first, then newest first
    keys = ["lane", "host", "pid", "state", "tasks_held", "runs", "done", "failed", "handed_off", "lost",
            "tokens", "cost_usd", "end_reason"]
    got_by = by(got, "session_id")
    assert pick(got_by[s1], *keys) == {
        "lane": "a", "host": "h1", "pid": 101, "state": "active", "tasks_held": 1, "runs": 4, "done": 2,
        "failed": 1, "handed_off": 0, "lost": 0, "tokens": 330, "cost_usd": Decimal("0.3"), "end_reason": None}
    assert pick(got_by[s2], *keys) == {
        "lane": "a", "host": "h2", "pid": 102, "state": "ended", "tasks_held": 0, "runs": 1, "done": 0,
        "failed": 0, "handed_off": 1, "lost": 0, "tokens": 0, "cost_usd": Decimal("0"), "end_reason": "deadline"}
    assert pick(got_by[s3], *keys) == {
        "lane": "a", "host": "h3", "pid": 103, "state": "lost", "tasks_held": 0, "runs": 1, "done": 0,
        "failed": 0, "handed_off": 0, "lost": 1, "tokens": 0, "cost_usd": Decimal("0"), "end_reason": "pid-gone"}
    assert pick(got_by[s5], "state", "tasks_held", "runs") == {"state": "active", "tasks_held": 0, "runs": 0}
    assert got_by[s2]["age_seconds"] == Decimal("3600.0")
    assert 100 <= got_by[s1]["age_seconds"] < 130
    assert 5 <= got_by[s1]["heartbeat_age_seconds"] < 30
    assert 590 - 130 < got_by[s1]["deadline_in_seconds"] <= 600


# ------------------------------------------------------------------------------------------------
# recent_repairs


def test_recent_repairs_newest_first_with_reason_and_outcome(conn: psycopg.Connection) -> None:
    sync_lane(conn, "r", lease_seconds=3, session_timeout_seconds=3600, max_attempts=3, backoff_base_seconds=0)
    sr = open_session(conn, "r", host="hr", pid=7)
    r1 = enqueue(conn, "r", "r1")
    take(conn, sr, r1)
    expire(conn, r1)  # sr silent for its 3 s lease and a second, not for its hour of session timeout
    acted = rows(conn, "select * from fleet.reconcile(300, 60)")
    assert [(a["action"], a["task_id"]) for a in acted] == [("released", r1)]

    sl = open_session(conn, "r", host="hx", pid=777)
    r2 = enqueue(conn, "r", "r2")
    take(conn, sl, r2)
    rows(conn, "select * from fleet.declare_session_lost(%s, 'pid-gone')", (sl,))

    sc = open_session(conn, "r", host="hc", pid=8)
    r3 = enqueue(conn, "r", "r3", max_attempts=1)
    take(conn, sc, r3)
    close_session(conn, sc, "signal")                  # releases r3, at its cap: dead

    r4 = enqueue(conn, "r", "r4")
    take(conn, sr, r4)
    release(conn, r4, "lease-expired")
    conn.execute("update fleet.events set ts = now() - interval '8 days' where task_id = %s and kind = 'repaired'",
                 (r4,))

    got = view(conn, "recent_repairs")
    keys = ["task_id", "key", "lane", "reason", "state", "attempt", "evaporations", "host", "pid"]
    assert [pick(r, *keys) for r in got] == [
        {"task_id": r3, "key": "r3", "lane": "r", "reason": "session-closed", "state": "dead", "attempt": 1,
         "evaporations": 1, "host": "hc", "pid": 8},
        {"task_id": r2, "key": "r2", "lane": "r", "reason": "pid-gone", "state": "queued", "attempt": 1,
         "evaporations": 1, "host": "hx", "pid": 777},
        {"task_id": r1, "key": "r1", "lane": "r", "reason": "lease-expired", "state": "queued", "attempt": 1,
         "evaporations": 1, "host": "hr", "pid": 7},
    ]
    assert [r["session_id"] for r in got] == [sc, sl, sr]


@pytest.mark.parametrize("path", ["lease-expired", "heartbeat-timeout"])
def test_recent_repairs_say_when_the_repaired_lease_ran_out(conn: psycopg.Connection, path: str) -> None:
    # claimed ten minutes ago, its session heartbeating since, then silent: the lease ran out a
    # lease after the last heartbeat, not a lease after the claim
    timeout = 3600 if path == "lease-expired" else None
    sync_lane(conn, "r", lease_seconds=3, session_timeout_seconds=timeout)
    s = open_session(conn, "r", host="hr", pid=7)
    r1 = enqueue(conn, "r", "r1")
    take(conn, s, r1)
    conn.execute("update fleet.tasks set lease_expires_at = now() - interval '10 minutes' + interval '3 seconds'"
                 " where id = %s", (r1,))
    expire(conn, r1, ago="5 seconds")
    due = one(conn, "select fleet._lease_until(s.heartbeat_at, l.lease_seconds, l.session_timeout_seconds)"
                    " from fleet.sessions s join fleet.lanes l on l.name = s.lane where s.id = %s", (s,))
    acted = rows(conn, "select * from fleet.reconcile(300, 60)")
    assert [(a["action"], a["detail"]["reason"]) for a in acted if a["action"] == "released"] == [("released", path)]
    (got,) = view(conn, "recent_repairs")
    assert got["lease_expired_at"] == due


# ------------------------------------------------------------------------------------------------
# dead_letters


def test_dead_letters_say_why_with_the_last_error(conn: psycopg.Connection) -> None:
    sync_lane(conn, "d", max_attempts=3, max_handoffs=0, backoff_base_seconds=0)
    s = open_session(conn, "d")
    d1 = enqueue(conn, "d", "d1", title="fatal one")
    token = take(conn, s, d1)["lease_token"]
    record_run(conn, token, {"exit_code": 2})
    assert fail(conn, d1, token, "syntax error in main.py", retryable=False) == "dead"
    d2 = enqueue(conn, "d", "d2", max_attempts=1)
    take(conn, s, d2)
    assert release(conn, d2, "lease-expired") == "dead"
    d3 = enqueue(conn, "d", "d3")
    assert hand_off(conn, d3, take(conn, s, d3)["lease_token"], {}) == "dead"
    d4 = enqueue(conn, "d", "d4")
    fail(conn, d4, take(conn, s, d4)["lease_token"], "old", retryable=False)
    d5 = enqueue(conn, "d", "d5")
    fail(conn, d5, take(conn, s, d5)["lease_token"], "retried since", retryable=False)
    retry(conn, d5)
    for task_id, ago in ((d1, "3 hours"), (d2, "2 hours"), (d3, "1 hour"), (d4, "31 days")):
        conn.execute(f"update fleet.tasks set finished_at = now() - interval '{ago}' where id = %s", (task_id,))

    got = view(conn, "dead_letters")
    keys = ["task_id", "key", "title", "dead_reason", "last_error", "attempts", "failures", "evaporations",
            "handoffs", "last_run_outcome", "last_exit_code"]
    assert [pick(r, *keys) for r in got] == [
        {"task_id": d3, "key": "d3", "title": None, "dead_reason": "handoff-cap", "last_error": None,
         "attempts": 1, "failures": 0, "evaporations": 0, "handoffs": 1, "last_run_outcome": "handed_off",
         "last_exit_code": None},
        {"task_id": d2, "key": "d2", "title": None, "dead_reason": "attempt-cap",
         "last_error": "released: lease-expired", "attempts": 1, "failures": 0, "evaporations": 1,
         "handoffs": 0, "last_run_outcome": "lost", "last_exit_code": None},
        {"task_id": d1, "key": "d1", "title": "fatal one", "dead_reason": "fatal",
         "last_error": "syntax error in main.py", "attempts": 1, "failures": 1, "evaporations": 0,
         "handoffs": 0, "last_run_outcome": "failed", "last_exit_code": 2},
    ]


# ------------------------------------------------------------------------------------------------
# throughput_hourly (the history: sqlkit.build_throughput_history)


EMPTY = {"enqueued": 0, "routed_in": 0, "started": 0, "done": 0, "routed": 0, "failed": 0, "handed_off": 0,
         "lost": 0, "cancelled": 0, "wall_p50_seconds": None, "wall_p95_seconds": None}


def expected_throughput(h: datetime, h1: datetime) -> dict[tuple[str, datetime], dict[str, Any]]:
    return {
        ("a", h): EMPTY | {"enqueued": 5, "started": 7, "done": 2, "routed": 1, "failed": 1, "handed_off": 1,
                           "lost": 1, "wall_p50_seconds": Decimal("600.0"), "wall_p95_seconds": Decimal("1950.0")},
        ("a", h1): EMPTY | {"enqueued": 2, "started": 2, "done": 1, "cancelled": 1, "wall_p50_seconds": Decimal("4140.0"),
                            "wall_p95_seconds": Decimal("4140.0")},
        ("b", h): EMPTY | {"routed_in": 1},
        ("b", h1): EMPTY | {"started": 1, "done": 1, "wall_p50_seconds": Decimal("1800.0"),
                            "wall_p95_seconds": Decimal("1800.0")},
    }


def test_throughput_hourly_counts_arrivals_claims_outcomes_and_wall_clock(conn: psycopg.Connection) -> None:
    hours = build_throughput_history(conn)
    want = expected_throughput(hours["h"], hours["h1"])

    def got() -> dict[tuple[str, datetime], dict[str, Any]]:
        out = {}
        for r in view(conn, "throughput_hourly"):
            key = (r.pop("lane"), r.pop("hour"))
            out[key] = r
        return out

    assert got() == want                                 # computed live
    assert [(r["lane"], r["hour"]) for r in view(conn, "throughput_hourly")] == sorted(
        want, key=lambda k: (-k[1].timestamp(), k[0]))  # newest hour first
    assert roll_up(conn) == 4
    assert one(conn, "select rolled_until from fleet.lane_hours_rollup") == utc_hour(conn, 0)
    assert one(conn, "select count(*) from fleet.lane_hours") == 4
    assert got() == want                                 # read from the roll-up
    assert roll_up(conn) == 0                            # no hour closed since


# ------------------------------------------------------------------------------------------------
# usage_by_lane_day


STREAM = [
    {"type": "system", "subtype": "init", "session_id": "agent-1"},
    {"type": "result", "subtype": "success", "is_error": False, "session_id": "agent-1",
     "total_cost_usd": 0.75,
     # the top-level usage leaves the sub-agents out: it must not be what is counted
     "usage": {"input_tokens": 10, "cache_creation_input_tokens": 20, "cache_read_input_tokens": 30,
               "output_tokens": 5},
     "modelUsage": {
         "claude-sonnet-4-5": {"inputTokens": 1000, "cacheCreationInputTokens": 2000,
                               "cacheReadInputTokens": 6000, "outputTokens": 500},
         "claude-haiku-4-5": {"inputTokens": 200, "cacheCreationInputTokens": 0,
                              "cacheReadInputTokens": 800, "outputTokens": 100}}},
]


def test_usage_by_lane_day_sums_model_usage_per_utc_day(conn: psycopg.Connection) -> None:
    sync_lane(conn, "a", backoff_base_seconds=0)
    sync_lane(conn, "b")
    s = open_session(conn, "a")
    today = one(conn, "select date_trunc('day', now(), 'UTC')")
    yesterday = today - timedelta(days=1)

    def ended(token: Any, when: datetime) -> None:
        set_run(conn, token, f"'{(when - timedelta(minutes=5)).isoformat()}'::timestamptz",
                f"'{when.isoformat()}'::timestamptz")

    result = ADAPTERS["generic"].reader().feed("\n".join(json.dumps(r) for r in STREAM))
    report = run_report(result, result.tokens, None, {})
    assert (report["input_tokens"], report["cache_read_tokens"]) == (1200, 6800)   # not 10 and 30
    u1 = enqueue(conn, "a", "u1")
    tok = take(conn, s, u1)["lease_token"]
    record_run(conn, tok, report)
    complete(conn, u1, tok)
    ended(tok, today)
    u2 = enqueue(conn, "a", "u2")
    tok = take(conn, s, u2)["lease_token"]
    record_run(conn, tok, {"input_tokens": 100, "output_tokens": 50, "cost_usd": 0.05})
    fail(conn, u2, tok)
    ended(tok, today)
    u3 = enqueue(conn, "a", "u3")        # routed on: its stage is complete
    tok = take(conn, s, u3)["lease_token"]
    record_run(conn, tok, {"input_tokens": 300, "cache_read_tokens": 700, "output_tokens": 100, "cost_usd": 0.2})
    route(conn, u3, tok, "b")
    ended(tok, today + timedelta(minutes=1))
    u4 = enqueue(conn, "a", "u4")
    tok = take(conn, s, u4)["lease_token"]
    record_run(conn, tok, {"input_tokens": 50, "cache_creation_tokens": 50, "output_tokens": 10, "cost_usd": 0.01})
    complete(conn, u4, tok)
    ended(tok, yesterday + timedelta(hours=1))
    u5 = enqueue(conn, "a", "u5")        # still running: not counted yet
    record_run(conn, take(conn, s, u5)["lease_token"], {"input_tokens": 999999, "cost_usd": 9})
    u6 = enqueue(conn, "a", "u6")        # 31 days ago: out of the window
    tok = take(conn, s, u6)["lease_token"]
    record_run(conn, tok, {"input_tokens": 888888, "cost_usd": 8})
    complete(conn, u6, tok)
    ended(tok, today - timedelta(days=31))

    want = {
        ("a", today.date()): {
            "runs": 3, "completed": 2, "input_tokens": 1600, "cache_creation_tokens": 2000,
            "cache_read_tokens": 7500, "output_tokens": 750, "total_tokens": 11850,
            "cache_read_share": Decimal("0.6757"), "cost_usd": Decimal("1.000000"),
            "cost_per_completed": Decimal("0.500000"), "tokens_per_completed": Decimal("5925.0")},
        ("a", yesterday.date()): {
            "runs": 1, "completed": 1, "input_tokens": 50, "cache_creation_tokens": 50,
            "cache_read_tokens": 0, "output_tokens": 10, "total_tokens": 110,
            "cache_read_share": Decimal("0.0000"), "cost_usd": Decimal("0.010000"),
            "cost_per_completed": Decimal("0.010000"), "tokens_per_completed": Decimal("110.0")},
    }

    def got() -> dict[tuple[str, Any], dict[str, Any]]:
        return {(r.pop("lane"), r.pop("day")): r for r in view(conn, "usage_by_lane_day")}

    assert got() == want
    assert [r["day"] for r in view(conn, "usage_by_lane_day")] == [today.date(), yesterday.date()]
    roll_up(conn)
    assert got() == want
    # the session's time zone does not move the days
    conn.execute("set time zone 'Pacific/Kiritimati'")
    assert got() == want
    forget_roll_up(conn)
    assert got() == want


# ------------------------------------------------------------------------------------------------
# pool_overview and pool_accept_rate: failures, throttles and transient errors apart


def test_pool_views_count_failures_throttles_and_transient_errors_apart(conn: psycopg.Connection) -> None:
    one(conn, "select fleet.sync_pool('pool', null)")
    one(conn, "select fleet.sync_profile('prof', 'pool', '{}')")
    sync_lane(conn, "a", max_attempts=5, config={"profile": "prof", "max_transient": 1})
    s = open_session(conn, "a")
    done, failed, throttled, flaky = (enqueue(conn, "a") for _ in range(4))
    complete(conn, done, take(conn, s, done)["lease_token"])
    fail(conn, failed, take(conn, s, failed)["lease_token"])
    throttle(conn, throttled, take(conn, s, throttled)["lease_token"], after_seconds=0)
    conn.execute("update fleet.pools set throttled_until = null")
    assert transient(conn, flaky, take(conn, s, flaky)["lease_token"]) == "queued"
    # past max_transient: a failure, counted as one (and not as a transient error)
    assert transient(conn, flaky, take(conn, s, flaky)["lease_token"]) == "queued"

    [pool] = view(conn, "pool_overview")
    assert pick(pool, "throttles_today", "transients_today") == {"throttles_today": 1, "transients_today": 1}
    [rate] = view(conn, "pool_accept_rate")
    assert pick(rate, "runs", "done", "failed", "blocked", "throttled", "transient", "accept_rate") == {
        "runs": 5, "done": 1, "failed": 2, "blocked": 0, "throttled": 1, "transient": 1,
        "accept_rate": Decimal("0.333")}


# ------------------------------------------------------------------------------------------------
# documentation


def test_every_view_and_column_is_documented(conn: psycopg.Connection) -> None:
    for name in VIEWS:
        assert one(conn, "select obj_description(%s::regclass, 'pg_class')", (f"fleet.{name}",)), name
        undocumented = [r["attname"] for r in rows(
            conn, "select a.attname, col_description(a.attrelid, a.attnum) as doc from pg_attribute a"
                  " where a.attrelid = %s::regclass and a.attnum > 0 and not a.attisdropped",
            (f"fleet.{name}",)) if not r["doc"]]
        assert undocumented == [], f"{name}: {undocumented}"
    for fn in ("fleet.cohort_metrics(timestamptz, timestamptz, text)", "fleet.roll_up_lane_hours(int)",
               "fleet.lane_hours_between(timestamptz, timestamptz)", "fleet.lane_hours_since(timestamptz)"):
        assert one(conn, "select obj_description(%s::regprocedure, 'pg_proc')", (fn,)), fn
    # security invoker: the caller's grants and the tables' row-level security apply when a key
    # reads them (02_security.sql); no other option (security_barrier, check_option). batch_overview
    # (11_batches.sql) still reads as its owner and filters by the key's lanes itself.
    options = {r["relname"]: r["reloptions"] for r in rows(
        conn, "select relname, reloptions from pg_class where relnamespace = 'fleet'::regnamespace and relkind = 'v'")}
    assert {v: o for v, o in options.items() if o != ["security_invoker=true"]} == {"batch_overview": None}


# ------------------------------------------------------------------------------------------------
# plans at a moderate scale


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("views_scale", ROOT / "bench" / "views_scale.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the tables that grow with history (fleet.lane_hours holds at most 400 days of lane-hours)
BIG = {"tasks", "runs", "events", "sessions", "lane_handoffs"}


PLANS = {
    # query: indexes its time window (or live rows) must be read through
    "select * from fleet.lane_overview": {"tasks_ready", "tasks_live_lane",
                                          "events_kind_ts|events_ts", "sessions_active_lane|sessions_active_host"},
    "select * from fleet.stuck_tasks": {"tasks_running_session|tasks_live_lane"},
    "select * from fleet.session_overview": {"sessions_started", "runs_session"},
    "select * from fleet.recent_repairs": {"events_kind_ts"},
    "select * from fleet.dead_letters": {"tasks_dead"},
    "select * from fleet.throughput_hourly": {"runs_lane_started", "runs_long_ended", "tasks_created", "events_kind_ts"},
    "select * from fleet.usage_by_lane_day": {"runs_lane_started", "runs_long_ended"},
    "select * from fleet.cohort_metrics(now() - interval '7 days', now())": {"tasks_created", "runs_lane_started"},
    "select * from fleet.cohort_metrics(now() - interval '200 days', now() - interval '193 days')":
        {"tasks_created", "runs_task"},
}



def named_plans(now: datetime) -> list[tuple[str, dict[str, Any], set[str]]]:
    """The dashboards' named queries of the views above (monitor/dashboards/queries.sql, loaded as the
    dashboards load them), with the parameters `fleet status`, `stats` and `snapshot` give them, and
    the indexes their view's plan must read. (Every window the dashboards give ends now.)"""
    week = {"since": now - timedelta(days=7), "from": now - timedelta(days=7), "to": now}
    return [
        ("lane_overview", {}, PLANS["select * from fleet.lane_overview"]),
        ("stuck_tasks", {}, PLANS["select * from fleet.stuck_tasks"]),
        ("sessions", {}, PLANS["select * from fleet.session_overview"]),
        ("recent_repairs", {"limit": 1000}, PLANS["select * from fleet.recent_repairs"]),
        ("dead_letters", {"limit": 1000}, PLANS["select * from fleet.dead_letters"]),
        ("throughput_since", week, PLANS["select * from fleet.throughput_hourly"]),
        ("usage_since", week, PLANS["select * from fleet.usage_by_lane_day"]),
        ("cohort", week, PLANS["select * from fleet.cohort_metrics(now() - interval '7 days', now())"]),
    ]


@pytest.fixture
def moderate(conn: psycopg.Connection) -> psycopg.Connection:
    """5,000 tasks and about 50,000 events over a year (the bench's generator, scaled down)."""
    bench = _bench()
    t_end = bench.build_live(conn, 5000, slot=6 * 3600)
    bench.build_history(conn, 5000, 50_000, 365, t_end, slot=6 * 3600, say=lambda _: None)
    assert 45_000 <= one(conn, "select count(*) from fleet.events") <= 55_000
    return conn


def test_views_read_their_windows_through_indexes(moderate: psycopg.Connection) -> None:
    conn = moderate

    named = [(f"{name} (monitor/dashboards/queries.sql)", queries()[name], {"lane": None} | params, wanted)
             for name, params, wanted in named_plans(one(conn, "select now()"))]

    def check(stage: str) -> None:
        for query, sql_text, params, wanted in [(q, q, None, w) for q, w in PLANS.items()] + named:
            nodes = explain(conn, sql_text, params)
            seq = sorted({n["Relation Name"] for n in nodes if n["Node Type"] == "Seq Scan"} & BIG)
            assert seq == [], f"{stage}: {query} scans {seq} sequentially"
            used = {n["Index Name"] for n in nodes if "Index Name" in n}
            for alternatives in wanted:
                assert used & set(alternatives.split("|")), f"{stage}: {query} uses {sorted(used)}, not {alternatives}"

    check("live")                        # nothing rolled up: the whole 30 days computed live
    assert roll_up(conn) > 0
    check("rolled up")


def test_lane_summary_counts_every_state(conn: psycopg.Connection) -> None:
    conn.execute("select fleet.sync_lane('s', '{}'::jsonb)")
    for i in range(len(TASK_STATES)):
        conn.execute("select fleet.enqueue('s', %s)", (f"k{i}",))
    # put one task in each state (as the functions would leave it; the CHECKs hold)
    for i, state in enumerate(TASK_STATES):
        conn.execute(
            """update fleet.tasks set state = %(s)s::text,
                      block_reason = case when %(s)s::text = 'blocked' then 'test' end,
                      finished_at = case when %(s)s::text in ('done', 'dead', 'cancelled') then now() end,
                      lease_token = case when %(s)s::text = 'running' then gen_random_uuid() end,
                      lease_expires_at = case when %(s)s = 'running' then now() + interval '1 minute' end,
                      session_id = case when %(s)s = 'running'
                                        then fleet.open_session('s', 'h', 1, now(), 60) end
                where key = %(k)s""",
            {"s": state, "k": f"k{i}"},
        )
    cur = conn.execute("select * from fleet.lane_summary() where lane = 's'")
    assert cur.description is not None
    row = dict(zip([d.name for d in cur.description], cur.fetchone() or (), strict=True))
    assert {s: row[s] for s in TASK_STATES} == dict.fromkeys(TASK_STATES, 1)


def test_lane_summary_of_a_key_prefix_counts_those_tasks_and_their_runs_alone(conn: psycopg.Connection) -> None:
    # `fleet up --demo`'s own run: an earlier demo's tasks and runs in the same lanes are not counted
    sync_lane(conn, "s")
    sync_lane(conn, "r", accepts_from=["s"])
    sync_lane(conn, "idle")
    sess = open_session(conn, "s")
    usage = {"input_tokens": 100, "cache_creation_tokens": 10, "cache_read_tokens": 1000, "output_tokens": 5,
             "cost_usd": 0.25}
    for key in ("old:1", "new:1", "new:2"):
        task_id = enqueue(conn, "s", key)
        tok = take(conn, sess, task_id)["lease_token"]
        record_run(conn, tok, usage)
        if key == "new:2":  # its run stays with lane s; the task goes on in r
            route(conn, task_id, tok, "r")
        else:
            complete(conn, task_id, tok)
    failing = enqueue(conn, "s", "new:3")
    fail(conn, failing, take(conn, sess, failing)["lease_token"], "boom", retryable=False)

    def summary(*args: Any) -> dict[str, dict[str, Any]]:
        got = rows(conn, "select * from fleet.lane_summary(" + ", ".join(["%s"] * len(args)) + ")", args)
        return {r["lane"]: {k: r[k] for k in ("queued", "done", "dead", "retries", "tokens", "cost_usd")} for r in got}

    per_run = 100 + 10 + 1000 + 5
    assert summary("new:") == {
        "s": {"queued": 0, "done": 1, "dead": 1, "retries": 1, "tokens": 2 * per_run, "cost_usd": Decimal("0.5")},
        "r": {"queued": 1, "done": 0, "dead": 0, "retries": 0, "tokens": 0, "cost_usd": 0}}
    # without a prefix (and with NULL): every lane, every task and run, as before
    everything = {"idle": {"queued": 0, "done": 0, "dead": 0, "retries": 0, "tokens": 0, "cost_usd": 0},
                  "r": {"queued": 1, "done": 0, "dead": 0, "retries": 0, "tokens": 0, "cost_usd": 0},
                  "s": {"queued": 0, "done": 2, "dead": 1, "retries": 1, "tokens": 3 * per_run,
                        "cost_usd": Decimal("0.75")}}
    assert summary() == summary(None) == everything
    assert summary("nothing-has-this:") == {}
