"""The claim group (migrations/sources/06_claim.sql): fleet.claim, called over psycopg against a real,
freshly migrated PostgreSQL: what a claim leases and in what order, every limit it keeps
(max_running, pools, review_cap, daily budgets, the session's deadline), its refusals, and claims
under concurrency.

The acceptance criterion: 8 claimers, each a thread with its own connection and its own session,
drain 1,000 tasks from a lane with max_running 5 while a watcher polls the running count; the
count never exceeds the slots, and no task is claimed twice. The claim locks the lane row only for a
lane with a limit counted across claims; a lane without one lets claims run side by side, and pools
count their slots under their own locks. Claims in flight are held open in explicit transactions on
their own connections; a waiter is seen waiting in pg_stat_activity, never inferred from a sleep.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import errors
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from sqlkit import (
    INVALID_ARGUMENT,
    RUNNING_INDEXES,
    SESSION_NOT_ACTIVE,
    Call,
    add_lane,
    as_key,
    assert_index_only,
    bind,
    cancel,
    claim,
    claim_one,
    close_session,
    complete,
    count,
    enqueue,
    enqueue_many,
    fail,
    fill,
    function_body,
    generic_plans,
    hand_off,
    kinds,
    last_event,
    lease_left,
    leases,
    loop_queries,
    one,
    open_session,
    parenthesised_after,
    pick,
    record_run,
    refused,
    release,
    running,
    runs,
    seconds_between,
    sync_lane,
    task,
    wait_until_waiting,
    world,
)

# ------------------------------------------------------------------------------------------------
# what a claim leases, in what order


def test_claim_leases_the_task(conn, lane, session):
    conn.execute("update fleet.lanes set lease_seconds = 45 where name = 'a'")
    task_id = enqueue(conn, lane, "k")
    got = claim(conn, session)
    assert [t["id"] for t in got] == [task_id]
    t = task(conn, task_id)
    assert got[0]["lease_token"] == t["lease_token"] is not None
    assert t["state"] == "running"
    assert t["attempts"] == 1
    assert t["session_id"] == session
    assert seconds_between(conn, task_id, "lease_expires_at", "updated_at") == 45
    [run] = runs(conn, task_id)
    assert run["attempt"] == 1
    assert run["session_id"] == session
    assert run["lane"] == "a"
    assert run["lease_token"] == t["lease_token"]
    assert run["ended_at"] is None and run["outcome"] is None
    assert kinds(conn, task_id) == ["enqueued", "claimed"]
    ev = last_event(conn, task_id)
    assert ev["session_id"] == session and ev["detail"] == {"attempt": 1}


def test_claim_renews_the_session_heartbeat(conn, lane, session):
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '1 hour'")
    assert claim(conn, session) == []
    assert one(conn, "select heartbeat_at > now() - interval '1 minute' from fleet.sessions")


def test_a_claim_renews_the_leases_its_session_holds(conn, lane, session):
    # a claim is a sign of life of its session: the lease of every task it holds follows it
    held = enqueue(conn, lane, "held")
    claim_one(conn, session)
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '59 seconds'")
    assert lease_left(conn, held) < 2
    assert claim(conn, session) == []  # nothing ready
    assert lease_left(conn, held) > 59


def test_claim_takes_only_its_own_lane(conn, lane, session):
    add_lane(conn, "b")
    other = enqueue(conn, "b", "in-b", priority=1000)
    mine = enqueue(conn, lane, "in-a")
    assert [t["id"] for t in claim(conn, session, 10)] == [mine]
    assert task(conn, other)["state"] == "queued"


def test_claim_order_priority_then_carry_over_then_run_at_then_id(conn, lane, session):
    same = "2020-01-01T00:00:00Z"
    a = enqueue(conn, lane, "a", priority=5, run_at="2019-01-01T00:00:00Z")
    b = enqueue(conn, lane, "b", priority=10, run_at="2021-01-01T00:00:00Z")
    c = enqueue(conn, lane, "c", priority=10, run_at=same)
    d = enqueue(conn, lane, "d", priority=10, run_at=same)
    e = enqueue(conn, lane, "e", priority=5, run_at="2022-01-01T00:00:00Z")
    conn.execute("update fleet.tasks set carry_over = true where id = %s", (e,))
    future = enqueue(conn, lane, "f", priority=1000, run_at="2999-01-01T00:00:00Z")
    order = [claim_one(conn, session)["id"] for _ in range(5)]
    assert order == [c, d, b, e, a]
    assert claim(conn, session) == [], "a task whose run_at is in the future is not claimed"
    assert task(conn, future)["state"] == "queued"
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s' where id = %s", (future,))
    assert claim_one(conn, session)["id"] == future


def test_claim_batch_returns_tasks_in_claim_order(conn, lane, session):
    old = enqueue(conn, lane, "old", priority=5, run_at="2019-01-01T00:00:00Z")
    resumed = enqueue(conn, lane, "resumed", priority=5, run_at="2022-01-01T00:00:00Z")
    top = enqueue(conn, lane, "top", priority=9, run_at="2023-01-01T00:00:00Z")
    conn.execute("update fleet.tasks set carry_over = true where id = %s", (resumed,))
    got = claim(conn, session, 10)
    assert [t["id"] for t in got] == [top, resumed, old]
    assert all(t["carry_over"] is False for t in got), "a claim clears carry_over"


def test_claim_limit(conn, lane, session):
    ids = [enqueue(conn, lane, f"k{i}") for i in range(5)]
    assert [t["id"] for t in claim(conn, session, 3)] == ids[:3]
    assert claim(conn, session, 0) == []
    assert [t["id"] for t in claim(conn, session, 10)] == ids[3:]
    assert claim(conn, session, 10) == []
    assert count(conn, "runs") == 5


@pytest.mark.parametrize("limit", [-1, None])
def test_claim_invalid_limit(conn, lane, session, limit):
    enqueue(conn, lane, "k")
    before = world(conn)
    with refused(INVALID_ARGUMENT):
        claim(conn, session, limit)
    assert world(conn) == before


def test_claim_run_at_in_the_future_is_not_claimed(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    conn.execute("update fleet.tasks set run_at = now() + interval '1 minute'")
    assert claim(conn, session) == []
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s'")
    assert claim_one(conn, session)["id"] == task_id


def test_claim_paused_lane_gives_nothing(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    conn.execute("update fleet.lanes set paused = true")
    assert claim(conn, session, 5) == []
    assert task(conn, task_id)["state"] == "queued"
    assert count(conn, "runs") == 0
    conn.execute("update fleet.lanes set paused = false")
    assert claim_one(conn, session)["id"] == task_id


def test_claim_respects_max_running_across_sessions(conn, session):
    conn.execute("update fleet.lanes set max_running = 2 where name = 'a'")
    other = open_session(conn, "a", host="host-2")
    ids = [enqueue(conn, "a", f"k{i}") for i in range(5)]
    first = claim(conn, session, 10)
    assert [t["id"] for t in first] == ids[:2]
    assert claim(conn, other, 10) == []
    assert claim(conn, session, 10) == []
    complete(conn, first[0]["id"], first[0]["lease_token"])
    assert [t["id"] for t in claim(conn, other, 10)] == [ids[2]]
    assert claim(conn, session, 10) == []
    assert one(conn, "select count(*) from fleet.tasks where state = 'running'") == 2


def test_claim_max_running_zero_and_unlimited(conn, lane, session):
    for i in range(4):
        enqueue(conn, lane, f"k{i}")
    conn.execute("update fleet.lanes set max_running = 0")
    assert claim(conn, session, 10) == []
    conn.execute("update fleet.lanes set max_running = null")
    assert len(claim(conn, session, 10)) == 4


def test_claim_counts_running_tasks_of_other_lanes_separately(conn, lane, session):
    add_lane(conn, "b", max_running=1)
    sb = open_session(conn, "b")
    enqueue(conn, "b", "b1")
    enqueue(conn, "b", "b2")
    conn.execute("update fleet.lanes set max_running = 1 where name = 'a'")
    enqueue(conn, lane, "a1")
    assert len(claim(conn, sb, 5)) == 1
    assert len(claim(conn, session, 5)) == 1


def test_claim_after_the_session_deadline_gives_nothing(conn, lane, session):
    enqueue(conn, lane, "k")
    conn.execute("update fleet.sessions set deadline = now() - interval '1 s'")
    assert claim(conn, session, 5) == []
    assert count(conn, "runs") == 0


def test_claim_increments_attempts_and_writes_one_run_per_claim(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    first = claim_one(conn, session)
    assert first["attempts"] == 1
    release(conn, task_id)
    second = claim_one(conn, session)
    assert second["attempts"] == 2
    assert second["lease_token"] != first["lease_token"]
    assert [(r["attempt"], r["lease_token"]) for r in runs(conn, task_id)] == [
        (1, first["lease_token"]),
        (2, second["lease_token"]),
    ]
    assert kinds(conn, task_id) == ["enqueued", "claimed", "repaired", "claimed"]


def test_claim_with_an_ended_session_is_refused(conn, lane, session):
    enqueue(conn, lane, "k")
    close_session(conn, session)
    before = world(conn)
    with refused(SESSION_NOT_ACTIVE):
        claim(conn, session)
    assert world(conn) == before


def test_claim_with_a_lost_session_is_refused(conn, lane, session):
    enqueue(conn, lane, "k")
    conn.execute("update fleet.sessions set state = 'lost', ended_at = now(), end_reason = 'gone'")
    with refused(SESSION_NOT_ACTIVE) as info:
        claim(conn, session)
    assert "lost" in str(info.value)
    assert count(conn, "runs") == 0


def test_claim_with_an_unknown_session_is_refused(conn, lane):
    enqueue(conn, lane, "k")
    with refused(SESSION_NOT_ACTIVE):
        claim(conn, uuid.uuid4())
    with refused(SESSION_NOT_ACTIVE):
        claim(conn, None)  # type: ignore[arg-type]
    assert count(conn, "runs") == 0


def test_claim_skips_done_dead_and_cancelled_tasks(conn, lane, session):
    ids = [enqueue(conn, lane, f"k{i}") for i in range(4)]
    cancel(conn, ids[0])
    t = claim_one(conn, session)
    complete(conn, t["id"], t["lease_token"])
    t = claim_one(conn, session)
    fail(conn, t["id"], t["lease_token"], retryable=False)
    assert [t["id"] for t in claim(conn, session, 10)] == [ids[3]]


def test_a_session_does_not_reclaim_a_task_it_handed_off(conn, lane, session):
    handed = enqueue(conn, lane, "handed")
    t = claim_one(conn, session)
    hand_off(conn, handed, t["lease_token"], {})
    other = enqueue(conn, lane, "other")
    assert [r["id"] for r in claim(conn, session, 5)] == [other]
    assert [r["id"] for r in claim(conn, open_session(conn, lane), 5)] == [handed]


# ------------------------------------------------------------------------------------------------
# the lane lock: only a lane with a limit counted across claims serialises them


def test_a_lane_without_limits_claims_while_another_claim_is_uncommitted(connect) -> None:
    setup = connect()
    add_lane(setup, "free")
    fill(setup, "free", 4)
    sa, sb = open_session(setup, "free", host="host-1"), open_session(setup, "free", host="host-2")

    a = connect(autocommit=False)
    mine = leases(a, sa, 2)  # its transaction stays open: the claim is not committed
    assert len(mine) == 2
    # no lock of any mode on the lane row: even FOR UPDATE (which every row lock blocks) gets it
    probe = connect()
    probe.execute("set lock_timeout = '2s'")
    assert one(probe, "select name from fleet.lanes where name = 'free' for update nowait") == "free"
    # and a second claimer is served at once, with other tasks
    b = connect()
    b.execute("set lock_timeout = '2s'")
    theirs = leases(b, sb, 5)
    assert len(theirs) == 2 and not {t for t, _ in theirs} & {t for t, _ in mine}
    a.commit()
    assert running(setup, "free") == 4


def test_large_claims_of_a_lane_run_side_by_side(connect) -> None:
    """A claim of 50 is served while another claim of 50 of its lane is uncommitted (they took
    turns from 20261130160000 until 20261130170000), with other tasks."""
    setup = connect()
    add_lane(setup, "bulk")
    fill(setup, "bulk", 120)
    sa, sb = (open_session(setup, "bulk", host=f"host-{n}") for n in (1, 2))

    a = connect(autocommit=False)
    mine = leases(a, sa, 50)  # uncommitted
    assert len(mine) == 50
    b = connect()
    b.execute("set lock_timeout = '2s'")
    theirs = leases(b, sb, 50)
    assert len(theirs) == 50 and not {t for t, _ in theirs} & {t for t, _ in mine}
    a.commit()
    assert running(setup, "bulk") == 100


LIMITS = {
    "max_running": {"max_running": 10},
    "review_cap": {"config": {"review": True, "review_cap": 10}},
    "daily_budget_usd": {"config": {"daily_budget_usd": 100}},
    "daily_budget_tokens": {"config": {"daily_budget_tokens": 1000000}},
}


@pytest.mark.parametrize("limit", sorted(LIMITS))
def test_a_lane_with_a_limit_still_serialises_its_claims(connect, limit: str) -> None:
    setup = connect()
    add_lane(setup, "held", **LIMITS[limit])
    fill(setup, "held", 4)
    sa, sb = open_session(setup, "held", host="host-1"), open_session(setup, "held", host="host-2")

    a = connect(autocommit=False)
    assert len(leases(a, sa, 1)) == 1
    probe = connect()
    with pytest.raises(errors.LockNotAvailable):
        probe.execute("select 1 from fleet.lanes where name = 'held' for no key update nowait")
    b = connect()
    waiting = Call(b, lambda c: leases(c, sb, 1))
    waiting.start()
    assert wait_until_waiting(setup, b.info.backend_pid) in ("tuple", "transactionid")
    a.commit()
    assert len(waiting.outcome()) == 1
    assert running(setup, "held") == 2


def test_pools_still_count_their_slots_under_their_own_lock(connect) -> None:
    setup = connect()
    setup.execute("select fleet.sync_pool('shared', 1)")
    setup.execute("select fleet.sync_profile('agent', 'shared', '{}')")
    for lane in ("pa", "pb"):
        add_lane(setup, lane, config={"profile": "agent"})  # no lane limit: no lane lock
        fill(setup, lane, 2)
    sa, sb = open_session(setup, "pa", host="host-1"), open_session(setup, "pb", host="host-2")

    a = connect(autocommit=False)
    assert len(leases(a, sa, 1)) == 1  # the pool's one slot, not yet committed
    b = connect()
    waiting = Call(b, lambda c: leases(c, sb, 1))
    waiting.start()
    assert wait_until_waiting(setup, b.info.backend_pid) in ("tuple", "transactionid")
    a.commit()
    assert waiting.outcome() == []
    assert one(setup, "select count(*) from fleet.tasks where state = 'running' and pool = 'shared'") == 1


# ------------------------------------------------------------------------------------------------
# real concurrent claimers


LANE = "conc"
SLOTS = 5
TASKS = 1000
CLAIMERS = 8


def test_eight_claimers_never_exceed_max_running_nor_claim_twice(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as setup:
        setup.execute(
            "insert into fleet.lanes (name, max_running, lease_seconds, max_attempts, max_handoffs) "
            "values (%s, %s, 300, 3, 10)",
            (LANE, SLOTS),
        )
        setup.execute(
            "select fleet.enqueue(%s, 'task:' || g, jsonb_build_object('n', g), g %% 7) "
            "from generate_series(1, %s) g",
            (LANE, TASKS),
        )

    stop = threading.Event()
    start = threading.Barrier(CLAIMERS + 1)
    errors: list[BaseException] = []
    claimed: list[list[int]] = [[] for _ in range(CLAIMERS)]
    samples: list[int] = []

    def claimer(n: int) -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as c:
                sid = open_session(c, LANE, f"host-{n}", 1000 + n)
                start.wait(timeout=30)
                while not stop.is_set():
                    got = c.execute(
                        "select id, lease_token from fleet.claim(%s, 2)", (sid,)
                    ).fetchall()
                    if not got:
                        left = c.execute(
                            "select count(*) from fleet.tasks where lane = %s and state = 'queued'",
                            (LANE,),
                        ).fetchone()
                        assert left is not None
                        if left[0] == 0:
                            break
                        time.sleep(0.001)  # every slot is taken: let a holder finish
                        continue
                    for task_id, token in got:
                        claimed[n].append(task_id)
                        row = c.execute(
                            "select fleet.complete(%s, %s, %s)", (task_id, token, Jsonb({"by": n}))
                        ).fetchone()
                        assert row is not None and row[0] == "done"
                c.execute("select fleet.close_session(%s, 'drained', null)", (sid,))
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)
            stop.set()

    def watcher() -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as c:
                while not stop.is_set():
                    row = c.execute(
                        "select count(*) from fleet.tasks where lane = %s and state = 'running'",
                        (LANE,),
                    ).fetchone()
                    assert row is not None
                    samples.append(row[0])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(n,), daemon=True) for n in range(CLAIMERS)]
    watch = threading.Thread(target=watcher, daemon=True)
    watch.start()
    for t in threads:
        t.start()
    began = time.monotonic()
    start.wait(timeout=30)
    for t in threads:
        t.join(timeout=60)
    stop.set()
    watch.join(timeout=10)
    elapsed = time.monotonic() - began

    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a claimer hung"
    assert samples, "the watcher never sampled"
    assert max(samples) <= SLOTS, f"running count reached {max(samples)} > {SLOTS}"
    assert max(samples) >= 2, "the claimers never overlapped; the test proved nothing"

    everything = [task_id for mine in claimed for task_id in mine]
    twice = [task_id for task_id, n in Counter(everything).items() if n > 1]
    assert not twice, f"claimed twice: {twice[:10]}"
    assert len(everything) == TASKS
    assert sum(1 for mine in claimed if mine) >= 2, "one claimer did all the work"

    with psycopg.connect(db_url, autocommit=True) as c:
        states = dict(
            c.execute("select state, count(*) from fleet.tasks group by state").fetchall()
        )
        assert states == {"done": TASKS}
        per_task = c.execute(
            "select count(*) filter (where n <> 1), count(*) from "
            "(select t.id, count(r.id) as n from fleet.tasks t "
            "left join fleet.runs r on r.task_id = t.id group by t.id) x"
        ).fetchone()
        assert per_task == (0, TASKS), "every task has exactly one run row"
        assert c.execute(
            "select count(*) from fleet.runs where outcome = 'done' and attempt = 1"
        ).fetchone() == (TASKS,)
        ev = dict(
            c.execute(
                "select kind, count(*) from fleet.journal where task_id is not null group by kind"
            ).fetchall()
        )
        assert ev == {"enqueued": TASKS, "claimed": TASKS, "completed": TASKS}
        handoffs = c.execute(
            "select coalesce(sum((counts ->> 'done')::int), 0), count(*) from fleet.lane_handoffs"
        ).fetchone()
        assert handoffs == (TASKS, CLAIMERS)
    assert elapsed < 60


DRAIN_CLAIMERS = 6


def _drain(db_url: str, lane: str, batch: int, after_claim: Callable[[psycopg.Connection, int, uuid.UUID], None]
           ) -> list[list[int]]:
    """DRAIN_CLAIMERS threads, each with its own connection and session, claim until nothing comes."""
    start = threading.Barrier(DRAIN_CLAIMERS)
    claimed: list[list[int]] = [[] for _ in range(DRAIN_CLAIMERS)]
    errs: list[BaseException] = []

    def claimer(n: int) -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as c:
                sid = open_session(c, lane, host=f"host-{n}")
                start.wait(timeout=30)
                while got := leases(c, sid, batch):
                    for task, token in got:
                        claimed[n].append(task)
                        after_claim(c, task, token)
        except BaseException as exc:
            errs.append(exc)

    threads = [threading.Thread(target=claimer, args=(n,), daemon=True) for n in range(DRAIN_CLAIMERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errs, errs
    assert not any(t.is_alive() for t in threads), "a claimer hung"
    return claimed


def test_claimers_of_a_lane_without_limits_take_each_task_once(db_url: str, conn: psycopg.Connection) -> None:
    add_lane(conn, "free")
    fill(conn, "free", 600)

    def done(c: psycopg.Connection, task: int, token: uuid.UUID) -> None:
        assert one(c, "select fleet.complete(%s, %s)", (task, token)) == "done"

    claimed = _drain(db_url, "free", 3, done)
    every = [t for mine in claimed for t in mine]
    assert not [t for t, k in Counter(every).items() if k > 1], "a task was claimed twice"
    assert len(every) == 600 and sum(1 for mine in claimed if mine) >= 2
    assert conn.execute("select state, attempts, count(*) from fleet.tasks group by 1, 2").fetchall() == [
        ("done", 1, 600)]
    assert one(conn, "select count(*) from fleet.runs where outcome = 'done'") == 600
    assert conn.execute("select kind, count(*) from fleet.journal where task_id is not null group by 1 order by 1"
                        ).fetchall() == [("claimed", 600), ("completed", 600), ("enqueued", 600)]


@pytest.mark.parametrize("gate", ["review_cap", "daily_budget_tokens"])
def test_gated_lanes_stop_claiming_at_their_limit_under_concurrent_claimers(
        db_url: str, conn: psycopg.Connection, gate: str) -> None:
    cap = 8
    config: dict[str, Any] = ({"review": True, "review_cap": cap} if gate == "review_cap"
                              else {"daily_budget_tokens": cap * 100})
    add_lane(conn, "gated", config=config)
    fill(conn, "gated", 100)

    def spend_and_complete(c: psycopg.Connection, task: int, token: uuid.UUID) -> None:
        # each task spends 100 tokens: the budget is cap tasks; a review lane holds each in review
        c.execute("select fleet.record_run(%s, %s)", (token, Jsonb({"input_tokens": 100})))
        c.execute("select fleet.complete(%s, %s)", (task, token))

    claimed = _drain(db_url, "gated", 1, spend_and_complete)
    n = sum(len(mine) for mine in claimed)
    # a claim sees only what committed before it: up to DRAIN_CLAIMERS - 1 claims may overlap the one
    # that reaches the limit, never more; and the gate closes (nothing claimed past that)
    assert cap <= n <= cap + DRAIN_CLAIMERS - 1, n
    assert one(conn, "select count(*) from fleet.tasks where state = 'queued'") == 100 - n
    sid = open_session(conn, "gated", host="host-99")
    assert leases(conn, sid, 5) == []


# ------------------------------------------------------------------------------------------------
# cost follows the active work, not the history


def claim_statements(conn: psycopg.Connection, session: uuid.UUID) -> dict[str, str]:
    """The claim's ready query (without pools, and the pooled claim's) and its running count, read
    from fleet.claim as the database runs it, bound to lane a, ``session`` and a limit of 4."""
    body = function_body(conn, "fleet.claim(uuid, int)")
    values = {"s.lane": "'a'", "s.id": f"'{session}'::uuid", "v_free": "4"}
    _pools, pooled = loop_queries(body)
    return {
        "ready": bind(parenthesised_after(body, "v_ids := array"), values),
        "pooled": bind(pooled, values),
        "running": bind(parenthesised_after(body, "l.max_running -"), {"s.lane": "'a'"}),
    }


def test_the_claim_reads_ready_and_running_tasks_by_partial_index_whatever_the_history(
        long_history: psycopg.Connection) -> None:
    """As the monitor's pass does (tests/sql/test_reconcile.py), the claim reads the active work only."""
    conn = long_history
    statements = claim_statements(conn, uuid.uuid4())
    assert_index_only(conn, statements["ready"], "tasks", {"tasks_ready"})
    assert_index_only(conn, statements["pooled"], "tasks", {"tasks_ready"})
    assert_index_only(conn, statements["running"], "tasks", RUNNING_INDEXES)


