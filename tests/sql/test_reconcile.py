"""The reconcile group (migrations/sources/10_reconcile.sql): fleet.reconcile(), the monitor's pass —
expired leases, sessions that stopped heartbeating, tasks held by an ended session, overdue
sessions, idle capacity, two monitors at once — and what it costs over a long history (the plans of
its own statements, read from the function). Called over psycopg against a real, freshly migrated
PostgreSQL. (fleet.declare_session_lost on its own: tests/sql/test_sessions.py; fleet.stalled_tasks
through real shifts: tests/test_guardrails.py.)

Time is driven by writing the columns the monitor reads (heartbeat_at, deadline, run_at) instead of
sleeping. A running task's lease follows its session (fleet._lease_until of the session's last
heartbeat): sqlkit.expire ages the heartbeat of the sessions holding the tasks, and every task of
such a session expires with it. With a lane's default session timeout (the lease) a silent session
is found lost by step 1 (heartbeat-timeout) before step 3 could see its leases; so the tests of the
lease-expired path (step 3) give their lane a session timeout longer than its lease (``STEP3``).
"""

from __future__ import annotations

import random
import threading
import uuid
from collections import Counter
from typing import Any

import psycopg
import pytest
from sqlkit import (
    RUNNING_INDEXES,
    SESSION_NOT_ACTIVE,
    Call,
    assert_fenced,
    assert_index_only,
    bind,
    claim_exactly,
    enqueue,
    events,
    expire,
    explain,
    function_body,
    heartbeat,
    lease_left,
    loop_queries,
    one,
    open_session,
    reconcile,
    repaired_events,
    rows,
    scans_of,
    session_row,
    sync_lane,
    take,
    task,
    view,
    wait_until_waiting,
    world,
)


def actions(result: list[dict[str, Any]]) -> list[tuple[str, int | None]]:
    return [(r["action"], r["task_id"]) for r in result]


#: lane settings under which a silent session's leases run out (60 s) before the session may be
#: declared lost (120 s): what fleet.reconcile's step 3 (lease-expired) repairs
STEP3 = {"lease_seconds": 60, "session_timeout_seconds": 120}


# ------------------------------------------------------------------------------------------------
# expired leases


def test_expired_lease_goes_back_to_the_queue(conn):
    sync_lane(conn, **STEP3)
    enqueue(conn, "a")
    enqueue(conn, "a")
    s = open_session(conn, "a")
    (expired,) = claim_exactly(conn, s)
    live = open_session(conn, "a", host="h-live")
    (alive,) = claim_exactly(conn, live)
    expire(conn, expired["id"])  # s is silent for its lease, not yet for its session timeout

    result = reconcile(conn)

    assert actions(result) == [("released", expired["id"])]
    assert result[0]["lane"] == "a" and result[0]["session_id"] == s
    assert result[0]["detail"] == {"reason": "lease-expired", "state": "queued"}
    t = task(conn, expired["id"])
    assert t["state"] == "queued"
    assert (t["evaporations"], t["failures"], t["attempts"]) == (1, 0, 1)
    assert t["lease_token"] is None and t["lease_expires_at"] is None and t["session_id"] is None
    assert t["finished_at"] is None and t["dead_reason"] is None
    # the run of the released lease is closed as lost
    run = rows(conn, "select * from fleet.runs where lease_token = %s", (expired["lease_token"],))[0]
    assert run["outcome"] == "lost" and run["ended_at"] is not None
    assert "lease-expired" in run["error_tail"]
    # one repaired event with its reason
    (ev,) = repaired_events(conn, expired["id"])
    assert ev["detail"]["reason"] == "lease-expired" and ev["detail"]["state"] == "queued"
    assert ev["session_id"] == s and ev["lane"] == "a"
    # the task whose lease is fine (its session heartbeats) is untouched
    other = task(conn, alive["id"])
    assert other["state"] == "running" and other["lease_token"] == alive["lease_token"]
    # step 3 repairs a lease, not a session: the silent one is still active (step 1 finds it once
    # it is silent for its session timeout)
    assert session_row(conn, s)["state"] == "active" and events(conn, "session_lost") == []
    # the old token is fenced
    assert_fenced(conn, expired["id"], expired["lease_token"])
    # and the released task can be claimed again, by anyone
    (again,) = claim_exactly(conn, open_session(conn, "a", host="h2"))
    assert again["id"] == expired["id"] and again["attempts"] == 2
    assert_fenced(conn, expired["id"], expired["lease_token"])


