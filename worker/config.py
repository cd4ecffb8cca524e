"""Configuration: ``fleet.toml`` (DESIGN §9) plus environment overrides, validated by pydantic.

The file is found at ``--config``, else ``$FLEET_CONFIG``, else ``./fleet.toml``; with no file at
all, lanefleet runs with the built-in example lanes (``docs``, ``bugfix``, ``review``) so that
``fleet up --demo`` works on a fresh clone (a file must name its lanes: the example lanes run a
scripted agent that fakes its work). The environment overrides the file:

- ``DATABASE_URL`` or ``FLEET_DATABASE__URL``: the database (none: the embedded Postgres);
- any field as ``FLEET_<SECTION>__<FIELD>``, e.g. ``FLEET_FLEET__WORKSPACES``,
  ``FLEET_LANES__DOCS__MAX_RUNNING=4``.

A bad value is a :class:`ConfigError` whose message names the field, and nothing starts.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import tomllib
from collections.abc import Mapping
from difflib import get_close_matches
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from worker.errors import ConfigError, InvalidInput

LANE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}\Z")  # \Z: "$" would let "docs\n" through
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
PLACEHOLDERS = {"prompt_file", "workspace", "model", "task_id", "agent_session"}
# the longest pause a usage limit puts on a pool: the longest window any provider meters (a week)
# and a day's slack. The database's fleet._longest_throttle() caps every throttle at it, and the
# shift believes no reset further ahead (worker.shift.limits.LONGEST_RESET)
LONGEST_THROTTLE_SECONDS = 8 * 86400.0
# a task's payload (its JSON text) at most, per lane unless fleet.toml says otherwise (enforced in
# the database: fleet._max_payload_bytes)
MAX_PAYLOAD_BYTES = 1 << 20


def parse_duration(value: str | int | float) -> float:
    """Seconds from ``30``, ``"30s"``, ``"5m"``, ``"1.5h"``, ``"250ms"``."""
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _DURATION.match(value)
        if not m:
            raise ValueError(f"{value!r} is not a duration (use e.g. 30s, 5m, 1h)")
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds <= 0:
        raise ValueError("a duration must be positive")
    return seconds


def flag_duration(value: str, flag: str) -> float:
    """Seconds from a duration flag (30s, 5m, 7d); a bad one is one line naming the flag."""
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise InvalidInput(f"{flag}: {exc}") from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DatabaseConfig(_Strict):
    url: str | None = None
    # no url: the embedded server's data folder (default: <fleet.home>/pgdata, beside the config)
    path: Path | None = None
    # a transaction-mode pooler (Supavisor, PgBouncer): no server-side prepared statements
    pooler: bool = False
    pool_min: int = Field(default=1, ge=0)
    pool_max: int = Field(default=8, ge=1)


class SupabaseConfig(_Strict):
    url: str | None = None  # the project URL (env SUPABASE_URL)
    anon_key: str | None = None  # the project's anon key, sent as `apikey` (env SUPABASE_ANON_KEY)
    key: str | None = None  # this host's fleet key, a JWT from `fleet keys mint` (env FLEET_KEY)
    # `fleet run` only: the worker key the shifts it launches use (env FLEET_WORKER_KEY), while its
    # monitor passes use `key`, which must then be an operator key
    worker_key: str | None = None
    # the project's Max rows (PostgREST's db-max-rows; Supabase's default 1000): the longest page the
    # store asks for. Set it to the project's if that is lower.
    max_rows: int = Field(default=1000, ge=1)


class FleetSection(_Strict):
    store: Literal["postgres", "supabase"] = "postgres"
    workspaces: Path = Path(".fleet/workspaces")
    home: Path = Path(".fleet")  # embedded Postgres, logs, runtime files
    git_cache: Path = Path(".fleet/git")  # the per-host mirrors of lanes' repos
    # the shift slots' lock files and the crontab's logs (None: <home>/cron), shared by every
    # launcher of the host: fleet run, fleet up, the crontab's lines
    cron_dir: Path | None = None
    monitor_every: float = 30.0
    # a lane with ready work and idle slots for this long is reported (the "leaked slot" class)
    idle_alert_seconds: float = 300.0

    @field_validator("monitor_every", "idle_alert_seconds", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)


DEFAULT_LIMIT_PATTERNS = [
    r"usage limit", r"rate[ _-]?limit", r"hit your limit", r"\b429\b.{0,40}(too many|rate)",
    r"(too many|rate).{0,40}\b429\b", r"quota exceeded",
    # Claude Code's wordings since 2.x: "5-hour limit reached ∙ resets 12pm", "You've hit your
    # weekly limit · resets Sep 15 at 7pm"
    r"\blimit reached\b", r"hit your (?:\w+ )?limit",
    # and past the plan's own, its paid overage: "You're out of extra usage · resets 8:40pm (…)"
    r"out of extra usage",
]
ESCALATING = ["unverified-exit", "verify-failed", "stalled"]


def _argv(v: Any) -> Any:
    return shlex.split(v) if isinstance(v, str) else v


def _check_placeholders(v: list[str] | None) -> list[str] | None:
    for arg in v or []:
        for name in re.findall(r"\{([^{}]*)\}", arg):
            if name not in PLACEHOLDERS:
                raise ValueError(
                    f"unknown placeholder {{{name}}} in {arg!r}; "
                    f"known: {', '.join('{' + p + '}' for p in sorted(PLACEHOLDERS))}"
                )
    return v


def _agent_name(v: str | None) -> str | None:
    # which names exist is the adapters' to say (worker.agent.adapters.check_config): this is the form
    if v is not None and not LANE_NAME.match(v):
        raise ValueError(f"{v!r} is not an agent name (e.g. claude, codex, opencode, gemini, generic)")
    return v


ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
#: what lanefleet itself reads from the shift's environment as its database, its keys or its config:
#: never passed to an agent, even when a lane names it in ``agent_env`` (an agent that needs a value
#: of its own under one of these names gets it from ``agent_env_file``)
FLEET_OWN_ENV = ("DATABASE_URL", "SUPABASE_URL", "SUPABASE_ANON_KEY", "SUPABASE_JWT_SECRET",
                 "SUPABASE_SERVICE_ROLE_KEY", "SUPABASE_DB_URL")


def _agent_env_names(v: list[str]) -> list[str]:
    for name in v:
        if not ENV_NAME.match(name):
            raise ValueError(f"{name!r} is not an environment variable name")
        if name.startswith("FLEET_") or name in FLEET_OWN_ENV or name in ENV_SETTINGS:
            raise ValueError(f"{name} is lanefleet's own (its database, keys or config) and never reaches an "
                             "agent; give the agent a value of its own in agent_env_file")
    return v


def _sandbox_paths(v: list[str]) -> list[str]:
    for path in v:
        if not path.strip():
            raise ValueError("an empty path")
    return v


class _AgentAccess(_Strict):
    """What an agent of a lane or profile may see besides its task (README "Running coding agents"):
    a profile's settings add to its lane's."""

    # names passed through from the shift's environment (e.g. ANTHROPIC_API_KEY), besides the base
    # set every agent gets (worker.agent.executor.BASE_ENV)
    agent_env: list[str] = Field(default_factory=list)
    # KEY=VALUE lines read by the shift (mode 0600, owned by the shift's user) into the agent's environment
    agent_env_file: Path | None = None
    # "bwrap": in a bubblewrap sandbox (worker.agent.sandbox); "none": as the shift's user, seeing what
    # it sees. Unset: bwrap for a real agent CLI (claude, codex, opencode, gemini), none for generic
    sandbox: Literal["bwrap", "none"] | None = None
    sandbox_ro: list[str] = Field(default_factory=list)  # more paths the sandbox shows read-only (~ allowed)
    sandbox_rw: list[str] = Field(default_factory=list)  # ... and read-write (e.g. ~/.claude, the CLI's login)
    sandbox_hide: list[str] = Field(default_factory=list)  # more paths it hides (besides the fleet's own)

    _env_names = field_validator("agent_env")(classmethod(lambda cls, v: _agent_env_names(v)))
    _paths = field_validator("sandbox_ro", "sandbox_rw", "sandbox_hide")(classmethod(lambda cls, v: _sandbox_paths(v)))


class WindowConfig(_Strict):
    """A usage window of a pool (README "Capacity windows"): how long, and its budget."""

    hours: float | None = Field(default=None, gt=0)
    days: float | None = Field(default=None, gt=0)
    budget_tokens: int | None = Field(default=None, gt=0)  # tokens of every kind the runs recorded
    budget_usd: float | None = Field(default=None, gt=0)
    # the provider's name of the window its readings carry (Claude Code: five_hour, seven_day,
    # seven_day_opus, ...); default: the window's own name
    provider_window: str | None = None
    models: list[str] = Field(default_factory=list)  # only runs of these models (prefixes): a model family's window

    @model_validator(mode="after")
    def _length_and_budget(self) -> WindowConfig:
        if (self.hours is None) == (self.days is None):
            raise ValueError("a window needs hours or days (one of them)")
        if self.budget_tokens is None and self.budget_usd is None:
            raise ValueError("a window needs a budget_tokens or a budget_usd")
        return self

    @property
    def seconds(self) -> float:
        return (self.hours or 0) * 3600 + (self.days or 0) * 86400

    def settings(self, name: str) -> dict[str, Any]:
        """What fleet.sync_pool takes of it."""
        return {"seconds": self.seconds, "budget_tokens": self.budget_tokens, "budget_usd": self.budget_usd,
                "provider_window": self.provider_window or name, "models": self.models}


class PoolConfig(_Strict):
    """A capacity pool (an account, a subscription, a local GPU): slots across the whole fleet, and
    the usage windows its provider meters it by."""

    slots: int | None = Field(default=None, ge=0)  # None: unlimited
    windows: dict[str, WindowConfig] = Field(default_factory=dict)
    reserve: float = Field(default=0.1, ge=0, lt=1)  # of each window's budget, kept for running work


class ProfileConfig(_AgentAccess):
    """A named dispatch configuration: how to start an agent, and which model each tier runs (and
    what its agents may see, added to the lane's)."""

    command: list[str] | None = Field(default=None, min_length=1)  # default: the agent's own
    agent: str | None = None  # the adapter (claude, codex, opencode, gemini, generic); default: from the program
    models: dict[str, str] = Field(default_factory=dict)  # tier -> model
    model: str | None = None  # a tier the map does not name
    pool: str | None = None
    prompt: Path | None = None  # a prompt template ({instructions} {task} ... see README)
    # a run that hits a usage or rate limit: an exit code, or one of these (regex, any case) in its
    # final message or the tail of its output
    limit_exit_codes: list[int] = Field(default_factory=list)
    limit_patterns: list[str] = Field(default_factory=lambda: list(DEFAULT_LIMIT_PATTERNS))
    # the pool's pause when the message names no reset time; never a shorter one, whatever the
    # message said (no hot loop); neither past the longest window (the database cuts every pause there)
    throttle_backoff: float = Field(default=900.0, le=LONGEST_THROTTLE_SECONDS)
    throttle_floor: float = Field(default=60.0, le=LONGEST_THROTTLE_SECONDS)

    _split_command = field_validator("command", mode="before")(classmethod(lambda cls, v: _argv(v)))
    _placeholders = field_validator("command")(classmethod(lambda cls, v: _check_placeholders(v)))

    @field_validator("throttle_backoff", "throttle_floor", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)

    @field_validator("limit_patterns")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        for pattern in v:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"limit pattern {pattern!r} is not a regular expression: {exc}") from None
        return v

    _agent = field_validator("agent")(classmethod(lambda cls, v: _agent_name(v)))

    @model_validator(mode="after")
    def _command_or_agent(self) -> ProfileConfig:
        if self.command is None and self.agent is None:
            raise ValueError("a profile needs a command or an agent (claude, codex, opencode, gemini)")
        return self

    def model_for(self, tier: str | None) -> str | None:
        return self.models.get(tier, self.model) if tier else self.model


