"""opencode: ``opencode run --format json`` (one JSON event per line on stdout).

What it prints (tests/agents/corpus/opencode/, README "Shapes"): ``step_start``, ``text``,
``tool_use``, ``reasoning``, ``step_finish`` (``part.reason`` "tool-calls" | "stop" | …,
``part.cost``, ``part.tokens{input,output,reasoning,cache{read,write}}``), ``error``
(``error{name,data{message,statusCode?,isRetryable?}}``) and, in current sources, a closing
``done``; ``sessionID`` on every event. No model is named.

What is read:

- the session: ``sessionID``;
- tokens and cost: the sum over ``step_finish`` parts. opencode's ``getUsage``
  (packages/opencode/src/session/session.ts, anomalyco/opencode) stores
  ``output: outputTokens - reasoningTokens`` and charges ``reasoning`` at the output rate on top,
  so output here = ``output + reasoning``; ``input`` is already net of both cache counts;
- the outcome: a ``step_finish`` with reason "stop" → succeeded (run-json-bash-tool-two-steps);
  an ``error`` event → final, not succeeded — opencode exits 0 after one
  (run-json-error-model-not-found-1.14.25.jsonl), so this matters; ``done`` → final;
- the summary: the last ``text`` part;
- limits: an error with ``statusCode`` 429 or a rate-limit/quota wording; transient:
  ``statusCode`` >= 500, ``isRetryable``, "overloaded". A 401 is an ordinary failure;
- ``--session`` of an unknown id: "Session not found" on stderr, which shares the run's log →
  ``session_missing``. The current run.ts prints it with ``UI.error`` and exits 1; 1.14.19 printed
  a ``NotFoundError`` and exited 0 (run-json-session-not-found-stderr-1.14.19.txt).
"""

from __future__ import annotations

import re
from typing import Any

from worker.agent.adapters import Adapter
from worker.agent.adapters.base import Signal, StreamReader, Tokens, clip, count, money

_LIMIT = re.compile(r"rate.?limit|quota|usage limit|too many requests|resource.?exhausted", re.IGNORECASE)
_TRANSIENT = re.compile(r"overloaded", re.IGNORECASE)
_SESSION_NOT_FOUND = re.compile("Session not found")


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


class OpencodeReader(StreamReader):
    agent = "opencode"
    session_missing_line = _SESSION_NOT_FOUND

    def __init__(self) -> None:
        super().__init__()
        self._failed = False
        self._last_reason: str | None = None

    def record(self, obj: dict[str, Any]) -> None:
        sid = obj.get("sessionID")
        if isinstance(sid, str) and sid:
            self.out.session_id = sid
        part = _dict(obj.get("part"))
        kind = obj.get("type")
        if kind == "step_finish":
            self._step(part)
        elif kind == "text":
            self.out.summary = clip(part.get("text")) or self.out.summary
        elif kind == "error":
            self._error(obj.get("error"))
        elif kind == "done":
            self.out.final = True
            self.out.succeeded = not self._failed and self._last_reason == "stop"

    def _step(self, part: dict[str, Any]) -> None:
        out = self.out
        tokens = part.get("tokens")
        if isinstance(tokens, dict):
            cache = _dict(tokens.get("cache"))
            reasoning = count(tokens.get("reasoning"))
            out.tokens = out.tokens + Tokens(count(tokens.get("input")), count(cache.get("write")),
                                             count(cache.get("read")), count(tokens.get("output")) + reasoning,
                                             reasoning)
        cost = money(part.get("cost"))
        if cost is not None:
            out.cost_usd = (out.cost_usd or 0.0) + cost
        reason = part.get("reason")
        self._last_reason = reason if isinstance(reason, str) else None
        if reason == "stop" and not self._failed:
            out.final, out.succeeded, out.subtype = True, True, "stop"

    def _error(self, value: Any) -> None:
        out = self.out
        error = _dict(value)
        data = _dict(error.get("data"))
        name = error["name"] if isinstance(error.get("name"), str) else "error"
        message = data["message"] if isinstance(data.get("message"), str) else ""
        self._failed = True
        out.final, out.succeeded, out.subtype = True, False, name
        out.error = clip(message) or name
        status = data.get("statusCode")
        text = f"{name}: {message}"[:500]
        if status == 429 or _LIMIT.search(message):
            out.limit = Signal(f"opencode error {name}", text)
        elif (isinstance(status, int) and status >= 500) or data.get("isRetryable") is True \
                or _TRANSIENT.search(message):
            out.transient = Signal(f"opencode error {name}", text)



# Verified against anomalyco/opencode packages/opencode/src/cli/cmd/run.ts (the stored snapshot):
# `run [message..]` reads piped stdin (`process.stdin.isTTY ? undefined : await Bun.stdin.text()`)
# and uses it as the message when none is given, `--format json` emits the raw events, `-m/--model`
# takes provider/model, `-s/--session` continues a session. So the prompt goes to stdin and
# `{model}` must be provider/model (e.g. anthropic/claude-sonnet-4-5).
ADAPTER = Adapter(
    name="opencode",
    programs=("opencode",),
    command=("opencode", "run", "--format", "json", "--model", "{model}", "--session", "{agent_session}"),
    reader=OpencodeReader,
    reports_cost=True,
    describe="run --format json events: step_finish tokens and cost (summed), error events (exit 0)",
)
