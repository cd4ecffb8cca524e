"""Claude Code: ``claude -p --output-format stream-json --verbose`` (or ``--output-format json``).

What it prints (tests/agents/corpus/claude/, README "Shapes"): ``system/init``, ``assistant`` and
``user`` records, ``rate_limit_event`` records, and a ``result`` record at the end of each turn;
``session_id`` on every record. ``--output-format json`` prints the ``result`` alone, or with
``--verbose`` a JSON array of all records (json-array-not-logged-in-2.1.126.json).

What is read:

- the session: the last ``session_id`` a record named — except after a failed ``--resume``, whose
  result names a *new* id while ``errors[]`` says "No conversation found with session ID: X"
  (stream-json-no-conversation-found-resume.jsonl): that is ``session_missing``, and no id is kept;
- the outcome from the ``result``: succeeded = ``subtype`` "success" and not ``is_error``
  ("success" with ``is_error`` is what limits and API errors look like); ``result`` → summary;
  ``errors[]`` (or the text of an ``is_error`` result) → error;
- tokens: ``modelUsage`` summed over its models (sub-agents are only there, not in ``usage``:
  stream-json-task-subagent-two-models-2.0.27.jsonl), ``thinkingTokens`` → reasoning; ``usage``
  when there is no ``modelUsage`` (stream-json-success-minimal-2.1.7.jsonl). ``total_cost_usd``
  (older ``cost_usd``). Both are cumulative for the life of the process, so with several turns
  the last result is the run's figure (stream-json-multi-turn-cumulative-allowed-warning-2.1.285);
- before a result, an estimate: each assistant message's ``usage`` (repeated on every content
  block, later repeats larger: the largest of each count is kept), summed over message ids, by
  ``message.model``. It undercounts sub-agents and final output; the result replaces it;
- limits: ``rate_limit_event`` with status ``rejected`` (``resetsAt`` epoch; allowed and
  allowed_warning never are), a ``<synthetic>`` assistant with ``"error":"rate_limit"`` or with a
  limit's wording ("Weekly limit reached ∙ resets 5am": stream-json-weekly-limit-reached-tail-exit0),
  ``api_error_status`` 429 or a limit's wording on an ``is_error`` result. The signal's text is the
  synthetic assistant's wording when there is one: the shift reads the reset from it;
- usage windows: every ``rate_limit_event``'s ``rate_limit_info`` (any status): the window it
  names (``rateLimitType``: five_hour, seven_day, seven_day_opus …) with its ``status``,
  ``utilization`` (0..1) and ``resetsAt``, and each of ``unifiedWindows{name: {utilization,
  resetsAt}}`` (stream-json-multi-turn-cumulative-allowed-warning-2.1.285: allowed_warning on
  seven_day at 0.77, five_hour at 0.5 beside it). The status belongs to the named window only;
  the length is known from the name (five_hour 300 minutes, seven_day* 10 080);
- transient: an ``is_error`` result with ``api_error_status`` 500/502/503/504/529 or an API-error
  wording (limits/api-error-wordings.jsonl). Authentication failures ("Not logged in") are neither.
"""

from __future__ import annotations

import json
import re
from typing import Any

from worker.agent.adapters import Adapter
from worker.agent.adapters.base import (
    WINDOW_STATUSES,
    Signal,
    StreamReader,
    Tokens,
    WindowReading,
    clip,
    count,
    epoch,
    fraction,
    money,
    timestamp,
    transient_wording,
)

_NO_CONVERSATION = "No conversation found with session ID"
_SYNTHETIC = "<synthetic>"
# a usage limit's wording (limits/claude-limit-wordings.jsonl): "5-hour limit reached ∙ resets
# 12pm", "You've hit your session limit · …", "Claude AI usage limit reached|<epoch>", "You have
# reached your specified API usage limits", "You're out of extra usage · resets …"
_LIMIT_TEXT = re.compile(r"limit reached|hit your (?:\w+ )?limit|usage limits?\b|out of extra usage", re.IGNORECASE)
_TRANSIENT_STATUS = frozenset({500, 502, 503, 504, 529})
_PROVIDER = "anthropic"


