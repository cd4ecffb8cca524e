"""Task states: Python's one list against the schema's CHECK, and the counts that cover them all."""

from __future__ import annotations

import re

import psycopg

from worker.models import FINISHED_STATES, TASK_STATES


def _check(conn: psycopg.Connection, name: str) -> str:
    row = conn.execute(
        "select pg_get_constraintdef(oid) from pg_constraint where conrelid = 'fleet.tasks'::regclass and conname = %s",
        (name,),
    ).fetchone()
    assert row is not None, name
    return str(row[0])


def test_the_python_states_are_the_schemas(conn: psycopg.Connection) -> None:
    assert sorted(re.findall(r"'(\w+)'::text", _check(conn, "task_state"))) == sorted(TASK_STATES)
    assert sorted(re.findall(r"'(\w+)'::text", _check(conn, "finished_has_time"))) == sorted(FINISHED_STATES)


def test_lane_summary_counts_every_state(conn: psycopg.Connection) -> None:
    conn.execute("select fleet.sync_lane('s', '{}'::jsonb)")
    for i, state in enumerate(TASK_STATES):
        conn.execute("select fleet.enqueue('s', %s)", (f"k{i}",))
    # put one task in each state (as the functions would leave it; the CHECKs hold)
    for i, state in enumerate(TASK_STATES):
        conn.execute(
            """update fleet.tasks set state = %(s)s,
                      block_reason = case when %(s)s = 'blocked' then 'test' end,
                      finished_at = case when %(s)s in ('done', 'dead', 'cancelled') then now() end,
                      lease_token = case when %(s)s = 'running' then gen_random_uuid() end,
                      lease_expires_at = case when %(s)s = 'running' then now() + interval '1 minute' end,
                      session_id = case when %(s)s = 'running'
                                        then fleet.open_session('s', 'h', 1, now(), 60) end
                where key = %(k)s""",
            {"s": state, "k": f"k{i}"},
        )
    cur = conn.execute("select * from fleet.lane_summary() where lane = 's'")
    assert cur.description is not None
    row = dict(zip([d.name for d in cur.description], cur.fetchone() or (), strict=True))
    assert {s: row[s] for s in TASK_STATES} == dict.fromkeys(TASK_STATES, 1)
