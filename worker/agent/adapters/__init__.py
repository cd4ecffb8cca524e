"""One adapter per agent CLI (claude, codex, opencode, gemini; generic for anything else).

Each module of this package defines ``ADAPTER``; the registry finds them all, so adding an agent
CLI is one module here plus its samples under tests/agents/corpus/ (README "Adding an agent CLI").
A profile or lane names its adapter (``agent = "codex"``); by default :func:`detect` picks it from
the program name of the command.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath

from worker.agent.adapters.base import Reading, Signal, StreamReader, Tokens, WindowReading
from worker.config import FleetConfig


@dataclass(frozen=True)
class Adapter:
    name: str
    programs: tuple[str, ...]  # program names it is detected from (the basename of argv[0])
    command: tuple[str, ...]  # the default argv template (the prompt goes to the agent's stdin)
    reader: Callable[[], StreamReader]
    resume: tuple[str, ...] | None = None  # argv template to resume a session (None: `command`'s rule)
    reports_cost: bool = True  # False: the cost is computed from the price table
    describe: str = ""  # one line for `fleet profiles` and the README
    # the usage-window readings a CLI keeps beside its output and does not print (Codex's session
    # rollout): (the run's reading, the folders its home may be) -> readings
    session_windows: Callable[[Reading, Sequence[Path]], list[WindowReading]] | None = None


def _load() -> dict[str, Adapter]:
    found: dict[str, Adapter] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name == "base":
            continue
        adapter = getattr(importlib.import_module(f"{__name__}.{info.name}"), "ADAPTER", None)
        if isinstance(adapter, Adapter):
            found[adapter.name] = adapter
    return found


ADAPTERS: dict[str, Adapter] = _load()
AGENT_NAMES = tuple(sorted(ADAPTERS))


def detect(argv: Sequence[str]) -> str:
    """The adapter of a command, from its program's name (``generic`` when none claims it)."""
    program = PurePath(argv[0]).name if argv else ""
    for adapter in ADAPTERS.values():
        if program in adapter.programs:
            return adapter.name
    return "generic"


def adapter(name: str) -> Adapter:
    return ADAPTERS[name]



def agent_of(name: str | None, argv: Sequence[str] | None, where: str) -> Adapter:
    """The adapter a profile or lane names (``where``: its config path), else the one its command's
    program is; ConfigError naming ``where`` for an unknown one."""
    from worker.errors import ConfigError

    chosen = name or detect(argv or ())
    if chosen not in ADAPTERS:
        raise ConfigError(f"{where}.agent: unknown agent {chosen!r} (agents: {', '.join(AGENT_NAMES)})")
    found = ADAPTERS[chosen]
    if argv is None and not found.command:
        raise ConfigError(f"{where}: agent {chosen!r} has no default command; give `command`")
    return found


def check_config(cfg: FleetConfig) -> None:
    """Every profile's and lane's agent exists and has a command (ConfigError naming the field)."""
    from worker.errors import ConfigError

    for name, profile in cfg.profiles.items():
        agent_of(profile.agent, profile.command, f"profiles.{name}")
    for name, lane in cfg.lanes.items():
        if lane.profile is not None and lane.agent is not None:
            raise ConfigError(f"lanes.{name}.agent: the lane runs profile {lane.profile!r}; "
                              f"name the agent there (profiles.{lane.profile}.agent)")
        if lane.profile is None:
            agent_of(lane.agent, lane.command, f"lanes.{name}")


__all__ = ["ADAPTERS", "AGENT_NAMES", "Adapter", "Reading", "Signal", "StreamReader", "Tokens", "adapter",
           "agent_of", "check_config", "detect"]
