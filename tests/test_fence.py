"""The shift's self-fence (worker/shift/fence.py): the validity arithmetic on a frozen clock, the
thread acting on a real one, the supervisor's backstop, and a real shift frozen by SIGSTOP whose
agent is stopped all the same. A real shift cut off from its database: tests/partition/."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from fleetkit import Backend, Fleet, lane_defaults, wait_for

from worker.agent.executor import AgentProcess
from worker.shift.fence import MARGIN, Fence, term_window


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def fence_on(clock: Clock, term: float = 1.0) -> tuple[Fence, list[tuple[str, bool]]]:
    calls: list[tuple[str, bool]] = []
    return Fence(lambda stage, first: calls.append((stage, first)), term_window=term, clock=clock), calls


def test_the_lease_holds_from_the_moment_the_call_was_sent() -> None:
    clock = Clock()
    fence, calls = fence_on(clock)
    assert fence.remaining() is None and fence.check() is None  # nothing granted: nothing to fence
    # sent at 1000, answered at 1002.5 (a slow round trip) with 6 s: it holds until 1006, not 1008.5
    clock.now = 1002.5
    fence.renewed(1000.0, 6.0)
    assert fence.until == 1006.0 and fence.remaining() == pytest.approx(3.5)
    assert fence.term_at == pytest.approx(1006.0 - MARGIN - 1.0)
    assert fence.kill_at == pytest.approx(1006.0 - MARGIN)
    assert fence.check() == pytest.approx(fence.term_at - 1002.5) and calls == []


def test_it_asks_the_agents_to_stop_then_kills_them_before_the_lease_runs_out() -> None:
    clock = Clock()
    fence, calls = fence_on(clock)
    fence.renewed(1000.0, 6.0)
    clock.now = 1004.4
    fence.check()
    assert calls == []
    clock.now = 1004.6  # past term_at (1004.5)
    wait = fence.check()
    assert calls == [("term", True)] and wait == pytest.approx(1005.5 - 1004.6)
    fence.check()
    assert calls[-1] == ("term", False)  # asked once; later looks only mark what appeared
    clock.now = 1005.5  # kill_at: half a second before the database could call it expired
    fence.check()
    assert calls[-1] == ("kill", True) and fence.stage == "kill"
    clock.now = 1010.0
    assert fence.check() == pytest.approx(0.1)  # and it goes on killing whatever appears
    assert calls[-1] == ("kill", False)


def test_a_renewal_lifts_it_and_an_older_grant_never_shortens_it() -> None:
    clock = Clock()
    fence, calls = fence_on(clock)
    fence.renewed(1000.0, 6.0)
    clock.now = 1005.6
    fence.check()
    assert fence.stage == "kill"
    fence.renewed(1005.0, 6.0)  # a heartbeat got through: until 1011
    assert fence.stage is None and fence.until == 1011.0
    calls.clear()
    fence.check()
    assert calls == []
    fence.renewed(1001.0, 6.0)  # a late answer to an earlier call
    assert fence.until == 1011.0
    # a renewal that leaves less than the term window keeps the agents stopping
    clock.now = 1009.8
    fence.check()
    assert calls == [("term", True)]
    fence.renewed(1004.0, 6.0)
    assert fence.stage == "term"


def test_the_term_window_is_a_sixth_of_the_lease_at_most_the_grace() -> None:
    assert term_window(60, 20) == 10
    assert term_window(6, 20) == 1
    assert term_window(60, 3) == 3
    assert term_window(60, 0) == 0


def test_the_thread_acts_on_a_real_clock_while_nothing_else_runs() -> None:
    # the main loop is "blocked" (this test sleeps): the fence's own thread stops the agents
    done = threading.Event()
    calls: list[tuple[str, float]] = []
    start = time.monotonic()

    def on_fence(stage: str, first: bool) -> None:
        if first:
            calls.append((stage, time.monotonic() - start))
            if stage == "kill":
                done.set()

    fence = Fence(on_fence, term_window=0.3, margin=0.2)
    fence.start()
    try:
        fence.renewed(start, 1.0)
        assert done.wait(5)
    finally:
        fence.stop()
    (term, t_term), (kill, t_kill) = calls
    assert (term, kill) == ("term", "kill")
    # never early (the moments are the lease's); late only by the scheduler (a loaded machine)
    assert 0.5 - 0.02 <= t_term and 0.8 - 0.02 <= t_kill and t_term < t_kill < 3.0, calls


# -- the supervisor's backstop: a real supervisor process, a real agent


def test_the_supervisor_stops_its_agent_at_the_fence_when_nobody_moves_it(tmp_path: Path) -> None:
    # what a frozen shift leaves: deadlines on the pipe, and no renewal after them
    agent = AgentProcess([sys.executable, "-c", TRAPS_TERM, str(tmp_path / "got")], cwd=tmp_path,
                         env=dict(os.environ), log_path=tmp_path / "agent.log")
    try:
        start = time.monotonic()
        agent.fence(start + 0.6, start + 1.2)
        agent.fence(start + 1.0, start + 1.6)  # a renewal moves them on
        code = agent.wait(10)
        took = time.monotonic() - start
    finally:
        agent.release()
    assert (tmp_path / "got").read_text() == "SIGTERM"  # asked first, at 1.0 s
    assert code == 128 + signal.SIGKILL and 1.55 <= took < 3, (code, took)  # then killed at 1.6 s


def test_a_supervisor_told_nothing_leaves_its_agent_alone(tmp_path: Path) -> None:
    agent = AgentProcess([sys.executable, "-c", "import time; time.sleep(1.5)"], cwd=tmp_path,
                         env=dict(os.environ), log_path=tmp_path / "agent.log")
    try:
        assert agent.wait(10) == 0
    finally:
        agent.release()


def test_a_frozen_shift_still_has_its_agent_stopped_before_its_lease_runs_out(db_url: str, tmp_path: Path) -> None:
    script = tmp_path / "agent.py"
    script.write_text(BEATS)
    f = Fleet(Backend("postgres", db_url), tmp_path, {"work": lane_defaults(
        command=["python", str(script), str(tmp_path / "alive.log")], lease_seconds=6, grace_seconds=1)})
    proc = None
    try:
        task_id = f.enqueue("work", "frozen")
        proc = f.spawn_shift("work", "--max-tasks", "1")
        wait_for("the agent", lambda: (tmp_path / "alive.log").exists() and
                 len((tmp_path / "alive.log").read_text().split()) > 5, timeout=30)
        os.kill(proc.pid, signal.SIGSTOP)  # the shift and its fence thread freeze; its supervisors do not
        time.sleep(0.3)
        until = float(f.sql("""select extract(epoch from fleet._lease_until(s.heartbeat_at, l.lease_seconds,
                                                                            l.session_timeout_seconds)) as t
                                 from fleet.tasks k join fleet.sessions s on s.id = k.session_id
                                 join fleet.lanes l on l.name = k.lane where k.id = %s""", (task_id,))[0]["t"])
        wait_for("the lease to run out", lambda: time.time() > until + 0.5, timeout=15)
        last = float((tmp_path / "alive.log").read_text().split()[-1])
        assert last < until, f"the agent ran {last - until:.2f} s past its frozen shift's lease"
        assert f.task(task_id)["state"] == "running"  # nobody repaired it yet: the agent stopped on its own
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(60) == 0  # it thaws, finds its agent stopped, hands the task off, ends
        assert f.task(task_id)["state"] == "queued"
        (run,) = f.runs(task_id)
        assert run["outcome"] == "handed_off", run
    finally:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(10)
        f.close()


TRAPS_TERM = r'''
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *a: out.write_text("SIGTERM"))  # and goes on: only SIGKILL ends it
while True:
    time.sleep(0.05)
'''

# an agent whose sign of life is the wall-clock time, every 50 ms, in the file it is given
BEATS = r'''
import sys, time
with open(sys.argv[1], "a", buffering=1) as f:
    while True:
        f.write(f"{time.time():.3f}\n")
        time.sleep(0.05)
'''