def test_the_claims_one_plan_for_every_call_reads_no_table_sequentially(conn: psycopg.Connection) -> None:
    """The plan cache keeps one plan of each of the claim's statements for every later call (a
    generic plan, made for any parameter values): that plan, forced here, reads the tasks by index,
    in a lane whose queue is most of the table. (A claim written as one statement, its LIMIT joined
    to the update, was planned anew for every call, and its generic plan, made for a tenth of the
    queue, joined the tasks through a sequential scan.)"""
    sync_lane(conn, "a")
    enqueue_many(conn, "a", [{"key": f"deep:{i}"} for i in range(20000)])
    conn.execute("analyze fleet.tasks")
    session = open_session(conn, "a")
    claimed: list[dict[str, Any]] = []
    plans = [p for p in generic_plans(conn, lambda: claimed.extend(claim(conn, session, 2))) if "fleet.tasks" in p]
    assert len(claimed) == 2
    assert any("update fleet.tasks" in p for p in plans), plans
    sequential = [p for p in plans if re.search(r"Seq Scan on tasks\b", p)]
    assert not sequential, "\n\n".join(sequential)


# ------------------------------------------------------------------------------------------------
# budgets: a task whose earlier runs spent its budget is blocked by the claim, never run


def _budgeted(conn: psycopg.Connection, key: str, max_cost: float | None = None, max_tokens: int | None = None) -> int:
    return one(conn, "select task_id from fleet.enqueue_task('b', %s, p_max_cost_usd => %s, p_max_tokens => %s)",
               (key, max_cost, max_tokens))


