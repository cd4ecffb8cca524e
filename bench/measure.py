"""Scratch databases and what is measured around one timed run, the same way for every system.

A run's figure is ``jobs / (last worker's end - first worker's start)``, both taken with
``time.monotonic()`` (CLOCK_MONOTONIC is one clock for every process of the machine) inside the
worker processes, after a barrier that starts them together. Around the run, :class:`Probe` reads
the server's WAL position and the scratch database's commit counter, the machine's busy CPU time
(/proc/stat) and the client processes' CPU time, and, when asked, samples the wait events of the
scratch database's backends in pg_stat_activity.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

PREFIX = "lf_bench_"


def db_url(server_url: str, dbname: str) -> str:
    """A postgresql:// URL for database ``dbname`` on the server of ``server_url`` (a URL or a
    key=value conninfo): asyncpg takes only URLs."""
    from urllib.parse import quote, urlencode

    params = {k: str(v) for k, v in conninfo_to_dict(server_url).items()}
    params["dbname"] = dbname
    user, password = params.pop("user", ""), params.pop("password", "")
    host, port = params.pop("host", "127.0.0.1"), params.pop("port", "5432")
    auth = quote(user, safe="") + (":" + quote(password, safe="") if password else "")
    query = urlencode({k: v for k, v in params.items() if k != "dbname"})
    return (f"postgresql://{auth + '@' if auth else ''}{host}:{port}/{quote(dbname, safe='')}"
            + (f"?{query}" if query else ""))


def admin_connect(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(url, autocommit=True)


@contextlib.contextmanager
def scratch_database(admin_url: str, label: str) -> Iterator[tuple[str, str]]:
    """A fresh database ``lf_bench_<label>_<hex>`` on the admin URL's server; (name, url).
    Dropped WITH (FORCE) on the way out, whatever happened."""
    name = f"{PREFIX}{label}_{uuid.uuid4().hex[:8]}"
    with admin_connect(admin_url) as admin:
        admin.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    try:
        yield name, db_url(admin_url, name)
    finally:
        with admin_connect(admin_url) as admin:
            admin.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


def settle(url: str, checkpoint: bool = True) -> None:
    """Before every timed run: statistics for the planner and a checkpoint, so that each run starts
    from the same state (no dirty pages of the previous one, the same full-page-write cost).

    Only the tables that hold rows are vacuumed and analyzed (the queue just loaded). A table the
    reset emptied keeps what TRUNCATE leaves, the statistics of a table never analyzed, as in a
    newly installed queue: VACUUM of an empty table records it as known to be empty (0 pages,
    0 rows), and a statement planned then reads it sequentially however large it grows during the
    run (no autoanalyze comes in a run of seconds). That was lanefleet's completion until
    2026-12-02: its run found by lease token in a `runs` table analyzed empty, a sequential scan of
    every run so far per completion (2.1 ms of server CPU per job at 20,000 jobs, against 0.5)."""
    with psycopg.connect(url, autocommit=True) as conn:
        tables = conn.execute(
            "select format('%I.%I', n.nspname, c.relname) from pg_catalog.pg_class c"
            " join pg_catalog.pg_namespace n on n.oid = c.relnamespace"
            " where c.relkind = 'r' and n.nspname not in ('pg_catalog', 'information_schema')"
            " and n.nspname not like 'pg_toast%' order by 1"
        ).fetchall()
        for (table,) in tables:
            if conn.execute(f"select exists (select from {table})").fetchone() == (True,):
                conn.execute(f"vacuum analyze {table}")
        if checkpoint:
            conn.execute("checkpoint")


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)  # idle + iowait
    total = sum(parts[:8])  # guest time is already counted in user
    return total - idle, total


def backend_cpu(pid: int) -> float | None:
    """utime + stime of a process of this machine (a server backend), in seconds; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class Probe:
    """Counters of one run. Use as a context manager around the run (workers started and joined
    inside it). A sampler thread reads pg_stat_activity every ``interval`` seconds: the wait event
    of each active backend of the scratch database (``CPU`` when it waits for nothing), and the CPU
    time of every backend of that database (first and last reading per backend: the server's CPU
    spent for the run, short by at most one interval per backend)."""

    admin_url: str
    dbname: str
    interval: float = 0.025
    wal_bytes: int = 0
    commits: int = 0
    cpu_busy_s: float = 0.0
    cpu_server_s: float = 0.0
    wall_s: float = 0.0
    waits: collections.Counter[str] = field(default_factory=collections.Counter)
    samples: int = 0
    _cpu: dict[int, tuple[float, float]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _read(self, conn: psycopg.Connection[Any]) -> tuple[str, int]:
        conn.execute("select pg_stat_clear_snapshot()")
        row = conn.execute(
            "select pg_current_wal_lsn()::text,"
            " (select xact_commit from pg_stat_database where datname = %s)", (self.dbname,)
        ).fetchone()
        assert row is not None
        return str(row[0]), int(row[1] or 0)

    def _sample(self, conn: psycopg.Connection[Any]) -> None:
        rows = conn.execute(
            "select pid, state = 'active', coalesce(wait_event_type || ':' || wait_event, 'CPU')"
            " from pg_stat_activity where datname = %s and pid <> pg_backend_pid()",
            (self.dbname,),
        ).fetchall()
        self.samples += 1
        for pid, active, wait in rows:
            if active:
                self.waits[str(wait)] += 1
            cpu = backend_cpu(pid)
            if cpu is not None:
                first = self._cpu.get(pid, (cpu, cpu))[0]
                self._cpu[pid] = (first, cpu)

    def _sampler(self) -> None:
        with admin_connect(self.admin_url) as conn:
            while not self._stop.wait(self.interval):
                self._sample(conn)

    def wait_for_idle(self, timeout: float = 10.0) -> None:
        """Until no client is connected to the scratch database (a backend reports its counters
        as it exits)."""
        deadline = time.monotonic() + timeout
        with admin_connect(self.admin_url) as conn:
            while time.monotonic() < deadline:
                row = conn.execute(
                    "select count(*) from pg_stat_activity where datname = %s and pid <> pg_backend_pid()"
                    " and backend_type = 'client backend'",
                    (self.dbname,),
                ).fetchone()
                if row is None or row[0] == 0:
                    return
                time.sleep(0.02)

    def __enter__(self) -> Probe:
        with admin_connect(self.admin_url) as conn:
            self._lsn0, self._commits0 = self._read(conn)
        self._busy0 = _busy_jiffies()[0]
        self._wall0 = time.monotonic()
        self._thread = threading.Thread(target=self._sampler, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.wall_s = time.monotonic() - self._wall0
        self.cpu_busy_s = (_busy_jiffies()[0] - self._busy0) / os.sysconf("SC_CLK_TCK")
        self.cpu_server_s = sum(last - first for first, last in self._cpu.values())
        if exc[0] is not None:
            return
        self.wait_for_idle()
        with admin_connect(self.admin_url) as conn:
            lsn1, commits1 = self._read(conn)
            row = conn.execute("select pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)", (lsn1, self._lsn0)).fetchone()
            assert row is not None
            self.wal_bytes = int(row[0])
            self.commits = commits1 - self._commits0

    def top_waits(self, n: int = 4) -> str:
        total = sum(self.waits.values())
        if not total:
            return "-"
        return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in self.waits.most_common(n))


class WorkerFailed(RuntimeError):
    """A worker process raised, died, or did not finish in time."""


def _child(target: Any, args: tuple[Any, ...], barrier: Any, out: Any) -> None:
    import traceback

    try:
        out.put(target(*args, barrier=barrier))
    except BaseException:
        out.put({"error": traceback.format_exc()})
        barrier.abort()


_CONTEXT: Any = None


def _mp_context() -> Any:
    """The multiprocessing context of the workers: a fork server, started on first use, with the
    modules every worker needs already imported."""
    import multiprocessing

    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["psycopg", "bench.measure", "bench.fleetload", "bench.peers", "asyncpg",
                                         "uvloop", "pgqueuer", "procrastinate"])
    return _CONTEXT


