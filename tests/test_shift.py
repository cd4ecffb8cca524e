"""Lane shifts end to end (DESIGN §4–§6): real shifts run the scripted agent against a real database.

In-process shifts (:class:`worker.shift.shift.Shift`) where no signal is needed; ``fleet shift``
subprocesses where one is (SIGTERM, SIGKILL). Every wait polls the database or /proc against a
deadline. The agent is ``worker.dev.example_agent``, steered by the task payload.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
import structlog.testing
from fleetkit import Backend, Fleet, alive, lane_defaults, pids_using, proc_children, wait_for

from worker.agent.adapters import ADAPTERS
from worker.agent.prices import run_report
from worker.dev import example_agent
from worker.errors import DatabaseUnavailable
from worker.shift.shift import IDLE_CLAIM_MAX, Shift, ShiftSummary

QUICK = {"steps": 2, "sleep": 0.05}


@pytest.fixture
def fleet_of(backend: Backend, tmp_path: Path):
    """A fleet on each back-end (conftest ``backend``): postgres, and supabase over REST."""
    made: list[Fleet] = []

    def make(lanes: dict[str, dict[str, Any]] | None = None) -> Fleet:
        f = Fleet(backend, tmp_path, lanes or {"work": lane_defaults()})
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def result_record_of(log_path: str) -> dict[str, Any]:
    """The last stream-json result record in a run's log, read independently of the shift."""
    records = []
    for line in Path(log_path).read_text().splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("type") == "result":
            records.append(obj)
    assert records, f"no result record in {log_path}"
    return records[-1]


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
    """Processes this test started (agents, supervisors, shifts): never leave one behind."""
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- 1. completion, retries, tokens


def test_the_generic_reader_sums_model_usage_skips_noise_and_takes_the_last_result() -> None:
    first = {"type": "result", "session_id": "s-1", "is_error": True, "total_cost_usd": 9.0,
             "modelUsage": {"m": {"inputTokens": 999999, "outputTokens": 1}}}
    last = {
        "type": "result", "subtype": "success", "session_id": "s-2", "is_error": False,
        "total_cost_usd": 0.25, "result": "all good",
        # the top-level usage covers the main model only and disagrees with modelUsage
        "usage": {"input_tokens": 100, "cache_creation_input_tokens": 5,
                  "cache_read_input_tokens": 50, "output_tokens": 10},
        "modelUsage": {
            "claude-sonnet-4-5": {"inputTokens": 100, "cacheCreationInputTokens": 5,
                                  "cacheReadInputTokens": 50, "outputTokens": 10, "costUSD": 0.2},
            "claude-haiku-4-5": {"inputTokens": 40, "cacheCreationInputTokens": 3,
                                 "cacheReadInputTokens": 7, "outputTokens": 4, "costUSD": 0.05},
        },
    }
    lines = [
        "Starting agent...\n",
        json.dumps({"type": "system", "subtype": "init", "session_id": "s-0"}) + "\n",
        json.dumps(first) + "\n",
        "{this is not json\n",
        "Traceback (most recent call last):\n",
        json.dumps({"type": "assistant", "session_id": "s-2", "message": {}}) + "\n",
        "   " + json.dumps(last) + "  \n",
        "[1, 2, 3]\n",
        "done.\n",
    ]
    res = ADAPTERS["generic"].reader().feed("".join(lines))
    assert res.final and res.succeeded
    assert res.session_id == "s-2"
    assert res.subtype == "success"
    assert res.cost_usd == pytest.approx(0.25)
    assert res.summary == "all good"
    t = res.tokens
    assert (t.input, t.cache_write, t.cache_read, t.output) == (140, 8, 57, 14)
    assert t.input != last["usage"]["input_tokens"]
    assert sorted(res.models) == ["claude-haiku-4-5", "claude-sonnet-4-5"]
    report = run_report(res, res.tokens, None, {})
    assert report["input_tokens"] == 140 and report["output_tokens"] == 14
    assert report["agent_session"] == "s-2" and report["cost_source"] == "reported"

    nothing = ADAPTERS["generic"].reader().feed("no json here\n{\"type\": \"assistant\"}\n")
    assert not nothing.final and nothing.tokens.total == 0 and not nothing.succeeded
    assert nothing.session_id is None and "agent_session" not in run_report(nothing, nothing.tokens, None, {})
    # an agent stopped before its result record: the session its earlier records named is kept
    cut = ADAPTERS["generic"].reader().feed(
        json.dumps({"type": "system", "subtype": "init", "session_id": "s-9"}) + "\n"
        + json.dumps({"type": "assistant", "session_id": "s-9", "message": {}}) + "\nKilled\n")
    assert not cut.final and cut.session_id == "s-9"
    assert cut.tokens.total == 0


