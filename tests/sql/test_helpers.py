"""The private helpers (migrations/sources/01_helpers.sql) that every group uses: fleet._release (the
repair shared by close_session and the monitor), and the hot helpers' language — with the security
settings of the two functions that call them on every claim and lane sync.
"""

from __future__ import annotations

import psycopg
from sqlkit import (
    add_lane,
    claim_one,
    enqueue,
    fill,
    last_event,
    leases,
    one,
    open_session,
    release,
    runs,
    task,
    world,
)

# ------------------------------------------------------------------------------------------------
# _release


def test_release_requeues_then_kills_at_the_cap(conn, session):
    conn.execute("update fleet.lanes set max_attempts = 2")
    task_id = enqueue(conn, "a", "k")
    claim_one(conn, session)
    assert release(conn, task_id, "lease-expired") == "queued"
    t = task(conn, task_id)
    assert t["evaporations"] == 1 and t["state"] == "queued" and t["lease_token"] is None
    ev = last_event(conn, task_id)
    assert ev["kind"] == "repaired"
    assert ev["detail"]["reason"] == "lease-expired" and ev["detail"]["state"] == "queued"
    claim_one(conn, session)
    assert release(conn, task_id, "session-lost") == "dead"
    t = task(conn, task_id)
    assert t["state"] == "dead" and t["dead_reason"] == "attempt-cap" and t["evaporations"] == 2
    assert [r["outcome"] for r in runs(conn, task_id)] == ["lost", "lost"]


def test_release_of_a_task_not_running_does_nothing(conn, lane):
    task_id = enqueue(conn, lane, "k")
    before = world(conn)
    assert release(conn, task_id) is None
    assert release(conn, 999) is None
    assert world(conn) == before


# ------------------------------------------------------------------------------------------------
# the hot helpers are PL/pgSQL


HOT_HELPERS = ["_event(text,text,bigint,uuid,jsonb)", "_end_run(uuid,text,text,text,text)", "_lane_allowed(text)",
               "_done_state(text,bigint)", "_allowed_lanes()", "_require_lane(text)"]


def test_the_hot_helpers_are_plpgsql_and_claim_and_sync_lane_stay_definer(conn: psycopg.Connection) -> None:
    langs = dict(conn.execute(
        "select p.oid::regprocedure::text, l.lanname from pg_proc p join pg_language l on l.oid = p.prolang"
        " where p.oid = any (%s::regprocedure[])", ([f"fleet.{h}" for h in HOT_HELPERS],)).fetchall())
    assert langs == {f"fleet.{h}": "plpgsql" for h in HOT_HELPERS}
    for fn in ("fleet.claim(uuid, int)", "fleet.sync_lane(text, jsonb)"):
        secdef, config = conn.execute(
            "select prosecdef, proconfig from pg_proc where oid = %s::regprocedure", (fn,)).fetchone() or (None, None)
        assert secdef is True and config == ["search_path=pg_catalog, fleet, pg_temp"], fn
    assert one(conn, "select has_function_privilege('fleet_worker', 'fleet.claim(uuid, int)', 'execute')")
    assert not one(conn, "select has_function_privilege('fleet_worker', 'fleet.sync_lane(text, jsonb)', 'execute')")
    assert not one(conn, "select has_function_privilege('anon', 'fleet.claim(uuid, int)', 'execute')")
    # the same behaviour: a completion closes its run, writes its event, and a review lane reviews
    add_lane(conn, "rv", config={"review": True})
    fill(conn, "rv", 1)
    [(task, token)] = leases(conn, open_session(conn, "rv"))
    assert one(conn, "select fleet.complete(%s, %s)", (task, token)) == "review"
    assert conn.execute("select outcome, ended_at is not null from fleet.runs where task_id = %s",
                        (task,)).fetchall() == [("done", True)]
    assert one(conn, "select detail from fleet.journal where task_id = %s and kind = 'completed'",
               (task,)) == {"attempt": 1, "state": "review"}
