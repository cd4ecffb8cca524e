"""The lanes group (migrations/sources/03_lanes.sql): fleet.sync_lane never changes a lane under a claim
in flight, and the next claim sees what it wrote; a lane paused for what lanefleet found wrong
with its config (fleet.pause_lane, sync_lane's paused_reason) apart from an operator's pause; a
retired lane (fleet.retire_lane, fleet.unretire_lane) and what refuses it. (What sync_lane answers, created / unchanged /
updated, through the store: tests/test_store.py; pools and profiles through real shifts:
tests/test_dispatch.py.)
"""

from __future__ import annotations

import pytest
from psycopg import errors
from psycopg.types.json import Jsonb
from sqlkit import (
    INVALID_ARGUMENT,
    INVALID_STATE,
    LANE_NOT_ALLOWED,
    LANE_RETIRED,
    UNKNOWN_LANE,
    Call,
    add_lane,
    as_key,
    cancel,
    claim,
    complete,
    enqueue,
    events,
    fail,
    fill,
    leases,
    one,
    open_session,
    refused,
    retry,
    route,
    rows,
    running,
    sync_lane,
    take,
    task,
    wait_until_waiting,
)

# ------------------------------------------------------------------------------------------------
# sync_lane and the claims in flight


def test_sync_lane_waits_for_the_claims_in_flight_and_the_next_claim_sees_its_limit(connect) -> None:
    setup = connect()
    add_lane(setup, "free")
    add_lane(setup, "other")
    fill(setup, "free", 6)
    fill(setup, "other", 1)
    sa, sb, so = open_session(setup, "free", host="host-1"), open_session(setup, "free", host="host-2"), open_session(setup, "other", host="host-3")

    # an unlimited claim in flight; the lane is given max_running 3 meanwhile
    a = connect(autocommit=False)
    assert len(leases(a, sa, 3)) == 3
    s = connect()
    sync = Call(s, lambda c: one(c, "select fleet.sync_lane('free', '{\"max_running\": 3}')"))
    sync.start()
    assert wait_until_waiting(setup, s.info.backend_pid) == "advisory"
    a.commit()
    assert sync.outcome() == "updated"
    # had the sync not waited, this claim would not see the three above (uncommitted) and take 3 more
    b = connect()
    assert leases(b, sb, 3) == []
    assert running(setup, "free") == 3

    # a sync not yet committed holds back the claims of its lane only
    s2 = connect(autocommit=False)
    assert one(s2, "select fleet.sync_lane('free', '{\"max_running\": 4}')") == "updated"
    b.execute("set lock_timeout = '300ms'")
    with pytest.raises(errors.LockNotAvailable):
        leases(b, sb, 1)
    o = connect()
    o.execute("set lock_timeout = '2s'")
    assert len(leases(o, so, 1)) == 1
    s2.commit()
    assert len(leases(b, sb, 3)) == 1  # the new limit: 4


# ------------------------------------------------------------------------------------------------
# a lane paused for its config (what lanefleet found wrong), apart from an operator's pause


def _sync(conn, name: str, **settings) -> str:
    return one(conn, "select fleet.sync_lane(%s, %s)", (name, Jsonb(settings)))


def _lane(conn, name: str) -> dict:
    return rows(conn, "select * from fleet.lanes where name = %s", (name,))[0]


def test_a_lane_paused_by_its_preflight_claims_nothing_until_a_sync_of_a_fixed_config(conn) -> None:
    reason = "lanes.x.instructions: lane_instructions/x.md does not exist"
    assert _sync(conn, "x", paused_reason=reason) == "created"
    enqueue(conn, "x", "t1")
    s = open_session(conn, "x")
    assert claim(conn, s, 5) == []
    assert (_lane(conn, "x")["paused"], _lane(conn, "x")["paused_reason"]) == (False, reason)
    assert _lane(conn, "x")["paused_at"] is not None
    overview = rows(conn, "select paused, paused_reason, retired from fleet.lane_overview where lane = 'x'")
    assert overview == [{"paused": True, "paused_reason": reason, "retired": False}]
    assert rows(conn, "select * from fleet.ready_by_lane()") == []  # `fleet up` launches no shift for it
    # a sync that says nothing of it (fleet migrate) leaves it; the same reason again changes nothing
    assert _sync(conn, "x", max_running=2) == "updated"
    assert _sync(conn, "x", max_running=2, paused_reason=reason) == "unchanged"
    assert claim(conn, s, 5) == []
    # the fixed config: cleared, journaled, claimed
    assert _sync(conn, "x", max_running=2, paused_reason=None) == "updated"
    assert _lane(conn, "x")["paused_reason"] is None and _lane(conn, "x")["paused_at"] is None
    assert [(e["detail"]["by"], e["detail"].get("reason"), e["detail"].get("was"))
            for e in events(conn, "lane_paused", "x") + events(conn, "lane_unpaused", "x")] == [
        ("sync", reason, None), ("sync", None, reason)]
    assert len(claim(conn, s, 5)) == 1


