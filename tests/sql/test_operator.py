"""The operator group (migrations/sources/09_operator.sql): fleet.cancel, fleet.retry and
fleet.clear_throttle, called over psycopg against a real, freshly migrated PostgreSQL — what they
change, what they refuse, the events they write. (fleet.resume, fleet.review_approve/review_reject and fleet.task_spend
are exercised through real shifts and `fleet` commands:
tests/test_guardrails.py, tests/test_dispatch.py; their grants and lane checks:
tests/sql/test_security.py.)
"""

from __future__ import annotations

from datetime import datetime

import psycopg
import pytest
from sqlkit import (
    INVALID_ARGUMENT,
    INVALID_STATE,
    LANE_NOT_ALLOWED,
    UNKNOWN_TASK,
    add_lane,
    as_key,
    cancel,
    claim,
    claim_one,
    complete,
    enqueue,
    fail,
    hand_off,
    kinds,
    last_event,
    one,
    open_session,
    refused,
    release,
    retry,
    rows,
    runs,
    take_lease,
    task,
    throttle,
    transient,
    world,
)

# ------------------------------------------------------------------------------------------------
# cancel


def test_cancel_a_queued_task(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    assert cancel(conn, task_id) == "cancelled"
    after = task(conn, task_id)
    assert after["state"] == "cancelled" and after["finished_at"] is not None
    assert claim(conn, session) == []
    assert kinds(conn, task_id) == ["enqueued", "cancelled"]
    ev = last_event(conn, task_id)
    assert ev["detail"] == {"was": "queued"} and ev["session_id"] is None


def test_cancel_a_resumable_task_clears_carry_over(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    hand_off(conn, task_id, t["lease_token"], {})
    cancel(conn, task_id)
    assert task(conn, task_id)["carry_over"] is False


def test_cancel_a_running_task(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    assert cancel(conn, task_id) == "cancelled"
    after = task(conn, task_id)
    assert after["state"] == "cancelled"
    assert after["lease_token"] is None and after["session_id"] is None
    assert after["finished_at"] is not None
    [run] = runs(conn, task_id)
    assert run["outcome"] == "cancelled" and run["ended_at"] is not None
    ev = last_event(conn, task_id)
    assert ev["kind"] == "cancelled"
    assert ev["detail"] == {"was": "running"} and ev["session_id"] == session


def test_cancel_again_is_a_no_op(conn, lane):
    task_id = enqueue(conn, lane, "k")
    cancel(conn, task_id)
    before = world(conn)
    assert cancel(conn, task_id) == "cancelled"
    assert world(conn) == before


@pytest.mark.parametrize("end", ["done", "dead"])
def test_cancel_a_finished_task_is_refused(conn, lane, session, end):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    if end == "done":
        complete(conn, task_id, t["lease_token"])
    else:
        fail(conn, task_id, t["lease_token"], retryable=False)
    before = world(conn)
    with refused(INVALID_STATE):
        cancel(conn, task_id)
    assert world(conn) == before


def test_cancel_unknown_task(conn, lane):
    with refused(UNKNOWN_TASK):
        cancel(conn, 12345)


# ------------------------------------------------------------------------------------------------
# retry


def test_retry_a_dead_task(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    release(conn, task_id)
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s'")
    t = claim_one(conn, session)
    hand_off(conn, task_id, t["lease_token"], {})
    t = claim_one(conn, session := open_session(conn, lane))
    fail(conn, task_id, t["lease_token"], "fatal thing", retryable=False)
    assert retry(conn, task_id) == "queued"
    after = task(conn, task_id)
    assert after["state"] == "queued"
    assert (after["failures"], after["evaporations"], after["handoffs"]) == (0, 0, 0)
    assert after["attempts"] == 3, "attempts count claims, for the record"
    assert after["dead_reason"] is None and after["finished_at"] is None
    assert after["carry_over"] is False
    assert kinds(conn, task_id)[-1] == "retried"
    assert last_event(conn, task_id)["detail"] == {"was": "dead", "reason": "fatal"}
    t = claim_one(conn, session)
    assert t["id"] == task_id and t["attempts"] == 4


def test_retry_gives_a_fresh_cap(conn, session):
    conn.execute("update fleet.lanes set max_attempts = 1")
    task_id = enqueue(conn, "a", "k")
    t = claim_one(conn, session)
    assert fail(conn, task_id, t["lease_token"]) == "dead"
    retry(conn, task_id)
    t = claim_one(conn, session)
    assert fail(conn, task_id, t["lease_token"]) == "dead", "one more try, as the cap says"
    retry(conn, task_id)
    t = claim_one(conn, session)
    assert complete(conn, task_id, t["lease_token"]) == "done"


def test_retry_a_cancelled_task(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    cancel(conn, task_id)
    assert retry(conn, task_id) == "queued"
    after = task(conn, task_id)
    assert after["state"] == "queued" and after["finished_at"] is None
    assert last_event(conn, task_id)["detail"] == {"was": "cancelled", "reason": None}
    assert claim_one(conn, session)["id"] == task_id


@pytest.mark.parametrize("state", ["queued", "running", "done"])
def test_retry_refused_unless_dead_or_cancelled(conn, lane, session, state):
    task_id = enqueue(conn, lane, "k")
    if state != "queued":
        t = claim_one(conn, session)
        if state == "done":
            complete(conn, task_id, t["lease_token"])
    before = world(conn)
    with refused(INVALID_STATE):
        retry(conn, task_id)
    assert world(conn) == before


def test_retry_unknown_task(conn, lane):
    with refused(UNKNOWN_TASK):
        retry(conn, 12345)


# ------------------------------------------------------------------------------------------------
# clear_throttle: an operator lifts a pool's throttle


def _pooled_lanes(conn: psycopg.Connection) -> None:
    """Lanes a and b drawing from pool shared (profile p), lane c from pool other (profile o)."""
    for pool in ("shared", "other"):
        conn.execute("select fleet.sync_pool(%s, null)", (pool,))
    conn.execute("select fleet.sync_profile('p', 'shared', '{}')")
    conn.execute("select fleet.sync_profile('o', 'other', '{}')")
    for name, profile in (("a", "p"), ("b", "p"), ("c", "o")):
        add_lane(conn, name, config={"profile": profile})


def test_clear_throttle_lifts_the_pool_and_readies_the_tasks_that_wait_for_it(conn):
    _pooled_lanes(conn)
    waiting, other_pool, transient_wait, later, blocked_b = (
        enqueue(conn, lane, key) for lane, key in (("a", "w"), ("c", "o"), ("a", "t"), ("a", "l"), ("b", "x")))
    sa, sc = open_session(conn, "a", host="host-a"), open_session(conn, "c")
    until = throttle(conn, waiting, take_lease(conn, sa, waiting), until="9999-12-31T00:00:00Z", note="weekly")
    throttle(conn, other_pool, take_lease(conn, sc, other_pool), after_seconds=3600)
    conn.execute("update fleet.pools set throttled_until = null where name = 'shared'")  # to claim the rest
    transient(conn, transient_wait, take_lease(conn, sa, transient_wait), after_seconds=3600)
    conn.execute("update fleet.pools set throttled_until = %s where name = 'shared'", (until,))
    conn.execute("update fleet.tasks set run_at = now() + interval '1 day' where id = %s", (later,))
    # every lane of the pool is stopped
    assert claim(conn, open_session(conn, "b")) == []
    by = one(conn, "select throttled_by from fleet.pools where name = 'shared'")
    assert by["task"] == waiting

    got = one(conn, "select fleet.clear_throttle('shared')")
    # (compared as times: JSON drops a fraction's trailing zeros, isoformat() does not)
    assert got | {"was_until": datetime.fromisoformat(got["was_until"])} == {
        "pool": "shared", "was_until": until, "note": "weekly", "set_by": by, "tasks": 1}
    pool = rows(conn, "select * from fleet.pools where name = 'shared'")[0]
    assert (pool["throttled_until"], pool["throttle_note"], pool["throttled_by"]) == (None, None, None)
    assert one(conn, "select run_at <= now() from fleet.tasks where id = %s", (waiting,))
    assert task(conn, waiting)["carry_over"] is True  # still first of its priority
    # not: a task of another pool, one waiting for a transient retry, one queued for later
    for task_id in (other_pool, transient_wait, later):
        assert one(conn, "select run_at > now() from fleet.tasks where id = %s", (task_id,)), task_id
    assert one(conn, "select throttled_until > now() from fleet.pools where name = 'other'")
    ev = rows(conn, "select * from fleet.journal where kind = 'throttle_cleared'")
    assert len(ev) == 1 and ev[0]["task_id"] is None and ev[0]["lane"] is None
    assert ev[0]["detail"] == got | {"by": {"role": one(conn, "select session_user::text")}}
    # the pool's lanes claim again, the throttled task first
    claimed = claim(conn, open_session(conn, "b"), 5)
    assert [t["id"] for t in claimed] == [blocked_b]
    assert [t["id"] for t in claim(conn, open_session(conn, "a"), 5)] == [waiting]
    # again: nothing to lift, nothing journaled
    assert one(conn, "select fleet.clear_throttle('shared')")["was_until"] is None
    assert len(rows(conn, "select * from fleet.journal where kind = 'throttle_cleared'")) == 1


def test_clear_throttle_is_a_fleet_wide_operators_call(conn):
    _pooled_lanes(conn)
    task_id = enqueue(conn, "a", "w")
    throttle(conn, task_id, take_lease(conn, open_session(conn, "a"), task_id), after_seconds=3600)
    before = world(conn) | {"pools": rows(conn, "select * from fleet.pools order by name")}
    with refused(INVALID_ARGUMENT) as err:
        one(conn, "select fleet.clear_throttle('nope')")
    assert "unknown pool 'nope'" in str(err.value) and "known pools: other, shared" in str(err.value)
    # a worker may not (no grant), nor an operator key limited to some lanes (the pool is shared)
    with as_key(conn, "fleet_worker", {"role": "fleet_worker", "fleet_lanes": ["*"]}), refused("42501"):
        one(conn, "select fleet.clear_throttle('shared')")
    with as_key(conn, "fleet_operator", {"role": "fleet_operator", "fleet_lanes": ["a", "b"]}), \
            refused(LANE_NOT_ALLOWED) as err:
        one(conn, "select fleet.clear_throttle('shared')")
    assert "works on every lane" in str(err.value)
    assert world(conn) | {"pools": rows(conn, "select * from fleet.pools order by name")} == before
    # an operator key for every lane may
    with as_key(conn, "fleet_operator", {"role": "fleet_operator", "sub": "lanefleet:operator:x"}):
        got = one(conn, "select fleet.clear_throttle('shared')")
        assert got["tasks"] == 1 and got["set_by"]["task"] == task_id
        detail = one(conn, "select detail from fleet.journal where kind = 'throttle_cleared'")
        assert detail["by"] == {"role": "fleet_operator", "key": "lanefleet:operator:x"}
