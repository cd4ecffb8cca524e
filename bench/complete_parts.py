"""Where a durable completion's server time goes: fleet.complete against copies of itself with
one part taken out.

    uv run python -m bench.complete_parts [--calls 500] [--reps 5]
    uv run python -m bench.complete_parts --own-transactions

The copies are made from the live definition (pg_get_functiondef) by replacing the text of one
part, so they follow the function as it changes; a part whose text is no longer there stops the
run (exit status 1) rather than timing a copy that is not what its name says. Per repetition and
copy (in an order rotated by repetition): the tables emptied, ``--calls`` tasks enqueued and
claimed (claims of 100, committed, then vacuumed), then every running task completed with the
copy. By default one DO block makes the calls, timed with clock_timestamp(): the µs of one call
inside a transaction, without the round trip, the commit or the client. With
``--own-transactions`` the client makes each call as a prepared statement in a transaction of
its own (synchronous_commit off, no flush wait), timed at the client, and a SQL function that
does nothing is timed the same way: each figure less that one is the server's work of a call and
its commit. Printed: the median over the repetitions, and what each part costs (the whole less
its copy). The calls run as the connecting role (a superuser, by default: the lane check's
cheapest path). A copy with a part removed is wrong on purpose (no lane check, every task done);
it runs only in its scratch database. Times are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import textwrap
import time
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from bench.copies import DefinitionChanged, function_copies
from bench.copies import definition as function_definition
from bench.fleetload import LANE, LANE_SETTINGS
from bench.harness import log, scratch_db, stamp

LANE_CHECK = " and fleet._lane_allowed(x.lane)"
DONE_STATE = ("fleet._done_state(x.lane, x.id)", "'done'::text")
RUN_CLOSE = "perform fleet._end_run(p_token, 'done', null, v_state);"

# name -> the (text, replacement) pairs that make the copy; None: fleet.complete itself
COPIES: dict[str, list[tuple[str, str]] | None] = {
    "fleet.complete": None,
    "without the lane check": [(LANE_CHECK, "")],
    "done state a constant": [DONE_STATE],
    "neither of the two": [(LANE_CHECK, ""), DONE_STATE],
    "without the run's close": [(RUN_CLOSE, "")],
}
NOTHING = "a SQL function doing nothing"  # (--own-transactions: the call and commit alone)


SIGNATURE = "fleet.complete(bigint,uuid,jsonb)"


def definition(conn: psycopg.Connection[Any]) -> str:
    """fleet.complete's CREATE statement, as the database holds it."""
    return function_definition(conn, SIGNATURE)


def copies(conn: psycopg.Connection[Any]) -> dict[str, str]:
    """Create the copies in the database: name -> the function to call."""
    return function_copies(conn, SIGNATURE, COPIES, "fleet._bench_complete_")


def parts(med: dict[str, float]) -> list[tuple[str, float]]:
    """What each part costs, from the medians of the copies: the whole less the copy without it;
    the rest, what is left of the whole (less the function that does nothing, when timed) after
    the lane check and the done state together and the run's close."""
    whole = med["fleet.complete"]
    lane, done = whole - med["without the lane check"], whole - med["done state a constant"]
    both, close = whole - med["neither of the two"], whole - med["without the run's close"]
    return [("the lane check (fleet._lane_allowed)", lane), ("the done state (fleet._done_state)", done),
            ("the two together (the whole less neither)", both), ("the run's close (fleet._end_run)", close),
            ("the rest: the task's update, the call", whole - med.get(NOTHING, 0.0) - both - close)]


def ready(conn: psycopg.Connection[Any], session: str, calls: int, rep: int) -> None:
    """``calls`` tasks running, the tables holding nothing else."""
    conn.execute("truncate fleet.events, fleet.runs, fleet.lane_handoffs, fleet.tasks restart identity cascade")
    conn.execute("select count(*) from fleet.enqueue_many(%s, %s)",
                 (LANE, Jsonb([{"key": f"parts:{rep}:{i}"} for i in range(calls)])))
    for _ in range(0, calls, 100):
        conn.execute("select count(*) from fleet.claim(%s, 100)", (session,))
    conn.execute("vacuum fleet.tasks, fleet.runs")


