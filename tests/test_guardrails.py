"""Guard rails: stalls and needs-attention, task and lane budgets, review debt — through
real shifts running the scripted agent against a real database, on both back-ends."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fleetkit import AGENT, Backend, Fleet, lane_defaults, pids_using, wait_for

CORPUS = Path(__file__).resolve().parent / "agents" / "corpus"
REPLAY = str(Path(__file__).resolve().parent / "agents" / "replay.py")

TIERS = ["mechanical", "mid", "strong"]
PROFILES = {
    "pools": {"max": {"slots": 4}},
    "profiles": {"scripted": {"command": [*AGENT, "--model", "{model}"],
                              "models": {"mechanical": "m-small", "mid": "m-mid", "strong": "m-large"},
                              "pool": "max"}},
}
QUICK = {"steps": 1, "sleep": 0.02}


@pytest.fixture
def rails(backend: Backend, tmp_path: Path):
    made: list[Fleet] = []

    def make(**lane: Any) -> Fleet:
        settings = lane_defaults(profile="scripted", tiers=TIERS, **lane)
        del settings["command"]
        f = Fleet(backend, tmp_path, {"work": settings}, tables=PROFILES)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def overview(fleet: Fleet) -> dict[str, Any]:
    return fleet.sql("select * from fleet.lane_overview where lane = 'work'")[0]


# ------------------------------------------------------------------------------------------------
# stalls


def journal_size(fleet: Fleet) -> int:
    return int(fleet.sql("select count(*) as n from fleet.journal")[0]["n"])


def test_a_stalled_agent_is_stopped_and_its_next_attempt_escalates(rails) -> None:
    fleet = rails(stall_seconds=2, stall_action="stop")
    task = fleet.enqueue("work", "quiet", {"mode": "hang"})  # alive, says nothing, never checkpoints

    summary = fleet.run_shift("work", max_tasks=1, max_seconds=40)

    run = fleet.runs(task)[0]
    assert (run["outcome"], run["reason"]) == ("failed", "stalled"), run
    assert "stalled: no progress for 2 s" in fleet.task(task)["last_error"]
    assert fleet.task(task)["tier"] == "mid"
    escalated = fleet.sql("select detail from fleet.journal where kind = 'escalated' and task_id = %s", (task,))
    assert escalated[0]["detail"]["reason"] == "stalled"
    assert summary.outcomes.get("stalled") == 1
    assert not pids_using(fleet.workspace("work", "quiet")), "the stalled agent outlived its stop"


def test_a_stalled_attempt_claimed_again_at_once_keeps_the_tokens_it_streamed(backend: Backend, tmp_path: Path) -> None:
    # Claude Code 2.0.27's real session (tests/agents/corpus), cut before its result record: an agent
    # that streamed its turns and then went silent. With no backoff the same shift claims the task
    # again while the stalled agent is still being stopped.
    sample = CORPUS / "claude" / "stream-json-task-subagent-two-models-2.0.27.jsonl"
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(line for line in sample.read_text().splitlines(keepends=True)
                           if json.loads(line)["type"] != "result"))
    lane = lane_defaults(command=[sys.executable, REPLAY, str(cut), "hang"], stall_seconds=2,
                         stall_action="stop", backoff_base_seconds=0, max_attempts=2, slots=2)
    fleet = Fleet(backend, tmp_path, {"work": lane})
    try:
        task = fleet.enqueue("work", "stalls", {})
        fleet.run_shift("work", max_tasks=2, max_seconds=40)
        runs = fleet.runs(task)
        assert [(r["outcome"], r["reason"]) for r in runs] == [("failed", "stalled")] * 2
        # the streamed messages' cache writes, once per message id: sonnet 60,390 + haiku 8,378
        assert [r["cache_creation_tokens"] for r in runs] == [68768, 68768]
    finally:
        fleet.close()


def test_a_stall_is_only_reported_where_the_lane_says_so_and_progress_keeps_an_agent_alive(rails) -> None:
    fleet = rails(stall_seconds=2)  # stall_action: report
    quiet = fleet.enqueue("work", "quiet", {"mode": "hang"})
    busy = fleet.enqueue("work", "busy", {"steps": 40, "sleep": 0.25})  # prints a turn every 0.25 s
    shift = fleet.shift("work", max_tasks=2, max_seconds=60)
    import threading

    t = threading.Thread(target=shift.run)
    t.start()
    try:
        stuck = wait_for("the quiet task reported as stalled", lambda: [
            r for r in fleet.sql("select task_id, reasons from fleet.stuck_tasks") if "stalled" in r["reasons"]],
            timeout=20, every=0.2)
        assert [r["task_id"] for r in stuck] == [quiet]
        time.sleep(1.5)
        assert [fleet.task(i)["state"] for i in (quiet, busy)] == ["running", "running"]
        monitor = fleet.cli("monitor", "--once", "--json")
        assert monitor.returncode == 0, monitor.stderr
        assert "stalled" in monitor.stdout
    finally:
        shift.request_stop("test over")
        t.join(60)
    assert fleet.runs(busy)[0]["reason"] is None


def test_an_agent_waiting_on_a_prompt_needs_attention_and_is_not_stalled(rails) -> None:
    fleet = rails(stall_seconds=2, stall_action="stop")
    task = fleet.enqueue("work", "asks", {"attention": "Claude needs your permission to use Bash"})
    shift = fleet.shift("work", max_tasks=1, max_seconds=60)
    import threading

    t = threading.Thread(target=shift.run)
    t.start()
    try:
        rows = wait_for("the task flagged needs-attention", lambda: fleet.sql("select * from fleet.attention_tasks"),
                        timeout=20, every=0.2)
        assert rows[0]["id"] == task and "permission to use Bash" in rows[0]["attention"]
        time.sleep(4)  # twice the stall time: waiting on a human is not a stall
        assert fleet.task(task)["state"] == "running"
        assert overview(fleet)["needs_attention"] == 1
        if not fleet.backend.rest:
            status = fleet.cli("status", env={**fleet.env("operator"), "COLUMNS": "250"})
            assert "needs attention" in status.stdout and "permission to use Bash" in status.stdout
    finally:
        shift.request_stop("test over")
        t.join(60)


# ------------------------------------------------------------------------------------------------
# budgets


def test_a_budget_crossed_mid_run_stops_the_agent_and_blocks_the_task(rails) -> None:
    fleet = rails()
    # 5,000 tokens a step, 40 steps: the budget of 12,000 is crossed at the third step
    task = fleet.enqueue("work", "spender", {"steps": 40, "sleep": 0.2}, max_tokens=12000)

    started = time.monotonic()
    fleet.run_shift("work", max_tasks=1)

    row = fleet.task(task)
    assert (row["state"], row["block_reason"], row["failures"]) == ("blocked", "budget", 0)
    run = fleet.runs(task)[0]
    # the cost is said only when the agent reported one: no "($0.0000)" for an unpriced agent
    priced = rf" \(\${float(run['cost_usd']):.4f}\)" if run["cost_usd"] else ""
    assert re.fullmatch(rf"spent [\d,]+ tokens of the task's 12,000 budget{priced}", row["last_error"]), row
    streamed = run["input_tokens"] + run["output_tokens"]
    assert 12000 <= streamed < 40 * 5000, run  # what it streamed before it was stopped, counted
    assert time.monotonic() - started < 40 * 0.2, "the agent ran to its end"
    steps = json.loads((fleet.workspace("work", "spender") / ".fleet" / "checkpoint.json").read_text())["step"]
    assert steps < 10

    # resumed without a new budget, or with one it has spent too: refused, one line, nothing changed
    # (the next claim would block it again at once, an attempt and a run for nothing)
    before = (fleet.task(task), fleet.runs(task), journal_size(fleet))
    for args in ([], ["--max-tokens", "12000"], ["--max-cost", "0", "--max-tokens", str(streamed)]):
        refused = fleet.cli("resume", str(task), *args)
        assert refused.returncode == 1 and "would be blocked again at once" in refused.stderr, refused
        assert f"spent {streamed:,} tokens" in refused.stderr and "--max-tokens" in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr
        assert (fleet.task(task), fleet.runs(task), journal_size(fleet)) == before, args
    # (the dashboards read SQL: over the database's own connection on either back-end)
    shown = fleet.cli("status", env={**fleet.env("operator"), "FLEET_FLEET__STORE": "postgres",
                                     "DATABASE_URL": fleet.backend.db_url})
    assert shown.returncode == 0, shown.stderr
    status = " ".join(shown.stdout.split())  # (its title wraps at the terminal's width)
    assert "a budget: `fleet resume TASK --max-tokens N`" in status and "re-runs the gate" not in status, status
    # with a budget that fits, it runs to the end
    assert fleet.cli("resume", str(task), "--max-tokens", "1000000").returncode == 0
    fleet.run_shift("work", max_tasks=1, max_seconds=60)
    assert fleet.task(task)["state"] == "done"


def test_a_lane_over_its_daily_budget_claims_nothing(rails) -> None:
    fleet = rails(daily_budget_tokens=1000)
    first = fleet.enqueue("work", "first", QUICK)
    fleet.run_shift("work", max_tasks=1)
    assert fleet.task(first)["state"] == "done"

    second = fleet.enqueue("work", "second", QUICK)
    summary = fleet.run_shift("work")

    assert summary.claimed == 0 and fleet.task(second)["state"] == "queued"
    row = overview(fleet)
    assert row["over_budget"] is True and row["spent_today_tokens"] >= 1000 and row["daily_budget_tokens"] == 1000


# ------------------------------------------------------------------------------------------------
# review


def test_the_review_cap_stops_claiming_and_approve_and_reject_behave(rails) -> None:
    fleet = rails(review=True, review_cap=1)
    a = fleet.enqueue("work", "a", QUICK, priority=10)
    b = fleet.enqueue("work", "b", QUICK)

    fleet.run_shift("work", max_tasks=1)
    assert fleet.task(a)["state"] == "review" and fleet.task(a)["finished_at"] is None
    assert fleet.run_shift("work").claimed == 0, "one task in review reaches the cap"
    assert fleet.task(b)["state"] == "queued"
    listed = json.loads(fleet.cli("review", "list", "--json").stdout)
    assert [t["key"] for t in listed] == ["a"]

    empty = fleet.cli("review", "reject", "a", "--note", " ")
    assert empty.returncode == 1 and "a rejection needs a note" in empty.stderr
    rejected = fleet.cli("review", "reject", "a", "--note", "Keep the public API: do not rename parse()")
    assert rejected.returncode == 0, rejected.stderr
    assert fleet.task(a)["state"] == "queued" and fleet.task(a)["failures"] == 0
    fleet.run_shift("work", max_tasks=1)  # a again (priority 10): its prompt carries the note
    prompt = (fleet.workspace("work", "a") / ".fleet" / "prompt.md").read_text()
    assert "do not rename parse()" in prompt
    assert fleet.task(a)["state"] == "review"

    bad = fleet.cli("review", "approve", "b")
    assert bad.returncode == 1 and "only tasks in review can be approved" in bad.stderr
    assert fleet.cli("review", "approve", "a", "--note", "good").returncode == 0
    assert fleet.task(a)["state"] == "done" and fleet.task(a)["finished_at"] is not None
    fleet.run_shift("work", max_tasks=1)
    assert fleet.task(b)["state"] == "review"

    rates = fleet.sql("select approved, rejected, accept_rate, pool, host from fleet.review_accept_rate")
    assert [(r["approved"], r["rejected"], r["pool"]) for r in rates] == [(1, 1, "max")]
    assert rates[0]["accept_rate"] == pytest.approx(0.5) and rates[0]["host"]
    assert overview(fleet)["in_review"] == 1


def test_bad_budgets_are_refused_at_enqueue(rails) -> None:
    from worker.errors import InvalidInput

    fleet = rails()
    with pytest.raises(InvalidInput, match="a task budget must be positive"):
        fleet.store.enqueue("work", "k", {}, max_tokens=0)
    assert fleet.sql("select count(*) as n from fleet.tasks")[0]["n"] == 0
