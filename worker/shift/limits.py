"""What a run's end means for its task: done, a failed attempt, a usage limit, a provider error
that says nothing about the work, or an agent session that cannot be resumed.

:func:`judge` decides from the agent's adapter reading (worker.agent.adapters) first — its
structured records — and falls back to text only for a run that did not succeed:

- **Usage limits** (:func:`usage_limit`): the adapter's limit signal (Claude Code's
  ``rate_limit_event`` with status ``rejected``, Codex's ``turn.failed``, an HTTP 429 …), else
  an exit code the profile lists or one of its patterns in the CLI's own words: its error, and the
  tail of its output — for a CLI whose records the adapter read, the lines that are not records
  (the agent's summary and messages quote whatever the code they worked on says, "Limit reached"
  included), else the final message and the whole tail (never a ``rate_limit_event`` record:
  ordinary sessions carry them too).
  :func:`reset_time` reads the reset the message names (an epoch after ``|``, an ISO time, "resets
  3pm (Europe/Berlin)", "resets Oct 31, 9am", "try again at 12:16 PM", "try again at Sep 15th, 2026
  7:59 PM", "try again in 5 days 22 hours", "reset after 3h5m30s", "retry after 120", "on
  2026-04-01 at 00:00 UTC"; a time without a zone is UTC). A reset in the past, or further ahead
  than LONGEST_RESET, is not believed and the profile's ``throttle_backoff`` applies; the
  database never queues the task sooner than the profile's ``throttle_floor``.
- **Transient provider errors** (overloaded, 5xx, a reset connection): the adapter's signal, else
  :data:`~worker.agent.adapters.base.TRANSIENT_WORDINGS` in the CLI's own error text. Retried without spending an
  attempt, up to the lane's ``max_transient`` (the database counts).
- **A session that cannot be resumed** ("No conversation found with session ID …"): only when
  this attempt was told to resume one; the session is dropped and the next attempt starts fresh.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from worker.agent.adapters import Reading, Signal
from worker.agent.adapters.base import TRANSIENT_WORDINGS
from worker.config import DEFAULT_LIMIT_PATTERNS, ProfileConfig

Kind = Literal["done", "failed", "throttled", "transient", "session_dropped"]


@dataclass(frozen=True)
class UsageLimit:
    note: str  # the text that said so
    until: datetime | None = None  # the reset, when it is believed
    after_seconds: float | None = None  # or a delay (a believed one, or the profile's backoff)
    signal: str = "pattern"  # what said so: a structured record, "pattern '…'", "exit code N"
    reset_read: datetime | None = None  # the reset as the message named it, believed or not

    def signal_report(self) -> dict[str, Any]:
        """What ``fleet.throttle`` journals: the signal, the text and the reset as read."""
        return {"signal": self.signal, "text": self.note,
                "reset": self.reset_read.isoformat() if self.reset_read is not None else None}


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    why: str = ""  # the error, the note
    limit: UsageLimit | None = None
    transient: Signal | None = None


def judge(reading: Reading, code: int, profile: ProfileConfig | None, output_tail: str, *,
          resumed: bool, now: datetime | None = None) -> Verdict:
    """What the run's end means. ``resumed``: this attempt was told to resume an agent session.
    Exit 75 (a hand-off) and the shift's own stops are the shift's to handle before this."""
    # a session it was told to resume and could not find: opencode 1.14.19 says so on stderr alone
    # and exits 0 (anomalyco/opencode#27559). With exit 0, only a run that showed nothing else (no
    # record, no session, no message, no tokens): one that did work may quote such words
    if resumed and reading.session_missing is not None and not reading.succeeded and (
            code != 0 or not (reading.final or reading.session_id or reading.summary or reading.tokens.total)):
        return Verdict("session_dropped", reading.session_missing.text)
    # exit 0 is done unless the CLI's own end-of-run record says otherwise (Claude Code's is_error,
    # opencode's error event: both exit 0); a run without such a record is the shift's to judge
    if code == 0 and (reading.succeeded or not reading.final):
        return Verdict("done")
    # the CLI's own words only: its error, and what it printed that is not one of its records. Where
    # the adapter read the stream (an end-of-run record), the records are its to judge: the agent's
    # summary and its messages may well quote "limit reached" from the code it worked on
    if reading.final:
        output_tail = "\n".join(line for line in output_tail.splitlines() if not _json_record(line))
        final_text = reading.error
    else:
        final_text = "\n".join(t for t in (reading.error, reading.summary) if t) or None
    limit = usage_limit(profile, code, final_text, output_tail, structured=reading.limit, now=now)
    if limit is not None:
        return Verdict("throttled", limit.note, limit=limit)
    # the CLI's own error text only: an agent's summary may well talk about a server being overloaded
    transient = reading.transient or _transient_text([reading.error] if reading.error else [])
    if transient is not None:
        return Verdict("transient", f"{transient.signal}: {transient.text}"[:2000], transient=transient)
    if code != 0:
        return Verdict("failed", f"exit code {code}: {error_message(reading, output_tail)}"[:2000])
    said = reading.error or reading.summary or ""
    return Verdict("failed", f"exit 0, but the agent's end-of-run record says it failed "
                             f"({reading.subtype or 'no subtype'}): {said}"[:2000])


def error_message(reading: Reading, output_tail: str, lines: int = 3) -> str:
    """What the agent said went wrong (a task's ``last_error``; the raw output stays in the run's
    ``error_tail``): its CLI's own error as the adapter read it from its records, else the last
    ``lines`` lines of its output that are not JSON records (its stderr: the log holds both
    streams), else its final message."""
    if reading.error:
        return reading.error
    plain = [line.strip() for line in output_tail.splitlines() if line.strip() and not _json_record(line)]
    if plain:
        return "\n".join(plain[-lines:])[-800:]
    return reading.summary or "the agent printed no error message (its log has the whole output)"


def _json_record(line: str) -> bool:
    stripped = line.strip()
    if not stripped.startswith("{"):
        return False
    try:
        return isinstance(json.loads(stripped), dict)
    except ValueError:
        return False


def _transient_text(texts: list[str]) -> Signal | None:
    for text in texts:
        for pattern in TRANSIENT_WORDINGS:
            m = re.search(pattern, text, re.IGNORECASE)
            if m:
                return Signal(f"pattern {pattern!r}", _line_of(text, m))
    return None


def _line_of(text: str, m: re.Match[str]) -> str:
    start = text.rfind("\n", 0, m.start()) + 1
    end = text.find("\n", m.end())
    return text[start:end if end >= 0 else len(text)].strip()[:500]


# -- usage limits

# the longest window any provider meters (a week) and a day's slack: a reset further ahead is misread
LONGEST_RESET = timedelta(days=8)


def usage_limit(profile: ProfileConfig | None, code: int, final_text: str | None, output_tail: str, *,
                succeeded: bool = False, structured: Signal | None = None,
                now: datetime | None = None) -> UsageLimit | None:
    """A usage or rate limit reported by a run, or None.

    ``profile``: the run's profile (None: the default patterns, no exit codes, a 15-minute pause).
    ``succeeded``: such a run is never a limit, whatever its text says (an agent's summary may well
    mention rate limiting). ``structured``: the adapter's limit signal, which decides first; then an
    exit code the profile lists, or one of its patterns in ``final_text`` or the last lines of the
    output (never in a ``rate_limit_event`` record)."""
    if succeeded:
        return None
    now = now or datetime.now(UTC)
    patterns = profile.limit_patterns if profile is not None else DEFAULT_LIMIT_PATTERNS
    codes = profile.limit_exit_codes if profile is not None else []
    backoff = profile.throttle_backoff if profile is not None else ProfileConfig.model_fields["throttle_backoff"].default
    if structured is not None:
        until, after = structured.until, structured.after_seconds
        if until is None and after is None:
            until, after = reset_time(structured.text, now)
        return UsageLimit(structured.text or structured.signal, *_believed(until, after, backoff, now),
                          signal=structured.signal, reset_read=_read(until, after, now))
    plain = "\n".join(line for line in output_tail[-4000:].splitlines() if not _rate_limit_record(line))
    texts = [t for t in (final_text, plain[-2000:]) if t]
    hit: str | None = None
    signal = "pattern"
    for text in texts:
        for pattern in patterns:
            m = re.search(pattern, text, re.IGNORECASE)
            if m:
                hit, signal = _line_of(text, m), f"pattern {pattern!r}"
                break
        if hit:
            break
    if hit is None and code in codes:
        hit = signal = f"exit code {code} (a usage limit for this profile)"
    if hit is None:
        return None
    # the reset is read from the line that said so, else from the final message: never from the rest
    # of the output, whose records carry timestamps of their own (Gemini CLI's on every event)
    until, after = (None, None) if hit.startswith("exit code") else reset_time(hit, now)
    if until is None and after is None and final_text:
        until, after = reset_time(final_text, now)
    return UsageLimit(hit, *_believed(until, after, backoff, now), signal=signal, reset_read=_read(until, after, now))


def _rate_limit_record(line: str) -> bool:
    if '"rate_limit_event"' not in line:
        return False
    try:
        rec = json.loads(line)
    except ValueError:
        return False
    return isinstance(rec, dict) and rec.get("type") == "rate_limit_event"


def _read(until: datetime | None, after: float | None, now: datetime) -> datetime | None:
    if until is not None:
        return until
    return now + timedelta(seconds=after) if after is not None else None


def _believed(until: datetime | None, after: float | None, backoff: float,
              now: datetime) -> tuple[datetime | None, float | None]:
    """The reset as read, unless it is in the past or past LONGEST_RESET (then the backoff). The
    database applies the floor."""
    if until is not None and not (now < until <= now + LONGEST_RESET):
        until = None
    if after is not None and not (0 < after <= LONGEST_RESET.total_seconds()):
        after = None
    if until is None and after is None:
        after = backoff
    return until, after


_EPOCH = re.compile(r"\|\s*(\d{10})(?:\d{3})?\b")
_ISO = re.compile(r"\b(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)")
# (a clock is not followed by a word: "try again at 10 de jul. de 2026" and "reset (every 5h …)"
# name no clock)
_CLOCK = re.compile(r"\b(?:reset(?:s|ting)?\b[^0-9\n]{0,20}|try again at\s+)(\d{1,2})(?!\d)(?::(\d{2}))?\s*(am|pm)?"
                    r"(?![ \t]*[^\W\d_])(?:\s*\(([^)]+)\))?", re.IGNORECASE)
_RETRY_AFTER = re.compile(r"retry[- ]after:?\s*(\d+)\b", re.IGNORECASE)
# a delay: "try again in 20 minutes", "in 5 days 22 hours 11 minutes", "reset after 3h5m30s" (Gemini
# CLI: a unit followed at once by the next number)
_SPAN = re.compile(r"\b(?:in|after)\s+((?:\d+(?:\.\d+)?\s*(?:days?|d|hours?|hrs?|h|minutes?|mins?|m|seconds?|secs?|s)(?:\b|(?=\d))"
                   r"[\s,]*(?:and\s+)?)+)(?!\w)", re.IGNORECASE)  # (the last unit ends a word: not "5d41402abc")
_SPAN_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([dhms])", re.IGNORECASE)
# "resets Oct 31, 9am", "resets Sep 15 at 7pm", "resets Jan 18, 11:30am (Asia/Calcutta)"
_DATED = re.compile(r"\breset(?:s|ting)?\b(?:\s+on)?\s+(?P<mon>jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?"
                    r"\s+(?P<day>\d{1,2})(?:,|\s+at)?\s+(?P<hour>\d{1,2})(?::(?P<min>\d{2}))?\s*(?P<ampm>am|pm)?"
                    r"(?:\s*\((?P<zone>[^)]+)\))?", re.IGNORECASE)
# Codex: "try again at Apr 28th, 2026 10:03 PM", "… at Aug 20, 2026, 7:38 AM" (a year, so the date
# as written; no zone: read as UTC, as a clock without one is — the CLI prints its machine's time)
_DATED_YEAR = re.compile(r"\b(?P<mon>jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?\s+(?P<day>\d{1,2})"
                         r"(?:st|nd|rd|th)?,?\s+(?P<year>\d{4}),?\s+(?:at\s+)?(?P<hour>\d{1,2}):(?P<min>\d{2})\s*"
                         r"(?P<ampm>am|pm)?(?:\s*\((?P<zone>[^)]+)\))?", re.IGNORECASE)
# "regain access on 2026-04-01 at 00:00 UTC"
_DATE_AT = re.compile(r"\b(\d{4}-\d{2}-\d{2})\s+at\s+(\d{1,2}):(\d{2})\s*(UTC|GMT)?", re.IGNORECASE)
_MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
_UNIT = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def reset_time(text: str, now: datetime | None = None) -> tuple[datetime | None, float | None]:
    """The reset a limit message names: (an absolute time, or None; a delay in seconds, or None)."""
    now = now or datetime.now(UTC)
    m = _EPOCH.search(text)
    if m:
        return datetime.fromtimestamp(int(m.group(1)), UTC), None
    m = _ISO.search(text)
    if m:
        try:
            when = datetime.fromisoformat(m.group(1).replace("Z", "+00:00"))
            return (when if when.tzinfo else when.replace(tzinfo=UTC)), None
        except ValueError:
            pass
    m = _DATE_AT.search(text)
    if m:
        try:
            day = datetime.fromisoformat(m.group(1))
            return day.replace(hour=int(m.group(2)), minute=int(m.group(3)), tzinfo=UTC), None
        except ValueError:
            pass
    m = _RETRY_AFTER.search(text)
    if m:
        return None, float(m.group(1))
    m = _SPAN.search(text)
    if m:
        return None, sum(float(n) * _UNIT[u.lower()] for n, u in _SPAN_PART.findall(m.group(1)))
    m = _DATED_YEAR.search(text) or _DATED.search(text)
    if m:
        return _dated(m, now), None
    m = _CLOCK.search(text)
    if m:
        hour, minute = _hour(int(m.group(1)), (m.group(3) or "").lower()), int(m.group(2) or 0)
        if hour > 23 or minute > 59:
            return None, None
        zone = _zone(m.group(4))
        local = now.astimezone(zone)
        when = local.replace(hour=hour, minute=minute, second=0, microsecond=0)
        if when <= local:
            when += timedelta(days=1)
        return when.astimezone(UTC), None
    return None, None


def _dated(m: re.Match[str], now: datetime) -> datetime | None:
    """A reset with a month and a day, in its zone: in the year it names, else the next such date
    (this year or the next)."""
    g = m.groupdict()
    month, day = _MONTHS.index(g["mon"][:3].lower()) + 1, int(g["day"])
    hour, minute = _hour(int(g["hour"]), (g["ampm"] or "").lower()), int(g["min"] or 0)
    zone = _zone(g["zone"])
    local = now.astimezone(zone)
    for year in ((int(g["year"]),) if g.get("year") else (local.year, local.year + 1)):
        try:
            when = datetime(year, month, day, hour, minute, tzinfo=zone)
        except ValueError:
            return None
        if g.get("year") or when > local:  # (a named year's date in the past: not believed, later)
            return when.astimezone(UTC)
    return None


def _hour(hour: int, ampm: str) -> int:
    if ampm == "pm" and hour < 12:
        return hour + 12
    if ampm == "am" and hour == 12:
        return 0
    return hour


def _zone(name: str | None) -> ZoneInfo | Any:
    try:
        return ZoneInfo(name.strip()) if name else UTC
    except (ZoneInfoNotFoundError, ValueError):
        return UTC
