"""Real agent CLI output (tests/agents/corpus/, sources in its README) replayed through real shifts
by tests/agents/replay.py, on both store back-ends: what the run, the task and the journal record,
against figures worked out by hand from each sample."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from fleetkit import Backend, Fleet, lane_defaults

from worker.agent.sandbox import bwrap_problem

CORPUS = Path(__file__).resolve().parent / "agents" / "corpus"
REPLAY = str(Path(__file__).resolve().parent / "agents" / "replay.py")


def replay(*pairs: tuple[str, int | str], resume: bool = False) -> list[str]:
    """The replay agent's argv: attempt N replays pair N (sample under the corpus, exit code)."""
    argv = [sys.executable, REPLAY]
    for sample, code in pairs:
        argv += [sample if sample.startswith("/") else str(CORPUS / sample), str(code)]
    return [*argv, "--resume", "{agent_session}"] if resume else argv


@pytest.fixture
def agent_fleet(backend: Backend, tmp_path: Path):
    """A lane ``work`` whose profile ``p`` runs the replay agent under the adapter ``agent``."""
    made: list[Fleet] = []

    def make(agent: str, command: list[str], model: str = "m", **lane: Any) -> Fleet:
        settings = lane_defaults(profile="p", **lane)
        del settings["command"]
        # a real CLI's adapter: its agent runs sandboxed (worker.agent.sandbox), and the samples some
        # tests cut into the test's folder are shown to it read-only
        # (and the replaying script with its corpus: a checkout under /tmp is hidden like the rest of /tmp)
        sandbox: dict[str, Any] = ({"sandbox_ro": [str(tmp_path), str(Path(REPLAY).parent)]}
                                   if bwrap_problem() is None else {"sandbox": "none"})
        tables = {"profiles": {"p": {"command": command, "agent": agent, "model": model, **sandbox}}}
        home = tmp_path / f"fleet-{len(made)}"
        home.mkdir()
        f = Fleet(backend, home, {"work": settings}, tables=tables)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def one_run(fleet: Fleet, key: str, **shift: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    task = fleet.enqueue("work", key, {})
    fleet.run_shift("work", max_tasks=1, once=True, **shift)
    runs = fleet.runs(task)
    assert len(runs) == 1, runs
    return fleet.task(task), runs[0]


def tokens(run: dict[str, Any]) -> tuple[int, int, int, int, int]:
    return (run["input_tokens"], run["cache_creation_tokens"], run["cache_read_tokens"], run["output_tokens"],
            run["reasoning_tokens"])


def events(fleet: Fleet, task: int, kind: str) -> list[dict[str, Any]]:
    return [r["detail"] for r in fleet.sql("select detail from fleet.journal where task_id = %s and kind = %s "
                                           "order by id", (task, kind))]


def argv_seen(fleet: Fleet, key: str) -> list[dict[str, Any]]:
    """What the shift passed to each run of the replay agent (argv and FLEET_AGENT_SESSION)."""
    path = fleet.workspace("work", key) / "replay-argv.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def next_clock(after: datetime, hour: int, minute: int) -> datetime:
    """The first hour:minute UTC after ``after`` (what "resets 5am" means, worked out by hand)."""
    at = after.replace(hour=hour, minute=minute, second=0, microsecond=0)
    return at if at > after else at + timedelta(days=1)


# ------------------------------------------------------------------------------------------------
# tokens, cost and session of each CLI


def test_codex_tokens_less_the_cache_a_computed_cost_and_its_thread(agent_fleet) -> None:
    # codex-cli 0.46 (jnarowski/agentcmd): usage 2,946 in (0 cached), 7 out; no cost in the output
    fleet = agent_fleet("codex", replay(("codex/exec-json-simple-answer-0.46.jsonl", 0)), model="gpt-5")
    task, run = one_run(fleet, "codex")
    assert task["state"] == "done" and task["result"]["summary"] == "4"
    assert (run["agent"], run["outcome"], tokens(run)) == ("codex", "done", (2946, 0, 0, 7, 0))
    # gpt-5's list price: 2,946 × $1.25 + 7 × $10 per million
    assert (float(run["cost_usd"]), run["cost_source"]) == (pytest.approx(0.0037525, abs=1e-6), "computed")
    assert run["agent_session"] == task["agent_session"] == "019a2d7a-41c4-78b1-b7cc-a45d62a89cd5"
    shown = fleet.cli("show", str(task["id"]), env={**fleet.env("operator"), "COLUMNS": "80"})
    assert shown.returncode == 0, shown.stderr
    assert "codex · tier - · profile p · pool - · model gpt-5" in shown.stdout
    assert "2,946 in · 0 cache write · 0 cache read · 7 out" in shown.stdout
    assert "cost $0.0038 (computed from the price table)" in shown.stdout
    assert max(len(line) for line in shown.stdout.splitlines()) <= 80


def test_codex_resumed_runs_record_their_own_share_of_the_thread_total(agent_fleet, tmp_path: Path) -> None:
    # codex 0.157.1 (littlebearapps/untether): three processes of one thread; each turn.completed
    # is the thread's running total (10,656 → 21,328 → 32,017 input, of it 5,888 → 11,776 → 21,760
    # cached; 6 → 13 → 21 output). Replayed as three attempts: two hand-offs, then done.
    lines = (CORPUS / "codex/exec-json-resume-cumulative-usage-0.157.1.jsonl").read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if '"thread.started"' in line] + [len(lines)]
    parts = []
    for n, (a, b) in enumerate(pairwise(starts)):
        part = tmp_path / f"process-{n + 1}.jsonl"
        part.write_text("\n".join(lines[a:b]) + "\n")
        parts.append(str(part))
    fleet = agent_fleet("codex", replay((parts[0], 75), (parts[1], 75), (parts[2], 0), resume=True))
    task = fleet.enqueue("work", "thread", {})
    for _ in range(3):  # a hand-off goes to the next shift
        fleet.run_shift("work", max_tasks=1, once=True)
    runs = fleet.runs(task)
    assert [r["outcome"] for r in runs] == ["handed_off", "handed_off", "done"]
    # fresh input = input - cached: 4,768 / 9,552 / 10,257 in total; each run its increment
    assert [tokens(r) for r in runs] == [(4768, 0, 5888, 6, 0), (4784, 0, 5888, 7, 0), (705, 0, 9984, 8, 0)]
    thread = "0199f000-0419-7000-8000-00000000c0de"
    assert [seen["argv"][-2:] for seen in argv_seen(fleet, "thread")][1:] == [["--resume", thread]] * 2


