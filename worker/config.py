"""Configuration: ``fleet.toml`` (DESIGN §9) plus environment overrides, validated by pydantic.

The file is found at ``--config``, else ``$FLEET_CONFIG``, else ``./fleet.toml``; with no file at
all, lanefleet runs with the built-in example lanes (``docs``, ``bugfix``, ``review``) so that
``fleet up --demo`` works on a fresh clone. The environment overrides the file:

- ``DATABASE_URL`` or ``FLEET_DATABASE__URL``: the database (none: the embedded Postgres);
- any field as ``FLEET_<SECTION>__<FIELD>``, e.g. ``FLEET_FLEET__WORKSPACES``,
  ``FLEET_LANES__DOCS__MAX_RUNNING=4``.

A bad value is a :class:`ConfigError` whose message names the field, and nothing starts.
"""

from __future__ import annotations

import os
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from worker.errors import ConfigError

LANE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}\Z")  # \Z: "$" would let "docs\n" through
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
PLACEHOLDERS = {"prompt_file", "workspace", "model", "task_id", "agent_session"}


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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DatabaseConfig(_Strict):
    url: str | None = None
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


class FleetSection(_Strict):
    store: Literal["postgres", "supabase"] = "postgres"
    workspaces: Path = Path(".fleet/workspaces")
    home: Path = Path(".fleet")  # embedded Postgres, logs, runtime files
    monitor_every: float = 30.0
    # a lane with ready work and idle slots for this long is reported (the "leaked slot" class)
    idle_alert_seconds: float = 300.0

    @field_validator("monitor_every", "idle_alert_seconds", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)


class LaneConfig(_Strict):
    command: list[str] = Field(min_length=1)
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
    accepts_from: list[str] | None = None
    paused: bool = False
    cron: str | None = None
    shift_minutes: float = Field(default=9.0, gt=0)
    max_shifts: int = Field(default=1, ge=1)
    grace_seconds: float = Field(default=20.0, ge=0)
    require_result: bool = False
    hidden_files: list[str] = Field(default_factory=lambda: ["fleet"])
    stall_seconds: int | None = Field(default=None, gt=0)

    @field_validator("command", mode="before")
    @classmethod
    def _split_command(cls, v: Any) -> Any:
        return shlex.split(v) if isinstance(v, str) else v

    @field_validator("command")
    @classmethod
    def _known_placeholders(cls, v: list[str]) -> list[str]:
        for arg in v:
            for name in re.findall(r"\{([^{}]*)\}", arg):
                if name not in PLACEHOLDERS:
                    raise ValueError(
                        f"unknown placeholder {{{name}}} in {arg!r}; "
                        f"known: {', '.join('{' + p + '}' for p in sorted(PLACEHOLDERS))}"
                    )
        return v

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
        return self

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
    agent = ["python", "-m", "worker.example_agent", "{prompt_file}"]
    common = {"command": agent, "lease_seconds": 30, "cron": "*/10 * * * *", "backoff_base_seconds": 2,
              "backoff_max_seconds": 60, "grace_seconds": 3}
    return {
        "docs": {**common, "max_running": 2},
        "bugfix": {**common, "max_running": 2},
        "review": {**common, "max_running": 1, "accepts_from": ["bugfix"]},
    }


class FleetConfig(_Strict):
    database: DatabaseConfig = Field(default_factory=DatabaseConfig)
    supabase: SupabaseConfig = Field(default_factory=SupabaseConfig)
    fleet: FleetSection = Field(default_factory=FleetSection)
    lanes: dict[str, LaneConfig] = Field(default_factory=dict)
    # where the file was read from (None: built-in defaults); relative paths resolve against it
    source: Path | None = None

    @field_validator("lanes")
    @classmethod
    def _lane_keys(cls, v: dict[str, LaneConfig]) -> dict[str, LaneConfig]:
        for name in v:
            if not LANE_NAME.match(name):
                raise ValueError(
                    f"{name!r} is not a lane name (lowercase letters, digits, - and _, 63 at most)"
                )
        return v

    @property
    def base_dir(self) -> Path:
        return self.source.parent if self.source else Path.cwd()

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


def _set_path(data: dict[str, Any], path: list[str], value: str) -> None:
    node = data
    for part in path[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"environment override of {'.'.join(path)}: {part} is not a table")
        node = nxt
    raw: Any = value
    if value[:1] in "[{" or value in ("true", "false"):
        import json

        try:
            raw = json.loads(value)
        except ValueError:
            raw = value
    node[path[-1]] = raw


def _env_overrides(data: dict[str, Any], environ: dict[str, str]) -> None:
    for key, value in sorted(environ.items()):
        if key.startswith("FLEET_") and "__" in key:
            parts = [p.lower() for p in key[len("FLEET_"):].split("__")]
            if all(parts):
                _set_path(data, parts, value)
    url = environ.get("FLEET_DATABASE__URL") or environ.get("DATABASE_URL")
    if url:
        data.setdefault("database", {})["url"] = url


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
    if not data.get("lanes"):
        data["lanes"] = _example_lanes() | dict(data.get("lanes") or {})
    _env_overrides(data, environ)
    try:
        cfg = FleetConfig.model_validate({**data, "source": source})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "config"
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise ConfigError(f"{file if source else 'config'}: {where}: {err['msg']}{more}") from None
    for name, lane in cfg.lanes.items():
        for other in lane.accepts_from or []:
            if other not in cfg.lanes:
                raise ConfigError(f"lanes.{name}.accepts_from: {other!r} is not a configured lane")
    return cfg
