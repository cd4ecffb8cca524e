"""The sessions group (migrations/sources/05_sessions.sql): fleet.open_session, fleet.close_session
(the lane hand-off it writes, the tasks it releases) and fleet.declare_session_lost, called over
psycopg against a real, freshly migrated PostgreSQL.
"""

from __future__ import annotations

import uuid

import psycopg
import pytest
from sqlkit import (
    INVALID_ARGUMENT,
    SESSION_NOT_ACTIVE,
    UNKNOWN_LANE,
    add_lane,
    claim,
    claim_exactly,
    claim_one,
    close_session,
    complete,
    count,
    enqueue,
    events,
    fail,
    hand_off,
    kinds,
    last_event,
    one,
    open_session,
    race,
    record_run,
    refused,
    repaired_events,
    rows,
    runs,
    session_row,
    sync_lane,
    task,
    world,
)

# ------------------------------------------------------------------------------------------------
# open_session


def test_open_session(conn, lane):
    sid = open_session(conn, lane, host="box", pid=77, seconds=300)
    s = rows(
        conn, "select *, extract(epoch from deadline - started_at) as len from fleet.sessions"
    )[0]
    assert s["id"] == sid
    assert s["lane"] == "a" and s["host"] == "box" and s["pid"] == 77
    assert s["state"] == "active" and s["ended_at"] is None
    assert s["pid_started_at"] is not None and s["pid_identity"] is None
    assert float(s["len"]) == 300
    other = one(conn, "select fleet.open_session('a', 'box', 77, now(), 300, %s)", ("boot-id:12345",))
    assert rows(conn, "select pid_identity from fleet.sessions where id = %s", (other,)) == [
        {"pid_identity": "boot-id:12345"}]
    ev = rows(conn, "select * from fleet.journal where session_id = %s", (sid,))
    assert [e["kind"] for e in ev] == ["session_opened"]
    assert ev[0]["detail"] == {"host": "box", "pid": 77, "seconds": 300}


@pytest.mark.parametrize(
    ("code", "args"),
    [
        (UNKNOWN_LANE, ("nope", "h", 1, 60, None)),
        (UNKNOWN_LANE, (None, "h", 1, 60, None)),
        (INVALID_ARGUMENT, ("a", "", 1, 60, None)),
        (INVALID_ARGUMENT, ("a", None, 1, 60, None)),
        (INVALID_ARGUMENT, ("a", "h", 0, 60, None)),
        (INVALID_ARGUMENT, ("a", "h", -5, 60, None)),
        (INVALID_ARGUMENT, ("a", "h", None, 60, None)),
        (INVALID_ARGUMENT, ("a", "h", 1, 0, None)),
        (INVALID_ARGUMENT, ("a", "h", 1, -60, None)),
        (INVALID_ARGUMENT, ("a", "h", 1, None, None)),
        (INVALID_ARGUMENT, ("a", "h", 1, 60, "")),
        (INVALID_ARGUMENT, ("a", "h", 1, 60, "b" * 201)),
    ],
)
def test_open_session_refusals_write_nothing(conn, lane, code, args):
    with refused(code):
        conn.execute("select fleet.open_session(%s, %s, %s, now(), %s, %s)", args)
    assert count(conn, "sessions") == 0
    assert count(conn, "events") == 0


# ------------------------------------------------------------------------------------------------
# close_session