class PriceConfig(_Strict):
    """A model's list price in USD per million tokens, for agent CLIs that report no cost."""

    input: float = Field(ge=0)
    output: float = Field(ge=0)
    cache_read: float | None = Field(default=None, ge=0)  # default: input
    cache_write: float | None = Field(default=None, ge=0)  # default: input


class LaneConfig(_AgentAccess):
    command: list[str] | None = Field(default=None, min_length=1)  # or a profile's, or the agent's own
    agent: str | None = None  # the adapter of `command` (default: from its program name)
    instructions: Path | None = None  # default: lane_instructions/<lane>.md
    model: str | None = None
    max_running: int | None = Field(default=None, ge=0)  # slots across the whole fleet; None = unlimited
    slots: int | None = Field(default=None, ge=1)  # concurrent agents per shift; default min(max_running, 4)
    lease_seconds: int = Field(default=60, ge=3, le=86400)
    max_attempts: int = Field(default=3, ge=1)
    max_handoffs: int = Field(default=10, ge=0)
    session_timeout_seconds: int | None = Field(default=None, gt=0)
    backoff_base_seconds: int = Field(default=10, ge=0)
    backoff_max_seconds: int = Field(default=3600, ge=0)
    # transient provider errors (overloaded, 5xx, connection reset) retried before one counts as a failure
    max_transient: int = Field(default=10, ge=0)
    max_payload_bytes: int = Field(default=MAX_PAYLOAD_BYTES, ge=1)  # an enqueue's payload (JSON text), at most
    accepts_from: list[str] | None = None
    paused: bool = False  # the operator's pause: nothing is claimed (apart from a preflight's pause)
    # a lane retired in the database (`fleet lanes retire`) stays retired through a sync unless this
    # says false; true retires it at the sync (refused while it has live tasks)
    retired: bool | None = None
    cron: str | None = None
    shift_minutes: float = Field(default=9.0, gt=0)
    max_shifts: int = Field(default=1, ge=1)
    grace_seconds: float = Field(default=20.0, ge=0)
    require_result: bool = False
    hidden_files: list[str] = Field(default_factory=lambda: ["fleet"])
    stall_seconds: int | None = Field(default=None, gt=0)
    # dispatch (see README "Running coding agents")
    profile: str | None = None  # the default profile (else `command` + `model`)
    tiers: list[str] = Field(default_factory=list)  # lowest first, e.g. mechanical, mid, strong
    default_tier: str | None = None  # default: the first tier
    escalate_on: list[str] = Field(default_factory=lambda: list(ESCALATING))
    pools: list[str] = Field(default_factory=list)  # preference order; default: the profile's pool
    verify: list[str] | None = Field(default=None, min_length=1)  # the gate, run after an exit 0
    verify_timeout: float = 600.0
    # guard rails (see README "Running coding agents")
    stall_action: Literal["report", "stop"] = "report"  # a stalled agent: reported, or stopped (a failed attempt)
    max_cost_usd: float | None = Field(default=None, gt=0)  # per task, unless given at enqueue
    max_tokens: int | None = Field(default=None, gt=0)  # per task (all kinds), unless given at enqueue
    daily_budget_usd: float | None = Field(default=None, gt=0)  # per lane per UTC day: no claims past it
    daily_budget_tokens: int | None = Field(default=None, gt=0)
    review: bool = False  # a completed task waits in `review` for `fleet review approve|reject`
    review_cap: int | None = Field(default=None, ge=1)  # no claims while this many wait in review
    # a triage lane: its routes are verdicts (the lane a task belongs in), and `fleet stats` shows how
    # often a verdict was wrong (the task later left that lane: routed again, evicted, failed there)
    triage: bool = False
    workspace_retention: float = 7 * 86400.0  # a finished task's workspace is reaped after this
    # git workspaces: each task works in a worktree of a per-host mirror of `repo`, on branch
    # fleet/<lane>/<task key> cut from `base` at its first claim
    repo: str | None = None  # a path or any URL git can reach
    base: str = "main"
    # batches (`fleet batch create`): after the last member, `batch_verify` runs in a worktree of
    # the integration branch, then `ship` once (env FLEET_BATCH_MEMBERS: the landed keys)
    batch_verify: list[str] | None = Field(default=None, min_length=1)
    ship: list[str] | None = Field(default=None, min_length=1)
    batch_size: int | None = Field(default=None, ge=2)  # compose batches of ready tasks (needs `repo`)
    # the CI loop (a lane fed by a source, with a repo): an agent's exit 0 waits in `ci` (holding no
    # slot) for its pull request's checks; a failure comes back to the agent, at most max_ci_fixes times
    ci: bool = False
    max_ci_fixes: int = Field(default=3, ge=0)

    _split_command = field_validator("command", "verify", "batch_verify", "ship", mode="before")(classmethod(lambda cls, v: _argv(v)))
    _placeholders = field_validator("command")(classmethod(lambda cls, v: _check_placeholders(v)))
    _agent = field_validator("agent")(classmethod(lambda cls, v: _agent_name(v)))

    @field_validator("verify_timeout", "workspace_retention", mode="before")
    @classmethod
    def _durations(cls, v: Any) -> float:
        return parse_duration(v)

    @model_validator(mode="after")
    def _tiers(self) -> LaneConfig:
        if len(set(self.tiers)) != len(self.tiers):
            raise ValueError("tiers must not repeat")
        if self.default_tier is not None and self.default_tier not in self.tiers:
            raise ValueError(f"default_tier {self.default_tier!r} is not one of the lane's tiers {self.tiers}")
        if self.command is None and self.profile is None and self.agent is None:
            raise ValueError("a lane needs a command, a profile or an agent")
        return self

    @field_validator("cron")
    @classmethod
    def _cron(cls, v: str | None) -> str | None:
        if v is not None:
            if len(v.split()) not in (5, 6):
                raise ValueError(f"{v!r} is not a cron expression (5 fields, or 6 with seconds first)")
            try:
                cron_trigger(v)
            except ValueError as exc:
                raise ValueError(f"{v!r} is not a valid cron expression: {exc}") from exc
        return v

    @field_validator("accepts_from")
    @classmethod
    def _lane_names(cls, v: list[str] | None) -> list[str] | None:
        for name in v or []:
            if not LANE_NAME.match(name):
                raise ValueError(f"{name!r} is not a lane name")
        return v

    @model_validator(mode="after")
    def _backoff(self) -> LaneConfig:
        if self.backoff_max_seconds < self.backoff_base_seconds:
            raise ValueError("backoff_max_seconds must be at least backoff_base_seconds")
        if self.batch_size is not None and not self.repo:
            raise ValueError("batch_size needs a repo: batch members land on a git integration branch")
        if self.ci and not self.repo:
            raise ValueError("ci needs a repo: the task's branch is pushed there and its pull request's checks judged")
        return self

    def lease_grant(self) -> float:
        """The seconds a heartbeat makes a session's lease hold by this config: the lease, or the
        session timeout when shorter (the database's fleet._lease_until decides; a shift uses this
        until its first heartbeat says)."""
        return float(min(self.lease_seconds, self.session_timeout_seconds or self.lease_seconds))

    def shift_slots(self) -> int:
        if self.slots is not None:
            return self.slots
        return max(1, min(self.max_running, 4)) if self.max_running is not None else 4


