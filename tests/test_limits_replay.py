"""Usage limits read from real captured agent output (tests/agents/corpus/, sources in its README),
replayed through real shifts by tests/agents/replay.py, on both store back-ends; and the reset
sanity rules of worker.shift.limits.usage_limit on the real wordings.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fleetkit import Backend, Fleet, lane_defaults

from worker.agent.adapters import adapter
from worker.shift.limits import judge, reset_time, usage_limit

CORPUS = Path(__file__).resolve().parent / "agents" / "corpus"
REPLAY = str(Path(__file__).resolve().parent / "agents" / "replay.py")


def replaying(sample: str, code: int = 0) -> list[str]:
    return [sys.executable, REPLAY, str(CORPUS / sample), str(code)]


@pytest.fixture
def replay_fleet(backend: Backend, tmp_path: Path):
    made: list[Fleet] = []

    def make(sample: str, code: int = 0) -> Fleet:
        f = Fleet(backend, tmp_path, {"work": lane_defaults(command=replaying(sample, code))})
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def test_a_success_with_allowed_rate_limit_events_is_done_not_throttled(replay_fleet) -> None:
    # Claude Code 2.1.83 (anthropics/claude-code#38673): rate_limit_event status "allowed" records
    # in an ordinary, successful session
    fleet = replay_fleet("claude/stream-json-success-rate-limit-allowed-2.1.83.jsonl")
    task = fleet.enqueue("work", "allowed", {})
    fleet.run_shift("work", max_tasks=1, once=True)
    assert fleet.task(task)["state"] == "done"
    assert [r["outcome"] for r in fleet.runs(task)] == ["done"]


def test_a_success_that_mentions_rate_limiting_is_done(backend: Backend, tmp_path: Path) -> None:
    # Claude Code 2.1.3's real session of the corpus, its final result text replaced by a summary
    # about rate limiting (the record's shape stays the captured one)
    lines = (CORPUS / "claude/stream-json-success-tool-use-2.1.3.jsonl").read_text().splitlines()
    result = json.loads(lines[-1])
    assert result["type"] == "result" and result["is_error"] is False
    result["result"] = "Added rate limiting to POST /login; tests pass"
    edited = tmp_path / "edited.jsonl"
    edited.write_text("\n".join([*lines[:-1], json.dumps(result)]) + "\n")
    fleet = Fleet(backend, tmp_path, {"work": lane_defaults(command=[sys.executable, REPLAY, str(edited), "0"])})
    try:
        task = fleet.enqueue("work", "mentions", {})
        fleet.run_shift("work", max_tasks=1, once=True)
        assert fleet.task(task)["state"] == "done"
        assert fleet.sql("select count(*) as n from fleet.journal where kind = 'throttled'")[0]["n"] == 0
    finally:
        fleet.close()


def test_a_failed_run_whose_agent_quotes_limit_reached_is_a_failure_not_a_limit(replay_fleet) -> None:
    # Claude Code 2.0.27 (link-assistant/hive-mind): the agent's messages and summary quote the code
    # it worked on ("⚠️  Limit reached: 200 applications in 24 hours"); replayed with exit code 1
    sample = "claude/stream-json-task-subagent-two-models-2.0.27.jsonl"
    assert "Limit reached" in (CORPUS / sample).read_text()
    fleet = replay_fleet(sample, 1)
    task = fleet.enqueue("work", "quotes", {})
    fleet.run_shift("work", max_tasks=1, once=True)
    run = fleet.runs(task)[0]
    assert (run["outcome"], fleet.task(task)["failures"]) == ("failed", 1), run
    assert fleet.sql("select count(*) as n from fleet.journal where kind = 'throttled'")[0]["n"] == 0
    assert fleet.sql("select count(*) as n from fleet.pools where throttled_until is not null")[0]["n"] == 0


def test_a_rejected_rate_limit_event_throttles_until_its_reset(replay_fleet) -> None:
    sample = "claude/stream-json-session-limit-rejected-429-2.1.220.jsonl"
    fleet = replay_fleet(sample, 1)
    task = fleet.enqueue("work", "rejected", {})
    fleet.run_shift("work", max_tasks=1, once=True)
    row = fleet.task(task)
    run = fleet.runs(task)[0]
    assert (row["state"], row["failures"], run["outcome"]) == ("queued", 0, "throttled")
    assert row["run_at"] >= datetime.now(UTC) + timedelta(seconds=50)  # never sooner than the floor


# ------------------------------------------------------------------------------------------------
# the wordings, and the resets that are not believed


NOW = datetime(2026, 11, 30, 13, 0, tzinfo=UTC)


def wordings(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (CORPUS / "limits" / name).read_text().splitlines() if line.strip()]


def test_every_claude_limit_wording_of_the_corpus_is_a_limit_when_the_run_failed() -> None:
    # ("You're out of extra usage · resets …" of 2.1.123 and 2.1.143 among them)
    missed = [w for w in wordings("claude-limit-wordings.jsonl")
              if usage_limit(None, 1, None, str(w.get("text", "")), now=NOW) is None]
    assert missed == []


def test_no_limit_wording_is_a_limit_of_a_run_that_succeeded() -> None:
    for w in wordings("claude-limit-wordings.jsonl") + wordings("codex-limit-wordings.jsonl"):
        assert usage_limit(None, 0, str(w.get("text", "")), "", succeeded=True, now=NOW) is None


@pytest.mark.parametrize("text", [
    "Claude AI usage limit reached|1700000000",          # a reset in the past
    "usage limit: rate limited until 2026-11-30T12:00:00Z",  # past, as ISO
    "usage limit reached, retry-after: 2592000",         # 30 days: longer than any window
])
def test_a_reset_in_the_past_or_too_far_ahead_is_not_believed(text: str) -> None:
    hit = usage_limit(None, 1, text, "", now=NOW)
    assert hit is not None and hit.until is None and hit.after_seconds == 900.0


def test_a_near_reset_is_read_as_said_and_the_database_applies_the_floor() -> None:
    # the floor is fleet.throttle's (tests/sql/test_finish.py); Python reports what it read
    hit = usage_limit(None, 1, "usage limit, retry-after: 2", "", now=NOW)
    assert hit is not None and hit.after_seconds == 2.0 and hit.signal == "pattern 'usage limit'"
    assert hit.signal_report() == {"signal": "pattern 'usage limit'", "text": "usage limit, retry-after: 2",
                                   "reset": (NOW + timedelta(seconds=2)).isoformat()}


def test_a_timestamp_elsewhere_in_the_output_is_never_taken_for_the_reset() -> None:
    # Gemini CLI 0.26.0's real events carry an ISO `timestamp` each; the limit line names 12pm
    events = (CORPUS / "gemini/stream-json-hello-0.26.0.jsonl").read_text()
    hit = usage_limit(None, 1, None, events + "5-hour limit reached ∙ resets 12pm\n", now=NOW)
    assert hit is not None and hit.until == datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def wording(name: str, fragment: str) -> str:
    (text,) = [str(w["text"]) for w in wordings(name) if fragment in str(w["text"])]
    return text


# now = 2026-11-30 13:00 UTC; each reset worked out by hand from the real wording
@pytest.mark.parametrize("file, fragment, until, after", [
    ("claude-limit-wordings.jsonl", "resets Oct 31, 9am", datetime(2027, 10, 31, 9, 0, tzinfo=UTC), None),
    ("claude-limit-wordings.jsonl", "resets Jan 18, 11:30am (Asia/Calcutta)",
     datetime(2027, 1, 18, 6, 0, tzinfo=UTC), None),  # 11:30 IST is 06:00 UTC
    ("claude-limit-wordings.jsonl", "resets Sep 15 at 7pm", datetime(2027, 9, 15, 19, 0, tzinfo=UTC), None),
    ("claude-limit-wordings.jsonl", "regain access on 2026-04-01 at 00:00 UTC",
     datetime(2026, 4, 1, 0, 0, tzinfo=UTC), None),
    ("codex-limit-wordings.jsonl", "try again in 5 days 22 hours 11 minutes", None, 5 * 86400 + 22 * 3600 + 11 * 60),
    ("codex-limit-wordings.jsonl", "try again at 12:16", datetime(2026, 12, 1, 12, 16, tzinfo=UTC), None),
    # Claude Code 2.1.143: 14:00 in Warsaw (CET, UTC+1) now; 20:40 CET today is 19:40 UTC
    ("claude-limit-wordings.jsonl", "out of extra usage · resets 8:40pm (Europe/Warsaw)",
     datetime(2026, 11, 30, 19, 40, tzinfo=UTC), None),
    # codex-cli 0.153.4: a date with an ordinal and the year, a 12-hour clock and no zone (read as
    # UTC, like "try again at 12:16 PM"; the CLI printed its machine's local time, +02:00 there)
    ("codex-limit-wordings.jsonl", "try again at Sep 15th, 2026 7:59 PM", datetime(2026, 9, 15, 19, 59, tzinfo=UTC),
     None),
    ("codex-limit-wordings.jsonl", "try again at Apr 28th, 2026 10:03 PM", datetime(2026, 4, 28, 22, 3, tzinfo=UTC),
     None),
    ("codex-limit-wordings.jsonl", "try again at Jul 23rd, 2026 4:15 AM", datetime(2026, 7, 23, 4, 15, tzinfo=UTC),
     None),
    ("codex-limit-wordings.jsonl", "try again at Aug 20, 2026, 7:38 AM", datetime(2026, 8, 20, 7, 38, tzinfo=UTC),
     None),
    # Gemini CLI's units written together: a span, not "reset … 3" read as 3 o'clock
    ("gemini-quota-wordings.jsonl", "reset after 3h5m30s", None, 3 * 3600 + 5 * 60 + 30),
    ("gemini-quota-wordings.jsonl", "reset after 21h41m24s", None, 21 * 3600 + 41 * 60 + 24),
])
def test_resets_with_a_date_a_span_or_a_clock_are_read(file: str, fragment: str, until: datetime | None,
                                                      after: float | None) -> None:
    assert reset_time(wording(file, fragment), now=NOW) == (until, after)


def test_a_dated_reset_months_ahead_is_not_believed_but_a_near_one_is() -> None:
    # Oct 31 seen from Nov 30 is eleven months ahead: a misread, the backoff applies
    far = usage_limit(None, 1, wording("claude-limit-wordings.jsonl", "resets Oct 31, 9am"), "", now=NOW)
    assert far is not None and far.until is None and far.after_seconds == 900.0
    near = usage_limit(None, 1, wording("claude-limit-wordings.jsonl", "resets Oct 31, 9am"), "",
                       now=datetime(2026, 10, 29, 8, 0, tzinfo=UTC))
    assert near is not None and near.until == datetime(2026, 10, 31, 9, 0, tzinfo=UTC)


# ------------------------------------------------------------------------------------------------
# Claude Code's "out of extra usage" result, Codex 0.153.4's dated limit line


EXTRA_USAGE = "claude/stream-json-result-out-of-extra-usage-exit1.jsonl"
# the harness logged that run at 2026-04-21 00:19:38 UTC
EXTRA_USAGE_AT = datetime(2026, 4, 21, 0, 19, 38, tzinfo=UTC)


def test_out_of_extra_usage_with_exit_1_is_a_limit_until_its_reset() -> None:
    text = (CORPUS / EXTRA_USAGE).read_text()
    reading = adapter("claude").reader().feed(text)
    verdict = judge(reading, 1, None, text, resumed=False, now=EXTRA_USAGE_AT)
    assert verdict.kind == "throttled"
    # Apr 24, 4am in Tokyo (UTC+9) is Apr 23, 19:00 UTC: 2 days 18 h ahead, believed
    assert verdict.limit is not None and verdict.limit.until == datetime(2026, 4, 23, 19, 0, tzinfo=UTC)


def test_out_of_extra_usage_replayed_throttles(replay_fleet) -> None:
    fleet = replay_fleet(EXTRA_USAGE, 1)
    task = fleet.enqueue("work", "extra-usage", {})
    fleet.run_shift("work", max_tasks=1, once=True)
    row, run = fleet.task(task), fleet.runs(task)[0]
    assert (row["state"], row["failures"], run["outcome"]) == ("queued", 0, "throttled")


def test_codex_0_153_dated_limit_line_on_stderr_is_a_limit() -> None:
    # `codex exec` (no --json) printed it on stderr and exited 1: no records, the text says it
    line = wording("codex-limit-wordings.jsonl", "Sep 15th, 2026 7:59 PM")
    reading = adapter("codex").reader().feed(line + "\n")
    assert (reading.final, reading.limit) == (False, None)
    verdict = judge(reading, 1, None, line + "\n", resumed=False, now=datetime(2026, 9, 11, 4, 8, tzinfo=UTC))
    assert verdict.kind == "throttled" and verdict.limit is not None
    assert verdict.limit.note == line and verdict.limit.signal == "pattern 'usage limit'"
    # the date it names, read as UTC (four days ahead: believed)
    assert verdict.limit.until == datetime(2026, 9, 15, 19, 59, tzinfo=UTC)


def test_a_resumed_run_that_did_work_and_exited_0_is_done_whatever_it_quotes() -> None:
    # the opencode line of "Session not found" (anomalyco/opencode#27559), in a run that also
    # showed a session and tokens: done; the same line alone (1.14.19's whole output): dropped
    line = (CORPUS / "opencode/run-json-session-not-found-stderr-1.14.19.txt").read_text()
    alone = adapter("opencode").reader().feed(line)
    assert judge(alone, 0, None, line, resumed=True, now=NOW).kind == "session_dropped"
    worked = (CORPUS / "opencode/run-json-bash-tool-two-steps.jsonl").read_text().splitlines()[0] + "\n" + line
    reading = adapter("opencode").reader().feed(worked)
    assert reading.session_missing is not None and reading.session_id is not None
    assert judge(reading, 0, None, worked, resumed=True, now=NOW).kind == "done"


@pytest.mark.parametrize("fragment", ["try again at 10 de jul. de 2026, 11:52", "wait for limits to reset (every 5h"])
def test_a_number_that_is_no_clock_names_no_reset(fragment: str) -> None:
    # Codex's pt-BR date (openai/codex#28089) and its "(every 5h and every week.)": once read as
    # 10:00 and 05:00 today, believed, and retried too early
    assert reset_time(wording("codex-limit-wordings.jsonl", fragment), now=NOW) == (None, None)


@pytest.mark.parametrize("text", ["HTTP 429 in 5d41402abc4b2a76b9719d911017c592", "wait after 2h3f9a1c"])
def test_a_span_whose_last_unit_runs_into_a_word_is_no_delay(text: str) -> None:
    assert reset_time(text, now=NOW) == (None, None)
