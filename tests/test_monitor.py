"""The fleet monitor and the cron host (DESIGN §7): host-local pid checks, monitor passes against
real ``fleet shift`` subprocesses, and the ``fleet monitor``, ``fleet run`` and ``fleet crontab``
commands.

Processes: every subprocess here is started by the test and, if still alive at the end, killed by
its pid; agents are found by their workspace (under the test's tmp folder) and killed by pid.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

import fleetkit
import psycopg
import pytest
from fleetkit import Backend
from psycopg.rows import dict_row
from sqlkit import expire

from monitor.host import SLOT_HELD
from monitor.reconcile import host_checks, monitor_pass
from worker.config import FleetConfig, cron_trigger, load_config
from worker.proc import process_identity, process_start_time
from worker.store.postgres import PostgresStore
from worker.store.sync import sync_config

ROOT = Path(__file__).resolve().parents[1]
AGENT = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]
HANG = {"mode": "hang"}

T = TypeVar("T")


# ------------------------------------------------------------------------------------------------
# helpers


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str | Path):
        return json.dumps(str(v))
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def write_config(tmp: Path, lanes: dict[str, dict[str, Any]], **fleet: Any) -> Path:
    lines = ["[fleet]", f"workspaces = {toml_value(tmp / 'ws')}", f"home = {toml_value(tmp / 'home')}"]
    lines += [f"{k} = {toml_value(v)}" for k, v in fleet.items()]
    for name, settings in lanes.items():
        lines += ["", f"[lanes.{name}]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in {"command": AGENT, **settings}.items()]
    path = tmp / "fleet.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def wait_for(what: str, fn: Callable[[], T], timeout: float = 15.0, every: float = 0.05) -> T:
    """fleetkit's wait_for with a longer default: these tests start whole shifts."""
    return fleetkit.wait_for(what, fn, timeout, every)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def pids_under(folder: Path) -> set[int]:
    """Live processes whose cwd or command line is under ``folder`` (the test's own tmp folder)."""
    needle = str(folder)
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if (needle in cmdline or cwd.startswith(needle)) and alive(int(entry.name)):
            found.add(int(entry.name))
    return found


class Fleet:
    """A fleet.toml in a tmp folder, its lanes synced into the test's database, and helpers.

    ``store``: the monitor's (an operator key on supabase); ``worker``: a shift's (a worker key for
    the fleet's lanes on supabase), for sessions a test opens itself. On postgres they are one store.
    """

    def __init__(self, backend: Backend, tmp: Path, lanes: dict[str, dict[str, Any]], **fleet: Any) -> None:
        self.backend = backend
        self.db_url = backend.db_url  # direct, for the test's own SQL
        self.tmp = tmp
        self.toml = write_config(tmp, lanes, **fleet)
        self.cfg: FleetConfig = load_config(self.toml, environ={"DATABASE_URL": self.db_url})
        self.direct = PostgresStore(self.db_url, min_size=1, max_size=3)
        sync_config(self.direct, self.cfg)
        self.operator_key = backend.key("operator")
        self.worker_key = backend.key("worker", list(lanes))
        self.store = backend.store(self.operator_key) if backend.rest else self.direct
        self.worker = backend.store(self.worker_key) if backend.rest else self.direct
        self.procs: list[subprocess.Popen[bytes]] = []

    def env(self, role: str = "operator") -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") and k != "DATABASE_URL"}
        env.update(self.backend.env(self.worker_key if role == "worker" else self.operator_key))
        env["FLEET_CONFIG"] = str(self.toml)
        return env

    def spawn(self, *args: str, log: str = "proc.log", role: str = "operator") -> subprocess.Popen[bytes]:
        out = (self.tmp / log).open("ab")
        try:
            proc = subprocess.Popen([sys.executable, "-m", "monitor.cli", *args], cwd=ROOT, env=self.env(role),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        finally:
            out.close()
        self.procs.append(proc)
        return proc

    def spawn_shift(self, lane: str, *args: str) -> subprocess.Popen[bytes]:
        return self.spawn("shift", "--lane", lane, "--max-seconds", "60", "--poll", "0.1", *args,
                          log=f"shift-{lane}.log", role="worker")

    def cli(self, *args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "monitor.cli", *args], cwd=ROOT, env=env or self.env(),
                              capture_output=True, text=True, timeout=timeout)

    def sql(self, query: str, params: Any = ()) -> list[dict[str, Any]]:
        with psycopg.connect(self.db_url, autocommit=True, row_factory=dict_row) as c:
            cur = c.execute(query, params)  # type: ignore[arg-type]
            return cur.fetchall() if cur.description else []

    def enqueue(self, lane: str, n: int, payload: dict[str, Any]) -> list[int]:
        return [self.store.enqueue(lane, f"{lane}:{i}", payload)[0] for i in range(n)]

    def tasks(self, ids: list[int]) -> list[dict[str, Any]]:
        return self.sql("select * from fleet.tasks where id = any(%s) order by id", (ids,))

    def states(self, ids: list[int]) -> list[str]:
        return [t["state"] for t in self.tasks(ids)]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        for pid in pids_under(self.tmp):  # agents that outlived a test failure
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for store in {id(s): s for s in (self.store, self.worker, self.direct)}.values():
            store.close()


