"""Fenced side effects: ``fleet guard -- CMD`` runs CMD only while the task's lease holds, asked of
the database at that moment through the shift, for longer than the question took; else CMD never
runs and the guard exits 77 (not yours any more) or 75 (could not confirm now: retry).

The end-to-end tests run a real shift (both back-ends) whose agent, a small script written into the
test's folder, calls ``fleet guard`` the way an agent would — found on its PATH, which the test
strips of lanefleet's virtualenv so that only what the shift provides can make it work. The lease is
then repaired away while the agent still runs, and the agent's next guarded command is refused.
(fleet.lease_held itself, and its security: tests/sql/test_lease.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from fleetkit import ROOT, Backend, Fleet, lane_defaults, wait_for

from worker.errors import DatabaseUnavailable
from worker.models import LeaseAnswer
from worker.shift import guard_client as guard_mod
from worker.shift.guard import GuardServer, private_run_dir, sweep_stale
from worker.shift.guard_client import EX_NOPERM, EX_TEMPFAIL, ask, verdict
from worker.shift.shift import Shift, ShiftSummary

# The scripted agent: two guarded commands while the lease holds (one exits 0, one exits 3), then it
# waits for the test to repair the lease away and tries a third. Each guarded command writes its
# marker; what `fleet guard` returned is kept in guard-<n>.json.
AGENT = r'''
import json, os, subprocess, sys, time
from pathlib import Path

task = json.loads(Path(".fleet/task.json").read_text())
out = Path(task["payload"]["dir"])
keep = ("FLEET_GUARD_SOCKET", "FLEET_LEASE_TOKEN", "FLEET_BIN", "FLEET_TASK_ID", "PATH")
(out / "env.json").write_text(json.dumps({k: os.environ.get(k) for k in keep}))


def guarded(n, code):
    marker = out / f"marker-{n}"
    cmd = ["fleet", "guard", "--", sys.executable, "-c",
           f"import pathlib, sys; pathlib.Path({str(marker)!r}).write_text('x'); print('cmd {n} ran'); sys.exit({code})"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        got = {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
    except OSError as exc:  # `fleet` is not on this PATH
        got = {"rc": None, "stdout": "", "stderr": repr(exc)}
    (out / f"guard-{n}.json").write_text(json.dumps(got))


guarded(1, 0)
guarded(2, 3)
(out / "phase1").write_text("done")
deadline = time.monotonic() + 90
while not (out / "go").exists():
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(0.02)
guarded(3, 0)
(out / "phase2").write_text("done")
'''


def run_in_thread(shift: Shift) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["summary"] = shift.run()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


def joined(t: threading.Thread, out: dict[str, Any], timeout: float = 60) -> ShiftSummary:
    t.join(timeout)
    assert not t.is_alive(), "the shift did not end"
    if "error" in out:
        raise out["error"]
    return out["summary"]


def result(out: Path, n: int) -> dict[str, Any]:
    return json.loads((out / f"guard-{n}.json").read_text())


def bare_env(**fleet: str) -> dict[str, str]:
    """This process's environment without any FLEET_* (or database) variable, plus ``fleet``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") and k != "DATABASE_URL"}
    env.update(fleet)
    return env


