"""Batches through real shifts, against a real temporary git repository with a
bare origin, the scripted agent making real commits: members run one after another, each landed on
the integration branch batch/<id> fast-forward only, or evicted; an inconclusive gate or a failed
landing blocks the batch until `fleet resume --batch`; the tail ships once.

Every test runs on both back-ends: on the Supabase stack the shift's batch calls go through PostgREST
RPC with a worker key, `fleet batch create` / `fleet resume --batch` with an operator key."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fleetkit import Backend, Fleet, alive, lane_defaults, wait_for
from gitkit import bare_origin, git, log_of, mirror_held

pytestmark = pytest.mark.parametrize("backend", ["postgres", "supabase"], indirect=True)

# The verify gate: fails (task-failed, with output) for a member whose payload says gate_fail;
# crashes (exit 1, no output: automation-broken) while <tmp>/gate_mode says crash; with payload
# sabotage=<origin>, pushes a commit to origin's integration branch behind the runner's back.
GATE = r'''
import json, os, subprocess, sys, tempfile
from pathlib import Path
payload = json.loads(Path(".fleet/task.json").read_text())["payload"]
mode = Path(sys.argv[1]).read_text().strip() if Path(sys.argv[1]).exists() else "ok"
if mode == "crash":
    sys.exit(1)
if payload.get("gate_fail"):
    print("FAILED test_member: assertion failed")
    sys.exit(1)
if payload.get("guard"):  # `fleet guard` in a member checks the carrier's lease
    proc = subprocess.run(["fleet", "guard", "--", sys.executable, "-c", "print('guarded ran')"],
                          capture_output=True, text=True)
    print(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print("fleet-gate: automation-broken the guard refused")
        sys.exit(1)
if payload.get("sabotage"):
    branch = "batch/" + os.environ["FLEET_BATCH_ID"]
    d = tempfile.mkdtemp()
    git = ["git", "-c", "user.name=x", "-c", "user.email=x@example.invalid"]
    subprocess.run([*git, "clone", "-q", "-b", branch, payload["sabotage"], d], check=True)
    Path(d, "other.txt").write_text("behind your back\n")
    subprocess.run([*git, "-C", d, "add", "other.txt"], check=True)
    subprocess.run([*git, "-C", d, "commit", "-q", "-m", "pushed behind the runner's back"], check=True)
    subprocess.run([*git, "-C", d, "push", "-q", "origin", branch], check=True)
print("all tests passed")
'''

# The ship command: appends one line per run, the landed members (and "rerun" when the runner says
# an earlier run's outcome was never recorded); while <shipped>.kill names a pid, SIGKILLs it (the
# shift) after shipping, once.
SHIP = r'''
import os, signal, sys, time
rerun = " rerun" if os.environ.get("FLEET_BATCH_SHIP_RERUN") == "1" else ""
with open(sys.argv[1], "a") as fh:
    fh.write(os.environ["FLEET_BATCH_ID"] + ":" + os.environ["FLEET_BATCH_MEMBERS"] + rerun + "\n")
kill = sys.argv[1] + ".kill"
if os.path.exists(kill):
    pid = int(open(kill).read())
    os.remove(kill)
    os.kill(pid, signal.SIGKILL)
    time.sleep(30)
'''


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    return bare_origin(tmp_path)


@pytest.fixture
def batch_fleet(backend: Backend, tmp_path: Path, origin: Path):
    made: list[Fleet] = []
    gate, ship = tmp_path / "gate.py", tmp_path / "ship.py"
    gate.write_text(GATE)
    ship.write_text(SHIP)

    def make(**lane: object) -> Fleet:
        settings = {"repo": str(origin), "base": "main", "lease_seconds": 3,
                    "verify": [sys.executable, str(gate), str(tmp_path / "gate_mode")],
                    "ship": [sys.executable, str(ship), str(tmp_path / "shipped.txt")], **lane}
        f = Fleet(backend, tmp_path, {"code": lane_defaults(**settings)})
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def rev(origin: Path, ref: str) -> str:
    return git("--git-dir", str(origin), "rev-parse", ref)


def member_payload(key: str, **extra: Any) -> dict[str, Any]:
    return {"steps": 1, "sleep": 0.01, "commit": f"{key}.txt", **extra}


def create(f: Fleet, keys: list[str], **kw: Any) -> int:
    return int(f.monitor_store.batch_call("batch_create", {"p_lane": "code", "p_keys": keys, "p_max": kw.get("max", 4),
                                                   "p_profile": None}))


def members(f: Fleet, batch: int) -> list[dict[str, Any]]:
    return f.sql("select m.*, t.key from fleet.batch_members m join fleet.tasks t on t.id = m.task_id "
                 "where m.batch_id = %s order by n", (batch,))


def batch_row(f: Fleet, batch: int) -> dict[str, Any]:
    return f.sql("select * from fleet.batches where id = %s", (batch,))[0]


def carrier_events(f: Fleet, batch: int) -> list[str]:
    carrier = batch_row(f, batch)["task_id"]
    return [k for k in f.event_kinds(carrier) if k.startswith("batch_")]


def test_a_batch_lands_members_in_order_evicts_a_failing_one_and_ships_once(batch_fleet, origin: Path,
                                                                              tmp_path: Path) -> None:
    f = batch_fleet()
    keys = ["m1", "m2", "m3", "m4"]
    ids = {k: f.enqueue("code", k, member_payload(k, gate_fail=(k == "m2"))) for k in keys}
    out = f.cli("batch", "create", "code", *keys, "--json")
    assert out.returncode == 0, out.stderr
    batch = json.loads(out.stdout)["batch"]
    assert {f.task(i)["state"] for i in ids.values()} == {"batched"}
    carrier = f.task(batch_row(f, batch)["task_id"])
    assert (carrier["kind"], carrier["key"], carrier["payload"]) == ("batch", f"batch:{batch}", {"batch": batch})

    summary = f.run_shift("code", max_tasks=1)  # the batch takes one slot and one claim

    assert summary.claimed == 1 and summary.outcomes.get("done") == 1
    b = batch_row(f, batch)
    assert b["state"] == "done" and f.task(b["task_id"])["state"] == "done"
    ms = members(f, batch)
    assert [m["state"] for m in ms] == ["landed", "evicted", "landed", "landed"]
    # landed in order, fast-forward only: each landing starts where the previous one ended
    base = rev(origin, "main")
    landed = [m for m in ms if m["state"] == "landed"]
    assert landed[0]["landed_from"] == base
    assert [m["landed_from"] for m in landed[1:]] == [m["landed_to"] for m in landed[:-1]]
    # origin's integration branch holds exactly the landed commits, in order
    assert log_of(origin, f"batch/{batch}") == [
        "m4: step 1/1 (attempt 1)", "m3: step 1/1 (attempt 1)", "m1: step 1/1 (attempt 1)", "initial"]
    assert rev(origin, f"batch/{batch}") == landed[-1]["landed_to"]
    assert log_of(origin, "main") == ["initial"], "the base is never written"
    # the evicted member is an ordinary queued task again, with its failure and the gate's evidence
    m2 = f.task(ids["m2"])
    assert (m2["state"], m2["batch_id"], m2["failures"]) == ("queued", None, 1)
    assert "FAILED test_member" in m2["last_error"]
    assert ms[1]["gate"] == "task-failed" and "FAILED test_member" in ms[1]["evidence"]
    assert [f.task(ids[k])["state"] for k in ("m1", "m3", "m4")] == ["done", "done", "done"]
    # shipped once, with the landed members
    assert (tmp_path / "shipped.txt").read_text() == f"{batch}:m1 m3 m4\n"
    kinds = carrier_events(f, batch)
    assert kinds.count("batch_setup") == 1 and kinds.count("batch_member_advanced") == 4
    assert kinds.count("batch_landed") == 3 and kinds.count("batch_evicted") == 1
    assert kinds.count("batch_torn_down") == 4 and kinds.count("batch_shipped") == 1
    assert kinds[-1] == "batch_done"
    # member worktrees are torn down; the report says what happened
    assert not any(Path(m["worktree"]).exists() for m in ms)
    report = b["report"]
    assert report["landed"] == ["m1", "m3", "m4"] and report["evicted"] == ["m2"]
    assert [m["gate"] for m in report["members"]] == ["ok", "task-failed", "ok", "ok"]
    assert all(m["tokens"] > 0 for m in report["members"]) and report["ship"]["exit_code"] == 0
    ov = f.sql("select * from fleet.batch_overview where id = %s", (batch,))[0]
    assert (ov["landed"], ov["evicted"], ov["pending"], ov["state"]) == (3, 1, 0, "done")
    assert ov["tokens"] == report["tokens"] > 0
    # each member's agent is a run of the member's own task, closed, its outcome the member's; the
    # carrier's run carries none of their tokens
    for m in ms:
        (run,) = f.runs(m["task_id"])
        assert run["id"] == m["run_id"] and run["session_id"] == f.runs(b["task_id"])[0]["session_id"]
        assert (run["outcome"], run["gate"], run["reason"]) == (
            ("done", "ok", None) if m["state"] == "landed" else ("failed", "task-failed", "verify-failed"))
        assert run["ended_at"] is not None and run["exit_code"] == 0
        tokens = sum(run[k] for k in ("input_tokens", "cache_creation_tokens", "cache_read_tokens", "output_tokens"))
        assert tokens == m["tokens"] > 0
    (carrier_run,) = f.runs(b["task_id"])
    assert carrier_run["outcome"] == "done" and carrier_run["input_tokens"] == carrier_run["output_tokens"] == 0
    # the cohort figures split batched from unbatched: all four were batched, one evicted, one ship
    split = {r["cohort"]: r for r in f.sql(
        "select * from fleet.cohort_split(now() - interval '1 hour', now() + interval '1 hour', 'code')")}
    assert {k: split["batched"][k] for k in ("tasks", "completed", "open", "batches", "batch_members", "evicted",
                                              "ship_runs", "runs", "total_tokens")} == {
        "tasks": 4, "completed": 3, "open": 1, "batches": 1, "batch_members": 4, "evicted": 1, "ship_runs": 1,
        "runs": 4, "total_tokens": report["tokens"]}
    assert split["unbatched"]["tasks"] == 0

    shown = f.cli("batch", "show", str(batch), "--json")
    assert shown.returncode == 0, shown.stderr
    assert [m["state"] for m in json.loads(shown.stdout)["members"]] == ["landed", "evicted", "landed", "landed"]


def test_a_crashing_gate_blocks_the_batch_and_resume_continues_without_landing_twice(
        batch_fleet, origin: Path, tmp_path: Path) -> None:
    f = batch_fleet()
    for k in ("a", "b"):
        f.enqueue("code", k, member_payload(k))
    batch = create(f, ["a", "b"])
    (tmp_path / "gate_mode").write_text("crash")

    f.run_shift("code", max_tasks=1)

    b = batch_row(f, batch)
    assert (b["state"], b["block_reason"]) == ("blocked", "automation-broken")
    carrier = f.task(b["task_id"])
    assert (carrier["state"], carrier["block_reason"]) == ("blocked", "automation-broken")
    ms = members(f, batch)
    assert [(m["state"], m["gate"]) for m in ms] == [("running", "automation-broken"), ("pending", None)]
    assert log_of(origin, f"batch/{batch}") == ["initial"], "nothing landed"
    assert "batch_blocked" in carrier_events(f, batch)

    (tmp_path / "gate_mode").write_text("ok")  # the gate is fixed
    out = f.cli("resume", "--batch", str(batch))
    assert out.returncode == 0, out.stderr
    assert batch_row(f, batch)["state"] == "running" and f.task(b["task_id"])["state"] == "queued"

    f.run_shift("code", max_tasks=1)

    assert batch_row(f, batch)["state"] == "done"
    # member a's gate ran again, not its agent: one commit of a, landed once
    assert log_of(origin, f"batch/{batch}") == ["b: step 1/1 (attempt 2)", "a: step 1/1 (attempt 1)", "initial"]
    kinds = carrier_events(f, batch)
    assert kinds.count("batch_landed") == 2 and kinds.count("batch_resumed") == 1
    assert kinds.count("batch_member_advanced") == 2
    assert (tmp_path / "shipped.txt").read_text() == f"{batch}:a b\n"


def test_a_member_whose_landing_cannot_fast_forward_blocks_with_landing_failed(batch_fleet, origin: Path) -> None:
    f = batch_fleet()
    f.enqueue("code", "s", member_payload("s", sabotage=str(origin)))
    f.enqueue("code", "t", member_payload("t"))
    batch = create(f, ["s", "t"])

    f.run_shift("code", max_tasks=1)

    b = batch_row(f, batch)
    assert (b["state"], b["block_reason"]) == ("blocked", "landing-failed")
    assert f.task(b["task_id"])["block_reason"] == "landing-failed"
    ms = members(f, batch)
    assert [(m["state"], m["gate"]) for m in ms] == [("running", "ok"), ("pending", None)]
    assert log_of(origin, f"batch/{batch}") == ["pushed behind the runner's back", "initial"], \
        "origin's integration branch is left as it was"
    kinds = carrier_events(f, batch)
    assert "batch_landing_failed" in kinds and kinds[-1] == "batch_blocked"
    assert "does not fast-forward" in f.task(b["task_id"])["last_error"]


def test_fleet_guard_in_a_member_checks_the_carriers_lease(batch_fleet, origin: Path) -> None:
    f = batch_fleet()
    f.enqueue("code", "g", member_payload("g", guard=True))
    batch = create(f, ["g"])
    f.run_shift("code", max_tasks=1)
    assert batch_row(f, batch)["state"] == "done", batch_row(f, batch)
    assert members(f, batch)[0]["state"] == "landed"


def test_a_lane_without_a_repo_cannot_make_a_batch(backend: Backend, tmp_path: Path) -> None:
    f = Fleet(backend, tmp_path, {"code": lane_defaults()})
    try:
        f.enqueue("code", "x", {})
        out = f.cli("batch", "create", "code", "x")
        assert out.returncode != 0 and "no `repo`" in (out.stderr + out.stdout)
        # made anyway (the database does not know the config): the shift fails the carrier clearly
        batch = create(f, ["x"])
        f.run_shift("code", max_tasks=1)
        carrier = f.task(batch_row(f, batch)["task_id"])
        assert carrier["state"] == "dead" and "has no `repo`" in carrier["last_error"]
        # and a dead carrier gives its members back to the queue
        assert f.task(f.sql("select id from fleet.tasks where key = 'x'")[0]["id"])["state"] == "queued"
        assert batch_row(f, batch)["state"] == "cancelled"
    finally:
        f.close()


def test_batch_create_refuses_tasks_that_are_not_queued_in_the_lane(batch_fleet) -> None:
    f = batch_fleet()
    f.enqueue("code", "q", {})
    batch = create(f, ["q"])
    with pytest.raises(Exception, match="batched"):
        create(f, ["q"])  # already a member
    with pytest.raises(Exception, match="unknown task"):
        create(f, ["nope"])
    for k in ("a", "b", "c"):
        f.enqueue("code", k, {})
    with pytest.raises(Exception, match="maximum"):
        create(f, ["a", "b", "c"], max=2)
    assert batch_row(f, batch)["state"] == "open"


def test_a_shift_killed_during_member_2_is_continued_on_the_same_branch(batch_fleet, origin: Path) -> None:
    f = batch_fleet()
    f.enqueue("code", "k1", member_payload("k1"))
    f.enqueue("code", "k2", member_payload("k2", steps=3, sleep=0.6))
    f.enqueue("code", "k3", member_payload("k3"))
    batch = create(f, ["k1", "k2", "k3"])
    proc = f.spawn_shift("code", "--max-seconds", "60")
    try:
        def k2_committed() -> bool:
            ms = members(f, batch)
            if ms[1]["state"] != "running" or not ms[1]["worktree"]:
                return False
            try:
                return "k2: step 1/3" in git("log", "--format=%s", cwd=Path(ms[1]["worktree"]))
            except AssertionError:
                return False

        wait_for("member 2 to commit its first step", k2_committed, timeout=60)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if alive(proc.pid):
            proc.kill()
    carrier_id = batch_row(f, batch)["task_id"]
    session = f.task(carrier_id)["session_id"]
    # the monitor's repair: the dead shift's session is lost, the carrier goes back to the queue
    f.monitor_store.declare_session_lost(session, "test: shift SIGKILLed")
    assert f.task(carrier_id)["state"] == "queued"
    k2_branch = members(f, batch)[1]["branch"]

    f.run_shift("code", max_tasks=1)

    assert batch_row(f, batch)["state"] == "done"
    ms = members(f, batch)
    assert [m["state"] for m in ms] == ["landed", "landed", "landed"]
    assert ms[1]["branch"] == k2_branch
    history = log_of(origin, f"batch/{batch}")
    assert history[-2:] == ["k1: step 1/1 (attempt 1)", "initial"] and history[0] == "k3: step 1/1 (attempt 2)"
    k2 = history[1:-2]
    assert k2[-1] == "k2: step 1/3 (attempt 1)", "the first shift's commit is kept on the member branch"
    assert k2[0].startswith("k2: step 3/3"), "the member's work is complete"
    assert "k2: step 3/3 (attempt 2)" in k2 or len(k2) == 3, "the second shift went on from the checkpoint"
    kinds = carrier_events(f, batch)
    assert kinds.count("batch_landed") == 3 and kinds.count("batch_member_advanced") == 3


def test_a_shift_killed_after_ship_ran_ships_again_told_it_is_a_rerun(batch_fleet, tmp_path: Path) -> None:
    f = batch_fleet()
    f.enqueue("code", "k1", member_payload("k1"))
    batch = create(f, ["k1"])
    shipped = tmp_path / "shipped.txt"
    proc = f.spawn_shift("code", "--max-seconds", "60")
    try:
        Path(f"{shipped}.kill").write_text(str(proc.pid))
        proc.wait(timeout=60)  # the ship command SIGKILLs it after shipping, before the outcome is recorded
    finally:
        if alive(proc.pid):
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert shipped.read_text() == f"{batch}:k1\n"
    b = batch_row(f, batch)
    assert b["state"] == "running" and "ship" not in b["report"] and len(b["report"]["ship_started"]) == 1
    f.monitor_store.declare_session_lost(f.task(b["task_id"])["session_id"], "test: shift SIGKILLed")

    f.run_shift("code", max_tasks=1)

    b = batch_row(f, batch)
    assert b["state"] == "done" and b["report"]["ship"]["exit_code"] == 0
    assert shipped.read_text() == f"{batch}:k1\n{batch}:k1 rerun\n", "the command was told it may have run"
    assert [s["attempt"] for s in b["report"]["ship_started"]] == [1, 2]
    kinds = carrier_events(f, batch)
    assert kinds.count("batch_ship_started") == 2 and kinds.count("batch_shipped") == 1
    assert [m["state"] for m in members(f, batch)] == ["landed"], "landed once"


def test_a_shift_ending_during_a_member_hands_the_batch_off_and_the_next_shift_finishes_it(
        batch_fleet, origin: Path) -> None:
    f = batch_fleet()
    f.enqueue("code", "slow", member_payload("slow", steps=20, sleep=0.5))
    batch = create(f, ["slow"])
    shift = f.shift("code", max_seconds=120, once=False)
    thread = threading.Thread(target=shift.run, daemon=True)
    thread.start()

    def committed() -> bool:
        ms = members(f, batch)
        if not ms[0]["worktree"] or not Path(ms[0]["worktree"], ".git").exists():
            return False
        try:
            return "slow: step 1/20" in git("log", "--format=%s", cwd=Path(ms[0]["worktree"]))
        except AssertionError:
            return False

    wait_for("the member's first commit", committed, timeout=60)
    shift.request_stop("test")  # the shift ends during the member's agent (as at its deadline)
    thread.join(60)
    assert not thread.is_alive()

    carrier = f.task(batch_row(f, batch)["task_id"])
    assert (carrier["state"], carrier["handoffs"]) == ("queued", 1)
    m = members(f, batch)[0]
    assert m["state"] == "running"
    pushed = log_of(origin, m["branch"])  # pushed at the hand-off, with its commits
    assert pushed[0].startswith("slow: step ") and pushed[-1] == "initial"

    f.sql("update fleet.tasks set payload = payload || '{\"sleep\": 0.01}' where key = 'slow'")
    f.run_shift("code", max_tasks=1)

    assert batch_row(f, batch)["state"] == "done"
    history = log_of(origin, f"batch/{batch}")
    assert history[0] == "slow: step 20/20 (attempt 2)" and history[-1] == "initial"
    assert set(pushed) <= set(history), "the first shift's commits landed with the rest"


def test_a_long_wait_on_the_mirror_keeps_the_carriers_lease(batch_fleet) -> None:
    """Another shift on the host holds the mirror (a long fetch) for two leases while the batch
    sets up its integration branch: the shift heartbeats from a thread meanwhile, so the monitor
    finds the carrier's lease alive and the batch finishes in its first claim."""
    f = batch_fleet()  # lease_seconds 3: a heartbeat every second
    f.enqueue("code", "m1", member_payload("m1"))
    batch = create(f, ["m1"])
    carrier = batch_row(f, batch)["task_id"]
    shift = f.shift("code", max_tasks=1, max_seconds=60)
    thread = threading.Thread(target=shift.run, daemon=True)
    with mirror_held(shift.mirror()):
        thread.start()
        wait_for("the carrier to be claimed", lambda: f.task(carrier)["state"] == "running", timeout=30)
        time.sleep(7)  # two leases and more, the main loop waiting on the lock in the batch's set-up
        repaired = [a for a in f.monitor_store.reconcile() if a.task_id == carrier]
        assert repaired == [] and f.task(carrier)["state"] == "running"
    thread.join(60)
    assert not thread.is_alive()
    t = f.task(carrier)
    assert (t["state"], t["attempts"], t["handoffs"], t["evaporations"]) == ("done", 1, 0, 0)
    assert [m["state"] for m in members(f, batch)] == ["landed"]


