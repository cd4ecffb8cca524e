"""fleet.journal: every transition of a task, a session or a lane, in order, each fact written once
(a task's creation, a claim and a completion are their rows' entries; the rest are events)."""

from __future__ import annotations

import psycopg
from sqlkit import (
    add_lane,
    as_key,
    claim_exactly,
    complete,
    complete_many,
    enqueue,
    enqueue_many,
    hand_off,
    one,
    open_session,
    record_run,
    release,
    route,
    rows,
    take,
)


def journal(conn: psycopg.Connection, where: str, params: tuple[object, ...]) -> list[dict[str, object]]:
    return rows(conn, f"select * from fleet.journal where {where} order by id", params)


def test_a_tasks_whole_life_reads_in_order_from_the_journal(conn: psycopg.Connection) -> None:
    add_lane(conn, "a")
    add_lane(conn, "b")
    t = enqueue(conn, "a", "life")
    s1 = open_session(conn, "a", host="h1")
    hand_off(conn, t, take(conn, s1, t)["lease_token"], {"done": "half"})
    s2 = open_session(conn, "a", host="h2")
    take(conn, s2, t)
    assert release(conn, t, "lease-expired") == "queued"          # the monitor's repair
    s3 = open_session(conn, "a", host="h3")
    assert route(conn, t, take(conn, s3, t)["lease_token"], "b") == "queued"
    s4 = open_session(conn, "b", host="h4")
    lease = take(conn, s4, t)["lease_token"]
    record_run(conn, lease, {"input_tokens": 10, "output_tokens": 5})
    assert complete(conn, t, lease) == "done"

    got = journal(conn, "task_id = %s", (t,))
    assert [(e["kind"], e["lane"], e["session_id"]) for e in got] == [
        ("enqueued", "a", None),
        ("claimed", "a", s1), ("handed_off", "a", s1),
        ("claimed", "a", s2), ("repaired", "a", s2),
        ("claimed", "a", s3), ("routed", "a", s3),
        ("claimed", "b", s4), ("completed", "b", s4),
    ]
    # in the order they happened: positions rise, and so does time
    assert [e["id"] for e in got] == sorted({e["id"] for e in got})  # type: ignore[type-var]
    assert [e["ts"] for e in got] == sorted(e["ts"] for e in got)  # type: ignore[type-var]
    assert got[0]["detail"] == {"key": "life", "priority": 0}
    assert [e["detail"]["attempt"] for e in got if e["kind"] == "claimed"] == [1, 2, 3, 1]  # type: ignore[index]
    assert got[-1]["detail"] == {"attempt": 1, "state": "done"}
    # each fact once: the events hold none of what the task and run rows say
    assert one(conn, "select count(*) from fleet.events where task_id = %s"
                     " and kind in ('enqueued', 'claimed', 'completed')", (t,)) == 0
    # a session's journal: what its shift did, in order
    assert [e["kind"] for e in journal(conn, "session_id = %s", (s2,))][-2:] == ["claimed", "repaired"]
    assert [e["kind"] for e in journal(conn, "session_id = %s and task_id = %s", (s4, t))] == ["claimed", "completed"]


def test_complete_many_journals_what_complete_does(conn: psycopg.Connection) -> None:
    add_lane(conn, "r", config={"review": True})
    enqueue_many(conn, "r", [{"key": f"m{i}"} for i in range(3)])
    s = open_session(conn, "r")
    held = claim_exactly(conn, s, 3)
    assert [st for _, st in complete_many(conn, [h["id"] for h in held], [h["lease_token"] for h in held])] \
        == ["review"] * 3
    for h in held:
        got = journal(conn, "task_id = %s", (h["id"],))
        assert [e["kind"] for e in got] == ["enqueued", "claimed", "completed"]
        assert got[-1]["detail"] == {"attempt": 1, "state": "review"}
        assert got[-1]["session_id"] == s
    # enqueue_many numbers the new tasks' entries in input order
    firsts = journal(conn, "kind = 'enqueued' and lane = 'r'", ())
    assert [e["detail"]["key"] for e in firsts] == ["m0", "m1", "m2"]  # type: ignore[index]