def _window_minutes(name: str) -> int | None:
    """A Claude window's length, as its name says it."""
    if name == "five_hour":
        return 300
    if name == "seven_day" or name.startswith("seven_day_"):
        return 7 * 24 * 60
    return None


def _larger(a: Tokens, b: Tokens) -> Tokens:
    return Tokens(max(a.input, b.input), max(a.cache_write, b.cache_write), max(a.cache_read, b.cache_read),
                  max(a.output, b.output), max(a.reasoning, b.reasoning))


def _message_text(message: dict[str, Any]) -> str | None:
    content = message.get("content")
    if isinstance(content, list):
        texts = [c["text"] for c in content if isinstance(c, dict) and isinstance(c.get("text"), str)]
        return "\n".join(texts) or None
    return content if isinstance(content, str) and content else None


class ClaudeReader(StreamReader):
    agent = "claude"

    def __init__(self) -> None:
        super().__init__()
        self._streamed: dict[str, tuple[str, Tokens]] = {}  # message id → (model, largest usage), since the last result
        self._result_tokens = Tokens()
        self._result_models: dict[str, Tokens] = {}
        self._unkeyed = 0
        self._no_session = False  # a failed --resume: the ids it names are not resumable

    def record(self, obj: dict[str, Any]) -> None:
        sid = obj.get("session_id")
        if isinstance(sid, str) and sid and not self._no_session:
            self.out.session_id = sid
        kind = obj.get("type")
        if kind == "assistant":
            self._assistant(obj)
        elif kind == "rate_limit_event":
            self._rate_limit(obj)
        elif kind == "result":
            self._result(obj)

    def _assistant(self, obj: dict[str, Any]) -> None:
        message = obj.get("message")
        if not isinstance(message, dict):
            return
        model = message.get("model")
        if model == _SYNTHETIC:
            text = clip(_message_text(message), 500) or ""
            if obj.get("error") == "rate_limit" or _LIMIT_TEXT.search(text):
                limit = self.out.limit
                if limit is not None and limit.signal == "rate_limit_event rejected":
                    self.out.limit = Signal(limit.signal, text or limit.text, limit.until)
                else:
                    self.out.limit = Signal("assistant <synthetic>", text or json.dumps(obj)[:500])
            return
        usage = message.get("usage")
        if not isinstance(usage, dict):
            return
        mid = message.get("id")
        if not isinstance(mid, str) or not mid:
            self._unkeyed += 1
            mid = f"#{self._unkeyed}"
        name = model if isinstance(model, str) and model else "unknown"
        seen = Tokens(count(usage.get("input_tokens")), count(usage.get("cache_creation_input_tokens")),
                      count(usage.get("cache_read_input_tokens")), count(usage.get("output_tokens")))
        old = self._streamed.get(mid, (name, Tokens()))[1]
        new = _larger(old, seen)
        self._streamed[mid] = (name, new)
        gained = new.minus(old)
        self.out.tokens = self.out.tokens + gained
        self.out.by_model[name] = self.out.by_model.get(name, Tokens()) + gained

    def _rate_limit(self, obj: dict[str, Any]) -> None:
        info = obj.get("rate_limit_info")
        if not isinstance(info, dict):
            return
        self._windows(info, timestamp(obj.get("timestamp")))
        if info.get("status") != "rejected":
            return  # allowed / allowed_warning: ordinary sessions carry them
        self.out.limit = Signal("rate_limit_event rejected", json.dumps(obj)[:500], epoch(info.get("resetsAt")))

    def _windows(self, info: dict[str, Any], at: Any) -> None:
        """The windows one ``rate_limit_info`` speaks of: the one it names, then its unifiedWindows."""
        named = info.get("rateLimitType") if isinstance(info.get("rateLimitType"), str) else None
        status = info.get("status") if info.get("status") in WINDOW_STATUSES else None
        listed = info.get("unifiedWindows")
        unified: dict[str, Any] = listed if isinstance(listed, dict) else {}
        names = [named] if named else []
        names += [n for n in unified if isinstance(n, str) and n and n != named]
        for name in names:
            found = unified.get(name)
            each: dict[str, Any] = found if isinstance(found, dict) else {}
            own = name == named
            utilization = fraction(info.get("utilization")) if own else None
            reset = epoch(info.get("resetsAt")) if own else None
            self.out.windows.append(WindowReading(
                _PROVIDER, name, status if own else None,
                utilization if utilization is not None else fraction(each.get("utilization")),
                reset if reset is not None else epoch(each.get("resetsAt")), _window_minutes(name), at))

    def _result(self, obj: dict[str, Any]) -> None:
        out = self.out
        is_error = obj.get("is_error") is True
        subtype = obj.get("subtype") if isinstance(obj.get("subtype"), str) else None
        text = obj.get("result") if isinstance(obj.get("result"), str) else None
        listed = obj.get("errors")
        errors = [e for e in listed if isinstance(e, str)] if isinstance(listed, list) else []
        out.final = True
        out.subtype = subtype
        out.succeeded = subtype == "success" and not is_error
        out.summary = clip(text)
        out.error = clip("\n".join(errors)) or (clip(text) if is_error else None)
        missing = next((e for e in errors if _NO_CONVERSATION in e), None)
        if missing is not None:
            out.session_missing = Signal("result errors", missing[:500])
            out.session_id, self._no_session = None, True
        cost = money(obj.get("total_cost_usd"))
        cost = cost if cost is not None else money(obj.get("cost_usd"))
        if cost is not None:
            out.cost_usd = cost
        self._result_tokens, self._result_models = _result_tokens(obj)
        self._streamed.clear()
        out.tokens, out.by_model = self._result_tokens, dict(self._result_models)
        if is_error:
            self._classify(obj.get("api_error_status"), "\n".join([text or "", *errors]).strip())

    def _classify(self, status: Any, text: str) -> None:
        if self.out.limit is None and (status == 429 or _LIMIT_TEXT.search(text)):
            self.out.limit = Signal(f"api_error_status {status}" if status == 429 else "result is_error", text[:500])
        elif self.out.limit is None and (status in _TRANSIENT_STATUS or transient_wording(text)):
            signal = f"api_error_status {status}" if status in _TRANSIENT_STATUS else "result is_error"
            self.out.transient = Signal(signal, text[:500])


