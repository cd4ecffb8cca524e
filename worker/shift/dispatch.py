"""Dispatch for coding agents: which command and model a task's attempt runs with, and what a
verify gate said (what a run's end means: worker.shift.limits).

- **Resolution.** A claim tells the shift the task's tier and the profile it drew (``run_profile``,
  chosen by the database from the lane's pools). :func:`resolve` turns them into the argv template
  and the model, exactly as a spawn uses them; ``fleet profiles`` and the shift's start banner show
  the same resolution.
- **Verify gates.** :func:`classify_gate` maps a gate's end to one of four outcomes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal

from worker.agent.adapters import Adapter, agent_of
from worker.agent.executor import render_argv
from worker.agent.sandbox import AgentRules, rules_for
from worker.config import FleetConfig

GateOutcome = Literal["ok", "task-failed", "automation-broken", "capability-unavailable"]
GATE_OUTCOMES: tuple[GateOutcome, ...] = ("ok", "task-failed", "automation-broken", "capability-unavailable")
# exit status of a gate that ran but cannot judge (as `git bisect run` reads 125: "cannot test")
GATE_CANNOT_JUDGE = 125
_GATE_LINE = re.compile(r"^\s*fleet-gate:\s*(ok|task-failed|automation-broken|capability-unavailable)\b(.*)$",
                        re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True)
class Dispatch:
    """What one attempt runs: the profile (None: the lane's own command), tier, model, the argv
    template (and the one that resumes a session, where the agent's adapter has its own), the
    agent's adapter."""

    profile: str | None
    tier: str | None
    model: str | None
    command: list[str]
    pool: str | None = None
    agent: str = "generic"
    resume: list[str] | None = None

    def describe(self) -> str:
        who = self.profile or "lane command"
        tier = f"{self.tier}=" if self.tier else ""
        return f"{tier}{who}/{self.model or '-'}"

    def argv(self, values: dict[str, str]) -> list[str]:
        """The argv of a spawn: the resume template when there is a session to resume."""
        template = self.resume if self.resume is not None and values.get("agent_session") else self.command
        return render_argv(template, values)


def resolve(cfg: FleetConfig, lane_name: str, profile: str | None, tier: str | None,
            pool: str | None = None) -> Dispatch:
    """The dispatch of an attempt of ``lane_name`` with ``profile`` (None: the lane's default) at
    ``tier``. A profile the config does not have falls back to the lane's (the claim may come from
    a host whose config is newer). A profile's (or lane's) ``command`` overrides its agent's
    default command, for a fresh run and a resumed one alike."""
    lane = cfg.lane(lane_name)
    name = profile if profile in cfg.profiles else lane.profile
    if name is not None:
        prof = cfg.profiles[name]
        return replace(_profile_dispatch(cfg, name), tier=tier, model=prof.model_for(tier) or lane.model,
                       pool=pool or prof.pool)
    found = agent_of(lane.agent, lane.command, f"lanes.{lane_name}")
    command, resume = _templates(lane.command, found)
    return Dispatch(None, tier, lane.model, command, pool, found.name, resume)


def _templates(command: list[str] | None, found: Adapter) -> tuple[list[str], list[str] | None]:
    if command is not None:
        return command, None
    return list(found.command), list(found.resume) if found.resume is not None else None


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
    started = cannot_start_line(output) if code == 127 else None
    if started is not None:
        return "automation-broken", started  # "verify gate 'X' cannot start: ...", the supervisor's
    if code is None or code in (126, 127) or code > 128:
        why = {126: "is not executable", 127: "could not be started (command not found?)"}.get(
            code or 0, f"was killed (exit {code})")
        return "automation-broken", f"the gate {why}\n{evidence}".strip()
    if not evidence:
        return "automation-broken", f"the gate exited {code} without any output: no evidence the work is wrong"
    return "task-failed", evidence


def cannot_start_line(output: str) -> str | None:
    """The supervisor's line saying what could not be started (worker/agent/supervisor.py), without
    its ``lanefleet:`` prefix: "the agent 'claudee' cannot start: No such file or directory"."""
    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("lanefleet: ") and " cannot start: " in line:
            return line.removeprefix("lanefleet: ")
    return None


#: what ``fleet profiles`` shows for what a spawn fills in (the prompt file and workspace are per
#: task, the session per attempt)
SAMPLE_VALUES = {"prompt_file": "<prompt_file>", "workspace": "<workspace>", "task_id": "<task_id>",
                 "agent_session": "<agent_session>"}


def resolved(cfg: FleetConfig) -> dict[str, Any]:
    """``fleet profiles``: profiles with each tier's argv, and per lane the dispatch of each pool and tier in order."""
    profiles = []
    for name, p in cfg.profiles.items():
        tiers = sorted({*p.models, *(t for lane in cfg.lanes.values() for t in lane.tiers)})
        d0 = _profile_dispatch(cfg, name)
        profiles.append({
            "name": name, "agent": d0.agent, "pool": p.pool, "slots": cfg.pools[p.pool].slots if p.pool else None,
            "command": d0.command, "resume": d0.resume, "models": p.models, "default_model": p.model,
            "limit_patterns": p.limit_patterns, "limit_exit_codes": p.limit_exit_codes,
            "throttle_backoff_seconds": p.throttle_backoff, "throttle_floor_seconds": p.throttle_floor,
            "tiers": {t: {"model": p.model_for(t), "argv": d0.argv({**SAMPLE_VALUES, "model": p.model_for(t) or ""})}
                      for t in tiers if p.model_for(t)},
        })
    lanes = {}
    for name in cfg.lanes:
        lanes[name] = [{"pool": d.pool, "profile": d.profile, "agent": d.agent, "tier": d.tier, "model": d.model,
                        "argv": d.argv({**SAMPLE_VALUES, "model": d.model or ""}),
                        "access": access(rules_for(cfg, name, d.profile, d.agent))}
                       for d in lane_dispatch(cfg, name)]
    return {"profiles": profiles, "lanes": lanes}


def access(rules: AgentRules) -> dict[str, Any]:
    """What the agents of a dispatch may see (worker.agent.sandbox): names and paths, never a value."""
    return {"sandbox": rules.sandbox, "sandbox_from": rules.sandbox_from, "agent_env": list(rules.env),
            "agent_env_files": [str(path) for _, path in rules.env_files], "sandbox_ro": list(rules.ro),
            "sandbox_rw": list(rules.rw), "sandbox_hide": list(rules.hide), "summary": rules.describe()}


def _profile_dispatch(cfg: FleetConfig, name: str) -> Dispatch:
    p = cfg.profiles[name]
    found = agent_of(p.agent, p.command, f"profiles.{name}")
    command, resume = _templates(p.command, found)
    return Dispatch(name, None, p.model, command, p.pool, found.name, resume)
