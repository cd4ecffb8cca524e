"""Gemini CLI: ``gemini --output-format stream-json`` (or ``--output-format json``).

What it prints (tests/agents/corpus/gemini/, README "Shapes"): stream-json events ``init{session_id,
model}``, ``message{role,content,delta}``, ``tool_use``, ``tool_result``, ``error{severity,message}``
and a final ``result{status, error?, stats}``; ``--output-format json`` prints one document
``{session_id?, response, stats{models{<m>{tokens{prompt,candidates,total,cached,thoughts,tool}}}},
error?{type,message,code}}``. No cost anywhere.

What is read:

- the session: ``init.session_id`` (or the json document's ``session_id``);
- the outcome: ``result.status`` "success" → succeeded, "error" → not; its ``error.message``;
- the summary: the assistant ``message`` deltas joined (or the json ``response``);
- tokens, stream-json: ``stats.input_tokens`` is the prompt *including* ``cached`` (types.ts:
  "Breakdown of input_tokens: cached, input"), ``output_tokens`` is the candidates only, and
  ``total_tokens`` also holds the thoughts (uiTelemetry sums the API's totalTokenCount). So input
  = input_tokens - cached, cache_read = cached, output = total_tokens - input_tokens (the billed
  output: candidates + thoughts), reasoning = output - output_tokens. stream-json-hello-0.26.0:
  11 598 in, 69 candidates, 11 785 total → 187 output of which 118 reasoning. The remainder also
  holds tool-use prompt tokens when a run has them (none of the samples do). Per model from
  ``stats.models`` when present (newer builds), else the run's total with no model named
  (``init.model`` echoes the requested alias, e.g. "auto-gemini-3");
- tokens, json: per model prompt - cached + tool → input, cached → cache_read, candidates +
  thoughts → output, thoughts → reasoning (json-output-2plus2-0.6.1.json: 7 173 + 0 + 17 = 7 190);
- the error: the result's ``error.message``, else an ``error`` event's ``message``;
- ``--resume`` of an unknown id: "Error resuming session: Invalid session identifier …" on stderr
  (exit 42, no stream) → ``session_missing``;
- limits: code 429, RESOURCE_EXHAUSTED, "Quota exceeded", "exhausted your daily quota", "exhausted
  your capacity" (newer CLIs: "… Your quota will reset after 3h5m30s."); transient: 500/503,
  UNAVAILABLE, "overloaded", "Invalid stream:" — in a result's or the json document's error, or an
  ``error`` event of severity error (limits/gemini-quota-wordings.jsonl).
"""

from __future__ import annotations

import re
from typing import Any

from worker.agent.adapters import Adapter
from worker.agent.adapters.base import Signal, StreamReader, Tokens, clip, count

_LIMIT = re.compile(r"RESOURCE_EXHAUSTED|Quota exceeded|exhausted your (?:daily )?quota|exhausted your capacity|"
                    r"exceeded your current quota|"
                    r"\b429\b|Too Many Requests|TerminalQuotaError", re.IGNORECASE)
# ("Invalid stream: The model returned an empty response or malformed tool call.": the model's
# reply, not the task; 0.44.0 printed it in about 3 of 5 tool-using runs, switchboard's
# docs/harness-behavior.md G17)
_TRANSIENT = re.compile(r"\bUNAVAILABLE\b|overloaded|\b50[0-4]\b|Invalid stream:", re.IGNORECASE)


# `--resume` of a session it does not have (stderr, exit 42: switchboard's probes of 0.42.0)
# (the CLI's own line, from its start: an agent's words quoting it are not)
_SESSION_MISSING = re.compile(r"^\s*Error resuming session: Invalid session identifier")


def _stream_tokens(stats: dict[str, Any]) -> Tokens:
    prompt, cached = count(stats.get("input_tokens")), count(stats.get("cached"))
    candidates = count(stats.get("output_tokens"))
    output = max(candidates, count(stats.get("total_tokens")) - prompt)
    fresh = count(stats["input"]) if "input" in stats else max(0, prompt - cached)
    return Tokens(input=fresh, cache_read=cached, output=output, reasoning=output - candidates)


def _json_tokens(tokens: dict[str, Any]) -> Tokens:
    cached, thoughts = count(tokens.get("cached")), count(tokens.get("thoughts"))
    return Tokens(input=max(0, count(tokens.get("prompt")) - cached) + count(tokens.get("tool")), cache_read=cached,
                  output=count(tokens.get("candidates")) + thoughts, reasoning=thoughts)


