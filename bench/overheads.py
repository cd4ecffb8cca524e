"""What a shift costs besides its agents (issue #7, item 5): start-up, memory, heartbeat traffic.

    uv run python bench/overheads.py            # 5 starts per setting, 60 s heartbeat windows (about 5 min)
    uv run python bench/overheads.py --quick    # 3 starts, 12 s windows with a 6 s lease (about 2 min)

Everything runs the real ``fleet shift`` in a fresh interpreter (``python -m monitor.cli shift``,
what cron starts) against a scratch database on --url, with the scripted agent
``worker.dev.example_agent`` as the lane's command.

1. Start to first claim. One ready task; a ``fleet shift --once --max-tasks 1`` is spawned and the
   wall clock runs from just before the spawn to the ``claimed`` event of that task in
   fleet.journal (its ``ts`` is the claim's ``now()``; database and bench share this host's clock).
   ``session_opened`` splits it into "start-up" (imports, config, schema check, the pool) and
   "session → claim". Two settings: without a bytecode cache (every module compiled from source:
   a venv that never wrote ``__pycache__``, or PYTHONDONTWRITEBYTECODE set) and with one (the
   normal case after the first run, or ``uv sync --compile-bytecode``). Then one more run under
   ``-X importtime``: the total import time and the packages that take it.
2. Memory with 16 running agents. A lane with max_running 16 and 16 tasks whose agent hangs; when
   all 16 run, the resident memory of the shift process, of each agent's supervisor (and, for
   scale, of each agent) from /proc: RSS, PSS (shared pages split among their users) and private.
3. Heartbeat traffic. ``track_functions = 'pl'`` on the scratch database (set per database, no
   server restart, no pg_stat_statements needed) makes PostgreSQL count the calls of every
   ``fleet.*`` function; the deltas of pg_stat_user_functions over a window while the shift holds
   N tasks (slots = N, so it never polls the claim) give the SQL API calls per minute. Then the
   same with 1 task and 15 free slots on an empty queue: the idle claim poll. The shift also
   counts its own statements (it runs under bench/callcount.py): exact, and it sees the pool's
   connection check, an empty statement sent before every call, which the server does not count
   as a function call.

Correctness is asserted (the claimed task is the one queued; all agents run; every task handed
off at the end, no agent outlives its shift); times are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from bench.harness import (
    AGENT,
    DEFAULT_URL,
    FleetBench,
    alive,
    git_state,
    log,
    machine,
    memory_kb,
    scratch_db,
    wait_agents,
    wait_for,
)

HANG = {"mode": "hang", "steps": 1}


def make_bench(url: str, folder: Path, lease: int) -> FleetBench:
    lane = {"command": AGENT, "lease_seconds": lease, "grace_seconds": 2, "max_attempts": 3,
            "hidden_files": ["fleet"]}
    return FleetBench(url, folder, {
        "start": {**lane, "max_running": 4},
        "mem": {**lane, "max_running": 16, "slots": 16},
        "beat": {**lane, "max_running": 16, "slots": 16},
    })


# -- 1. start to first claim -------------------------------------------------------------------


def start_to_claim(b: FleetBench, env: dict[str, str]) -> dict[str, float]:
    (task,) = b.enqueue("start", 1, {"steps": 1, "sleep": 0})
    t0 = time.time()
    proc = b.spawn("shift", "--lane", "start", "--once", "--max-tasks", "1", "--poll", "0.05", env=env)
    err = b.wait(proc, 120)
    assert proc.returncode == 0, err[-2000:]
    row = b.conn.execute(
        "select (select extract(epoch from ts) from fleet.journal where kind = 'claimed' and task_id = %s),"
        " (select extract(epoch from e.ts) from fleet.events e join fleet.tasks t on t.id = %s"
        "   join fleet.runs r on r.task_id = t.id and r.session_id = e.session_id"
        "   where e.kind = 'session_opened'),"
        " (select state from fleet.tasks where id = %s)", (task, task, task)).fetchone()
    assert row is not None and row[0] is not None, f"task {task} was never claimed"
    assert row[2] == "done", f"task {task} ended {row[2]}"
    claimed, opened = float(row[0]), float(row[1])
    return {"total": claimed - t0, "startup": opened - t0, "session_to_claim": claimed - opened}


IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( +)(\S+)")


def import_profile(b: FleetBench, env: dict[str, str]) -> tuple[float, dict[str, float], list[str]]:
    """Total import time (ms), self time per top package (ms), and the modules imported."""
    b.enqueue("start", 1, {"steps": 1, "sleep": 0})
    proc = b.spawn("shift", "--lane", "start", "--once", "--max-tasks", "1", env=env, python=["-X", "importtime"])
    err = b.wait(proc, 120)
    assert proc.returncode == 0, err[-2000:]
    total, per_pkg, modules = 0.0, defaultdict[str, float](float), []
    for line in err.splitlines():
        m = IMPORT_LINE.match(line)
        if not m:
            continue
        self_us, cum_us, indent, name = int(m[1]), int(m[2]), len(m[3]), m[4]
        if indent == 1:
            total += cum_us / 1000
        per_pkg[name.split(".")[0]] += self_us / 1000
        modules.append(name)
    return total, dict(per_pkg), modules


def part_start(b: FleetBench, runs: int) -> None:
    log("\n1. `fleet shift` start to first claim (wall clock from spawn to the claimed event)")
    cold_dir = Path(tempfile.mkdtemp(prefix="lf_bench_nopyc_", dir=b.folder))
    warm_dir = Path(tempfile.mkdtemp(prefix="lf_bench_pyc_", dir=b.folder))
    # an empty cache that is never written: every module compiled from source, every time
    cold = {**b.env, "PYTHONPYCACHEPREFIX": str(cold_dir), "PYTHONDONTWRITEBYTECODE": "1"}
    warm = {k: v for k, v in b.env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    warm["PYTHONPYCACHEPREFIX"] = str(warm_dir)
    start_to_claim(b, warm)  # writes the bytecode cache
    log(f"   {'setting':34s} {'median':>8s} {'min':>8s} {'max':>8s}   start-up | session → claim (medians)")
    for label, env in (("no bytecode cache (compile)", cold), ("bytecode cached", warm)):
        xs = [start_to_claim(b, env) for _ in range(runs)]
        tot = [x["total"] for x in xs]
        log(f"   {label:34s} {statistics.median(tot):6.3f} s {min(tot):6.3f} s {max(tot):6.3f} s"
            f"   {statistics.median(x['startup'] for x in xs):.3f} s | "
            f"{statistics.median(x['session_to_claim'] for x in xs) * 1000:.0f} ms")
        log(json.dumps({"start_to_claim": label, "runs_s": [round(x, 3) for x in tot]}))
    for label, env in (("no bytecode cache", cold), ("bytecode cached", warm)):
        total, per_pkg, modules = import_profile(b, env)
        top = sorted(per_pkg.items(), key=lambda kv: -kv[1])[:12]
        log(f"   -X importtime, {label}: {total:.0f} ms of imports, {len(modules)} modules; by package: "
            + ", ".join(f"{k} {v:.0f}" for k, v in top))
        if env is warm:
            extra = sorted({m.split(".")[0] for m in modules} & {
                "jwt", "cryptography", "markdown_it", "apscheduler", "httpx", "supabase", "postgrest",
                "gotrue", "storage3", "realtime", "websockets"})
            log(f"   packages a shift does not use, imported anyway: {', '.join(extra) or 'none'}"
                + ("; rich.live" if "rich.live" in modules else "")
                + ("; rich.markdown" if "rich.markdown" in modules else ""))
    import_floor(warm, max(runs, 9))


CORE = ["typer", "rich.console", "rich.table", "psycopg", "psycopg_pool", "tenacity", "pydantic", "worker.config",
        "worker.models", "worker.store.postgres"]
# the worker-side command modules (the monitor's app imports them all)
WORKER_CLI = [f"worker.cli.{name}" for name in ("batch", "db", "devstack", "dispatch", "guard", "keys", "migrate",
                                                "review", "shift", "tasks")]
# (label, imported first, then timed): what each part adds on top of what is imported before it
IMPORT_STEPS = [
    ("the core: typer, rich, psycopg + pool, tenacity, pydantic, worker.config/models/store.postgres", [], CORE),
    ("+ structlog (the shift's logging; it brings rich.traceback, pygments, asyncio)", CORE, ["structlog"]),
    ("+ worker.shift.shift and worker.cli.* (executor, workspace, the worker commands)", [*CORE, "structlog"],
     ["worker.shift.shift", *WORKER_CLI]),
    ("+ the rest of monitor.cli.app (monitor commands, dashboards, dispatch, dev-stack, keys)",
     [*CORE, "structlog", "worker.shift.shift", *WORKER_CLI], ["monitor.cli.app"]),
    ("(PyJWT + cryptography, no longer imported by a shift)", [*CORE, "structlog", "monitor.cli.app"], ["jwt"]),
    ("(urllib.request, no longer imported by a shift)", [*CORE, "structlog", "monitor.cli.app"], ["urllib.request"]),
]


def import_floor(env: dict[str, str], runs: int) -> None:
    """What each step of a shift's imports costs on top of the ones before it, in a fresh
    interpreter with the bytecode cached: min and median of ``runs``."""
    import subprocess

    def once(before: list[str], timed: list[str]) -> float:
        code = ("import importlib, time\n"
                f"for m in {before!r}: importlib.import_module(m)\n"
                "t = time.perf_counter()\n"
                f"for m in {timed!r}: importlib.import_module(m)\n"
                "print(time.perf_counter() - t)")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return float(out.stdout) * 1000

    def interpreter() -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
        return (time.perf_counter() - t0) * 1000

    log(f"   a shift's imports step by step, fresh interpreter, bytecode cached ({runs} runs): {'min':>10s} {'median':>7s}")
    xs = [interpreter() for _ in range(runs)]
    log(f"     {'the interpreter alone (spawn to exit of -c pass)':84s} {min(xs):5.0f} ms {statistics.median(xs):5.0f} ms")
    for label, before, timed in IMPORT_STEPS:
        once(before, timed)  # writes the bytecode of any module not cached yet
        xs = [once(before, timed) for _ in range(runs)]
        log(f"     {label:84s} {min(xs):5.0f} ms {statistics.median(xs):5.0f} ms")


# -- 2. memory with 16 agents ------------------------------------------------------------------


def stop_shift(b: FleetBench, proc: Any, lane: str, pids: list[int]) -> None:
    """SIGTERM: the shift hands its tasks off; then no agent may be left, nor a task running."""
    b.stop(proc)
    wait_for("no agent left", lambda: not [p for p in pids if alive(p)], timeout=15)
    assert b.count(lane) == 0, f"{b.count(lane)} tasks still running in {lane}"


def mb(kb: float) -> str:
    return f"{kb / 1024:.1f} MB"


def part_memory(b: FleetBench) -> None:
    log("\n2. Resident memory of a shift with 16 running agents (lane max_running 16, agents hang)")
    tasks = b.enqueue("mem", 16, HANG)
    proc = b.spawn("shift", "--lane", "mem", "--max-seconds", "600")
    pids: list[int] = []
    try:
        b.expect(proc, "16 running tasks", lambda: b.count("mem") == 16)
        tree = wait_agents(proc.pid, 16)
        time.sleep(1.0)  # let the last agents finish starting
        shift = memory_kb(proc.pid)
        sups = [memory_kb(p) for p in tree]
        agents = [memory_kb(a) for kids in tree.values() for a in kids]
        log(f"   {'process':28s} {'RSS':>10s} {'PSS':>10s} {'private':>10s}")
        log(f"   {'shift':28s} {mb(shift['rss']):>10s} {mb(shift['pss']):>10s} {mb(shift['private']):>10s}")
        for label, xs in (("supervisor (mean of 16)", sups), ("agent (mean of 16, for scale)", agents)):
            log(f"   {label:28s} " + " ".join(f"{mb(statistics.fmean(x[k] for x in xs)):>10s}"
                                             for k in ("rss", "pss", "private")))
        log(f"   {'16 supervisors, together':28s} " + " ".join(f"{mb(sum(x[k] for x in sups)):>10s}"
                                                         for k in ("rss", "pss", "private")))
        log(f"   {'shift + 16 supervisors':28s} "
            + " ".join(f"{mb(shift[k] + sum(x[k] for x in sups)):>10s}" for k in ("rss", "pss", "private")))
        log(json.dumps({"memory_kb": {"shift": shift, "supervisors": sups[:1], "agents": agents[:1]}}))
        pids = [*tree, *(a for kids in tree.values() for a in kids)]
    finally:
        if proc.poll() is None:
            stop_shift(b, proc, "mem", pids)
    row = b.conn.execute("select count(*) from fleet.tasks where id = any(%s) and state = 'queued' and handoffs = 1",
                         (tasks,)).fetchone()
    assert row is not None and row[0] == 16, f"only {row[0] if row else 0} of 16 tasks were handed off"


# -- 3. heartbeat traffic ----------------------------------------------------------------------

SNAPSHOT = """
select coalesce(jsonb_object_agg(funcname, calls), '{}') from pg_stat_user_functions where schemaname = 'fleet'
"""


def server_counts(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Calls of each fleet.* function, nested ones included (track_functions)."""
    row = conn.execute(SNAPSHOT).fetchone()
    assert row is not None
    return {f"fleet.{k}": int(v) for k, v in row[0].items()}


