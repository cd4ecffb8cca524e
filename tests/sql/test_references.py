"""A task's lane, checked once per statement (migrations/sources/20_references.sql): the rule the
foreign key held, from both sides — a task of no lane is refused, a lane with tasks is not deleted
and a renamed one takes its tasks along; a delete in flight waits for the task's writer."""

from __future__ import annotations

import threading

import psycopg
from sqlkit import add_lane, claim_one, enqueue, one, open_session, refused, route

FK = "23503"


def test_a_task_of_no_lane_is_refused_and_nothing_is_written(conn: psycopg.Connection) -> None:
    add_lane(conn, "a")
    with refused(FK) as info:
        conn.execute("insert into fleet.tasks (lane, key) values ('a', 'k1'), ('nope', 'k2')")
    assert "fleet.tasks: lane 'nope' names no row of fleet.lanes" in str(info.value)
    assert info.value.diag.table_name == "tasks" and info.value.diag.column_name == "lane"
    assert one(conn, "select count(*) from fleet.tasks") == 0
    conn.execute("insert into fleet.tasks (lane, key) values ('a', 'k1'), ('a', 'k2')")
    assert one(conn, "select count(*) from fleet.tasks") == 2


def test_a_task_moved_to_no_lane_is_refused(conn: psycopg.Connection) -> None:
    add_lane(conn, "a")
    t = enqueue(conn, "a", "k")
    with refused(FK) as info:
        conn.execute("update fleet.tasks set lane = 'gone' where id = %s", (t,))
    assert "lane 'gone'" in str(info.value)
    assert one(conn, "select lane from fleet.tasks where id = %s", (t,)) == "a"


def test_a_route_still_moves_a_task_to_a_lane_that_is_there(conn: psycopg.Connection) -> None:
    add_lane(conn, "a")
    add_lane(conn, "b")
    t = enqueue(conn, "a", "k")
    s = open_session(conn, "a")
    assert route(conn, t, claim_one(conn, s)["lease_token"], "b") == "queued"
    assert one(conn, "select lane from fleet.tasks where id = %s", (t,)) == "b"


def test_a_lane_with_tasks_is_not_deleted_and_a_rename_takes_its_tasks_along(conn: psycopg.Connection) -> None:
    add_lane(conn, "a")
    add_lane(conn, "empty")
    t = enqueue(conn, "a", "k")
    with refused(FK) as info:
        conn.execute("delete from fleet.lanes where name = 'a'")
    assert "lane 'a' has tasks" in str(info.value)
    assert info.value.diag.message_hint == "retire it instead: `fleet lanes retire a`"
    conn.execute("delete from fleet.lanes where name = 'empty'")
    conn.execute("update fleet.lanes set name = 'a2' where name = 'a'")
    assert one(conn, "select lane from fleet.tasks where id = %s", (t,)) == "a2"


def test_a_lane_deleted_while_a_task_of_it_is_written_waits_and_is_refused(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as setup:
        add_lane(setup, "a")
    writer = psycopg.connect(db_url)
    try:
        writer.execute("insert into fleet.tasks (lane, key) values ('a', 'k')")  # holds the lane, not committed
        outcome: list[BaseException | None] = []

        def delete() -> None:
            with psycopg.connect(db_url, autocommit=True) as deleter:
                try:
                    deleter.execute("delete from fleet.lanes where name = 'a'")
                    outcome.append(None)
                except psycopg.Error as exc:
                    outcome.append(exc)

        th = threading.Thread(target=delete)
        th.start()
        th.join(1.0)
        assert th.is_alive(), "the delete did not wait for the task's writer"
        writer.commit()
        th.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], psycopg.Error)
        assert outcome[0].sqlstate == FK
    finally:
        writer.close()
    with psycopg.connect(db_url, autocommit=True) as check:
        assert one(check, "select count(*) from fleet.lanes where name = 'a'") == 1
