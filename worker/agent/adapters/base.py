"""What every agent adapter reads from its CLI's output, and the reader they share.

An adapter (one module per agent CLI in this package) knows its CLI's default command and reads
its output. A :class:`StreamReader` is fed the run's log as it grows (``read``: from where the last
read stopped) and says at any point what the run has shown so far (:meth:`StreamReader.reading`):
the shift checks a budget against it while the agent runs, and reads the same object once more
after the agent exited — so the streamed count *is* the final accounting once the CLI printed
its end-of-run record, and a run stopped before that keeps every token it streamed.

Token kinds are normalised across CLIs: ``input`` is fresh input (never cached), ``cache_write``
and ``cache_read`` the cached parts, ``output`` every output token billed (reasoning included),
``reasoning`` the part of ``output`` the CLI reports as reasoning/thinking (informational: it is
never added to a total again).

Usage windows are normalised too (:class:`WindowReading`): what a provider said of one of its
metered windows (Claude Code's ``rate_limit_event``, Codex's rate-limit snapshots), utilisation as
a fraction 0..1. ``Reading.windows`` keeps every one the output carried, in order;
:func:`latest_windows` is the last word on each window.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

# API errors that say nothing about the work (Claude Code's and the providers' wordings, from
# tests/agents/corpus/limits/api-error-wordings.jsonl): an adapter's transient signal, and the
# fallback worker.shift.limits applies to any CLI's error text
TRANSIENT_WORDINGS = [
    r"overloaded(?:_error)?", r"\bAPI Error:?\s*\(?5\d\d\b", r"\b5\d\d\b.{0,20}(internal server error|bad gateway|"
    r"service unavailable|gateway timeout)", r"\bECONNRESET\b", r"\bETIMEDOUT\b", r"Connection error",
    r"Unable to connect to API", r"fetch failed", r"stream disconnected", r"socket hang up",
]
_TRANSIENT = re.compile("|".join(f"(?:{w})" for w in TRANSIENT_WORDINGS), re.IGNORECASE)


def transient_wording(text: str) -> bool:
    """Whether an error text is one of the provider-side wordings (TRANSIENT_WORDINGS)."""
    return _TRANSIENT.search(text) is not None


@dataclass
class Tokens:
    input: int = 0
    cache_write: int = 0
    cache_read: int = 0
    output: int = 0
    reasoning: int = 0  # part of output

    @property
    def total(self) -> int:
        return self.input + self.cache_write + self.cache_read + self.output

    def __add__(self, other: Tokens) -> Tokens:
        return Tokens(self.input + other.input, self.cache_write + other.cache_write,
                      self.cache_read + other.cache_read, self.output + other.output,
                      self.reasoning + other.reasoning)

    def minus(self, other: Tokens) -> Tokens:
        """What is left after ``other`` (never below zero): a running total less an earlier one."""
        return Tokens(max(0, self.input - other.input), max(0, self.cache_write - other.cache_write),
                      max(0, self.cache_read - other.cache_read), max(0, self.output - other.output),
                      max(0, self.reasoning - other.reasoning))


@dataclass(frozen=True)
class Signal:
    """A structured record that said something about the run: a usage limit, a provider error,
    a session that cannot be resumed."""

    signal: str  # which record said it, e.g. "rate_limit_event rejected", "turn.failed", "api_error_status 529"
    text: str  # what it said (the human wording where there is one), at most 500 characters
    until: datetime | None = None  # a reset it named
    after_seconds: float | None = None  # or a delay it named


@dataclass(frozen=True)
class WindowReading:
    """What the provider said of one of its usage windows at one point of the run."""

    provider: str  # "anthropic" | "openai"
    window: str  # the CLI's name: five_hour, seven_day, seven_day_opus …; Codex: five_hour/weekly, else primary/secondary
    status: str | None = None  # allowed | allowed_warning | rejected; None: not said
    utilization: float | None = None  # how full, 0..1; None: not said
    resets_at: datetime | None = None
    window_minutes: int | None = None  # the window's length; None: unknown
    at: datetime | None = None  # the time of the record that said it, if it has one

    def report(self) -> dict[str, Any]:
        """The window as the run report carries it (``fleet.record_run``'s ``windows``)."""
        return {"provider": self.provider, "window": self.window, "status": self.status,
                "utilization": self.utilization,
                "resets_at": self.resets_at.isoformat() if self.resets_at is not None else None,
                "window_minutes": self.window_minutes}


WINDOW_STATUSES = frozenset({"allowed", "allowed_warning", "rejected"})


def latest_windows(windows: list[WindowReading]) -> list[WindowReading]:
    """The last reading of each (provider, window), in the order the windows were first seen."""
    last: dict[tuple[str, str], WindowReading] = {}
    for w in windows:
        last[(w.provider, w.window)] = w
    return list(last.values())


@dataclass
class Reading:
    """What a run's output has shown so far."""

    agent: str
    session_id: str | None = None
    final: bool = False  # the CLI printed its end-of-run record
    succeeded: bool = False  # ... and that record says the work succeeded
    subtype: str | None = None  # the CLI's own word for the outcome: success, error_max_turns, turn.failed …
    summary: str | None = None  # the agent's final message (at most 2000 characters)
    error: str | None = None  # the CLI's own error text, when it reported one (at most 2000 characters)
    tokens: Tokens = field(default_factory=Tokens)
    by_model: dict[str, Tokens] = field(default_factory=dict)
    cost_usd: float | None = None  # as the CLI reported it; None: it reports none (see worker.agent.prices)
    session_total: bool = False  # tokens are the agent session's running total, not this process's
    limit: Signal | None = None  # a usage limit, as a structured record said it
    transient: Signal | None = None  # a provider-side error that says nothing about the work
    session_missing: Signal | None = None  # the agent could not resume the session it was given
    windows: list[WindowReading] = field(default_factory=list)  # every usage-window reading, in order

    @property
    def models(self) -> list[str]:
        return list(self.by_model)


class StreamReader:
    """Reads a run's log as it grows; subclasses handle each JSON record (``record``) and each line
    that is not one (``plain``). A log that is one JSON document over many lines (a pretty-printed
    object, or the array ``claude --output-format json`` prints with ``--verbose``) is read whole
    when the run ends (``close``)."""

    agent = "generic"
    #: a line by which the CLI says it cannot resume the session it was given (None: it says so in
    #: its records, or not at all)
    session_missing_line: ClassVar[re.Pattern[str] | None] = None
    _WHOLE_LIMIT = 8 << 20  # bytes of non-record lines kept for ``close``

    def __init__(self) -> None:
        self.offset = 0
        self._partial = b""
        self._records = 0
        self._loose: list[str] = []
        self._loose_size = 0
        self.out = Reading(agent=self.agent)

    # -- what subclasses implement

    def record(self, obj: dict[str, Any]) -> None:  # pragma: no cover - every adapter overrides it
        """One JSON object the CLI printed."""

    def plain(self, line: str) -> None:
        """One line that is not a JSON object: the CLI's own words on stderr (the log holds both
        streams), where :attr:`session_missing_line` says a session it was told to resume is not
        there."""
        if self.session_missing_line is not None and self.out.session_missing is None \
                and self.session_missing_line.search(line):
            self.out.session_missing = Signal(f"{self.agent} stderr", line[:500])

    # -- feeding

    def read(self, path: Path, limit: int = 4 << 20) -> bool:
        """Read what the log gained since the last call; True if it grew."""
        try:
            with path.open("rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read(limit)
        except OSError:
            return False
        if not chunk:
            return False
        self.offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > self._WHOLE_LIMIT:
            self._partial = b""
        for raw in lines:
            self.line(raw.decode("utf-8", "replace"))
        return True

    def read_all(self, path: Path) -> Reading:
        """Read the whole log (or what is left of it) and close: the run's final reading."""
        while self.read(path):
            pass
        return self.close()

    def feed(self, text: str) -> Reading:
        """Read ``text`` as a whole output (tests, replays) and close."""
        for line in text.splitlines():
            self.line(line)
        return self.close()

    def line(self, line: str) -> None:
        stripped = line.strip()
        if not stripped:
            return
        obj: Any = None
        if stripped.startswith("{"):
            try:
                obj = json.loads(stripped)
            except ValueError:
                obj = None
        if isinstance(obj, dict):
            self._records += 1
            self.record(obj)
            return
        if self._loose_size < self._WHOLE_LIMIT:
            self._loose.append(line)
            self._loose_size += len(line)
        self.plain(stripped)

    def close(self) -> Reading:
        """The run ended: read a trailing partial line, and a log that was one JSON document."""
        if self._partial:
            rest, self._partial = self._partial.decode("utf-8", "replace"), b""
            self.line(rest)
        if self._loose and not self.out.final:
            doc: Any = None
            try:
                doc = json.loads("\n".join(self._loose))
            except ValueError:
                doc = None
            self._loose, self._loose_size = [], 0
            for obj in doc if isinstance(doc, list) else [doc]:
                if isinstance(obj, dict):
                    self._records += 1
                    self.record(obj)
        return self.out

    def reading(self) -> Reading:
        return self.out


def count(value: Any) -> int:
    """A token count as a CLI prints it: a non-negative integer, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def money(value: Any) -> float | None:
    """A cost as a CLI prints it: a non-negative number, else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


def clip(text: Any, limit: int = 2000) -> str | None:
    return text[:limit] if isinstance(text, str) and text else None


def epoch(value: Any) -> datetime | None:
    """A reset time a CLI names as epoch seconds (a positive number), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 1e11:
        return datetime.fromtimestamp(value, UTC)
    return None


def fraction(value: Any, scale: float = 1.0) -> float | None:
    """A utilisation as a CLI prints it (``scale`` 100 for a percentage): a number in 0..1, else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= scale:
        return float(value) / scale
    return None


def timestamp(value: Any) -> datetime | None:
    """A record's ISO 8601 time (``2026-02-23T19:34:34.390Z``), else None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        found = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return found if found.tzinfo is not None else found.replace(tzinfo=UTC)


def later(at: datetime | None, seconds: Any) -> datetime | None:
    """``seconds`` (a non-negative number) after ``at``; None without either."""
    if at is None or not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds < 0:
        return None
    return at + timedelta(seconds=seconds)