def test_close_session_writes_the_lane_handoff(conn, lane, session):
    conn.execute("update fleet.lanes set backoff_base_seconds = 600")
    done, failed, handed, held, waiting = (
        enqueue(conn, lane, k) for k in ("done", "failed", "handed", "held", "waiting")
    )
    urgent = enqueue(conn, lane, "urgent", priority=50)
    claimed = claim(conn, session, 5)
    assert {t["id"] for t in claimed} == {urgent, done, failed, handed, held}
    tok = {t["id"]: t["lease_token"] for t in claimed}
    complete(conn, urgent, tok[urgent])
    complete(conn, done, tok[done])
    fail(conn, failed, tok[failed], "oops")
    hand_off(conn, handed, tok[handed], {"agent_session": "x"})
    record_run(
        conn,
        tok[done],
        {
            "input_tokens": 100,
            "cache_creation_tokens": 10,
            "cache_read_tokens": 1000,
            "output_tokens": 50,
            "cost_usd": 0.25,
        },
    )
    record_run(conn, tok[failed], {"input_tokens": 20, "output_tokens": 5, "cost_usd": 0.5})
    record_run(conn, tok[held], {"input_tokens": 1})
    # a run of another session is not counted
    other = open_session(conn, lane, host="host-2")
    extra = enqueue(conn, lane, "extra")
    conn.execute("update fleet.tasks set priority = 99 where id = %s", (extra,))
    t = claim_one(conn, other)
    record_run(conn, t["lease_token"], {"input_tokens": 100000})
    complete(conn, extra, t["lease_token"])

    hid = close_session(conn, session, "deadline", {"summary": "a good shift"})
    [h] = rows(conn, "select * from fleet.lane_handoffs where session_id = %s", (session,))
    assert h["id"] == hid
    assert h["lane"] == "a"
    assert h["end_reason"] == "deadline"
    assert h["counts"] == {
        "runs": 5,
        "done": 2,
        "failed": 1,
        "handed_off": 1,
        "routed": 0,
        "lost": 1,
        "cancelled": 0,
    }
    assert h["completed"] == [urgent, done]
    assert h["failed"] == [failed]
    assert h["handed_off"] == [handed]
    assert h["tokens"] == {"input": 121, "cache_creation": 10, "cache_read": 1000, "output": 55}
    assert float(h["cost_usd"]) == 0.75
    assert h["notes"] == {"summary": "a good shift"}
    assert h["window_start"] <= h["window_end"]
    # the queue head, in claim order: the work carried over first — the resumed hand-off, then the
    # released one (repaired work goes before fresh work of its priority) — then the waiting task,
    # then the failed one (in backoff, still queued)
    head = [q["id"] for q in h["queue_head"]]
    assert head == [handed, held, waiting, failed]
    assert [q["carry_over"] for q in h["queue_head"]] == [True, True, False, False]
    assert set(h["queue_head"][0]) >= {"id", "key", "title", "priority", "carry_over", "run_at"}

    # the still-held task was released, counting an evaporation
    released = task(conn, held)
    assert released["state"] == "queued"
    assert released["evaporations"] == 1
    assert released["lease_token"] is None
    assert runs(conn, held)[0]["outcome"] == "lost"
    assert runs(conn, held)[0]["error_tail"] == "released: session-closed"
    assert kinds(conn, held)[-1] == "repaired"
    assert last_event(conn, held)["detail"]["reason"] == "session-closed"

    s = rows(conn, "select * from fleet.sessions where id = %s", (session,))[0]
    assert s["state"] == "ended" and s["ended_at"] is not None and s["end_reason"] == "deadline"
    ev = rows(
        conn,
        "select * from fleet.journal where session_id = %s and kind = 'session_closed'",
        (session,),
    )
    assert len(ev) == 1
    assert ev[0]["detail"] == {"reason": "deadline", "lane_handoff": hid}


def test_close_session_release_at_the_cap_is_dead(conn, session):
    conn.execute("update fleet.lanes set max_attempts = 1")
    task_id = enqueue(conn, "a", "k")
    claim_one(conn, session)
    close_session(conn, session)
    after = task(conn, task_id)
    assert after["state"] == "dead" and after["dead_reason"] == "attempt-cap"
    assert after["evaporations"] == 1 and after["finished_at"] is not None


def test_close_session_twice_returns_the_same_id(conn, lane, session):
    enqueue(conn, lane, "k")
    claim_one(conn, session)
    first = close_session(conn, session, "deadline", {"n": 1})
    before = world(conn)
    assert close_session(conn, session, "sigterm", {"n": 2}) == first
    assert world(conn) == before, "closing again is a no-op"