def test_repaired_work_is_claimed_before_fresh_work_of_its_priority(conn):
    # the repaired task was enqueued last and released last: fresh work is older in run_at
    sync_lane(conn, **STEP3)
    fresh = [enqueue(conn, "a") for _ in range(3)]
    lost = enqueue(conn, "a")
    s = open_session(conn, "a")
    held = take(conn, s, lost)
    expire(conn, lost)
    assert actions(reconcile(conn)) == [("released", lost)]
    assert task(conn, lost)["carry_over"] is True
    assert held["id"] == lost
    other = open_session(conn, "a")
    assert [t["id"] for t in claim_exactly(conn, other, 2)] == [lost, fresh[0]]


def test_a_second_pass_repairs_nothing_more(conn):
    sync_lane(conn, **STEP3)
    enqueue(conn, "a")
    s = open_session(conn, "a")
    (t,) = claim_exactly(conn, s)
    expire(conn, t["id"])
    assert actions(reconcile(conn)) == [("released", t["id"])]
    assert reconcile(conn) == []
    assert len(repaired_events(conn, t["id"])) == 1
    assert task(conn, t["id"])["evaporations"] == 1


def test_expired_lease_at_the_attempt_cap_is_dead_and_keeps_last_error(conn):
    sync_lane(conn, max_attempts=2, backoff_base_seconds=0, **STEP3)
    s = open_session(conn, "a")
    tid = enqueue(conn, "a")
    (first,) = claim_exactly(conn, s)
    assert one(conn, "select fleet.fail(%s, %s, 'boom: the tests fail')",
               (tid, first["lease_token"])) == "queued"
    (second,) = claim_exactly(conn, s)
    expire(conn, tid)

    result = reconcile(conn)

    assert actions(result) == [("released", tid)]
    assert result[0]["detail"] == {"reason": "lease-expired", "state": "dead"}
    t = task(conn, tid)
    assert t["state"] == "dead" and t["dead_reason"] == "attempt-cap"
    assert (t["failures"], t["evaporations"]) == (1, 1)
    assert t["last_error"] == "boom: the tests fail"
    assert t["finished_at"] is not None and t["lease_token"] is None
    (ev,) = repaired_events(conn, tid)
    assert ev["detail"]["state"] == "dead"
    assert_fenced(conn, tid, second["lease_token"])
    assert reconcile(conn) == []  # a dead letter is not repaired again


def test_evaporations_alone_spend_the_cap(conn):
    sync_lane(conn, max_attempts=3, **STEP3)
    tid = enqueue(conn, "a")
    states = []
    for _ in range(3):
        (t,) = claim_exactly(conn, open_session(conn, "a"))
        expire(conn, tid)
        states.append(reconcile(conn)[0]["detail"]["state"])
    assert states == ["queued", "queued", "dead"]
    t = task(conn, tid)
    assert (t["state"], t["dead_reason"], t["evaporations"], t["attempts"]) == ("dead", "attempt-cap", 3, 3)


def test_per_task_cap_overrides_the_lane(conn):
    sync_lane(conn, max_attempts=5, **STEP3)
    tid = enqueue(conn, "a", max_attempts=1)
    claim_exactly(conn, open_session(conn, "a"))
    expire(conn, tid)
    assert reconcile(conn)[0]["detail"]["state"] == "dead"
    assert task(conn, tid)["dead_reason"] == "attempt-cap"


# ------------------------------------------------------------------------------------------------
# sessions that stopped heartbeating