def cron_trigger(expr: str) -> Any:
    """An APScheduler CronTrigger from 5 fields (minute first) or 6 (second first)."""
    from apscheduler.triggers.cron import CronTrigger

    f = expr.split()
    if len(f) == 5:
        return CronTrigger(minute=f[0], hour=f[1], day=f[2], month=f[3], day_of_week=f[4])
    return CronTrigger(second=f[0], minute=f[1], hour=f[2], day=f[3], month=f[4], day_of_week=f[5])


def _example_lanes() -> dict[str, Any]:
    agent = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]
    common = {"command": agent, "lease_seconds": 30, "cron": "*/10 * * * *", "backoff_base_seconds": 2,
              "backoff_max_seconds": 60, "grace_seconds": 3}
    return {
        "docs": {**common, "max_running": 2},
        "bugfix": {**common, "max_running": 2},
        "review": {**common, "max_running": 1, "accepts_from": ["bugfix"]},
    }


REPOSITORY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,38}/[A-Za-z0-9._-]{1,100}\Z")


class SourceConfig(_Strict):
    """An issue tracker feeding lanes (README "Taking work from GitHub"): which items become tasks
    of which lane, and what is written back."""

    kind: Literal["github"] = "github"
    repository: str  # owner/name
    api_url: str = "https://api.github.com"
    # the token: from this environment variable, or from a file (mode 0600); never given to agents
    token_env: str = "GITHUB_TOKEN"
    token_file: Path | None = None
    # the selector: an open issue with one of these labels becomes a task of that label's lane
    labels: dict[str, str] = Field(min_length=1)
    assignee: str | None = None  # only issues assigned to this login ("none": to nobody)
    milestone: str | None = None  # only issues of this milestone (its title or number)
    # labels → the task's priority, tier and profile
    priority: dict[str, int] = Field(default_factory=dict)
    tier: dict[str, str] = Field(default_factory=dict)
    profile: dict[str, str] = Field(default_factory=dict)
    # write-back: a label while a task runs, a comment at done, a comment and a label for a person at
    # dead or blocked
    on_claim: Literal["label", "none"] = "label"
    on_done: Literal["comment", "none"] = "comment"
    on_failure: Literal["comment", "none"] = "comment"
    running_label: str = "fleet:running"
    attention_label: str = "fleet:needs-attention"
    # GitHub's rate limit: a pass waits this long at most for its reset (else it stops, and no pass
    # asks again before the reset)
    max_rate_wait: float = 60.0
    timeout: float = 20.0

    @field_validator("max_rate_wait", "timeout", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)

    @field_validator("repository")
    @classmethod
    def _repository(cls, v: str) -> str:
        if not REPOSITORY.match(v):
            raise ValueError(f"{v!r} is not a repository (owner/name)")
        return v

    @field_validator("token_env")
    @classmethod
    def _token_env(cls, v: str) -> str:
        if not ENV_NAME.match(v):
            raise ValueError(f"{v!r} is not an environment variable name")
        return v

    @field_validator("api_url")
    @classmethod
    def _api_url(cls, v: str) -> str:
        from urllib.parse import urlsplit

        url = urlsplit(v)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{v!r} is not an http(s) URL")
        if url.scheme == "http" and url.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"{v!r}: the token would cross the network in clear text; use https "
                             "(plain http only to a loopback address)")
        return v.rstrip("/")

    @field_validator("priority")
    @classmethod
    def _priorities(cls, v: dict[str, int]) -> dict[str, int]:
        for label, n in v.items():
            if not 0 <= n <= 1000:
                raise ValueError(f"label {label!r}: priority {n} is not between 0 and 1000")
        return v


