"""lanefleet under load: the migrations in a scratch database, one lane, tasks enqueued, and
workers that drain the lane through the SQL API (the calls PostgresStore makes, sent directly
with psycopg as prepared statements, without the store's pool and pydantic models).

A worker: one connection, ``fleet.open_session``, then ``fleet.claim(session, batch)`` until it
comes back empty; each claimed task is completed with ``fleet.complete`` (durable: one call and one
commit per completion) or, in bulk mode, the whole claim with one ``fleet.complete_many``.
"""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

LANE = "bench"
# No slot limit (the peers have none either), leases long enough never to expire during a run.
LANE_SETTINGS: dict[str, Any] = {"max_running": None, "lease_seconds": 3600, "max_attempts": 3}


def install(url: str, migrations: Path | None = None) -> None:
    """The migrations (worker.db.migrate, what `fleet migrate` runs; those of ``migrations``, a
    directory, instead of the package's when given) and the bench lane."""
    from worker.db.migrate import load_migrations, migrate

    migrate(url, migrations=load_migrations(migrations) if migrations else None)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("select fleet.sync_lane(%s, %s)", (LANE, Jsonb(LANE_SETTINGS)))


def has_bulk(url: str) -> tuple[bool, bool]:
    """(fleet.enqueue_many exists, fleet.complete_many exists)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "select to_regprocedure('fleet.enqueue_many(text, jsonb)') is not null,"
            " to_regprocedure('fleet.complete_many(bigint[], uuid[], jsonb[])') is not null"
        ).fetchone()
    assert row is not None
    return bool(row[0]), bool(row[1])


def reset(url: str) -> None:
    """Empty the work tables (the lane stays)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("truncate fleet.events, fleet.runs, fleet.lane_handoffs, fleet.tasks, fleet.sessions"
                     " restart identity cascade")


def _payload(i: int) -> dict[str, Any]:
    return {"n": i}


def enqueue_single(url: str, start: int, n: int) -> float:
    """``n`` calls of fleet.enqueue, one transaction each, from one connection; seconds."""
    with psycopg.connect(url, autocommit=True) as conn:
        t0 = time.monotonic()
        for i in range(start, start + n):
            conn.execute("select fleet.enqueue(%s, %s, %s)", (LANE, f"bench:{i}", Jsonb(_payload(i))),
                         prepare=True)
        return time.monotonic() - t0


def enqueue_bulk(url: str, n: int, chunk: int) -> float:
    """``n`` tasks in calls of fleet.enqueue_many of ``chunk`` tasks each; seconds."""
    with psycopg.connect(url, autocommit=True) as conn:
        t0 = time.monotonic()
        for lo in range(0, n, chunk):
            tasks = [{"key": f"bench:{i}", "payload": _payload(i)} for i in range(lo, min(n, lo + chunk))]
            rows = conn.execute("select id, created from fleet.enqueue_many(%s, %s)",
                                (LANE, Jsonb(tasks)), prepare=True).fetchall()
            if len(rows) != len(tasks) or not all(created for _, created in rows):
                raise AssertionError(f"enqueue_many returned {len(rows)} rows for {len(tasks)} new tasks")
        return time.monotonic() - t0


def enqueue_fallback(url: str, n: int) -> None:
    """Without fleet.enqueue_many: fleet.enqueue for every task, pipelined in one transaction."""
    with psycopg.connect(url) as conn:
        with conn.cursor() as cur:
            cur.executemany("select fleet.enqueue(%s, %s, %s)",
                            [(LANE, f"bench:{i}", Jsonb(_payload(i))) for i in range(n)])
        conn.commit()


def worker(url: str, batch: int, mode: str, profile: bool, *, barrier: Any) -> dict[str, Any]:
    """Drain the lane (see the module doc). ``mode``: ``each`` (one fleet.complete per task, each
    its own transaction) or ``bulk`` (one fleet.complete_many per claim). Returns its
    timings and the task ids it completed."""
    with psycopg.connect(url, autocommit=True) as conn:
        if profile:
            conn.execute("set track_functions = 'pl'")
        row = conn.execute("select fleet.open_session(%s, %s, %s, null, %s)",
                           (LANE, socket.gethostname(), os.getpid(), 3600)).fetchone()
        assert row is not None
        session = row[0]
        claim = "select id, lease_token from fleet.claim(%s, %s)"
        complete = "select fleet.complete(%s, %s)"
        complete_many = "select task_id, status from fleet.complete_many(%s, %s)"
        barrier.wait(timeout=300)
        cpu0 = time.thread_time()  # this thread's: right for a process and for a thread worker
        t0 = time.monotonic()
        done: list[int] = []
        calls = 0
        while True:
            rows = conn.execute(claim, (session, batch), prepare=True).fetchall()
            calls += 1
            if not rows:
                break
            if mode == "bulk":
                ids = [r[0] for r in rows]
                res = conn.execute(complete_many, (ids, [r[1] for r in rows]), prepare=True).fetchall()
                calls += 1
                bad = [(t, s) for t, s in res if s != "done"]
                if bad or len(res) != len(ids):
                    raise AssertionError(f"complete_many: {len(res)} rows for {len(ids)} tasks, not done: {bad[:5]}")
                done.extend(ids)
            else:
                for task_id, token in rows:
                    status = conn.execute(complete, (task_id, token), prepare=True).fetchone()
                    calls += 1
                    if status is None or status[0] != "done":
                        raise AssertionError(f"complete({task_id}) returned {status}")
                    done.append(task_id)
        t1 = time.monotonic()
        cpu = time.thread_time() - cpu0
        conn.execute("select fleet.close_session(%s, 'drained', '{}'::jsonb)", (session,))
    return {"t0": t0, "t1": t1, "ids": done, "calls": calls, "cpu_client": cpu}