def test_a_lanes_batch_size_composes_batches_of_ready_tasks_in_priority_order(batch_fleet, origin: Path) -> None:
    f = batch_fleet(batch_size=2)
    a = f.enqueue("code", "a", member_payload("a"), priority=5)
    b = f.enqueue("code", "b", member_payload("b"), priority=10)
    c = f.enqueue("code", "c", member_payload("c"), priority=1)

    f.run_shift("code")

    (batch,) = f.sql("select * from fleet.batches")
    assert batch["state"] == "done"
    assert [m["key"] for m in members(f, batch["id"])] == ["b", "a"], "claim order: priority first"
    assert log_of(origin, f"batch/{batch['id']}") == ["a: step 1/1 (attempt 1)", "b: step 1/1 (attempt 1)",
                                                      "initial"]
    # one ready task left: no batch of one, it ran as an ordinary task on its own branch
    assert f.task(c)["batch_id"] is None and f.task(c)["state"] == "done"
    assert log_of(origin, "fleet/code/c")[0] == "c: step 1/1 (attempt 1)"
    assert {f.task(i)["state"] for i in (a, b)} == {"done"}


def test_batch_size_needs_a_repo(backend: Backend) -> None:
    from worker.config import LaneConfig

    with pytest.raises(ValueError, match="batch_size needs a repo"):
        LaneConfig(command=["true"], batch_size=2)