def test_close_session_empty(conn, lane, session):
    hid = close_session(conn, session, None, None)
    [h] = rows(conn, "select * from fleet.lane_handoffs where id = %s", (hid,))
    assert h["counts"]["runs"] == 0
    assert h["completed"] == [] and h["failed"] == [] and h["handed_off"] == []
    assert h["tokens"] == {"input": 0, "cache_creation": 0, "cache_read": 0, "output": 0}
    assert h["queue_head"] == [] and h["notes"] == {}
    assert h["end_reason"] == "closed"
    assert one(conn, "select end_reason from fleet.sessions") == "closed"


def test_close_session_queue_head_is_ten_of_its_lane(conn, lane, session):
    add_lane(conn, "b")
    enqueue(conn, "b", "other-lane", priority=1000)
    ids = [enqueue(conn, lane, f"k{i:02}", priority=i % 3) for i in range(15)]
    hid = close_session(conn, session)
    head = one(conn, "select queue_head from fleet.lane_handoffs where id = %s", (hid,))
    expected = sorted(ids, key=lambda i: (-((i - ids[0]) % 3), i))[:10]
    assert [q["id"] for q in head] == expected


def test_close_session_of_a_lost_session_still_writes_the_snapshot(conn, lane, session):
    conn.execute("update fleet.sessions set state = 'lost', ended_at = now(), end_reason = 'gone'")
    hid = close_session(conn, session, "late")
    assert hid is not None
    s = rows(conn, "select * from fleet.sessions")[0]
    assert s["state"] == "lost" and s["end_reason"] == "gone", "a lost session stays lost"


def test_close_session_refusals(conn, lane, session):
    before = world(conn)
    with refused(SESSION_NOT_ACTIVE):
        close_session(conn, uuid.uuid4())
    with refused(INVALID_ARGUMENT):
        close_session(conn, session, "x", [1])
    assert world(conn) == before


def test_concurrent_close_session_writes_one_snapshot(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into fleet.lanes (name) values ('a')")
        c.execute("select fleet.enqueue('a', 'k' || g) from generate_series(1, 5) g")
        sid = open_session(c, "a", "h", 1)
        c.execute("select fleet.claim(%s, 5)", (sid,))

    def work(c: psycopg.Connection, i: int) -> int:
        row = c.execute("select fleet.close_session(%s, 'race', null)", (sid,)).fetchone()
        assert row is not None
        return row[0]

    results = race(db_url, 4, work)
    assert all(isinstance(r, int) for r in results), results
    assert len(set(results)) == 1
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute("select count(*) from fleet.lane_handoffs").fetchone() == (1,)
        assert c.execute(
            "select sum(evaporations), count(*) filter (where state = 'queued') from fleet.tasks"
        ).fetchone() == (5, 5), "each held task released exactly once"


# ------------------------------------------------------------------------------------------------
# declare_session_lost (the monitor's pass calls it too: tests/sql/test_reconcile.py)


def test_declare_session_lost_directly(conn):
    sync_lane(conn)
    s = open_session(conn, "a")
    enqueue(conn, "a")
    enqueue(conn, "a")
    held = claim_exactly(conn, s, 2)
    result = rows(conn, "select * from fleet.declare_session_lost(%s, 'pid-gone')", (s,))
    assert [r["action"] for r in result] == ["session_lost", "released", "released"]
    assert session_row(conn, s)["end_reason"] == "pid-gone"
    for t in held:
        assert task(conn, t["id"])["state"] == "queued"
        assert repaired_events(conn, t["id"])[0]["detail"]["reason"] == "pid-gone"
    # a second declaration is a no-op (nothing active, nothing held)
    assert rows(conn, "select * from fleet.declare_session_lost(%s, 'pid-gone')", (s,)) == []
    assert len(events(conn, "session_lost")) == 1