def verify(url: str, n: int, results: list[dict[str, Any]]) -> list[str]:
    """Every task done exactly once: the problems found (empty when all is well)."""
    problems = []
    ids = [i for r in results for i in r["ids"]]
    if len(ids) != n:
        problems.append(f"workers completed {len(ids)} tasks, expected {n}")
    if len(set(ids)) != len(ids):
        problems.append(f"{len(ids) - len(set(ids))} tasks completed twice by the workers")
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "select count(*), count(*) filter (where state = 'done'), count(*) filter (where attempts <> 1),"
            " (select count(*) from fleet.runs where outcome = 'done'),"
            " (select count(*) from fleet.runs),"
            " (select count(*) from fleet.journal where kind = 'completed')"
            " from fleet.tasks"
        ).fetchone()
    assert row is not None
    total, done, not_once, runs_done, runs, completed = row
    if total != n or done != n:
        problems.append(f"{done} of {total} tasks done, expected {n} of {n}")
    if not_once:
        problems.append(f"{not_once} tasks claimed other than exactly once (attempts <> 1)")
    if runs_done != n or runs != n:
        problems.append(f"{runs_done} done runs of {runs}, expected {n}")
    if completed != n:
        problems.append(f"{completed} completed journal entries, expected {n}")
    return problems


def function_profile(url: str, n: int) -> str:
    """Server time per function over the last run (the workers ran with track_functions = 'pl'),
    in µs per job: where the SQL API spends its time."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "select funcname, calls, total_time, self_time from pg_stat_user_functions"
            " where schemaname = 'fleet' order by self_time desc limit 8"
        ).fetchall()
    return "; ".join(f"{f} {calls:,} calls, self {1000 * s / n:.0f} µs/job (total {1000 * t / n:.0f})"
                     for f, calls, t, s in rows)


def explain_hot_calls(url: str) -> str:
    """The time and WAL of every statement inside one enqueue_many of 1,000, one claim of 10, one
    complete and one complete_many of 9 (auto_explain with nested statements and its log sent to
    this client; the instrumentation makes every figure slower than in the timed runs)."""
    reset(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("select fleet.enqueue(%s, 'explain:' || g, '{}'::jsonb) from generate_series(1, 20) g", (LANE,))
        conn.execute("vacuum analyze")
        row = conn.execute("select fleet.open_session(%s, 'explain', 1, null, 3600)", (LANE,)).fetchone()
        assert row is not None
        session = row[0]
        notices: list[str] = []
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        for s in ("load 'auto_explain'", "set auto_explain.log_min_duration = 0", "set auto_explain.log_analyze = on",
                  "set auto_explain.log_buffers = on", "set auto_explain.log_wal = on",
                  "set auto_explain.log_nested_statements = on", "set client_min_messages = log"):
            conn.execute(s)
        out: list[str] = []

        def call(label: str, q: str, params: tuple[Any, ...]) -> list[Any]:
            notices.clear()
            t0 = time.monotonic()
            rows = conn.execute(q, params).fetchall()
            ms = 1000 * (time.monotonic() - t0)
            out.append(f"{label}: {ms:.2f} ms round trip, {len(notices) - 1} statements inside")
            fk = [t for t in notices if "SELECT 1 FROM ONLY" in t]  # the foreign-key checks
            if fk:
                total = sum(float(m.group(1)) for t in fk if (m := re.search(r"duration: ([0-9.]+) ms", t)))
                out.append(f"    {total:7.3f} ms  {len(fk)} foreign-key checks (SELECT 1 FROM ONLY … FOR KEY SHARE)")
            out.extend("    " + _summarise_plan(t) for t in notices if "SELECT 1 FROM ONLY" not in t)
            return rows

        if has_bulk(url)[0]:
            tasks = [{"key": f"explain-bulk:{i}", "payload": _payload(i)} for i in range(1000)]
            call("enqueue_many(1,000 tasks)", "select count(*) from fleet.enqueue_many(%s, %s)", (LANE, Jsonb(tasks)))
        claimed = call("claim(session, 10)", "select id, lease_token from fleet.claim(%s, 10)", (session,))
        call("complete(task, token)", "select fleet.complete(%s, %s)", claimed[0])
        if has_bulk(url)[1] and len(claimed) > 1:
            call(f"complete_many({len(claimed) - 1} tasks)", "select * from fleet.complete_many(%s, %s)",
                 ([r[0] for r in claimed[1:]], [r[1] for r in claimed[1:]]))
    return "\n".join(out)


def _summarise_plan(text: str) -> str:
    """One line from an auto_explain message: duration, the statement's start, rows, WAL."""
    dur = re.search(r"duration: ([0-9.]+) ms", text)
    q = re.search(r"Query Text: (.*?)(?:\n(?=\S)|\Z)", text, re.S)
    query = " ".join((q.group(1) if q else "?").split())[:90]
    wal = re.search(r"WAL: ([^\n]+)", text)
    top = next((ln.strip() for ln in text.splitlines()[2:] if "actual time" in ln), "")
    rows = re.search(r"rows=(\d+) loops", top)
    return (f"{float(dur.group(1)) if dur else 0:7.3f} ms  rows={rows.group(1) if rows else '?'}"
            f"  {('WAL ' + wal.group(1).strip()) if wal else ''}  | {query}")