def test_a_member_over_its_task_budget_is_stopped_and_leaves_the_batch_blocked(batch_fleet, origin: Path) -> None:
    f = batch_fleet()
    # 5,000 tokens a step, 40 steps: the member's budget of 12,000 is crossed at the third step
    spender = f.enqueue("code", "spender", member_payload("spender", steps=40, sleep=0.2), max_tokens=12000)
    f.enqueue("code", "fine", member_payload("fine"))
    batch = create(f, ["spender", "fine"])

    f.run_shift("code", max_tasks=1, max_seconds=60)

    assert batch_row(f, batch)["state"] == "done"
    ms = members(f, batch)
    assert [(m["state"], m["gate"]) for m in ms] == [("evicted", "budget"), ("landed", "ok")]
    row = f.task(spender)
    assert (row["state"], row["block_reason"], row["failures"], row["batch_id"]) == ("blocked", "budget", 0, None)
    assert "12,000 budget" in row["last_error"]
    (run,) = f.runs(spender)
    assert (run["outcome"], run["reason"]) == ("blocked", "budget")
    # (all 40 steps would be 200,000: the agent was stopped, not run to its end; no clock asked,
    # which a loaded machine made fail)
    assert 12000 <= run["input_tokens"] + run["output_tokens"] < 40 * 5000, "what it streamed, counted"
    assert log_of(origin, f"batch/{batch}")[:-1] == ["fine: step 1/1 (attempt 1)"], "nothing of it landed"
    # an operator gives it room: an ordinary task again, run alone
    assert f.cli("resume", str(spender), "--max-tokens", "1000000", env=f.env("operator")).returncode == 0
    assert f.task(spender)["state"] == "queued"