def _result_tokens(obj: dict[str, Any]) -> tuple[Tokens, dict[str, Tokens]]:
    """The tokens of a result record: ``modelUsage`` per model, else ``usage`` (no model named)."""
    per_model = obj.get("modelUsage")
    if isinstance(per_model, dict) and per_model:
        models = {str(name): Tokens(count(u.get("inputTokens")), count(u.get("cacheCreationInputTokens")),
                                    count(u.get("cacheReadInputTokens")), count(u.get("outputTokens")),
                                    count(u.get("thinkingTokens")))
                  for name, u in per_model.items() if isinstance(u, dict)}
        return sum(models.values(), Tokens()), models
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return Tokens(), {}
    details = usage.get("output_tokens_details")
    thinking = count(details.get("thinking_tokens")) if isinstance(details, dict) else 0
    return Tokens(count(usage.get("input_tokens")), count(usage.get("cache_creation_input_tokens")),
                  count(usage.get("cache_read_input_tokens")), count(usage.get("output_tokens")), thinking), {}


ADAPTER = Adapter(
    name="claude",
    programs=("claude",),
    # the prompt goes to stdin; `--resume {agent_session}` is dropped while there is no session.
    # acceptEdits: it may edit files in its workspace; anything more (Bash) the profile's command says
    command=("claude", "-p", "--output-format", "stream-json", "--verbose", "--permission-mode", "acceptEdits",
             "--model", "{model}", "--resume", "{agent_session}"),
    reader=ClaudeReader,
    reports_cost=True,
    describe="stream-json/json records: result (modelUsage, total_cost_usd), rate_limit_event, limit messages",
)