class FleetConfig(_Strict):
    database: DatabaseConfig = Field(default_factory=DatabaseConfig)
    supabase: SupabaseConfig = Field(default_factory=SupabaseConfig)
    fleet: FleetSection = Field(default_factory=FleetSection)
    pools: dict[str, PoolConfig] = Field(default_factory=dict)
    profiles: dict[str, ProfileConfig] = Field(default_factory=dict)
    lanes: dict[str, LaneConfig] = Field(default_factory=dict)
    # USD per million tokens by model, over worker.agent.prices.DEFAULT_PRICES
    prices: dict[str, PriceConfig] = Field(default_factory=dict)
    sources: dict[str, SourceConfig] = Field(default_factory=dict)
    # where the file was read from (None: built-in defaults); relative paths resolve against it
    source: Path | None = None

    @field_validator("lanes", "pools", "profiles", "sources")
    @classmethod
    def _names(cls, v: dict[str, Any], info: Any) -> dict[str, Any]:
        what = {"lanes": "lane", "pools": "pool", "profiles": "profile", "sources": "source"}[info.field_name]
        for name in v:
            if not LANE_NAME.match(name):
                raise ValueError(
                    f"{name!r} is not a {what} name (lowercase letters, digits, - and _, 63 at most)"
                )
        return v

    @model_validator(mode="after")
    def _dispatch(self) -> FleetConfig:
        for name, profile in self.profiles.items():
            if profile.pool is not None and profile.pool not in self.pools:
                raise ValueError(f"profiles.{name}.pool: unknown pool {profile.pool!r} "
                                 f"(pools: {', '.join(sorted(self.pools)) or 'none'})")
        for name, lane in self.lanes.items():
            where = f"lanes.{name}"
            if lane.profile is not None and lane.profile not in self.profiles:
                raise ValueError(f"{where}.profile: unknown profile {lane.profile!r} "
                                 f"(profiles: {', '.join(sorted(self.profiles)) or 'none'})")
            for pool in lane.pools:
                if pool not in self.pools:
                    raise ValueError(f"{where}.pools: unknown pool {pool!r} "
                                     f"(pools: {', '.join(sorted(self.pools)) or 'none'})")
            # every pool of the lane has a profile that draws from it (dispatch_list raises)
            drawn: list[str | None] = [e["profile"] for e in self.dispatch_list(name)]
            for chosen in drawn or [lane.profile]:
                prof = self.profiles.get(chosen) if chosen else None
                for tier in lane.tiers:
                    if prof is not None and prof.model_for(tier) is None:
                        raise ValueError(f"{where}.tiers: profile {chosen!r} maps no model to tier "
                                         f"{tier!r} (give profiles.{chosen}.models.{tier} or a model)")
        return self

    @model_validator(mode="after")
    def _sources(self) -> FleetConfig:
        fed = set()
        for name, source in self.sources.items():
            where = f"sources.{name}"
            for label, target in source.labels.items():
                if target not in self.lanes:
                    raise ValueError(f"{where}.labels: label {label!r} names lane {target!r}, which is not configured "
                                     f"(lanes: {', '.join(sorted(self.lanes)) or 'none'})")
                fed.add(target)
            for label, profile in source.profile.items():
                if profile not in self.profiles:
                    raise ValueError(f"{where}.profile: label {label!r} names unknown profile {profile!r}")
            # the source's token never reaches an agent (an agent gets a token of its own, if any)
            for kind, table in (("lanes", self.lanes), ("profiles", self.profiles)):
                for other, access in table.items():
                    if source.token_env in access.agent_env:
                        raise ValueError(f"{kind}.{other}.agent_env: {source.token_env} is source {name}'s token "
                                         "and never reaches an agent; give the agent a narrower token of its own "
                                         "under another name")
        for name, lane in self.lanes.items():
            if lane.ci and name not in fed:
                raise ValueError(f"lanes.{name}.ci: no source feeds the lane (a [sources.<name>] labels entry): "
                                 "nothing would open its pull requests or read their checks")
        return self

    def sources_of(self, lane: str) -> list[str]:
        """The sources feeding a lane."""
        return [n for n, s in self.sources.items() if lane in s.labels.values()]

    def dispatch_list(self, lane_name: str) -> list[dict[str, str]]:
        """The lane's pools in preference order, each with the profile that draws from it: the
        lane's own profile when its pool is that one, else the first profile (in the file's order)
        drawing from it. Empty for a lane without pools (its profile's pool, if any, is used)."""
        lane = self.lanes[lane_name]
        own_pool = self.profiles[lane.profile].pool if lane.profile else None
        pools = lane.pools or ([own_pool] if own_pool else [])
        out = []
        for pool in pools:
            own = lane.profile if lane.profile and self.profiles[lane.profile].pool == pool else None
            chosen = own or next((n for n, p in self.profiles.items() if p.pool == pool), None)
            if chosen is None:
                raise ValueError(f"lanes.{lane_name}.pools: no profile draws from pool {pool!r}")
            out.append({"pool": pool, "profile": chosen})
        return out

    @property
    def base_dir(self) -> Path:
        return self.source.parent if self.source else Path.cwd()

    def fix_hint(self) -> str:
        """What a paused lane's reason says to do: fix the file this config was read from, and sync
        that file (a shift started with ``--config`` elsewhere: a bare ``fleet`` reads another)."""
        if self.source is None:
            return "fix fleet.toml, then `fleet lanes sync`"
        return f"fix {self.source}, then `fleet --config {self.source} lanes sync`"

    def path(self, p: Path) -> Path:
        return p if p.is_absolute() else self.base_dir / p

    def lane(self, name: str) -> LaneConfig:
        from worker.errors import UnknownLane

        try:
            return self.lanes[name]
        except KeyError:
            raise UnknownLane(
                f"unknown lane {name!r}",
                f"lanes in the config: {', '.join(sorted(self.lanes)) or 'none'}",
            ) from None

    def instructions_path(self, lane: str) -> Path:
        from worker.resources import resource_dir

        configured = self.lane(lane).instructions
        if configured is not None:
            return self.path(configured)
        local = self.base_dir / "lane_instructions" / f"{lane}.md"
        return local if local.exists() else resource_dir("lane_instructions") / f"{lane}.md"