@pytest.fixture
def make_fleet(backend: Backend, tmp_path: Path) -> Iterator[Callable[..., Fleet]]:
    """A fleet on each back-end (conftest ``backend``): postgres, and supabase over REST."""
    made: list[Fleet] = []

    def make(lanes: dict[str, dict[str, Any]], **fleet: Any) -> Fleet:
        f = Fleet(backend, tmp_path, lanes, **fleet)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def lane(**kw: Any) -> dict[str, Any]:
    return {"lease_seconds": 60, "max_running": 4, "max_attempts": 3, "grace_seconds": 1,
            "backoff_base_seconds": 0, **kw}


def kinds(actions: list[Any]) -> list[str]:
    return [a.action for a in actions]


# ------------------------------------------------------------------------------------------------
# a shift killed with SIGKILL


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_killed_shift_is_repaired_within_one_pass_on_its_host(make_fleet, reaped):
    """Same host: the pid check sees the shift is gone and releases its tasks at once, although
    their leases (60 s) have not expired. ``zombie``: the dead shift has not been reaped by its
    parent yet (as under ``fleet run``, which reaps at its next launch) — it is gone all the same."""
    fleet = make_fleet({"docs": lane(lease_seconds=60)})
    ids = fleet.enqueue("docs", 2, HANG)
    proc = fleet.spawn_shift("docs")
    wait_for("both tasks running", lambda: fleet.states(ids) == ["running", "running"])
    (sess,) = fleet.sql("select * from fleet.sessions")
    assert sess["pid"] == proc.pid and sess["host"] == socket.gethostname()
    assert sess["pid_identity"] == process_identity(proc.pid) is not None
    agents = wait_for("the agents", lambda: pids_under(fleet.tmp / "ws") if len(pids_under(fleet.tmp / "ws")) >= 2 else set())

    os.kill(proc.pid, signal.SIGKILL)
    if reaped:
        proc.wait(10)
    else:
        wait_for("the shift to be a zombie", lambda: not alive(proc.pid))

    actions = monitor_pass(fleet.store, fleet.cfg)

    assert kinds(actions) == ["session_lost", "released", "released"], actions
    assert actions[0].detail["reason"] == "pid-gone"
    assert sorted(a.task_id for a in actions[1:]) == ids
    for t in fleet.tasks(ids):
        assert (t["state"], t["evaporations"], t["attempts"]) == ("queued", 1, 1)
        assert t["lease_token"] is None
    (s,) = fleet.sql("select * from fleet.sessions")
    assert (s["state"], s["end_reason"]) == ("lost", "pid-gone")
    reasons = [e["detail"]["reason"] for e in fleet.sql("select * from fleet.journal where kind = 'repaired'")]
    assert reasons == ["pid-gone", "pid-gone"]
    assert monitor_pass(fleet.store, fleet.cfg) == []  # nothing twice
    # and the agents died with their shift (the supervisor's pipe), without the monitor's help
    wait_for("the agents to die with their shift", lambda: not any(alive(p) for p in agents), timeout=10)
    if not reaped:
        proc.wait(10)