def in_one_transaction(conn: psycopg.Connection[Any], notices: list[str], fn: str, calls: int) -> float:
    """µs per call of ``fn`` over the running tasks, timed on the server by a DO block (its
    figure: the last of the connection's ``notices``)."""
    conn.execute(f"""
        do $$
        declare t0 timestamptz; r record; n int := 0;
        begin
            t0 := clock_timestamp();
            for r in select id, lease_token from fleet.tasks where state = 'running' order by id loop
                perform {fn}(r.id, r.lease_token);
                n := n + 1;
            end loop;
            raise notice '% %', n, extract(epoch from clock_timestamp() - t0) * 1e6;
        end $$""")
    n, us = notices[-1].split()
    if int(n) != calls:
        raise SystemExit(f"{fn}: {n} tasks were running, expected {calls}")
    return float(us) / calls


def own_transactions(conn: psycopg.Connection[Any], fn: str, calls: int) -> float:
    """µs per call of ``fn`` over the running tasks, each call a transaction of its own, at the
    client."""
    rows = conn.execute("select id, lease_token from fleet.tasks where state = 'running' order by id").fetchall()
    if len(rows) != calls:
        raise SystemExit(f"{fn}: {len(rows)} tasks were running, expected {calls}")
    query = f"select {fn}(%s, %s)"
    t0 = time.perf_counter()
    for row in rows:
        conn.execute(query, row, prepare=True).fetchone()
    return (time.perf_counter() - t0) * 1e6 / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=500, help="completions per copy and repetition (default 500)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions, the median is printed (default 5)")
    ap.add_argument("--own-transactions", action="store_true",
                    help="each call a transaction of its own, timed at the client")
    ap.add_argument("--url", default=os.environ.get("TEST_DATABASE_URL",
                                                    "postgresql://postgres@127.0.0.1:5432/postgres"))
    args = ap.parse_args()
    if args.calls < 1 or args.reps < 1:
        ap.error("--calls and --reps must be at least 1")
    with scratch_db(args.url, "parts") as url, psycopg.connect(url, autocommit=True) as conn:
        role = conn.execute("select current_user, current_setting('is_superuser') = 'on'").fetchone() or ("?", None)
        how = "each call its own transaction, at the client" if args.own_transactions else "in one DO block"
        for line in (*textwrap.wrap(stamp(conn), 80), f"{args.calls} calls per copy, {args.reps} repetitions, {how};",
                     f"as {role[0]}{' (a superuser)' if role[1] else ''}"):
            log(line)
        conn.execute("set synchronous_commit = off")
        conn.execute("select fleet.sync_lane(%s, %s)", (LANE, Jsonb(LANE_SETTINGS)))
        row = conn.execute("select fleet.open_session(%s, 'bench-parts', 1, null, 3600)", (LANE,)).fetchone()
        assert row is not None
        session = str(row[0])
        notices: list[str] = []
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        try:
            fns = copies(conn)
        except DefinitionChanged as exc:
            log(f"cannot make the copies: {exc};")
            log("bring bench/complete_parts.py in step with fleet.complete")
            return 1
        if args.own_transactions:
            conn.execute("create function fleet._bench_nothing(bigint, uuid) returns text"
                         " language sql as $$ select 'done' $$")
            fns[NOTHING] = "fleet._bench_nothing"
        times: dict[str, list[float]] = {name: [] for name in fns}
        names = list(fns)
        for rep in range(args.reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                ready(conn, session, args.calls, rep)
                times[name].append(own_transactions(conn, fns[name], args.calls) if args.own_transactions
                                   else in_one_transaction(conn, notices, fns[name], args.calls))
                left = conn.execute("select count(*) from fleet.tasks where state = 'running'").fetchone()
                if name != NOTHING and (left is None or left[0] != 0):
                    raise SystemExit(f"{fns[name]}: {left and left[0]} tasks still running after the calls")
        med = {name: statistics.median(t) for name, t in times.items()}
        log("")
        log(f"{'µs per call':42s} {'median':>8s} {'min':>8s}")
        for name, t in times.items():
            log(f"{name:42s} {med[name]:8.1f} {min(t):8.1f}")
        whole = med["fleet.complete"] - med.get(NOTHING, 0.0)
        if args.own_transactions:
            log(f"{'fleet.complete less the one doing nothing':42s} {whole:8.1f}")
        log("")
        log(f"{'what a part costs (the whole less its copy)':44s} {'µs':>6s} {'share':>6s}")
        for label, us in parts(med):
            log(f"{label:44s} {us:6.1f} {us / whole:6.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