def _set_path(data: dict[str, Any], path: list[str], value: str, name: str) -> None:
    node = data
    for part in path[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"environment variable {name}: sets {'.'.join(path)}, but {part} is not a table")
        node = nxt
    raw: Any = value
    if value[:1] in "[{" or value in ("true", "false"):
        import json

        try:
            raw = json.loads(value)
        except ValueError:
            raw = value
    node[path[-1]] = raw


# variables read by name, besides FLEET_<SECTION>__<FIELD> (which override the file's fields)
ENV_SETTINGS = ("DATABASE_URL", "SUPABASE_URL", "SUPABASE_ANON_KEY", "FLEET_KEY", "FLEET_WORKER_KEY",
                "FLEET_ALLOW_NEWER_SCHEMA",
                # libpq's own, which a database URL without them relies on
                "PGHOST", "PGHOSTADDR", "PGPORT", "PGUSER", "PGPASSWORD", "PGPASSFILE", "PGDATABASE", "PGSERVICE",
                "PGSERVICEFILE", "PGSSLMODE", "PGSSLROOTCERT", "PGSSLCERT", "PGSSLKEY", "PGOPTIONS")


#: ``[supabase]`` field → the Supabase-style name read only when the config leaves the field out
SUPABASE_FALLBACKS = {"url": "SUPABASE_URL", "anon_key": "SUPABASE_ANON_KEY", "key": "FLEET_KEY",
                      "worker_key": "FLEET_WORKER_KEY"}