def test_a_killed_shift_on_another_host_is_repaired_after_its_lease(make_fleet):
    """Another host cannot see the pid: the tasks come back when the session times out / the
    lease expires (3 s here), not at the first pass."""
    fleet = make_fleet({"docs": lane(lease_seconds=3)})
    ids = fleet.enqueue("docs", 2, HANG)
    proc = fleet.spawn_shift("docs")
    wait_for("both tasks running", lambda: fleet.states(ids) == ["running", "running"])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    killed = time.monotonic()

    assert host_checks(fleet.store, host="some-other-host") == []
    first = monitor_pass(fleet.store, fleet.cfg, host="some-other-host")
    assert first == [], first
    first_remote = monitor_pass(fleet.store, fleet.cfg, local=False)
    assert first_remote == [], first_remote
    assert fleet.states(ids) == ["running", "running"]

    repaired: list[Any] = []

    def passed() -> bool:
        repaired.extend(monitor_pass(fleet.store, fleet.cfg, local=False))
        # the leases and the session's heartbeat run out separately (a pass may see one first)
        return fleet.states(ids) == ["queued", "queued"] and \
            fleet.sql("select state from fleet.sessions")[0]["state"] == "lost"

    wait_for("the repair after the lease", passed, timeout=15, every=0.25)
    took = time.monotonic() - killed
    assert took >= 1.5, f"repaired {took:.1f} s after the kill: before the lease could expire"
    assert sorted(a.task_id for a in repaired if a.action == "released") == ids
    (s,) = fleet.sql("select * from fleet.sessions")
    assert (s["state"], s["end_reason"]) == ("lost", "heartbeat-timeout")
    assert [t["evaporations"] for t in fleet.tasks(ids)] == [1, 1]


def test_pid_checks_of_this_host(make_fleet):
    fleet = make_fleet({"docs": lane()})
    store, host = fleet.store, socket.gethostname()
    me = os.getpid()
    started = process_start_time(me)
    assert started is not None
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert process_start_time(gone.pid) is None
    (tid,) = fleet.enqueue("docs", 1, {})

    me_now = process_identity(me)
    assert me_now is not None
    boot, ticks = me_now.rsplit(":", 1)

    reused = fleet.worker.open_session("docs", host, me, started - timedelta(hours=1), 600)
    held = fleet.worker.claim(reused, 1)
    assert [t.id for t in held] == [tid]
    same = fleet.worker.open_session("docs", host, me, started, 600)
    no_start = fleet.worker.open_session("docs", host, me, None, 600)
    gone_here = fleet.worker.open_session("docs", host, gone.pid, None, 600)
    gone_elsewhere = fleet.worker.open_session("docs", "another-host", gone.pid, None, 600)
    # with an identity (boot id, start ticks): the start time as the host's clock, stepped an hour
    # since, says it: the same process; another start or another boot with the same pid is not
    stepped = fleet.worker.open_session("docs", host, me, started - timedelta(hours=1), 600, me_now)
    started_later = fleet.worker.open_session("docs", host, me, started, 600, f"{boot}:{int(ticks) + 1}")
    before_a_reboot = fleet.worker.open_session("docs", host, me, started, 600, f"another-boot:{ticks}")
    gone_with_identity = fleet.worker.open_session("docs", host, gone.pid, None, 600, f"{boot}:{ticks}")

    actions = host_checks(store)

    lost = {a.session_id: a.detail["reason"] for a in actions if a.action == "session_lost"}
    assert lost == {reused: "pid-reused", gone_here: "pid-gone", started_later: "pid-reused",
                    before_a_reboot: "pid-reused", gone_with_identity: "pid-gone"}
    assert [(a.action, a.task_id) for a in actions if a.action != "session_lost"] == [("released", tid)]
    state = {r["id"]: (r["state"], r["end_reason"]) for r in fleet.sql("select * from fleet.sessions")}
    assert state == {reused: ("lost", "pid-reused"), gone_here: ("lost", "pid-gone"),
                     same: ("active", None), no_start: ("active", None), gone_elsewhere: ("active", None),
                     stepped: ("active", None), started_later: ("lost", "pid-reused"),
                     before_a_reboot: ("lost", "pid-reused"), gone_with_identity: ("lost", "pid-gone")}
    (t,) = fleet.tasks([tid])
    assert (t["state"], t["evaporations"]) == ("queued", 1)
    assert host_checks(store) == []


# ------------------------------------------------------------------------------------------------
# fleet monitor