def test_an_operators_pause_stays_apart_from_a_preflight_pause(conn) -> None:
    assert _sync(conn, "x", paused=True, paused_reason="lanes.x.command: 'claudee' is not on PATH") == "created"
    enqueue(conn, "x", "t1")
    s = open_session(conn, "x")
    # the config fixed, the operator's pause stays: still nothing claimed
    assert _sync(conn, "x", paused=True, paused_reason=None) == "updated"
    assert (_lane(conn, "x")["paused"], _lane(conn, "x")["paused_reason"]) == (True, None)
    assert rows(conn, "select paused, paused_reason from fleet.lane_overview where lane = 'x'") == [
        {"paused": True, "paused_reason": None}]
    assert claim(conn, s, 5) == []
    # and a pause lanefleet puts on it leaves the operator's word as it was
    assert one(conn, "select fleet.pause_lane('x', 'lanes.x.hidden_files: no set claud')") == "paused"
    assert _lane(conn, "x")["paused"] is True
    assert _sync(conn, "x", paused=False, paused_reason=None) == "updated"
    assert len(claim(conn, s, 5)) == 1


def test_pause_lane_wants_a_reason_a_known_lane_and_the_keys_own_lane(conn) -> None:
    add_lane(conn, "a")
    add_lane(conn, "b")
    with refused(INVALID_ARGUMENT):
        one(conn, "select fleet.pause_lane('a', '  ')")
    with refused(UNKNOWN_LANE):
        one(conn, "select fleet.pause_lane('nope', 'why')")
    with refused(INVALID_ARGUMENT):
        _sync(conn, "a", paused_reason="")
    with as_key(conn, "fleet_worker", {"role": "fleet_worker", "fleet_lanes": ["a"]}):
        with refused(LANE_NOT_ALLOWED):
            one(conn, "select fleet.pause_lane('b', 'not yours')")
    with as_key(conn, "fleet_worker", {"role": "fleet_worker", "fleet_lanes": ["a"]}):
        assert one(conn, "select fleet.pause_lane('a', 'the agent is not on PATH')") == "paused"
        assert one(conn, "select fleet.pause_lane('a', 'the agent is not on PATH')") == "unchanged"
        assert one(conn, "select paused_reason from fleet.lanes where name = 'a'") == "the agent is not on PATH"
    assert _lane(conn, "a")["paused_reason"] is None  # (as_key rolls back)
    assert _lane(conn, "b")["paused_reason"] is None


# ------------------------------------------------------------------------------------------------
# retired lanes


def test_retire_refuses_while_tasks_are_live_naming_how_many_of_each(conn) -> None:
    sync_lane(conn, "old")
    s = open_session(conn, "old")
    queued = [enqueue(conn, "old", f"q{i}") for i in range(2)]
    running_one = enqueue(conn, "old", "r")
    take(conn, s, running_one)
    with refused(INVALID_STATE) as err:
        one(conn, "select fleet.retire_lane('old')")
    assert "lane old has 3 live tasks (2 queued, 1 running)" in str(err.value)
    assert _lane(conn, "old")["retired_at"] is None
    for t in queued:
        cancel(conn, t)
    with refused(INVALID_STATE) as err:
        one(conn, "select fleet.retire_lane('old')")
    assert "1 live task (1 running)" in str(err.value)
    complete(conn, running_one, task(conn, running_one)["lease_token"])
    assert one(conn, "select fleet.retire_lane('old')") == "retired"
    assert one(conn, "select fleet.retire_lane('old')") == "unchanged"
    assert [e["lane"] for e in events(conn, "lane_retired")] == ["old"]
    with refused(UNKNOWN_LANE):
        one(conn, "select fleet.retire_lane('nope')")