def supabase_setting(cfg: FleetConfig, field: str, environ: Mapping[str, str]) -> str | None:
    """``[supabase] <field>`` (FLEET_SUPABASE__<FIELD> included), else its fallback variable."""
    value: str | None = getattr(cfg.supabase, field) or environ.get(SUPABASE_FALLBACKS[field])
    return value


def env_settings(environ: Mapping[str, str], cfg: FleetConfig | None = None) -> list[str]:
    """The names of the set environment variables that change what ``fleet`` does with a config:
    what a process started with another environment (cron's) would not see. With ``cfg``, not a
    fallback whose field the config already sets (it is not read)."""
    overrides = [k for k in environ if _override_path(k)]
    read_instead = {SUPABASE_FALLBACKS[f] for f in SUPABASE_FALLBACKS if cfg is not None and getattr(cfg.supabase, f)}
    used = {k for k in ENV_SETTINGS if environ.get(k) and k not in read_instead}
    return sorted(set(overrides) | used)


def _override_path(key: str) -> list[str] | None:
    """The config path a FLEET_<SECTION>__<FIELD> variable sets (lowercase), or None."""
    if not (key.startswith("FLEET_") and "__" in key):
        return None
    parts = [p.lower() for p in key[len("FLEET_"):].split("__")]
    return parts if all(parts) else None


