"""The shift (#3) and the monitor (#4) on the supabase back-end, through the real local stack.

The same scenarios as tests/test_shift.py and tests/test_monitor.py, with every store call going
through supabase-py → nginx → PostgREST: shifts use a worker key scoped to the test's lanes, the
monitor an operator key. Subprocess shifts get ``store = "supabase"`` from the environment and a
DATABASE_URL that answers nothing, so a call that slipped past the REST store would fail. The test
itself reads and tampers with the database through a direct connection.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fleetkit import Fleet, alive, lane_defaults, pids_using, proc_children, wait_for
from supabase_stack import key

from monitor.reconcile import host_checks, monitor_pass
from worker import example_agent
from worker.devstack import DevStack
from worker.errors import LaneForbidden
from worker.shift import Shift, ShiftSummary
from worker.store import PostgresStore
from worker.supabase_store import AccessDenied, SupabaseStore

QUICK = {"steps": 2, "sleep": 0.05}
NOWHERE = "postgresql://nobody@127.0.0.1:9/nowhere?connect_timeout=1"


@dataclass
class SupabaseFleet(Fleet):
    """A fleetkit Fleet whose store is the REST one (lanes synced over the direct connection, as
    `fleet migrate` would)."""

    stack: DevStack | None = None
    key_lanes: list[str] | None = None
    direct: PostgresStore = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        assert self.stack is not None
        self.direct = self.store
        self.worker_key = key(self.stack, "worker", self.key_lanes or list(self.lanes))
        self.operator_key = key(self.stack, "operator")
        self.store = SupabaseStore(self.stack.url, self.stack.anon_key, self.worker_key)  # type: ignore[assignment]
        self.monitor_store = SupabaseStore(self.stack.url, self.stack.anon_key, self.operator_key)

    def close(self) -> None:
        self.store.close()
        self.monitor_store.close()
        self.direct.close()

    def env(self) -> dict[str, str]:
        assert self.stack is not None
        env = super().env()
        env.update({"DATABASE_URL": NOWHERE, "FLEET_FLEET__STORE": "supabase",
                    "FLEET_SUPABASE__URL": self.stack.url, "FLEET_SUPABASE__KEY": self.worker_key,
                    "SUPABASE_ANON_KEY": self.stack.anon_key})
        return env


@pytest.fixture
def fleet_of(stack: DevStack, tmp_path: Path):
    made: list[SupabaseFleet] = []

    def make(lanes: dict[str, dict[str, Any]] | None = None, key_lanes: list[str] | None = None) -> SupabaseFleet:
        f = SupabaseFleet(stack.db_url, tmp_path, lanes or {"work": lane_defaults()}, stack=stack,
                          key_lanes=key_lanes)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()
        for pid in pids_using(tmp_path):  # an agent a failed test left behind, found by its folder
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def model_usage_sums(record: dict[str, Any]) -> dict[str, int]:
    mu = record["modelUsage"]
    return {
        "input_tokens": sum(m["inputTokens"] for m in mu.values()),
        "cache_creation_tokens": sum(m["cacheCreationInputTokens"] for m in mu.values()),
        "cache_read_tokens": sum(m["cacheReadInputTokens"] for m in mu.values()),
        "output_tokens": sum(m["outputTokens"] for m in mu.values()),
    }


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


def joined(t: threading.Thread, out: dict[str, Any], timeout: float = 30) -> ShiftSummary:
    t.join(timeout)
    assert not t.is_alive(), "the shift did not end"
    if "error" in out:
        raise out["error"]
    return out["summary"]


def kill_leftovers(pids: set[int]) -> None:
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- completion, retries, tokens


def test_shift_completes_tasks_with_tokens_over_rest(fleet_of) -> None:
    f = fleet_of()
    assert isinstance(f.store, SupabaseStore)
    ids = [f.enqueue("work", f"ok:{i}", dict(QUICK)) for i in range(3)]
    summary = f.run_shift("work")

    assert summary.reason == "idle" and summary.exit_code == 0
    assert summary.claimed == 3 and summary.outcomes == {"done": 3}
    expected = model_usage_sums(example_agent.result_record("x", is_error=False, steps=2, scale=1000, text=""))
    for task_id in ids:
        t = f.task(task_id)
        assert (t["state"], t["attempts"], t["failures"], t["handoffs"]) == ("done", 1, 0, 0)
        (run,) = f.runs(task_id)
        assert (run["outcome"], run["exit_code"], run["session_id"]) == ("done", 0, summary.session)
        assert {k: run[k] for k in expected} == expected
        assert run["agent_session"] == t["agent_session"] and run["agent_session"]
        assert t["checkpoint"] == {"step": 2, "of": 2, "attempt": 1}
        assert [k for k in f.event_kinds(task_id) if k != "checkpoint"] == ["enqueued", "claimed", "completed"]
    (session,) = f.sql("select * from fleet.sessions where id = %s", (summary.session,))
    assert (session["state"], session["end_reason"]) == ("ended", "idle")
    (handoff,) = f.sql("select * from fleet.lane_handoffs where session_id = %s", (summary.session,))
    assert sorted(handoff["completed"]) == sorted(ids)
    assert handoff["tokens"]["input"] == 3 * expected["input_tokens"]
    # the lane hand-off was read back over REST and written for the next shift
    assert summary.lane_handoff == handoff["id"] and summary.handoff_file and summary.handoff_file.exists()


def test_failures_are_retried_up_to_the_cap_over_rest(fleet_of) -> None:
    f = fleet_of()
    failing = f.enqueue("work", "always-fails", {"mode": "fail", "steps": 1, "sleep": 0.01})
    flaky = f.enqueue("work", "fails-once", {"fail_attempts": 1, "steps": 1, "sleep": 0.01})
    summary = f.run_shift("work")
    assert summary.outcomes == {"failed": 4, "done": 1}
    t = f.task(failing)
    assert (t["state"], t["dead_reason"], t["failures"], t["attempts"]) == ("dead", "attempt-cap", 3, 3)
    runs = f.runs(failing)
    assert [r["outcome"] for r in runs] == ["failed"] * 3
    assert all(r["input_tokens"] > 0 and r["exit_code"] == 1 for r in runs)
    t = f.task(flaky)
    assert (t["state"], t["attempts"], t["failures"]) == ("done", 2, 1)


def test_a_routed_task_keeps_its_id_over_rest(fleet_of) -> None:
    f = fleet_of({"bugfix": lane_defaults(), "review": lane_defaults(accepts_from=["bugfix"])})
    task_id = f.enqueue("bugfix", "issue:7", {"steps": 1, "sleep": 0.01, "route": "review", "route_note": "fixed"})
    assert f.run_shift("bugfix").outcomes == {"routed": 1}
    assert f.run_shift("review").outcomes == {"done": 1}
    t = f.task(task_id)
    assert (t["lane"], t["state"], t["stages"][0]["note"]) == ("review", "done", "fixed")


def test_a_key_for_one_lane_cannot_route_out_of_it(fleet_of) -> None:
    """A bugfix key (no review) finishes the stage but cannot route it: the route is a failed attempt."""
    f = fleet_of({"bugfix": lane_defaults(), "review": lane_defaults(accepts_from=["bugfix"])},
                 key_lanes=["bugfix"])
    task_id = f.enqueue("bugfix", "issue:8", {"steps": 1, "sleep": 0.01, "route": "review"}, max_attempts=1)
    assert f.run_shift("bugfix").outcomes == {"failed": 1}
    t = f.task(task_id)
    assert (t["lane"], t["state"]) == ("bugfix", "dead")
    assert "not allowed for this key" in t["last_error"]


# -- a shift with a key for another lane


def test_fleet_shift_with_a_key_for_another_lane_refuses_to_start(fleet_of) -> None:
    f = fleet_of({"work": lane_defaults(), "other": lane_defaults()}, key_lanes=["other"])
    f.direct.enqueue("work", "w:1", dict(QUICK))
    before = f.sql("select count(*) as n from fleet.sessions")[0]["n"]
    done = f.cli("shift", "--lane", "work", "--once", "--max-seconds", "10")
    assert done.returncode == 1, done.stderr
    assert "lane 'work' is not allowed for this key" in done.stderr
    assert f.sql("select count(*) as n from fleet.sessions")[0]["n"] == before == 0
    with pytest.raises(LaneForbidden):
        f.store.open_session("work", "h", 1, None, 60)


# -- SIGTERM: hand off, and the next shift resumes


def test_sigterm_hands_off_and_the_next_shift_resumes_over_rest(fleet_of) -> None:
    f = fleet_of({"work": lane_defaults(grace_seconds=5)})
    hang = [f.enqueue("work", f"hang:{i}", {"mode": "hang"}) for i in range(2)]
    proc = f.spawn_shift("work", "--once", "--slots", "2", "--max-tasks", "2", "--max-seconds", "60")
    started: set[int] = set()
    try:
        def agents_up() -> bool:
            rows = f.sql("select t.id, r.log_path from fleet.tasks t join fleet.runs r on r.task_id = t.id"
                         " where t.state = 'running'")
            return len(rows) == 2 and all(
                r["log_path"] and Path(r["log_path"]).exists() and '"init"' in Path(r["log_path"]).read_text()
                for r in rows)

        wait_for("both hang agents to start", agents_up, timeout=30)
        started = pids_using(f.workspaces) | {proc.pid}
        wait_for("a heartbeat", lambda: f.sql(
            "select heartbeat_at >= started_at + interval '0.9 s' as hb from fleet.sessions")[0]["hb"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        kill_leftovers(started)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not pids_using(f.workspaces), "an agent outlived its shift"
    (session,) = f.sql("select * from fleet.sessions")
    assert (session["state"], session["end_reason"], session["pid"]) == ("ended", "SIGTERM", proc.pid)
    for task_id in hang:
        t = f.task(task_id)
        assert (t["state"], t["resume"], t["handoffs"], t["failures"], t["evaporations"]) == (
            "queued", True, 1, 0, 0)
        assert "SIGTERM" in t["handoff"]["reason"] and t["handoff"]["agent_session"] == t["agent_session"]
        assert [r["outcome"] for r in f.runs(task_id)] == ["handed_off"]
    (lh,) = f.sql("select * from fleet.lane_handoffs where session_id = %s", (session["id"],))
    assert sorted(lh["handed_off"]) == sorted(hang)

    f.sql("update fleet.tasks set payload = '{\"steps\": 1, \"sleep\": 0.01}' where id = any(%s)", (hang,))
    nxt = f.run_shift("work", slots=1)
    assert nxt.outcomes == {"done": 2}
    for task_id in hang:
        runs = f.runs(task_id)
        assert [r["outcome"] for r in runs] == ["handed_off", "done"]
        assert runs[1]["agent_session"] == runs[0]["agent_session"]  # resumed the same agent session


# -- SIGKILL: the monitor (an operator key, over REST) repairs at once on this host


def test_sigkill_is_repaired_by_one_monitor_pass_over_rest(fleet_of) -> None:
    f = fleet_of({"work": lane_defaults(lease_seconds=60)})
    ids = [f.enqueue("work", f"hang:{i}", {"mode": "hang"}) for i in range(2)]
    proc = f.spawn_shift("work", "--slots", "2", "--max-seconds", "60")
    ours: set[int] = {proc.pid}
    try:
        def agents() -> set[int] | None:
            supervisors = proc_children(proc.pid)
            found = {a for s in supervisors for a in proc_children(s)}
            return found if len(supervisors) == 2 and len(found) == 2 else None

        ours |= wait_for("two supervisors with an agent each", agents, timeout=30)
        ours |= proc_children(proc.pid)
        wait_for("both tasks running", lambda: [t["state"] for t in map(f.task, ids)] == ["running"] * 2)
        (sess,) = f.sql("select * from fleet.sessions")
        assert sess["pid"] == proc.pid and sess["host"] == socket.gethostname()

        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        wait_for("the agents to die with their shift", lambda: not any(alive(p) for p in ours), timeout=10)

        actions = monitor_pass(f.monitor_store, f.cfg)  # type: ignore[arg-type]
    finally:
        kill_leftovers(ours)
    assert [a.action for a in actions] == ["session_lost", "released", "released"], actions
    assert actions[0].detail["reason"] == "pid-gone"
    assert sorted(a.task_id for a in actions[1:] if a.task_id is not None) == ids
    for task_id in ids:
        t = f.task(task_id)
        assert (t["state"], t["evaporations"], t["lease_token"]) == ("queued", 1, None)
    (s,) = f.sql("select * from fleet.sessions")
    assert (s["state"], s["end_reason"]) == ("lost", "pid-gone")
    assert monitor_pass(f.monitor_store, f.cfg) == []  # type: ignore[arg-type]


def test_a_worker_key_monitor_repairs_its_lanes_on_this_host_but_not_the_fleet(fleet_of) -> None:
    f = fleet_of({"work": lane_defaults(lease_seconds=60)})
    (task_id,) = [f.enqueue("work", "t:1", {})]
    gone = f.direct.open_session("work", socket.gethostname(), 999_999, None, 600)  # no such pid
    f.direct.claim(gone, 1)
    actions = host_checks(f.store)  # type: ignore[arg-type]
    assert [(a.action, a.task_id) for a in actions] == [("session_lost", None), ("released", task_id)]
    with pytest.raises(AccessDenied):  # a fleet-wide pass is an operator's
        f.store.reconcile()


# -- fencing: a lost lease, a cancel


def test_a_lost_lease_kills_the_agent_and_the_shift_writes_nothing_over_rest(fleet_of) -> None:
    f = fleet_of()
    task_id = f.enqueue("work", "hang", {"mode": "hang"})
    shift = f.shift("work", once=False, max_tasks=2, max_seconds=30)
    thread, out = run_in_thread(shift)
    ws = f.workspace("work", "hang")
    started: set[int] = set()
    try:
        started = wait_for("the agent to run", lambda: pids_using(ws) if len(pids_using(ws)) >= 2 else None)
        with psycopg.connect(f.db_url, autocommit=False) as c:
            assert c.execute("select fleet._release(%s, 'test')", (task_id,)).fetchone()[0] == "queued"
            other = c.execute("select fleet.open_session('work', 'elsewhere', 4242, null, 60)").fetchone()[0]
            (got,) = c.execute("select id, lease_token from fleet.claim(%s, 1)", (other,)).fetchall()
            c.commit()
        t0 = time.monotonic()
        wait_for("the agent to be killed", lambda: not pids_using(ws), timeout=10)
        assert time.monotonic() - t0 < shift.heartbeat_every + 1.5
        ok = f.enqueue("work", "after", {"steps": 1, "sleep": 0.01})
        summary = joined(thread, out)
    finally:
        kill_leftovers(started)
    assert summary.outcomes == {"lost": 1, "done": 1}
    t = f.task(task_id)
    assert (t["state"], t["session_id"], t["lease_token"]) == ("running", other, got[1])
    assert f.event_kinds(task_id) == ["enqueued", "claimed", "repaired", "claimed"]
    assert f.runs(task_id)[0]["outcome"] == "lost"
    assert f.task(ok)["state"] == "done"


def test_a_task_cancelled_by_an_operator_over_rest_stops_its_agent(fleet_of) -> None:
    f = fleet_of()
    task_id = f.enqueue("work", "hang", {"mode": "hang"})
    shift = f.shift("work")
    thread, out = run_in_thread(shift)
    ws = f.workspace("work", "hang")
    started: set[int] = set()
    try:
        started = wait_for("the agent to run", lambda: pids_using(ws) if len(pids_using(ws)) >= 2 else None)
        assert f.monitor_store.cancel(task_id) == "cancelled"
        wait_for("the agent to be stopped", lambda: not pids_using(ws), timeout=10)
        summary = joined(thread, out)
    finally:
        kill_leftovers(started)
    assert summary.outcomes == {"cancelled": 1}
    assert f.event_kinds(task_id) == ["enqueued", "claimed", "cancelled"]


def test_fleet_commands_over_rest(fleet_of) -> None:
    """The CLI with store = "supabase": enqueue and show with an operator key, no database URL."""
    f = fleet_of()
    env = {**f.env(), "FLEET_SUPABASE__KEY": f.operator_key}
    out = f.cli("enqueue", "work", "--key", "cli:1", "--payload", '{"a": 1}', "--run-at", "+1h", "--json",
                env=env)
    assert out.returncode == 0, out.stderr
    task_id = json.loads(out.stdout)["id"]
    t = f.task(task_id)
    assert t["payload"] == {"a": 1} and t["run_at"] > t["created_at"]
    shown = f.cli("show", "cli:1", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["task"]["id"] == task_id
    listed = f.cli("tasks", "--json", env=env)
    assert [t["key"] for t in json.loads(listed.stdout)] == ["cli:1"]