def test_stale_session_is_lost_and_all_its_tasks_released_at_once(conn):
    sync_lane(conn, lease_seconds=60)
    sync_lane(conn, "b", lease_seconds=60)
    for _ in range(3):
        enqueue(conn, "a")
    stale = open_session(conn, "a")
    fine = open_session(conn, "a", host="h2")
    held = claim_exactly(conn, stale, 2)
    (kept,) = claim_exactly(conn, fine)
    # 61 s without a heartbeat: the session and, with it, the lease of every task it holds ran out
    # (the claims' lease_expires_at say otherwise: that column is not what decides)
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '61 seconds' where id = %s",
                 (stale,))
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '50 seconds' where id = %s",
                 (fine,))
    assert one(conn, "select count(*) from fleet.tasks where state = 'running' and lease_expires_at > "
                     "now() + interval '50 seconds'") == 3
    assert [round(lease_left(conn, t["id"])) for t in (*held, kept)] == [-1, -1, 10]

    result = reconcile(conn)

    ids = sorted(t["id"] for t in held)
    assert result[0]["action"] == "session_lost" and result[0]["session_id"] == stale
    assert result[0]["detail"]["reason"] == "heartbeat-timeout"
    assert sorted(r["task_id"] for r in result[1:]) == ids
    assert all(r["action"] == "released" and r["detail"]["reason"] == "heartbeat-timeout" for r in result[1:])
    assert len(result) == 3
    s = session_row(conn, stale)
    assert s["state"] == "lost" and s["end_reason"] == "heartbeat-timeout" and s["ended_at"] is not None
    assert session_row(conn, fine)["state"] == "active"
    for t in held:
        row = task(conn, t["id"])
        assert (row["state"], row["evaporations"]) == ("queued", 1)
        (ev,) = repaired_events(conn, t["id"])
        assert ev["detail"]["reason"] == "heartbeat-timeout"
        assert_fenced(conn, t["id"], t["lease_token"])
    assert task(conn, kept["id"])["state"] == "running"
    assert len(events(conn, "session_lost")) == 1
    # the lost shift learns it at its next call
    with pytest.raises(psycopg.Error) as info:
        conn.execute("select * from fleet.heartbeat(%s)", (stale,))
    assert info.value.sqlstate == SESSION_NOT_ACTIVE


def test_session_timeout_overrides_the_lease(conn):
    sync_lane(conn, "slow", lease_seconds=60)  # timeout: the lease, 60 s
    sync_lane(conn, "fast", lease_seconds=60, session_timeout_seconds=10)
    slow = open_session(conn, "slow")
    fast_ok = open_session(conn, "fast")
    fast_gone = open_session(conn, "fast", host="h2")
    for s, ago in ((slow, 30), (fast_ok, 5), (fast_gone, 11)):
        conn.execute("update fleet.sessions set heartbeat_at = now() - make_interval(secs => %s) "
                     "where id = %s", (ago, s))
    result = reconcile(conn)
    assert [(r["action"], r["session_id"]) for r in result] == [("session_lost", fast_gone)]
    assert [session_row(conn, s)["state"] for s in (slow, fast_ok, fast_gone)] == ["active", "active", "lost"]


@pytest.mark.parametrize("late", ["heartbeat", "lease"])
def test_a_heartbeat_that_commits_during_the_pass_keeps_its_session(db_url, conn, late):
    # heartbeat: silent past its session timeout (step 1 would find it lost); lease: silent past its
    # lease only, on a lane whose session timeout is longer (step 3 would release its task). Either
    # step locks the session row and leaves it, busy in a heartbeat, for the next pass: the heartbeat
    # writes the session row alone, no task row, so a step 3 locking only the tasks would not wait.
    sync_lane(conn, **(STEP3 if late == "lease" else {}))
    enqueue(conn, "a")
    s = open_session(conn, "a")
    (t,) = claim_exactly(conn, s)
    if late == "heartbeat":
        conn.execute("update fleet.sessions set heartbeat_at = now() - interval '1 hour'")
    else:
        expire(conn, t["id"])
    assert lease_left(conn, t["id"]) < 0
    result: dict[str, Any] = {}

    def monitor() -> None:
        with psycopg.connect(db_url, autocommit=True) as b:
            result["rows"] = reconcile(b)

    with psycopg.connect(db_url) as a:
        # the shift's heartbeat is under way (not committed yet) when the monitor looks
        assert rows(a, "select * from fleet.heartbeat(%s)", (s,)) == [
            {"task_id": None, "status": "session", "valid_for": 60.0},
            {"task_id": t["id"], "status": "ok", "valid_for": 60.0}]
        th = threading.Thread(target=monitor)
        th.start()
        th.join(1.5)
        a.commit()
    th.join(10)
    assert not th.is_alive()
    assert result["rows"] == []
    assert session_row(conn, s)["state"] == "active"
    assert task(conn, t["id"])["state"] == "running"
    assert events(conn, "session_lost") == [] and repaired_events(conn, t["id"]) == []
    assert lease_left(conn, t["id"]) > 50  # renewed by the heartbeat's session row
    # a session that really stopped is still found on the next pass
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '1 hour'")
    assert [r["action"] for r in reconcile(conn)] == ["session_lost", "released"]


