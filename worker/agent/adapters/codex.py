"""OpenAI Codex CLI: ``codex exec --json`` (JSON Lines on stdout).

What it prints (tests/agents/corpus/codex/, README "Shapes"): ``thread.started{thread_id}``,
``turn.started``, ``item.started/updated/completed`` (reasoning, agent_message, command_execution,
file_change, todo_list, error …), then ``turn.completed{usage}`` or ``turn.failed{error}``;
top-level ``{"type":"error"}`` events come before a failure, and also for "Reconnecting... N/5".

What is read:

- the session: ``thread.started.thread_id`` (re-emitted with the same id by ``exec resume``);
- the outcome: ``turn.completed`` → succeeded; ``turn.failed`` or a top-level ``error`` (other
  than "Reconnecting... N/5", which is not a failure by itself) → final, not succeeded, its
  message → error. ``item.completed`` of type "error" is a warning (exec-json-rollout-budget-…);
- the summary: the last ``agent_message`` item;
- tokens: ``turn.completed.usage``. ``input_tokens`` includes the cache reads
  (``cached_input_tokens``) and the cache writes (``cache_write_input_tokens``, newer builds), so
  input = input_tokens - cached - cache_write; ``output_tokens`` includes
  ``reasoning_output_tokens``. The 0.157.1 sample's cache writes are all 0, so its numbers cannot
  tell; the split is as agentclientprotocol/codex-acp#509/#510 and getagentseal/codeburn#1075
  report it ("Codex reports inputTokens inclusive of both cache reads and cache writes", "reasoning
  output appears to be included in output_tokens: 23,318 input + 251 output = 23,569 total").
  The usage is the *thread's* running total across ``exec resume`` (openai/codex#19308 maps it
  from the thread's total token usage; exec-json-resume-cumulative-usage-0.157.1.jsonl:
  10 656 → 21 328 → 32 017 input), hence ``session_total``. No cost, no model in the events;
- limits: only wording, in ``error``/``turn.failed`` messages ("You've hit your usage limit … try
  again at 12:16 PM", the backend's ``usage_limit_reached`` body with ``resets_at``); transient:
  "exceeded retry limit, last status: 5xx", "stream disconnected", 5xx, "overloaded". A 401 is an
  ordinary failure;
- ``exec resume`` of a thread it has no rollout of: "Error: thread/resume: thread/resume failed: no
  rollout found for thread id …" on stderr, exit 1 (0.130, 0.137) → ``session_missing``;
- usage windows: ``codex exec --json`` prints none (its ThreadEvent has no rate-limit event, and
  its JSONL processor drops the app-server's rate-limit notifications: corpus README "Codex usage
  windows"). They are in the session's rollout file (``~/.codex/sessions/…/rollout-*.jsonl``):
  ``{"timestamp", "type":"event_msg", "payload":{"type":"token_count", "rate_limits":{"primary",
  "secondary"}}}``, each window ``used_percent`` (0..100), ``window_minutes`` and ``resets_at``
  (epoch; 0.46 wrote ``resets_in_seconds`` from the record's time, and 299/10079 minutes). Such
  records are read wherever they appear in the log (a wrapper that follows the rollout):
  rollout-token-count-resets-in-seconds-0.46.jsonl, rollout-vscode-session-0.104.jsonl. A window is
  named ``five_hour``/``weekly`` when its minutes say so (within 2 minutes of 300/10 080), else
  ``primary``/``secondary``; a ``limit_id`` other than "codex" (a model family metered apart)
  prefixes the name. A snapshot has no status.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from worker.agent.adapters import Adapter
from worker.agent.adapters.base import (
    Reading,
    Signal,
    StreamReader,
    Tokens,
    WindowReading,
    clip,
    count,
    epoch,
    fraction,
    later,
    timestamp,
)
from worker.files import read_tail

_RECONNECTING = re.compile(r"^\s*Reconnecting\.\.\.\s*\d+/\d+", re.IGNORECASE)
_LIMIT = re.compile(r"usage limit|usage_limit_reached|rate limit|last status: 429\b|Too Many Requests", re.IGNORECASE)
_RESETS_AT = re.compile(r'"resets_at"\s*:\s*(\d{9,11})\b')
_TRANSIENT = re.compile(r"last status: 5\d\d\b|stream disconnected|\b(?:500|502|503|504|529)\b|overloaded|"
                        r"Internal Server Error|Bad Gateway|Service Unavailable", re.IGNORECASE)
# `exec resume` of a thread it has no rollout of (stderr, exit 1; 0.130 and 0.137)
# (the CLI's own line, from its start: an agent's words quoting it are not)
_SESSION_MISSING = re.compile(r"^\s*Error: thread/resume: .*no rollout found for thread")
_PROVIDER = "openai"
# the windows' lengths a name is given for (0.46 wrote 299 and 10079 for the same windows)
_NAMED_MINUTES = ((300, "five_hour"), (7 * 24 * 60, "weekly"))


def _window_name(slot: str, minutes: int | None) -> str:
    """``five_hour``/``weekly`` when the minutes say so, else the slot (primary, secondary)."""
    for length, name in _NAMED_MINUTES:
        if minutes is not None and abs(minutes - length) <= 2:
            return name
    return slot


class CodexReader(StreamReader):
    agent = "codex"
    session_missing_line = _SESSION_MISSING

    def record(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        if kind == "thread.started":
            tid = obj.get("thread_id")
            if isinstance(tid, str) and tid:
                self.out.session_id = tid
        elif kind == "item.completed":
            item = obj.get("item")
            if isinstance(item, dict) and item.get("type") == "agent_message":
                self.out.summary = clip(item.get("text")) or self.out.summary
        elif kind == "turn.completed":
            self._completed(obj.get("usage"))
        elif kind == "turn.failed":
            error = obj.get("error")
            self._failed("turn.failed", error.get("message") if isinstance(error, dict) else None)
        elif kind == "error":
            message = obj.get("message")
            if not (isinstance(message, str) and _RECONNECTING.match(message)):
                self._failed("error", message)
        elif kind == "event_msg":
            payload = obj.get("payload")
            if isinstance(payload, dict) and payload.get("type") == "token_count":
                self._rate_limits(payload.get("rate_limits"), timestamp(obj.get("timestamp")))

    def _rate_limits(self, snapshot: Any, at: Any) -> None:
        """A rollout's rate-limit snapshot (``null`` in some builds' exec sessions: openai/codex#14880)."""
        if not isinstance(snapshot, dict):
            return
        limit_id = snapshot.get("limit_id")
        prefix = f"{limit_id}_" if isinstance(limit_id, str) and limit_id and limit_id != "codex" else ""
        for slot in ("primary", "secondary"):
            window = snapshot.get(slot)
            if not isinstance(window, dict):
                continue
            minutes = count(window.get("window_minutes")) or None
            reset = epoch(window.get("resets_at")) or later(at, window.get("resets_in_seconds"))
            self.out.windows.append(WindowReading(_PROVIDER, prefix + _window_name(slot, minutes), None,
                                                  fraction(window.get("used_percent"), 100.0), reset, minutes, at))

    def _completed(self, usage: Any) -> None:
        out = self.out
        out.final, out.succeeded, out.subtype = True, True, "turn.completed"
        if not isinstance(usage, dict):
            return
        cached, written = count(usage.get("cached_input_tokens")), count(usage.get("cache_write_input_tokens"))
        out.tokens = Tokens(max(0, count(usage.get("input_tokens")) - cached - written), written, cached,
                            count(usage.get("output_tokens")), count(usage.get("reasoning_output_tokens")))
        out.session_total = True

    def _failed(self, kind: str, message: Any) -> None:
        out = self.out
        text = message if isinstance(message, str) else ""
        out.final, out.succeeded = True, False
        if out.subtype != "turn.failed":  # a turn.failed is the last word; an error before it says the same
            out.subtype = kind
        out.error = clip(text) or out.error
        signal = f"codex {kind}"
        if _LIMIT.search(text):
            reset = _RESETS_AT.search(text)
            out.limit = Signal(signal, text[:500], epoch(int(reset.group(1))) if reset else None)
        elif _TRANSIENT.search(text):
            out.transient = Signal(signal, text[:500])


