"""Dispatch for coding agents: tiers and escalation, profiles, verify gates, capacity
pools and usage limits — through real shifts running the scripted agent against a real database
(both back-ends), plus the parsing the shift relies on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fleetkit import AGENT, Backend, Fleet, lane_defaults, wait_for

from worker.config import FleetConfig, ProfileConfig, load_config
from worker.errors import ConfigError, InvalidInput, InvalidState
from worker.shift.dispatch import classify_gate, resolve, resolved
from worker.shift.limits import reset_time, usage_limit

TIERS = ["mechanical", "mid", "strong"]
MODELS_A = {"mechanical": "a-small", "mid": "a-mid", "strong": "a-large"}
MODELS_B = {"mechanical": "b-small", "mid": "b-mid", "strong": "b-large"}
AGENT_WITH_MODEL = [*AGENT, "--model", "{model}"]
QUICK = {"steps": 1, "sleep": 0.02}

# A verify gate steered by the task payload's "gate": ok | fail | silent | unavailable | flag
# ("flag": ok once the file named by the payload's "flag" exists, else cannot judge).
GATE = '''
import json, os, sys
from pathlib import Path
payload = json.loads(Path(".fleet/task.json").read_text()).get("payload") or {}
with open(os.environ["GATE_CALLS"], "a") as fh:
    fh.write(os.environ["FLEET_TASK_KEY"] + "\\n")
mode = payload.get("gate", "ok")
if mode == "flag":
    mode = "ok" if Path(payload["flag"]).exists() else "unavailable"
if mode == "wait":  # a slow suite: passes once the flag exists
    import time
    while not Path(payload["flag"]).exists():
        time.sleep(0.05)
    mode = "ok"
if mode == "ok":
    print("12 passed")
    sys.exit(0)
if mode == "fail":
    print("FAILED tests/test_parser.py::test_unicode - AssertionError: 'é' != 'e'")
    print("1 failed, 11 passed")
    sys.exit(1)
if mode == "silent":
    sys.exit(3)
if mode == "unavailable":
    print("fleet-gate: capability-unavailable no GPU on this host to run the benchmark suite")
    sys.exit(2)
'''


@pytest.fixture
def dispatch_fleet(backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    made: list[Fleet] = []

    def make(lanes: dict[str, dict[str, Any]], tables: dict[str, Any] | None = None) -> Fleet:
        f = Fleet(backend, tmp_path, lanes, tables=tables)
        made.append(f)
        return f

    monkeypatch.setenv("GATE_CALLS", str(tmp_path / "gate-calls"))
    yield make
    for f in made:
        f.close()


def two_pools(slots_a: int = 2, slots_b: int = 2) -> dict[str, Any]:
    return {
        "pools": {"pool-a": {"slots": slots_a}, "pool-b": {"slots": slots_b}},
        "profiles": {
            "agent-a": {"command": AGENT_WITH_MODEL, "models": MODELS_A, "pool": "pool-a"},
            "agent-b": {"command": AGENT_WITH_MODEL, "models": MODELS_B, "pool": "pool-b"},
        },
    }


def tiered_lane(**kw: Any) -> dict[str, Any]:
    base = lane_defaults(profile="agent-a", tiers=TIERS)
    del base["command"]
    base.update(kw)
    return base


# ------------------------------------------------------------------------------------------------
# tiers and escalation


def test_an_unverified_exit_escalates_the_next_attempt_one_tier_and_the_top_tier_stays(dispatch_fleet) -> None:
    fleet = dispatch_fleet({"work": tiered_lane()}, two_pools())
    low = fleet.enqueue("work", "low", {**QUICK, "fail_attempts": 1})
    top = fleet.enqueue("work", "top", {**QUICK, "fail_attempts": 1}, tier="strong")

    fleet.run_shift("work")  # both fail (an unverified exit)
    fleet.run_shift("work")  # both succeed, one tier up where there is one

    assert [(r["tier"], r["model"], r["outcome"], r["reason"]) for r in fleet.runs(low)] == [
        ("mechanical", "a-small", "failed", "unverified-exit"), ("mid", "a-mid", "done", None)]
    assert [(r["tier"], r["model"], r["outcome"]) for r in fleet.runs(top)] == [
        ("strong", "a-large", "failed"), ("strong", "a-large", "done")]
    escalations = fleet.sql("select task_id, detail from fleet.journal where kind = 'escalated'")
    assert [(e["task_id"], e["detail"]["from"], e["detail"]["to"], e["detail"]["reason"]) for e in escalations] == [
        (low, "mechanical", "mid", "unverified-exit")]
    # the agent was started with the model of its tier
    log = Path(fleet.runs(low)[1]["log_path"]).read_text()
    assert '"model": "a-mid"' in log


def test_a_reason_the_lane_does_not_list_does_not_escalate(dispatch_fleet) -> None:
    fleet = dispatch_fleet({"work": tiered_lane(escalate_on=["verify-failed"])}, two_pools())
    task = fleet.enqueue("work", "t", {**QUICK, "fail_attempts": 1})
    fleet.run_shift("work")
    fleet.run_shift("work")
    assert [r["tier"] for r in fleet.runs(task)] == ["mechanical", "mechanical"]
    assert "escalated" not in fleet.event_kinds(task)


# ------------------------------------------------------------------------------------------------
# profiles


def test_an_unknown_profile_or_tier_is_refused_at_enqueue_and_nothing_is_written(dispatch_fleet) -> None:
    fleet = dispatch_fleet({"work": tiered_lane()}, two_pools())

    with pytest.raises(InvalidInput, match=r"unknown profile 'nope'.*") as info:
        fleet.store.enqueue("work", "k1", {}, profile="nope")
    # a caller of every lane is told every profile; a key limited to lanes, only its lane's (agent-b
    # is no profile of lane work's)
    assert ("the profiles of lane work: agent-a" if fleet.backend.rest else "agent-a, agent-b") in (info.value.hint or "")
    with pytest.raises(InvalidInput, match="lane work has no tier 'huge'"):
        fleet.store.enqueue("work", "k2", {}, tier="huge")

    cli = fleet.cli("enqueue", "work", "--key", "k3", "--profile", "nope")
    assert cli.returncode == 1 and "unknown profile 'nope'" in cli.stderr and "Traceback" not in cli.stderr
    assert fleet.sql("select count(*) as n from fleet.tasks")[0]["n"] == 0
    assert fleet.sql("select count(*) as n from fleet.journal where kind = 'enqueued'")[0]["n"] == 0
    ok = fleet.cli("enqueue", "work", "--key", "k4", "--profile", "agent-b", "--tier", "strong", "--json")
    assert ok.returncode == 0, ok.stderr
    row = fleet.task(json.loads(ok.stdout)["id"])
    assert (row["profile"], row["tier"]) == ("agent-b", "strong")


def test_a_task_enqueued_with_a_profile_runs_with_it(dispatch_fleet) -> None:
    # (the lane's dispatch names agent-b: a key limited to the lane may name only its profiles)
    fleet = dispatch_fleet({"work": tiered_lane(pools=["pool-a", "pool-b"])}, two_pools())
    task = fleet.enqueue("work", "t", QUICK, profile="agent-b", tier="mid")
    fleet.run_shift("work")
    run = fleet.runs(task)[0]
    assert (run["profile"], run["pool"], run["tier"], run["model"], run["outcome"]) == (
        "agent-b", "pool-b", "mid", "b-mid", "done")


def test_fleet_profiles_shows_every_profile_resolved_as_a_spawn_resolves_it(dispatch_fleet) -> None:
    fleet = dispatch_fleet({"work": tiered_lane(pools=["pool-a", "pool-b"])}, two_pools())
    out = fleet.cli("profiles", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    a = next(p for p in data["profiles"] if p["name"] == "agent-a")
    assert a["pool"] == "pool-a"
    assert a["tiers"]["mid"]["argv"][-2:] == ["--model", "a-mid"]
    lane = data["lanes"]["work"]
    assert [(d["pool"], d["profile"], d["tier"], d["model"]) for d in lane][:4] == [
        ("pool-a", "agent-a", "mechanical", "a-small"), ("pool-a", "agent-a", "mid", "a-mid"),
        ("pool-a", "agent-a", "strong", "a-large"), ("pool-b", "agent-b", "mechanical", "b-small")]
    plain = fleet.cli("profiles")
    assert plain.returncode == 0 and "agent-b" in plain.stdout and "b-large" in plain.stdout


def test_a_shift_logs_its_resolved_dispatch_once_at_start(dispatch_fleet, capsys) -> None:
    fleet = dispatch_fleet({"work": tiered_lane()}, two_pools())
    fleet.run_shift("work")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "dispatch=" in ln]
    assert len(lines) == 1
    assert "mechanical=agent-a/a-small [pool-a]" in lines[0] and "strong=agent-a/a-large" in lines[0]


# ------------------------------------------------------------------------------------------------
# verify gates


def gated(tmp: Path, **kw: Any) -> dict[str, Any]:
    script = tmp / "gate.py"
    script.write_text(GATE)
    # the gate counts its calls in the file GATE_CALLS names: its lane passes the variable on
    return tiered_lane(verify=[sys.executable, str(script)], agent_env=["GATE_CALLS"], **kw)


def test_each_of_the_four_gate_outcomes_leads_to_its_state(dispatch_fleet, tmp_path: Path) -> None:
    fleet = dispatch_fleet({"work": gated(tmp_path)}, two_pools())
    ok = fleet.enqueue("work", "ok", {**QUICK, "gate": "ok"})
    wrong = fleet.enqueue("work", "wrong", {**QUICK, "gate": "fail"})
    silent = fleet.enqueue("work", "silent", {**QUICK, "gate": "silent"})
    unavailable = fleet.enqueue("work", "unavailable", {**QUICK, "gate": "unavailable"})

    fleet.run_shift("work", max_tasks=4)

    t = {k: fleet.task(i) for k, i in (("ok", ok), ("wrong", wrong), ("silent", silent), ("na", unavailable))}
    assert t["ok"]["state"] == "done" and t["ok"]["result"]["gate"] == "ok"
    # task-failed: a failed attempt, escalating, the gate's output kept as evidence
    assert (t["wrong"]["state"], t["wrong"]["failures"], t["wrong"]["tier"]) == ("queued", 1, "mid")
    assert "1 failed, 11 passed" in t["wrong"]["last_error"]
    run = fleet.runs(wrong)[0]
    assert (run["gate"], run["reason"], run["outcome"]) == ("task-failed", "verify-failed", "failed")
    assert "test_unicode" in run["error_tail"]
    # inconclusive: blocked with the reason, no failure counted, never done
    assert (t["silent"]["state"], t["silent"]["block_reason"], t["silent"]["failures"]) == (
        "blocked", "automation-broken", 0)
    assert (t["na"]["state"], t["na"]["block_reason"]) == ("blocked", "capability-unavailable")
    assert "no GPU" in t["na"]["last_error"]
    blocked = fleet.sql("select key, block_reason from fleet.blocked_tasks order by key")
    assert blocked == [{"key": "silent", "block_reason": "automation-broken"},
                       {"key": "unavailable", "block_reason": "capability-unavailable"}]
    if not fleet.backend.rest:  # `fleet status` reads the database directly
        status = fleet.cli("status", env={**fleet.env("operator"), "COLUMNS": "250"})
        assert status.returncode == 0, status.stderr
        assert "capability-unavailable" in status.stdout and "fleet resume TASK" in status.stdout
        data = json.loads(fleet.cli("status", "--json").stdout)
        assert sorted((b["key"], b["block_reason"]) for b in data["blocked"]) == [
            ("silent", "automation-broken"), ("unavailable", "capability-unavailable")]


def test_a_gate_that_cannot_start_blocks_the_task(dispatch_fleet, tmp_path: Path) -> None:
    fleet = dispatch_fleet({"work": tiered_lane(verify=[str(tmp_path / "no-such-gate")])}, two_pools())
    task = fleet.enqueue("work", "t", QUICK)
    fleet.run_shift("work")
    row = fleet.task(task)
    assert (row["state"], row["block_reason"]) == ("blocked", "automation-broken")
    # named as the gate, not as the agent
    assert row["last_error"] == f"verify gate '{tmp_path / 'no-such-gate'}' cannot start: No such file or directory"


def test_resume_reruns_only_the_gate_and_retry_runs_the_agent_again(dispatch_fleet, tmp_path: Path) -> None:
    fleet = dispatch_fleet({"work": gated(tmp_path)}, two_pools())
    flag = tmp_path / "gpu-is-back"
    resumed = fleet.enqueue("work", "resumed", {**QUICK, "gate": "flag", "flag": str(flag)})
    retried = fleet.enqueue("work", "retried", {**QUICK, "gate": "flag", "flag": str(flag)})
    fleet.run_shift("work", max_tasks=2)
    assert [fleet.task(i)["state"] for i in (resumed, retried)] == ["blocked", "blocked"]

    with pytest.raises(InvalidState, match="only blocked tasks can be resumed"):
        fleet.monitor_store.resume(fleet.enqueue("work", "queued-one", QUICK))
    flag.write_text("yes")
    assert fleet.cli("resume", str(resumed)).returncode == 0
    assert fleet.cli("retry", str(retried)).returncode == 0
    fleet.sql("delete from fleet.tasks where key = 'queued-one'")
    fleet.run_shift("work", max_tasks=2)

    assert [fleet.task(i)["state"] for i in (resumed, retried)] == ["done", "done"]
    again = fleet.runs(resumed)[1]
    assert again["gate"] == "ok" and not Path(again["log_path"]).exists(), "the agent ran again on resume"
    assert Path(fleet.runs(retried)[1]["log_path"]).exists(), "retry must run the agent"
    calls = (tmp_path / "gate-calls").read_text().split()
    assert calls.count("resumed") == 2 and calls.count("retried") == 2
    assert "resumed" in fleet.event_kinds(resumed)


# ------------------------------------------------------------------------------------------------
# pools and usage limits


def test_a_usage_limit_requeues_for_after_the_reset_spends_no_attempt_and_spills_over(dispatch_fleet) -> None:
    fleet = dispatch_fleet({"work": tiered_lane(pools=["pool-a", "pool-b"])}, two_pools())
    limited = fleet.enqueue("work", "limited", {**QUICK, "limit_attempts": 1, "limit_reset_in": 1800})
    before = datetime.now(UTC)

    fleet.run_shift("work")

    row = fleet.task(limited)
    run = fleet.runs(limited)[0]
    reset = before + timedelta(seconds=1800)
    assert row["state"] == "queued" and row["failures"] == 0 and row["evaporations"] == 0
    assert abs((row["run_at"] - reset).total_seconds()) < 30, (row["run_at"], reset)
    assert (run["outcome"], run["reason"], run["pool"]) == ("throttled", "usage-limit", "pool-a")
    assert row["agent_session"] is not None and row["agent_session"] == run["agent_session"]
    pool = fleet.sql("select * from fleet.pool_overview where pool = 'pool-a'")[0]
    assert pool["throttled_until"] == row["run_at"] and pool["throttles_today"] == 1

    # the lane's next task spills over to the second pool (and its profile); the limited one waits
    nxt = fleet.enqueue("work", "next", QUICK)
    fleet.run_shift("work")
    assert fleet.task(limited)["state"] == "queued" and len(fleet.runs(limited)) == 1
    run = fleet.runs(nxt)[0]
    assert (run["pool"], run["profile"], run["model"], run["outcome"]) == ("pool-b", "agent-b", "b-small", "done")
    claimed = fleet.sql("select detail from fleet.journal where kind = 'claimed' and task_id = %s", (nxt,))
    assert claimed[0]["detail"]["spilled"] is True and claimed[0]["detail"]["preferred_pool"] == "pool-a"
    b = fleet.sql("select * from fleet.pool_overview where pool = 'pool-b'")[0]
    assert b["spillovers_today"] == 1 and b["throttled_until"] is None
    rates = fleet.sql("select pool, done, throttled, accept_rate from fleet.pool_accept_rate order by pool")
    assert [(r["pool"], r["done"], r["throttled"]) for r in rates] == [("pool-a", 0, 1), ("pool-b", 1, 0)]
    assert rates[1]["accept_rate"] == 1


def test_a_full_pool_spills_over_and_a_pool_is_shared_across_lanes(dispatch_fleet) -> None:
    fleet = dispatch_fleet({"one": tiered_lane(pools=["pool-a", "pool-b"]), "two": tiered_lane()},
                           two_pools(slots_a=1, slots_b=1))
    hang = {"mode": "hang"}
    a = fleet.enqueue("one", "a", hang)
    b = fleet.enqueue("one", "b", hang)
    c = fleet.enqueue("one", "c", hang)
    d = fleet.enqueue("two", "d", hang)
    s1 = fleet.direct.open_session("one", "h", 1, None, 60)
    s2 = fleet.direct.open_session("two", "h", 2, None, 60)

    got = fleet.direct.claim(s1, 5)
    assert [(t.id, t.pool, t.run_profile) for t in got] == [(a, "pool-a", "agent-a"), (b, "pool-b", "agent-b")]
    assert fleet.direct.claim(s2, 5) == [], "pool-a is full: lane two may not claim"
    assert fleet.task(c)["state"] == "queued" and fleet.task(d)["state"] == "queued"
    fleet.direct.complete(a, got[0].lease_token)
    assert [t.id for t in fleet.direct.claim(s2, 5)] == [d]


# ------------------------------------------------------------------------------------------------
# config


def cfg_of(tmp_path: Path, text: str) -> FleetConfig:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return load_config(path, environ={})


PROFILES = '''
[pools.max]
slots = 2
[profiles.claude]
command = "claude -p --model {model} --resume {agent_session}"
models = { mechanical = "haiku", mid = "sonnet", strong = "opus" }
pool = "max"
'''


@pytest.mark.parametrize(("lane", "words"), [
    ('profile = "nope"', "lanes.work.profile: unknown profile 'nope'"),
    ('profile = "claude"\npools = ["gone"]', "lanes.work.pools: unknown pool 'gone'"),
    ('profile = "claude"\ntiers = ["mechanical", "huge"]', "profile 'claude' maps no model to tier 'huge'"),
    ('profile = "claude"\ntiers = ["mid"]\ndefault_tier = "strong"', "default_tier 'strong' is not one of"),
    ("max_running = 1", "needs a command, a profile or an agent"),
])
def test_bad_dispatch_config_is_refused_naming_the_field(tmp_path: Path, lane: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        cfg_of(tmp_path, PROFILES + f"\n[lanes.work]\n{lane}\n")
    assert words in info.value.message


def test_resolve_uses_the_profile_model_of_the_tier_and_drops_resume_without_a_session(tmp_path: Path) -> None:
    from worker.agent.executor import render_argv

    cfg = cfg_of(tmp_path, PROFILES + '\n[lanes.work]\nprofile = "claude"\ntiers = ["mechanical", "mid", "strong"]\n')
    d = resolve(cfg, "work", None, "mid")
    assert (d.profile, d.model, d.pool) == ("claude", "sonnet", "max")
    assert render_argv(d.command, {"model": d.model or "", "agent_session": ""}) == ["claude", "-p", "--model", "sonnet"]
    assert render_argv(d.command, {"model": "opus", "agent_session": "s-1"})[-2:] == ["--resume", "s-1"]
    assert cfg.dispatch_list("work") == [{"pool": "max", "profile": "claude"}]


# ------------------------------------------------------------------------------------------------
# parsing


NOW = datetime(2026, 11, 30, 13, 0, tzinfo=UTC)


@pytest.mark.parametrize(("text", "until", "after"), [
    ("Claude AI usage limit reached|1796054400", datetime.fromtimestamp(1796054400, UTC), None),
    ("rate limited until 2026-11-30T15:30:00Z", datetime(2026, 11, 30, 15, 30, tzinfo=UTC), None),
    ("429 Too Many Requests; retry-after: 120", None, 120.0),
    ("You've hit your limit. Try again in 20 minutes.", None, 1200.0),
    ("You've hit your limit · resets 3pm (UTC)", datetime(2026, 11, 30, 15, 0, tzinfo=UTC), None),
    ("5-hour limit reached ∙ resets 11am", datetime(2026, 12, 1, 11, 0, tzinfo=UTC), None),
    ("usage limit resets 4:30pm (Europe/Berlin)", datetime(2026, 11, 30, 15, 30, tzinfo=UTC), None),
    ("rate limit exceeded", None, None),
])
def test_reset_time_reads_what_limit_messages_say(text: str, until: datetime | None, after: float | None) -> None:
    assert reset_time(text, now=NOW) == (until, after)


def test_usage_limit_detection_patterns_codes_and_backoff() -> None:
    prof = ProfileConfig(command=["x"], limit_exit_codes=[42], throttle_backoff="5m")
    hit = usage_limit(prof, 1, "Claude AI usage limit reached|1796054400", "", now=NOW)
    assert hit is not None and hit.until == datetime.fromtimestamp(1796054400, UTC)
    coded = usage_limit(prof, 42, None, "nothing useful")
    assert coded is not None and coded.after_seconds == 300.0 and coded.until is None
    assert usage_limit(prof, 1, "the tests still fail", "error: 3 failed") is None
    assert usage_limit(None, 0, "fixed issue #429 in the parser", "") is None
    assert usage_limit(None, 1, None, "API Error: 429 Too Many Requests") is not None


@pytest.mark.parametrize(("code", "output", "timed_out", "outcome"), [
    (0, "12 passed", False, "ok"),
    (1, "1 failed, 11 passed", False, "task-failed"),
    (1, "", False, "automation-broken"),
    (127, "lanefleet: verify gate 'pytest' cannot start: No such file or directory", False, "automation-broken"),
    (127, "sh: 1: pytest: not found", False, "automation-broken"),
    (137, "", False, "automation-broken"),
    (125, "", False, "capability-unavailable"),
    (0, "", True, "automation-broken"),
    (2, "fleet-gate: capability-unavailable no GPU", False, "capability-unavailable"),
    (1, "fleet-gate: ok", False, "automation-broken"),
])
def test_classify_gate(code: int, output: str, timed_out: bool, outcome: str) -> None:
    assert classify_gate(code, output, timed_out=timed_out)[0] == outcome


def test_a_shift_that_stops_under_the_gate_hands_off_and_the_next_attempt_runs_the_gate_only(
        dispatch_fleet, tmp_path: Path) -> None:
    """The agent's work is done (exit 0) and its gate runs when the shift is told to stop: the
    task is handed off marked verify_pending, on the session that did the work, and the next
    shift runs the gate alone (it ran the agent again from the start)."""
    fleet = dispatch_fleet({"work": gated(tmp_path, grace_seconds=1)}, two_pools())
    flag = tmp_path / "the-suite-passes"
    task = fleet.enqueue("work", "t", {**QUICK, "gate": "wait", "flag": str(flag)})
    shift = fleet.shift("work", max_seconds=60)
    thread = threading.Thread(target=shift.run, daemon=True)
    thread.start()
    calls = tmp_path / "gate-calls"
    wait_for("the gate to run", lambda: calls.exists() and calls.read_text().split() == ["t"], timeout=30)
    shift.request_stop("SIGTERM")
    thread.join(30)
    assert not thread.is_alive()
    t = fleet.task(task)
    assert (t["state"], t["verify_pending"], t["failures"], t["handoffs"]) == ("queued", True, 0, 1)
    first = fleet.runs(task)[0]
    assert first["outcome"] == "handed_off" and first["agent_session"]
    assert t["handoff"]["agent_session"] == first["agent_session"] and t["handoff"]["verify_pending"] is True

    flag.write_text("yes")
    fleet.run_shift("work", max_tasks=1)
    t = fleet.task(task)
    assert (t["state"], t["verify_pending"]) == ("done", False)
    again = fleet.runs(task)[1]
    assert again["gate"] == "ok" and not Path(again["log_path"]).exists(), "the agent ran again"
    assert calls.read_text().split() == ["t", "t"]


def test_a_task_resumed_for_its_gate_then_rejected_in_review_runs_its_agent_again(
        dispatch_fleet, tmp_path: Path) -> None:
    """The gate-only attempt of a resumed task passes into review; the reviewer's rejection is
    work for the agent (it was another gate-only attempt: verify_pending outlived the completion)."""
    fleet = dispatch_fleet({"work": gated(tmp_path, review=True)}, two_pools())
    flag = tmp_path / "gpu-is-back"
    task = fleet.enqueue("work", "t", {**QUICK, "gate": "flag", "flag": str(flag)})
    fleet.run_shift("work", max_tasks=1)
    assert fleet.task(task)["state"] == "blocked"
    flag.write_text("yes")
    fleet.monitor_store.resume(task)
    fleet.run_shift("work", max_tasks=1)  # the gate alone: ok, so into review
    assert (fleet.task(task)["state"], fleet.task(task)["verify_pending"]) == ("review", False)
    fleet.monitor_store.review_reject(task, "keep the public API")
    fleet.run_shift("work", max_tasks=1)
    third = fleet.runs(task)[2]
    assert Path(third["log_path"]).exists(), "the rejected work went to its gate alone, not to its agent"
    assert "keep the public API" in (fleet.workspace("work", "t") / ".fleet" / "prompt.md").read_text()


def test_a_slow_gate_times_out_as_automation_broken(dispatch_fleet, tmp_path: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text("import time\ntime.sleep(60)\n")
    fleet = dispatch_fleet({"work": tiered_lane(verify=[sys.executable, str(script)], verify_timeout="1s")},
                           two_pools())
    task = fleet.enqueue("work", "t", QUICK)
    started = time.monotonic()
    fleet.run_shift("work")
    assert time.monotonic() - started < 30
    row = fleet.task(task)
    assert (row["state"], row["block_reason"]) == ("blocked", "automation-broken")
    assert "timed out" in row["last_error"]


# ------------------------------------------------------------------------------------------------
# agents: the adapter of each dispatch


def test_each_dispatch_names_its_agent_and_an_agent_without_a_command_runs_its_default() -> None:
    cfg = FleetConfig.model_validate({
        "profiles": {"cx": {"agent": "codex", "model": "gpt-5"},
                     "cl": {"command": ["/opt/bin/claude", "-p", "--model", "{model}"], "model": "claude-sonnet-4-5"}},
        "lanes": {"a": {"profile": "cx"}, "b": {"profile": "cl"}, "c": {"command": ["python", "x.py"]},
                  "d": {"agent": "gemini"}},
    })
    data = resolved(cfg)
    cx = next(p for p in data["profiles"] if p["name"] == "cx")
    assert cx["agent"] == "codex" and cx["command"][:2] == ["codex", "exec"] and "resume" in cx["resume"]
    assert [d["agent"] for lane in "abcd" for d in data["lanes"][lane]] == ["codex", "claude", "generic", "gemini"]
    fresh = resolve(cfg, "a", None, None).argv({"model": "gpt-5", "agent_session": ""})
    again = resolve(cfg, "a", None, None).argv({"model": "gpt-5", "agent_session": "T-1"})
    assert fresh[-1] == "-" and "resume" not in fresh and again[-3:] == ["resume", "T-1", "-"]
    # no model configured: the agent's own default, no `--model ""`
    assert "--model" not in resolve(cfg, "d", None, None).argv({"model": "", "agent_session": ""})


@pytest.mark.parametrize(("toml", "says"), [
    ('[profiles.p]\nagent = "cursor"\n[lanes.w]\nprofile = "p"\n', "profiles.p.agent: unknown agent 'cursor'"),
    ('[lanes.w]\nagent = "generic"\n', "lanes.w: agent 'generic' has no default command"),
    ('[profiles.p]\nagent = "codex"\n[lanes.w]\nprofile = "p"\nagent = "claude"\n',
     "lanes.w.agent: the lane runs profile 'p'"),
    ('[lanes.w]\nagent = "Claude Code"\n', "is not an agent name"),
])
def test_a_bad_agent_is_one_line_naming_the_field(tmp_path: Path, toml: str, says: str) -> None:
    (tmp_path / "fleet.toml").write_text(toml)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    out = subprocess.run([sys.executable, "-m", "monitor.cli", "profiles"], cwd=tmp_path, capture_output=True,
                         text=True, env={**env, "FLEET_CONFIG": str(tmp_path / "fleet.toml")}, timeout=60)
    assert out.returncode == 1 and says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_gate_that_cannot_start_is_named_as_the_gate() -> None:
    said = "lanefleet: verify gate 'pytest' cannot start: No such file or directory"
    assert classify_gate(127, f"some noise\n{said}\n") == (
        "automation-broken", "verify gate 'pytest' cannot start: No such file or directory")
    outcome, evidence = classify_gate(127, "sh: 1: pytest: not found")
    assert (outcome, evidence.splitlines()[0]) == ("automation-broken", "the gate could not be started (command not found?)")