def test_closing_a_run_and_its_report_are_hot_updates(conn: psycopg.Connection) -> None:
    """No indexed column of fleet.runs changes when a run is reported and closed: both updates stay
    on the run's page, with no new index entry."""
    add_lane(conn, "a")
    t = enqueue(conn, "a")
    s = open_session(conn, "a")
    with conn.transaction():
        lease = take(conn, s, t)["lease_token"]
        record_run(conn, lease, {"input_tokens": 1000, "output_tokens": 50, "cost_usd": 0.25, "model": "m"})
        complete(conn, t, lease)
        upd, hot = conn.execute("select n_tup_upd, n_tup_hot_upd from pg_stat_xact_user_tables"
                                " where relid = 'fleet.runs'::regclass").fetchone()  # type: ignore[misc]
    assert (upd, hot) == (2, 2)


def test_a_claim_of_a_hundred_closed_together_stays_on_its_pages(conn: psycopg.Connection) -> None:
    """A claim of 100 puts its runs on pages of their own; complete_many closes them all in one
    statement, so each page needs room for a second, larger version of every run on it: the
    table's fill factor leaves it (at 50, one close in seven moved off its page)."""
    add_lane(conn, "a")
    enqueue_many(conn, "a", [{"key": f"k{i}", "payload": {"i": i}} for i in range(300)])
    s = open_session(conn, "a")
    conn.execute("select pg_stat_reset_single_table_counters('fleet.runs'::regclass)")
    for _ in range(3):
        held = claim_exactly(conn, s, 100)
        done = complete_many(conn, [h["id"] for h in held], [h["lease_token"] for h in held])
        assert {st for _, st in done} == {"done"}
    conn.execute("select pg_stat_force_next_flush()")
    upd, hot = conn.execute("select n_tup_upd, n_tup_hot_upd from pg_stat_user_tables"
                            " where relid = 'fleet.runs'::regclass").fetchone()  # type: ignore[misc]
    assert (upd, hot) == (300, 300)


def test_a_run_that_lasted_long_is_still_found_by_its_end(conn: psycopg.Connection) -> None:
    """fleet._runs_ended_since finds a run by its end whatever it lasted: the short ones through their
    start, the ones longer than an hour through long_ended_at."""
    add_lane(conn, "a")
    s = open_session(conn, "a")
    ids = [enqueue(conn, "a") for _ in range(3)]
    for t, started in zip(ids, ("10 minutes", "5 hours", "3 days"), strict=True):
        lease = take(conn, s, t)["lease_token"]
        conn.execute(f"update fleet.runs set started_at = now() - interval '{started}' where lease_token = %s",
                     (lease,))
        complete(conn, t, lease)
    found = rows(conn, "select task_id, long_ended_at is not null as long"
                       " from fleet._runs_ended_since(now() - interval '1 minute') order by task_id")
    assert found == [{"task_id": ids[0], "long": False}, {"task_id": ids[1], "long": True},
                     {"task_id": ids[2], "long": True}]
    assert rows(conn, "select task_id from fleet._runs_ended_since(now() + interval '1 minute')") == []
    # and the journal's completions since a time are the same runs
    assert {e["task_id"] for e in rows(conn, "select task_id from fleet.journal_since(now() - interval '1 minute')"
                                             " where kind = 'completed'")} == set(ids)


def test_a_lane_scoped_key_reads_the_journal_of_its_lanes_only(conn: psycopg.Connection) -> None:
    add_lane(conn, "a")
    add_lane(conn, "b")
    ta, tb = enqueue(conn, "a"), enqueue(conn, "b")
    for lane, t in (("a", ta), ("b", tb)):
        s = open_session(conn, lane)
        complete(conn, t, take(conn, s, t)["lease_token"])
    with as_key(conn, "fleet_operator", {"role": "fleet_operator", "fleet_lanes": ["a"]}):
        seen = rows(conn, "select distinct task_id from fleet.journal where task_id is not null")
    assert seen == [{"task_id": ta}]


def test_the_journal_is_read_only(conn: psycopg.Connection) -> None:
    add_lane(conn, "a")
    with conn.transaction(force_rollback=True):
        try:
            conn.execute("insert into fleet.journal (id, kind) values (1, 'x')")
        except psycopg.errors.InsufficientPrivilege:
            pass
        else:
            raise AssertionError("a write to fleet.journal went through")
    assert one(conn, "select count(*) from fleet.events") == 0
