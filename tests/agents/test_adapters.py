"""Every sample of tests/agents/corpus through its adapter, with the figures worked out by hand.

Each sample is read twice: whole (``feed``) and as a growing log (written to a file in pieces and
read in small chunks, as a shift reads a running agent); the two readings must be equal.
"""

from __future__ import annotations

import importlib
import itertools
import json
import pkgutil
import subprocess
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

import worker.agent.adapters as adapters
from worker.agent.adapters import ADAPTERS, Adapter, Reading, Tokens, adapter, detect
from worker.agent.adapters.base import WindowReading, latest_windows
from worker.agent.executor import render_argv

CORPUS = Path(__file__).parent / "corpus"
CLIS = ("claude", "codex", "opencode", "gemini")


def sample(cli: str, name: str) -> str:
    return (CORPUS / cli / name).read_text(encoding="utf-8")


def streamed(cli: str, text: str) -> Reading:
    """The reading of ``text`` as a log that grows in seven pieces, read 509 bytes at a time."""
    reader = adapter(cli).reader()
    data = text.encode()
    cuts = sorted({0, len(data), *(len(data) * k // 7 for k in range(1, 7))})
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "run.log"
        log.write_bytes(b"")
        for start, end in itertools.pairwise(cuts):
            with log.open("ab") as fh:
                fh.write(data[start:end])
            while reader.read(log, limit=509):
                pass
        return reader.read_all(log)


def read(cli: str, text: str) -> Reading:
    fed = adapter(cli).reader().feed(text)
    assert streamed(cli, text) == fed
    return fed


def read_sample(cli: str, name: str) -> Reading:
    return read(cli, sample(cli, name))


def lines(cli: str, name: str) -> list[str]:
    return sample(cli, name).splitlines()


def test_every_sample_is_checked_here() -> None:
    """A sample added to the corpus gets its figures here too."""
    found = {f"{cli}/{p.name}" for cli in CLIS for p in (CORPUS / cli).iterdir()}
    assert found == HAND_CHECKED


@pytest.mark.parametrize("path", sorted(f"{cli}/{p.name}" for cli in CLIS for p in (CORPUS / cli).iterdir()))
def test_streamed_reading_equals_the_whole(path: str) -> None:
    cli, name = path.split("/")
    read_sample(cli, name)


# -- Claude Code


def test_claude_tool_use_success_2_1_3() -> None:
    r = read_sample("claude", "stream-json-success-tool-use-2.1.3.jsonl")
    assert (r.agent, r.final, r.succeeded, r.subtype) == ("claude", True, True, "success")
    assert r.session_id == "40e7b02d-c0f9-4876-9010-f514d4eb0603"
    assert r.summary == "Here are the files in the current directory."
    # modelUsage opus: inputTokens 38, cacheCreation 31159, cacheRead 28775, outputTokens 765 (not
    # the top-level usage's 18 / 25067 / 17254 / 424)
    opus = Tokens(input=38, cache_write=31159, cache_read=28775, output=765)
    assert r.tokens == opus and r.by_model == {"claude-opus-4-5-20251101": opus}
    assert r.tokens.total == 38 + 31159 + 28775 + 765
    assert r.cost_usd == 0.24722425  # total_cost_usd (modelUsage's costUSD 0.2284 is not it)
    assert (r.limit, r.transient, r.session_missing) == (None, None, None)
    # before the result: the one assistant message's usage 10 / 3556 / 17254 / 4
    early = adapter("claude").reader().feed("\n".join(lines("claude", "stream-json-success-tool-use-2.1.3.jsonl")[:3]))
    assert not early.final
    assert early.by_model == {"claude-opus-4-5-20251101": Tokens(10, 3556, 17254, 4)}


def test_claude_minimal_success_without_model_usage_2_1_7() -> None:
    r = read_sample("claude", "stream-json-success-minimal-2.1.7.jsonl")
    assert (r.succeeded, r.summary, r.session_id) == (True, "4", "1d1e46f9-35c7-4834-b529-846d5bb82288")
    # no modelUsage: the result's usage 10 / 21570 / 0 / 25, no model named
    assert r.tokens == Tokens(input=10, cache_write=21570, cache_read=0, output=25)
    assert r.by_model == {}
    assert r.cost_usd == 0.1354875


def test_claude_rate_limit_allowed_is_not_a_limit_2_1_83() -> None:
    r = read_sample("claude", "stream-json-success-rate-limit-allowed-2.1.83.jsonl")
    # status "allowed" (even with overageStatus "rejected") is an ordinary session
    assert r.limit is None and r.succeeded
    assert r.summary is None  # "result": "" as published
    assert r.session_id == "REDACTED"
    assert r.tokens == Tokens(input=3, output=6)  # the reduced result's usage: 3 in, 6 out
    assert r.cost_usd == 0.024


def test_claude_multi_turn_last_result_wins_2_1_285() -> None:
    name = "stream-json-multi-turn-cumulative-allowed-warning-2.1.285.jsonl"
    r = read_sample("claude", name)
    assert r.succeeded and r.summary == "OK."
    assert r.session_id == "4cda4f2a-2a49-499b-af37-c6f4739bd0c7"
    # the last result (result_index 3): modelUsage haiku 1545 in, 77338 cache write, 314408 cache
    # read, 2536 out of which thinkingTokens 961 — cumulative, so not added to the first result's
    haiku = Tokens(input=1545, cache_write=77338, cache_read=314408, output=2536, reasoning=961)
    assert r.tokens == haiku and r.by_model == {"claude-haiku-4-5-20251001": haiku}
    assert r.cost_usd == 0.20030130000000002  # total_cost_usd of the last result, not 0.064 + 0.200
    assert r.limit is None  # rate_limit_event allowed_warning (utilization 0.77) is never a limit
    first = lines("claude", name)
    # the first turn alone (records 1-10): result_index 0, modelUsage 18 / 29690 / 34984 / 234 (114 thinking)
    turn = adapter("claude").reader().feed("\n".join(first[:10]))
    assert turn.tokens == Tokens(input=18, cache_write=29690, cache_read=34984, output=234, reasoning=114)
    assert turn.cost_usd == 0.06406640000000001
    # before it, the estimate: msg …HfZ2 (10 / 7424 / 13780 / 3) + msg …VzTB (8 / 22266 / 21204 / 1),
    # each repeated on two content blocks and counted once: 18 / 29690 / 34984 / 4 — the streamed
    # output_tokens is not final (234 in the result)
    early = adapter("claude").reader().feed("\n".join(first[:9]))
    assert not early.final
    assert early.tokens == Tokens(input=18, cache_write=29690, cache_read=34984, output=4)


def test_claude_sub_agent_two_models_2_0_27() -> None:
    name = "stream-json-task-subagent-two-models-2.0.27.jsonl"
    r = read_sample("claude", name)
    assert r.succeeded and r.session_id == "46c574cf-a4e0-4294-912b-3e69ecc53cf5"
    assert r.summary is not None and r.summary.startswith("Perfect! Let me create a summary")
    # modelUsage: sonnet 156 / 60390 / 1773252 / 10580, haiku (the Task sub-agent) 1371 / 17928 /
    # 21342 / 4179; the top-level usage counts only sonnet
    sonnet = Tokens(input=156, cache_write=60390, cache_read=1773252, output=10580)
    haiku = Tokens(input=1371, cache_write=17928, cache_read=21342, output=4179)
    assert r.by_model == {"claude-sonnet-4-5-20250929": sonnet, "claude-haiku-4-5-20251001": haiku}
    assert r.tokens == Tokens(input=156 + 1371, cache_write=60390 + 17928, cache_read=1773252 + 21342,
                              output=10580 + 4179)
    assert r.cost_usd == 0.9644162999999997  # sonnet $0.9176 + haiku $0.0468
    # just before the result record: the largest usage of each of the 44 message ids, by model —
    # sonnet 41 ids: 156 / 60390 / 1773252 / 7733; haiku 3 ids: 573 / 8378 / 12964 / 3 (1 863 449 in all).
    # The gap to the result (known: streamed usage undercounts sub-agents and output): sonnet output
    # 2 847; haiku 798 in, 9 550 cache write, 8 378 cache read, 4 176 out.
    early = adapter("claude").reader().feed("\n".join(lines("claude", name)[:-1]))
    assert not early.final
    assert early.by_model == {"claude-sonnet-4-5-20250929": Tokens(156, 60390, 1773252, 7733),
                              "claude-haiku-4-5-20251001": Tokens(573, 8378, 12964, 3)}
    assert early.tokens.total == 1863449
    assert r.tokens.minus(early.tokens) == Tokens(input=798, cache_write=9550, cache_read=8378, output=2847 + 4176)


def test_claude_weekly_limit_exit_0() -> None:
    r = read_sample("claude", "stream-json-weekly-limit-reached-tail-exit0.jsonl")
    # subtype "success" with is_error true: not a success, whatever the exit code (0 here)
    assert (r.final, r.succeeded, r.subtype) == (True, False, "success")
    assert r.limit is not None and r.limit.text == "Weekly limit reached ∙ resets 5am"
    assert r.limit.signal == "assistant <synthetic>" and r.limit.until is None  # the shift reads "resets 5am"
    assert r.transient is None
    assert r.error == "Weekly limit reached ∙ resets 5am"
    # modelUsage haiku 7209 / 0 / 0 / 2120 + sonnet 858 / 19624 / 58446 / 2397
    assert r.tokens == Tokens(input=7209 + 858, cache_write=19624, cache_read=58446, output=2120 + 2397)
    assert r.cost_usd == 0.14746179999999998
    assert r.session_id == "64652bfd-65f5-460f-bb16-fa89fa8fc778"


def test_claude_session_limit_rejected_429_2_1_220() -> None:
    name = "stream-json-session-limit-rejected-429-2.1.220.jsonl"
    r = read_sample("claude", name)
    assert r.final and not r.succeeded
    # the rejected rate_limit_event says it (no resetsAt in this one); its text is the synthetic
    # assistant's wording, which names the reset
    assert r.limit is not None and r.limit.signal == "rate_limit_event rejected"
    assert r.limit.text == "You've hit your session limit · resets 9am (Europe/Berlin)"
    assert r.limit.until is None and r.transient is None
    assert r.session_id == "a74d2edb-d7df-475f-ad7f-2c89def2ca88"  # from the records before the result
    # the result record alone still says it: api_error_status 429 on an is_error result
    alone = read("claude", lines("claude", name)[-1])
    assert alone.limit is not None and alone.limit.signal == "api_error_status 429"
    assert alone.limit.text == "You've hit your session limit · resets 9am (Europe/Berlin)"


def test_claude_rejected_rate_limit_event_with_resets_at() -> None:
    r = read_sample("claude", "rate-limit-event-rejected-resetsat-line.jsonl")
    assert r.limit is not None and r.limit.signal == "rate_limit_event rejected"
    assert r.limit.until == datetime(2026, 5, 12, 6, 0, tzinfo=UTC)  # resetsAt 1778565600 (epoch seconds)
    assert '"five_hour"' in r.limit.text  # no synthetic wording followed: the record itself
    assert not r.final


def test_claude_error_max_turns() -> None:
    r = read_sample("claude", "stream-json-error-max-turns-result-sonnet-5.jsonl")
    assert (r.final, r.succeeded, r.subtype) == (True, False, "error_max_turns")
    assert r.error == "Reached maximum number of turns (40)"  # errors[]
    assert r.tokens == Tokens(input=2409, cache_write=29104, cache_read=1617801, output=15946)
    assert r.cost_usd == 1.4020935000000005
    assert (r.limit, r.transient) == (None, None)


def test_claude_no_conversation_found_on_resume() -> None:
    r = read_sample("claude", "stream-json-no-conversation-found-resume.jsonl")
    assert r.final and not r.succeeded and r.subtype == "error_during_execution"
    assert r.session_missing is not None
    assert "32175d93-2cc2-4775-82a8-56ce80d73b2b" in r.session_missing.text
    assert r.session_id is None  # not the new id 7cd10988-… the result names
    assert r.tokens == Tokens() and r.cost_usd == 0.0
    assert (r.limit, r.transient) == (None, None)


def test_claude_json_array_not_logged_in() -> None:
    r = read_sample("claude", "json-array-not-logged-in-2.1.126.json")
    # the array's elements are read like stream lines: init, synthetic assistant, result
    assert r.session_id == "b3d1aeb8-3513-49b9-ac2b-14406f585edb"
    assert r.final and not r.succeeded
    assert r.error == "Not logged in · Please run /login"
    assert (r.limit, r.transient) == (None, None)  # "error":"authentication_failed" is an ordinary failure
    assert r.tokens == Tokens() and r.cost_usd == 0.0


def test_claude_json_single_object() -> None:
    r = read_sample("claude", "json-single-object-success.json")
    assert r.succeeded and r.session_id == "20dde46c-b21a-4475-ac07-6a190b80c4e3"
    assert r.tokens == Tokens(output=13) and r.cost_usd == 0.079


def test_claude_error_during_execution_with_is_error_false() -> None:
    r = read_sample("claude", "result-error-during-execution-is-error-false.json")  # pretty-printed: read at close
    assert r.final and not r.succeeded and r.subtype == "error_during_execution"
    assert r.error is None  # no errors[], and is_error false
    assert r.tokens == Tokens(input=112, cache_write=58211, cache_read=1120129, output=6814)
    assert r.cost_usd == 0.6571631500000001 and r.session_id == "xxxxxxxxx"


CLAUDE_EXTRA_USAGE = "stream-json-result-out-of-extra-usage-exit1.jsonl"


def test_claude_out_of_extra_usage_result() -> None:
    r = read_sample("claude", CLAUDE_EXTRA_USAGE)
    # the harness logged "Claude Code failed with exit code 1": subtype "success" with is_error
    # true, 371 ms, no API call (duration_api_ms 0), one turn, every count 0, modelUsage {}
    assert (r.final, r.succeeded, r.subtype) == (True, False, "success")
    assert r.error == "You're out of extra usage · resets Apr 24, 4am (Asia/Tokyo)"
    assert r.summary == "You're out of extra usage · resets Apr 24, 4am (Asia/Tokyo)"
    assert r.session_id == "72c16fd3-1f84-4478-afe7-144dbe9b85a3"
    assert r.tokens == Tokens() and r.by_model == {} and r.cost_usd == 0.0  # total_cost_usd 0
    assert (r.transient, r.session_missing, r.windows) == (None, None, [])


def test_claude_out_of_extra_usage_result_is_a_limit() -> None:
    r = read_sample("claude", CLAUDE_EXTRA_USAGE)
    assert r.limit is not None and r.limit.signal == "result is_error"
    assert r.limit.text == "You're out of extra usage · resets Apr 24, 4am (Asia/Tokyo)"


def test_claude_plain_text_limit_is_left_to_the_shift() -> None:
    r = read_sample("claude", "text-print-limit-exit1.txt")
    # no record at all: the shift's text patterns read "You've hit your limit · resets 1pm …"
    assert (r.final, r.limit, r.session_id) == (False, None, None)


# -- usage windows (Claude Code's rate_limit_event)


def test_claude_windows_allowed_warning_and_unified_windows_2_1_285() -> None:
    r = read_sample("claude", "stream-json-multi-turn-cumulative-allowed-warning-2.1.285.jsonl")
    # the one rate_limit_event: status allowed_warning on rateLimitType seven_day (utilization 0.77,
    # resetsAt 1791036000); unifiedWindows adds five_hour (0.5, 1790788200), with no status of its own.
    # The record has no timestamp.
    assert r.windows == [
        WindowReading("anthropic", "seven_day", "allowed_warning", 0.77, datetime(2026, 10, 3, 14, 0, tzinfo=UTC),
                      10080, None),
        WindowReading("anthropic", "five_hour", None, 0.5, datetime(2026, 9, 30, 17, 10, tzinfo=UTC), 300, None),
    ]
    assert r.windows[0].report() == {
        "provider": "anthropic", "window": "seven_day", "status": "allowed_warning", "utilization": 0.77,
        "resets_at": "2026-10-03T14:00:00+00:00", "window_minutes": 10080}


@pytest.mark.parametrize(("name", "window"), [
    # status rejected, resetsAt 1778565600, no utilization
    ("rate-limit-event-rejected-resetsat-line.jsonl",
     WindowReading("anthropic", "five_hour", "rejected", None, datetime(2026, 5, 12, 6, 0, tzinfo=UTC), 300)),
    # rejected without resetsAt
    ("stream-json-session-limit-rejected-429-2.1.220.jsonl",
     WindowReading("anthropic", "five_hour", "rejected", None, None, 300)),
    # allowed (overageStatus rejected is about overage, not this window), resetsAt 1774447200
    ("stream-json-success-rate-limit-allowed-2.1.83.jsonl",
     WindowReading("anthropic", "five_hour", "allowed", None, datetime(2026, 3, 25, 14, 0, tzinfo=UTC), 300)),
])
def test_claude_windows_of_each_status(name: str, window: WindowReading) -> None:
    assert read_sample("claude", name).windows == [window]


def test_claude_samples_without_rate_limit_events_read_no_windows() -> None:
    for path in sorted((CORPUS / "claude").iterdir()):
        if "rate_limit_event" not in path.read_text(encoding="utf-8"):
            assert read_sample("claude", path.name).windows == [], path.name


def test_latest_windows_keeps_the_last_reading_of_each() -> None:
    early = WindowReading("anthropic", "five_hour", "allowed", 0.5)
    week = WindowReading("anthropic", "seven_day", None, 0.2)
    late = WindowReading("anthropic", "five_hour", "allowed_warning", 0.9)
    other = WindowReading("openai", "five_hour", None, 0.1)
    assert latest_windows([early, week, late, other]) == [late, week, other]


def api_wording(source: str) -> str:
    for line in (CORPUS / "limits" / "api-error-wordings.jsonl").read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        if entry["source"] == source:
            return str(entry["text"])
    raise AssertionError(source)


@pytest.mark.parametrize("source", [
    "anthropics/claude-code#12401",  # API Error: 529 {… "overloaded_error" …}
    "search-index file id 69065271885 (design doc; repository not resolvable)",  # API Error: 529 Overloaded. …
    "anthropics/claude-code#6596",  # API Error (Connection error.) · … TypeError (fetch failed)
    "anthropics/claude-code#75956",  # API Error: Unable to connect to API (ECONNRESET)
    "anthropics/claude-code#53905",  # API Error: 500 {… rate_limit_check_failed …} via a gateway
])
def test_claude_api_error_wordings_are_transient(source: str) -> None:
    # real wording, constructed record: the wording as the text of an is_error result
    text = api_wording(source)
    record = {"type": "result", "subtype": "success", "is_error": True, "result": text}
    r = read("claude", json.dumps(record))
    assert r.transient is not None and r.transient.text == text[:500]
    assert r.limit is None and not r.succeeded


def test_claude_not_logged_in_wording_is_neither() -> None:
    # real wording, constructed record
    text = api_wording("velvetmonkey/flywheel-ideas (index id 57090656436)")
    r = read("claude", json.dumps({"type": "result", "subtype": "success", "is_error": True, "result": text}))
    assert (r.limit, r.transient, r.succeeded) == (None, None, False)


# -- Codex CLI


def test_codex_simple_answer_0_46() -> None:
    r = read_sample("codex", "exec-json-simple-answer-0.46.jsonl")
    assert (r.agent, r.final, r.succeeded, r.subtype) == ("codex", True, True, "turn.completed")
    assert r.session_id == "019a2d7a-41c4-78b1-b7cc-a45d62a89cd5" and r.summary == "4"
    assert r.tokens == Tokens(input=2946, output=7)  # 2946 in, 0 cached, 7 out
    assert r.session_total and r.cost_usd is None and r.by_model == {}


def test_codex_command_execution_0_46() -> None:
    r = read_sample("codex", "exec-json-command-execution-0.46.jsonl")
    assert r.succeeded and r.session_id == "019a2d7b-231d-7290-acc1-6bc6571440da"
    assert r.summary is not None and r.summary.startswith("`test.js` simply contains")
    assert r.tokens == Tokens(input=6087 - 5120, cache_read=5120, output=204)  # input_tokens includes cached


def test_codex_full_session() -> None:
    r = read_sample("codex", "exec-json-full-session-todo-file-change.jsonl")
    assert r.succeeded and r.session_id == "019a3fe0-82fb-7e31-8e96-1d5c0544fd8a"
    assert r.summary is not None and r.summary.startswith("**What I Did**")  # the last agent_message
    assert r.tokens == Tokens(input=177136 - 163840, cache_read=163840, output=2836)


def test_codex_turn_completed_without_reasoning_field() -> None:
    r = read_sample("codex", "exec-json-turn-completed-no-reasoning-field.jsonl")
    assert r.succeeded and r.session_id is None and r.summary == "123333"
    assert r.tokens == Tokens(input=32161 - 1920, cache_read=1920, output=47)


def test_codex_resume_cumulative_three_processes_0_157_1() -> None:
    runs: list[list[str]] = []  # the three processes, each from its thread.started
    for line in lines("codex", "exec-json-resume-cumulative-usage-0.157.1.jsonl"):
        if line.startswith('{"type":"thread.started"'):
            runs.append([])
        runs[-1].append(line)
    first, second, third = (read("codex", "\n".join(run)) for run in runs)
    assert {r.session_id for r in (first, second, third)} == {"0199f000-0419-7000-8000-00000000c0de"}
    assert all(r.session_total and r.succeeded for r in (first, second, third))
    assert [r.summary for r in (first, second, third)] == ["Hi!", "Hi again!", "Hi once more!"]
    # the thread's running total: input_tokens - cached_input_tokens - cache_write_input_tokens (0)
    assert first.tokens == Tokens(input=10656 - 5888, cache_read=5888, output=6)
    assert second.tokens == Tokens(input=21328 - 11776, cache_read=11776, output=13)
    assert third.tokens == Tokens(input=32017 - 21760, cache_read=21760, output=21)
    # what the third process used itself: its total less the second's
    assert third.tokens.minus(second.tokens) == Tokens(input=10257 - 9552, cache_read=21760 - 11776, output=8)


def test_codex_reconnecting_then_401_is_an_ordinary_failure() -> None:
    name = "exec-json-reconnecting-401-turn-failed.jsonl"
    r = read_sample("codex", name)
    assert (r.final, r.succeeded, r.subtype) == (True, False, "turn.failed")
    assert r.error == "exceeded retry limit, last status: 401 Unauthorized, request id: 99cdbe04acfb0b34-AMS"
    assert (r.limit, r.transient) == (None, None)
    # "Reconnecting... 1/5" … "5/5" alone are no failure
    retrying = adapter("codex").reader().feed("\n".join(lines("codex", name)[:7]))
    assert (retrying.final, retrying.error) == (False, None)


def test_codex_usage_limit() -> None:
    r = read_sample("codex", "exec-json-usage-limit-try-again-at-12-16-PM.jsonl")
    assert r.final and not r.succeeded and r.subtype == "turn.failed"
    assert r.limit is not None and r.limit.signal == "codex turn.failed"
    assert "try again at 12:16 PM" in r.limit.text and r.limit.until is None  # the shift reads the clock time
    assert r.session_id == "019a77e4-0716-7152-8396-b642e26c3e20" and r.tokens == Tokens()


def test_codex_warning_item_then_rollout_budget_error() -> None:
    name = "exec-json-rollout-budget-error-turn-failed.jsonl"
    r = read_sample("codex", name)
    assert (r.final, r.succeeded, r.subtype) == (True, False, "error")  # the top-level error
    assert r.error == "shared rollout token budget exhausted" and r.summary == "ok"
    assert (r.limit, r.transient) == (None, None)
    # the item.completed of type "error" (a config warning) is no failure
    warned = adapter("codex").reader().feed("\n".join(lines("codex", name)[:4]))
    assert (warned.final, warned.error) == (False, None)


def test_codex_invalid_request_400() -> None:
    r = read_sample("codex", "exec-json-invalid-request-400-turn-failed.jsonl")
    assert r.final and not r.succeeded and r.error is not None and "invalid_request_error" in r.error
    assert (r.limit, r.transient, r.session_id) == (None, None, None)


def codex_wording(source: str) -> str:
    for line in (CORPUS / "limits" / "codex-limit-wordings.jsonl").read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        if entry["source"].startswith(source):
            return str(entry["text"])
    raise AssertionError(source)


def test_codex_backend_usage_limit_body_names_its_reset() -> None:
    # real wording, constructed record: the backend body (with resets_at) as a turn.failed message
    text = codex_wording("james-6-23/codex2api")
    r = read("codex", json.dumps({"type": "turn.failed", "error": {"message": text}}))
    assert r.limit is not None and r.limit.until == datetime.fromtimestamp(1775317531, UTC)


def test_codex_retry_limit_429_is_a_limit() -> None:
    # real wording, constructed record
    text = codex_wording("icebear0828/codex-proxy")  # exceeded retry limit, last status: 429 Too Many Requests
    r = read("codex", json.dumps({"type": "turn.failed", "error": {"message": text}}))
    assert r.limit is not None and r.transient is None


# -- usage windows (Codex's rate-limit snapshots, in its rollout files)


def test_codex_exec_json_carries_no_windows_its_rollout_does_0_46() -> None:
    # one run, two outputs: its `--json` stdout has no snapshot; its rollout has one (token_count
    # with info null at 00:59:38.856Z): primary 0.0 % of 299 minutes, resets in 17388 s; secondary
    # 7.0 % of 10079 minutes, resets in 491245 s — from the record's time
    assert read_sample("codex", "exec-json-simple-answer-0.46.jsonl").windows == []
    r = read_sample("codex", "rollout-token-count-resets-in-seconds-0.46.jsonl")
    at = datetime(2025, 10, 29, 0, 59, 38, 856000, tzinfo=UTC)
    assert r.windows == [
        WindowReading("openai", "five_hour", None, 0.0, at + timedelta(seconds=17388), 299, at),
        WindowReading("openai", "weekly", None, 0.07, at + timedelta(seconds=491245), 10079, at),
    ]
    assert r.windows[1].resets_at == datetime(2025, 11, 3, 17, 27, 3, 856000, tzinfo=UTC)
    # a rollout is no exec run: no outcome, no tokens are read from it
    assert (r.final, r.session_id, r.tokens) == (False, None, Tokens())


def test_a_codex_run_reads_the_windows_of_its_session_rollout(tmp_path: Path) -> None:
    """`codex exec --json` prints no rate limits; the shift finds the run's rollout by its thread id
    under the agent's homes (CODEX_HOME, the sandbox's home, the user's) and reads its snapshots."""
    from worker.shift.shift import session_windows

    thread = "019a2d7a-41c4-78b1-b7cc-a45d62a89cd5"  # the 0.46 run's thread, in the rollout's session_meta
    run = Reading(agent="codex", session_id=thread)
    workspace = tmp_path / "ws"
    assert session_windows("codex", run, workspace, environ={}) == []  # no rollout there yet
    day = workspace / ".fleet" / "home" / ".codex" / "sessions" / "2025" / "10" / "29"
    day.mkdir(parents=True)
    rollout = day / f"rollout-2025-10-29T00-59-38-{thread}.jsonl"
    rollout.write_text(sample("codex", "rollout-token-count-resets-in-seconds-0.46.jsonl"), encoding="utf-8")
    at = datetime(2025, 10, 29, 0, 59, 38, 856000, tzinfo=UTC)
    expected = [WindowReading("openai", "five_hour", None, 0.0, at + timedelta(seconds=17388), 299, at),
                WindowReading("openai", "weekly", None, 0.07, at + timedelta(seconds=491245), 10079, at)]
    assert session_windows("codex", run, workspace, environ={}) == expected
    # another thread's run finds nothing; a CODEX_HOME is looked in first
    assert session_windows("codex", Reading(agent="codex", session_id="019a0000-0000-0000-0000-000000000000"),
                           workspace, environ={}) == []
    elsewhere = tmp_path / "codex-home"
    (elsewhere / "sessions" / "2025" / "10" / "29").mkdir(parents=True)
    (elsewhere / "sessions" / "2025" / "10" / "29" / rollout.name).write_text(
        sample("codex", "rollout-vscode-session-0.104.jsonl"), encoding="utf-8")
    from_codex_home = session_windows("codex", run, workspace, environ={"CODEX_HOME": str(elsewhere)})
    assert from_codex_home and from_codex_home != expected
    # an agent whose CLI prints its windows keeps none beside: nothing is looked for
    assert session_windows("claude", run, workspace, environ={}) == []


def test_codex_rollout_snapshots_0_104() -> None:
    r = read_sample("codex", "rollout-vscode-session-0.104.jsonl")
    # 12 token_count records, two windows each
    assert len(r.windows) == 24
    assert {(w.provider, w.window, w.window_minutes, w.status) for w in r.windows} == {
        ("openai", "five_hour", 300, None), ("openai", "weekly", 10080, None)}
    first = datetime(2026, 2, 23, 19, 34, 34, 390000, tzinfo=UTC)  # line 12, info null
    assert r.windows[:2] == [
        WindowReading("openai", "five_hour", None, 0.04, datetime.fromtimestamp(1771890497, UTC), 300, first),
        WindowReading("openai", "weekly", None, 0.10, datetime.fromtimestamp(1772355702, UTC), 10080, first),
    ]
    # line 21: 7 % and 11 %, the weekly reset a second later (1772355703)
    assert (r.windows[4].utilization, r.windows[5].utilization) == (0.07, 0.11)
    assert r.windows[5].resets_at == datetime.fromtimestamp(1772355703, UTC)
    last = datetime(2026, 2, 23, 19, 36, 2, 633000, tzinfo=UTC)  # line 62, the last token_count
    assert latest_windows(r.windows) == [
        WindowReading("openai", "five_hour", None, 0.07, datetime(2026, 2, 23, 23, 48, 17, tzinfo=UTC), 300, last),
        WindowReading("openai", "weekly", None, 0.11, datetime(2026, 3, 1, 9, 1, 42, tzinfo=UTC), 10080, last),
    ]


def test_codex_window_names_follow_the_minutes_and_the_limit_id() -> None:
    # constructed records in the 0.104 shape (no real capture has these): a plan whose primary is
    # the weekly window and has no secondary, a length no name is given for, a model family
    # metered apart, and the null snapshot of openai/codex#14880
    def windows(rate_limits: object) -> list[tuple[str, int | None, float | None]]:
        record = {"timestamp": "2026-02-23T19:34:34.390Z", "type": "event_msg",
                  "payload": {"type": "token_count", "info": None, "rate_limits": rate_limits}}
        return [(w.window, w.window_minutes, w.utilization) for w in read("codex", json.dumps(record)).windows]

    assert windows({"limit_id": "codex", "primary": {"used_percent": 24.0, "window_minutes": 10080,
                                                     "resets_at": 1772355702}, "secondary": None}) == [
        ("weekly", 10080, 0.24)]
    assert windows({"primary": {"used_percent": 55.0, "window_minutes": 43800}}) == [("primary", 43800, 0.55)]
    assert windows({"primary": {"used_percent": 96.0}, "secondary": {"used_percent": 1.0}}) == [
        ("primary", None, 0.96), ("secondary", None, 0.01)]
    assert windows({"limit_id": "codex_other", "primary": {"used_percent": 3.0, "window_minutes": 300}}) == [
        ("codex_other_five_hour", 300, 0.03)]
    assert windows(None) == []


# -- opencode


def test_opencode_two_steps() -> None:
    name = "run-json-bash-tool-two-steps.jsonl"
    r = read_sample("opencode", name)
    assert (r.agent, r.final, r.succeeded, r.subtype) == ("opencode", True, True, "stop")
    assert r.session_id == "ses_494719016ffe85dkDMj0FPRbHK" and r.summary == "```\nhello\n```"
    # step 1: 21772 in, 110 out; step 2: 671 in, 8 out, 21415 cache read; reasoning 0 in both
    assert r.tokens == Tokens(input=21772 + 671, cache_read=21415, output=110 + 8)
    assert r.cost_usd == 0.001  # 0 + 0.001
    # after the first step (reason "tool-calls") the run is not over
    first = adapter("opencode").reader().feed("\n".join(lines("opencode", name)[:3]))
    assert not first.final and first.tokens == Tokens(input=21772, output=110) and first.cost_usd == 0.0


def test_opencode_first_step_finish_with_cost() -> None:
    r = read_sample("opencode", "run-json-step-start-finish-cost.jsonl")
    assert r.tokens == Tokens(input=11087, output=145) and r.cost_usd == 0.0070147
    assert not r.final  # this first version's step_finish names no reason
    assert r.session_id == "ses_6783457c2ffeICANaRjenHkVxv"


@pytest.mark.parametrize(("name", "session", "error"), [
    ("run-json-error-model-not-found-1.14.25.jsonl", "ses_236c4ba84ffeKJLGiwxfHIx8Au",
     "Model not found: nonexistent/nonexistent."),
    ("run-json-error-unknown-server-error-1.16.2.jsonl", "ses_x",
     "Unexpected server error. Check server logs for details."),
    ("run-json-error-direct-access-token-401.jsonl", "ses_0718724eaffe3Oo6svlXn9Yl8g",
     'Failed to get direct access token: 401 Unauthorized - {"message":"401 Unauthorized"}'),
    # 1.18.29 (anomalyco/opencode#47972): the same wording as 1.16.2, now with the run's own
    # session id, and the process exits 1 after it
    ("run-json-error-unknown-server-error-exit1-1.18.29.jsonl", "ses_f7eaf57b4ffeRoCprFrTfUsZZJ",
     "Unexpected server error. Check server logs for details."),
])
def test_opencode_error_events(name: str, session: str, error: str) -> None:
    r = read_sample("opencode", name)
    # 1.14.25 exits 0 after its error event, 1.18.29 exits 1: either way the event alone says the run failed
    assert (r.final, r.succeeded, r.subtype) == (True, False, "UnknownError")
    assert (r.session_id, r.error) == (session, error)
    assert (r.limit, r.transient) == (None, None)  # no statusCode: none is a limit or a provider 5xx
    assert r.tokens == Tokens() and r.cost_usd is None


def test_opencode_session_not_found_on_stderr_1_14_19() -> None:
    r = read_sample("opencode", "run-json-session-not-found-stderr-1.14.19.txt")
    # `run --format json -s ses_doesnotexist`: zero stdout and exit 0 (anomalyco/opencode#27559);
    # only the NotFoundError on stderr says the session is not there
    assert r.session_missing is not None and r.session_missing.signal == "opencode stderr"
    assert r.session_missing.text == 'message: "Session not found: ses_doesnotexist",'
    assert (r.final, r.succeeded, r.session_id, r.error) == (False, False, None, None)
    assert r.tokens == Tokens() and r.cost_usd is None
    assert (r.limit, r.transient) == (None, None)


# -- Gemini CLI


def test_gemini_stream_json_hello_0_26_0() -> None:
    r = read_sample("gemini", "stream-json-hello-0.26.0.jsonl")
    assert (r.agent, r.final, r.succeeded, r.subtype) == ("gemini", True, True, "success")
    assert r.session_id == "7bffa130-8c69-4cf8-ac8a-0d36b2d99f53"
    assert r.summary == "Hello! How can I help you today?"
    # input_tokens 11598 (cached 0 of it), output_tokens 69 candidates, total_tokens 11785: the
    # 11785 - 11598 - 69 = 118 left are the thoughts, billed as output → output 187, reasoning 118
    assert r.tokens == Tokens(input=11598, cache_read=0, output=187, reasoning=118)
    assert r.tokens.total == 11785
    assert r.by_model == {} and r.cost_usd is None  # init.model "auto-gemini-3" is the requested alias


def test_gemini_assistant_deltas_without_result() -> None:
    r = read_sample("gemini", "stream-json-assistant-deltas-partial.jsonl")
    assert not r.final and r.tokens == Tokens()
    assert r.summary is not None and r.summary.startswith("` returns early and `processGeminiOutput`")
    assert r.summary.endswith("- path: repo-agent/")  # the three deltas joined


def test_gemini_json_document_0_6_1() -> None:
    r = read_sample("gemini", "json-output-2plus2-0.6.1.json")
    assert r.final and r.succeeded and r.summary == "4" and r.session_id is None
    # gemini-2.5-pro: prompt 7173 (cached 0, tool 0), candidates 0, thoughts 17 → output 17 (all
    # reasoning); 7173 + 17 = the document's total 7190
    pro = Tokens(input=7173, output=17, reasoning=17)
    assert r.by_model == {"gemini-2.5-pro": pro} and r.tokens == pro and r.tokens.total == 7190


def test_gemini_tool_use_and_tool_result_0_42_0() -> None:
    r = read_sample("gemini", "stream-json-tool-use-read-file-0.42.0.jsonl")
    assert (r.final, r.succeeded, r.subtype) == (True, True, "success")
    assert r.session_id == "00000000-0000-4000-8000-000000000002"  # the id the prober gave --session-id
    # the two deltas "SWITCHBOARD_GEMINI_PROBE_TOOL_5F8A2" + "1"; the tool_use / tool_result lines
    # (update_topic, read_file with output "") add nothing to it
    assert r.summary == "SWITCHBOARD_GEMINI_PROBE_TOOL_5F8A21"
    # stats.models gemini-3-flash-preview: input_tokens 20525 of which cached 7559 (input 12966),
    # output_tokens 100, total_tokens 20625 = 20525 + 100: no thoughts
    flash = Tokens(input=12966, cache_read=7559, output=100, reasoning=0)
    assert r.by_model == {"gemini-3-flash-preview": flash} and r.tokens == flash
    assert r.tokens.total == 20625
    assert (r.error, r.limit, r.transient) == (None, None, None)


def test_gemini_result_error_invalid_model_0_42_0() -> None:
    r = read_sample("gemini", "stream-json-result-error-invalid-model-0.42.0.jsonl")
    # exit 1 (the source's exit table): result status "error" with error{type "unknown", message}
    assert (r.final, r.succeeded, r.subtype) == (True, False, "error")
    assert r.session_id == "00000000-0000-4000-8000-000000000003"
    assert r.error == "[API Error: Requested entity was not found.]"
    assert (r.limit, r.transient) == (None, None)  # an unknown model (404 on stderr): an ordinary failure
    assert r.summary is None
    assert r.tokens == Tokens()  # every count in stats (and in stats.models) is 0


GEMINI_TRAILING_ERROR = "stream-json-error-event-result-error-no-error-field-0.44.0.jsonl"


def test_gemini_error_event_then_result_error_0_44_0() -> None:
    r = read_sample("gemini", GEMINI_TRAILING_ERROR)
    # the whole answer streamed, then an error event and a result with status "error" (no error
    # field): the CLI's word is not a success
    assert (r.final, r.succeeded, r.subtype) == (True, False, "error")
    assert r.session_id == "3dcef4a2-52a3-42ec-978f-3a92863f6e97"
    # the eight deltas joined, the last one's "\n\n" stripped
    assert r.summary is not None and r.summary.startswith("This directory contains a mix of Python scripts")
    assert r.summary.endswith("with an `add` method, along with usage examples.")
    # per model, output = total_tokens - input_tokens (candidates + thoughts):
    # gemini-3.1-flash-lite 3787 in (cached 0), 3943 - 3787 = 156 out, 156 - 46 = 110 thoughts;
    # gemini-3-flash-preview 55454 in of which 46121 cached (input 9333), 56191 - 55454 = 737 out,
    # 737 - 475 = 262 thoughts
    lite = Tokens(input=3787, output=156, reasoning=110)
    flash = Tokens(input=9333, cache_read=46121, output=737, reasoning=262)
    assert r.by_model == {"gemini-3.1-flash-lite": lite, "gemini-3-flash-preview": flash}
    # their sums are the top-level stats: input 13120, cached 46121, total_tokens 60134
    assert r.tokens == lite + flash and r.tokens.input == 13120 and r.tokens.total == 60134
    assert r.limit is None


def test_gemini_error_event_gives_the_error_text_0_44_0() -> None:
    r = read_sample("gemini", GEMINI_TRAILING_ERROR)
    assert r.error == "Invalid stream: The model returned an empty response or malformed tool call."
    # the model's reply failed, not the task (switchboard's docs: ~3 of 5 tool-using runs of 0.44.0)
    assert r.transient is not None and r.transient.signal == "gemini error" and r.limit is None


GEMINI_CAPACITY = "stream-json-result-error-exhausted-capacity-quota.jsonl"


def test_gemini_exhausted_capacity_result() -> None:
    r = read_sample("gemini", GEMINI_CAPACITY)
    assert (r.final, r.succeeded, r.subtype) == (True, False, "error")
    assert r.error == ("[API Error: You have exhausted your capacity on this model. "
                       "Your quota will reset after 3h5m30s.]")
    assert r.session_id is None and r.tokens == Tokens()  # the one line published; stats all 0


def test_gemini_exhausted_capacity_is_a_limit() -> None:
    r = read_sample("gemini", GEMINI_CAPACITY)
    assert r.limit is not None and r.limit.signal == "result error"
    assert "Your quota will reset after 3h5m30s." in r.limit.text
    assert r.transient is None


def test_gemini_resume_of_an_unknown_session_0_42_0() -> None:
    r = read_sample("gemini", "stderr-resume-unknown-session-0.42.0.txt")
    assert r.session_missing is not None and r.session_missing.signal == "gemini stderr"
    assert r.session_missing.text == ('Error resuming session: Invalid session identifier '
                                      '"99999999-9999-9999-9999-999999999999".')
    assert (r.final, r.succeeded, r.session_id) == (False, False, None)
    assert (r.limit, r.transient) == (None, None)


def test_gemini_daily_quota_wording_is_a_limit() -> None:
    # real wording (google-gemini/gemini-cli#12386), constructed record: a result error
    entries = [json.loads(x) for x in (CORPUS / "limits" / "gemini-quota-wordings.jsonl").read_text().splitlines()]
    text = next(e["text"] for e in entries if "exhausted your daily quota" in e["text"])
    record = {"type": "result", "status": "error", "error": {"type": "Error", "message": text}}
    r = read("gemini", json.dumps(record))
    assert r.final and not r.succeeded and r.limit is not None and r.transient is None


# -- generic, detection, the registry


def test_generic_reads_the_example_agent(tmp_path: Path) -> None:
    """lanefleet's scripted agent prints Claude-Code-style stream-json."""

    def run(payload: dict[str, object]) -> Reading:
        fleet = tmp_path / ".fleet"
        fleet.mkdir(exist_ok=True)
        (fleet / "checkpoint.json").unlink(missing_ok=True)
        (fleet / "task.json").write_text(json.dumps({"key": "t-1", "lane": "build", "payload": payload}))
        (tmp_path / "prompt.md").write_text("do it")
        out = subprocess.run([sys.executable, "-m", "worker.dev.example_agent", "prompt.md"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
        return read("generic", out.stdout + out.stderr)

    r = run({"steps": 2, "sleep": 0, "tokens": 10})
    assert (r.agent, r.final, r.succeeded) == ("generic", True, True)
    # result_record: sonnet 3·10·2 = 60 in, 10 write, 100 read, 20 out; haiku 20 in, 20 read, 10 out
    assert r.by_model == {"claude-sonnet-4-5": Tokens(60, 10, 100, 20), "claude-haiku-4-5": Tokens(20, 0, 20, 10)}
    assert r.cost_usd == round(0.000015 * 60 + 0.000001 * 20, 6)
    limited = run({"limit_attempts": 1, "tokens": 10})
    assert not limited.succeeded and limited.limit is not None
    assert limited.limit.text.startswith("Claude AI usage limit reached|")


@pytest.mark.parametrize(("argv", "name"), [
    (["/usr/local/bin/claude", "-p"], "claude"), (["codex", "exec"], "codex"), (["opencode", "run"], "opencode"),
    (["/opt/bin/gemini"], "gemini"), (["python", "-m", "worker.dev.example_agent"], "generic"), ([], "generic"),
])
def test_detect(argv: list[str], name: str) -> None:
    assert detect(argv) == name


def test_every_adapter_module_defines_adapter() -> None:
    modules = [m.name for m in pkgutil.iter_modules(adapters.__path__) if m.name != "base"]
    assert sorted(modules) == ["claude", "codex", "gemini", "generic", "opencode"]
    for name in modules:
        found = importlib.import_module(f"worker.agent.adapters.{name}").ADAPTER
        assert isinstance(found, Adapter) and found.name == name and ADAPTERS[name] is found
        assert found.describe and isinstance(found.reader().reading(), Reading)
        assert found.reader().agent == name


@pytest.mark.parametrize(("name", "without", "with_session"), [
    ("claude", ["claude", "-p", "--output-format", "stream-json", "--verbose", "--permission-mode", "acceptEdits",
                "--model", "m"],
     ["claude", "-p", "--output-format", "stream-json", "--verbose", "--permission-mode", "acceptEdits",
      "--model", "m", "--resume", "S"]),
    ("opencode", ["opencode", "run", "--format", "json", "--model", "m"],
     ["opencode", "run", "--format", "json", "--model", "m", "--session", "S"]),
    ("gemini", ["gemini", "--output-format", "stream-json", "--approval-mode", "auto_edit", "--model", "m"],
     ["gemini", "--output-format", "stream-json", "--approval-mode", "auto_edit", "--model", "m", "--resume", "S"]),
])
def test_default_commands_resume_only_a_session(name: str, without: list[str], with_session: list[str]) -> None:
    command = list(ADAPTERS[name].command)
    assert render_argv(command, {"model": "m", "agent_session": ""}) == without
    assert render_argv(command, {"model": "m", "agent_session": "S"}) == with_session
    # no model configured: the agent's own default (no `--model ""`)
    assert render_argv(command, {"model": "", "agent_session": ""}) == [a for a in without if a not in ("--model", "m")]


def test_codex_resume_of_a_thread_without_its_rollout_0_137_0() -> None:
    r = read_sample("codex", "stderr-resume-no-rollout-found-0.137.0.txt")
    assert r.session_missing is not None and r.session_missing.signal == "codex stderr"
    assert r.session_missing.text == ("Error: thread/resume: thread/resume failed: no rollout found for thread id "
                                      "019e9154-c304-70f0-adde-36efb1be1701 (code -32600)")
    assert (r.final, r.succeeded, r.session_id, r.error) == (False, False, None, None)
    assert (r.limit, r.transient) == (None, None)


def test_codex_resume_command() -> None:
    codex = ADAPTERS["codex"]
    assert codex.resume is not None and codex.reports_cost is False
    assert render_argv(list(codex.resume), {"model": "m", "agent_session": "T"})[-3:] == ["resume", "T", "-"]
    assert render_argv(list(codex.command), {"model": "m", "agent_session": ""})[-1] == "-"  # prompt on stdin


HAND_CHECKED = {
    "claude/stream-json-success-tool-use-2.1.3.jsonl",
    "claude/stream-json-success-minimal-2.1.7.jsonl",
    "claude/stream-json-success-rate-limit-allowed-2.1.83.jsonl",
    "claude/stream-json-multi-turn-cumulative-allowed-warning-2.1.285.jsonl",
    "claude/stream-json-task-subagent-two-models-2.0.27.jsonl",
    "claude/stream-json-weekly-limit-reached-tail-exit0.jsonl",
    "claude/stream-json-session-limit-rejected-429-2.1.220.jsonl",
    "claude/rate-limit-event-rejected-resetsat-line.jsonl",
    "claude/stream-json-error-max-turns-result-sonnet-5.jsonl",
    "claude/stream-json-no-conversation-found-resume.jsonl",
    "claude/json-array-not-logged-in-2.1.126.json",
    "claude/json-single-object-success.json",
    "claude/result-error-during-execution-is-error-false.json",
    "claude/text-print-limit-exit1.txt",
    "claude/stream-json-result-out-of-extra-usage-exit1.jsonl",
    "codex/exec-json-simple-answer-0.46.jsonl",
    "codex/exec-json-command-execution-0.46.jsonl",
    "codex/exec-json-full-session-todo-file-change.jsonl",
    "codex/exec-json-turn-completed-no-reasoning-field.jsonl",
    "codex/exec-json-resume-cumulative-usage-0.157.1.jsonl",
    "codex/exec-json-reconnecting-401-turn-failed.jsonl",
    "codex/exec-json-usage-limit-try-again-at-12-16-PM.jsonl",
    "codex/exec-json-rollout-budget-error-turn-failed.jsonl",
    "codex/exec-json-invalid-request-400-turn-failed.jsonl",
    "codex/rollout-token-count-resets-in-seconds-0.46.jsonl",
    "codex/rollout-vscode-session-0.104.jsonl",
    "codex/stderr-resume-no-rollout-found-0.137.0.txt",
    "opencode/run-json-bash-tool-two-steps.jsonl",
    "opencode/run-json-step-start-finish-cost.jsonl",
    "opencode/run-json-error-model-not-found-1.14.25.jsonl",
    "opencode/run-json-error-unknown-server-error-1.16.2.jsonl",
    "opencode/run-json-error-direct-access-token-401.jsonl",
    "opencode/run-json-session-not-found-stderr-1.14.19.txt",
    "opencode/run-json-error-unknown-server-error-exit1-1.18.29.jsonl",
    "gemini/stream-json-hello-0.26.0.jsonl",
    "gemini/stream-json-assistant-deltas-partial.jsonl",
    "gemini/json-output-2plus2-0.6.1.json",
    "gemini/stream-json-tool-use-read-file-0.42.0.jsonl",
    "gemini/stream-json-result-error-invalid-model-0.42.0.jsonl",
    "gemini/stream-json-error-event-result-error-no-error-field-0.44.0.jsonl",
    "gemini/stream-json-result-error-exhausted-capacity-quota.jsonl",
    "gemini/stderr-resume-unknown-session-0.42.0.txt",
}