def test_shift_completes_tasks_with_one_run_each_and_tokens_from_model_usage(fleet_of) -> None:
    f = fleet_of()
    ids = [f.enqueue("work", f"ok:{i}", dict(QUICK)) for i in range(3)]
    summary = f.run_shift("work")

    assert summary.reason == "idle" and summary.exit_code == 0
    assert summary.claimed == 3 and summary.outcomes == {"done": 3}
    # what the example agent reports for 2 steps at the default scale, summed over its two models
    expected = model_usage_sums(example_agent.result_record("x", is_error=False, steps=2, scale=1000,
                                                            text=""))
    top_level = example_agent.result_record("x", is_error=False, steps=2, scale=1000, text="")["usage"]
    assert expected["input_tokens"] != top_level["input_tokens"]  # the test can tell them apart
    for task_id in ids:
        t = f.task(task_id)
        assert (t["state"], t["attempts"], t["failures"], t["handoffs"]) == ("done", 1, 0, 0)
        runs = f.runs(task_id)
        assert len(runs) == 1
        run = runs[0]
        assert (run["outcome"], run["exit_code"], run["session_id"]) == ("done", 0, summary.session)
        record = result_record_of(run["log_path"])
        got = {k: run[k] for k in expected}
        assert got == model_usage_sums(record) == expected
        assert got["input_tokens"] != record["usage"]["input_tokens"]
        assert got["output_tokens"] != record["usage"]["output_tokens"]
        assert float(run["cost_usd"]) == pytest.approx(record["total_cost_usd"])
        assert run["agent_session"] == record["session_id"] == t["agent_session"]
        assert set(run["model"].split(",")) == set(record["modelUsage"])
        assert [k for k in f.event_kinds(task_id) if k != "checkpoint"] == ["enqueued", "claimed", "completed"]
        assert t["checkpoint"] == {"step": 2, "of": 2, "attempt": 1}
    session = f.sql("select * from fleet.sessions where id = %s", (summary.session,))[0]
    assert (session["state"], session["end_reason"]) == ("ended", "idle")
    handoff = f.sql("select * from fleet.lane_handoffs where session_id = %s", (summary.session,))[0]
    assert sorted(handoff["completed"]) == sorted(ids)
    assert handoff["tokens"]["input"] == 3 * expected["input_tokens"]
    # the lane hand-off was read back through the store and written for the next shift
    assert summary.lane_handoff == handoff["id"] and summary.handoff_file and summary.handoff_file.exists()


def test_failures_are_retried_up_to_the_cap_and_a_later_attempt_can_succeed(fleet_of) -> None:
    f = fleet_of()
    failing = f.enqueue("work", "always-fails", {"mode": "fail", "steps": 1, "sleep": 0.01})
    flaky = f.enqueue("work", "fails-once", {"fail_attempts": 1, "steps": 1, "sleep": 0.01})
    summary = f.run_shift("work")
    assert summary.outcomes == {"failed": 4, "done": 1}

    t = f.task(failing)
    assert (t["state"], t["dead_reason"], t["failures"], t["attempts"]) == ("dead", "attempt-cap", 3, 3)
    assert "the tests still fail" in t["last_error"]
    runs = f.runs(failing)
    assert [r["outcome"] for r in runs] == ["failed"] * 3
    assert [r["attempt"] for r in runs] == [1, 2, 3]
    assert all(r["exit_code"] == 1 for r in runs)
    for r in runs:  # a failed attempt's tokens count too
        assert {k: r[k] for k in ("input_tokens", "cache_creation_tokens", "cache_read_tokens",
                                  "output_tokens")} == model_usage_sums(result_record_of(r["log_path"]))
        assert r["input_tokens"] > 0

    t = f.task(flaky)
    assert (t["state"], t["attempts"], t["failures"]) == ("done", 2, 1)
    assert [r["outcome"] for r in f.runs(flaky)] == ["failed", "done"]


# -- 2. is_error, require_result, garbage


