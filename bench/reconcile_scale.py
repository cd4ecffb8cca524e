"""Does the monitor's cost follow active work, not history? Time fleet.reconcile() and fleet.claim()
on a database holding N finished tasks (default 1,000,000) and a little active work, and show the
plans of their inner queries.

    uv run python bench/reconcile_scale.py [--finished 1000000] [--url postgresql://...]

It creates (and drops) its own database on the server given by --url (default: the machine's
127.0.0.1:5432, or TEST_DATABASE_URL). Prints one line per figure; see bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from worker.db.migrate import migrate

INNER = {
    "expired leases": "select t.id from fleet.tasks t where t.state = 'running' and t.lease_expires_at < now()",
    "stale sessions": "select s.id from fleet.sessions s where s.state = 'active' and s.heartbeat_at < now() - interval '60 s'",
    "ready work of a lane": "select count(*), min(run_at) from fleet.tasks t where t.lane = 'bench' and t.state = 'queued' and t.run_at <= now()",
    "claim's ready scan": "select t.id from fleet.tasks t where t.lane = 'bench' and t.state = 'queued' and t.run_at <= now() order by t.priority desc, t.carry_over desc, t.run_at, t.id limit 5",
    "running in a lane": "select count(*) from fleet.tasks where lane = 'bench' and state = 'running'",
}


def plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    out = [plan]
    for child in plan.get("Plans", []):
        out += plan_nodes(child)
    return out


def timed(conn: psycopg.Connection[Any], sql: str, n: int) -> float:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        with conn.transaction(force_rollback=True):
            conn.execute(sql).fetchall()
        xs.append((time.perf_counter() - t0) * 1000)
    return statistics.median(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--finished", type=int, default=1_000_000)
    ap.add_argument("--url", default=os.environ.get("TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    args = ap.parse_args()
    name = f"lf_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.url, autocommit=True) as admin:
        admin.execute(f'create database "{name}"')
    url = make_conninfo(args.url, dbname=name)
    try:
        migrate(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("select fleet.sync_lane('bench', '{\"max_running\": 50, \"lease_seconds\": 60}')")
            t0 = time.perf_counter()
            conn.execute(
                "insert into fleet.tasks (lane, key, state, attempts, created_at, updated_at, finished_at)"
                " select 'bench', 'old:' || g, case when g %% 10 = 0 then 'dead' else 'done' end, 1,"
                " now() - interval '30 days', now() - interval '30 days', now() - interval '30 days'"
                " from generate_series(1, %s) g", (args.finished,))
            load = time.perf_counter() - t0
            for i in range(200):
                conn.execute("select fleet.enqueue('bench', %s)", (f"new:{i}",))
            session = conn.execute("select fleet.open_session('bench', 'bench-host', 1, null, 3600)").fetchone()[0]
            conn.execute("select count(*) from fleet.claim(%s, 40)", (session,))
            conn.execute("vacuum analyze fleet.tasks")
            conn.execute("vacuum analyze fleet.sessions")
            print(f"finished tasks: {args.finished:,} (loaded in {load:.1f} s); queued 160, running 40")
            worst_seq = []
            for label, sql in INNER.items():
                plan = conn.execute(f"explain (format json) {sql}").fetchone()[0][0]["Plan"]
                nodes = plan_nodes(plan)
                indexes = sorted({n["Index Name"] for n in nodes if "Index Name" in n})
                seq = [n["Relation Name"] for n in nodes if n["Node Type"] == "Seq Scan"]
                worst_seq += [r for r in seq if r == "tasks"]
                print(f"plan  {label:22s} indexes={','.join(indexes) or '-'} seq_scans={','.join(seq) or '-'}")
            print(f"median fleet.reconcile()   {timed(conn, 'select * from fleet.reconcile(300, 60)', 20):7.2f} ms")
            claim_sql = f"select * from fleet.claim('{session}', 1)"
            beat_sql = f"select * from fleet.heartbeat('{session}')"
            print(f"median fleet.claim(s, 1)   {timed(conn, claim_sql, 20):7.2f} ms")
            print(f"median fleet.heartbeat(s)  {timed(conn, beat_sql, 20):7.2f} ms")
            print(json.dumps({"seq_scans_on_tasks": len(worst_seq)}))
            return 1 if worst_seq else 0
    finally:
        with psycopg.connect(args.url, autocommit=True) as admin:
            admin.execute(f'drop database if exists "{name}" with (force)')


if __name__ == "__main__":
    sys.exit(main())