def test_opencode_sums_its_steps_and_an_error_event_with_exit_0_is_a_failure(agent_fleet) -> None:
    # opencode (littlebearapps/untether fixture): two step_finish parts, 21,772 + 671 in, 110 + 8 out,
    # cache reads 0 + 21,415, cost 0 + 0.001 (reported)
    fleet = agent_fleet("opencode", replay(("opencode/run-json-bash-tool-two-steps.jsonl", 0)))
    task, run = one_run(fleet, "steps")
    assert (task["state"], run["agent"], tokens(run)) == ("done", "opencode", (22443, 0, 21415, 118, 0))
    assert (float(run["cost_usd"]), run["cost_source"]) == (0.001, "reported")
    assert task["agent_session"] == "ses_494719016ffe85dkDMj0FPRbHK"
    # opencode 1.14.25: an UnknownError event, and the process exited 0
    other = agent_fleet("opencode", replay(("opencode/run-json-error-model-not-found-1.14.25.jsonl", 0)))
    task, run = one_run(other, "unknown-model")
    assert (task["state"], task["failures"], run["outcome"]) == ("queued", 1, "failed")
    assert "Model not found: nonexistent/nonexistent." in task["last_error"]


def test_gemini_tokens_with_thoughts_and_a_computed_cost(agent_fleet) -> None:
    # gemini-cli 0.26.0: input_tokens 11,598 (cached 0), output_tokens 69, total_tokens 11,785 →
    # output billed 11,785 - 11,598 = 187, of it 187 - 69 = 118 thoughts
    fleet = agent_fleet("gemini", replay(("gemini/stream-json-hello-0.26.0.jsonl", 0)), model="gemini-2.5-flash")
    task, run = one_run(fleet, "hello")
    assert (task["state"], run["agent"], tokens(run)) == ("done", "gemini", (11598, 0, 0, 187, 118))
    # the router alias "auto-gemini-3" has no price: the dispatched model's, 11,598 × $0.30 + 187 × $2.50
    assert (float(run["cost_usd"]), run["cost_source"]) == (pytest.approx(0.0039469, abs=1e-6), "computed")
    assert task["agent_session"] == "7bffa130-8c69-4cf8-ac8a-0d36b2d99f53"