def fleet_guard(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "monitor.cli", "guard", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def write_marker(path: Path, code: int = 0) -> list[str]:
    """A command that writes ``path``, prints a line and exits ``code``."""
    return [sys.executable, "-c",
            f"import pathlib, sys; pathlib.Path({str(path)!r}).write_text('x'); print('ran'); sys.exit({code})"]


# -- 1. through a real shift


REPAIRS = {
    # how the lease is taken away while the agent runs → (exit code, what the refusal must say)
    "cancelled": (EX_NOPERM, "the task is cancelled now"),
    "session-lost": (EX_NOPERM, "the task is queued now"),  # the monitor's repair: back to the queue
    # run out by the database's clock, not repaired yet: the shift could still renew it
    "expired": (EX_TEMPFAIL, "the lease ran out and its shift has not renewed it yet"),
}


@pytest.mark.parametrize("repair", list(REPAIRS))
def test_guard_runs_the_command_while_the_lease_holds_and_refuses_after_it_is_repaired_away(
        backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, repair: str) -> None:
    script = tmp_path / "guarded_agent.py"
    script.write_text(AGENT)
    out = tmp_path / "out"
    out.mkdir()
    # a long lease: no heartbeat (every 20 s) notices the repair and kills the agent before it asks
    f = Fleet(backend, tmp_path, {"work": lane_defaults(command=["python", str(script), "{prompt_file}"],
                                                        lease_seconds=60)})
    # the agent's PATH has no lanefleet on it: `fleet` is found only through what the shift adds
    bare = os.pathsep.join(p for p in ("/usr/local/bin", "/usr/bin", "/bin") if Path(p).is_dir())
    assert shutil.which("fleet", path=bare) is None
    monkeypatch.setenv("PATH", bare)
    try:
        task_id = f.enqueue("work", "guarded:1", {"dir": str(out)})
        shift = f.shift("work", max_tasks=1, max_seconds=90)
        if repair == "expired":  # its claim renews the lease, no heartbeat after the test ages it
            shift._heartbeat = lambda: None  # type: ignore[method-assign]
        thread, res = run_in_thread(shift)
        wait_for("the agent's guarded commands", lambda: (out / "phase1").exists() or not thread.is_alive(),
                 timeout=60)

        env = json.loads((out / "env.json").read_text())
        sock = Path(env["FLEET_GUARD_SOCKET"])
        assert len(str(sock)) < 108 and stat.S_ISSOCK(sock.stat().st_mode)
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert env["FLEET_LEASE_TOKEN"] == str(f.task(task_id)["lease_token"])
        assert os.access(env["FLEET_BIN"], os.X_OK)
        assert env["PATH"].endswith(os.pathsep + bare)

        first, second = result(out, 1), result(out, 2)
        assert first["rc"] == 0, first
        assert (out / "marker-1").exists()
        assert (second["rc"], second["stdout"]) == (3, "cmd 2 ran\n"), second  # CMD's exit code and output
        assert (out / "marker-2").exists()

        if repair == "cancelled":
            assert f.monitor_store.cancel(task_id) == "cancelled"
        elif repair == "session-lost":
            f.sql("select * from fleet.declare_session_lost(%s, 'test: the host vanished')", (shift.session,))
            assert f.task(task_id)["state"] == "queued"
        else:
            # the lease follows the session: its last heartbeat a lease and a second ago
            f.sql("update fleet.sessions set heartbeat_at = now() - interval '61 seconds' where id = %s",
                  (shift.session,))
        (out / "go").write_text("go")
        wait_for("the agent's guarded command after the repair", lambda: (out / "phase2").exists(), timeout=60)
        third = result(out, 3)
        code, says = REPAIRS[repair]
        assert third["rc"] == code, third
        assert not (out / "marker-3").exists()
        assert f"task {task_id} (guarded:1)" in third["stderr"], third["stderr"]
        assert says in third["stderr"], third["stderr"]
        assert f"not run (exit {code})" in third["stderr"] and third["stderr"].count("\n") == 1
        assert third["stdout"] == ""

        summary = joined(thread, res)
        assert summary.claimed == 1
        assert not sock.exists() and not sock.parent.exists()  # the shift took its socket away
    finally:
        f.close()


# -- 2. the agent's side without a shift


def test_outside_a_task_or_without_a_shift_guard_refuses_with_77(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    cmd = ["--", *write_marker(marker)]
    token = str(uuid.uuid4())

    p = fleet_guard(*cmd, env=bare_env())
    assert p.returncode == EX_NOPERM
    assert "not inside a fleet task" in p.stderr and "not run (exit 77)" in p.stderr

    p = fleet_guard(*cmd, env=bare_env(FLEET_TASK_ID="41", FLEET_LEASE_TOKEN=token,
                                       FLEET_GUARD_SOCKET=str(tmp_path / "no.sock")))
    assert p.returncode == EX_NOPERM
    assert "task 41: the shift is gone" in p.stderr, p.stderr

    p = fleet_guard(*cmd, env=bare_env(FLEET_TASK_ID="41", FLEET_TASK_KEY="issue:41", FLEET_LEASE_TOKEN=token))
    assert p.returncode == EX_NOPERM
    assert "task 41 (issue:41): the shift is gone or runs no guard" in p.stderr, p.stderr

    p = fleet_guard("--quiet", *cmd, env=bare_env())
    assert (p.returncode, p.stderr) == (EX_NOPERM, "")
    assert not marker.exists()


HELD = LeaseAnswer(True, "running", 30.0, True)


class FakeStore:
    """lease_held answers what the test says (or raises it), after ``delay`` seconds; every call is
    recorded."""

    def __init__(self, answer: Any, delay: float = 0.0) -> None:
        self.answer = answer
        self.delay = delay
        self.calls: list[tuple[int, uuid.UUID]] = []

    def lease_held(self, task: int, token: uuid.UUID) -> LeaseAnswer:
        self.calls.append((task, token))
        time.sleep(self.delay)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer  # type: ignore[no-any-return]


@pytest.fixture
def deep_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary directory far too deep for an AF_UNIX socket path."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    return deep


def test_guard_server_socket_is_private_short_and_removed_on_stop(deep_tmp: Path) -> None:
    assert tempfile.gettempdir() == str(deep_tmp)
    server = GuardServer(FakeStore(HELD))  # type: ignore[arg-type]
    server.start()
    try:
        assert server.running and server.socket_path is not None
        sock = server.socket_path
        assert len(str(sock)) <= 100 and not str(sock).startswith(str(deep_tmp))
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
        env = server.agent_env(1, uuid.UUID(int=7), "/usr/bin")
        assert env["FLEET_GUARD_SOCKET"] == str(sock)
        assert env["FLEET_LEASE_TOKEN"] == str(uuid.UUID(int=7))
        assert env["PATH"] == f"{sock.parent / 'bin'}{os.pathsep}/usr/bin"
        assert server.agent_env(None, None, None)["PATH"] == f"{sock.parent / 'bin'}{os.pathsep}{os.defpath}"
        assert os.path.realpath(sock.parent / "bin" / "fleet") == os.path.realpath(env["FLEET_BIN"])
        assert ask(str(sock), 1, str(uuid.UUID(int=7)), 5) == {"held": True, "state": "running", "valid_for": 30.0,
                                                              "token_matches": True, "error": None}
    finally:
        server.stop()
    assert not sock.exists() and not sock.parent.exists()
    assert server.agent_env(None, None, None)["FLEET_GUARD_SOCKET"] == ""
    server.stop()  # idempotent


def test_guard_passes_the_command_through_when_held(tmp_path: Path) -> None:
    store = FakeStore(HELD)
    server = GuardServer(store, tmp_path / "g.sock")  # type: ignore[arg-type]
    server.start()
    try:
        marker, token = tmp_path / "marker", uuid.uuid4()
        server.agent_env(9, token, None)
        env = bare_env(FLEET_TASK_ID="9", FLEET_LEASE_TOKEN=str(token), FLEET_GUARD_SOCKET=str(tmp_path / "g.sock"))
        p = fleet_guard("--", *write_marker(marker, 3), env=env)
        assert (p.returncode, p.stdout, p.stderr) == (3, "ran\n", "")
        assert marker.exists()
        assert store.calls == [(9, token)]
        # options end at CMD: `-c` and what follows are the command's
        p = fleet_guard(sys.executable, "-c", "import sys; print(sys.argv[1:]); sys.exit(5)", "-q", "--x",
                        env=env)
        assert (p.returncode, p.stdout) == (5, "['-q', '--x']\n"), p.stderr
        q = subprocess.run([sys.executable, "-m", "monitor.cli", "guard", "--", sys.executable, "-c",
                            "import sys; print(sys.stdin.read().upper())"],
                           cwd=ROOT, env=env, input="from stdin", capture_output=True, text=True, timeout=60)
        assert (q.returncode, q.stdout) == (0, "FROM STDIN\n")
        p = fleet_guard("--", "no-such-command-anywhere", env=env)
        assert p.returncode == 127 and "command not found" in p.stderr
    finally:
        server.stop()
    assert not (tmp_path / "g.sock").exists()
    p = fleet_guard("--", *write_marker(tmp_path / "late"), env=env)
    assert p.returncode == EX_NOPERM and "task 9: the shift is gone" in p.stderr
    assert not (tmp_path / "late").exists()


@pytest.mark.parametrize(("answer", "code", "says"), [
    (DatabaseUnavailable("the database is unreachable: connection refused"), EX_TEMPFAIL,
     "the lease could not be confirmed now (the database is unreachable: connection refused); retry"),
    (LeaseAnswer(False, "running", 0.0, False), EX_NOPERM,
     "lease lost: its lease was repaired and another worker holds the task now"),
    (LeaseAnswer(False, "running", 0.0, True), EX_TEMPFAIL,
     "the lease ran out and its shift has not renewed it yet"),
    (LeaseAnswer(False, "done", 0.0, False), EX_NOPERM, "lease lost: the task is done now"),
    (LeaseAnswer(False, "unknown", 0.0, False), EX_NOPERM, "lease lost: the task no longer exists"),
])
def test_guard_refuses_when_not_held_or_unknown(tmp_path: Path, answer: Any, code: int, says: str) -> None:
    server = GuardServer(FakeStore(answer), tmp_path / "g.sock")  # type: ignore[arg-type]
    server.start()
    try:
        marker, token = tmp_path / "marker", uuid.uuid4()
        server.agent_env(12, token, None)
        env = bare_env(FLEET_TASK_ID="12", FLEET_LEASE_TOKEN=str(token), FLEET_GUARD_SOCKET=str(tmp_path / "g.sock"))
        p = fleet_guard("--", *write_marker(marker), env=env)
        assert p.returncode == code
        assert p.stderr.startswith(f"fleet guard: task 12: {says}"), p.stderr
        assert p.stderr.endswith(f"not run (exit {code})\n"), p.stderr
        assert not marker.exists()
    finally:
        server.stop()


def test_guard_answers_only_for_the_leases_its_shift_gave_and_asks_nothing_else(tmp_path: Path) -> None:
    # an agent holding task 12's lease asks of another task, or of task 12 under another token: the
    # guard says nothing of them (the database is not asked) and the command is not run
    store = FakeStore(LeaseAnswer(False, "done", 0.0, False))
    server = GuardServer(store, tmp_path / "g.sock")  # type: ignore[arg-type]
    server.start()
    try:
        mine, other = uuid.uuid4(), uuid.uuid4()
        server.agent_env(12, mine, None)
        server.agent_env(13, other, None)  # another agent's lease of this shift
        marker = tmp_path / "marker"
        for task, token in (("13", mine), ("12", other), ("14", mine), ("12", uuid.uuid4())):
            env = bare_env(FLEET_TASK_ID=task, FLEET_LEASE_TOKEN=str(token), FLEET_GUARD_SOCKET=str(tmp_path / "g.sock"))
            p = fleet_guard("--", *write_marker(marker), env=env)
            assert p.returncode == EX_NOPERM, (task, p.stderr)
            assert p.stderr.startswith(f"fleet guard: task {task}: this shift gave no lease of this task under "
                                       "that token"), p.stderr
            answer = ask(str(tmp_path / "g.sock"), int(task), str(token), 5)
            assert answer == {"held": False, "state": "not_given", "valid_for": 0.0, "token_matches": False,
                              "error": None}
        assert store.calls == [] and not marker.exists()
        p = fleet_guard("--", *write_marker(marker), env=bare_env(
            FLEET_TASK_ID="12", FLEET_LEASE_TOKEN=str(mine), FLEET_GUARD_SOCKET=str(tmp_path / "g.sock")))
        assert p.returncode == EX_NOPERM and "lease lost: the task is done now" in p.stderr
        assert store.calls == [(12, mine)]
    finally:
        server.stop()


def test_an_answer_slower_than_the_lease_it_vouches_for_is_not_acted_on(tmp_path: Path) -> None:
    # held, 1.5 s left when the database answered; the answer took 2 s to arrive: stale
    server = GuardServer(FakeStore(LeaseAnswer(True, "running", 1.5, True), delay=2.0), tmp_path / "g.sock")  # type: ignore[arg-type]
    server.start()
    try:
        marker, token = tmp_path / "marker", uuid.uuid4()
        server.agent_env(12, token, None)
        env = bare_env(FLEET_TASK_ID="12", FLEET_LEASE_TOKEN=str(token), FLEET_GUARD_SOCKET=str(tmp_path / "g.sock"))
        p = fleet_guard("--", *write_marker(marker), env=env)
        assert p.returncode == EX_TEMPFAIL, p.stderr
        assert "longer than the 1.5 s the lease held for when it was given: it is stale; retry" in p.stderr
        assert not marker.exists()
        # the same answer given at once is acted on
        server.store = FakeStore(LeaseAnswer(True, "running", 1.5, True))  # type: ignore[assignment]
        p = fleet_guard("--", *write_marker(marker), env=env)
        assert (p.returncode, p.stdout) == (0, "ran\n"), p.stderr
    finally:
        server.stop()


@pytest.mark.parametrize(("valid_for", "round_trip", "runs"), [
    (10.0, 0.01, True), (10.0, 9.99, True), (10.0, 10.0, False), (10.0, 15.0, False), (0.0, 0.0, False),
])
def test_the_validity_arithmetic(valid_for: float, round_trip: float, runs: bool) -> None:
    answer = {"held": True, "state": "running", "valid_for": valid_for, "token_matches": True, "error": None}
    code, why = verdict(answer, round_trip)
    assert (code is None) is runs, why
    if not runs:
        assert code == EX_TEMPFAIL and "stale" in why


def test_run_guarded_times_the_round_trip_on_its_own_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a frozen clock that moves only while the question is out: 12 s pass, the lease had 10
    ticks = iter([100.0, 112.0])
    monkeypatch.setattr(guard_mod, "ask", lambda *a: {"held": True, "state": "running", "valid_for": 10.0,
                                                      "token_matches": True, "error": None})
    marker = tmp_path / "marker"
    code = guard_mod.run_guarded(write_marker(marker), task="5", token=str(uuid.uuid4()), socket_path="/x",
                                 timeout=20, quiet=True, clock=lambda: next(ticks))
    assert code == EX_TEMPFAIL and not marker.exists()


def test_guard_server_answers_a_bad_request_with_not_held(tmp_path: Path) -> None:
    import socket

    store = FakeStore(HELD)
    server = GuardServer(store, tmp_path / "g.sock")  # type: ignore[arg-type]
    server.start()
    try:
        for line in (b"not json\n", b'{"task": "x", "token": "y"}\n', b'{"task": 1}\n', b"[]\n"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5)
                s.connect(str(tmp_path / "g.sock"))
                s.sendall(line)
                answer = json.loads(s.makefile().readline())
            assert answer["held"] is False and answer["error"].startswith("bad request"), (line, answer)
        assert store.calls == []
    finally:
        server.stop()


def test_private_run_dir_is_short_under_a_deep_tmpdir(deep_tmp: Path) -> None:
    d = private_run_dir()
    try:
        assert len(str(d / "guard.sock")) <= 100
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    finally:
        d.rmdir()


def test_run_dirs_of_dead_shifts_are_swept_and_no_other(tmp_path: Path) -> None:
    import socket

    base = Path(tempfile.mkdtemp(prefix="lf-sweep-", dir="/tmp"))  # short: sockets live in it
    old = time.time() - 3600

    def run_dir(name: str, *, dead_socket: bool = True, extra: str | None = None, age: float = old) -> Path:
        d = base / name
        (d / "bin").mkdir(parents=True)
        if dead_socket:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.bind(str(d / "guard.sock"))  # bound, then closed: nobody listens
        if extra:
            (d / extra).write_text("not ours")
        os.utime(d, (age, age))
        return d

    try:
        dead = run_dir("lanefleet-guard-dead0001")
        no_socket = run_dir("lanefleet-guard-nosock01", dead_socket=False)
        young = run_dir("lanefleet-guard-young001", age=time.time())
        foreign = run_dir("lanefleet-guard-foreign1", extra="notes.txt")
        other = run_dir("lanefleet-other-dead0001")
        (base / "lanefleet-guard-afile").write_text("a file")
        live = GuardServer(FakeStore(HELD), base / "lanefleet-guard-live0001" / "guard.sock")  # type: ignore[arg-type]
        live.start()
        token = uuid.uuid4()
        live.agent_env(1, token, None)
        try:
            os.utime(base / "lanefleet-guard-live0001", (old, old))
            removed = sweep_stale(base)
            assert sorted(removed) == sorted([dead, no_socket])
            assert not dead.exists() and not no_socket.exists()
            assert young.exists() and foreign.exists() and other.exists()
            assert (base / "lanefleet-guard-afile").exists()
            assert ask(str(live.socket_path), 1, str(token), 5)["held"] is True  # untouched, still serving
        finally:
            live.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