@pytest.mark.parametrize("settings", [{}, STEP3], ids=["default-timeout", "longer-timeout"])
def test_a_task_whose_session_heartbeats_is_never_repaired_whatever_its_claims_lease(conn, settings):
    # claimed two hours ago under a 60 s lease: tasks.lease_expires_at (set by the claim, never
    # renewed) ran out long ago; the session heartbeat just now, and the task's lease follows it
    sync_lane(conn, **settings)
    enqueue(conn, "a")
    enqueue(conn, "a")
    s = open_session(conn, "a")
    held = claim_exactly(conn, s, 2)
    conn.execute("update fleet.tasks set lease_expires_at = now() - interval '2 hours' + interval '60 seconds',"
                 " last_progress_at = now() - interval '2 hours' where state = 'running'")
    conn.execute("update fleet.runs set started_at = now() - interval '2 hours'")
    assert heartbeat(conn, s) == {t["id"]: "ok" for t in held}
    before = world(conn)

    assert reconcile(conn) == []

    assert world(conn) == before
    for t in held:
        assert lease_left(conn, t["id"]) > 59
        assert one(conn, "select held from fleet.lease_held(%s, %s)", (t["id"], t["lease_token"])) is True
        assert task(conn, t["id"])["lease_expires_at"] < one(conn, "select now() - interval '1 hour'")
    assert view(conn, "stuck_tasks") == []
    # and once the session is silent for its lease, every task of it is repaired, together
    expire(conn, held[0]["id"])
    assert sorted(r["task_id"] for r in reconcile(conn) if r["action"] == "released") == \
        sorted(t["id"] for t in held)


def test_step_3_rechecks_a_session_whose_heartbeat_committed_after_the_pass_looked(db_url, conn, connect):
    # Step 3's query takes its snapshot before its first row; PL/pgSQL fetches a FOR loop's rows ten
    # at a time, locking each as it is fetched. So: ten expired tasks of a session silent longest
    # come first, and while the pass is held up repairing the first of them (a run row locked by
    # another transaction), the shift of a second silent session heartbeats and commits. When the
    # pass locks that session's row, it must see the newest row (the lock's recheck) and leave its
    # task, though by the pass's snapshot the lease had run out.
    sync_lane(conn, max_attempts=10, **STEP3)
    for _ in range(11):
        enqueue(conn, "a")
    first = open_session(conn, "a", host="h-first")
    early = claim_exactly(conn, first, 10)
    second = open_session(conn, "a", host="h-second")
    (late,) = claim_exactly(conn, second)
    expire(conn, *(t["id"] for t in early), ago="20 seconds")
    expire(conn, late["id"], ago="1 second")
    assert lease_left(conn, late["id"]) < 0

    holder = connect(autocommit=False)  # holds the run row of the first task the pass repairs
    first_repaired = min(early, key=lambda t: t["id"])  # step 3's order: oldest heartbeat, then task id
    holder.execute("select 1 from fleet.runs where lease_token = %s for update", (first_repaired["lease_token"],))
    monitor = connect()
    watch = connect()
    pass_ = Call(monitor, reconcile)
    pass_.start()
    assert wait_until_waiting(watch, monitor.info.backend_pid) in ("tuple", "transactionid")

    shift = connect()
    shift.execute("set lock_timeout = '5s'")  # the second session's row is not locked yet
    assert heartbeat(shift, second) == {late["id"]: "ok"}
    holder.rollback()

    result = pass_.outcome()
    assert sorted(r["task_id"] for r in result) == sorted(t["id"] for t in early)
    assert {r["detail"]["reason"] for r in result} == {"lease-expired"}
    assert task(conn, late["id"])["state"] == "running"
    assert task(conn, late["id"])["lease_token"] == late["lease_token"]
    assert repaired_events(conn, late["id"]) == []
    assert lease_left(conn, late["id"]) > 50


