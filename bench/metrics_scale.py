"""Does a Prometheus scrape stay under 50 ms at 1,000,000 tasks and 10,000,000 events (issue #22,
item 4)? Build the history of bench/views_scale.py, roll up a year of hours, then time the scrape.

    uv run python bench/metrics_scale.py [--tasks 1000000] [--events 10000000] [--days 365] [--runs 50]
    uv run python bench/metrics_scale.py --quick     # 20,000 tasks, 200,000 events, 30 days
    uv run python bench/metrics_scale.py --explain   # also the plan of the scrape, its costliest nodes

It creates (and drops, unless --keep) its own database on the server given by --url (default:
TEST_DATABASE_URL, else the machine's 127.0.0.1:5432). The history is views_scale.py's
(``build_live``, ``build_history``: 8 lanes, a year, 85 % done at once, failures, hand-offs,
repairs, routes, dead letters, cancellations, 200 live tasks of which 40 run), plus two capacity
pools of 20 slots with one throttled run in 200 tasks (a usage limit, in lanes l0..l3). Then the
steady state of a fleet that has run a year: the first roll-up (30 days, what the monitor's first
pass does) and the year's older hours rolled up as the monitor's hourly passes would have, so
fleet.lane_hours holds some 70,000 lane-hours; VACUUM ANALYZE.

Timed, --runs times each after one warm-up (median and p95, ms): ``select fleet.metrics()`` (the
scrape's one statement, with its jsonb decoded by psycopg), the server's own execution time of it
(EXPLAIN ANALYZE of the function's body), and ``monitor.metrics.metrics_payload`` over a
PostgresStore (the statement, the collector, the exposition: what `/metrics` serves). Beside them,
what summing the year of rolled-up hours at every scrape would cost (what fleet.lane_totals saves).
It exits 1 if the median of metrics_payload is 50 ms or more.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.harness import log, pct, stamp
from bench.views_scale import LANES, LIVE, build_history, build_live, plan_nodes
from worker.db.migrate import migrate

GOAL_MS = 50.0
# the roll-up kept as sums (fleet.lane_totals) against summing the hours at every scrape
SUM_OF_HOURS = """
    select h.lane, sum(h.enqueued), sum(h.routed_in), sum(h.started), sum(h.done), sum(h.routed),
           sum(h.failed), sum(h.handed_off), sum(h.lost), sum(h.cancelled), sum(h.input_tokens),
           sum(h.cache_creation_tokens), sum(h.cache_read_tokens), sum(h.output_tokens), sum(h.cost_usd)
      from fleet.lane_hours h group by h.lane"""


def add_pools(conn: psycopg.Connection[Any]) -> int:
    """Pools p0, p1 (20 slots each) and a throttled run for every 200th task of lanes l0..l3 (in
    the pool of its lane's parity), an hour before the task's first run; the number written."""
    for pool in ("p0", "p1"):
        conn.execute("select fleet.sync_pool(%s, 20)", (pool,))
        conn.execute("select fleet.sync_profile(%s, %s, '{}')", (f"prof-{pool}", pool))
    cur = conn.execute(f"""
        insert into fleet.runs (task_id, session_id, lane, attempt, lease_token, started_at, ended_at, outcome,
                                pool, reason, error_tail)
        select t.id, null, t.lane, 1, md5('throttled:' || t.id)::uuid, t.created_at, t.created_at + interval '2 minutes',
               'throttled', 'p' || (substr(t.lane, 2)::int % 2), 'usage-limit', 'usage limit reached'
          from fleet.tasks t
         where t.id % 200 = 0 and substr(t.lane, 2)::int < {LANES // 2} and t.state in ('done', 'dead', 'cancelled')""")
    return cur.rowcount


def roll_up_the_year(conn: psycopg.Connection[Any]) -> tuple[float, int, float]:
    """The first roll-up (30 days), then every older hour, as a year of hourly passes would have
    written them (fleet.lane_totals follows by its triggers): (ms of the first, lane-hours in all,
    ms of the rest)."""
    t0 = time.perf_counter()
    conn.execute("select fleet.roll_up_lane_hours()")
    first = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    conn.execute("insert into fleet.lane_hours select * from fleet.lane_hours_between('-infinity',"
                 " (select min(hour) from fleet.lane_hours))")
    rest = (time.perf_counter() - t0) * 1000
    row = conn.execute("select count(*) from fleet.lane_hours").fetchone()
    assert row is not None
    return first, int(row[0]), rest


def times(fn: Any, runs: int) -> list[float]:
    fn()  # warm
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def statement_of(conn: psycopg.Connection[Any]) -> str:
    """The statement fleet.metrics() runs: its body's ``return (...)`` (comments dropped)."""
    body = str(conn.execute("select prosrc from pg_proc where oid = 'fleet.metrics()'::regprocedure")
               .fetchone()[0])  # type: ignore[index]
    text = re.sub(r"--[^\n]*", "", body)
    start = text.index("return (") + len("return (")
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    raise AssertionError("the body of fleet.metrics() has no return (...)")


def server_times(conn: psycopg.Connection[Any], query: str, runs: int) -> tuple[list[float], list[float]]:
    """The server's planning and execution times of the scrape's statement (EXPLAIN ANALYZE, no
    per-node timing). fleet.metrics() plans it once per connection (PL/pgSQL keeps the plan)."""
    plan, run = [], []
    for _ in range(runs):
        (doc,) = conn.execute("explain (analyze, timing off, summary on, format json) " + query).fetchone()  # type: ignore[misc]
        plan.append(float(doc[0]["Planning Time"]))
        run.append(float(doc[0]["Execution Time"]))
    return plan, run


def costliest(conn: psycopg.Connection[Any], body: str, n: int = 12) -> list[str]:
    """The plan's nodes by their total time (inclusive), with the index or table each reads."""
    (doc,) = conn.execute("explain (analyze, buffers, format json) " + body).fetchone()  # type: ignore[misc]
    nodes = plan_nodes(doc[0]["Plan"])
    ranked = sorted(nodes, key=lambda x: -float(x["Actual Total Time"]) * float(x["Actual Loops"]))
    return [f"{float(x['Actual Total Time']) * float(x['Actual Loops']):8.2f} ms  {x['Node Type']}"
            f"{' on ' + x['Relation Name'] if 'Relation Name' in x else ''}"
            f"{' using ' + x['Index Name'] if 'Index Name' in x else ''}"
            f"  rows {int(x['Actual Rows'])} x {int(x['Actual Loops'])}" for x in ranked[:n]]


def line(label: str, xs: list[float]) -> str:
    return f"  {label:44s} {statistics.median(xs):7.2f} {pct(xs, 95):7.2f} {max(xs):7.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20,000 tasks, 200,000 events, 30 days")
    ap.add_argument("--tasks", type=int)
    ap.add_argument("--events", type=int)
    ap.add_argument("--days", type=int, help="the history spans this many days (default 365, --quick 30)")
    ap.add_argument("--runs", type=int, default=50, help="timed scrapes of each kind (default 50)")
    ap.add_argument("--explain", action="store_true", help="print the scrape's costliest plan nodes")
    ap.add_argument("--url", default=os.environ.get("TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    ap.add_argument("--keep", action="store_true", help="keep the database (its name is printed)")
    args = ap.parse_args()
    args.tasks = args.tasks or (20_000 if args.quick else 1_000_000)
    args.events = args.events or (200_000 if args.quick else 10_000_000)
    args.days = args.days or (30 if args.quick else 365)
    if args.tasks <= LIVE * 2:
        ap.error(f"--tasks must be more than {LIVE * 2}")

    from monitor.metrics import metrics_payload
    from worker.store.postgres import PostgresStore

    name = f"lf_bench_metrics_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.url, autocommit=True) as admin:
        admin.execute(f'create database "{name}"')
    url = make_conninfo(args.url, dbname=name)
    started = time.perf_counter()
    try:
        migrate(url)
        with psycopg.connect(url, autocommit=True) as conn:
            log(stamp(conn))
            t_end = build_live(conn, args.tasks)
            build_history(conn, args.tasks, args.events, args.days, t_end)
            log(f"throttled runs: {add_pools(conn):,}")
            first, hours, rest = roll_up_the_year(conn)
            conn.execute("vacuum analyze")
            row = conn.execute(
                "select (select count(*) from fleet.tasks), (select count(*) from fleet.events),"
                " (select count(*) from fleet.runs), (select count(*) from fleet.sessions),"
                " pg_size_pretty(pg_database_size(current_database()))").fetchone()
            assert row is not None
            log(f"data: {row[0]:,} tasks, {row[1]:,} events, {row[2]:,} runs, {row[3]:,} sessions, {row[4]} on disk;"
                f" loaded in {time.perf_counter() - started:.0f} s")
            log(f"lane-hours rolled up: {hours:,} (the first roll-up, 30 days: {first:.0f} ms; the older hours:"
                f" {rest / 1000:.1f} s)")
            body = statement_of(conn)
            planning, execution = server_times(conn, body, args.runs)
            samples = len(conn.execute("select fleet.metrics()").fetchone()[0])  # type: ignore[index]
            store = PostgresStore(url)
            try:
                results = {
                    "select fleet.metrics() (client round trip)":
                        times(lambda: conn.execute("select fleet.metrics()").fetchone(), args.runs),
                    "  its execution on the server": execution,
                    "  (its planning, once per connection)": planning,
                    "metrics_payload(store): the whole scrape": times(lambda: metrics_payload(store), args.runs),
                    "(summing the rolled-up hours instead)": times(lambda: conn.execute(SUM_OF_HOURS).fetchall(),
                                                                   args.runs),
                }
                payload, _ = metrics_payload(store)
            finally:
                store.close()
            log("")
            log(f"a scrape: {samples} samples, {len(payload):,} bytes of exposition; {args.runs} runs each, ms")
            log(f"  {'':44s} {'median':>7s} {'p95':>7s} {'max':>7s}")
            for label, xs in results.items():
                log(line(label, xs))
            whole = statistics.median(results["metrics_payload(store): the whole scrape"])
            log(f"goal: a scrape under {GOAL_MS:.0f} ms (median of metrics_payload): "
                f"{'met' if whole < GOAL_MS else 'NOT met'}")
            if args.explain or whole >= GOAL_MS:
                log("")
                log("the scrape's costliest plan nodes (inclusive time x loops):")
                for text in costliest(conn, body):
                    log("  " + text)
            log(json.dumps({"samples": samples, "lane_hours": hours,
                            "ms": {k.strip(): {"p50": round(statistics.median(v), 2), "p95": round(pct(v, 95), 2)}
                                   for k, v in results.items()},
                            "goal_met": whole < GOAL_MS, "seconds": round(time.perf_counter() - started)}))
            return 0 if whole < GOAL_MS else 1
    finally:
        if args.keep:
            log(f"kept database {name}")
        else:
            with psycopg.connect(args.url, autocommit=True) as admin:
                admin.execute(f'drop database if exists "{name}" with (force)')


if __name__ == "__main__":
    sys.exit(main())
