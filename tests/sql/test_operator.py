"""The operator group (migrations/sources/09_operator.sql): fleet.cancel and fleet.retry, called over
psycopg against a real, freshly migrated PostgreSQL — what they change, what they refuse, the
events they write. (fleet.resume, fleet.review_approve/review_reject, fleet.task_spend and
fleet.set_task_budget are exercised through real shifts and `fleet` commands:
tests/test_guardrails.py, tests/test_dispatch.py; their grants and lane checks:
tests/sql/test_security.py.)
"""

from __future__ import annotations

import pytest
from sqlkit import (
    INVALID_STATE,
    UNKNOWN_TASK,
    cancel,
    claim,
    claim_one,
    complete,
    enqueue,
    fail,
    hand_off,
    kinds,
    last_event,
    open_session,
    refused,
    release,
    retry,
    runs,
    task,
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
