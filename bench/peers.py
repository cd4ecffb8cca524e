"""The peers, each driven by its own documented public API, and the pgbench ceiling.

- pgbench: a one-row UPDATE (a random row of 10,000) per transaction, prepared statements, on a
  table of its own in a scratch database: the commit ceiling of the server.
- PgQueuer (1.x, asyncpg driver, uvloop as its CLI uses): schema by ``Queries.install()`` (what
  ``pgq install`` runs); jobs enqueued with ``Queries.enqueue`` (lists: one statement per batch);
  drained by ``PgQueuer.run(batch_size=…, mode=QueueExecutionMode.drain)`` with a no-op
  ``@pgq.entrypoint`` (``concurrency_limit`` as the scenario says).
- Procrastinate (3.x, its psycopg connector): schema by ``app.schema_manager.apply_schema_async()``
  (what ``procrastinate schema --apply`` runs); jobs deferred with ``Task.batch_defer_async`` (bulk)
  or ``Task.defer_async`` (single); drained by ``app.run_worker_async(concurrency=…, wait=False)``
  with a no-op task.

Every worker records the ids of the jobs its handler saw, so the harness can check that each job
ran exactly once.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

# -- pgbench ---------------------------------------------------------------------------------

PGBENCH_ROWS = 10_000
PGBENCH_SCRIPT = "\\set id random(1, {rows})\nupdate bench_row set n = n + 1 where id = :id;\n"


def pgbench_install(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("create table bench_row (id int primary key, n bigint not null default 0)")
        conn.execute("insert into bench_row (id) select generate_series(1, %s)", (PGBENCH_ROWS,))
        conn.execute("vacuum analyze bench_row")


def find_pgbench(binary: str = "pgbench") -> str | None:
    """The pgbench binary: as given, from PATH, or the newest of /usr/lib/postgresql/*/bin."""
    import glob
    import shutil

    found = shutil.which(binary)
    if found:
        return found
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pgbench"),
                      key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return versions[-1] if versions else None


def pgbench(url: str, clients: int, seconds: float, binary: str) -> float:
    """tps of the one-row UPDATE with ``clients`` clients for ``seconds``."""
    params = conninfo_to_dict(url)
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(PGBENCH_SCRIPT.format(rows=PGBENCH_ROWS))
        script = f.name
    cmd = [binary, "-n", "-M", "prepared", "-c", str(clients), "-j", str(min(clients, 2)),
           "-T", str(max(1, round(seconds))), "-f", script,
           "-h", str(params.get("host", "127.0.0.1")), "-p", str(params.get("port", 5432)),
           "-U", str(params.get("user", "postgres")), str(params["dbname"])]
    env = None
    if params.get("password"):
        import os

        env = {**os.environ, "PGPASSWORD": str(params["password"])}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    finally:
        Path(script).unlink(missing_ok=True)
    m = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out)
    if not m:
        raise RuntimeError(f"pgbench printed no tps:\n{out}")
    return float(m.group(1))


# -- PgQueuer --------------------------------------------------------------------------------

PGQ_ENTRYPOINT = "noop"


def _pgq_payload(i: int) -> bytes:
    return b'{"n": %d}' % i


def pgq_install(url: str) -> None:
    import asyncio

    import asyncpg  # type: ignore[import-untyped]
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    async def go() -> None:
        conn = await asyncpg.connect(url)
        try:
            await Queries(AsyncpgDriver(conn)).install()
        finally:
            await conn.close()

    asyncio.run(go())


def pgq_reset(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("truncate pgqueuer, pgqueuer_log, pgqueuer_statistics restart identity")


def pgq_enqueue(url: str, start: int, n: int, chunk: int) -> float:
    """``n`` jobs, ``chunk`` per call of Queries.enqueue (1: the scalar form, one job per call);
    seconds."""
    import asyncpg
    import uvloop
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    async def go() -> float:
        conn = await asyncpg.connect(url)
        try:
            q = Queries(AsyncpgDriver(conn))
            t0 = time.monotonic()
            if chunk == 1:
                for i in range(start, start + n):
                    await q.enqueue(PGQ_ENTRYPOINT, _pgq_payload(i))
            else:
                for lo in range(start, start + n, chunk):
                    hi = min(start + n, lo + chunk)
                    ids = await q.enqueue([PGQ_ENTRYPOINT] * (hi - lo), [_pgq_payload(i) for i in range(lo, hi)],
                                          [0] * (hi - lo))
                    if len(ids) != hi - lo:
                        raise AssertionError(f"enqueue returned {len(ids)} ids for {hi - lo} jobs")
            return time.monotonic() - t0
        finally:
            await conn.close()

    return uvloop.run(go())


def pgq_worker(url: str, batch: int, limit: int, *, barrier: Any) -> dict[str, Any]:
    """One PgQueuer (one asyncpg connection) draining the queue."""
    import asyncpg
    import uvloop
    from pgqueuer import PgQueuer
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.models import Job
    from pgqueuer.types import QueueExecutionMode

    seen: list[int] = []

    async def go() -> dict[str, Any]:
        conn = await asyncpg.connect(url)
        pgq = PgQueuer(AsyncpgDriver(conn))

        @pgq.entrypoint(PGQ_ENTRYPOINT, concurrency_limit=limit)
        async def noop(job: Job) -> None:
            seen.append(int(job.id))

        barrier.wait(timeout=300)
        cpu0, t0 = time.process_time(), time.monotonic()
        await pgq.run(batch_size=batch, mode=QueueExecutionMode.drain)
        t1, cpu = time.monotonic(), time.process_time() - cpu0
        await conn.close()
        return {"t0": t0, "t1": t1, "ids": seen, "cpu_client": cpu}

    return uvloop.run(go())


def pgq_verify(url: str, n: int, results: list[dict[str, Any]]) -> list[str]:
    problems = _seen_once(n, results)
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "select (select count(*) from pgqueuer),"
            " (select count(*) from pgqueuer_log where status = 'successful'),"
            " (select count(*) from pgqueuer_log where status not in ('queued', 'picked', 'successful'))"
        ).fetchone()
    assert row is not None
    left, ok, bad = row
    if left:
        problems.append(f"{left} jobs left in the queue table")
    if ok != n:
        problems.append(f"{ok} jobs logged successful, expected {n}")
    if bad:
        problems.append(f"{bad} jobs logged with another final status")
    return problems


# -- Procrastinate ---------------------------------------------------------------------------

PROC_TASK = "noop"


def _proc_app(url: str, pool_size: int | None = None) -> tuple[Any, Any, list[int]]:
    """The app, its no-op task, and the list the task appends its job ids to."""
    from procrastinate import App, JobContext, PsycopgConnector

    kwargs: dict[str, Any] = {"conninfo": url}
    if pool_size:
        kwargs.update(min_size=pool_size, max_size=pool_size)
    app = App(connector=PsycopgConnector(**kwargs))
    seen: list[int] = []

    @app.task(name=PROC_TASK, pass_context=True)
    async def noop(context: JobContext, n: int) -> None:
        assert context.job.id is not None
        seen.append(int(context.job.id))

    return app, noop, seen


def proc_install(url: str) -> None:
    import asyncio

    app, _, _ = _proc_app(url)

    async def go() -> None:
        async with app.open_async():
            await app.schema_manager.apply_schema_async()

    asyncio.run(go())


def proc_reset(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("truncate procrastinate_jobs, procrastinate_events, procrastinate_periodic_defers,"
                     " procrastinate_workers restart identity cascade")


def proc_enqueue(url: str, start: int, n: int, chunk: int) -> float:
    """``n`` jobs, ``chunk`` per batch_defer_async call (1: defer_async, one job per call); seconds."""
    import asyncio

    app, noop, _ = _proc_app(url)

    async def go() -> float:
        async with app.open_async():
            t0 = time.monotonic()
            if chunk == 1:
                for i in range(start, start + n):
                    await noop.defer_async(n=i)
            else:
                for lo in range(start, start + n, chunk):
                    hi = min(start + n, lo + chunk)
                    ids = await noop.batch_defer_async(*({"n": i} for i in range(lo, hi)))
                    if len(ids) != hi - lo:
                        raise AssertionError(f"batch_defer returned {len(ids)} ids for {hi - lo} jobs")
            return time.monotonic() - t0

    return asyncio.run(go())


def proc_worker(url: str, concurrency: int, pool_size: int | None, *, barrier: Any) -> dict[str, Any]:
    """One Procrastinate worker with ``concurrency`` sub-workers, until the queue is empty."""
    import asyncio

    app, _, seen = _proc_app(url, pool_size)

    async def go() -> dict[str, Any]:
        async with app.open_async():
            barrier.wait(timeout=300)
            cpu0, t0 = time.process_time(), time.monotonic()
            await app.run_worker_async(concurrency=concurrency, wait=False, install_signal_handlers=False)
            t1, cpu = time.monotonic(), time.process_time() - cpu0
        return {"t0": t0, "t1": t1, "ids": seen, "cpu_client": cpu}

    return asyncio.run(go())


def proc_verify(url: str, n: int, results: list[dict[str, Any]]) -> list[str]:
    problems = _seen_once(n, results)
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "select count(*) filter (where status = 'succeeded'), count(*) filter (where status <> 'succeeded'),"
            " count(*) filter (where attempts <> 1) from procrastinate_jobs"
        ).fetchone()
    assert row is not None
    ok, other, retried = row
    if ok != n or other:
        problems.append(f"{ok} jobs succeeded and {other} in another state, expected {n} succeeded")
    if retried:
        problems.append(f"{retried} jobs ran other than exactly once (attempts <> 1)")
    return problems


def _seen_once(n: int, results: list[dict[str, Any]]) -> list[str]:
    ids = [i for r in results for i in r["ids"]]
    problems = []
    if len(ids) != n:
        problems.append(f"handlers ran {len(ids)} times, expected {n}")
    if len(set(ids)) != len(ids):
        problems.append(f"{len(ids) - len(set(ids))} jobs ran twice")
    return problems