def run_workers(target: Any, args: list[tuple[Any, ...]], *, timeout: float = 900.0,
                threads: bool = False) -> list[dict[str, Any]]:
    """Run ``target(*a, barrier=b)`` once per ``a`` in its own process (forked from a fork server
    that imported the bench modules once: no state shared with this process, no per-worker
    interpreter start) or, with ``threads``, in threads of this process.
    Each worker connects and prepares, calls ``barrier.wait()`` and then times its own work; it
    returns a dict with at least ``t0`` and ``t1`` (time.monotonic()). Returns the dicts; raises
    WorkerFailed if any worker failed."""
    import queue as queue_mod

    n = len(args)
    if threads:
        tbarrier = threading.Barrier(n)
        tout: queue_mod.Queue[dict[str, Any]] = queue_mod.Queue()
        workers: list[Any] = [threading.Thread(target=_child, args=(target, a, tbarrier, tout), daemon=True)
                              for a in args]
        out: Any = tout
    else:
        ctx = _mp_context()
        barrier = ctx.Barrier(n)
        out = ctx.Queue()
        workers = [ctx.Process(target=_child, args=(target, a, barrier, out), daemon=True) for a in args]
    for w in workers:
        w.start()
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < n:
            try:
                results.append(out.get(timeout=0.5))
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"{n - len(results)} of {n} workers did not finish in {timeout:.0f} s") from None
                if not threads and any(w.exitcode not in (None, 0) for w in workers):
                    time.sleep(0.5)  # its error report may still be in the pipe
                    while True:
                        try:
                            results.append(out.get_nowait())
                        except queue_mod.Empty:
                            break
                    if len(results) < n:
                        codes = [w.exitcode for w in workers]
                        raise WorkerFailed(f"a worker process died (exit codes {codes})") from None
    finally:
        for w in workers:
            w.join(timeout=30)
            if not threads and w.is_alive():
                w.terminate()
                w.join()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise WorkerFailed(errors[0])
    return results


def span(results: list[dict[str, Any]]) -> float:
    """Seconds from the first worker's start to the last worker's end."""
    return float(max(r["t1"] for r in results) - min(r["t0"] for r in results))