def _spend(conn: psycopg.Connection, task_id: int, tokens: int, cost: float) -> None:
    """One run of the task that spent ``tokens`` and ``cost``, failed, and is ready again."""
    (t,) = claim(conn, open_session(conn, "b"), 1)
    assert t["id"] == task_id
    record_run(conn, t["lease_token"], {"exit_code": 1, "input_tokens": tokens, "cost_usd": cost})
    fail(conn, task_id, t["lease_token"], "spent")
    conn.execute("update fleet.tasks set run_at = now() where id = %s", (task_id,))


def test_a_task_whose_runs_spent_its_token_budget_is_blocked_by_the_claim(conn) -> None:
    sync_lane(conn, "b")
    over = _budgeted(conn, "over", max_tokens=1000)
    fits = _budgeted(conn, "fits", max_tokens=1000)
    _spend(conn, over, 1500, 0.01)
    conn.execute("update fleet.tasks set priority = 5 where id = %s", (over,))  # first in line
    assert [c["id"] for c in claim(conn, open_session(conn, "b"), 5)] == [fits]
    t = task(conn, over)
    assert (t["state"], t["block_reason"], t["failures"]) == ("blocked", "budget", 1)
    assert t["last_error"] == "spent 1,500 tokens of the task's 1,000 budget ($0.0100)"
    assert [(r["attempt"], r["outcome"], r["reason"]) for r in runs(conn, over)][-1] == (2, "blocked", "budget")
    assert kinds(conn, over)[-2:] == ["claimed", "blocked"]