def _env_overrides(data: dict[str, Any], environ: dict[str, str]) -> dict[tuple[str, ...], str]:
    """Apply the environment's overrides to ``data``; returns the variable that set each path."""
    made: dict[tuple[str, ...], str] = {}
    for key, value in sorted(environ.items()):
        if (parts := _override_path(key)) is not None:
            _set_path(data, parts, value, key)
            made[tuple(parts)] = key
    if origin := _url_variable(environ):
        data.setdefault("database", {})["url"] = environ[origin]
        made[("database", "url")] = origin
    return made


def _url_variable(environ: Mapping[str, str]) -> str | None:
    return next((name for name in ("FLEET_DATABASE__URL", "DATABASE_URL") if environ.get(name)), None)


def database_origin(cfg: FleetConfig, environ: Mapping[str, str]) -> str | None:
    """Where the config's database URL came from, for a message: the environment variable that
    set it, or the config file's ``database.url``. None: no URL (the embedded database)."""
    if not cfg.database.url:
        return None
    return _url_variable(environ) or f"{cfg.source or 'config'}: database.url"


def _blame(loc: tuple[str, ...], made: dict[tuple[str, ...], str], file_data: dict[str, Any]) -> str | None:
    """The environment variable to blame for an error at ``loc``: one that set it or a value
    under it, or that made the table it is in (a lane only the environment names)."""
    for path, name in made.items():
        if loc[:len(path)] == path:
            return name
    for path, name in made.items():
        node: Any = file_data
        for part in loc:
            node = node.get(part) if isinstance(node, dict) else None
        if path[:len(loc)] == loc and node is None:
            return name
    return None