def test_a_member_waiting_on_a_person_flags_its_carrier_and_is_not_a_stall(batch_fleet) -> None:
    f = batch_fleet(stall_seconds=2, stall_action="stop")
    f.enqueue("code", "asks", member_payload("asks", attention="Claude needs your permission to use Bash"))
    batch = create(f, ["asks"])
    shift = f.shift("code", max_tasks=1, max_seconds=60)
    t = threading.Thread(target=shift.run)
    t.start()
    try:
        carrier = batch_row(f, batch)["task_id"]
        rows = wait_for("the carrier flagged needs-attention", lambda: f.sql("select * from fleet.attention_tasks"),
                        timeout=30, every=0.2)
        assert rows[0]["id"] == carrier and "permission to use Bash" in rows[0]["attention"]
        time.sleep(4)  # twice the stall time: waiting on a human is not a stall
        assert f.task(carrier)["state"] == "running"
    finally:
        shift.request_stop("test over")
        t.join(60)


def test_a_silent_member_stalls_its_carrier(batch_fleet) -> None:
    f = batch_fleet(stall_seconds=2, stall_action="stop")
    f.enqueue("code", "quiet", member_payload("quiet", mode="hang"))  # alive, says nothing
    batch = create(f, ["quiet"])
    f.run_shift("code", max_tasks=1, max_seconds=40)
    carrier = batch_row(f, batch)["task_id"]
    run = f.runs(carrier)[0]
    assert (run["outcome"], run["reason"]) == ("failed", "stalled"), run
    # the carrier's next claim continues the same member
    assert f.task(carrier)["state"] == "queued" and members(f, batch)[0]["state"] == "running"