def test_a_session_busy_in_a_heartbeat_is_left_alone_by_step_3(conn, connect):
    sync_lane(conn, **STEP3)
    enqueue(conn, "a")
    s = open_session(conn, "a")
    (t,) = claim_exactly(conn, s)
    expire(conn, t["id"])
    shift = connect(autocommit=False)
    shift.execute("select * from fleet.heartbeat(%s)", (s,)).fetchall()  # under way: the session row held
    monitor = connect(autocommit=False)  # the pass, not committed yet (the rest of it still running)
    # the heartbeat goes on to write a task of its own (what p_progressed does)
    progress = Call(shift, lambda c: c.execute(
        "update fleet.tasks set last_progress_at = now() where id = %s", (t["id"],)))
    try:
        assert reconcile(monitor) == []  # the busy session is left for the next pass
        progress.start()
        progress.outcome(timeout=3)
    finally:
        monitor.rollback()
        if progress.is_alive():
            progress.join(10)
    shift.commit()
    assert task(conn, t["id"])["state"] == "running"


# ------------------------------------------------------------------------------------------------
# tasks held by a session that already ended


def test_tasks_held_by_an_ended_session_are_released(conn):
    sync_lane(conn)
    enqueue(conn, "a")
    s = open_session(conn, "a")
    (t,) = claim_exactly(conn, s)
    # an ended session that still holds a task (e.g. closed by hand, or an older close_session)
    conn.execute("update fleet.sessions set state = 'ended', ended_at = now(), end_reason = 'x' "
                 "where id = %s", (s,))
    assert lease_left(conn, t["id"]) > 50  # by its heartbeat, the lease would still hold

    result = reconcile(conn)

    assert actions(result) == [("released", t["id"])]
    assert result[0]["detail"] == {"reason": "session-ended", "state": "queued"}
    assert task(conn, t["id"])["state"] == "queued"
    assert repaired_events(conn, t["id"])[0]["detail"]["reason"] == "session-ended"
    assert rows(conn, "select outcome from fleet.runs where task_id = %s", (t["id"],)) == [{"outcome": "lost"}]
    assert_fenced(conn, t["id"], t["lease_token"])


def test_every_repair_writes_one_repaired_event_with_its_reason(conn):
    sync_lane(conn, **STEP3)
    for _ in range(3):
        enqueue(conn, "a")
    s1, s2, s3 = (open_session(conn, "a", host=f"h{i}") for i in range(3))
    (t1,), (t2,), (t3,) = claim_exactly(conn, s1), claim_exactly(conn, s2), claim_exactly(conn, s3)
    expire(conn, t1["id"])
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '1 hour' where id = %s", (s2,))
    conn.execute("update fleet.sessions set state = 'ended', ended_at = now() where id = %s", (s3,))
    reconcile(conn)
    reasons = {r["task_id"]: r["detail"]["reason"] for r in events(conn, "repaired")}
    assert reasons == {t1["id"]: "lease-expired", t2["id"]: "heartbeat-timeout", t3["id"]: "session-ended"}
    outcomes = rows(conn, "select outcome, count(*) as n from fleet.runs group by outcome")
    assert outcomes == [{"outcome": "lost", "n": 3}]


# ------------------------------------------------------------------------------------------------
# reports: overdue sessions, idle capacity


def test_overdue_session_is_reported_once(conn):
    sync_lane(conn)
    late = open_session(conn, "a", host="h1")
    within_grace = open_session(conn, "a", host="h2")
    conn.execute("update fleet.sessions set deadline = now() - interval '2 minutes' where id = %s", (late,))
    conn.execute("update fleet.sessions set deadline = now() - interval '30 seconds' where id = %s",
                 (within_grace,))

    result = reconcile(conn, grace=60)

    assert [(r["action"], r["session_id"]) for r in result] == [("overdue", late)]
    assert result[0]["detail"]["host"] == "h1"
    evs = events(conn, "session_overdue")
    assert [e["session_id"] for e in evs] == [late]
    reconcile(conn, grace=60)
    assert len(events(conn, "session_overdue")) == 1
    # reported, not repaired: the session is still active
    assert session_row(conn, late)["state"] == "active"