def test_the_lanes_synced_budget_counts_when_the_task_has_none(conn) -> None:
    sync_lane(conn, "b")
    t = _budgeted(conn, "lane-budget")
    _spend(conn, t, 10, 0.75)
    assert [c["id"] for c in claim(conn, open_session(conn, "b"), 1)] == [t]  # no budget yet
    fail(conn, t, task(conn, t)["lease_token"], "x")
    conn.execute("update fleet.tasks set run_at = now() where id = %s", (t,))
    one(conn, "select fleet.sync_lane('b', %s)", (Jsonb({"config": {"max_cost_usd": 0.5}}),))
    assert claim(conn, open_session(conn, "b"), 1) == []
    assert pick(task(conn, t), "state", "last_error") == {
        "state": "blocked", "last_error": "spent $0.7500 of the task's $0.5000 budget (10 tokens)"}


def test_a_task_blocked_by_its_budget_takes_no_pool_slot(conn) -> None:
    one(conn, "select fleet.sync_pool('p', 1)")
    one(conn, "select fleet.sync_profile('prof', 'p', '{}'::jsonb)")
    sync_lane(conn, "b", config={"profile": "prof"})
    over = _budgeted(conn, "over", max_tokens=10)
    fits = _budgeted(conn, "fits")
    _spend(conn, over, 50, 0)
    conn.execute("update fleet.tasks set priority = 5 where id = %s", (over,))
    claimed = claim(conn, open_session(conn, "b"), 2)
    assert [(c["id"], c["pool"]) for c in claimed] == [(fits, "p")]  # the pool's one slot went to fits
    assert task(conn, over)["state"] == "blocked"