def test_claude_sub_agents_count_from_model_usage(agent_fleet) -> None:
    # Claude Code 2.0.27 (link-assistant/hive-mind): modelUsage sonnet 156 / 60,390 / 1,773,252 /
    # 10,580 and haiku 1,371 / 17,928 / 21,342 / 4,179 (in / cache write / cache read / out);
    # total_cost_usd 0.9644163
    fleet = agent_fleet("claude", replay(("claude/stream-json-task-subagent-two-models-2.0.27.jsonl", 0)))
    task, run = one_run(fleet, "sub-agents")
    assert (task["state"], run["agent"]) == ("done", "claude")
    assert tokens(run) == (156 + 1371, 60390 + 17928, 1773252 + 21342, 10580 + 4179, 0)
    assert (float(run["cost_usd"]), run["cost_source"]) == (0.964416, "reported")
    assert task["agent_session"] == "46c574cf-a4e0-4294-912b-3e69ecc53cf5"


def test_claude_json_array_is_read_and_a_login_failure_is_an_ordinary_failure(agent_fleet) -> None:
    # Claude Code 2.1.126 `--output-format json --verbose`: one JSON array, result "Not logged in"
    fleet = agent_fleet("claude", replay(("claude/json-array-not-logged-in-2.1.126.json", 1)))
    task, run = one_run(fleet, "array")
    assert (task["state"], task["failures"], run["outcome"]) == ("queued", 1, "failed")
    assert run["agent_session"] == "b3d1aeb8-3513-49b9-ac2b-14406f585edb"
    assert events(fleet, task["id"], "throttled") == [] and "Not logged in" in task["last_error"]


# ------------------------------------------------------------------------------------------------
# last_error: the agent's own message; the raw output stays in the run's error_tail


@pytest.mark.parametrize(("agent", "sample", "said"), [
    # codex (hive-mind #715): five "Reconnecting... N/5" error events, then error + turn.failed
    ("codex", "codex/exec-json-reconnecting-401-turn-failed.jsonl",
     "exceeded retry limit, last status: 401 Unauthorized, request id: 99cdbe04acfb0b34-AMS"),
    # Claude Code (claude-sonnet-5 launcher.log): result error_max_turns with errors[]
    ("claude", "claude/stream-json-error-max-turns-result-sonnet-5.jsonl", "Reached maximum number of turns (40)"),
    # opencode: an UnknownError event whose message quotes a JSON body
    ("opencode", "opencode/run-json-error-direct-access-token-401.jsonl",
     'Failed to get direct access token: 401 Unauthorized - {"message":"401 Unauthorized"}'),
    # Gemini CLI 0.42.0: the result's own error
    ("gemini", "gemini/stream-json-result-error-invalid-model-0.42.0.jsonl",
     "[API Error: Requested entity was not found.]"),
])
def test_last_error_is_the_agents_own_error_message(agent_fleet, agent: str, sample: str, said: str) -> None:
    fleet = agent_fleet(agent, replay((sample, 1)))
    task, run = one_run(fleet, "failing")
    assert (task["state"], run["outcome"], run["exit_code"]) == ("queued", "failed", 1)
    assert task["last_error"] == f"exit code 1: {said}"
    # what it printed stays with the run: the end of the log (2000 bytes), records and all
    tail = (CORPUS / sample).read_bytes()[-2000:].decode("utf-8", "replace")
    assert run["error_tail"] == tail and '{"type"' in run["error_tail"]