class GeminiReader(StreamReader):
    agent = "gemini"
    session_missing_line = _SESSION_MISSING

    def __init__(self) -> None:
        super().__init__()
        self._said: list[str] = []

    def record(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        sid = obj.get("session_id")
        if isinstance(sid, str) and sid:
            self.out.session_id = sid
        if kind == "message" and obj.get("role") == "assistant" and isinstance(obj.get("content"), str):
            if obj.get("delta") is not True:
                self._said.clear()
            self._said.append(obj["content"])
            self.out.summary = clip("".join(self._said).strip())
        elif kind == "error" and obj.get("severity") != "warning":
            # its text is the run's error unless the result names one (0.44.0 ends "Invalid
            # stream: …" and then a result of status "error" without any)
            self.out.error = clip(obj.get("message")) or self.out.error
            self._classify("gemini error", obj.get("message"), None)
        elif kind == "result":
            self._result(obj)
        elif kind is None and ("response" in obj or "stats" in obj or "error" in obj):
            self._document(obj)

    def _result(self, obj: dict[str, Any]) -> None:
        out = self.out
        status = obj.get("status")
        out.final, out.succeeded = True, status == "success"
        out.subtype = status if isinstance(status, str) else None
        self._error(obj.get("error"), "result error")
        stats = obj.get("stats")
        if not isinstance(stats, dict):
            return
        models = stats.get("models")
        if isinstance(models, dict) and models:
            out.by_model = {str(m): _stream_tokens(s) for m, s in models.items() if isinstance(s, dict)}
            out.tokens = sum(out.by_model.values(), Tokens())
        else:
            out.tokens = _stream_tokens(stats)

    def _document(self, obj: dict[str, Any]) -> None:
        out = self.out
        error = obj.get("error")
        out.final = True
        out.succeeded = not isinstance(error, dict)
        out.subtype = "success" if out.succeeded else "error"
        out.summary = clip(obj.get("response")) or out.summary
        self._error(error, "json error")
        stats = obj.get("stats")
        models = stats.get("models") if isinstance(stats, dict) else None
        if isinstance(models, dict):
            out.by_model = {str(m): _json_tokens(s["tokens"]) for m, s in models.items()
                            if isinstance(s, dict) and isinstance(s.get("tokens"), dict)}
            out.tokens = sum(out.by_model.values(), Tokens())

    def _error(self, error: Any, signal: str) -> None:
        if not isinstance(error, dict):
            return
        message = error.get("message") if isinstance(error.get("message"), str) else ""
        kind = error.get("type") if isinstance(error.get("type"), str) else ""
        self.out.error = clip(message) or clip(kind) or self.out.error
        self._classify(signal, f"{kind}: {message}" if kind else message, error.get("code"))

    def _classify(self, signal: str, text: Any, code: Any) -> None:
        text = text if isinstance(text, str) else ""
        if code == 429 or code == "RESOURCE_EXHAUSTED" or _LIMIT.search(text):
            self.out.limit = Signal(signal, text[:500])
        elif code in (500, 503, "UNAVAILABLE") or _TRANSIENT.search(text):
            self.out.transient = Signal(signal, text[:500])


# Verified against geminicli.com docs (cli-reference: "cat file | gemini — Process piped content",
# `gemini -r "<session-id>" "query"` resumes by id; session-management: "--resume (or -r) …
# Resume by ID: You can also provide the full session UUID") and google-gemini/gemini-cli
# packages/core/src/output/{types,stream-json-formatter}.ts for `--output-format stream-json`.
# Without a TTY on stdin the CLI runs headless and reads the prompt from it. In an untrusted folder
# headless runs exit 55 and writes are denied by the default approval mode: a profile adds
# `--skip-trust` / `--approval-mode …` as it needs.
ADAPTER = Adapter(
    name="gemini",
    programs=("gemini",),
    # auto_edit: file edits are applied, shell commands are not (headless runs cannot ask)
    command=("gemini", "--output-format", "stream-json", "--approval-mode", "auto_edit", "--model", "{model}",
             "--resume", "{agent_session}"),
    reader=GeminiReader,
    reports_cost=False,
    describe="stream-json events (init, result stats) or the json document (stats.models tokens)",
)