def _ready_since(conn: psycopg.Connection, lane_name: str, seconds: int) -> int:
    return enqueue(conn, lane_name, run_at=one(conn, "select now() - make_interval(secs => %s)", (seconds,)))


def test_idle_capacity_is_reported_and_journalled_once_per_idle_period(conn):
    sync_lane(conn, "idle", max_running=2)
    sync_lane(conn, "young", max_running=2)
    sync_lane(conn, "later", max_running=2)
    _ready_since(conn, "idle", 400)
    _ready_since(conn, "idle", 350)
    _ready_since(conn, "young", 100)  # ready, but not for long
    enqueue(conn, "later", run_at=one(conn, "select now() - interval '1 hour' + interval '2 hours'"))

    result = reconcile(conn, idle=300)

    assert [(r["action"], r["lane"]) for r in result] == [("idle_capacity", "idle")]
    d = result[0]["detail"]
    assert (d["ready"], d["running"], d["max_running"]) == (2, 0, 2)
    assert 395 <= d["idle_seconds"] <= 460
    assert len(events(conn, "idle_capacity", "idle")) == 1

    again = reconcile(conn, idle=300)
    assert [(r["action"], r["lane"]) for r in again] == [("idle_capacity", "idle")]
    assert len(events(conn, "idle_capacity", "idle")) == 1  # still the same idle period

    # an unlimited lane counts as having free slots
    sync_lane(conn, "unlimited")
    _ready_since(conn, "unlimited", 400)
    assert ("idle_capacity", "unlimited") in [(r["action"], r["lane"]) for r in reconcile(conn, idle=300)]


@pytest.mark.parametrize("why", ["paused", "preflight-paused", "active-session", "slots-full", "no-slots"])
def test_idle_capacity_not_reported(conn, why):
    sync_lane(conn, "other")
    sync_lane(conn, "x", max_running=0 if why == "no-slots" else 1, paused=(why == "paused"),
              paused_reason="lanes.x.instructions: missing" if why == "preflight-paused" else None)
    _ready_since(conn, "x", 400)
    if why == "active-session":
        open_session(conn, "x")
    if why == "slots-full":
        # the lane's one slot is taken by a healthy running task (held, here, by a session of
        # another lane, so that no session of lane x is active)
        s = open_session(conn, "other")
        tid = _ready_since(conn, "x", 500)
        conn.execute("update fleet.tasks set state = 'running', lease_token = gen_random_uuid(), "
                     "lease_expires_at = now() + interval '1 minute', session_id = %s where id = %s",
                     (s, tid))
    result = reconcile(conn, idle=300)
    assert [r for r in result if r["action"] == "idle_capacity"] == []
    assert events(conn, "idle_capacity") == []
    # control: the same lane, unpaused, with a free slot and no active session, is reported
    conn.execute("update fleet.sessions set state = 'ended', ended_at = now()")
    conn.execute("update fleet.tasks set state = 'queued', lease_token = null, lease_expires_at = null, "
                 "session_id = null where state = 'running'")
    conn.execute("update fleet.lanes set paused = false, paused_reason = null, max_running = 5 where name = 'x'")
    assert [r["lane"] for r in reconcile(conn, idle=300) if r["action"] == "idle_capacity"] == ["x"]


# ------------------------------------------------------------------------------------------------
# two monitors