def test_a_long_stream_cut_mid_record_is_not_taken_for_the_error(agent_fleet) -> None:
    # codex's full real turn (hive-mind #642, 23 KB), replayed with exit 1: the log's last 4000
    # bytes begin inside a record (what the old last_error showed: `exit code 1: xt":"Explore
    # repo…`), and no record names an error, so the agent's last message is what it said
    sample = "codex/exec-json-full-session-todo-file-change.jsonl"
    fleet = agent_fleet("codex", replay((sample, 1)))
    task, run = one_run(fleet, "long")
    records = [json.loads(line) for line in (CORPUS / sample).read_text().splitlines()]
    said = [r["item"]["text"] for r in records
            if r["type"] == "item.completed" and r["item"]["type"] == "agent_message"][-1]
    assert task["last_error"] == f"exit code 1: {said}"[:2000]
    assert run["error_tail"] == (CORPUS / sample).read_bytes()[-2000:].decode("utf-8", "replace")


def test_without_records_the_last_lines_of_stderr_are_the_error(agent_fleet) -> None:
    # a real process's stderr (Python's traceback of a missing module), no JSON records at all
    fleet = agent_fleet("generic", [sys.executable, "-c", "import lanefleet_no_such_module"])
    task, run = one_run(fleet, "stderr")
    assert task["last_error"] == ("exit code 1: Traceback (most recent call last):\n"
                                  "File \"<string>\", line 1, in <module>\n"
                                  "ModuleNotFoundError: No module named 'lanefleet_no_such_module'")
    assert run["error_tail"].startswith("Traceback (most recent call last):")


# ------------------------------------------------------------------------------------------------
# usage limits: the signal, the text and the reset in the journal


def test_a_weekly_limit_with_exit_0_throttles_until_its_reset(agent_fleet) -> None:
    # hive-mind's log: synthetic "Weekly limit reached ∙ resets 5am", result is_error, exit code 0
    fleet = agent_fleet("claude", replay(("claude/stream-json-weekly-limit-reached-tail-exit0.jsonl", 0)))
    task, run = one_run(fleet, "weekly")
    assert (task["state"], task["failures"], run["outcome"]) == ("queued", 0, "throttled")
    (detail,) = events(fleet, task["id"], "throttled")
    assert detail["signal"] == "assistant <synthetic>" and "Weekly limit reached ∙ resets 5am" in detail["text"]
    reset = next_clock(run["ended_at"], 5, 0)
    assert abs(datetime.fromisoformat(detail["reset_read"]) - reset) < timedelta(minutes=2)
    assert abs(task["run_at"] - reset) < timedelta(minutes=2)


def test_codex_usage_limit_names_its_signal_and_the_clock_it_read(agent_fleet) -> None:
    # codex exec --json (hive-mind #719): turn.failed "… or try again at 12:16 PM."
    fleet = agent_fleet("codex", replay(("codex/exec-json-usage-limit-try-again-at-12-16-PM.jsonl", 1)))
    task, run = one_run(fleet, "codex-limit")
    assert (task["state"], task["failures"], run["outcome"]) == ("queued", 0, "throttled")
    (detail,) = events(fleet, task["id"], "throttled")
    assert detail["signal"] == "codex turn.failed" and "try again at 12:16 PM" in detail["text"]
    reset = next_clock(run["ended_at"], 12, 16)
    assert abs(datetime.fromisoformat(detail["reset_read"]) - reset) < timedelta(minutes=2)
    assert task["run_at"] >= max(reset, run["ended_at"] + timedelta(seconds=59)) - timedelta(minutes=2)


def test_a_gemini_invalid_stream_is_retried_without_spending_an_attempt(agent_fleet) -> None:
    # Gemini CLI 0.44.0 (switchboard's capture): the answer streamed, then an error event "Invalid
    # stream: …" and a result of status "error" that names no error; exit 1. The model's reply
    # failed, not the task: a transient, journaled in its words
    sample = "gemini/stream-json-error-event-result-error-no-error-field-0.44.0.jsonl"
    fleet = agent_fleet("gemini", replay((sample, 1)), max_transient=2)
    task, run = one_run(fleet, "invalid-stream")
    assert (task["state"], task["failures"], task["transients"], run["outcome"]) == ("queued", 0, 1, "transient")
    (detail,) = events(fleet, task["id"], "transient")
    assert detail["transients"] == 1
    assert "Invalid stream: The model returned an empty response or malformed tool call." in detail["error"]


