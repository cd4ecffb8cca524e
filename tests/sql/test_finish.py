"""The finish group (migrations/sources/08_finish.sql): how a run ends — fleet.complete,
fleet.complete_many, fleet.fail, fleet.hand_off, fleet.route (and a target lane that has the
task's key), fleet.transient, fleet.drop_session, fleet.throttle's floor, signal, bound and who
set it — and its run record, fleet.record_run (the same answer to a made-up token and to another
lane's); called over psycopg
against a real, freshly migrated PostgreSQL. Every transition, every refusal, the events row each
transition writes, and the races a finishing call must win or lose cleanly; fleet.cannot_start (an
agent program that could not start: the task back unspent, its lane paused). (fleet.block and
fleet.throttle are also exercised through real shifts: tests/test_dispatch.py,
tests/test_guardrails.py; the fence of these calls: tests/sql/test_lease.py.)
"""

from __future__ import annotations

import json
import threading
import uuid
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from sqlkit import (
    INVALID_ARGUMENT,
    LANE_NOT_ALLOWED,
    LEASE_LOST,
    ROUTE_REFUSED,
    UNKNOWN_LANE,
    UNKNOWN_TASK,
    Call,
    add_lane,
    as_key,
    checkpoint,
    claim,
    claim_one,
    complete,
    complete_many,
    drop_session,
    enqueue,
    enqueue_many,
    enqueue_task,
    fail,
    generic_plans,
    hand_off,
    kinds,
    last_event,
    one,
    open_session,
    race,
    record_run,
    refused,
    release,
    route,
    rows,
    running_tasks,
    runs,
    seconds_between,
    task,
    throttle,
    transient,
    wait_until_waiting,
    world,
)

from worker.config import LONGEST_THROTTLE_SECONDS
from worker.shift.limits import LONGEST_RESET

# ------------------------------------------------------------------------------------------------
# complete


