"""Dispatch for coding agents: which command and model a task's attempt runs with, what a
usage-limit message means, and what a verify gate said.

- **Resolution.** A claim tells the shift the task's tier and the profile it drew (``run_profile``,
  chosen by the database from the lane's pools). :func:`resolve` turns them into the argv template
  and the model, exactly as a spawn uses them; ``fleet profiles`` and the shift's start banner show
  the same resolution.
- **Usage limits.** :func:`usage_limit` looks for the profile's exit codes and patterns in a run's
  final message and the tail of its output, and :func:`reset_time` reads the reset the message
  names (an epoch after ``|`` as Claude Code prints it, an ISO time, "resets 3pm (Europe/Berlin)",
  "try again in 20 minutes", "retry after 120").
- **Verify gates.** :func:`classify_gate` maps a gate's end to one of four outcomes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from worker.agent.executor import render_argv
from worker.config import DEFAULT_LIMIT_PATTERNS, FleetConfig, ProfileConfig

GateOutcome = Literal["ok", "task-failed", "automation-broken", "capability-unavailable"]
GATE_OUTCOMES: tuple[GateOutcome, ...] = ("ok", "task-failed", "automation-broken", "capability-unavailable")
# exit status of a gate that ran but cannot judge (as `git bisect run` reads 125: "cannot test")
GATE_CANNOT_JUDGE = 125
_GATE_LINE = re.compile(r"^\s*fleet-gate:\s*(ok|task-failed|automation-broken|capability-unavailable)\b(.*)$",
                        re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True)
class Dispatch:
    """What one attempt runs: the profile (None: the lane's own command), tier, model, argv template."""

    profile: str | None
    tier: str | None
    model: str | None
    command: list[str]
    pool: str | None = None

    def describe(self) -> str:
        who = self.profile or "lane command"
        tier = f"{self.tier}=" if self.tier else ""
        return f"{tier}{who}/{self.model or '-'}"


def resolve(cfg: FleetConfig, lane_name: str, profile: str | None, tier: str | None,
            pool: str | None = None) -> Dispatch:
    """The dispatch of an attempt of ``lane_name`` with ``profile`` (None: the lane's default) at
    ``tier``. A profile the config does not have falls back to the lane's (the claim may come from
    a host whose config is newer); a lane with neither a profile nor a command cannot happen (the
    config refuses it)."""
    lane = cfg.lane(lane_name)
    name = profile if profile in cfg.profiles else lane.profile
    if name is not None:
        prof = cfg.profiles[name]
        return Dispatch(name, tier, prof.model_for(tier) or lane.model, prof.command, pool or prof.pool)
    assert lane.command is not None
    return Dispatch(None, tier, lane.model, lane.command, pool)


def lane_dispatch(cfg: FleetConfig, lane_name: str) -> list[Dispatch]:
    """Every dispatch a lane's tasks can get: per pool of its preference list (or its default
    profile), per tier. What `fleet profiles` and a shift's start banner print."""
    lane = cfg.lane(lane_name)
    entries = cfg.dispatch_list(lane_name) or [{"profile": lane.profile or "", "pool": ""}]
    out = []
    for entry in entries:
        tiers: list[str | None] = [*lane.tiers] or [None]
        for tier in tiers:
            out.append(resolve(cfg, lane_name, entry["profile"] or None, tier, entry["pool"] or None))
    return out


def banner(cfg: FleetConfig, lane_name: str) -> str:
    """One line: ``tier=profile/model`` for each tier, per pool in preference order."""
    parts = []
    for d in lane_dispatch(cfg, lane_name):
        pool = f" [{d.pool}]" if d.pool else ""
        parts.append(f"{d.describe()}{pool}")
    return ", ".join(parts)


# -- usage limits


@dataclass(frozen=True)
class UsageLimit:
    note: str  # the line that said so
    until: datetime | None = None  # the reset the message named
    after_seconds: float | None = None  # or a delay


# the longest window any provider meters (a week) and a day's slack: a reset further ahead is misread
LONGEST_RESET = timedelta(days=8)


def usage_limit(profile: ProfileConfig | None, code: int, final_text: str | None,
                output_tail: str, *, succeeded: bool = False, now: datetime | None = None) -> UsageLimit | None:
    """A usage or rate limit reported by a run, or None.

    ``profile``: the run's profile (None: the default patterns, no exit codes, a 15-minute pause).
    ``succeeded``: the run exited 0 with a success record; such a run is never a limit, whatever
    its text says (an agent's summary may well mention rate limiting). Otherwise a structured
    signal decides first: Claude Code's ``rate_limit_event`` with status ``rejected`` (and its
    ``resetsAt``); then an exit code the profile lists, or one of its patterns in the run's final
    message or the last lines of its output — never in a ``rate_limit_event`` record, which Claude
    Code also writes into ordinary sessions. A reset in the past, or further ahead than
    LONGEST_RESET, is not believed: the profile's ``throttle_backoff`` applies."""
    if succeeded:
        return None
    now = now or datetime.now(UTC)
    patterns = profile.limit_patterns if profile is not None else DEFAULT_LIMIT_PATTERNS
    codes = profile.limit_exit_codes if profile is not None else []
    backoff = profile.throttle_backoff if profile is not None else ProfileConfig.model_fields["throttle_backoff"].default
    floor = profile.throttle_floor if profile is not None else ProfileConfig.model_fields["throttle_floor"].default
    records = _records(output_tail[-4000:])
    structured = _rejected_rate_limit(records)
    if structured is not None:
        note, until = structured
        return UsageLimit(note, *_believed(until, None, backoff, floor, now))
    # the text patterns never read a rate_limit_event: ordinary sessions carry them too
    plain = "\n".join(line for line, rec in records if rec is None or rec.get("type") != "rate_limit_event")
    texts = [t for t in (final_text, plain[-2000:]) if t]
    hit: str | None = None
    for text in texts:
        for pattern in patterns:
            m = re.search(pattern, text, re.IGNORECASE)
            if m:
                start = text.rfind("\n", 0, m.start()) + 1
                end = text.find("\n", m.end())
                hit = text[start:end if end >= 0 else len(text)].strip()[:500]
                break
        if hit:
            break
    if hit is None and code in codes:
        hit = f"exit code {code} (a usage limit for this profile)"
    if hit is None:
        return None
    until, after = reset_time(" ".join(texts) if hit.startswith("exit code") else hit + "\n" + " ".join(texts), now)
    return UsageLimit(hit, *_believed(until, after, backoff, floor, now))


def _believed(until: datetime | None, after: float | None, backoff: float, floor: float,
              now: datetime) -> tuple[datetime | None, float | None]:
    """The reset as read, unless it is in the past or past LONGEST_RESET (then the backoff); never
    sooner than ``floor`` seconds from now."""
    if until is not None and not (now < until <= now + LONGEST_RESET):
        until = None
    if after is not None and not (0 < after <= LONGEST_RESET.total_seconds()):
        after = None
    if until is None and after is None:
        after = backoff
    if until is not None and until < now + timedelta(seconds=floor):
        until = now + timedelta(seconds=floor)
    if after is not None:
        after = max(after, floor)
    return until, after


def _records(tail_text: str) -> list[tuple[str, dict[str, Any] | None]]:
    """Each line of the output's tail, with its JSON object when it is one."""
    out: list[tuple[str, dict[str, Any] | None]] = []
    for line in tail_text.splitlines():
        rec: Any = None
        if line.lstrip().startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
        out.append((line, rec if isinstance(rec, dict) else None))
    return out


def _rejected_rate_limit(records: list[tuple[str, dict[str, Any] | None]]) -> tuple[str, datetime | None] | None:
    """The last ``rate_limit_event`` whose status is ``rejected``: (the record, its reset)."""
    for line, rec in reversed(records):
        if rec is not None and rec.get("type") == "rate_limit_event":
            info = rec.get("rate_limit_info") or {}
            if isinstance(info, dict) and info.get("status") == "rejected":
                reset = info.get("resetsAt")
                until = datetime.fromtimestamp(reset, UTC) if isinstance(reset, int | float) else None
                return line.strip()[:500], until
    return None


_EPOCH = re.compile(r"\|\s*(\d{10})(?:\d{3})?\b")
_ISO = re.compile(r"\b(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)")
_CLOCK = re.compile(r"\b(?:reset(?:s|ting)?\b[^0-9\n]{0,20}|try again at\s+)(\d{1,2})(?::(\d{2}))?\s*(am|pm)?"
                    r"(?:\s*\(([^)]+)\))?", re.IGNORECASE)
_RETRY_AFTER = re.compile(r"retry[- ]after:?\s*(\d+)\b", re.IGNORECASE)
# a delay: "try again in 20 minutes", "in 5 days 22 hours 11 minutes"
_SPAN = re.compile(r"\b(?:in|after)\s+((?:\d+(?:\.\d+)?\s*(?:days?|d|hours?|hrs?|h|minutes?|mins?|m|seconds?|secs?|s)\b"
                   r"[\s,]*(?:and\s+)?)+)", re.IGNORECASE)
_SPAN_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([dhms])", re.IGNORECASE)
# "resets Oct 31, 9am", "resets Sep 15 at 7pm", "resets Jan 18, 11:30am (Asia/Calcutta)"
_DATED = re.compile(r"\breset(?:s|ting)?\b(?:\s+on)?\s+(jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?\s+(\d{1,2})"
                    r"(?:,|\s+at)?\s+(\d{1,2})(?::(\d{2}))?\s*(am|pm)?(?:\s*\(([^)]+)\))?", re.IGNORECASE)
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
    m = _DATED.search(text)
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
    """A reset with a month and a day (the next such date, this year or the next), in its zone."""
    month, day = _MONTHS.index(m.group(1)[:3].lower()) + 1, int(m.group(2))
    hour, minute = _hour(int(m.group(3)), (m.group(5) or "").lower()), int(m.group(4) or 0)
    zone = _zone(m.group(6))
    local = now.astimezone(zone)
    for year in (local.year, local.year + 1):
        try:
            when = datetime(year, month, day, hour, minute, tzinfo=zone)
        except ValueError:
            return None
        if when > local:
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


# -- verify gates


def classify_gate(code: int | None, output: str, *, timed_out: bool = False) -> tuple[GateOutcome, str]:
    """A gate's outcome and its evidence (the output's tail, or why there is none).

    A line ``fleet-gate: <outcome> [why]`` in the output decides. Else: exit 0 → ok; exit 125 →
    capability-unavailable (the gate ran and cannot judge); 126/127 (not executable, not found), a
    signal, a timeout, or a failure that printed nothing → automation-broken (the gate itself could
    not run); any other failure with output → task-failed, the output being the evidence. An
    inconclusive gate is never ok.
    """
    evidence = output[-4000:].strip()
    said_lines = list(_GATE_LINE.finditer(output))
    m = said_lines[-1] if said_lines else None  # the last one decides
    if m is not None and not timed_out:
        said: GateOutcome = m.group(1).lower()  # type: ignore[assignment]
        if said == "ok" and code not in (0, None):
            return "automation-broken", f"the gate said ok but exited {code}\n{evidence}"
        return said, evidence
    if timed_out:
        return "automation-broken", f"the gate timed out\n{evidence}".strip()
    if code == 0:
        return "ok", evidence
    if code == GATE_CANNOT_JUDGE:
        return "capability-unavailable", evidence or "the gate exited 125: it cannot judge this work"
    if code is None or code in (126, 127) or code > 128:
        why = {126: "is not executable", 127: "could not be started (command not found?)"}.get(
            code or 0, f"was killed (exit {code})")
        return "automation-broken", f"the gate {why}\n{evidence}".strip()
    if not evidence:
        return "automation-broken", f"the gate exited {code} without any output: no evidence the work is wrong"
    return "task-failed", evidence


#: what ``fleet profiles`` shows for what a spawn fills in (the prompt file and workspace are per
#: task, the session per attempt)
SAMPLE_VALUES = {"prompt_file": "<prompt_file>", "workspace": "<workspace>", "task_id": "<task_id>",
                 "agent_session": "<agent_session>"}


def resolved(cfg: FleetConfig) -> dict[str, Any]:
    """``fleet profiles``: profiles with each tier's argv, and per lane the dispatch of each pool and tier in order."""
    profiles = []
    for name, p in cfg.profiles.items():
        tiers = sorted({*p.models, *(t for lane in cfg.lanes.values() for t in lane.tiers)})
        profiles.append({
            "name": name, "pool": p.pool, "slots": cfg.pools[p.pool].slots if p.pool else None,
            "command": p.command, "models": p.models, "default_model": p.model,
            "limit_patterns": p.limit_patterns, "limit_exit_codes": p.limit_exit_codes,
            "throttle_backoff_seconds": p.throttle_backoff, "throttle_floor_seconds": p.throttle_floor,
            "tiers": {t: {"model": p.model_for(t), "argv": render_argv(p.command, {**SAMPLE_VALUES, "model": p.model_for(t) or ""})}
                      for t in tiers if p.model_for(t)},
        })
    lanes = {}
    for name in cfg.lanes:
        lanes[name] = [{"pool": d.pool, "profile": d.profile, "tier": d.tier, "model": d.model,
                        "argv": render_argv(d.command, {**SAMPLE_VALUES, "model": d.model or ""})}
                       for d in lane_dispatch(cfg, name)]
    return {"profiles": profiles, "lanes": lanes}