def test_gemini_exhausted_capacity_throttles_for_the_delay_it_names(agent_fleet) -> None:
    # a stream-json result (index 65889011546, "Exact JSON from user"): "[API Error: You have
    # exhausted your capacity on this model. Your quota will reset after 3h5m30s.]"
    fleet = agent_fleet("gemini", replay(("gemini/stream-json-result-error-exhausted-capacity-quota.jsonl", 1)))
    task, run = one_run(fleet, "gemini-quota")
    assert (task["state"], task["failures"], run["outcome"]) == ("queued", 0, "throttled")
    (detail,) = events(fleet, task["id"], "throttled")
    assert detail["signal"] == "result error" and "reset after 3h5m30s" in detail["text"]
    reset = run["ended_at"] + timedelta(hours=3, minutes=5, seconds=30)  # 11,130 s, not "3 o'clock"
    assert abs(datetime.fromisoformat(detail["reset_read"]) - reset) < timedelta(minutes=2)
    assert abs(task["run_at"] - reset) < timedelta(minutes=2)


# ------------------------------------------------------------------------------------------------
# sessions: resumed only where they live, dropped when the agent cannot find them


def test_a_session_the_agent_cannot_find_is_dropped_without_spending_an_attempt(agent_fleet) -> None:
    # attempt 1: Claude Code 2.1.3's session 40e7b02d… hands off (exit 75); attempt 2 resumes it and
    # gets cc-haha#271's "No conversation found with session ID" (a new id, 7cd10988…, exit 1);
    # attempt 3 starts fresh and succeeds (2.1.7's session 1d1e46f9…)
    fleet = agent_fleet("claude", replay(("claude/stream-json-success-tool-use-2.1.3.jsonl", 75),
                                         ("claude/stream-json-no-conversation-found-resume.jsonl", 1),
                                         ("claude/stream-json-success-minimal-2.1.7.jsonl", 0), resume=True))
    task_id = fleet.enqueue("work", "gone", {})
    for _ in range(2):  # a hand-off goes to the next shift; a dropped session is claimed again at once
        fleet.run_shift("work", max_tasks=2, once=True)
    task, runs = fleet.task(task_id), fleet.runs(task_id)
    assert [r["outcome"] for r in runs] == ["handed_off", "session_dropped", "done"]
    assert (task["state"], task["failures"]) == ("done", 0)
    first = "40e7b02d-c0f9-4876-9010-f514d4eb0603"
    assert [s["session"] for s in argv_seen(fleet, "gone")] == ["", first, ""]
    assert runs[1]["agent_session"] != "7cd10988-45cc-4e45-85ff-2d3d83316f0a"
    (dropped,) = events(fleet, task_id, "session_dropped")
    assert dropped["agent_session"] == first and "No conversation found" in dropped["note"]
    assert task["agent_session"] == "1d1e46f9-35c7-4834-b529-846d5bb82288"