def test_is_error_and_unverified_exits_are_failed_attempts(fleet_of) -> None:
    f = fleet_of({"work": lane_defaults(), "strict": lane_defaults(require_result=True)})
    is_error = f.enqueue("work", "is-error", {"mode": "is_error", "steps": 1, "sleep": 0.01}, max_attempts=1)
    garbage = f.enqueue("work", "garbage", {"mode": "garbage"})
    strict_garbage = f.enqueue("strict", "strict-garbage", {"mode": "garbage"}, max_attempts=1)
    strict_ok = f.enqueue("strict", "strict-ok", {"steps": 1, "sleep": 0.01})
    f.run_shift("work")
    f.run_shift("strict")

    t = f.task(is_error)
    assert (t["state"], t["failures"], t["dead_reason"]) == ("dead", 1, "attempt-cap")
    assert "end-of-run record says it failed (error_during_execution)" in t["last_error"]
    (run,) = f.runs(is_error)
    assert (run["outcome"], run["exit_code"]) == ("failed", 0)

    t = f.task(garbage)
    assert (t["state"], t["failures"]) == ("done", 0)
    assert [r["outcome"] for r in f.runs(garbage)] == ["done"]

    t = f.task(strict_garbage)
    assert (t["state"], t["failures"]) == ("dead", 1)
    assert "unverified exit" in t["last_error"]
    (run,) = f.runs(strict_garbage)
    assert (run["outcome"], run["exit_code"]) == ("failed", 0)

    assert f.task(strict_ok)["state"] == "done"


# -- 3. hand-offs


def test_exit_75_hands_off_without_spending_an_attempt_until_the_handoff_cap(fleet_of) -> None:
    f = fleet_of({"work": lane_defaults(max_handoffs=2, max_attempts=1)})
    task_id = f.enqueue("work", "waits", {"mode": "handoff", "steps": 1, "sleep": 0.01})
    for n in (1, 2):
        summary = f.run_shift("work", max_tasks=1)
        assert summary.outcomes == {"handed_off": 1}
        t = f.task(task_id)
        # max_attempts is 1: a hand-off that spent an attempt would have killed the task
        assert (t["state"], t["carry_over"], t["failures"], t["evaporations"], t["handoffs"], t["attempts"]) == (
            "queued", True, 0, 0, n, n)
        assert "exit 75" in t["handoff"]["reason"]
        assert t["handoff"]["shift_session"] == str(summary.session)
    f.run_shift("work", max_tasks=1)
    t = f.task(task_id)
    assert (t["state"], t["dead_reason"], t["failures"], t["handoffs"]) == ("dead", "handoff-cap", 0, 3)
    assert [r["outcome"] for r in f.runs(task_id)] == ["handed_off"] * 3
    assert all(r["exit_code"] == 75 for r in f.runs(task_id))


def test_a_task_that_needs_two_shifts_resumes_from_its_checkpoint_and_agent_session(fleet_of) -> None:
    f = fleet_of()
    task_id = f.enqueue("work", "long", {"steps": 4, "steps_per_shift": 2, "sleep": 0.05})
    first = f.run_shift("work", max_tasks=1)
    assert first.outcomes == {"handed_off": 1}
    t = f.task(task_id)
    assert (t["state"], t["carry_over"], t["handoffs"], t["failures"]) == ("queued", True, 1, 0)
    assert t["checkpoint"] == {"step": 2, "of": 4, "attempt": 1}
    session = t["agent_session"]
    assert session and t["handoff"]["agent_session"] == session

    second = f.run_shift("work")
    assert second.outcomes == {"done": 1}
    t = f.task(task_id)
    assert (t["state"], t["attempts"], t["failures"], t["handoffs"]) == ("done", 2, 0, 1)
    # steps 3 and 4 were done by attempt 2: it resumed from step 2, not from scratch
    assert t["checkpoint"] == {"step": 4, "of": 4, "attempt": 2}
    runs = f.runs(task_id)
    assert [r["outcome"] for r in runs] == ["handed_off", "done"]
    assert [r["agent_session"] for r in runs] == [session, session]
    log = Path(runs[1]["log_path"]).read_text()
    assert "step 3/4" in log and "step 1/4" not in log
    assert json.loads(log.splitlines()[0])["session_id"] == session
    ws = f.workspace("work", "long")
    assert json.loads((ws / ".fleet" / "task.json").read_text())["agent_session"] == session
    prompt = (ws / ".fleet" / "prompt.md").read_text()
    assert session in prompt and '"step": 2' in prompt
    assert "exit 75" in (ws / ".fleet" / "handoff.md").read_text()