def client_counts(path: Path) -> tuple[float, dict[str, int]]:
    data = json.loads(path.read_text())
    return float(data["t"]), dict(data["counts"])


def window(b: FleetBench, counts: Path, seconds: float) -> tuple[dict[str, float], dict[str, float]]:
    """Per minute over ``seconds``: the statements the shift sent (exact, from its own count) and
    the fleet.* calls the server counted (a backend flushes its counters when idle, up to 10 s
    late, so the server's figures are exact only to a call or two at each end of the window)."""
    s0 = server_counts(b.conn)
    t0, c0 = client_counts(counts)
    time.sleep(seconds)
    s1 = server_counts(b.conn)
    t1, c1 = client_counts(counts)
    minutes = (t1 - t0) / 60
    client = {k: (v - c0.get(k, 0)) / minutes for k, v in c1.items() if v - c0.get(k, 0)}
    server = {k: (v - s0.get(k, 0)) / minutes for k, v in s1.items() if v - s0.get(k, 0)}
    return client, server


def part_heartbeat(b: FleetBench, seconds: float, lease: int) -> None:
    every = max(0.5, lease / 3)
    log(f"\n3. Statements per minute of one shift session (lease {lease} s: a heartbeat every {every:g} s; "
        f"{seconds:g} s windows once the agents run)")
    dbname = b.conn.info.dbname
    b.conn.execute(f'alter database "{dbname}" set track_functions = \'pl\'')
    log(f"   {'held tasks':32s} {'fleet.heartbeat':>15s} {'fleet.claim':>11s} {'other calls':>11s} "
        f"{'pool checks':>11s} {'statements':>10s} | server-counted fleet.heartbeat")
    rows: list[dict[str, Any]] = []
    for held, slots, label in ((1, 1, "1 (slots 1)"), (16, 16, "16 (slots 16)"),
                               (1, 16, "1, 15 free slots, empty queue")):
        b.enqueue("beat", held, HANG)
        counts = b.folder / f"counts-{held}-{slots}.json"
        proc = b.spawn("shift", "--lane", "beat", "--max-seconds", "900", "--slots", str(slots),
                       count_to=counts)
        pids: list[int] = []
        try:
            b.expect(proc, f"{held} running", lambda: b.count("beat") == held)  # noqa: B023
            pids = [p for s, kids in wait_agents(proc.pid, held).items() for p in (s, *kids)]
            # past the start (the first heartbeat made, and the start's calls flushed to the
            # server's counters, which an idle backend does within 10 s)
            time.sleep(max(every, 10.0) + 1)
            client, server = window(b, counts, seconds)
        finally:
            if proc.poll() is None:
                stop_shift(b, proc, "beat", pids)
        beat, claim = client.get("fleet.heartbeat", 0.0), client.get("fleet.claim", 0.0)
        checks = client.get("(pool check)", 0.0)
        total = sum(client.values())
        others = total - beat - claim - checks
        log(f"   {label:32s} {beat:15.1f} {claim:11.1f} {others:11.1f} {checks:11.1f} {total:10.1f} | "
            f"{server.get('fleet.heartbeat', 0.0):9.1f}")
        rows.append({"held": held, "slots": slots, "client_per_minute": {k: round(v, 1) for k, v in client.items()},
                     "server_per_minute": {k: round(v, 1) for k, v in server.items()}})
        # the session handed its tasks back to the queue: cancel them, the next case starts clean
        b.conn.execute("update fleet.tasks set state = 'cancelled', finished_at = now() "
                       "where lane = 'beat' and state = 'queued'")
    log(json.dumps({"statements_per_minute": rows}))
    b.conn.execute(f'alter database "{dbname}" reset track_functions')
    # the property (a count, not a time): holding 16 tasks costs no more statements than holding 1
    one, sixteen = (sum(r["client_per_minute"].values()) for r in rows[:2])
    assert sixteen <= one * 1.1 + 1, f"a session holding 16 tasks sends {sixteen:.1f}/min, holding 1: {one:.1f}/min"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 starts, 12 s windows with a 6 s lease")
    ap.add_argument("--runs", type=int, help="starts per setting (default 5, --quick 3)")
    ap.add_argument("--window", type=float, help="seconds per heartbeat window (default 60, --quick 12)")
    ap.add_argument("--lease", type=int, help="lease_seconds of the lanes (default 30, --quick 6)")
    ap.add_argument("--only", choices=["start", "memory", "heartbeat"], action="append")
    ap.add_argument("--url", default=DEFAULT_URL)
    args = ap.parse_args()
    runs = args.runs or (3 if args.quick else 5)
    seconds = args.window or (12.0 if args.quick else 60.0)
    lease = args.lease or (6 if args.quick else 30)
    parts = args.only or ["start", "memory", "heartbeat"]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lf_bench_overheads_") as tmp, \
            scratch_db(args.url, "overheads") as url:
        b = make_bench(url, Path(tmp), lease)
        log(f"{datetime.now():%Y-%m-%d %H:%M}; {machine(b.conn)}; tree {git_state()}")
        if "start" in parts:
            part_start(b, runs)
        if "memory" in parts:
            part_memory(b)
        if "heartbeat" in parts:
            part_heartbeat(b, seconds, lease)
        b.close()
    log(f"\ndone in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
