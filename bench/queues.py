"""lanefleet against PgQueuer and Procrastinate: one server, one run, one table with ratios (#7).

    uv run --group bench python -m bench.queues             # full: 20,000 jobs, median of 3
    uv run --group bench python -m bench.queues --quick     # CI: 1,500 jobs, once, fewer rows

Each system gets its own scratch database ``lf_bench_<system>_<hex>`` on the server of --url
(default: TEST_DATABASE_URL or the machine's 127.0.0.1:5432), its schema from its own installer,
dropped at the end. Per scenario: empty the tables, bulk-enqueue the jobs (timed: the bulk enqueue
figure), VACUUM ANALYZE of the tables holding rows and CHECKPOINT (measure.settle), then start
the workers (each its own process) together
and time from the first start to the last end. The repetitions are interleaved (every scenario
once, then again) so that a slow minute of a shared machine does not fall on one system.

Correctness is asserted, never speed: every job ran exactly once (the handlers' job ids; in
lanefleet every task done with attempts = 1, one done run and one completed journal entry each). Any
failure is printed and the exit status is 1. Goals are printed met / not met and never fail.
See bench/README.md, "Against PgQueuer and Procrastinate".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench import fleetload, measure, peers

DEFAULT_URL = os.environ.get("TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Scenario:
    key: str
    label: str
    system: str  # pgbench | pgqueuer | procrastinate | lanefleet
    kind: str  # ceiling | drain | single
    params: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass
class Outcome:
    rates: list[float] = field(default_factory=list)
    reps: list[int] = field(default_factory=list)  # the repetition of each rate
    details: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    note: str = ""

    def add(self, rate: float, rep: int) -> None:
        self.rates.append(rate)
        self.reps.append(rep)

    @property
    def median(self) -> float | None:
        return statistics.median(self.rates) if self.rates else None

    def by_rep(self) -> dict[int, float]:
        """The median rate of each repetition."""
        groups: dict[int, list[float]] = {}
        for rate, rep in zip(self.rates, self.reps, strict=True):
            groups.setdefault(rep, []).append(rate)
        return {rep: statistics.median(xs) for rep, xs in groups.items()}


def paired_ratio(mine: Outcome, ref: Outcome) -> list[float]:
    """mine / ref within each repetition both ran in (measured one after the other, see
    RUN_ORDER, not a quarter of an hour apart): the ratios, in repetition order."""
    a, b = mine.by_rep(), ref.by_rep()
    return [a[r] / b[r] for r in sorted(set(a) & set(b)) if b[r]]


def plan(quick: bool, bulk: bool) -> list[Scenario]:
    """The scenarios, in the order of the table (a repetition runs them in RUN_ORDER)."""
    s: list[Scenario] = [Scenario("pgbench", "pgbench one-row UPDATE, 4 clients (tps)", "pgbench", "ceiling")]
    for c in (1, 4, 16):
        if quick and c == 4:
            continue
        s.append(Scenario(f"proc.c{c}", f"Procrastinate, concurrency {c}", "procrastinate", "drain",
                          {"concurrency": c, "small": True}))
    s += [
        Scenario("pgq.limit16", "PgQueuer, concurrency_limit = batch = 16", "pgqueuer", "drain",
                 {"batch": 16, "limit": 16}),
        Scenario("pgq.default", "PgQueuer, unlimited, batch 10 (its defaults)", "pgqueuer", "drain",
                 {"batch": 10, "limit": 0}),
        Scenario("pgq.batch100", "PgQueuer, unlimited, batch 100", "pgqueuer", "drain",
                 {"batch": 100, "limit": 0}),
    ]
    for c in (1, 4, 16):
        for b in (1, 10, 100):
            if quick and (c, b) not in ((1, 10), (16, 10)):
                continue
            s.append(Scenario(f"lf.c{c}.b{b}", f"lanefleet durable, concurrency {c}, claim batch {b}", "lanefleet",
                              "drain", {"concurrency": c, "batch": b, "mode": "each", "small": c == 1}))
    for c in (1, 4, 16):
        if quick and c == 4:
            continue
        s.append(Scenario(f"lf.bulk.c{c}", f"lanefleet bulk mode (claim 100, complete_many), concurrency {c}",
                          "lanefleet", "drain", {"concurrency": c, "batch": 100, "mode": "bulk", "needs_bulk": True}))
    for system, label in (("lanefleet", "lanefleet fleet.enqueue"), ("pgqueuer", "PgQueuer Queries.enqueue(one job)"),
                          ("procrastinate", "Procrastinate defer_async")):
        s.append(Scenario(f"enqueue1.{system}", f"enqueue, one job per call: {label}", system, "single"))
    if not bulk:
        s = [x for x in s if not x.params.get("needs_bulk")]
    return s


# The order a repetition runs them in: each lanefleet figure next to the ones it is compared with,
# so that a ratio compares two runs a minute apart (the table shows them grouped by system).
RUN_ORDER = [
    "pgbench", "pgq.default", "lf.c16.b10", "proc.c16", "lf.bulk.c16", "pgq.batch100",
    "proc.c4", "lf.c4.b10", "lf.bulk.c4", "proc.c1", "lf.c1.b10", "lf.bulk.c1",
    "pgq.limit16", "lf.c16.b1", "lf.c16.b100", "lf.c4.b1", "lf.c4.b100", "lf.c1.b1", "lf.c1.b100",
    "enqueue1.lanefleet", "enqueue1.pgqueuer", "enqueue1.procrastinate",
]


def run_order(scenarios: list[Scenario]) -> list[Scenario]:
    return sorted(scenarios, key=lambda sc: RUN_ORDER.index(sc.key) if sc.key in RUN_ORDER else len(RUN_ORDER))


BULK_LABELS = {
    "lanefleet": "bulk enqueue: lanefleet fleet.enqueue_many",
    "pgqueuer": "bulk enqueue: PgQueuer Queries.enqueue(lists)",
    "procrastinate": "bulk enqueue: Procrastinate batch_defer_async",
}


@dataclass
class Bench:
    args: argparse.Namespace
    urls: dict[str, tuple[str, str]] = field(default_factory=dict)  # system -> (dbname, url)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    lf_bulk: tuple[bool, bool] = (False, False)
    profile_out: list[str] = field(default_factory=list)
    rep: int = 0

    def outcome(self, key: str) -> Outcome:
        return self.outcomes.setdefault(key, Outcome())

    # -- per system

    def reset(self, system: str, url: str) -> None:
        {"lanefleet": fleetload.reset, "pgqueuer": peers.pgq_reset, "procrastinate": peers.proc_reset}[system](url)

    def load(self, system: str, url: str, n: int) -> float | None:
        """Bulk-enqueue n jobs; seconds (None: lanefleet without enqueue_many, loaded otherwise)."""
        chunk = self.args.chunk
        if system == "lanefleet":
            if not self.lf_bulk[0]:
                fleetload.enqueue_fallback(url, n)
                return None
            return fleetload.enqueue_bulk(url, n, chunk)
        if system == "pgqueuer":
            return peers.pgq_enqueue(url, 0, n, chunk)
        return peers.proc_enqueue(url, 0, n, chunk)

    def workers(self, sc: Scenario, url: str) -> tuple[Callable[..., dict[str, Any]], list[tuple[Any, ...]]]:
        p = sc.params
        if sc.system == "lanefleet":
            return fleetload.worker, [(url, p["batch"], p["mode"], self.args.profile)] * p["concurrency"]
        if sc.system == "pgqueuer":
            return peers.pgq_worker, [(url, p["batch"], p["limit"])] * self.args.pgq_procs
        return peers.proc_worker, [(url, p["concurrency"], None)]

    def verify(self, system: str, url: str, n: int, results: list[dict[str, Any]]) -> list[str]:
        fn = {"lanefleet": fleetload.verify, "pgqueuer": peers.pgq_verify, "procrastinate": peers.proc_verify}[system]
        return fn(url, n, results)

    def count_jobs(self, system: str, url: str) -> int:
        table = {"lanefleet": "fleet.tasks", "pgqueuer": "pgqueuer", "procrastinate": "procrastinate_jobs"}[system]
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(f"select count(*) from {table}").fetchone()
        return int(row[0]) if row else 0

    # -- scenarios

    def run(self, sc: Scenario) -> None:
        dbname, url = self.urls[sc.system]
        out = self.outcome(sc.key)
        admin = self.args.url
        if sc.kind == "ceiling":
            if not self.args.pgbench:
                out.note = "n/a (no pgbench binary)"
                log(f"  {sc.key:16s} skipped: no pgbench binary (--pgbench)")
                return
            measure.settle(url, not self.args.quick)
            with measure.Probe(admin, dbname) as probe:
                tps = peers.pgbench(url, 4, self.args.pgbench_seconds, self.args.pgbench)
            out.add(tps, self.rep)
            out.details.append(self._detail(probe, tps * self.args.pgbench_seconds, [], tps))
            log(f"  {sc.key:16s} {tps:9.0f} tps")
            return
        self.reset(sc.system, url)
        if sc.kind == "single":
            m = self.args.single
            measure.settle(url, not self.args.quick)
            with measure.Probe(admin, dbname) as probe:
                if sc.system == "lanefleet":
                    secs = fleetload.enqueue_single(url, 0, m)
                elif sc.system == "pgqueuer":
                    secs = peers.pgq_enqueue(url, 0, m, 1)
                else:
                    secs = peers.proc_enqueue(url, 0, m, 1)
            got = self.count_jobs(sc.system, url)
            if got != m:
                out.problems.append(f"{sc.key}: {got} jobs queued by {m} enqueue calls")
            out.add(m / secs, self.rep)
            out.details.append(self._detail(probe, m, [], m / secs))
            log(f"  {sc.key:16s} {m / secs:9.0f} jobs/s")
            return
        n = self.args.small_tasks if sc.params.get("small") else self.args.tasks
        secs_bulk = self.load(sc.system, url, n)
        if secs_bulk is not None:
            self.outcome(f"enqueue.bulk.{sc.system}").add(n / secs_bulk, self.rep)
        measure.settle(url, not self.args.quick)
        if self.args.profile and sc.system == "lanefleet":
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("select pg_stat_reset()")
        func, wargs = self.workers(sc, url)
        try:
            with measure.Probe(admin, dbname) as probe:
                results = measure.run_workers(func, wargs, threads=self.args.lf_threads and sc.system == "lanefleet")
        except measure.WorkerFailed as exc:
            out.problems.append(f"{sc.key}: a worker failed: {str(exc).strip().splitlines()[-1]}")
            log(f"  {sc.key:16s} FAILED\n{exc}")
            return
        rate = n / measure.span(results)
        problems = self.verify(sc.system, url, n, results)
        out.problems += [f"{sc.key}: {p}" for p in problems]
        out.add(rate, self.rep)
        out.details.append(self._detail(probe, n, results, rate))
        log(f"  {sc.key:16s} {rate:9.0f} jobs/s{'  PROBLEMS: ' + '; '.join(problems) if problems else ''}")
        if self.args.profile and sc.system == "lanefleet":
            self.profile_out.append(f"{sc.key}: " + fleetload.function_profile(url, n))

    def _detail(self, probe: measure.Probe, jobs: float, results: list[dict[str, Any]], rate: float) -> dict[str, Any]:
        client = sum(r.get("cpu_client", 0.0) for r in results)
        return {
            "rate": rate,
            "commits_per_job": probe.commits / jobs if jobs else None,
            "wal_per_job": probe.wal_bytes / jobs if jobs else None,
            "server_us_per_job": 1e6 * probe.cpu_server_s / jobs if jobs else None,
            "client_us_per_job": 1e6 * client / jobs if jobs and results else None,
            "machine_busy_s": probe.cpu_busy_s,
            "wall_s": probe.wall_s,
            "waits": probe.top_waits(),
        }


# -- output ------------------------------------------------------------------------------------

def fmt_rate(x: float | None) -> str:
    return "–" if x is None else f"{x:,.0f}"


def machine(url: str) -> list[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        ver = conn.execute("select version()").fetchone()
        settings: dict[str, str] = dict(conn.execute(
            "select name, setting || coalesce(' ' || unit, '') from pg_settings where name in"
            " ('fsync', 'synchronous_commit', 'shared_buffers', 'max_connections', 'wal_sync_method',"
            " 'full_page_writes', 'commit_delay')").fetchall())
    mem_kb = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    versions = []
    for mod in ("pgqueuer", "procrastinate", "asyncpg", "psycopg"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions.append(f"{mod} {version(mod)}")
    return [
        f"date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; machine: {os.cpu_count()} cores, {mem_kb / 1048576:.1f} GiB RAM,"
        f" load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"server: {ver[0] if ver else '?'}",
        "settings: " + ", ".join(f"{k}={v}" for k, v in sorted(settings.items())),
        "clients: " + ", ".join(versions),
    ]


def report(run: dict[str, Any]) -> tuple[str, bool]:
    """The markdown tables of a run (as saved by --json) and whether every correctness check
    passed."""
    m = run["meta"]
    outcomes: dict[str, Outcome] = {}
    for k, o in run["outcomes"].items():
        rates = list(o["rates"])
        reps = list(o.get("reps") or [i * m["reps"] // max(1, len(rates)) for i in range(len(rates))])
        outcomes[k] = Outcome(rates, reps, list(o.get("details", [])), list(o.get("problems", [])), o.get("note", ""))
    lf_bulk = bool(m["lf_bulk"])
    keys = set(m.get("scenarios") or [])
    scenarios = [sc for sc in plan(m["quick"], lf_bulk) if not keys or sc.key in keys]
    how = f"median of {m['reps']}" if m["reps"] > 1 else "one run"
    small = f" ({m['small_tasks']:,} for Procrastinate and lanefleet at concurrency 1)" if m["small_tasks"] != m["tasks"] else ""
    lines = [f"jobs: {m['tasks']:,} no-op per drain run{small}; {m['single']:,} for one-job enqueues; bulk enqueues"
             f" in calls of {m['chunk']:,}; {how}; lanefleet workers: {'threads' if m['lf_threads'] else 'one process each'};"
             f" PgQueuer: {m['pgq_procs']} process(es), one asyncpg connection each", ""]
    lines += ["| system / setting | jobs/s | min–max | commits/job | server CPU µs/job | client CPU µs/job | top waits (server) |",
              "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]

    def row(key: str, label: str) -> None:
        o = outcomes.get(key)
        if o is None or not o.rates:
            note = o.note if o and o.note else ("**failed**" if o and o.problems else "not run")
            lines.append(f"| {label} | {note} | | | | | |")
            return
        d = o.details

        def med(k: str, fmt: str) -> str:
            xs = [x[k] for x in d if x.get(k) is not None]
            return fmt.format(statistics.median(xs)) if xs else ""

        spread = f"{fmt_rate(min(o.rates))}–{fmt_rate(max(o.rates))}" if len(o.rates) > 1 else ""
        waits = sorted(d, key=lambda x: x["rate"])[len(d) // 2]["waits"] if d else ""  # the median run's
        lines.append(f"| {label} | {fmt_rate(o.median)} | {spread} | {med('commits_per_job', '{:.2f}')} |"
                     f" {med('server_us_per_job', '{:,.0f}')} | {med('client_us_per_job', '{:,.0f}')} | {waits} |")

    for sc in scenarios:
        if sc.kind != "single":
            row(sc.key, sc.label)
    for sc in scenarios:
        if sc.kind == "single":
            row(sc.key, sc.label)
    for system, label in BULK_LABELS.items():
        if f"enqueue.bulk.{system}" in outcomes:
            row(f"enqueue.bulk.{system}", label)

    # the goals of #24 (those of #7, before it: durable ≥ 1.2× PgQueuer default and ≥ 60 % of pgbench)
    goals: list[tuple[str, str, str, float]] = [
        ("durable c16 b10 ≥ 0.8× PgQueuer default", "lf.c16.b10", "pgq.default", 0.8),
        ("durable c16 b10 / the pgbench ceiling (no goal)", "lf.c16.b10", "pgbench", 0.0),
        ("bulk mode c4 ≥ 1.2× PgQueuer batch 100", "lf.bulk.c4", "pgq.batch100", 1.2),
        ("bulk mode c16 ≥ 1.2× PgQueuer batch 100", "lf.bulk.c16", "pgq.batch100", 1.2),
    ]
    for c in (1, 4, 16):
        goals += [(f"durable c{c} b10 ≥ 10× Procrastinate c{c}", f"lf.c{c}.b10", f"proc.c{c}", 10.0),
                  (f"bulk mode c{c} ≥ 10× Procrastinate c{c}", f"lf.bulk.c{c}", f"proc.c{c}", 10.0)]
    goals.append(("bulk enqueue ≥ 1.0× PgQueuer bulk enqueue", "enqueue.bulk.lanefleet", "enqueue.bulk.pgqueuer", 1.0))
    lines += ["", "ratio: lanefleet / reference within each repetition (the two ran one after the other), the"
              " median of those; in brackets the lowest and highest.", "",
              "| goal (#24) | lanefleet | reference | ratio | met |", "| --- | ---: | ---: | ---: | --- |"]
    for label, mine, ref, target in goals:
        x, y = outcomes.get(mine), outcomes.get(ref)
        ratios = paired_ratio(x, y) if x and y else []
        if not ratios:
            missing = [o for o in (x, y) if not o or not o.rates]
            if any(o and o.note for o in missing):
                why = next(o.note for o in missing if o and o.note)
            elif any(o and o.problems for o in missing):
                why = "**failed** (below)"
            elif (mine == "enqueue.bulk.lanefleet" or mine.startswith("lf.bulk")) and not lf_bulk:
                why = "n/a (no fleet.enqueue_many / complete_many)"
            else:
                why = "n/a (not run with --quick)" if m["quick"] else "n/a (not run)"
            lines.append(f"| {label} | {fmt_rate(x.median if x else None)} | {fmt_rate(y.median if y else None)} | – | {why} |")
            continue
        r = statistics.median(ratios)
        spread = f" ({min(ratios):.2f}–{max(ratios):.2f})" if len(ratios) > 1 else ""
        lines.append(f"| {label} | {fmt_rate(x.median if x else None)} | {fmt_rate(y.median if y else None)} |"
                     f" {r:.2f}×{spread} | {'–' if not target else 'met' if r >= target else '**not met**'} |")

    problems = [p for o in outcomes.values() for p in o.problems]
    runs = sum(len(o.rates) for k, o in outcomes.items() if not k.startswith("enqueue.bulk") and k != "pgbench")
    lines.append("")
    if problems:
        lines.append(f"CORRECTNESS FAILED ({len(problems)}):")
        lines += [f"- {p}" for p in problems]
    else:
        lines.append(f"correctness: every job of every run ({runs} runs) done exactly once")
    return "\n".join(lines), not problems


def render(run: dict[str, Any]) -> tuple[str, bool]:
    """The whole printout of a run: the machine, then the tables."""
    table, ok = report(run)
    head = "\n".join(f"{line}  " for line in run["header"])
    return f"{head}\n{run.get('footer', '')}\n\n{table}", ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1,500 jobs, one repetition, fewer scenarios (CI)")
    ap.add_argument("--url", default=DEFAULT_URL, help="a database of the server to use (default: %(default)s)")
    ap.add_argument("--tasks", type=int, help="jobs per drain run (default 20,000; --quick 1,500)")
    ap.add_argument("--small-tasks", type=int,
                    help="jobs per drain run of Procrastinate and of lanefleet at concurrency 1, the slow ones"
                         " (default: --tasks; --quick 400)")
    ap.add_argument("--reps", type=int, help="repetitions, the median is shown (default 3; --quick 1)")
    ap.add_argument("--single", type=int, help="jobs for the one-job-per-call enqueue (default 2,000; --quick 100)")
    ap.add_argument("--chunk", type=int, default=1000, help="jobs per bulk enqueue call (default %(default)s)")
    ap.add_argument("--pgbench-seconds", type=float, help="length of a pgbench run (default 10; --quick 2)")
    ap.add_argument("--pgbench", default="pgbench",
                    help="the pgbench binary (default: from PATH, else /usr/lib/postgresql/*/bin)")
    ap.add_argument("--pgq-procs", type=int, default=1, help="PgQueuer worker processes (default %(default)s)")
    ap.add_argument("--lf-threads", action="store_true", help="lanefleet workers as threads of one process")
    ap.add_argument("--only", action="append", default=[], help="run only scenarios whose key starts with this")
    ap.add_argument("--migrations", type=Path, help="lanefleet migrations directory (default: the package's)")
    ap.add_argument("--profile", action="store_true",
                    help="also: per-function server time of lanefleet (track_functions) and the plans of its hot calls")
    ap.add_argument("--json", type=Path, help="write every measurement here")
    ap.add_argument("--report", type=Path, help="print the tables of a run saved with --json, run nothing")
    args = ap.parse_args(argv)
    if args.report:
        text, ok = render(json.loads(args.report.read_text()))
        print(text)
        return 0 if ok else 1
    args.tasks = args.tasks or (1500 if args.quick else 20_000)
    args.small_tasks = args.small_tasks or (400 if args.quick else args.tasks)
    args.reps = args.reps or (1 if args.quick else 3)
    args.single = args.single or (100 if args.quick else 2000)
    args.pgbench_seconds = args.pgbench_seconds or (2.0 if args.quick else 10.0)
    args.pgbench = peers.find_pgbench(args.pgbench)

    try:
        import pgqueuer  # noqa: F401
        import procrastinate  # noqa: F401
    except ImportError as exc:
        log(f"{exc}: the peers are in the bench dependency group: uv run --group bench python -m bench.queues")
        return 2

    header = machine(args.url)
    for line in header:
        log(line)
    b = Bench(args)
    t_start = time.monotonic()
    with contextlib.ExitStack() as stack:
        installers: dict[str, Callable[[str], None]] = {
            "pgbench": peers.pgbench_install,
            "pgqueuer": peers.pgq_install,
            "procrastinate": peers.proc_install,
            "lanefleet": lambda url: fleetload.install(url, args.migrations),
        }
        for system, install in installers.items():
            name, url = stack.enter_context(measure.scratch_database(args.url, system))
            install(url)
            b.urls[system] = (name, url)
        b.lf_bulk = fleetload.has_bulk(b.urls["lanefleet"][1])
        with psycopg.connect(b.urls["lanefleet"][1], autocommit=True) as conn:
            row = conn.execute("select count(*), max(version) from supabase_migrations.schema_migrations").fetchone()
        header.append(f"lanefleet: {row[0] if row else '?'} migrations, the last {row[1] if row else '?'}")
        scenarios = plan(args.quick, all(b.lf_bulk))
        if not all(b.lf_bulk):
            log("lanefleet has no fleet.enqueue_many / fleet.complete_many: bulk mode and bulk enqueue are n/a")
        if args.only:
            scenarios = [s for s in scenarios if any(s.key.startswith(o) for o in args.only)]
        for rep in range(args.reps):
            log(f"repetition {rep + 1} of {args.reps}")
            b.rep = rep
            for sc in run_order(scenarios):
                t0 = time.monotonic()
                b.run(sc)
                log(f"  {'':16s} ({time.monotonic() - t0:.1f} s with its setup)")
        if args.profile:
            b.profile_out.append(fleetload.explain_hot_calls(b.urls["lanefleet"][1]))
    saved = {
        "header": header,
        "footer": f"wall time of the run: {time.monotonic() - t_start:.0f} s; load average at the end:"
                  f" {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        "meta": {"quick": args.quick, "tasks": args.tasks, "small_tasks": args.small_tasks, "single": args.single,
                 "chunk": args.chunk, "reps": args.reps, "lf_threads": args.lf_threads, "pgq_procs": args.pgq_procs,
                 "lf_bulk": all(b.lf_bulk), "scenarios": [sc.key for sc in scenarios]},
        "outcomes": {k: {"rates": o.rates, "reps": o.reps, "details": o.details, "problems": o.problems,
                         "note": o.note} for k, o in b.outcomes.items()},
    }
    if args.json:
        args.json.write_text(json.dumps(saved, indent=1))
    text, ok = render(saved)
    print(text)
    if b.profile_out:
        print("\nprofile (lanefleet):\n" + "\n".join(b.profile_out))
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