def _fields_at(loc: tuple[str, ...]) -> list[str]:
    """The field names of the config table at ``loc`` (``("lanes", "docs")``: a lane's)."""
    model: Any = FleetConfig
    i = 0
    while i < len(loc):
        info = model.model_fields.get(loc[i]) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if info is None:
            return []
        kind = info.annotation
        if get_origin(kind) is dict:
            kind, i = get_args(kind)[1], i + 1  # a named table: lanes.<name>
        model, i = kind, i + 1
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return []
    return [name for name in model.model_fields if name != "source"]


def _problem(err: Any) -> str:
    """A pydantic error as the rest of its line: what is wrong (and for a typo, what was meant)."""
    loc = tuple(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden" and loc:
        close = get_close_matches(loc[-1], _fields_at(loc[:-1]), n=1)
        return f"unknown field {loc[-1]!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ")


def load_config(path: Path | str | None = None, environ: dict[str, str] | None = None) -> FleetConfig:
    """Read and validate the config. Raises ConfigError with one line naming the bad field."""
    environ = dict(os.environ) if environ is None else environ
    explicit = path is not None or bool(environ.get("FLEET_CONFIG"))
    file = Path(path or environ.get("FLEET_CONFIG") or "fleet.toml")
    data: dict[str, Any] = {}
    source: Path | None = None
    if file.exists():
        try:
            data = tomllib.loads(file.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{file}: not valid TOML: {exc}") from None
        except (OSError, UnicodeDecodeError) as exc:  # a directory, no permission, not text
            why = getattr(exc, "strerror", None) or exc
            raise ConfigError(f"config file {file} cannot be read: {why}") from None
        source = file.resolve()
    elif explicit:
        raise ConfigError(f"config file {file} does not exist")
    if source is None:
        data["lanes"] = _example_lanes() | dict(data.get("lanes") or {})
    file_data = copy.deepcopy(data)
    made = _env_overrides(data, environ)
    if source is not None and not data.get("lanes"):
        # the example lanes run a scripted agent that fakes its work: never a real file's lanes
        raise ConfigError(f"{file}: no lanes: add a [lanes.NAME] section for each lane this host runs "
                          "(its agent or command); the example lanes are only for running without a file")
    try:
        cfg = FleetConfig.model_validate({**data, "source": source})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(str(p) for p in err["loc"])
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        variable = _blame(loc, made, file_data)
        origin = f"environment variable {variable}" if variable else str(file) if source else "config"
        where = f"{'.'.join(loc)}: " if loc else ""
        raise ConfigError(f"{origin}: {where}{_problem(err)}{more}") from None
    for name, lane in cfg.lanes.items():
        for other in lane.accepts_from or []:
            if other not in cfg.lanes:
                variable = _blame(("lanes", name, "accepts_from"), made, file_data)
                origin = f"environment variable {variable}" if variable else str(file) if source else "config"
                raise ConfigError(f"{origin}: lanes.{name}.accepts_from: {other!r} is not a configured lane")
    return cfg
