"""One schema against another: the time of a job's calls on two migrations directories,
interleaved block by block, so that a shared machine's slow minute falls on both.

    mkdir -p /tmp/old && git archive <rev> migrations | tar -x -C /tmp/old
    uv run python -m bench.schema_ab --a /tmp/old/migrations    # b: the package's own

A change of a table or of a function moves a job's server time by 5-20 %; a shared VM's speed
swings more than that within minutes, so two runs of bench.queues one after the other cannot tell
it (bench/README.md, "#24, continued: the checks as domains"). Here one client drives one scratch
database of each schema with ``synchronous_commit = off`` (no wait for the WAL flush: what is left
is the server's CPU and the round trips, the same on both sides), alternating blocks: per block
and schema, ``--jobs`` tasks enqueued with one fleet.enqueue_many (timed: bulk enqueue), drained in
the durable mode (claims of 10, one fleet.complete each) or in bulk mode (claims of 100, one
fleet.complete_many each), then the tables emptied. Printed per mode: the median µs per job of
each schema and the median of the blocks' paired ratios b / a with its interquartile range. Times
are printed, never asserted; every task must end done (exit status 1 otherwise).

``--clients N`` drains each block with N connections at once (a thread and a session each; the
enqueue stays one call): what contention costs, claimers meeting at the head of the ready index.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from bench.fleetload import LANE, LANE_SETTINGS
from bench.harness import log, scratch_db, stamp
from bench.wal import drain

MODES = {"enqueue_many": None, "durable (claim 10, complete)": (10, False),
         "bulk (claim 100, complete_many)": (100, True)}


def block(conns: list[psycopg.Connection[Any]], jobs: int, n: int) -> dict[str, float]:
    """One block on one schema: µs per job of each mode. Each connection drains the lane at the
    same time as the others, in a thread and with a session of its own."""
    conn = conns[0]
    out: dict[str, float] = {}
    for mode, how in MODES.items():
        conn.execute("truncate fleet.events, fleet.runs, fleet.lane_handoffs, fleet.tasks, fleet.sessions"
                     " restart identity cascade")
        tasks = Jsonb([{"key": f"ab:{n}:{i}", "payload": {"i": i}} for i in range(jobs)])
        t0 = time.perf_counter()
        conn.execute("select count(*) from fleet.enqueue_many(%s, %s)", (LANE, tasks))
        if how is not None:
            sessions = []
            for i, c in enumerate(conns):
                row = c.execute("select fleet.open_session(%s, 'bench-ab', %s, null, 3600)", (LANE, i + 1)).fetchone()
                assert row is not None
                sessions.append(row[0])
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(conns)) as pool:  # (map's results raise what a drain raised)
                list(pool.map(lambda c, s, how=how: drain(c, s, *how), conns, sessions))
            done = conn.execute("select count(*) from fleet.tasks where state = 'done'").fetchone()
            if done is None or done[0] != jobs:
                raise SystemExit(f"{mode}: {done and done[0]} of {jobs} tasks done")
        out[mode] = (time.perf_counter() - t0) * 1e6 / jobs
    return out


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """Within the blocks' range ('inclusive'): the default method extrapolates past it for a few
    blocks, down to a negative quartile of a ratio of times."""
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="migrations directory of schema a")
    ap.add_argument("--b", type=Path, help="migrations directory of schema b (default: the package's)")
    ap.add_argument("--blocks", type=int, default=20, help="blocks per schema (default 20)")
    ap.add_argument("--jobs", type=int, default=1000, help="jobs per block and mode (default 1000)")
    ap.add_argument("--clients", type=int, default=1,
                    help="connections draining each block together, a thread and a session each (default 1)")
    ap.add_argument("--url", default=os.environ.get("TEST_DATABASE_URL",
                                                    "postgresql://postgres@127.0.0.1:5432/postgres"))
    args = ap.parse_args()
    if args.clients < 1:
        ap.error("--clients must be at least 1")
    for d in (args.a, args.b):
        if d is not None and not any(d.glob("*_fleet_*.sql")):
            ap.error(f"{d}: no lanefleet migrations there (files *_fleet_*.sql)")
    with scratch_db(args.url, "ab_a", migrations=args.a) as url_a, \
            scratch_db(args.url, "ab_b", migrations=args.b) as url_b, contextlib.ExitStack() as stack:
        a = [stack.enter_context(psycopg.connect(url_a, autocommit=True)) for _ in range(args.clients)]
        b = [stack.enter_context(psycopg.connect(url_b, autocommit=True)) for _ in range(args.clients)]
        for line in (*textwrap.wrap(stamp(a[0]), 80), f"a: {args.a}", f"b: {args.b or 'the package migrations'}",
                     f"{args.blocks} blocks of {args.jobs} jobs; {args.clients} client{'s' if args.clients > 1 else ''}"):
            log(line)
        for conn in (*a, *b):
            conn.execute("set synchronous_commit = off")
        for conn in (a[0], b[0]):
            conn.execute("select fleet.sync_lane(%s, %s)", (LANE, Jsonb(LANE_SETTINGS)))
        times: dict[str, dict[str, list[float]]] = {m: {"a": [], "b": []} for m in MODES}
        block(a, args.jobs, -1)  # warm both: plans, caches, the tables' first pages
        block(b, args.jobs, -1)
        for n in range(args.blocks):
            order = (("a", a), ("b", b)) if n % 2 == 0 else (("b", b), ("a", a))
            for side, conns in order:
                for mode, us in block(conns, args.jobs, n).items():
                    times[mode][side].append(us)
        log("")
        log(f"{'µs per job':32s} {'a':>8s} {'b':>8s}   b / a: q1, median, q3")
        for mode, t in times.items():
            q1, med, q3 = quartiles([y / x for x, y in zip(t["a"], t["b"], strict=True)])
            log(f"{mode:32s} {statistics.median(t['a']):8.1f} {statistics.median(t['b']):8.1f}"
                f"   {q1:.3f}  {med:.3f}  {q3:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