def test_fleet_monitor_json_and_refusals(make_fleet):
    # a short lease: a lease counts as expired only once the server has been up that long (the
    # supabase stack was started seconds ago); the session outlives the test
    fleet = make_fleet({"docs": lane(lease_seconds=3, session_timeout_seconds=600)})
    wait_for("the server to be up a lease", lambda: fleet.sql(
        "select pg_postmaster_start_time() < now() - interval '3 s' as up")[0]["up"])
    (tid,) = fleet.enqueue("docs", 1, {})
    s = fleet.worker.open_session("docs", "another-host", 4242, None, 600)
    fleet.worker.claim(s, 1)
    with psycopg.connect(fleet.db_url, autocommit=True) as c:
        expire(c, tid)  # the shift silent for its 3 s lease and a second, not for its 600 s timeout

    refused = fleet.cli("monitor", "--once", "--every", "1s")
    assert refused.returncode == 1
    assert refused.stdout == ""
    err = refused.stderr.strip()
    assert len(err.splitlines()) == 1 and "--once" in err and "--every" in err, err
    assert "Traceback" not in refused.stderr
    assert fleet.states([tid]) == ["running"]  # refused before any pass

    out = fleet.cli("monitor", "--json")
    assert out.returncode == 0, out.stderr
    actions = json.loads(out.stdout)
    assert [(a["action"], a["task_id"], a["detail"]["reason"]) for a in actions] == \
        [("released", tid, "lease-expired")]
    assert actions[0]["session_id"] == str(s) and actions[0]["lane"] == "docs"
    assert fleet.states([tid]) == ["queued"]

    plain = fleet.cli("monitor")
    assert plain.returncode == 0 and "nothing to repair" in plain.stdout


# ------------------------------------------------------------------------------------------------
# fleet run


def run_env(fleet: Fleet) -> dict[str, str]:
    """`fleet run`'s environment: on supabase an operator key for its monitor passes and a worker
    key (FLEET_WORKER_KEY) for the shifts it launches."""
    env = fleet.env("operator")
    if fleet.worker_key is not None:
        env["FLEET_WORKER_KEY"] = fleet.worker_key
    return env


def test_fleet_run_launches_shifts_on_cron_and_never_past_max_shifts(make_fleet):
    """Two `fleet run` in one directory (a restart that overlapped, a second operator): between
    them a lane still runs no more than max_shifts shifts at once (they share its slot locks)."""
    fleet = make_fleet(
        # short shifts (about 2 s of work): a lane's next shift may start only after the last ended
        {name: lane(cron="*/2 * * * * *", max_shifts=1, shift_minutes=0.03, max_running=2)
         for name in ("docs", "bugfix")},
        monitor_every="2s",
    )
    ids = fleet.enqueue("docs", 1, HANG) + fleet.enqueue("bugfix", 1, HANG)
    runs = []
    for i in range(2):
        err = (fleet.tmp / f"run{i}.err").open("wb")
        runs.append(subprocess.Popen([sys.executable, "-m", "monitor.cli", "run"], cwd=ROOT, env=run_env(fleet),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err))
        err.close()
        fleet.procs.append(runs[-1])

    def second_shifts_at_work() -> bool:
        per_lane = fleet.sql("select lane, count(*) as n from fleet.sessions group by lane")
        running = fleet.sql("select count(*) as n from fleet.tasks where state = 'running'")[0]["n"]
        return len(per_lane) == 2 and sum(r["n"] for r in per_lane) >= 3 and running >= 1

    # a few seconds on a quiet machine; SIGTERM while a shift has a task running
    wait_for("a shift in each lane and a second one", second_shifts_at_work, timeout=40, every=0.1)
    for run in runs:
        run.send_signal(signal.SIGTERM)
    summaries = []
    for i, run in enumerate(runs):
        out, _ = run.communicate(timeout=40)
        assert run.returncode == 0, (fleet.tmp / f"run{i}.err").read_text()[-3000:]
        summaries.append(json.loads(out.decode().strip().splitlines()[-1]))

    sessions = fleet.sql("select * from fleet.sessions order by lane, started_at")
    for name in ("docs", "bugfix"):
        mine = [s for s in sessions if s["lane"] == name]
        assert 1 <= len(mine) <= sum(s["launched"].get(name, 0) for s in summaries), (summaries, mine)
        assert {s["max_concurrent"].get(name, 1) for s in summaries} == {1}, summaries
        assert {s["end_reason"] for s in mine} <= {"deadline", "SIGTERM"}, mine
        # never two shifts of a lane at once, of either run: each one ended before the next started
        for before, after in pairwise(mine):
            assert before["ended_at"] <= after["started_at"], (before, after)
    assert len(sessions) >= 3
    assert {s["end_reason"] for s in sessions} == {"deadline", "SIGTERM"}
    # every shift ended cleanly and wrote its lane hand-off; none was lost
    assert {s["state"] for s in sessions} == {"ended"}, [(s["state"], s["end_reason"]) for s in sessions]
    assert fleet.sql("select count(*) as n from fleet.lane_handoffs")[0]["n"] == len(sessions)
    # the running tasks were handed off (at each deadline and at SIGTERM), not lost
    for t in fleet.tasks(ids):
        assert t["state"] == "queued" and t["handoffs"] >= 1 and t["evaporations"] == 0, t
    assert sum(t["handoffs"] for t in fleet.tasks(ids)) >= 2
    outcomes = {r["outcome"] for r in fleet.sql("select outcome from fleet.runs")}
    assert outcomes == {"handed_off"}, outcomes
    assert fleet.sql("select count(*) as n from fleet.journal where kind = 'repaired'")[0]["n"] == 0
    assert not pids_under(fleet.tmp / "ws"), "an agent outlived fleet run"