@pytest.mark.parametrize(("agent", "session", "id_field", "missing", "code", "said"), [
    # opencode 1.14.19 (anomalyco/opencode#27559): "Session not found" on stderr, nothing else, exit 0
    ("opencode", "opencode/run-json-bash-tool-two-steps.jsonl", "sessionID",
     "opencode/run-json-session-not-found-stderr-1.14.19.txt", 0, "Session not found: ses_doesnotexist"),
    # Gemini CLI 0.42.0 (switchboard's capture): "Error resuming session: Invalid session identifier", exit 42
    ("gemini", "gemini/stream-json-hello-0.26.0.jsonl", "session_id",
     "gemini/stderr-resume-unknown-session-0.42.0.txt", 42, "Invalid session identifier"),
    # Codex 0.137.0 (vm0-ai/vm0#16125): "no rollout found for thread id …" on stderr, exit 1
    ("codex", "codex/exec-json-simple-answer-0.46.jsonl", "thread_id",
     "codex/stderr-resume-no-rollout-found-0.137.0.txt", 1, "no rollout found for thread id"),
], ids=["opencode", "gemini", "codex"])
def test_each_clis_session_it_cannot_resume_is_dropped_whatever_its_exit_code(
        agent_fleet, agent: str, session: str, id_field: str, missing: str, code: int, said: str) -> None:
    # attempt 1: a real session hands off (exit 75); attempt 2 resumes it and the CLI says, in its
    # own words, that it has no such session; attempt 3 starts fresh and the same sample succeeds
    fleet = agent_fleet(agent, replay((session, 75), (missing, code), (session, 0), resume=True))
    task_id = fleet.enqueue("work", "gone", {})
    for _ in range(2):
        fleet.run_shift("work", max_tasks=2, once=True)
    task, runs = fleet.task(task_id), fleet.runs(task_id)
    assert [r["outcome"] for r in runs] == ["handed_off", "session_dropped", "done"]
    assert (task["state"], task["failures"]) == ("done", 0)
    first = json.loads((CORPUS / session).read_text().splitlines()[0])[id_field]
    assert [s["session"] for s in argv_seen(fleet, "gone")] == ["", first, ""]
    (dropped,) = events(fleet, task_id, "session_dropped")
    assert dropped["agent_session"] == first and said in dropped["note"]


def test_a_session_recorded_on_another_host_is_not_resumed_here(agent_fleet) -> None:
    fleet = agent_fleet("claude", replay(("claude/stream-json-success-tool-use-2.1.3.jsonl", 75),
                                         ("claude/stream-json-success-minimal-2.1.7.jsonl", 0), resume=True))
    task_id = fleet.enqueue("work", "moved", {})
    fleet.run_shift("work", max_tasks=1, once=True)
    row = fleet.task(task_id)
    assert row["agent_session"] == "40e7b02d-c0f9-4876-9010-f514d4eb0603" and row["agent_session_profile"] == "p"
    fleet.sql("update fleet.tasks set agent_session_host = 'another-host' where id = %s", (task_id,))
    fleet.run_shift("work", max_tasks=1, once=True)
    assert fleet.task(task_id)["state"] == "done"
    second = argv_seen(fleet, "moved")[1]
    assert second["session"] == "" and "--resume" not in second["argv"]


# ------------------------------------------------------------------------------------------------
# transient provider errors


def test_provider_errors_are_retried_without_spending_attempts_up_to_the_lane_cap(agent_fleet,
                                                                                   tmp_path: Path) -> None:
    # real wording (anthropics/claude-code#35768, limits/api-error-wordings.jsonl) in a record we
    # built on Claude Code 2.1.220's result shape (tests/agents/corpus has no captured 529 result)
    wording = next(json.loads(line)["text"] for line in
                   (CORPUS / "limits/api-error-wordings.jsonl").read_text().splitlines()
                   if "req_011CZAZLPuVRisJc8oe4zrKo" in line)
    record = {"type": "result", "subtype": "success", "is_error": True, "api_error_status": 529,
              "duration_ms": 1200, "num_turns": 1, "result": wording, "session_id": "s-overloaded",
              "total_cost_usd": 0, "usage": {"input_tokens": 0, "output_tokens": 0}}
    sample = tmp_path / "constructed-529.jsonl"
    sample.write_text(json.dumps(record) + "\n")
    fleet = agent_fleet("claude", replay((str(sample), 1)), max_transient=2, max_attempts=3)
    task_id = fleet.enqueue("work", "overloaded", {})
    outcomes = []
    for _ in range(3):
        fleet.sql("update fleet.tasks set run_at = now() where id = %s", (task_id,))  # skip the backoff
        fleet.run_shift("work", max_tasks=1, once=True)
        outcomes.append((fleet.task(task_id)["state"], fleet.task(task_id)["failures"]))
    assert outcomes == [("queued", 0), ("queued", 0), ("queued", 1)]  # the third is past max_transient
    assert [r["outcome"] for r in fleet.runs(task_id)] == ["transient", "transient", "failed"]
    assert [d["transients"] for d in events(fleet, task_id, "transient")] == [1, 2]