def test_a_shift_does_not_reclaim_a_task_it_handed_off_itself(fleet_of) -> None:
    f = fleet_of({"work": lane_defaults(max_handoffs=3)})
    long = f.enqueue("work", "long", {"steps": 4, "steps_per_shift": 2, "sleep": 0.05})
    waits = f.enqueue("work", "waits", {"mode": "handoff", "steps": 1, "sleep": 0.01})
    f.run_shift("work")
    assert [r["outcome"] for r in f.runs(long)] == ["handed_off"]
    assert [r["outcome"] for r in f.runs(waits)] == ["handed_off"]
    assert f.task(waits)["state"] == "queued"
    f.run_shift("work")
    assert f.task(long)["state"] == "done"
    assert (f.task(waits)["state"], f.task(waits)["handoffs"]) == ("queued", 2)


# -- 4. SIGTERM: hand off with a snapshot, and the next shift resumes first


def _session_echo_lane(**overrides: Any) -> dict[str, Any]:
    """A lane whose command shows what the agent was given: {agent_session} and the env."""
    script = 'echo "session-arg=$1 session-env=[$FLEET_AGENT_SESSION]"; exec "$0" -m worker.dev.example_agent "$2"'
    return lane_defaults(command=["sh", "-c", script, sys.executable, "[{agent_session}]", "{prompt_file}"],
                         **overrides)