# Verified against openai/codex codex-rs/exec/src/cli.rs (the stored snapshot): `--json` and
# `--skip-git-repo-check` are global flags, `--model` is made global for exec's subcommands, the
# PROMPT "-" (or none) reads the prompt from stdin, and `exec resume [SESSION_ID] [PROMPT]` takes
# "-" to read it from stdin too ("Prompt to send after resuming the session. If `-` is used, read
# from stdin."). Also the docs' `codex exec -  # Force reading from stdin`. Note `codex exec`'s
# sandbox is read-only by default: a profile that lets the agent write adds `--sandbox …`.
#: the most of a rollout file read for its rate-limit snapshots (its end: the latest)
ROLLOUT_TAIL = 4 << 20


def rollout_windows(reading: Reading, homes: Sequence[Path]) -> list[WindowReading]:
    """The rate-limit snapshots of the run's session rollout, which ``codex exec --json`` never prints
    (tests/agents/corpus/README.md, "Codex usage windows"): the file
    ``<CODEX_HOME>/sessions/YYYY/MM/DD/rollout-<time>-<thread id>.jsonl`` of the thread the run
    reported, looked for under each of ``homes`` (a CODEX_HOME, or a HOME's ``.codex``). Its last
    ROLLOUT_TAIL bytes are read; [] when there is no thread id or no such file."""
    thread = reading.session_id
    if not thread or not re.fullmatch(r"[0-9A-Za-z-]{8,80}", thread):
        return []
    for home in homes:
        sessions = home / "sessions"
        try:
            found = sorted(sessions.glob(f"*/*/*/rollout-*{thread}.jsonl"))
        except OSError:
            continue
        if not found:
            continue
        reader = CodexReader()
        path = found[-1]
        try:  # (the task's HOME is the agent's: never a link to another file, never a FIFO)
            data, size = read_tail(path, ROLLOUT_TAIL)
        except OSError:
            return []
        text = data.decode("utf-8", "replace")
        if size > ROLLOUT_TAIL:
            text = text.split("\n", 1)[-1]  # the first line read is cut
        for line in text.splitlines():
            if '"token_count"' in line:  # only the snapshots: the rollout's other records are not the run's output
                reader.line(line)
        return list(reader.out.windows)
    return []


ADAPTER = Adapter(
    name="codex",
    programs=("codex",),
    # workspace-write: it may edit its workspace (exec is read-only by default), no network
    command=("codex", "exec", "--json", "--skip-git-repo-check", "--sandbox", "workspace-write", "--model", "{model}",
             "-"),
    resume=("codex", "exec", "--json", "--skip-git-repo-check", "--sandbox", "workspace-write", "--model", "{model}",
            "resume", "{agent_session}", "-"),
    reader=CodexReader,
    reports_cost=False,
    session_windows=rollout_windows,
    describe="exec --json events: thread.started, turn.completed usage (thread total), turn.failed/error",
)