def test_a_second_monitor_during_a_pass_skips_and_changes_nothing(db_url, conn):
    sync_lane(conn)
    enqueue(conn, "a")
    s = open_session(conn, "a")
    (t,) = claim_exactly(conn, s)
    expire(conn, t["id"])
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '1 hour'")
    before = one(conn, "select count(*) from fleet.journal")

    with psycopg.connect(db_url) as a, psycopg.connect(db_url, autocommit=True) as b:
        first = rows(a, "select * from fleet.reconcile()")  # psycopg opened a transaction: held
        assert [r["action"] for r in first] == ["session_lost", "released"]
        b.execute("set lock_timeout = '5s'")  # fail, not hang, if b waited for a's row locks

        second = rows(b, "select * from fleet.reconcile()")
        assert len(second) == 1 and second[0]["action"] == "skipped"
        assert second[0]["lane"] is None and second[0]["task_id"] is None
        # b sees nothing changed (a has not committed) and b wrote nothing itself
        assert one(b, "select count(*) from fleet.journal") == before
        assert one(b, "select state from fleet.tasks where id = %s", (t["id"],)) == "running"
        assert one(b, "select state from fleet.sessions where id = %s", (s,)) == "active"
        a.commit()

        # the lock was transaction-scoped: b's next pass runs (and finds nothing to do)
        assert rows(b, "select * from fleet.reconcile()") == []
    assert len(repaired_events(conn, t["id"])) == 1
    assert task(conn, t["id"])["evaporations"] == 1