def test_sigterm_hands_off_running_tasks_and_the_next_shift_resumes_them_first(fleet_of) -> None:
    f = fleet_of({"work": _session_echo_lane(grace_seconds=5)})
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
        # and a heartbeat has renewed their leases (so they ran for a measurable while)
        wait_for("a heartbeat", lambda: f.sql(
            "select heartbeat_at >= started_at + interval '0.9 s' as hb from fleet.sessions")[0]["hb"])
        # never-run tasks, older than the hand-offs to come, of the same priority
        older = [f.enqueue("work", f"older:{i}", {"steps": 1, "sleep": 0.01}) for i in range(2)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        kill_leftovers(started)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not pids_using(f.workspaces), "an agent outlived its shift"

    (session,) = f.sql("select * from fleet.sessions where lane = 'work'")
    assert (session["state"], session["end_reason"], session["pid"]) == ("ended", "SIGTERM", proc.pid)
    sessions = {}
    for task_id in hang:
        t = f.task(task_id)
        assert (t["state"], t["carry_over"], t["handoffs"], t["failures"], t["evaporations"]) == (
            "queued", True, 1, 0, 0)
        snap = t["handoff"]
        assert "SIGTERM" in snap["reason"]
        assert Path(snap["log_path"]).is_file()
        assert 0 < snap["ran_seconds"] < 60
        assert "agent_session" in snap
        # the agent never printed a result record; its init record named its session
        assert snap["agent_session"] and snap["agent_session"] == t["agent_session"]
        sessions[task_id] = snap["agent_session"]
        assert [r["outcome"] for r in f.runs(task_id)] == ["handed_off"]
    (lh,) = f.sql("select * from fleet.lane_handoffs where session_id = %s", (session["id"],))
    assert sorted(lh["handed_off"]) == sorted(hang)
    assert lh["end_reason"] == "SIGTERM"
    md = list((f.workspaces / "work" / "handoffs").glob("*.md"))
    assert len(md) == 1 and str(session["id"]) in md[0].name
    assert "Lane hand-off: work" in md[0].read_text()

    # the next shift: the hand-offs first, before the older never-run tasks; agents that end
    f.sql("update fleet.tasks set payload = '{\"steps\": 1, \"sleep\": 0.01}' where id = any(%s)", (hang,))
    nxt = f.run_shift("work", slots=1)
    assert nxt.outcomes == {"done": 4}
    claimed = [r["task_id"] for r in f.sql(
        "select task_id from fleet.journal where kind = 'claimed' and session_id = %s order by id",
        (nxt.session,))]
    assert set(claimed[:2]) == set(hang) and set(claimed[2:]) == set(older)
    for task_id in hang:
        sess = sessions[task_id]
        run = f.runs(task_id)[1]
        log = Path(run["log_path"]).read_text()
        assert f"session-arg=[{sess}] session-env=[{sess}]" in log
        assert run["agent_session"] == sess  # the agent resumed the same session
        ws = f.workspace("work", f.task(task_id)["key"])
        assert json.loads((ws / ".fleet" / "task.json").read_text())["agent_session"] == sess
        assert sess in (ws / ".fleet" / "handoff.md").read_text()
    for task_id in older:  # a never-run task has no session to resume
        assert "session-arg=[] session-env=[]" in Path(f.runs(task_id)[0]["log_path"]).read_text()


def test_an_agent_the_stop_signal_reached_first_is_handed_off_not_failed(fleet_of, monkeypatch) -> None:
    """systemd's stop (KillMode=control-group) sends SIGTERM to the shift and its agents at once:
    an agent that ends of it before the shift stops its agents is handed off like them, with no
    attempt spent (it was judged a failed attempt: its exit 143 was reaped as any other's)."""
    f = fleet_of()
    task_id = f.enqueue("work", "hang", {"mode": "hang"})
    shift = f.shift("work", max_seconds=60)
    hold, inside, release = threading.Event(), threading.Event(), threading.Event()
    heartbeat = shift.store.heartbeat

    def held(*args: Any, **kw: Any) -> Any:  # the main loop waits here while the test kills the agent
        if hold.is_set():
            inside.set()
            release.wait(20)
        return heartbeat(*args, **kw)

    monkeypatch.setattr(shift.store, "heartbeat", held)
    thread, out = run_in_thread(shift)
    started: set[int] = set()
    try:
        job = wait_for("the agent to run", lambda: shift.jobs.get(task_id), timeout=20)
        started = pids_using(f.workspace("work", "hang")) | {job.agent.pid}
        hold.set()
        assert inside.wait(20), "the shift never heartbeat"
        os.kill(job.agent.pid, signal.SIGTERM)  # the signal reaches the agent first
        wait_for("the agent to end", lambda: not alive(job.agent.pid) or _zombie(job.agent.pid), timeout=20)
        shift.request_stop("SIGTERM")  # and then the shift's own handler runs
        release.set()
        summary = joined(thread, out)
    finally:
        release.set()
        kill_leftovers(started)
    assert summary.outcomes == {"handed_off": 1}, summary
    t = f.task(task_id)
    assert (t["state"], t["failures"], t["handoffs"]) == ("queued", 0, 1)
    assert "SIGTERM" in t["handoff"]["reason"]


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


# -- 5. SIGKILL: no agent outlives its shift


def test_sigkill_of_a_shift_leaves_no_agent_alive(fleet_of) -> None:
    f = fleet_of()
    for i in range(2):
        f.enqueue("work", f"hang:{i}", {"mode": "hang"})
    proc = f.spawn_shift("work", "--slots", "2", "--max-seconds", "60")
    ours: set[int] = {proc.pid}
    try:
        def agents() -> set[int] | None:
            supervisors = proc_children(proc.pid)
            found = {a for s in supervisors for a in proc_children(s)}
            return found if len(supervisors) == 2 and len(found) == 2 else None

        agent_pids = wait_for("two supervisors with an agent each", agents, timeout=30)
        supervisors = proc_children(proc.pid)
        ours |= supervisors | agent_pids
        for pid in agent_pids:  # the agents are the example agent, working in a task workspace
            assert os.readlink(f"/proc/{pid}/cwd").startswith(str(f.workspaces))
            assert b"worker.dev.example_agent" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ours |= pids_using(f.workspaces)
        assert agent_pids <= pids_using(f.workspaces)

        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        wait_for("every agent and supervisor to die",
                 lambda: not any(alive(p) for p in ours) and not pids_using(f.workspaces), timeout=10)
    finally:
        kill_leftovers(ours)


# -- 6. fencing: a lease lost or a task cancelled behind the shift's back


def test_a_lost_lease_kills_the_agent_and_the_shift_writes_nothing_for_the_task(fleet_of) -> None:
    f = fleet_of()
    task_id = f.enqueue("work", "hang", {"mode": "hang"})
    shift = f.shift("work", once=False, max_tasks=2, max_seconds=30)
    thread, out = run_in_thread(shift)
    ws = f.workspace("work", "hang")
    started: set[int] = set()
    try:
        started = wait_for("the agent to run", lambda: pids_using(ws) if len(pids_using(ws)) >= 2 else None)
        # released (as a monitor would) and claimed by another session, in one transaction,
        # so the shift cannot take it back first
        with psycopg.connect(f.db_url, autocommit=False) as c:
            assert c.execute("select fleet._release(%s, 'test')", (task_id,)).fetchone()[0] == "queued"
            other = c.execute("select fleet.open_session('work', 'elsewhere', 4242, null, 60)").fetchone()[0]
            (got,) = c.execute("select id, lease_token from fleet.claim(%s, 1)", (other,)).fetchall()
            assert got[0] == task_id
            other_token = got[1]
            c.commit()
        t0 = time.monotonic()
        wait_for("the agent to be killed", lambda: not pids_using(ws), timeout=10)
        took = time.monotonic() - t0
        assert took < shift.heartbeat_every + 1.5, f"the agent lived on {took:.2f} s"
        ok = f.enqueue("work", "after", {"steps": 1, "sleep": 0.01})
        summary = joined(thread, out)
    finally:
        kill_leftovers(started)
    assert summary.reason == "task-budget"
    assert summary.outcomes == {"lost": 1, "done": 1}  # no complete/fail was even tried
    t = f.task(task_id)
    assert (t["state"], t["session_id"], t["lease_token"]) == ("running", other, other_token)
    kinds = f.event_kinds(task_id)
    assert kinds == ["enqueued", "claimed", "repaired", "claimed"]
    first = f.runs(task_id)[0]
    assert first["outcome"] == "lost" and first["exit_code"] == 128 + signal.SIGKILL
    assert f.task(ok)["state"] == "done"


def test_a_cancelled_task_has_its_agent_stopped_within_a_heartbeat(fleet_of) -> None:
    f = fleet_of()
    task_id = f.enqueue("work", "hang", {"mode": "hang"})
    shift = f.shift("work")
    thread, out = run_in_thread(shift)
    ws = f.workspace("work", "hang")
    started: set[int] = set()
    try:
        started = wait_for("the agent to run", lambda: pids_using(ws) if len(pids_using(ws)) >= 2 else None)
        assert f.monitor_store.cancel(task_id) == "cancelled"  # an operator's call
        t0 = time.monotonic()
        wait_for("the agent to be stopped", lambda: not pids_using(ws), timeout=10)
        took = time.monotonic() - t0
        assert took < shift.heartbeat_every + 1.5, f"the agent lived on {took:.2f} s"
        summary = joined(thread, out)
    finally:
        kill_leftovers(started)
    assert summary.reason == "idle" and summary.outcomes == {"cancelled": 1}
    t = f.task(task_id)
    assert (t["state"], t["failures"], t["evaporations"]) == ("cancelled", 0, 0)
    assert f.event_kinds(task_id) == ["enqueued", "claimed", "cancelled"]
    (run,) = f.runs(task_id)
    assert run["outcome"] == "cancelled" and run["exit_code"] == 128 + signal.SIGKILL


def _claim_answer_lost_once(monkeypatch: pytest.MonkeyPatch, shift: Shift) -> None:
    """The shift's first claim commits and its answer is lost on the way (as when the connection
    breaks after the commit): the real store's claim runs, then the call fails as a broken one does."""
    claim = shift.store.claim
    calls = []

    def lost_once(*args: Any, **kw: Any) -> Any:
        got = claim(*args, **kw)
        calls.append(got)
        if len(calls) == 1:
            assert got, "the test's claim found no task"
            raise DatabaseUnavailable("server closed the connection unexpectedly (after the claim committed)")
        return got

    monkeypatch.setattr(shift.store, "claim", lost_once)


def test_a_claim_whose_answer_was_lost_runs_its_tasks_without_spending_an_attempt(fleet_of, monkeypatch) -> None:
    f = fleet_of()
    ids = [f.enqueue("work", f"lost-answer:{i}", dict(QUICK)) for i in range(2)]
    shift = f.shift("work")
    _claim_answer_lost_once(monkeypatch, shift)
    summary = shift.run()
    assert summary.reason == "idle" and summary.claimed == 2 and summary.outcomes == {"done": 2}
    for task_id in ids:
        t = f.task(task_id)
        # without fleet.claimed the next heartbeat (or the idle stop's close) released the tasks the
        # shift never heard of: an evaporation each, and a second claim
        assert (t["state"], t["attempts"], t["evaporations"], t["failures"]) == ("done", 1, 0, 0)
        assert [(r["outcome"], r["session_id"]) for r in f.runs(task_id)] == [("done", summary.session)]
        assert "repaired" not in f.event_kinds(task_id)


def test_a_shift_that_ends_with_a_claim_unanswered_gives_its_tasks_back_at_no_cost(fleet_of, monkeypatch) -> None:
    f = fleet_of()
    task_id = f.enqueue("work", "lost-answer", dict(QUICK))
    shift = f.shift("work", max_seconds=3)
    shift.heartbeat_every = 0.5  # heartbeats while the claim is unanswered: none may release the task
    _claim_answer_lost_once(monkeypatch, shift)
    claimed = shift.store.claimed
    asked = []

    def unanswered_until_the_deadline(*args: Any, **kw: Any) -> Any:
        asked.append(time.monotonic())
        if time.monotonic() < shift.deadline:
            raise DatabaseUnavailable("connection refused")
        return claimed(*args, **kw)

    monkeypatch.setattr(shift.store, "claimed", unanswered_until_the_deadline)
    heartbeats = []
    heartbeat = shift.store.heartbeat
    monkeypatch.setattr(shift.store, "heartbeat",
                        lambda *a, **kw: heartbeats.append(a[1]) or heartbeat(*a, **kw))
    summary = shift.run()
    assert summary.reason == "deadline" and len(asked) >= 3
    assert len(heartbeats) >= 3 and all(h is None for h in heartbeats[1:]), heartbeats  # none named after it
    t = f.task(task_id)
    assert (t["state"], t["attempts"], t["evaporations"], t["failures"], t["transients"]) == ("queued", 1, 0, 0, 1)
    assert [r["outcome"] for r in f.runs(task_id)] == ["transient"]
    assert "repaired" not in f.event_kinds(task_id)
    # and the next shift runs it
    assert f.run_shift("work").outcomes == {"done": 1} and f.task(task_id)["state"] == "done"


# -- 7. routes


def test_a_task_routed_from_bugfix_to_review_keeps_its_id_and_stage_history(fleet_of) -> None:
    f = fleet_of({
        "bugfix": lane_defaults(),
        "review": lane_defaults(accepts_from=["bugfix"]),
        "docs": lane_defaults(accepts_from=[]),  # accepts no routes
    })
    task_id = f.enqueue("bugfix", "issue:7", {"steps": 1, "sleep": 0.01, "route": "review",
                                              "route_note": "fixed X"})
    refused = f.enqueue("bugfix", "issue:8", {"steps": 1, "sleep": 0.01, "route": "docs",
                                              "route_note": "nope"}, max_attempts=1)
    with structlog.testing.capture_logs() as logs:
        summary = f.run_shift("bugfix")
    assert summary.outcomes == {"routed": 1, "failed": 1}
    # the shift's log says what the database did: one route, one refusal (never "routed" for both)
    said = [(e["event"], e.get("task")) for e in logs if "rout" in e["event"] or "refused" in e["event"]]
    assert [e for e, _ in said].count("routed") == 1, said
    assert ("final call refused by the database: the attempt failed instead", refused) in said, said
    t = f.task(task_id)
    assert (t["lane"], t["state"], t["attempts"]) == ("review", "queued", 0)

    t = f.task(refused)
    assert (t["lane"], t["state"], t["failures"]) == ("bugfix", "dead", 1)
    assert "route to 'docs' refused" in t["last_error"]
    assert [r["outcome"] for r in f.runs(refused)] == ["failed"]

    assert f.run_shift("review").outcomes == {"done": 1}
    t = f.task(task_id)
    assert (t["id"], t["lane"], t["state"]) == (task_id, "review", "done")
    assert len(t["stages"]) == 1
    stage = t["stages"][0]
    assert (stage["lane"], stage["routed_to"], stage["note"], stage["attempts"]) == (
        "bugfix", "review", "fixed X", 1)
    assert [(r["lane"], r["outcome"]) for r in f.runs(task_id)] == [("bugfix", "routed"), ("review", "done")]
    prompt = (f.workspace("review", "issue:7") / ".fleet" / "prompt.md").read_text()
    assert "fixed X" in prompt and f.instructions_marker("review") in prompt

    shown = f.cli("show", str(task_id))
    assert shown.returncode == 0, shown.stderr
    assert "bugfix" in shown.stdout and "review" in shown.stdout and "fixed X" in shown.stdout
    shown = json.loads(f.cli("show", str(task_id), "--json").stdout)
    assert [r["lane"] for r in shown["runs"]] == ["bugfix", "review"]


# -- 8. fleet checkpoint


def test_fleet_checkpoint_writes_the_workspace_checkpoint(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / ".fleet").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") and k != "DATABASE_URL"}
    cmd = [sys.executable, "-m", "monitor.cli", "checkpoint", "--data", '{"x": 1}']
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(cmd, cwd=root, env={**env, "FLEET_WORKSPACE": str(ws)}, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads((ws / ".fleet" / "checkpoint.json").read_text()) == {"x": 1}

    (ws / ".fleet" / "checkpoint.json").unlink()
    missing = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert missing.returncode == 1
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and "workspace" in lines[0].lower(), missing.stderr
    assert not (ws / ".fleet" / "checkpoint.json").exists()


def test_a_checkpoint_written_with_fleet_checkpoint_is_stored_at_the_next_heartbeat(fleet_of) -> None:
    f = fleet_of()
    task_id = f.enqueue("work", "hang", {"mode": "hang"})
    shift = f.shift("work")
    thread, out = run_in_thread(shift)
    ws = f.workspace("work", "hang")
    started: set[int] = set()
    try:
        started = wait_for("the agent to run", lambda: pids_using(ws) if len(pids_using(ws)) >= 2 else None)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
        done = f.cli("checkpoint", "--data", '{"note": "half way"}', env={**env, "FLEET_WORKSPACE": str(ws)})
        assert done.returncode == 0, done.stderr
        wait_for("the checkpoint to be stored",
                 lambda: f.task(task_id)["checkpoint"] == {"note": "half way"}, timeout=5)
        assert f.task(task_id)["checkpoint_seq"] == 1
        f.sql("select fleet.cancel(%s)", (task_id,))
        joined(thread, out)
    finally:
        kill_leftovers(started)


# -- 9. the workspace


def test_workspace_hidden_files_are_private_kept_and_the_prompt_carries_the_checkpoint(fleet_of) -> None:
    f = fleet_of()
    repo = f.workspace("work", "repo:1")
    (repo / ".fleet").mkdir(parents=True)
    (repo / ".fleet" / "README.md").write_text("the repository's own README\n")
    task_id = f.enqueue("work", "repo:1", {"fail_attempts": 1, "steps": 2, "sleep": 0.01,
                                           "marker": "PAYLOAD-MARKER-42"})
    fresh = f.enqueue("work", "fresh:1", dict(QUICK))
    assert f.run_shift("work").outcomes == {"failed": 1, "done": 2}
    t = f.task(task_id)
    assert (t["state"], t["attempts"]) == ("done", 2)

    assert (repo / ".fleet" / "README.md").read_text() == "the repository's own README\n"
    assert ".fleet/README.md" not in json.loads((repo / ".fleet" / "rendered.json").read_text())
    readme = (f.workspace("work", "fresh:1") / ".fleet" / "README.md").read_text()
    assert "This workspace is run by lanefleet" in readme and "fresh:1" in readme and "{{" not in readme

    for ws in (repo, f.workspace("work", "fresh:1")):
        info = json.loads((ws / ".fleet" / "task.json").read_text())
        assert stat.S_IMODE((ws / ".fleet" / "task.json").stat().st_mode) == 0o600
    assert info["id"] == fresh and info["key"] == "fresh:1"

    # the prompt of attempt 2: lane instructions, payload, the failure and attempt 1's checkpoint
    prompt = (repo / ".fleet" / "prompt.md").read_text()
    assert f.instructions_marker("work") in prompt
    assert "PAYLOAD-MARKER-42" in prompt
    assert "attempt: 2" in prompt
    assert "Where you left off" in prompt and '"step": 2' in prompt
    assert "the tests still fail" in prompt
    first_prompt = (f.workspace("work", "fresh:1") / ".fleet" / "prompt.md").read_text()
    assert "Where you left off" not in first_prompt


# -- 7. an idle shift backs off its claims


def test_an_idle_shift_backs_off_its_claims_and_still_picks_up_new_work(fleet_of, monkeypatch) -> None:
    f = fleet_of()
    shift = f.shift("work", once=False, max_tasks=1, max_seconds=60)
    claims: list[float] = []
    claim = shift.store.claim

    def counted(*args: Any, **kw: Any) -> Any:  # the real store's claim, counted
        claims.append(time.monotonic())
        return claim(*args, **kw)

    monkeypatch.setattr(shift.store, "claim", counted)
    thread, out = run_in_thread(shift)
    time.sleep(6.5)
    idle = len(claims)
    # without the back-off a claim every poll_seconds; with it, the gaps double up to IDLE_CLAIM_MAX
    p, t, schedule = shift.poll_seconds, 0.0, [0.0]
    while t + min(p, IDLE_CLAIM_MAX) <= 6.5 - 0.3:
        t += min(p, IDLE_CLAIM_MAX)
        schedule.append(t)
        p *= 2
    got = [round(c - claims[0], 2) for c in claims]
    assert 3 <= idle <= len(schedule) + 1 < 6.5 / shift.poll_seconds / 2, (got, schedule)
    assert claims[-1] - claims[-2] >= 1.5, got  # never more than poll_seconds without the back-off
    enqueued = time.monotonic()
    task = f.enqueue("work", "late", {"steps": 1, "sleep": 0.01})
    summary = joined(thread, out)
    assert summary.claimed == 1 and f.task(task)["state"] == "done"
    picked = next(c for c in claims if c >= enqueued)
    assert picked - enqueued <= 5.5, "new work waited past the longest idle back-off"
