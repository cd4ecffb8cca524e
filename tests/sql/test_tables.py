"""The tables of schema fleet (made by the timestamped migrations, not by a source group): their own
constraints refuse impossible states whatever writes them, the hot tables' storage settings, and the
session row's updates by claims and heartbeats stay HOT.
"""

from __future__ import annotations

import re

import psycopg
import pytest
from sqlkit import (
    claim,
    claim_one,
    enqueue,
    one,
    open_session,
    rows,
    world,
)

from worker.models import FINISHED_STATES, TASK_STATES

# ------------------------------------------------------------------------------------------------
# the table's own constraints refuse impossible states, whatever writes them


@pytest.mark.parametrize(
    ("label", "update"),
    [
        ("running without lease token", "lease_token = null"),
        ("running without lease expiry", "lease_expires_at = null"),
        ("running without session", "session_id = null"),
        ("queued with a lease", "state = 'queued'"),
        (
            "done without finished_at",
            "state = 'done', lease_token = null, lease_expires_at = null, session_id = null",
        ),
        ("negative attempts", "attempts = -1"),
        ("priority out of range", "priority = 1001"),
        ("payload not an object", "payload = '[]'"),
        ("unknown state", "state = 'paused'"),
    ],
)
def test_constraints_refuse_impossible_task_states(conn, lane, session, label, update):
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    before = world(conn)
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(f"update fleet.tasks set {update} where id = %s", (task_id,))
    assert world(conn) == before, label


