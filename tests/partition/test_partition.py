"""Leases that hold under a partition (issue #18): a real shift on a "host" cut off from its
database (tests/partition/netns.py: a network namespace behind a wire that drops every frame),
the monitor and another shift on this side.

- a cut-off shift stops its agent before its lease could be repaired (its own clock, not the
  network, decides), the monitor repairs the task, the repaired task is claimed before fresh work,
  and after the heal the cut-off shift exits (its session was declared lost) without writing
  anything: its late ``complete`` is refused;
- a guarded command whose answer is delayed in flight past the lease it vouches for does not run.

The lane's lease is 6 s (a heartbeat every 2 s): what a cut costs is seconds, not minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import dbname_of
from fleetkit import ROOT, Backend, Fleet, alive, lane_defaults, wait_for

from partition.netns import Lines, PartitionHost
from worker.shift.guard_client import EX_TEMPFAIL

LEASE = 6

# The scripted agent. Its first attempt: writes the wall-clock time to alive.log every 50 ms (its
# sign of life) and, by the payload's mode, runs on until killed ("long"), exits 0 once the test
# says the cut happened ("finish"), or runs `fleet guard` each time the test asks ("guard").
# Any later attempt exits 0 at once (the work, done by the other side).
AGENT = r'''
import json, os, subprocess, sys, time
from pathlib import Path

task = json.loads(Path(".fleet/task.json").read_text())
out = Path(task["payload"]["dir"])
mode = task["payload"]["mode"]
if os.environ["FLEET_ATTEMPT"] != "1":
    print(json.dumps({"type": "result", "subtype": "success", "is_error": False,
                      "result": "done on attempt " + os.environ["FLEET_ATTEMPT"]}))
    sys.exit(0)
(out / "agent.pid").write_text(str(os.getpid()))
asked = 0
with (out / "alive.log").open("a", buffering=1) as beat:
    while True:
        beat.write(f"{time.time():.3f}\n")
        if mode == "finish" and (out / "cut").exists():
            time.sleep(0.3)
            (out / "finished").write_text("x")
            sys.exit(0)
        if mode == "guard" and (out / f"go-{asked + 1}").exists():
            asked += 1
            marker = out / f"marker-{asked}"
            p = subprocess.run(["fleet", "guard", "--", sys.executable, "-c",
                                f"import pathlib; pathlib.Path({str(marker)!r}).write_text('x')"],
                               capture_output=True, text=True, timeout=60)
            (out / f"guard-{asked}.json").write_text(json.dumps({"rc": p.returncode, "stderr": p.stderr}))
        time.sleep(0.05)
'''


@pytest.fixture
def fleet(db_url: str, tmp_path: Path) -> Any:
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    f = Fleet(Backend("postgres", db_url), tmp_path, {
        "cut": lane_defaults(command=["python", str(script), "{prompt_file}"], lease_seconds=LEASE,
                             grace_seconds=1, max_attempts=5)})
    yield f
    f.close()


def start_shift(host: PartitionHost, f: Fleet, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    """`fleet shift` inside the host, reaching the database through the wire only."""
    env = f.env()
    env["DATABASE_URL"] = host.url(dbname_of(f.db_url))
    log = f.tmp / "cut-off-shift.log"
    with log.open("wb") as out:
        proc = host.popen([sys.executable, "-m", "monitor.cli", "shift", "--lane", "cut", "--poll", "0.1",
                           "--json-logs", *args], env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
                          stderr=subprocess.STDOUT)
    return proc, log


def beats(out: Path) -> list[float]:
    try:
        return [float(x) for x in (out / "alive.log").read_text().split()]
    except FileNotFoundError:
        return []


def lease_until(f: Fleet, task_id: int) -> float:
    """When the task's lease runs out by the database's clock (epoch seconds; same machine, same clock)."""
    return float(f.sql("""select extract(epoch from fleet._lease_until(s.heartbeat_at, l.lease_seconds,
                                                                        l.session_timeout_seconds)) as t
                            from fleet.tasks k join fleet.sessions s on s.id = k.session_id
                            join fleet.lanes l on l.name = k.lane where k.id = %s""", (task_id,))[0]["t"])


def log_records(log: Path) -> list[dict[str, Any]]:
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"a line of the shift's log is not JSON: {line!r}") from None
    return records


# what a shift logs when the database refuses a call it made under a lease that is gone
REFUSED = ("lease lost; result dropped", "pending call answered: lease already gone", "session lost: stopping every agent")


def cut_and_repair(host: PartitionHost, f: Fleet, task_id: int, out: Path) -> float:
    """Cut the host off once its agent runs; wait until the lease ran out by the database's clock
    and let the monitor repair it. Returns when (epoch) the lease ran out."""
    wait_for("the agent on the host", lambda: f.task(task_id)["state"] == "running" and len(beats(out)) > 5,
             timeout=30)
    host.cut()
    (out / "cut").write_text(f"{time.time():.3f}")
    # the cut-off shift's last heartbeat may still have got through: read the lease after the cut
    time.sleep(0.5)
    until = lease_until(f, task_id)
    wait_for("the lease to run out by the database's clock", lambda: time.time() > until + 0.2, timeout=LEASE + 5)
    actions = f.monitor_store.reconcile()
    assert any(a.action == "released" and a.task_id == task_id for a in actions), actions
    assert f.task(task_id)["state"] == "queued"
    return until


def test_a_cut_off_shift_stops_its_agent_before_its_lease_could_be_repaired(
        partition_host: PartitionHost, fleet: Fleet) -> None:
    f, host = fleet, partition_host
    out = f.tmp / "out"
    out.mkdir()
    task_id = f.enqueue("cut", "long", {"dir": str(out), "mode": "long"})
    proc, log = start_shift(host, f, "--max-tasks", "1")
    wait_for("the claim", lambda: f.task(task_id)["state"] == "running", timeout=30)
    # fresh work queued while the task runs: the repaired task must still come first
    fresh = [f.enqueue("cut", f"fresh-{i}", {"dir": str(out), "mode": "long"}) for i in range(3)]

    until = cut_and_repair(host, f, task_id, out)
    t_cut = float((out / "cut").read_text())

    last = beats(out)[-1]
    pid = int((out / "agent.pid").read_text())
    assert not alive(pid), "the agent still runs after its lease was repaired"
    assert last < until, f"the agent's last sign of life came {last - until:.2f} s after its lease ran out"
    assert last > until - LEASE, "the agent was stopped before it ever lost touch"
    print(f"\npartition: the agent's last sign of life {until - last:.2f} s before its lease ran out "
          f"(lease {LEASE} s; the cut came {until - t_cut:.2f} s before it ran out)")
    # the monitor's side: the task went back, first in line; another shift here does the work
    summary = f.run_shift("cut", max_tasks=1)
    assert summary.outcomes == {"done": 1}
    assert f.task(task_id)["state"] == "done", "the repaired task was not claimed before the fresh ones"
    assert all(f.task(t)["state"] == "queued" for t in fresh)

    host.heal()
    code = proc.wait(60)  # its hand-off refused, its task budget spent: it ends (3 if it saw its session lost)
    assert code in (0, 3), f"the cut-off shift exited {code}; its log:\n{log.read_text()[-3000:]}"
    events = [r["event"] for r in log_records(log)]
    assert "lease not renewed in time: asking the agents to stop" in events, events
    assert any(e in REFUSED for e in events), events
    assert "handed off" not in events, "a refused hand-off was logged as made"
    runs = f.runs(task_id)
    assert [(r["attempt"], r["outcome"]) for r in runs] == [(1, "lost"), (2, "done")], runs


def test_a_late_complete_from_a_cut_off_shift_is_refused(partition_host: PartitionHost, fleet: Fleet) -> None:
    f, host = fleet, partition_host
    out = f.tmp / "out"
    out.mkdir()
    task_id = f.enqueue("cut", "finish", {"dir": str(out), "mode": "finish"})
    proc, log = start_shift(host, f, "--max-tasks", "1")

    cut_and_repair(host, f, task_id, out)  # the agent exited 0 during the cut: its complete is pending

    assert (out / "finished").exists()
    assert f.run_shift("cut", max_tasks=1).outcomes == {"done": 1}
    host.heal()
    code = proc.wait(60)
    assert code in (0, 3), f"the cut-off shift exited {code}; its log:\n{log.read_text()[-3000:]}"
    events = [r["event"] for r in log_records(log)]
    assert any(e in REFUSED for e in events), events
    assert "done" not in events, "a refused completion was logged as made"
    t = f.task(task_id)
    assert t["state"] == "done" and t["result"]["summary"] == "done on attempt 2", t["result"]
    runs = f.runs(task_id)
    assert [(r["attempt"], r["outcome"]) for r in runs] == [(1, "lost"), (2, "done")], runs


def test_a_guarded_command_whose_answer_comes_too_late_does_not_run(
        partition_host: PartitionHost, fleet: Fleet) -> None:
    f, host = fleet, partition_host
    assert host.relay is not None
    out = f.tmp / "out"
    out.mkdir()
    task_id = f.enqueue("cut", "guard", {"dir": str(out), "mode": "guard"})
    proc, log = start_shift(host, f, "--max-tasks", "1")
    wait_for("the agent on the host", lambda: len(beats(out)) > 5, timeout=30)

    # fleet.lease_held reaches the database at once; its answer is held in flight past the lease
    # (at most 6 s left when the database answers); every other call goes through
    host.relay.delay_answer_to(b"fleet.lease_held(", LEASE + 2)
    (out / "go-1").write_text("x")
    first = wait_for("the first guarded command", lambda: (out / "guard-1.json").exists() and
                     json.loads((out / "guard-1.json").read_text()), timeout=30)
    assert host.relay.trapped == 1
    assert first["rc"] == EX_TEMPFAIL, first
    assert "it is stale; retry" in first["stderr"], first
    assert not (out / "marker-1").exists(), "a guarded command ran on a stale answer"
    assert f.task(task_id)["state"] == "running", "the heartbeats did not go through meanwhile"

    (out / "go-2").write_text("x")  # asked again, answered at once: it runs
    second = wait_for("the second guarded command", lambda: (out / "guard-2.json").exists() and
                      json.loads((out / "guard-2.json").read_text()), timeout=30)
    assert second["rc"] == 0, second
    assert (out / "marker-2").exists()
    os.kill(proc.pid, 15)
    assert proc.wait(30) == 0, log.read_text()[-3000:]


# a shift's store in the host: one call before the cut, one during it (timed), one after the heal
STORE_UNDER_CUT = r'''
import sys, time
from worker.errors import DatabaseUnavailable
from worker.store.postgres import PostgresStore

store = PostgresStore(sys.argv[1], call_budget=float(sys.argv[2]), min_size=1, max_size=2)
store.lane_names()
print("ready", flush=True)
sys.stdin.readline()
t = time.monotonic()
try:
    store.lane_names()
    print(f"answered {time.monotonic() - t:.2f}", flush=True)
except DatabaseUnavailable as exc:
    print(f"unavailable {time.monotonic() - t:.2f}", flush=True)
sys.stdin.readline()
t = time.monotonic()
store.lane_names()
print(f"healed {time.monotonic() - t:.2f}", flush=True)
'''


def test_no_call_of_a_shift_blocks_past_its_deadline_under_a_cut(partition_host: PartitionHost, db_url: str) -> None:
    host = partition_host
    budget = 2.0  # a lease of 6 s: a third of it
    child = host.python(STORE_UNDER_CUT, host.url(dbname_of(db_url)), str(budget), cwd=ROOT)
    assert child.stdin is not None and child.stdout is not None
    lines = Lines(child.stdout)
    try:
        assert lines.next(30) == "ready\n"
        host.cut()
        child.stdin.write("\n")
        child.stdin.flush()
        line = lines.next(30)
        assert line, "a call under the cut did not return within 30 s"
        outcome, seconds = line.split()
        # the open connection's query is lost on the wire: the TCP user timeout and keepalives end
        # it, the retries stop at the budget; without them it would block until the heal
        assert outcome == "unavailable", outcome
        assert float(seconds) < 2 * budget + 2, f"a call blocked {seconds} s under the cut"
        host.heal()
        child.stdin.write("\n")
        child.stdin.flush()
        line = lines.next(30) or ""
        assert line.startswith("healed"), line
    finally:
        child.kill()
        child.wait(10)
