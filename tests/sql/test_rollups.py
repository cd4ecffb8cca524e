"""The rollups group (migrations/sources/13_rollups.sql): fleet.roll_up_lane_hours keeps fleet.lane_hours
in step with late writes and skips while another roll-up runs. (That the hourly views read the same
figures rolled up as live: tests/sql/test_dashboards.py.)
"""

from __future__ import annotations

import psycopg
from sqlkit import (
    build_throughput_history,
    one,
    record_run,
    roll_up,
)

# ------------------------------------------------------------------------------------------------
# roll_up_lane_hours


def test_roll_up_recomputes_late_writes_and_skips_when_busy(db_url: str, conn: psycopg.Connection) -> None:
    hours = build_throughput_history(conn)
    roll_up(conn)
    rolled = "select input_tokens from fleet.lane_hours where lane = 'a' and hour = %s"
    assert one(conn, rolled, (hours["h"],)) == 0
    # a late write into a rolled-up hour (a run's tokens recorded after the roll-up) ...
    token = one(conn, "select lease_token from fleet.runs where task_id = (select id from fleet.tasks where key = 't1')")
    record_run(conn, token, {"input_tokens": 1000, "cost_usd": 0.5})
    assert one(conn, rolled, (hours["h"],)) == 0
    # ... is counted once the next hour closes: the last two hours rolled up are computed again
    # (H is three hours back; the hour before the last one rolled up is two hours after it)
    conn.execute("update fleet.lane_hours_rollup set rolled_until = rolled_until - interval '1 hour'")
    assert roll_up(conn) > 0
    assert one(conn, rolled, (hours["h"],)) == 1000
    # a second roll-up while one runs returns -1 and writes nothing
    with psycopg.connect(db_url) as other:
        other.execute("select pg_advisory_xact_lock(7366104385829013)")
        conn.execute("update fleet.lane_hours_rollup set rolled_until = rolled_until - interval '1 hour'")
        assert roll_up(conn) == -1
        other.rollback()
    assert roll_up(conn) > 0
