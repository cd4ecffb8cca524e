"""The lease group (migrations/sources/07_lease.sql): what a running task's holder does while it runs —
fleet.heartbeat, fleet.checkpoint, fleet.lease_held — and the fence every call under a lease keeps
(checkpoint and the finishing calls of 08_finish.sql): a stale, random or null token changes
nothing and says "lease lost". Called over psycopg against a real, freshly migrated PostgreSQL.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from sqlkit import (
    INVALID_ARGUMENT,
    LEASE_LOST,
    SESSION_NOT_ACTIVE,
    UNKNOWN_TASK,
    add_lane,
    cancel,
    checkpoint,
    claim,
    claim_one,
    close_session,
    complete,
    enqueue,
    expire,
    fail,
    hand_off,
    heartbeat,
    kinds,
    last_event,
    lease_left,
    one,
    open_session,
    refused,
    release,
    retry,
    route,
    rows,
    task,
    world,
)

# ------------------------------------------------------------------------------------------------
# heartbeat


def test_heartbeat_renews_the_leases_of_its_session_only(conn, lane, session):
    other = open_session(conn, lane, host="host-2")
    mine = [enqueue(conn, lane, f"m{i}") for i in range(2)]
    theirs = enqueue(conn, lane, "t")
    claim(conn, session, 2)
    claim(conn, other, 1)
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '59 s'")
    assert all(lease_left(conn, t) < 2 for t in (*mine, theirs))
    assert heartbeat(conn, session) == {mine[0]: "ok", mine[1]: "ok"}
    for task_id in mine:
        assert lease_left(conn, task_id) > 59  # the lane's 60 s, from the heartbeat
    assert lease_left(conn, theirs) < 2, "another session's lease is not renewed"
    assert one(conn, "select heartbeat_at > now() - interval '5 s' from fleet.sessions where id = %s", (session,))
    assert one(conn, "select heartbeat_at < now() - interval '5 s' from fleet.sessions where id = %s", (other,))


def test_a_heartbeat_writes_its_session_row_and_no_task_row(conn, lane, session):
    tasks = [enqueue(conn, lane, f"k{i}") for i in range(3)]
    claim(conn, session, 3)
    conn.commit()
    versions = "select array_agg(xmin::text order by id) from fleet.tasks where id = any(%s)"
    before = one(conn, versions, (tasks,))
    session_before = one(conn, "select xmin::text from fleet.sessions where id = %s", (session,))
    assert heartbeat(conn, session) == dict.fromkeys(tasks, "ok")
    conn.commit()
    assert one(conn, versions, (tasks,)) == before, "a task row was written to renew its lease"
    assert one(conn, "select xmin::text from fleet.sessions where id = %s", (session,)) != session_before


def test_heartbeat_grants_the_lease_or_the_shorter_session_timeout(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    claim(conn, session, 1)
    got = rows(conn, "select task_id, status, valid_for from fleet.heartbeat(%s)", (session,))
    assert got == [{"task_id": None, "status": "session", "valid_for": 60.0},
                   {"task_id": task_id, "status": "ok", "valid_for": 60.0}]
    conn.execute("update fleet.lanes set session_timeout_seconds = 25 where name = %s", (lane,))
    got = rows(conn, "select task_id, valid_for from fleet.heartbeat(%s)", (session,))
    assert [r["valid_for"] for r in got] == [25.0, 25.0]  # the monitor may declare it lost after 25 s
    conn.execute("update fleet.lanes set session_timeout_seconds = 600 where name = %s", (lane,))
    got = rows(conn, "select task_id, valid_for from fleet.heartbeat(%s)", (session,))
    assert [r["valid_for"] for r in got] == [60.0, 60.0]  # a longer timeout does not lengthen the lease
    release(conn, task_id)
    got = rows(conn, "select task_id, status, valid_for from fleet.heartbeat(%s)", (session,))
    assert got[1:] == [{"task_id": task_id, "status": "lost", "valid_for": 0.0}]


def test_heartbeat_with_nothing_held(conn, lane, session):
    assert heartbeat(conn, session) == {}


def test_heartbeat_reports_a_released_task_as_lost(conn, lane, session):
    kept = enqueue(conn, lane, "kept")
    lost = enqueue(conn, lane, "lost")
    claim(conn, session, 2)
    release(conn, lost, "lease-expired")
    assert heartbeat(conn, session) == {kept: "ok", lost: "lost"}
    # reported again at the next heartbeat, in case an answer was lost on the way
    assert heartbeat(conn, session) == {kept: "ok", lost: "lost"}


def test_heartbeat_reports_lost_when_another_session_reclaimed_the_task(conn, lane, session):
    other = open_session(conn, lane, host="host-2")
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    release(conn, task_id)
    claim_one(conn, other)
    assert heartbeat(conn, session) == {task_id: "lost"}
    assert heartbeat(conn, other) == {task_id: "ok"}


def test_heartbeat_reports_a_cancelled_task(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    cancel(conn, task_id)
    assert heartbeat(conn, session) == {task_id: "cancelled"}


def test_heartbeat_forgets_old_losses(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    release(conn, task_id)
    conn.execute("update fleet.runs set ended_at = now() - interval '1 day'")
    assert heartbeat(conn, session) == {}


def test_heartbeat_does_not_report_finished_tasks(conn, lane, session):
    done = enqueue(conn, lane, "done")
    failed = enqueue(conn, lane, "failed")
    handed = enqueue(conn, lane, "handed")
    got = {t["id"]: t["lease_token"] for t in claim(conn, session, 3)}
    complete(conn, done, got[done])
    fail(conn, failed, got[failed])
    hand_off(conn, handed, got[handed])
    assert heartbeat(conn, session) == {}


@pytest.mark.parametrize("how", ["closed", "lost", "unknown"])
def test_heartbeat_of_an_inactive_session_is_refused(conn, lane, session, how):
    sid = session
    if how == "closed":
        close_session(conn, session)
    elif how == "lost":
        conn.execute("update fleet.sessions set state = 'lost', ended_at = now()")
    else:
        sid = uuid.uuid4()
    before = world(conn)
    with refused(SESSION_NOT_ACTIVE):
        heartbeat(conn, sid)
    assert world(conn) == before


def test_heartbeat_with_task_list_releases_what_the_shift_does_not_name(conn, lane, session):
    a, b, c = (enqueue(conn, lane, k) for k in ("a", "b", "c"))
    claim(conn, session, 3)
    one(conn, "select fleet.cancel(%s)", (c,))
    rows = dict(conn.execute("select task_id, status from fleet.heartbeat(%s, %s::bigint[]) where task_id is not null",
                             (session, [a, c])).fetchall())
    assert rows == {a: "ok", c: "cancelled"}
    released = task(conn, b)
    assert released["state"] == "queued" and released["evaporations"] == 1
    kinds = [r[0] for r in conn.execute(
        "select detail->>'reason' from fleet.journal where task_id = %s and kind = 'repaired'", (b,))]
    assert kinds == ["not-run-by-shift"]
    assert task(conn, a)["state"] == "running"


def test_heartbeat_reports_each_task_once_with_its_latest_outcome(conn, lane, session):
    # lost (released), re-claimed by the same session, then cancelled: one row, 'cancelled'
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    release(conn, task_id)
    claim_one(conn, session)
    cancel(conn, task_id)
    got = rows(conn, "select task_id, status from fleet.heartbeat(%s) where task_id is not null", (session,))
    assert got == [{"task_id": task_id, "status": "cancelled"}]
    # and the other way round: cancelled, retried, re-claimed, released: 'lost'
    retry(conn, task_id)
    claim_one(conn, session)
    release(conn, task_id)
    got = rows(conn, "select task_id, status from fleet.heartbeat(%s) where task_id is not null", (session,))
    assert got == [{"task_id": task_id, "status": "lost"}]


# ------------------------------------------------------------------------------------------------
# checkpoint


def test_checkpoint_increments_seq_and_records_progress(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    claimed_at = task(conn, task_id)["last_progress_at"]
    assert claimed_at is not None, "an attempt's progress clock starts at its claim"
    assert checkpoint(conn, task_id, t["lease_token"], {"step": 1}) == 1
    after = task(conn, task_id)
    assert after["checkpoint"] == {"step": 1}
    assert after["checkpoint_seq"] == 1
    assert after["last_progress_at"] > claimed_at
    assert checkpoint(conn, task_id, t["lease_token"], {"step": 2}) == 2
    assert task(conn, task_id)["checkpoint"] == {"step": 2}
    assert kinds(conn, task_id) == ["enqueued", "claimed", "checkpoint", "checkpoint"]
    assert last_event(conn, task_id)["detail"] == {"seq": 2}
    assert task(conn, task_id)["state"] == "running"


def test_checkpoint_survives_a_release_and_keeps_counting(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    checkpoint(conn, task_id, t["lease_token"], {"step": 1})
    release(conn, task_id)
    t2 = claim_one(conn, session)
    assert t2["checkpoint"] == {"step": 1}, "the next attempt sees the last checkpoint"
    assert checkpoint(conn, task_id, t2["lease_token"], {"step": 2}) == 2


def test_checkpoint_null_data_is_refused(conn, lane, session):
    enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(INVALID_ARGUMENT):
        checkpoint(conn, t["id"], t["lease_token"], None)
    assert world(conn) == before


# ------------------------------------------------------------------------------------------------
# lease_held (what `fleet guard` asks)


def test_lease_held_in_sql_and_its_security(conn: psycopg.Connection) -> None:
    for lane in ("docs", "bugfix"):
        conn.execute("select fleet.sync_lane(%s, '{}')", (lane,))
    conn.execute("select fleet.enqueue('bugfix', 'bugfix:1')")
    s = conn.execute("select fleet.open_session('bugfix', 'h', 1, null, 600)").fetchone()[0]
    task, token = conn.execute("select id, lease_token from fleet.claim(%s, 1)", (s,)).fetchone()

    def held(tok: Any, task_id: int = task) -> tuple[bool, str, bool]:
        return conn.execute("select held, state, token_matches from fleet.lease_held(%s, %s)",
                            (task_id, tok)).fetchone()

    def valid_for(tok: Any = token) -> float:
        return conn.execute("select valid_for from fleet.lease_held(%s, %s)", (task, tok)).fetchone()[0]

    assert held(token) == (True, "running", True)
    assert 59 < valid_for() <= 60  # the lane's lease, from the claim (a sign of life of the session)
    assert held(uuid.uuid4()) == (False, "running", False) and valid_for(uuid.uuid4()) == 0
    assert held(None) == (False, "running", False)
    assert held(token, task + 1000) == (False, "unknown", False)
    # the lease follows the session: its last heartbeat 59.5 s ago leaves half a second
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '59.5 s' where id = %s", (s,))
    # (less by the time between the update and the read: milliseconds, or more on a loaded machine)
    assert held(token) == (True, "running", True) and 0.2 < valid_for() <= 0.5
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '61 s' where id = %s", (s,))
    # run out by the database's clock, not repaired yet: not held, but still this token's
    assert held(token) == (False, "running", True) and valid_for() == 0
    conn.execute("update fleet.sessions set heartbeat_at = now() where id = %s", (s,))
    assert held(token) == (True, "running", True)
    conn.execute("update fleet.sessions set state = 'lost', ended_at = now() where id = %s", (s,))
    assert held(token) == (False, "running", True), "a lost session holds no lease, whatever its heartbeat"
    conn.execute("update fleet.sessions set state = 'active', ended_at = null where id = %s", (s,))
    assert conn.execute("select fleet.cancel(%s)", (task,)).fetchone()[0] == "cancelled"
    assert held(token) == (False, "cancelled", False)

    # the rules of 20261130100400_fleet_roles_rls.sql
    definer, config, volatile = conn.execute(
        "select prosecdef, proconfig, provolatile from pg_proc where oid = 'fleet.lease_held(bigint, uuid)'::regprocedure"
    ).fetchone()
    assert (definer, config, volatile) == (True, ["search_path=pg_catalog, fleet, pg_temp"], "s")
    may = {role: conn.execute("select has_function_privilege(%s, 'fleet.lease_held(bigint, uuid)', 'execute')",
                              (role,)).fetchone()[0]
           for role in ("fleet_worker", "service_role", "anon", "authenticated", "fleet_operator")}
    assert may == {"fleet_worker": True, "service_role": True, "anon": False, "authenticated": False,
                   "fleet_operator": False}
    public = conn.execute("""select exists (select 1 from pg_proc p, aclexplode(p.proacl) a
                               where p.oid = 'fleet.lease_held(bigint, uuid)'::regprocedure
                                 and a.grantee = 0)""").fetchone()[0]
    assert public is False

    # a key for the docs lane asking about a bugfix task hears what it would of no task at all; one
    # for bugfix gets the answer
    for lanes, ok in ((["docs"], False), (["bugfix"], True)):
        with conn.transaction(force_rollback=True):
            conn.execute("select set_config('role', 'fleet_worker', true)")
            conn.execute("select set_config('request.jwt.claims', %s, true)",
                         (json.dumps({"role": "fleet_worker", "fleet_lanes": lanes}),))
            if ok:
                assert held(token) == (False, "cancelled", False)
            else:
                assert held(token) == held(token, task + 1000) == (False, "unknown", False)


# ------------------------------------------------------------------------------------------------
# the fence: a call with a stale, random or null token changes nothing and says "lease lost"


def test_fenced_calls_on_an_unknown_task(conn, lane, session):
    with refused(UNKNOWN_TASK):
        checkpoint(conn, 999, uuid.uuid4(), {})
    with refused(UNKNOWN_TASK):
        complete(conn, 999, uuid.uuid4())
    with refused(UNKNOWN_TASK):
        fail(conn, 999, uuid.uuid4())
    with refused(UNKNOWN_TASK):
        hand_off(conn, 999, uuid.uuid4())


def _fenced_call(name: str) -> Callable[[psycopg.Connection, int, Any], Any]:
    calls: dict[str, Callable[[psycopg.Connection, int, Any], Any]] = {
        "checkpoint": lambda c, i, tok: checkpoint(c, i, tok, {"zombie": True}),
        "complete": lambda c, i, tok: complete(c, i, tok, {"zombie": True}),
        "fail": lambda c, i, tok: fail(c, i, tok, "zombie"),
        "fail-fatal": lambda c, i, tok: fail(c, i, tok, "zombie", retryable=False),
        "hand_off": lambda c, i, tok: hand_off(c, i, tok, {"agent_session": "zombie"}),
        "route": lambda c, i, tok: route(c, i, tok, "b"),
    }
    return calls[name]


FENCED = ["checkpoint", "complete", "fail", "fail-fatal", "hand_off", "route"]


@pytest.mark.parametrize("call", FENCED)
@pytest.mark.parametrize("token", ["stale", "random", "null"])
def test_fenced_call_with_a_bad_token_is_lease_lost_and_changes_nothing(conn, lane, call, token):
    add_lane(conn, "b")
    s1 = open_session(conn, lane, host="zombie")
    s2 = open_session(conn, lane, host="healthy")
    task_id = enqueue(conn, lane, "k")
    first = claim_one(conn, s1)
    assert release(conn, task_id, "lease-expired") == "queued"
    second = claim_one(conn, s2)
    bad = {"stale": first["lease_token"], "random": uuid.uuid4(), "null": None}[token]

    before = world(conn)
    with refused(LEASE_LOST) as info:
        _fenced_call(call)(conn, task_id, bad)
    assert "lease lost" in str(info.value)
    assert world(conn) == before

    # the live lease still works: the fence refused the token, not the call
    _fenced_call(call)(conn, task_id, second["lease_token"])
    assert world(conn) != before


@pytest.mark.parametrize("call", FENCED)
@pytest.mark.parametrize("how", ["completed", "cancelled", "released", "dead"])
def test_fenced_call_after_the_lease_ended_is_lease_lost(conn, lane, session, call, how):
    add_lane(conn, "b")
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    if how == "completed":
        complete(conn, task_id, t["lease_token"])
    elif how == "cancelled":
        cancel(conn, task_id)
    elif how == "released":
        release(conn, task_id)
    else:
        fail(conn, task_id, t["lease_token"], retryable=False)
    before = world(conn)
    with refused(LEASE_LOST):
        _fenced_call(call)(conn, task_id, t["lease_token"])
    assert world(conn) == before


def test_a_token_holds_only_its_own_task(conn, lane, session):
    a = enqueue(conn, lane, "a")
    b = enqueue(conn, lane, "b")
    _ta, tb = claim(conn, session, 2)
    before = world(conn)
    with refused(LEASE_LOST):
        complete(conn, a, tb["lease_token"])
    assert world(conn) == before
    assert complete(conn, b, tb["lease_token"]) == "done"


def test_the_fence_is_the_token_not_the_clock(conn, lane, session):
    # a lease that expired but was not yet repaired still holds the task: only a repair (the
    # monitor's _release) ends it, so a slow worker racing the monitor is decided by the row lock
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    expire(conn, task_id, ago="1 hour")  # its session silent for a lease and an hour
    assert lease_left(conn, task_id) < -3600
    assert one(conn, "select held from fleet.lease_held(%s, %s)", (task_id, t["lease_token"])) is False
    assert complete(conn, task_id, t["lease_token"]) == "done"