def test_fleet_run_for_a_duration(make_fleet):
    fleet = make_fleet({"docs": lane(cron="0 0 1 1 *"), "review": lane()})  # never due during the test
    # ready work in a lane without shifts: its monitor pass finds idle capacity at once
    fleet.enqueue("review", 1, {})
    started = time.monotonic()
    done = fleet.cli("run", "--for", "3s", env={**run_env(fleet), "FLEET_FLEET__IDLE_ALERT_SECONDS": "1s",
                                                "FLEET_FLEET__MONITOR_EVERY": "1s"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"launched": {}, "max_concurrent": {}}
    # what the monitor found is logged, a line each (JSON lines: stderr is no terminal here); the
    # idle capacity lasts every pass (one a second, and the last at the end), and is logged once
    found = [json.loads(line) for line in done.stderr.splitlines() if '"monitor: ' in line]
    assert [(f["event"], f["lane"]) for f in found] == [("monitor: idle_capacity", "review")], done.stderr[-2000:]
    assert found[0]["detail"]["ready"] == 1, found
    # it says when each lane's next shift starts, and which lanes it will never start
    said = " ".join(done.stdout.split())
    assert f"next shifts: docs at {datetime.now(UTC).year + 1}-01-01T00:00:00Z" in said, said
    assert "no cron, not scheduled: review" in said, said
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("backend", ["supabase"], indirect=True)
def test_fleet_run_and_monitor_on_supabase_refuse_keys_of_the_wrong_role(make_fleet):
    fleet = make_fleet({"docs": lane(cron="*/2 * * * * *")})
    env = fleet.env("operator")
    missing = fleet.cli("run", "--for", "1s", env=env)
    env["FLEET_WORKER_KEY"] = fleet.operator_key
    wrong = fleet.cli("run", "--for", "1s", env=env)

    assert missing.returncode == 1 and "FLEET_WORKER_KEY" in missing.stderr, missing.stderr
    assert "Traceback" not in missing.stderr
    assert wrong.returncode == 1 and "'fleet_operator', not fleet_worker" in wrong.stderr, wrong.stderr
    # and a worker key where the monitor's operator key goes: refused before anything runs
    for command in (["run", "--for", "1s"], ["monitor", "--once"]):
        as_worker = fleet.cli(*command, env={**run_env(fleet), "FLEET_SUPABASE__KEY": fleet.worker_key})
        assert as_worker.returncode == 1, as_worker
        assert f"`fleet {command[0]}` on the supabase store needs an operator key" in as_worker.stderr
        assert "role 'fleet_worker'" in as_worker.stderr and "Traceback" not in as_worker.stderr, as_worker.stderr
    # an operator key may not write lanes over the API: said with the way that works
    env = {k: v for k, v in fleet.env("operator").items() if k != "DATABASE_URL"}
    synced = fleet.cli("lanes", "sync", env=env)
    assert synced.returncode == 1 and "permission denied for function sync_" in synced.stderr, synced.stderr
    assert "with DATABASE_URL set to the project's connection string" in synced.stderr, synced.stderr
    assert fleet.sql("select count(*) as n from fleet.sessions")[0]["n"] == 0


# ------------------------------------------------------------------------------------------------
# fleet crontab


def test_fleet_crontab(make_fleet):
    fleet = make_fleet({
        "docs": lane(cron="*/10 * * * *", max_shifts=2),
        "bugfix": lane(cron="30 */2 * * * *"),  # with a seconds field
        "review": lane(),  # no cron: not scheduled
    }, monitor_every="2m")

    out = fleet.cli("crontab")

    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    jobs = [ln for ln in lines if not ln.startswith("#") and "=" not in ln.split()[0]]
    shift_lines = {ln.split("--lane ")[1].split(";")[0].split()[0]: ln for ln in jobs if " shift " in ln}
    assert set(shift_lines) == {"docs", "bugfix"}
    monitor_lines = [ln for ln in jobs if " monitor " in ln]
    assert len(monitor_lines) == 1 and len(jobs) == 3
    assert any(ln.startswith("#") and "review" in ln for ln in lines)

    assert shift_lines["docs"].split()[:5] == ["*/10", "*", "*", "*", "*"]
    assert shift_lines["bugfix"].split()[:5] == ["*/2", "*", "*", "*", "*"]
    assert monitor_lines[0].split()[:5] == ["*/2", "*", "*", "*", "*"]
    assert shift_lines["docs"].count("flock -n") == 2 and shift_lines["bugfix"].count("flock -n") == 1
    assert "flock -n" in monitor_lines[0] and "monitor --once" in monitor_lines[0]
    for ln in jobs:
        cron_trigger(" ".join(ln.split()[:5]))  # valid cron fields
        command = ln.split(None, 5)[5]
        words = shlex.split(command.replace("{", " ").replace("}", " ").replace(";", " ").replace("||", " "))
        fleet_bins = [w for w in words if w.endswith("/fleet")]
        assert fleet_bins, ln
        for b in fleet_bins:
            assert os.path.isabs(b) and os.access(b, os.X_OK), b
        assert str(fleet.toml.resolve()) in words, ln
        assert f"cd {fleet.toml.parent.resolve()}" in ln or f"cd {shlex.quote(str(fleet.toml.parent.resolve()))}" in ln
        syntax = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert syntax.returncode == 0, (ln, syntax.stderr)
        assert fleet.db_url not in ln  # no credentials in a crontab
    # distinct lock files per shift slot
    locks = [w for w in shlex.split(shift_lines["docs"].split(None, 5)[5].replace(";", " ").replace("||", " "))
             if w.endswith(".lock")]
    assert len(set(locks)) == 2 and all(os.path.isabs(x) for x in locks)
    # the database (and on supabase the store and key) came from this environment, which cron does not
    # pass: said, by name only, on stderr and in the crontab
    warned = [ln for ln in lines if ln.startswith("# warning")]
    assert len(warned) == 1 and "DATABASE_URL" in warned[0], lines
    assert "DATABASE_URL" in out.stderr and "cron does not pass" in out.stderr, out.stderr
    for value in fleet.env("operator").values():
        if len(value) > 20 and "/" not in value.strip("/"):  # keys and URLs: never printed
            assert value not in out.stdout


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)  # the lines are the same on both
def test_crontab_lines_run_as_cron_runs_them_on_a_fresh_host(make_fleet):
    """Each job's command as cron hands it to bash (its escaped % unescaped), with a lock folder that
    does not exist yet and has a % in its path: the folder is made, its owner's alone; a shift takes
    the first free slot; a lane whose slots are all held starts none; a shift that fails is not
    followed by one in the next slot."""
    fleet = make_fleet({"docs": lane(cron="*/10 * * * *", max_shifts=2, shift_minutes=0.02)})
    folder = fleet.tmp / "100% fresh" / "cron"
    # (the folder as a config names it: [fleet] cron_dir, which fleet run and fleet up use too)
    fleet.toml.write_text(fleet.toml.read_text().replace("[fleet]\n", f"[fleet]\ncron_dir = {json.dumps(str(folder))}\n", 1))
    out = fleet.cli("crontab")
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln and not ln.startswith("#") and "=" not in ln.split()[0]]
    assert all(re.search(r"(?<!\\)%", ln) is None for ln in lines), lines  # cron would cut the command there
    jobs = {("shift" if " shift " in ln else "monitor"): ln.split(None, 5)[5].replace("\\%", "%") for ln in lines}
    holders: list[subprocess.Popen[bytes]] = []

    def run(command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", command], env=env or fleet.env("worker"), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=60)

    def hold(slot: int) -> None:  # a shift of the lane that cron started earlier
        # (-w, not -n: the probe below holds the lock for a moment, and may come first)
        lock = str(folder / f"shift-docs-{slot}.lock")
        holders.append(subprocess.Popen(["flock", "-w", "10", lock, "sleep", "60"], start_new_session=True))
        wait_for(f"slot {slot} held", lambda: subprocess.run(["flock", "-n", lock, "true"]).returncode != 0)

    def sessions() -> list[dict[str, Any]]:
        return fleet.sql("select * from fleet.sessions where lane = 'docs' order by id")

    try:
        monitor = run(jobs["monitor"], fleet.env("operator"))
        assert monitor.returncode == 0 and not monitor.stdout and not monitor.stderr, monitor
        assert (folder / "monitor.log").exists() and folder.stat().st_mode & 0o777 == 0o700
        hold(0)
        assert run(jobs["shift"]).returncode == 0
        assert [s["end_reason"] for s in sessions()] == ["deadline"]  # in slot 1
        hold(1)
        assert run(jobs["shift"]).returncode == SLOT_HELD
        assert len(sessions()) == 1
        for holder in holders:
            os.killpg(holder.pid, signal.SIGKILL)  # flock and its sleep: the groups this test started
            holder.wait()
        holders.clear()
        (folder / "shift-docs.log").unlink()
        env = {**fleet.env("worker"), "DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/lanefleet_no_such_db"}
        assert run(jobs["shift"], env).returncode == 0  # the shift's 1: not a held slot, no second shift
        log = (folder / "shift-docs.log").read_text()
        assert "lanefleet_no_such_db" in log and len(log.strip().splitlines()) == 1, log  # one shift's one line
    finally:
        for holder in holders:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()


def test_fleet_crontab_is_quiet_when_the_config_file_says_it_all(make_fleet, tmp_path):
    fleet = make_fleet({"docs": lane(cron="*/10 * * * *")})
    env = {k: v for k, v in fleet.env("operator").items()
           if k not in {"DATABASE_URL", "SUPABASE_URL", "SUPABASE_ANON_KEY", "FLEET_KEY", "FLEET_WORKER_KEY"}
           and not (k.startswith("FLEET_") and "__" in k) and not k.startswith("PG")}
    out = fleet.cli("crontab", env=env)
    assert out.returncode == 0, out.stderr
    assert "warning" not in out.stdout and "warning" not in out.stderr


def test_every_launcher_takes_its_slots_in_the_one_folder_the_config_names(tmp_path):
    """[fleet] cron_dir, relative to the config's folder, else <home>/cron: the folder of the
    crontab's lines is the one fleet run and fleet up lock in (default_lock_dir)."""
    from monitor.host import crontab_lines, default_lock_dir

    lanes = {"docs": lane(cron="*/10 * * * *", max_shifts=1)}
    cfg = load_config(write_config(tmp_path, lanes), environ={})
    assert default_lock_dir(cfg) == (tmp_path / "home" / "cron").resolve()
    toml = write_config(tmp_path, lanes, cron_dir="locks")
    cfg = load_config(toml, environ={})
    assert default_lock_dir(cfg) == (tmp_path / "locks").resolve()
    lines = crontab_lines(cfg, fleet_bin="/usr/local/bin/fleet", workdir=tmp_path, config=toml,
                          lock_dir=default_lock_dir(cfg))
    assert all(str(tmp_path / "locks" / "shift-docs.log") in ln for ln in lines if " shift " in ln), lines


def test_a_launched_shift_holds_the_slot_the_crontabs_flock_guard_takes(tmp_path):
    """`fleet run` and the crontab of one directory share a lane's slots, both ways: the lock file
    is the one in the crontab's line, read from it."""
    from monitor.host import ShiftLauncher, crontab_lines, default_lock_dir

    toml = write_config(tmp_path, {"docs": lane(cron="*/10 * * * *", max_shifts=1)})
    cfg = load_config(toml, environ={})
    folder = default_lock_dir(cfg)
    (line,) = [ln for ln in crontab_lines(cfg, fleet_bin="/usr/local/bin/fleet", workdir=tmp_path, config=toml,
                                          lock_dir=folder) if " shift " in ln]
    (slot,) = [w for w in shlex.split(line.split(None, 5)[5].replace(";", " ")) if w.endswith(".lock")]

    class Sleepers(ShiftLauncher):
        """The slot accounting under test, not the shift: a process that lives until it is stopped."""

        def command(self, lane: str, extra: list[str] | None = None) -> list[str]:
            return [sys.executable, "-c", "import time; time.sleep(60)"]

    def guard_gets_the_slot() -> bool:  # what the crontab's line runs before its shift
        return subprocess.run(["flock", "-n", slot, "true"]).returncode == 0

    first, second = Sleepers(cfg, dict(os.environ), lock_dir=folder), Sleepers(cfg, dict(os.environ), lock_dir=folder)
    held = None
    try:
        shift = first.launch("docs")
        assert shift is not None
        # the folder it made is its owner's alone, as the crontab's lines make it (their logs go there)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert not guard_gets_the_slot(), "cron would start a second shift beside fleet run's"
        assert second.launch("docs") is None and second.count("docs") == 0
        shift.kill()  # however the shift ends, the kernel lets go of its slot
        shift.wait()
        assert guard_gets_the_slot()
        # and the other way: a shift cron started holds the slot against fleet run
        # (-w, not -n: the guard's probe holds the lock for a moment, and may come first)
        held = subprocess.Popen(["flock", "-w", "10", slot, "sleep", "60"], start_new_session=True)
        wait_for("cron's shift holding the slot", lambda: not guard_gets_the_slot())
        assert second.launch("docs") is None
        os.killpg(held.pid, signal.SIGKILL)  # flock and its sleep: the group this test started
        held.wait()
        wait_for("the slot free again", guard_gets_the_slot)
        assert second.launch("docs") is not None
    finally:
        first.stop_all(grace=5)
        second.stop_all(grace=5)
        if held is not None and held.poll() is None:
            os.killpg(held.pid, signal.SIGKILL)
            held.wait()


@pytest.mark.parametrize(("every", "fields"), [("30s", "*/1 * * * *"), ("5m", "*/5 * * * *"),
                                               ("2h", "0 */2 * * *"), ("1d", "0 0 * * *")])
def test_crontab_monitor_schedule(tmp_path, every, fields):
    from monitor.host import crontab_lines

    toml = write_config(tmp_path, {"docs": lane(cron="*/10 * * * *")}, monitor_every=every)
    cfg = load_config(toml, environ={})
    lines = crontab_lines(cfg, fleet_bin="/usr/local/bin/fleet", workdir=tmp_path, config=toml,
                          lock_dir=tmp_path / "cron")
    (mon,) = [ln for ln in lines if " monitor " in ln]
    assert " ".join(mon.split()[:5]) == fields, mon


def test_a_finding_of_fleet_up_is_one_short_line():
    from monitor.cli.run import finding
    from worker.models import RepairAction

    released = RepairAction(action="released", lane="docs", task_id=4, session_id=None,
                            detail={"reason": "lease-expired", "state": "queued"})
    assert finding(released) == "monitor: released, lane docs, task 4 (lease-expired)"
    idle = RepairAction(action="idle_capacity", lane="review", task_id=None, session_id=None, detail={"ready": 2})
    assert finding(idle) == "monitor: idle_capacity, lane review"


def test_a_long_running_command_says_each_repair_and_a_lasting_state_when_it_begins():
    from monitor.cli.run import Findings
    from worker.models import RepairAction

    def act(action: str, task: int | None = None, **detail: object) -> RepairAction:
        return RepairAction(action=action, lane="docs", task_id=task, session_id=None, detail=detail)

    said = Findings()
    stall, idle = act("stalled", 4, quiet_seconds=400.0), act("idle_capacity", ready=2)
    assert said.new([stall, idle, act("released", 5)]) == [stall, idle, act("released", 5)]
    # the next pass finds the same states (their figures moved on) and releases task 5 again
    later = act("stalled", 4, quiet_seconds=430.0)
    assert said.new([later, act("idle_capacity", ready=3), act("released", 5)]) == [act("released", 5)]
    # another task's stall is another state; the idle capacity ended
    other = act("stalled", 6, quiet_seconds=300.0)
    assert said.new([later, other]) == [other]
    # a state back after a pass without it is said again
    assert said.new([later]) == []
    assert said.new([]) == []
    assert said.new([idle, later]) == [idle, later]
    # a workspace or a source it names is part of what the state is
    ws1, ws2 = act("workspace_refused", workspace=1), act("workspace_refused", workspace=2)
    assert said.new([ws1]) == [ws1]
    assert said.new([ws1, ws2]) == [ws2]