def test_constraint_refuses_a_queued_task_with_a_lease(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(
            "update fleet.tasks set lease_token = gen_random_uuid() where id = %s", (task_id,)
        )
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("update fleet.tasks set state = 'running' where id = %s", (task_id,))


def test_constraint_refuses_an_active_session_with_an_end(conn, lane, session):
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("update fleet.sessions set ended_at = now()")
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("update fleet.sessions set state = 'ended'")


@pytest.mark.parametrize(("label", "update"), [
    ("unknown outcome", "outcome = 'vanished', ended_at = now()"),
    ("negative tokens", "input_tokens = -1"),
    ("negative cost", "cost_usd = -0.01"),
    ("attempt zero", "attempt = 0"),
    ("an outcome without an end", "outcome = 'done'"),
])
def test_constraints_refuse_impossible_runs(conn, lane, session, label, update):
    enqueue(conn, lane, "k")
    claim_one(conn, session)
    before = world(conn)
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(f"update fleet.runs set {update}")
    assert world(conn) == before, label


def test_a_check_of_the_written_tables_relates_columns(conn):
    """PostgreSQL plans every CHECK of a table again for each statement that writes it, whatever
    columns it sets; a one-column rule is its column's domain, planned once per backend."""
    one_column = rows(conn, """
        select conrelid::regclass::text as tbl, conname from pg_constraint
         where contype = 'c' and conrelid in ('fleet.tasks'::regclass, 'fleet.runs'::regclass)
           and cardinality(conkey) < 2""")
    assert one_column == []
    domains = {r[0] for r in conn.execute("""
        select c.conname from pg_constraint c join pg_attribute a on a.atttypid = c.contypid
         where a.attrelid in ('fleet.tasks'::regclass, 'fleet.runs'::regclass) and c.contype = 'c'""")}
    assert {"task_state", "task_priority_range", "counter_non_negative", "run_outcome",
            "token_count_non_negative", "cost_non_negative"} <= domains


# ------------------------------------------------------------------------------------------------
# storage settings


def test_hot_table_settings(conn: psycopg.Connection) -> None:
    opts = {r["relname"]: dict(o.split("=", 1) for o in r["reloptions"] or [])
            for r in rows(conn, "select relname, reloptions from pg_class"
                                " where relnamespace = 'fleet'::regnamespace and relname in ('tasks', 'sessions')")}
    assert opts["tasks"]["fillfactor"] == "70" and float(opts["tasks"]["autovacuum_vacuum_scale_factor"]) <= 0.05
    assert opts["sessions"]["fillfactor"] == "70"
    indexes = {r[0] for r in conn.execute("select indexname from pg_indexes where schemaname = 'fleet'").fetchall()}
    assert "sessions_active_heartbeat" not in indexes
    assert {"events_task", "events_session", "events_kind_ts", "events_ts", "tasks_ready"} <= indexes
    # the claim's ORDER BY is the partial index's order, on queued rows
    assert one(conn, "select indexdef from pg_indexes where indexname = 'tasks_ready'").endswith(
        "(lane, priority DESC, carry_over DESC, run_at, id) WHERE ((state)::text = 'queued'::text)")


def test_every_index_of_the_growing_tables_names_its_reader(conn: psycopg.Connection) -> None:
    """An index costs every non-HOT update of its table an entry: each one says which query reads it
    (its comment), and the run row's close changes none of them."""
    got = rows(conn, """
        select c.relname as tbl, i.relname as idx, obj_description(i.oid, 'pg_class') as note
          from pg_index x join pg_class i on i.oid = x.indexrelid join pg_class c on c.oid = x.indrelid
         where c.relnamespace = 'fleet'::regnamespace and c.relname in ('tasks', 'runs', 'events', 'sessions')""")
    assert len(got) >= 20
    unnamed = [(r["tbl"], r["idx"]) for r in got if not (r["note"] or "").startswith("read by: ")]
    assert unnamed == []
    # closing a run writes outcome, ended_at, end_id, end_state: in no index, key or predicate
    indexed = {r[0] for r in conn.execute(r"""
        select a.attname from pg_index x join pg_attribute a on a.attrelid = x.indrelid
         where x.indrelid = 'fleet.runs'::regclass
           and (a.attnum = any (x.indkey::int2[])
                or pg_get_expr(x.indpred, x.indrelid) ~ ('\m' || a.attname || '\M'))""").fetchall()}
    assert indexed.isdisjoint({"outcome", "ended_at", "end_id", "end_state", "input_tokens", "cost_usd"}), indexed
    opts = one(conn, "select reloptions from pg_class where oid = 'fleet.runs'::regclass")
    assert "fillfactor=40" in opts
    assert one(conn, "select amname from pg_class c join pg_am a on a.oid = c.relam"
                     " where c.oid = 'fleet.events_ts'::regclass") == "brin"


def test_a_task_is_in_the_indexes_of_its_state_only(lanes: psycopg.Connection) -> None:
    """Each state change of a task is a non-HOT update: it adds an entry to every index whose
    predicate the new row meets. A queued task is in the ready index and no other partial one; a
    running one in the live and running-session ones; a done one in none but the three every task
    is in (so an enqueue writes 4 entries and a completion 3)."""
    conn = lanes
    partial = {r["idx"]: r["pred"] for r in rows(conn, """
        select i.relname as idx, pg_get_expr(x.indpred, x.indrelid) as pred
          from pg_index x join pg_class i on i.oid = x.indexrelid
         where x.indrelid = 'fleet.tasks'::regclass""")}
    every = {i for i, p in partial.items() if p is None}
    assert every == {"tasks_pkey", "task_key_lane_unique", "tasks_created"}

    def holding(task_id: int) -> set[str]:
        return every | {i for i, p in partial.items()
                        if p is not None and one(conn, f"select exists (select 1 from fleet.tasks"
                                                       f" where id = %s and ({p}))", (task_id,))}

    t = enqueue(conn, "docs")
    assert holding(t) == every | {"tasks_ready"}
    s = open_session(conn, "docs")
    held = claim_one(conn, s)
    assert held["id"] == t
    assert holding(t) == every | {"tasks_live_lane", "tasks_running_session"}
    conn.execute("select fleet.complete(%s, %s)", (t, held["lease_token"]))
    assert one(conn, "select state from fleet.tasks where id = %s", (t,)) == "done"
    assert holding(t) == every


def test_a_claim_and_a_heartbeat_update_the_session_in_place(lanes: psycopg.Connection) -> None:
    """Without an index on heartbeat_at, the session row's updates are HOT (no index entries)."""
    conn = lanes
    s = open_session(conn, "docs")
    conn.execute("select pg_stat_reset_single_table_counters('fleet.sessions'::regclass)")
    for _ in range(10):
        claim(conn, s, 1)
        conn.execute("select * from fleet.heartbeat(%s)", (s,))
    conn.execute("select pg_stat_force_next_flush()")  # this backend's counters, now (PostgreSQL 15+)
    upd, hot = conn.execute("select n_tup_upd, n_tup_hot_upd from pg_stat_user_tables"
                            " where relid = 'fleet.sessions'::regclass").fetchone()
    assert upd >= 20 and hot == upd, (upd, hot)


def _check(conn: psycopg.Connection, name: str) -> str:
    row = conn.execute(
        # a check of the table, or of a column's domain (fleet.task_state)
        "select pg_get_constraintdef(oid) from pg_constraint where conname = %s and (conrelid = 'fleet.tasks'::regclass"
        " or contypid in (select atttypid from pg_attribute where attrelid = 'fleet.tasks'::regclass))",
        (name,),
    ).fetchone()
    assert row is not None, name
    return str(row[0])


def test_the_python_states_are_the_schemas(conn: psycopg.Connection) -> None:
    assert sorted(re.findall(r"'(\w+)'::text", _check(conn, "task_state"))) == sorted(TASK_STATES)
    assert sorted(re.findall(r"'(\w+)'::text", _check(conn, "finished_has_time"))) == sorted(FINISHED_STATES)