def test_a_retired_lane_takes_no_task_by_any_way_in_and_is_not_claimed(conn) -> None:
    sync_lane(conn, "old")
    sync_lane(conn, "new")
    s_old = open_session(conn, "old")  # a shift that began before the lane was retired
    dead = enqueue(conn, "old", "d")
    take(conn, s_old, dead)
    conn.execute("update fleet.tasks set max_attempts = 1 where id = %s", (dead,))
    assert fail(conn, dead, task(conn, dead)["lease_token"]) == "dead"
    assert one(conn, "select fleet.retire_lane('old')") == "retired"

    with refused(LANE_RETIRED) as err:
        enqueue(conn, "old", "late")
    assert "lane old is retired" in str(err.value) and "fleet lanes unretire old" in err.value.diag.message_hint
    with refused(LANE_RETIRED):
        retry(conn, dead)
    with refused(LANE_RETIRED):
        open_session(conn, "old")
    s_new = open_session(conn, "new")
    mover = enqueue(conn, "new", "mover")
    take(conn, s_new, mover)
    with refused(LANE_RETIRED):
        route(conn, mover, task(conn, mover)["lease_token"], "old")
    # an unknown lane's hint names the lanes that take tasks
    with refused(UNKNOWN_LANE) as err:
        enqueue(conn, "nope", "x")
    assert "known lanes: new;" in err.value.diag.message_hint
    conn.execute("insert into fleet.tasks (lane, key) values ('old', 'slipped-in')")  # (no way in but SQL)
    assert claim(conn, s_old, 5) == []

    # a sync of the config that still has the lane keeps it retired; the config's explicit word,
    # or an unretire, brings it back
    assert _sync(conn, "old", max_running=3) == "retired"
    assert _lane(conn, "old")["retired_at"] is not None and _lane(conn, "old")["max_running"] == 3
    assert _sync(conn, "old", max_running=3, retired=False) == "updated"
    assert _lane(conn, "old")["retired_at"] is None
    [slipped] = claim(conn, s_old, 5)
    complete(conn, slipped["id"], slipped["lease_token"])
    assert _sync(conn, "old", max_running=3, retired=True) == "retired"
    assert one(conn, "select fleet.unretire_lane('old')") == "unretired"
    assert one(conn, "select fleet.unretire_lane('old')") == "unchanged"
    assert enqueue(conn, "old", "back")
    with refused(INVALID_ARGUMENT):
        _sync(conn, "old", retired="yes")


def test_retire_waits_for_an_enqueue_in_flight_and_counts_its_task(connect) -> None:
    setup = connect()
    sync_lane(setup, "old")
    a = connect(autocommit=False)
    enqueue(a, "old", "in-flight")
    r = connect()
    retire = Call(r, lambda c: one(c, "select fleet.retire_lane('old')"))
    retire.start()
    wait_until_waiting(setup, r.info.backend_pid)
    a.commit()
    with refused(INVALID_STATE) as err:
        retire.outcome()
    assert "1 live task (1 queued)" in str(err.value)
    # and an enqueue that comes while a retire is under way reads the lane retired once it commits
    one(setup, "select fleet.cancel(id) from fleet.tasks where key = 'in-flight'")
    b = connect(autocommit=False)
    assert one(b, "select fleet.retire_lane('old')") == "retired"
    e = connect()
    late = Call(e, lambda c: enqueue(c, "old", "late"))
    late.start()
    wait_until_waiting(setup, e.info.backend_pid)
    b.commit()
    with refused(LANE_RETIRED):
        late.outcome()
    assert one(setup, "select count(*) from fleet.tasks where key = 'late'") == 0


def test_enqueue_many_refuses_a_retired_lane_naming_the_element(conn) -> None:
    sync_lane(conn, "old")
    sync_lane(conn, "new")
    assert one(conn, "select fleet.retire_lane('old')") == "retired"
    with refused(LANE_RETIRED) as err:
        one(conn, "select count(*) from fleet.enqueue_many('new', %s)",
            (Jsonb([{"key": "fine"}, {"key": "late", "lane": "old"}]),))
    assert str(err.value).startswith("p_tasks[1] (key 'late'): lane old is retired")
    assert one(conn, "select count(*) from fleet.tasks") == 0


def test_an_unknown_lanes_hint_names_only_lanes_that_take_tasks_and_the_key_may_work(conn) -> None:
    """One hint (fleet._lanes_hint) for every way in: enqueue and enqueue_many alike leave out a
    retired lane, and a key limited to some lanes learns of no other (its claim may name a lane
    that does not exist: that one is unknown, and the hint lists only its own)."""
    for name in ("old", "new", "secret"):
        sync_lane(conn, name)
    assert one(conn, "select fleet.retire_lane('old')") == "retired"
    calls = [lambda lane: enqueue(conn, lane, "x"),
             lambda lane: one(conn, "select count(*) from fleet.enqueue_many(null, %s)",
                              (Jsonb([{"key": "x", "lane": lane}]),))]
    for call in calls:
        with refused(UNKNOWN_LANE) as err:
            call("nope")
        assert err.value.diag.message_hint.startswith("known lanes: new, secret;"), err.value.diag.message_hint
        with as_key(conn, "fleet_worker", {"role": "fleet_worker", "fleet_lanes": ["new", "planned"]}), \
                refused(UNKNOWN_LANE) as err:
            call("planned")
        assert err.value.diag.message_hint.startswith("known lanes: new;"), err.value.diag.message_hint
    assert one(conn, "select count(*) from fleet.tasks") == 0