def test_concurrent_monitors_and_host_checks_repair_each_task_exactly_once(db_url, conn):
    sync_lane(conn, "a", max_attempts=10, **STEP3)
    sync_lane(conn, "b", max_attempts=10, **STEP3)
    sessions = []
    task_ids = []
    for i in range(12):
        ln = "ab"[i % 2]
        for _ in range(4):
            task_ids.append(enqueue(conn, ln))
        s = open_session(conn, ln, host=f"h{i}")
        claim_exactly(conn, s, 4)
        sessions.append(s)
    # every lease expired, half of the sessions stale too: several repair paths race for each task
    expire(conn, *task_ids, ago="5 seconds")
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '1 hour' "
                 "where id = any(%s)", (sessions[::2],))
    errors: list[BaseException] = []
    returned: list[str] = []  # list.append is atomic under the GIL; Counter's += is not
    start = threading.Barrier(4)

    def monitor() -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as c:
                start.wait()
                for _ in range(30):
                    for r in rows(c, "select * from fleet.reconcile()"):
                        returned.append(r["action"])
        except BaseException as exc:
            errors.append(exc)

    def host_check(seed: int) -> None:
        # what a host's pid check does, outside the monitors' advisory lock
        try:
            order = sessions[:]
            random.Random(seed).shuffle(order)
            with psycopg.connect(db_url, autocommit=True) as c:
                start.wait()
                for s in order:
                    for r in rows(c, "select * from fleet.declare_session_lost(%s, 'pid-gone')", (s,)):
                        returned.append(r["action"])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=monitor) for _ in range(2)]
    threads += [threading.Thread(target=host_check, args=(seed,)) for seed in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert not any(th.is_alive() for th in threads)

    per_task = Counter(r["task_id"] for r in events(conn, "repaired"))
    assert per_task == Counter({tid: 1 for tid in task_ids})
    assert returned.count("released") == len(task_ids)
    assert returned.count("session_lost") == len(sessions)
    assert one(conn, "select count(*) from fleet.tasks where state <> 'queued' or evaporations <> 1") == 0
    per_session = Counter(r["session_id"] for r in events(conn, "session_lost"))
    assert all(n == 1 for n in per_session.values()) and len(per_session) == len(sessions)
    assert one(conn, "select count(*) from fleet.runs where outcome is distinct from 'lost'") == 0


def test_concurrent_monitors_over_expired_leases(db_url, conn):
    sync_lane(conn, max_attempts=10, **STEP3)
    ids = [enqueue(conn, "a") for _ in range(60)]
    for i in range(0, 60, 6):
        claim_exactly(conn, open_session(conn, "a", host=f"h{i}"), 6)
    expire(conn, *ids)
    done = threading.Event()
    errors: list[BaseException] = []
    skipped = Counter()

    def monitor() -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as c:
                while not done.is_set():
                    got = rows(c, "select * from fleet.reconcile()")
                    skipped[threading.get_ident()] += sum(r["action"] == "skipped" for r in got)
                    if one(c, "select count(*) from fleet.tasks where state = 'running'") == 0:
                        done.set()
        except BaseException as exc:
            errors.append(exc)
            done.set()

    threads = [threading.Thread(target=monitor) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors, errors
    counts = Counter(r["task_id"] for r in events(conn, "repaired"))
    assert counts == Counter({tid: 1 for tid in ids})
    assert {r["detail"]["reason"] for r in events(conn, "repaired")} == {"lease-expired"}
    assert one(conn, "select count(*) from fleet.runs where outcome = 'lost'") == 60


# ------------------------------------------------------------------------------------------------
# cost follows the active work, not the history


ACTIVE_SESSIONS = {"sessions_active_heartbeat", "sessions_active_lane", "sessions_active_host"}


def reconcile_statements(conn: psycopg.Connection) -> dict[str, str]:
    """The statements of fleet.reconcile() (idle 300 s, grace 60 s) and the one of the
    fleet.declare_session_lost() it calls for each lost session (its session a parameter), read
    from the functions as the database runs them."""
    stale, held, expired, overdue, idle = loop_queries(function_body(conn, "fleet.reconcile(int, int)"))
    [session_tasks] = loop_queries(function_body(conn, "fleet.declare_session_lost(uuid, text)"))
    return {"stale_sessions": stale, "held_by_ended": held, "expired": expired,
            "overdue": bind(overdue, {"p_overdue_grace_seconds": "60"}),
            "idle": bind(idle, {"p_idle_seconds": "300"}),
            "session_tasks": bind(session_tasks, {"p_session": "%s"})}


def test_cost_follows_the_active_work_not_the_history(long_history: psycopg.Connection) -> None:
    conn = long_history
    q = reconcile_statements(conn)
    # the monitor's statements read running tasks, ready tasks and active sessions by partial index
    assert_index_only(conn, q["expired"], "tasks", RUNNING_INDEXES)
    # (the sessions of the running tasks: through an active-session index, or looked up by the
    # running task's session id — one probe per running task, whatever the history holds)
    assert_index_only(conn, q["expired"], "sessions", ACTIVE_SESSIONS | {"sessions_pkey"})
    assert_index_only(conn, q["held_by_ended"], "tasks", RUNNING_INDEXES)
    assert_index_only(conn, q["session_tasks"], "tasks", {"tasks_running_session"}, (uuid.uuid4(),))
    assert_index_only(conn, q["idle"], "tasks", {"tasks_ready"} | RUNNING_INDEXES)
    ready_scans = {i for _, i in scans_of(explain(conn, q["idle"]), "tasks")}
    assert "tasks_ready" in ready_scans, ready_scans
    assert_index_only(conn, q["stale_sessions"], "sessions", ACTIVE_SESSIONS)
    assert_index_only(conn, q["overdue"], "sessions", ACTIVE_SESSIONS)
    assert_index_only(conn, q["overdue"], "events", {"events_session", "events_kind_ts"})
    assert_index_only(conn, q["idle"], "sessions", ACTIVE_SESSIONS)
    # (and so do the claim's ready query and its running count: tests/sql/test_claim.py)

    # the pass itself repairs the active work and nothing of the history (lane a's session silent
    # for its lease, not yet for its session timeout: step 3 releases its three tasks)
    conn.execute("update fleet.lanes set session_timeout_seconds = 120 where name = 'a'")
    expire(conn, *[r["id"] for r in rows(conn, "select id from fleet.tasks where lane = 'a' and state = 'running'")])
    result = reconcile(conn)
    assert sorted(r["action"] for r in result) == ["released"] * 3
    assert {r["detail"]["reason"] for r in result} == {"lease-expired"}
    assert one(conn, "select count(*) from fleet.tasks where state = 'done'") == 50000


def test_reconcile_json_is_reconcile_answering_one_value(conn):
    sync_lane(conn, **STEP3)
    enqueue(conn, "a")
    enqueue(conn, "a")
    s = open_session(conn, "a")
    expired = claim_exactly(conn, s, 2)
    expire(conn, *(t["id"] for t in expired))
    with conn.transaction(force_rollback=True):
        expected = reconcile(conn)
    assert [a for a, _ in actions(expected)] == ["released", "released"]
    got = one(conn, "select fleet.reconcile_json(300, 60)")
    assert got == [{**r, "session_id": str(r["session_id"])} for r in expected]
    assert one(conn, "select fleet.reconcile_json()") == []  # nothing more to repair
