"""The preflight: what a lane's config needs before any task of it is claimed, checked by ``fleet
lanes sync``, ``fleet up``, ``fleet run`` and a shift's start.

A mistake in fleet.toml that only shows when an agent runs burns the lane's attempts: a
missing instructions file gave agents an empty prompt, an agent program that is not on PATH failed
every attempt with exit 127 until the lane's tasks were dead letters. So each lane is checked
first, and a lane that fails is **paused with the reason** (``fleet.lanes.paused_reason``) rather
than run: its instructions file exists; each program its agents run (the lane's or its profiles'
``command``, or the agent CLI's default) resolves on PATH, or is an executable file when given by
its absolute path; its hidden-file sets exist. (Pools and profiles a lane names are checked when
the config is read: a missing one stops every command.) What the run finds anyway — an agent
program that cannot start after all — pauses the lane the same way (fleet.cannot_start).

A program given by a relative path with a folder in it (``./bin/agent``) is relative to the task's
workspace, which the preflight cannot see; one with a placeholder is filled per task: neither is
checked here.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from worker.agent.adapters import agent_of
from worker.config import FleetConfig
from worker.resources import resource_dir


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a lane's config: the field that says it, and what is wrong."""

    field: str  # e.g. lanes.docs.instructions
    what: str

    def __str__(self) -> str:
        return f"{self.field}: {self.what}"


def programs(cfg: FleetConfig, lane: str) -> list[tuple[str, str]]:
    """The programs a lane's agents run, each with the config field that names it: its profiles'
    (the default one and every pool's) or its own, ``command`` or the agent CLI's default."""
    cfg_lane = cfg.lane(lane)
    profiles = [cfg_lane.profile] + [e["profile"] for e in cfg.dispatch_list(lane)]
    found: dict[str, str] = {}
    for name in dict.fromkeys(p for p in profiles if p):
        prof = cfg.profiles[name]
        adapter = agent_of(prof.agent, prof.command, f"profiles.{name}")
        argv = prof.command or list(adapter.command)
        found.setdefault(argv[0], f"profiles.{name}.{'command' if prof.command else 'agent'}")
    if cfg_lane.profile is None:
        adapter = agent_of(cfg_lane.agent, cfg_lane.command, f"lanes.{lane}")
        argv = cfg_lane.command or list(adapter.command)
        found.setdefault(argv[0], f"lanes.{lane}.{'command' if cfg_lane.command else 'agent'}")
    return [(field, program) for program, field in found.items()]


def program_problem(program: str, path: str | None, host: str) -> str | None:
    """Why ``program`` (an argv's first element) cannot be started from ``path`` (a PATH), or None."""
    if program in ("python", "python3") or "{" in program:
        return None  # this interpreter (worker.agent.executor.render_argv); a placeholder, filled per task
    if os.path.isabs(program):
        if not os.path.exists(program):
            return f"the agent program {program} does not exist on host {host}"
        if not os.path.isfile(program) or not os.access(program, os.X_OK):
            return f"the agent program {program} is not an executable file on host {host}"
        return None
    if os.sep in program:
        return None  # relative to the task's workspace
    if shutil.which(program, path=path) is None:
        return f"the agent program {program!r} is not on PATH on host {host}"
    return None


def lane_problems(cfg: FleetConfig, lane: str, *, path: Callable[[str], str | None] | None = None,
                  host: str | None = None) -> list[Problem]:
    """What is wrong with lane ``lane``'s config on this host ([] when nothing). ``path``: the PATH
    the agents named by a config field get (default: this process's PATH)."""
    host = host or socket.gethostname()
    cfg_lane = cfg.lane(lane)
    found: list[Problem] = []
    instructions = cfg.instructions_path(lane)
    field = f"lanes.{lane}.instructions"
    if not instructions.exists():
        if cfg_lane.instructions is None:  # neither beside the config nor among lanefleet's own
            beside = cfg.base_dir / "lane_instructions" / f"{lane}.md"
            found.append(Problem(field, f"no {beside} and no instructions of lanefleet's own for a lane {lane!r} "
                                        f"(give `instructions`, or write that file)"))
        else:
            found.append(Problem(field, f"{instructions} does not exist (a relative path is relative to "
                                        f"the config's folder, {cfg.base_dir})"))
    elif not instructions.is_file() or not os.access(instructions, os.R_OK):
        found.append(Problem(field, f"{instructions} is not a readable file"))
    sets = resource_dir("hidden_files")
    for name in cfg_lane.hidden_files:
        if not (sets / name).is_dir():
            known = ", ".join(sorted(p.name for p in sets.iterdir() if p.is_dir())) or "none"
            found.append(Problem(f"lanes.{lane}.hidden_files", f"no hidden-file set {name!r} in {sets} (sets: {known})"))
    for where, program in programs(cfg, lane):
        why = program_problem(program, path(where) if path else os.environ.get("PATH", os.defpath), host)
        if why is not None:
            found.append(Problem(where, why))
    return found


def reason(problems: Iterable[Problem]) -> str | None:
    """The pause reason the database keeps for a lane's problems (None: nothing wrong)."""
    text = "; ".join(str(p) for p in problems)
    return text or None


def preflight(cfg: FleetConfig, lanes: Iterable[str] | None = None, *,
              environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Lane → the reason to pause it (None: nothing wrong), for ``lanes`` (default: every lane of
    the config), with the PATH of ``environ`` (default: this process's)."""
    env = os.environ if environ is None else environ
    return {name: reason(lane_problems(cfg, name, path=lambda _field: env.get("PATH", os.defpath)))
            for name in (lanes if lanes is not None else cfg.lanes)}
