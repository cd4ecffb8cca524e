"""A task's lane and profile, checked once per statement (migrations/sources/20_references.sql):
the rules the foreign keys held, from both sides — a task of no lane or of an unknown profile is
refused, a lane or a profile with tasks is not deleted and a renamed one takes its tasks along; a
delete in flight waits for the task's writer."""

from __future__ import annotations

import threading

import psycopg
import pytest
from sqlkit import add_lane, claim_one, enqueue, one, open_session, refused, route

FK = "23503"


def add_profile(conn: psycopg.Connection, name: str) -> None:
    conn.execute("select fleet.sync_profile(%s, null, '{}')", (name,))


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
    assert "fleet.lanes: lane 'a' has tasks, so it is not deleted" in str(info.value)
    assert info.value.diag.message_hint == "retire it instead: `fleet lanes retire a`"
    conn.execute("delete from fleet.lanes where name = 'empty'")
    conn.execute("update fleet.lanes set name = 'a2' where name = 'a'")
    assert one(conn, "select lane from fleet.tasks where id = %s", (t,)) == "a2"


def test_a_task_of_an_unknown_profile_is_refused_and_nothing_is_written(conn: psycopg.Connection) -> None:
    add_lane(conn, "a")
    add_profile(conn, "p1")
    with refused(FK) as info:
        conn.execute("insert into fleet.tasks (lane, key, profile) values "
                     "('a', 'k1', 'p1'), ('a', 'k2', null), ('a', 'k3', 'nope')")
    assert "fleet.tasks: profile 'nope' names no row of fleet.profiles" in str(info.value)
    assert info.value.diag.table_name == "tasks" and info.value.diag.column_name == "profile"
    assert one(conn, "select count(*) from fleet.tasks") == 0
    conn.execute("insert into fleet.tasks (lane, key, profile) values ('a', 'k1', 'p1'), ('a', 'k2', null)")
    assert one(conn, "select count(*) from fleet.tasks") == 2


def test_a_task_given_an_unknown_profile_later_is_refused(conn: psycopg.Connection) -> None:
    add_lane(conn, "a")
    add_profile(conn, "p1")
    t = enqueue(conn, "a", "k")
    conn.execute("update fleet.tasks set profile = 'p1' where id = %s", (t,))
    with refused(FK) as info:
        conn.execute("update fleet.tasks set profile = 'gone' where id = %s", (t,))
    assert "profile 'gone'" in str(info.value)
    conn.execute("update fleet.tasks set profile = null where id = %s", (t,))
    assert one(conn, "select profile from fleet.tasks where id = %s", (t,)) is None


def test_a_profile_with_tasks_is_not_deleted_and_a_rename_takes_its_tasks_along(conn: psycopg.Connection) -> None:
    add_lane(conn, "a")
    add_profile(conn, "p1")
    add_profile(conn, "unused")
    t = enqueue(conn, "a", "k")
    conn.execute("update fleet.tasks set profile = 'p1' where id = %s", (t,))
    with refused(FK) as info:
        conn.execute("delete from fleet.profiles where name = 'p1'")
    assert "fleet.profiles: profile 'p1' has tasks, so it is not deleted" in str(info.value)
    assert info.value.diag.message_hint == "a task keeps the profile it was given, a finished one too"
    conn.execute("delete from fleet.profiles where name = 'unused'")
    conn.execute("update fleet.profiles set name = 'p2' where name = 'p1'")
    assert one(conn, "select profile from fleet.tasks where id = %s", (t,)) == "p2"


@pytest.mark.parametrize("table, name", [("lanes", "a"), ("profiles", "p1")])
def test_a_delete_of_what_a_task_being_written_names_waits_and_is_refused(db_url: str, table: str,
                                                                         name: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as setup:
        add_lane(setup, "a")
        add_profile(setup, "p1")
    writer = psycopg.connect(db_url)
    try:
        # holds the lane and the profile, not committed
        writer.execute("insert into fleet.tasks (lane, key, profile) values ('a', 'k', 'p1')")
        outcome: list[BaseException | None] = []

        def delete() -> None:
            with psycopg.connect(db_url, autocommit=True) as deleter:
                try:
                    deleter.execute(f"delete from fleet.{table} where name = %s", (name,))
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
        assert one(check, f"select count(*) from fleet.{table} where name = %s", (name,)) == 1