def test_complete(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    assert complete(conn, task_id, t["lease_token"], {"pr": 12}) == "done"
    after = task(conn, task_id)
    assert after["state"] == "done"
    assert after["result"] == {"pr": 12}
    assert after["finished_at"] is not None
    assert after["lease_token"] is None
    assert after["lease_expires_at"] is None
    assert after["session_id"] is None
    [run] = runs(conn, task_id)
    assert run["outcome"] == "done" and run["ended_at"] is not None
    assert kinds(conn, task_id) == ["enqueued", "claimed", "completed"]
    ev = last_event(conn, task_id)
    assert ev["session_id"] == session and ev["detail"] == {"attempt": 1, "state": "done"}


def test_completes_one_plan_reads_its_task_by_id_however_many_run(conn, lane, session):
    """The completion's plan, as the plan cache keeps it for every later call (generic), reads the
    task by id: not every running task (the statistics of a queue analyzed while little ran made a
    scan of the partial index tasks_running_session, all of it per completion, look cheaper)."""
    enqueue_many(conn, lane, [{"key": f"k{i}"} for i in range(3000)])
    claimed = claim(conn, session, 30)
    conn.execute("analyze fleet.tasks")
    t = claimed[0]
    states: list[str] = []
    plans = generic_plans(conn, lambda: states.append(complete(conn, t["id"], t["lease_token"])))
    assert states == ["done"]
    [update] = [p for p in plans if "update fleet.tasks" in p]
    assert "Index Scan using tasks_pkey on tasks" in update, update
    assert "tasks_running_session" not in update and "Seq Scan on tasks" not in update, update


def test_complete_twice_is_lease_lost(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    complete(conn, task_id, t["lease_token"])
    before = world(conn)
    with refused(LEASE_LOST):
        complete(conn, task_id, t["lease_token"])
    assert world(conn) == before


def test_complete_racing_cancel_has_one_winner(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into fleet.lanes (name) values ('a')")
        c.execute("select fleet.enqueue('a', 'k' || g) from generate_series(1, 20) g")
        sid = open_session(c, "a", "h", 1)
        leases = c.execute("select id, lease_token from fleet.claim(%s, 20)", (sid,)).fetchall()
    assert len(leases) == 20

    def work(c: psycopg.Connection, i: int) -> list[str]:
        got = []
        for task_id, token in leases:
            try:
                if i == 0:
                    row = c.execute("select fleet.complete(%s, %s)", (task_id, token)).fetchone()
                else:
                    row = c.execute("select fleet.cancel(%s)", (task_id,)).fetchone()
                assert row is not None
                got.append(row[0])
            except psycopg.Error as exc:
                got.append(str(exc.sqlstate))
        return got

    completer, canceller = race(db_url, 2, work)
    for (task_id, _), done, cancelled in zip(leases, completer, canceller, strict=True):
        # complete first: cancel is refused (LF004); cancel first: complete has lost its lease
        assert (done, cancelled) in {("done", "LF004"), ("LF001", "cancelled")}, (
            task_id,
            done,
            cancelled,
        )
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute(
            "select count(*) from fleet.runs where outcome is null or ended_at is null"
        ).fetchone() == (0,)


# ------------------------------------------------------------------------------------------------
# complete_many: every guarantee of complete, for a batch


def test_a_stale_token_in_the_middle_of_a_batch(lanes: psycopg.Connection) -> None:
    conn = lanes
    s, got = running_tasks(conn, "docs", 3)
    a, b, c = got
    stale = uuid.uuid4()
    statuses = complete_many(conn, [c["id"], b["id"], a["id"]], [c["lease_token"], stale, a["lease_token"]],
                             [{"n": 3}, {"n": 2}, None])
    assert statuses == [(c["id"], "done"), (b["id"], "lost"), (a["id"], "done")]  # input order

    kept = task(conn, b["id"])  # untouched: still running under its own lease, its run open
    assert (kept["state"], kept["lease_token"], kept["session_id"], kept["result"]) == (
        "running", b["lease_token"], s, None)
    assert [(r["outcome"], r["ended_at"]) for r in rows(conn, "select * from fleet.runs where task_id = %s",
                                                       (b["id"],))] == [(None, None)]
    assert one(conn, "select count(*) from fleet.journal where task_id = %s and kind = 'completed'", (b["id"],)) == 0

    for t, result in ((a, None), (c, {"n": 3})):
        done = task(conn, t["id"])
        assert (done["state"], done["result"], done["lease_token"], done["lease_expires_at"], done["session_id"]) == (
            "done", result, None, None, None)
        assert done["finished_at"] is not None
        [run] = rows(conn, "select * from fleet.runs where task_id = %s", (t["id"],))
        assert run["outcome"] == "done" and run["ended_at"] is not None
        [ev] = rows(conn, "select * from fleet.journal where task_id = %s and kind = 'completed'", (t["id"],))
        assert (ev["lane"], ev["session_id"], ev["detail"]) == ("docs", s, {"attempt": 1, "state": "done"})

    # the lost one can still be completed by its holder
    assert complete(conn, b["id"], b["lease_token"]) == "done"


def test_complete_many_does_what_complete_does(lanes: psycopg.Connection) -> None:
    conn = lanes
    _, (one_by_one, bulk) = running_tasks(conn, "docs", 2)
    complete(conn, one_by_one["id"], one_by_one["lease_token"], {"ok": True})
    complete_many(conn, [bulk["id"]], [bulk["lease_token"]], [{"ok": True}])
    cols = ("state", "result", "lease_token", "lease_expires_at", "session_id", "attempts", "failures")
    assert {c: task(conn, bulk["id"])[c] for c in cols} == {c: task(conn, one_by_one["id"])[c] for c in cols}
    ev = "select kind, lane, session_id, detail from fleet.journal where task_id = %s and kind <> 'enqueued' order by id"
    assert rows(conn, ev, (bulk["id"],)) == rows(conn, ev, (one_by_one["id"],))
    run = "select outcome, attempt, ended_at is not null as ended from fleet.runs where task_id = %s"
    assert rows(conn, run, (bulk["id"],)) == rows(conn, run, (one_by_one["id"],))


def test_a_batch_over_two_lanes_goes_to_review_where_its_lane_requires_one(lanes: psycopg.Connection) -> None:
    conn = lanes
    conn.execute("update fleet.lanes set config = '{\"review\": true}' where name = 'bugfix'")
    _, [d1, d2] = running_tasks(conn, "docs", 2)
    _, [b1] = running_tasks(conn, "bugfix", 1)
    assert complete_many(conn, [d2["id"], b1["id"], d1["id"]],
                         [d2["lease_token"], b1["lease_token"], d1["lease_token"]]) == [
        (d2["id"], "done"), (b1["id"], "review"), (d1["id"], "done")]
    assert [(r["id"], r["state"], r["finished_at"] is not None) for r in rows(
        conn, "select id, state, finished_at from fleet.tasks where id = any(%s) order by id",
        ([d1["id"], d2["id"], b1["id"]],))] == sorted(
        [(d1["id"], "done", True), (d2["id"], "done", True), (b1["id"], "review", False)])
    assert sorted((r["task_id"], r["lane"], r["detail"]["state"]) for r in rows(
        conn, "select task_id, lane, detail from fleet.journal where kind = 'completed'")) == sorted(
        [(d1["id"], "docs", "done"), (d2["id"], "docs", "done"), (b1["id"], "bugfix", "review")])


def test_a_repaired_and_reclaimed_task_is_lost_to_its_old_token(lanes: psycopg.Connection) -> None:
    """The zombie case: the monitor released the task, another shift claimed it; the old shift's
    batch must not complete it under the new holder."""
    conn = lanes
    _, [old] = running_tasks(conn, "docs", 1)
    one(conn, "select fleet._release(%s, 'test')", (old["id"],))
    [new] = claim(conn, open_session(conn, "docs", host="host-2"), 1)
    assert new["id"] == old["id"]
    assert complete_many(conn, [old["id"]], [old["lease_token"]]) == [(old["id"], "lost")]
    t = task(conn, new["id"])
    assert (t["state"], t["lease_token"]) == ("running", new["lease_token"])
    assert [r["outcome"] for r in rows(conn, "select outcome from fleet.runs where task_id = %s order by id",
                                       (old["id"],))] == ["lost", None]


def test_finished_and_unknown_tasks(lanes: psycopg.Connection) -> None:
    conn = lanes
    _, [t] = running_tasks(conn, "docs", 1)
    assert complete_many(conn, [t["id"], 999999], [t["lease_token"], uuid.uuid4()]) == [
        (t["id"], "done"), (999999, "unknown")]
    # done already: its token no longer holds it (as complete says "lease lost")
    assert complete_many(conn, [t["id"]], [t["lease_token"]]) == [(t["id"], "lost")]
    assert complete_many(conn, [], []) == []
    assert complete_many(conn, [t["id"]], [None]) == [(t["id"], "lost")]


@pytest.mark.parametrize(("tasks", "tokens", "results", "message"), [
    ("ab", "a", None, "p_tasks has 2 elements, p_tokens 1"),
    ("a", "ab", None, "p_tasks has 1 elements, p_tokens 2"),
    ("ab", "ab", [None], "p_results 1"),
    ("aa", "ab", None, "is named twice"),
    ("a-", "ab", None, "p_tasks[1] is NULL"),
    (None, "a", None, "needs p_tasks and p_tokens"),
    ("a", None, None, "needs p_tasks and p_tokens"),
], ids=["fewer tokens", "more tokens", "fewer results", "twice", "null task", "no tasks", "no tokens"])
def test_malformed_batches_change_nothing(lanes: psycopg.Connection, tasks: str | None, tokens: str | None,
                                          results: list[Any] | None, message: str) -> None:
    conn = lanes
    _, (a, b) = running_tasks(conn, "docs", 2)
    by = {"a": a, "b": b}
    ids = None if tasks is None else [None if c == "-" else by[c]["id"] for c in tasks]
    toks = None if tokens is None else [by[c]["lease_token"] for c in tokens]
    before = rows(conn, "select id, state, lease_token from fleet.tasks order by id")
    with refused("LF005") as err:
        complete_many(conn, ids, toks, results)
    assert message in str(err.value), str(err.value)
    assert rows(conn, "select id, state, lease_token from fleet.tasks order by id") == before
    assert one(conn, "select count(*) from fleet.runs where ended_at is not null") == 0


# ------------------------------------------------------------------------------------------------
# fail


def test_fail_requeues_with_backoff(conn, session):
    conn.execute(
        "update fleet.lanes set backoff_base_seconds = 10, backoff_max_seconds = 35, max_attempts = 9"
    )
    task_id = enqueue(conn, "a", "k")
    delays = []
    for attempt in range(1, 5):
        conn.execute(
            "update fleet.tasks set run_at = now() - interval '1 s' where id = %s", (task_id,)
        )
        t = claim_one(conn, session)
        assert t["attempts"] == attempt
        assert fail(conn, task_id, t["lease_token"], f"error {attempt}") == "queued"
        after = task(conn, task_id)
        assert after["state"] == "queued"
        assert after["failures"] == attempt
        assert after["last_error"] == f"error {attempt}"
        assert after["lease_token"] is None and after["session_id"] is None
        assert after["finished_at"] is None
        delays.append(seconds_between(conn, task_id, "run_at", "updated_at"))
        assert one(conn, "select run_at > now() from fleet.tasks where id = %s", (task_id,))
        assert claim(conn, session) == [], "a task in backoff is not claimable"
    assert delays == [10, 20, 35, 35]  # base * 2^(failures-1), capped at backoff_max
    outcomes = [(r["outcome"], r["error_tail"]) for r in runs(conn, task_id)]
    assert outcomes == [("failed", f"error {i}") for i in range(1, 5)]
    assert kinds(conn, task_id).count("failed") == 4
    ev = last_event(conn, task_id)
    assert ev["kind"] == "failed"
    assert ev["detail"]["state"] == "queued" and ev["detail"]["retryable"] is True
    assert ev["detail"]["error"] == "error 4"


def test_fail_at_the_attempt_cap_is_dead(conn, lane, session):
    task_id = enqueue(conn, lane, "k")  # lane cap: 3
    for attempt in range(1, 4):
        conn.execute("update fleet.tasks set run_at = now() - interval '1 s'")
        t = claim_one(conn, session)
        state = fail(conn, task_id, t["lease_token"], f"e{attempt}")
        assert state == ("dead" if attempt == 3 else "queued")
    after = task(conn, task_id)
    assert after["state"] == "dead"
    assert after["dead_reason"] == "attempt-cap"
    assert after["failures"] == 3
    assert after["finished_at"] is not None
    assert after["lease_token"] is None
    assert after["last_error"] == "e3"
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s'")
    assert claim(conn, session) == []
    ev = last_event(conn, task_id)
    assert ev["detail"]["state"] == "dead" and ev["detail"]["reason"] == "attempt-cap"


def test_fail_cap_counts_evaporations(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    for _ in range(2):
        claim_one(conn, session)
        assert release(conn, task_id) == "queued"
    t = claim_one(conn, session)
    assert fail(conn, task_id, t["lease_token"]) == "dead"
    after = task(conn, task_id)
    assert (after["failures"], after["evaporations"], after["dead_reason"]) == (1, 2, "attempt-cap")


def test_fail_not_retryable_is_dead_at_once(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    assert fail(conn, task_id, t["lease_token"], "bad input", retryable=False) == "dead"
    after = task(conn, task_id)
    assert after["state"] == "dead"
    assert after["dead_reason"] == "fatal"
    assert after["failures"] == 1
    assert after["last_error"] == "bad input"
    assert runs(conn, task_id)[0]["outcome"] == "failed"
    ev = last_event(conn, task_id)
    assert ev["kind"] == "failed"
    assert ev["detail"]["retryable"] is False and ev["detail"]["reason"] == "fatal"


def test_fail_per_task_max_attempts_overrides_the_lane(conn, lane, session):
    one_shot = enqueue(conn, lane, "one", max_attempts=1)
    t = claim_one(conn, session)
    assert t["id"] == one_shot
    assert fail(conn, one_shot, t["lease_token"]) == "dead"
    assert task(conn, one_shot)["dead_reason"] == "attempt-cap"

    patient = enqueue(conn, lane, "patient", max_attempts=5)
    for _ in range(4):
        conn.execute(
            "update fleet.tasks set run_at = now() - interval '1 s' where id = %s", (patient,)
        )
        t = claim_one(conn, session)
        assert fail(conn, patient, t["lease_token"]) == "queued", (
            "the lane's cap of 3 does not apply"
        )
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s' where id = %s", (patient,))
    t = claim_one(conn, session)
    assert fail(conn, patient, t["lease_token"]) == "dead"
    assert task(conn, patient)["failures"] == 5


def test_fail_keeps_a_long_error_whole_on_the_task_and_bounded_elsewhere(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    error = "x" * 10_000
    fail(conn, task_id, t["lease_token"], error)
    assert task(conn, task_id)["last_error"] == error
    assert len(runs(conn, task_id)[0]["error_tail"]) == 4000
    assert len(last_event(conn, task_id)["detail"]["error"]) == 1000


# ------------------------------------------------------------------------------------------------
# hand_off


def test_hand_off_requeues_without_spending_an_attempt(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    checkpoint(conn, task_id, t["lease_token"], {"step": 3})
    snap = {"agent_session": "agent-abc", "summary": "half way"}
    assert hand_off(conn, task_id, t["lease_token"], snap) == "queued"
    after = task(conn, task_id)
    assert after["state"] == "queued"
    assert after["handoffs"] == 1
    assert (after["failures"], after["evaporations"]) == (0, 0)
    assert after["handoff"] == snap
    assert after["agent_session"] == "agent-abc"
    assert after["checkpoint"] == {"step": 3}, "the checkpoint is kept for the next shift"
    assert after["carry_over"] is True
    assert after["lease_token"] is None and after["session_id"] is None
    assert after["finished_at"] is None
    assert runs(conn, task_id)[0]["outcome"] == "handed_off"
    assert kinds(conn, task_id) == ["enqueued", "claimed", "checkpoint", "handed_off"]
    assert last_event(conn, task_id)["detail"] == {"attempt": 1, "handoffs": 1, "state": "queued"}


def test_hand_off_does_not_count_against_the_attempt_cap(conn, lane):
    conn.execute("update fleet.lanes set max_attempts = 1, max_handoffs = 5")
    task_id = enqueue(conn, "a", "k")
    for _ in range(5):
        t = claim_one(conn, open_session(conn, lane))  # a hand-off is for the next shift
        assert hand_off(conn, task_id, t["lease_token"], {}) == "queued"
    after = task(conn, task_id)
    assert after["state"] == "queued" and after["handoffs"] == 5 and after["attempts"] == 5


def test_hand_off_is_claimed_before_older_tasks_of_the_same_priority(conn, lane, session):
    handed = enqueue(conn, lane, "handed")
    t = claim_one(conn, session)
    older = [enqueue(conn, lane, f"old{i}", run_at="2000-01-01T00:00:00Z") for i in range(3)]
    higher = enqueue(conn, lane, "higher", priority=1, run_at="2030-01-01T00:00:00Z")
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s' where id = %s", (higher,))
    hand_off(conn, handed, t["lease_token"], {})
    next_shift = open_session(conn, lane)
    order = [claim_one(conn, next_shift)["id"] for _ in range(5)]
    assert order == [higher, handed, *older], "higher priority first, then the resumed task"
    assert task(conn, handed)["carry_over"] is False


def test_hand_off_agent_session_is_kept_when_the_snapshot_has_none(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    hand_off(conn, task_id, t["lease_token"], {"agent_session": "s1"})
    t = claim_one(conn, session := open_session(conn, lane))
    hand_off(conn, task_id, t["lease_token"], {"notes": "no session this time"})
    after = task(conn, task_id)
    assert after["agent_session"] == "s1"
    assert after["handoff"] == {"notes": "no session this time"}
    t = claim_one(conn, session := open_session(conn, lane))
    hand_off(conn, task_id, t["lease_token"], None)
    assert task(conn, task_id)["handoff"] == {}


def test_hand_off_beyond_max_handoffs_is_dead(conn, session):
    conn.execute("update fleet.lanes set max_handoffs = 2")
    task_id = enqueue(conn, "a", "k")
    states = []
    for _ in range(3):
        t = claim_one(conn, open_session(conn, "a"))  # a hand-off is for the next shift
        states.append(hand_off(conn, task_id, t["lease_token"], {"n": len(states)}))
    assert states == ["queued", "queued", "dead"]
    after = task(conn, task_id)
    assert after["state"] == "dead"
    assert after["dead_reason"] == "handoff-cap"
    assert after["handoffs"] == 3
    assert after["carry_over"] is False
    assert after["finished_at"] is not None
    assert claim(conn, session) == []
    assert last_event(conn, task_id)["detail"]["state"] == "dead"


def test_hand_off_with_max_handoffs_zero_is_dead_at_once(conn, session):
    conn.execute("update fleet.lanes set max_handoffs = 0")
    task_id = enqueue(conn, "a", "k")
    t = claim_one(conn, session)
    assert hand_off(conn, task_id, t["lease_token"], {}) == "dead"
    assert task(conn, task_id)["dead_reason"] == "handoff-cap"


@pytest.mark.parametrize("snapshot", [[1], "text", 5])
def test_hand_off_snapshot_must_be_an_object(conn, lane, session, snapshot):
    enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(INVALID_ARGUMENT):
        hand_off(conn, t["id"], t["lease_token"], snapshot)
    assert world(conn) == before


# ------------------------------------------------------------------------------------------------
# route


def test_route_to_another_lane_starts_fresh_and_keeps_history(conn, lane, session):
    add_lane(conn, "review")
    task_id = enqueue(conn, lane, "k", {"repo": "r"}, priority=4)
    # a first attempt that evaporated, a second that failed, a third that handed off
    claim_one(conn, session)
    release(conn, task_id)
    t = claim_one(conn, session)
    fail(conn, task_id, t["lease_token"])
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s'")
    t = claim_one(conn, session)
    hand_off(conn, task_id, t["lease_token"], {"agent_session": "ag-1"})
    t = claim_one(conn, session := open_session(conn, lane))
    checkpoint(conn, task_id, t["lease_token"], {"stage": "triaged"})
    assert route(conn, task_id, t["lease_token"], "review", {"why": "ready"}) == "queued"

    after = task(conn, task_id)
    assert after["lane"] == "review"
    assert after["state"] == "queued"
    assert after["key"] == "k" and after["payload"] == {"repo": "r"} and after["priority"] == 4
    assert (after["attempts"], after["failures"], after["evaporations"], after["handoffs"]) == (
        0,
        0,
        0,
        0,
    )
    assert after["checkpoint"] is None and after["checkpoint_seq"] == 0
    assert after["agent_session"] is None and after["handoff"] is None
    assert after["last_error"] is None
    assert after["carry_over"] is False
    assert after["lease_token"] is None and after["session_id"] is None
    [stage] = after["stages"]
    assert stage["lane"] == "a"
    assert stage["routed_to"] == "review"
    assert (stage["attempts"], stage["failures"], stage["evaporations"], stage["handoffs"]) == (
        4,
        1,
        1,
        1,
    )
    assert stage["agent_session"] == "ag-1"
    assert stage["checkpoint"] == {"stage": "triaged"}
    assert stage["note"] == {"why": "ready"}
    assert stage["finished_at"]
    assert runs(conn, task_id)[-1]["outcome"] == "routed"
    assert kinds(conn, task_id)[-2:] == ["checkpoint", "routed"]
    assert last_event(conn, task_id)["detail"] == {
        "from": "a",
        "to": "review",
        "note": {"why": "ready"},
    }

    # the next lane claims it as its own attempt 1; a second route appends to the history
    review = open_session(conn, "review")
    assert claim(conn, session) == []
    t = claim_one(conn, review)
    assert t["attempts"] == 1
    assert route(conn, task_id, t["lease_token"], "a") == "queued"
    stages = task(conn, task_id)["stages"]
    assert [(s["lane"], s["routed_to"], s["attempts"]) for s in stages] == [
        ("a", "review", 4),
        ("review", "a", 1),
    ]
    assert stages[1]["note"] is None


def test_route_unknown_lane_is_refused(conn, lane, session):
    enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(UNKNOWN_LANE):
        route(conn, t["id"], t["lease_token"], "nope")
    with refused(UNKNOWN_LANE):
        route(conn, t["id"], t["lease_token"], None)
    assert world(conn) == before


def test_route_to_the_same_lane_is_refused(conn, lane, session):
    enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(INVALID_ARGUMENT):
        route(conn, t["id"], t["lease_token"], "a")
    assert world(conn) == before


def test_route_refused_by_accepts_from_changes_nothing(conn, lane, session):
    add_lane(conn, "review", accepts_from=["implement"])
    add_lane(conn, "closed", accepts_from=[])
    add_lane(conn, "implement")
    enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(ROUTE_REFUSED) as info:
        route(conn, t["id"], t["lease_token"], "review")
    assert "implement" in str(info.value.diag.message_hint)
    with refused(ROUTE_REFUSED):
        route(conn, t["id"], t["lease_token"], "closed")
    assert world(conn) == before
    # the lease is intact: routing to a lane that accepts it still works
    assert route(conn, t["id"], t["lease_token"], "implement") == "queued"


def test_route_accepted_by_accepts_from(conn, lane, session):
    add_lane(conn, "review", accepts_from=["x", "a"])
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    assert route(conn, task_id, t["lease_token"], "review") == "queued"
    assert task(conn, task_id)["lane"] == "review"


# ------------------------------------------------------------------------------------------------
# record_run


TOKENS = {
    "exit_code": 0,
    "tier": "large",
    "model": "claude-x",
    "agent_session": "ag-9",
    "input_tokens": 1200,
    "cache_creation_tokens": 300,
    "cache_read_tokens": 45000,
    "output_tokens": 800,
    "cost_usd": 0.4321,
    "log_path": "/logs/1.log",
    "error_tail": "warning: something",
}


def test_route_into_a_lane_that_has_the_key_is_refused_and_changes_nothing(conn, lane, session):
    """Keys are per lane: the target lane's own task of that key stays the only one there."""
    add_lane(conn, "review")
    theirs = enqueue(conn, "review", "issue:3")
    task_id = enqueue(conn, lane, "issue:3")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(ROUTE_REFUSED) as err:
        route(conn, task_id, t["lease_token"], "review")
    assert str(err.value.diag.message_primary) == (
        f"lane 'review' already has a task of key 'issue:3' (task {theirs}): task {task_id} cannot be routed there")
    assert "a key names one task in each lane" in str(err.value.diag.message_hint)
    assert world(conn) == before  # still running, its lease held
    # and the task completes where it is
    assert complete(conn, task_id, t["lease_token"]) == "done"


def test_route_into_a_lane_the_keys_task_left_is_refused(conn, lane, session):
    """A task keeps its key in the lanes it left: another task of the key is not routed in there."""
    add_lane(conn, "review")
    add_lane(conn, "c")
    first = enqueue(conn, "review", "issue:8")
    route(conn, first, claim_one(conn, open_session(conn, "review"))["lease_token"], "c")
    second = enqueue(conn, lane, "issue:8")
    t = claim_one(conn, session)
    assert t["id"] == second
    with as_key(conn, "fleet_worker", {"role": "fleet_worker", "fleet_lanes": ["a", "review"]}), \
            refused(ROUTE_REFUSED) as err:
        route(conn, second, t["lease_token"], "review")
    text = str(err.value.diag.message_primary)
    assert text == f"lane 'review' already has a task of key 'issue:8': task {second} cannot be routed there", text
    with refused(ROUTE_REFUSED) as err:  # a key for every lane is told which task
        route(conn, second, t["lease_token"], "review")
    assert f"(task {first})" in str(err.value)
    assert task(conn, second)["state"] == "running"


def test_a_task_routed_back_to_a_lane_it_was_in_keeps_its_key_there(conn, lane, session):
    add_lane(conn, "review")
    task_id = enqueue(conn, lane, "issue:2")
    route(conn, task_id, claim_one(conn, session)["lease_token"], "review")
    t = claim_one(conn, open_session(conn, "review"))
    assert route(conn, task_id, t["lease_token"], "a") == "queued"
    assert task(conn, task_id)["lane"] == "a"
    assert enqueue_task(conn, "review", "issue:2") == (task_id, False)


def test_a_route_racing_an_enqueue_of_its_key_into_the_target_lane_is_refused(conn, lane, session, connect):
    """The enqueue commits while the route waits on the key's index entry: the route is refused (its
    unique violation is read as the refusal), never a raw error, never two tasks of the key."""
    add_lane(conn, "review")
    task_id = enqueue(conn, lane, "issue:6")
    t = claim_one(conn, session)
    producer = connect(autocommit=False)
    theirs = producer.execute("select task_id from fleet.enqueue_task('review', 'issue:6')").fetchone()[0]
    watch = connect()
    router = Call(connect(), lambda c: route(c, task_id, t["lease_token"], "review"))
    router.start()
    wait_until_waiting(watch, router.conn.info.backend_pid)
    producer.commit()
    with pytest.raises(psycopg.Error) as err:
        router.outcome()
    assert err.value.sqlstate == ROUTE_REFUSED, err.value
    assert f"(task {theirs})" in str(err.value)
    assert task(conn, task_id)["lane"] == "a" and task(conn, task_id)["state"] == "running"
    assert one(conn, "select count(*) from fleet.tasks where key = 'issue:6' and lane = 'review'") == 1


def test_record_run_records_tokens_and_cost(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    record_run(conn, t["lease_token"], TOKENS)
    [run] = runs(conn, task_id)
    for field, value in TOKENS.items():
        if field == "cost_usd":
            assert float(run[field]) == value
        else:
            assert run[field] == value, field
    assert task(conn, task_id)["agent_session"] == "ag-9"
    assert run["ended_at"] is None, "recording a run does not end it"
    assert task(conn, task_id)["state"] == "running"


def test_record_run_merges_partial_reports(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    record_run(conn, t["lease_token"], {"model": "m1", "input_tokens": 10})
    record_run(conn, t["lease_token"], {"output_tokens": 5})
    [run] = runs(conn, task_id)
    assert (run["model"], run["input_tokens"], run["output_tokens"]) == ("m1", 10, 5)


def test_record_run_is_allowed_after_the_lease_is_gone(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    complete(conn, task_id, t["lease_token"])
    record_run(conn, t["lease_token"], {"input_tokens": 7, "cost_usd": 1.5, "exit_code": 0})
    [run] = runs(conn, task_id)
    assert run["input_tokens"] == 7 and float(run["cost_usd"]) == 1.5
    assert run["outcome"] == "done"

    # a fenced (released) run still spent its tokens
    other = enqueue(conn, lane, "other")
    t = claim_one(conn, session)
    release(conn, other)
    record_run(conn, t["lease_token"], {"output_tokens": 99})
    assert runs(conn, other)[0]["output_tokens"] == 99


def test_record_run_agent_session_only_from_the_latest_run(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    first = claim_one(conn, session)
    release(conn, task_id)
    second = claim_one(conn, session)
    record_run(conn, first["lease_token"], {"agent_session": "old", "input_tokens": 1})
    assert task(conn, task_id)["agent_session"] is None, "a superseded run does not set it"
    assert runs(conn, task_id)[0]["agent_session"] == "old", "but its run row keeps it"
    record_run(conn, second["lease_token"], {"agent_session": "new"})
    assert task(conn, task_id)["agent_session"] == "new"
    record_run(conn, first["lease_token"], {"agent_session": "older"})
    assert task(conn, task_id)["agent_session"] == "new"


def test_record_run_without_agent_session_keeps_the_tasks(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    hand_off(conn, task_id, t["lease_token"], {"agent_session": "from-snapshot"})
    record_run(conn, t["lease_token"], {"input_tokens": 3})
    assert task(conn, task_id)["agent_session"] == "from-snapshot"


def test_record_run_after_a_route_does_not_leak_the_agent_session_into_the_next_lane(
    conn, lane, session
):
    add_lane(conn, "review")
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    route(conn, task_id, t["lease_token"], "review")
    # the shift reports the finished run after routing it (allowed: the lease is gone)
    record_run(conn, t["lease_token"], {"agent_session": "triage-agent", "input_tokens": 5})
    after = task(conn, task_id)
    assert after["lane"] == "review"
    assert after["agent_session"] is None, "the review stage starts with a fresh agent session"
    assert runs(conn, task_id)[0]["agent_session"] == "triage-agent"


def test_record_run_refusals(conn, lane, session):
    enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(UNKNOWN_TASK):
        record_run(conn, uuid.uuid4(), {"input_tokens": 1})
    with refused(UNKNOWN_TASK):
        record_run(conn, None, {"input_tokens": 1})
    for bad in (None, [1], "x", 3):
        with refused(INVALID_ARGUMENT):
            record_run(conn, t["lease_token"], bad)
    assert world(conn) == before


def test_record_run_answers_another_lanes_token_as_a_made_up_one(conn, lane, session):
    """A key of lane a learns nothing from record_run about lane b's runs: a real token of b and a
    token nobody holds get the same answer (code, message, hint), and neither is recorded."""
    add_lane(conn, "b")
    enqueue(conn, "b", "theirs")
    theirs = claim_one(conn, open_session(conn, "b"))["lease_token"]
    enqueue(conn, lane, "mine")
    mine = claim_one(conn, session)["lease_token"]
    before = world(conn)
    a_key = {"role": "fleet_worker", "fleet_lanes": ["a"]}
    answers = []
    for token in (theirs, uuid.uuid4(), None):
        with as_key(conn, "fleet_worker", a_key), refused(LANE_NOT_ALLOWED) as err:
            record_run(conn, token, {"input_tokens": 1})
        d = err.value.diag
        answers.append((err.value.sqlstate, d.message_primary, d.message_detail, d.message_hint))
    assert answers[0] == answers[1] == answers[2], answers
    assert "'b'" not in answers[0][1] and "not allowed for this key" in answers[0][1]
    assert world(conn) == before
    with as_key(conn, "fleet_worker", a_key):
        record_run(conn, mine, {"input_tokens": 1})  # its own: recorded
    # a key of every lane: the real token is recorded, a made-up one is unknown
    with refused(UNKNOWN_TASK):
        record_run(conn, uuid.uuid4(), {"input_tokens": 1})
    record_run(conn, theirs, {"input_tokens": 2})
    assert one(conn, "select input_tokens from fleet.runs where lease_token = %s", (theirs,)) == 2


@pytest.mark.parametrize(
    "report",
    [
        {"input_tokens": -1},
        {"output_tokens": "many"},
        {"cost_usd": -0.5},
        {"exit_code": 1.5},
        {"exit_code": "zero"},
        {"cache_read_tokens": 1e30},
        {"reasoning_tokens": -1},
        {"reasoning_tokens": 2.5},
        {"reasoning_tokens": "lots"},
        {"cost_source": "guessed"},
    ],
)
def test_record_run_malformed_numbers_are_invalid_arguments(conn, lane, session, report):
    enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(INVALID_ARGUMENT):
        record_run(conn, t["lease_token"], report | {"agent_session": "x"})
    assert world(conn) == before


def test_record_run_records_the_agent_its_reasoning_tokens_and_where_the_cost_came_from(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    record_run(conn, t["lease_token"], {"agent": "codex", "input_tokens": 10, "output_tokens": 5,
                                        "reasoning_tokens": 3, "cost_usd": 0.25, "cost_source": "computed"})
    [run] = runs(conn, task_id)
    assert (run["agent"], run["reasoning_tokens"], run["cost_source"]) == ("codex", 3, "computed")
    # reasoning tokens are part of the output tokens: never added to a total
    assert one(conn, "select tokens from fleet.task_spend(%s)", (task_id,)) == 15
    record_run(conn, t["lease_token"], {"input_tokens": 11})  # a partial report keeps them
    [run] = runs(conn, task_id)
    assert (run["agent"], run["reasoning_tokens"], run["cost_source"]) == ("codex", 3, "computed")
    record_run(conn, t["lease_token"], {"cost_source": "reported"})
    assert runs(conn, task_id)[0]["cost_source"] == "reported"


def _profile_lane(conn: psycopg.Connection, floor: float | None = None) -> str:
    """Lane ``p`` whose tasks run under profile ``prof`` of pool ``pool`` (``floor``: its throttle floor)."""
    one(conn, "select fleet.sync_pool('pool', null)")
    if floor is None:
        one(conn, "select fleet.sync_profile('prof', 'pool', '{}')")
    else:
        one(conn, "select fleet.sync_profile('prof', 'pool', '{}', %s)", (floor,))
    return add_lane(conn, "p", config={"profile": "prof"})


def test_record_run_says_where_the_agent_session_lives(conn):
    lane = _profile_lane(conn)
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, open_session(conn, lane, host="host-7"))
    assert (t["agent_session_host"], t["agent_session_profile"]) == (None, None)
    record_run(conn, t["lease_token"], {"input_tokens": 1})
    assert task(conn, task_id)["agent_session_host"] is None, "no agent session, no place"
    record_run(conn, t["lease_token"], {"agent_session": "ag-1"})
    after = task(conn, task_id)
    assert (after["agent_session"], after["agent_session_host"], after["agent_session_profile"]) == (
        "ag-1", "host-7", "prof")
    # the next claim's rows carry them, wherever it runs
    release(conn, task_id)
    again = claim_one(conn, open_session(conn, lane, host="host-8"))
    assert (again["agent_session"], again["agent_session_host"], again["agent_session_profile"]) == (
        "ag-1", "host-7", "prof")
    # an agent session reported as null says it lives nowhere
    record_run(conn, again["lease_token"], {"agent_session": None})
    after = task(conn, task_id)
    assert (after["agent_session"], after["agent_session_host"], after["agent_session_profile"]) == (None, None, None)


def test_a_hand_off_naming_an_agent_session_says_where_it_lives(conn):
    lane = _profile_lane(conn)
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, open_session(conn, lane, host="host-3"))
    hand_off(conn, task_id, t["lease_token"], {"agent_session": "ag-3"})
    after = task(conn, task_id)
    assert (after["agent_session"], after["agent_session_host"], after["agent_session_profile"]) == (
        "ag-3", "host-3", "prof")
    # a snapshot without one keeps the session and its place
    t = claim_one(conn, open_session(conn, lane, host="host-4"))
    hand_off(conn, task_id, t["lease_token"], {})
    after = task(conn, task_id)
    assert (after["agent_session"], after["agent_session_host"]) == ("ag-3", "host-3")


def test_route_clears_where_the_agent_session_lived_and_the_transients(conn, lane, session):
    add_lane(conn, "review")
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    record_run(conn, t["lease_token"], {"agent_session": "ag-1"})
    transient(conn, task_id, t["lease_token"], after_seconds=0)
    t = claim_one(conn, session)
    assert route(conn, task_id, t["lease_token"], "review") == "queued"
    after = task(conn, task_id)
    assert (after["agent_session"], after["agent_session_host"], after["agent_session_profile"]) == (None, None, None)
    assert after["transients"] == 0
    assert after["stages"][0]["transients"] == 1


@pytest.mark.parametrize("transition", ["cancel", "release", "complete"])
def test_record_run_racing_a_transition_of_its_task_does_not_deadlock(
    db_url: str, transition: str
) -> None:
    """record_run must take its locks in the order every transition does: task, then run.

    The interleaving is arranged with a third transaction holding the run row: record_run queues
    on the run row first, then the transition locks the task and queues behind it. Taking the run
    row before the task (as record_run did) then closes a cycle, and Postgres kills one side with
    a deadlock error (40P01) - a lost token report or a lost cancel.
    """
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into fleet.lanes (name) values ('a')")
        c.execute("select fleet.enqueue('a', 'k')")
        sid = open_session(c, "a", "h", 1)
        task_id, token = c.execute(
            "select id, lease_token from fleet.claim(%s, 1)", (sid,)
        ).fetchone()  # type: ignore[misc]

    with (
        psycopg.connect(db_url, autocommit=True) as watch,
        psycopg.connect(db_url) as holder,
        psycopg.connect(db_url, autocommit=True) as reporter,
        psycopg.connect(db_url, autocommit=True) as actor,
    ):
        holder.execute("select 1 from fleet.runs where lease_token = %s for update", (token,))
        results: dict[str, Any] = {}

        def call(name: str, conn: psycopg.Connection, query: str, params: Any) -> None:
            try:
                results[name] = conn.execute(query, params).fetchone()
            except psycopg.Error as exc:
                results[name] = exc

        report = threading.Thread(
            target=call,
            args=(
                "record_run",
                reporter,
                "select fleet.record_run(%s, %s)",
                (token, Jsonb({"agent_session": "ag", "input_tokens": 10})),
            ),
        )
        report.start()
        wait_until_waiting(watch, reporter.info.backend_pid)
        query = {
            "cancel": ("select fleet.cancel(%s)", (task_id,)),
            "release": ("select fleet._release(%s, 'lease-expired')", (task_id,)),
            "complete": ("select fleet.complete(%s, %s)", (task_id, token)),
        }[transition]
        act = threading.Thread(target=call, args=(transition, actor, *query))
        act.start()
        wait_until_waiting(watch, actor.info.backend_pid)
        holder.rollback()
        report.join(timeout=30)
        act.join(timeout=30)

    errors = {k: v for k, v in results.items() if isinstance(v, BaseException)}
    assert not errors, errors
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute("select input_tokens from fleet.runs").fetchone() == (10,)
        state = c.execute("select state from fleet.tasks").fetchone()
        assert state == (
            {"cancel": "cancelled", "release": "queued", "complete": "done"}[transition],
        )


# ------------------------------------------------------------------------------------------------
# a task's verify gate: fleet.gate_verdict, the gate outcome → transition in the database


@pytest.mark.parametrize("gate, state, reason", [
    ("ok", "done", None), ("task-failed", "queued", None),
    ("automation-broken", "blocked", "automation-broken"),
    ("capability-unavailable", "blocked", "capability-unavailable")])
def test_the_gate_verdict_decides_the_tasks_transition(conn, lane, session, gate: str, state: str,
                                                       reason: str | None) -> None:
    enqueue(conn, lane)
    t = claim_one(conn, session)
    got = one(conn, "select fleet.gate_verdict(%s, %s, %s, %s, %s)",
              (t["id"], t["lease_token"], gate, "FAILED test_x", Jsonb({"summary": "did it"})))
    assert got == state
    row = task(conn, t["id"])
    assert (row["state"], row["block_reason"]) == (state, reason)
    if gate == "ok":
        assert row["result"] == {"summary": "did it", "gate": "ok"}
    if gate == "task-failed":  # a failed attempt with the gate's evidence, reason verify-failed
        assert row["failures"] == 1 and row["last_error"] == "verify gate failed: FAILED test_x"
        assert runs(conn, t["id"])[-1]["reason"] == "verify-failed"


def test_an_unknown_gate_verdict_is_refused_and_keeps_the_lease(conn, lane, session) -> None:
    enqueue(conn, lane)
    t = claim_one(conn, session)
    with refused("LF005"):
        one(conn, "select fleet.gate_verdict(%s, %s, 'looks fine', null, null)", (t["id"], t["lease_token"]))
    assert task(conn, t["id"])["state"] == "running"


def test_a_gate_verdict_with_a_stale_token_changes_nothing(conn, lane, session) -> None:
    enqueue(conn, lane)
    t = claim_one(conn, session)
    with refused("LF001"):
        one(conn, "select fleet.gate_verdict(%s, %s, 'ok', null, null)", (t["id"], uuid.uuid4()))
    assert task(conn, t["id"])["state"] == "running"


# ------------------------------------------------------------------------------------------------
# transient: a provider-side error that says nothing about the work


def _ready(conn: psycopg.Connection) -> None:
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s' where state = 'queued'")


def test_transient_requeues_with_backoff_and_counts_no_failure(conn, lane, session):
    conn.execute("update fleet.lanes set backoff_base_seconds = 10, backoff_max_seconds = 35")
    task_id = enqueue(conn, lane, "k")
    delays = []
    for n in range(1, 5):  # past the lane's max_attempts (3): none of these is a failure
        _ready(conn)
        t = claim_one(conn, session)
        record_run(conn, t["lease_token"], {"agent_session": "ag-1"})
        assert transient(conn, task_id, t["lease_token"], f"529 overloaded {n}") == "queued"
        after = task(conn, task_id)
        assert (after["state"], after["failures"], after["transients"], after["attempts"]) == ("queued", 0, n, n)
        assert after["carry_over"] is True and after["agent_session"] == "ag-1"
        assert after["agent_session_host"] == "host-1"
        assert after["lease_token"] is None and after["session_id"] is None and after["last_error"] is None
        delays.append(seconds_between(conn, task_id, "run_at", "updated_at"))
        assert claim(conn, session) == [], "a task in backoff is not claimable"
        ev = last_event(conn, task_id)
        assert ev["kind"] == "transient"
        assert datetime.fromisoformat(ev["detail"].pop("retry_at")) == after["run_at"]
        assert ev["detail"] == {"attempt": n, "error": f"529 overloaded {n}", "transients": n,
                                "max_transient": 10, "pool": None}
    assert delays == [10, 20, 35, 35]  # base * 2^(transients before), capped at backoff_max
    assert [(r["outcome"], r["reason"], r["error_tail"]) for r in runs(conn, task_id)] == [
        ("transient", "transient", f"529 overloaded {n}") for n in range(1, 5)]
    assert "failed" not in kinds(conn, task_id)


def test_transient_backoff_is_at_least_five_seconds(conn, lane, session):
    conn.execute("update fleet.lanes set backoff_base_seconds = 0")
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    transient(conn, task_id, t["lease_token"])
    assert seconds_between(conn, task_id, "run_at", "updated_at") == 5


@pytest.mark.parametrize("after", [0, 2.5, 86400])
def test_transient_waits_what_the_provider_said(conn, lane, session, after: float):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    assert transient(conn, task_id, t["lease_token"], "retry-after", after_seconds=after) == "queued"
    assert seconds_between(conn, task_id, "run_at", "updated_at") == after


def test_transient_past_max_transient_is_a_failure_by_fails_rules(conn, lane, session):
    conn.execute("""update fleet.lanes set config = config || '{"max_transient": 2}'""")
    task_id = enqueue(conn, lane, "k")  # lane cap: 3 attempts
    got = []
    for _ in range(5):
        _ready(conn)
        t = claim_one(conn, session)
        got.append(transient(conn, task_id, t["lease_token"], "overloaded"))
        after = task(conn, task_id)
        got.append((after["transients"], after["failures"]))
    assert got == ["queued", (1, 0), "queued", (2, 0),
                   "queued", (2, 1), "queued", (2, 2), "dead", (2, 3)]
    after = task(conn, task_id)
    assert (after["state"], after["dead_reason"], after["last_error"]) == ("dead", "attempt-cap", "overloaded")
    assert [(r["outcome"], r["reason"]) for r in runs(conn, task_id)] == [
        ("transient", "transient")] * 2 + [("failed", "transient")] * 3
    ev = last_event(conn, task_id)
    assert ev["kind"] == "failed"
    assert (ev["detail"]["failure"], ev["detail"]["state"], ev["detail"]["reason"]) == ("transient", "dead", "attempt-cap")


def test_transient_with_max_transient_zero_is_a_failure_at_once(conn, lane, session):
    conn.execute("""update fleet.lanes set config = config || '{"max_transient": 0}'""")
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    assert transient(conn, task_id, t["lease_token"]) == "queued"
    assert (task(conn, task_id)["failures"], task(conn, task_id)["transients"]) == (1, 0)
    assert kinds(conn, task_id)[-1] == "failed"


@pytest.mark.parametrize("after", [-1, 86400.5, float("nan"), float("inf")])
def test_transient_refuses_a_bad_delay_and_changes_nothing(conn, lane, session, after: float):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(INVALID_ARGUMENT) as err:
        transient(conn, task_id, t["lease_token"], after_seconds=after)
    assert str(after).lower().replace("inf", "infinity") in str(err.value).lower()
    assert world(conn) == before


def test_transient_is_fenced(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    before = world(conn)
    with refused(LEASE_LOST):
        transient(conn, task_id, uuid.uuid4())
    with refused(UNKNOWN_TASK):
        transient(conn, task_id + 100, uuid.uuid4())
    assert world(conn) == before


# ------------------------------------------------------------------------------------------------
# drop_session: the agent session the task was to resume does not exist


def test_drop_session_forgets_the_agent_session_and_requeues_at_once(conn):
    lane = _profile_lane(conn)
    task_id = enqueue(conn, lane, "k")
    session = open_session(conn, lane, host="host-5")
    t = claim_one(conn, session)
    record_run(conn, t["lease_token"], {"agent_session": "ag-gone"})
    checkpoint(conn, task_id, t["lease_token"], {"step": 2})
    assert drop_session(conn, task_id, t["lease_token"], "No conversation found with session ID") == "queued"
    after = task(conn, task_id)
    assert (after["agent_session"], after["agent_session_host"], after["agent_session_profile"]) == (None, None, None)
    assert (after["state"], after["failures"], after["evaporations"], after["attempts"]) == ("queued", 0, 0, 1)
    assert after["carry_over"] is True and after["checkpoint"] == {"step": 2}
    assert after["lease_token"] is None and after["session_id"] is None
    assert one(conn, "select run_at <= now() from fleet.tasks where id = %s", (task_id,))
    [run] = runs(conn, task_id)
    assert (run["outcome"], run["agent_session"]) == ("session_dropped", "ag-gone")
    ev = last_event(conn, task_id)
    assert (ev["kind"], ev["detail"]) == ("session_dropped", {
        "attempt": 1, "agent_session": "ag-gone", "note": "No conversation found with session ID"})
    # the next attempt starts fresh: claimed at once
    again = claim_one(conn, session)
    assert (again["id"], again["attempts"], again["agent_session"]) == (task_id, 2, None)


def test_drop_session_without_an_agent_session_is_refused_so_it_cannot_loop(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(INVALID_ARGUMENT) as err:
        drop_session(conn, task_id, t["lease_token"])
    assert "nothing to drop" in str(err.value)
    assert world(conn) == before
    assert task(conn, task_id)["state"] == "running"


def test_drop_session_is_fenced(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    record_run(conn, t["lease_token"], {"agent_session": "ag-1"})
    before = world(conn)
    with refused(LEASE_LOST):
        drop_session(conn, task_id, uuid.uuid4())
    assert world(conn) == before
    assert task(conn, task_id)["agent_session"] == "ag-1"


def test_cannot_start_hands_the_task_back_unspent_and_pauses_its_lane(conn, lane, session):
    first, second = enqueue(conn, lane, "k1"), enqueue(conn, lane, "k2")
    t = claim_one(conn, session)
    assert t["id"] == first
    error = "lanes.a: the agent program 'claudee' cannot start on host-1: not found on PATH (exit 127)"
    assert one(conn, "select fleet.cannot_start(%s, %s, %s)", (first, t["lease_token"], error)) == "queued"
    after = task(conn, first)
    assert (after["state"], after["failures"], after["evaporations"], after["handoffs"], after["attempts"]) == (
        "queued", 0, 0, 0, 1)
    assert after["last_error"] == error and after["lease_token"] is None and after["session_id"] is None
    [run] = runs(conn, first)
    assert (run["outcome"], run["error_tail"]) == ("not_started", error)
    assert last_event(conn, first)["kind"] == "not_started"
    assert one(conn, "select paused_reason from fleet.lanes where name = %s", (lane,)) == error
    [paused] = rows(conn, "select detail from fleet.journal where kind = 'lane_paused'")
    assert (paused["detail"]["by"], paused["detail"]["task"]) == ("run", first)
    # the lane claims nothing more into the same mistake: the other task, and this one, wait
    assert claim(conn, session, 5) == []
    assert task(conn, second)["state"] == "queued"
    # a sync of the fixed config clears the pause: both are claimed, the first with its attempts intact
    one(conn, "select fleet.sync_lane(%s, %s)", (lane, Jsonb({"paused_reason": None})))
    assert sorted(t["id"] for t in claim(conn, session, 5)) == [first, second]


def test_cannot_start_is_fenced(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    before = world(conn)
    with refused(LEASE_LOST):
        one(conn, "select fleet.cannot_start(%s, %s, 'nope')", (task_id, uuid.uuid4()))
    assert world(conn) == before
    assert one(conn, "select paused_reason from fleet.lanes where name = %s", (lane,)) is None


# ------------------------------------------------------------------------------------------------
# throttle: a floor in the database, and the signal that matched


def _throttle_delay(conn: psycopg.Connection, task_id: int) -> float:
    return seconds_between(conn, task_id, "run_at", "updated_at")


def test_throttle_never_queues_sooner_than_the_default_floor(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    record_run(conn, t["lease_token"], {"agent_session": "ag-1"})
    until = throttle(conn, task_id, t["lease_token"], until=datetime.now().astimezone() - timedelta(hours=1))
    assert _throttle_delay(conn, task_id) == 60
    assert until == task(conn, task_id)["run_at"]
    assert (task(conn, task_id)["agent_session"], task(conn, task_id)["failures"]) == ("ag-1", 0)
    _ready(conn)
    t = claim_one(conn, session)
    throttle(conn, task_id, t["lease_token"], after_seconds=0)
    assert _throttle_delay(conn, task_id) == 60
    _ready(conn)
    t = claim_one(conn, session)
    throttle(conn, task_id, t["lease_token"], after_seconds=90)  # longer than the floor: as said
    assert _throttle_delay(conn, task_id) == 90
    _ready(conn)
    t = claim_one(conn, session)
    throttle(conn, task_id, t["lease_token"])  # nothing said: 15 minutes
    assert _throttle_delay(conn, task_id) == 900


def test_throttle_honours_the_profiles_floor_for_the_task_and_its_pool(conn):
    lane = _profile_lane(conn, floor=300)
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, open_session(conn, lane))
    assert t["run_profile"] == "prof" and t["pool"] == "pool"
    until = throttle(conn, task_id, t["lease_token"], after_seconds=10, note="limit")
    assert _throttle_delay(conn, task_id) == 300
    assert one(conn, "select throttled_until from fleet.pools where name = 'pool'") == until
    # a floor of 0 lets a zero delay through
    one(conn, "select fleet.sync_profile('prof', 'pool', '{}', 0)")
    conn.execute("update fleet.pools set throttled_until = null")
    _ready(conn)
    t = claim_one(conn, open_session(conn, lane))
    throttle(conn, task_id, t["lease_token"], after_seconds=0)
    assert _throttle_delay(conn, task_id) == 0


def test_throttle_keeps_the_signal_that_matched_in_its_event(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    signal = {"signal": "rate_limit_event", "text": "x" * 1500, "reset": "2026-12-01T15:00:00+00:00"}
    throttle(conn, task_id, t["lease_token"], note="limit", after_seconds=120, signal=signal)
    ev = last_event(conn, task_id)
    assert ev["kind"] == "throttled"
    assert (ev["detail"]["signal"], ev["detail"]["text"], ev["detail"]["reset_read"]) == (
        "rate_limit_event", "x" * 1000, "2026-12-01T15:00:00+00:00")
    _ready(conn)
    t = claim_one(conn, session)
    throttle(conn, task_id, t["lease_token"], signal={"signal": "pattern", "text": "usage limit", "reset": None})
    detail = last_event(conn, task_id)["detail"]
    assert (detail["signal"], detail["text"]) == ("pattern", "usage limit") and "reset_read" not in detail
    _ready(conn)
    t = claim_one(conn, session)
    before = world(conn)
    with refused(INVALID_ARGUMENT):
        throttle(conn, task_id, t["lease_token"], signal=["not", "an", "object"])
    assert world(conn) == before


def test_sync_profile_keeps_the_throttle_floor(conn):
    one(conn, "select fleet.sync_pool('pool', null)")
    assert one(conn, "select fleet.sync_profile('prof', 'pool', '{}')") == "created"
    assert one(conn, "select throttle_floor_seconds from fleet.profiles") == 60
    assert one(conn, "select fleet.sync_profile('prof', 'pool', '{}', 60)") == "unchanged"
    assert one(conn, "select fleet.sync_profile('prof', 'pool', '{}', 120)") == "updated"
    assert one(conn, "select throttle_floor_seconds from fleet.profiles") == 120
    assert last_event_of(conn, "profile_updated")["throttle_floor_seconds"] == 120
    for bad in (-1, float("nan"), float("inf")):
        with refused(INVALID_ARGUMENT):
            one(conn, "select fleet.sync_profile('prof', 'pool', '{}', %s)", (bad,))
    assert one(conn, "select throttle_floor_seconds from fleet.profiles") == 120


@pytest.mark.parametrize("asked", [
    {"until": "9999-12-31T00:00:00Z"},
    {"until": "infinity"},
    {"until": "now() + 9 days"},
    {"after_seconds": 9 * 86400},
    {"after_seconds": 1e300},
    {"after_seconds": float("inf")},
], ids=["9999", "infinity", "9 days", "9 days later", "1e300 s", "inf s"])
def test_a_workers_throttle_pauses_its_pool_at_most_the_longest_window(conn, asked: dict[str, Any]):
    """Whichever argument asks for longer, the pool (every lane drawing from it) and the task wait
    at most fleet._longest_throttle(); the event says it was cut, and what was asked."""
    lane = _profile_lane(conn)
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, open_session(conn, lane))
    until_arg = asked.get("until")
    if until_arg == "now() + 9 days":
        until_arg = one(conn, "select now() + interval '9 days'")
    until = throttle(conn, task_id, t["lease_token"], until=until_arg, note="limit",
                     after_seconds=asked.get("after_seconds"))
    assert _throttle_delay(conn, task_id) == 8 * 86400
    assert one(conn, "select throttled_until from fleet.pools where name = 'pool'") == until
    detail = last_event(conn, task_id)["detail"]
    assert detail["capped"] is True and detail["until"] and detail["pool_until"]
    assert ("asked_until" in detail) == ("until" in asked)
    # a reset within the window is as said, and not marked cut
    conn.execute("update fleet.pools set throttled_until = null")
    _ready(conn)
    t = claim_one(conn, open_session(conn, lane))
    throttle(conn, task_id, t["lease_token"], after_seconds=7 * 86400)
    assert _throttle_delay(conn, task_id) == 7 * 86400
    assert "capped" not in last_event(conn, task_id)["detail"]


def test_the_longest_throttle_is_the_workers_longest_believed_reset() -> None:
    assert LONGEST_THROTTLE_SECONDS == LONGEST_RESET.total_seconds() == 8 * 86400


def test_the_longest_throttle_is_one_constant_in_the_database(conn):
    assert one(conn, "select extract(epoch from fleet._longest_throttle())") == LONGEST_THROTTLE_SECONDS


@pytest.mark.parametrize("after", [-1, float("nan")])
def test_throttle_refuses_a_negative_delay_and_changes_nothing(conn, lane, session, after: float):
    enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(INVALID_ARGUMENT):
        throttle(conn, t["id"], t["lease_token"], after_seconds=after)
    assert world(conn) == before


def test_a_pools_throttle_records_who_set_it(conn):
    """The pool keeps who gave it the reset it waits for: the task, its lane, session, host and
    profile, and the caller's role and key; a shorter pause from another run leaves them."""
    lane = _profile_lane(conn)
    one(conn, "select fleet.sync_lane('q', %s)", (Jsonb({"config": {"profile": "prof"}}),))
    first = enqueue(conn, lane, "k1")
    second = enqueue(conn, "q", "k2")
    s1, s2 = open_session(conn, lane, host="host-a"), open_session(conn, "q", host="host-b")
    t1, t2 = claim_one(conn, s1), claim_one(conn, s2)
    assert (t1["pool"], t2["pool"]) == ("pool", "pool")
    key = {"role": "fleet_worker", "fleet_lanes": ["p"], "sub": "lanefleet:worker:abc"}
    with conn.transaction():  # as PostgREST makes the call (the settings end with it)
        conn.execute("select set_config('role', 'fleet_worker', true)")
        conn.execute("select set_config('request.jwt.claims', %s, true)", (json.dumps(key),))
        until = throttle(conn, first, t1["lease_token"], after_seconds=3600, note="weekly limit")
    pool = rows(conn, "select * from fleet.pools where name = 'pool'")[0]
    assert pool["throttled_until"] == until and pool["throttle_note"] == "weekly limit"
    by = pool["throttled_by"]
    assert {k: by[k] for k in ("task", "lane", "session", "host", "profile", "role", "key")} == {
        "task": first, "lane": "p", "session": str(s1), "host": "host-a", "profile": "prof",
        "role": "fleet_worker", "key": "lanefleet:worker:abc"}
    assert by["at"]
    detail = last_event(conn, first)["detail"]
    assert detail["host"] == "host-a" and detail["pool_until"]
    assert detail["by"] == {"role": "fleet_worker", "key": "lanefleet:worker:abc"}
    # a shorter pause from another lane's run: the pool keeps the longer reset and who set it
    throttle(conn, second, t2["lease_token"], after_seconds=120, note="short")
    pool = rows(conn, "select * from fleet.pools where name = 'pool'")[0]
    assert (pool["throttled_until"], pool["throttled_by"], pool["throttle_note"]) == (until, by, "weekly limit")
    assert _throttle_delay(conn, second) == 120  # the task itself waits what it was told
    # a later reset from a direct connection: its login is the role, no key
    conn.execute("update fleet.pools set throttled_until = null")
    _ready(conn)
    t3 = claim_one(conn, s2)
    throttle(conn, t3["id"], t3["lease_token"], after_seconds=7200)
    by = one(conn, "select throttled_by from fleet.pools where name = 'pool'")
    assert (by["task"], by["lane"], by["host"]) == (second, "q", "host-b")
    assert by["role"] == one(conn, "select session_user::text") and "key" not in by


def test_sync_profile_refuses_a_throttle_floor_past_the_longest_window(conn):
    one(conn, "select fleet.sync_pool('pool', null)")
    assert one(conn, "select fleet.sync_profile('prof', 'pool', '{}', %s)", (8 * 86400,)) == "created"
    with refused(INVALID_ARGUMENT) as err:
        one(conn, "select fleet.sync_profile('prof', 'pool', '{}', %s)", (8 * 86400 + 1,))
    assert "throttle_floor must be 0 to 691200 seconds" in str(err.value)
    assert one(conn, "select throttle_floor_seconds from fleet.profiles") == 8 * 86400


def last_event_of(conn: psycopg.Connection, kind: str) -> dict[str, Any]:
    return one(conn, "select detail from fleet.journal where kind = %s order by id desc limit 1", (kind,))


def test_complete_many_json_is_complete_many_answering_one_value(lanes: psycopg.Connection) -> None:
    conn = lanes
    _, [a, b, c] = running_tasks(conn, "docs", 3)
    got = one(conn, "select fleet.complete_many_json(%s::bigint[], %s::uuid[])",
              ([c["id"], a["id"], b["id"]], [c["lease_token"], uuid.uuid4(), b["lease_token"]]))
    assert got == [{"task_id": c["id"], "status": "done"}, {"task_id": a["id"], "status": "lost"},
                   {"task_id": b["id"], "status": "done"}]
    assert (task(conn, a["id"])["state"], task(conn, b["id"])["state"]) == ("running", "done")
    with refused("LF005"):
        one(conn, "select fleet.complete_many_json(%s::bigint[], %s::uuid[])",
            ([a["id"], a["id"]], [a["lease_token"], a["lease_token"]]))
    assert task(conn, a["id"])["state"] == "running"