def test_within_its_budget_a_task_is_claimed_as_before(conn) -> None:
    sync_lane(conn, "b")
    t = _budgeted(conn, "ok", max_cost=1)
    _spend(conn, t, 10, 0.25)
    assert [c["id"] for c in claim(conn, open_session(conn, "b"), 1)] == [t]


# ------------------------------------------------------------------------------------------------
# fleet.claimed: what a claim whose answer was lost made the session's


def _claimed(conn: psycopg.Connection, session: uuid.UUID, known: list[int] | None) -> list[dict[str, Any]]:
    return [dict(r) for r in conn.cursor(row_factory=dict_row).execute(
        "select * from fleet.claimed(%s, %s::bigint[])", (session, known)).fetchall()]


def test_claimed_answers_the_sessions_running_tasks_the_shift_does_not_know_as_the_claim_did(conn, lane, session):
    a, b, c, d = (enqueue(conn, lane, k) for k in ("a", "b", "c", "d"))
    answered = {t["id"]: t for t in claim(conn, session, 3)}  # a, b, c: the answer the shift never got
    other = open_session(conn, lane)
    claim(conn, other, 1)  # d: another session's
    complete(conn, a, answered[a]["lease_token"])  # a: no longer running
    before = world(conn)
    got = _claimed(conn, session, [b])
    assert [t["id"] for t in got] == [c]
    assert got[0] == answered[c]  # the row as the claim answered it: its lease, attempt, tier, pool
    assert [t["id"] for t in _claimed(conn, session, None)] == [b, c]  # NULL: nothing known
    assert _claimed(conn, session, [b, c, d]) == []
    assert _claimed(conn, other, []) == [dict(task(conn, d))]
    assert world(conn) == before  # it only reads


@pytest.mark.parametrize("how", ["closed", "unknown", "another-lanes-key"])
def test_claimed_is_refused_for_a_session_that_is_not_the_callers_active_one(conn, lane, session, how):
    enqueue(conn, lane, "k")
    claim(conn, session, 1)
    add_lane(conn, "b")
    sid = uuid.uuid4() if how == "unknown" else session
    if how == "closed":
        close_session(conn, session)
    before = world(conn)
    if how == "another-lanes-key":
        with as_key(conn, "fleet_worker", {"role": "fleet_worker", "fleet_lanes": ["b"]}), \
                refused(SESSION_NOT_ACTIVE) as err:
            _claimed(conn, sid, [])
        assert "unknown session" in str(err.value)  # another lane's session is one that does not exist
    else:
        with refused(SESSION_NOT_ACTIVE):
            _claimed(conn, sid, [])
    assert world(conn) == before
