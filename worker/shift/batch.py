"""Batches: the state machine a shift drives for a claimed carrier task.

A batch (``fleet batch create LANE KEY...``) is carried by a task of kind ``batch``: claiming it
takes one slot, and the carrier's lease, heartbeat, hand-off, monitor repair and attempt cap are
those of any task. The shift that holds the carrier runs the members one after another, each in
its own git worktree on ``batch/<id>-m<n>-<key>``, cut from the integration branch
``batch/<id>`` (made from the lane's base):

- the agent runs (the executor contract of a task, with the member's prompt and payload, env
  ``FLEET_TASK_*`` of the member and ``FLEET_BATCH_ID``); a non-zero exit evicts the member;
- after an exit 0 the lane's verify gate runs in the member worktree: ``ok`` → the member branch is
  landed fast-forward only and pushed (:func:`worker.workspace.git.land_ff_only`), its worktree removed;
  ``task-failed`` → evicted (nothing of it landed: nothing to revert); an inconclusive gate or a
  landing that cannot fast-forward → the batch is blocked until ``fleet resume --batch ID``;
- a member's agent is recorded as a run of the member's own task (``fleet.runs``: its tokens, cost,
  model), whose outcome follows the member (done when landed, failed when evicted); the carrier's
  run carries none of it, so per-task accounting and the cohort figures hold for batched tasks;
- after the last member: the lane's ``batch_verify`` in a worktree of the integration branch, then
  its ``ship`` once (env ``FLEET_BATCH_MEMBERS``: the landed keys; its start is recorded first, and a
  takeover that finds a start without an outcome runs it again with ``FLEET_BATCH_SHIP_RERUN=1``),
  then the report.

Every step is a ``fleet.batch_*`` call fenced by the carrier's lease, and the member being worked
is read from the database, so a shift that takes the carrier over (after a repair or a hand-off)
continues the same member on the same branch: it re-runs the gate when the agent had exited 0,
re-tries the landing when the gate had passed (a landing is idempotent), else runs the agent
again in the member's worktree, whose commits are kept.

:meth:`BatchRunner.step` makes at most one move per call and never waits on a process: the shift
calls it from its loop, so it keeps heartbeating the carrier while members run. Git operations
are made in the call (they are local to the host's mirror, plus one push per landing), each under
the shift's :meth:`~worker.shift.shift.Shift.keepalive`: a wait on the mirror (another shift's
fetch) can outlast a lease, and the main loop, parked in git, heartbeats nothing meanwhile.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from uuid import UUID

from worker.agent.adapters import ADAPTERS, StreamReader
from worker.agent.executor import AgentProcess, render_argv, tail
from worker.agent.prices import run_report, spent
from worker.config import FleetConfig, LaneConfig
from worker.errors import ConfigError, DatabaseUnavailable, FleetError, LeaseLost
from worker.files import UnsafeFile
from worker.models import Task
from worker.shift.dispatch import Dispatch, classify_gate, resolve
from worker.shift.progress import Marks, over_budget, progress_marks, waiting_for
from worker.store.protocol import Store
from worker.workspace.folder import Workspace, batch_workspace, prepare, safe_name

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from worker.workspace.git import Mirror

INCONCLUSIVE = ("automation-broken", "capability-unavailable")


def require_repo(cfg: FleetConfig, lane: str) -> None:
    """A batch lands its members on a git integration branch: refuse a configured lane without a
    ``repo`` (a lane the config does not know is the database's to refuse)."""
    lane_cfg = cfg.lanes.get(lane)
    if lane_cfg is not None and not lane_cfg.repo:
        raise ConfigError(f"lane {lane} has no `repo`: a batch lands its members on a git integration branch",
                          f"set [lanes.{lane}] repo = \"<path or URL>\" (and base) in fleet.toml")


class BatchShift(Protocol):
    """What a batch runner uses of the shift that claimed its carrier (:class:`worker.shift.shift.Shift`)."""

    @property
    def store(self) -> Store: ...
    @property
    def cfg(self) -> FleetConfig: ...
    @property
    def lane(self) -> LaneConfig: ...
    @property
    def lane_name(self) -> str: ...
    @property
    def workspaces(self) -> Path: ...
    @property
    def host(self) -> str: ...
    @property
    def session(self) -> UUID: ...
    @property
    def deadline_at(self) -> datetime: ...
    @property
    def log(self) -> Any: ...
    @property
    def stop_reason(self) -> str | None: ...
    def instructions(self) -> str: ...
    def mirror(self) -> Mirror: ...
    def task_budget(self, task: Task, log: Any) -> tuple[tuple[float | None, int | None], tuple[float, int]]: ...
    def task_env(self, task: Task, ws: Workspace, d: Dispatch, *, attempt: int | None = None,
                 lease: UUID | None = None, **extra: str) -> dict[str, str]: ...
    def environment(self, d: Dispatch, lease: UUID | None, **task_vars: str) -> dict[str, str]: ...
    def start_gate(self, ws: Workspace, env: dict[str, str], gate_log: Path, d: Dispatch) -> AgentProcess: ...
    def agent_process(self, argv: list[str], *, cwd: Path, env: dict[str, str], log_path: Path,
                      dispatch: Dispatch, stdin: Path | None = None, label: str = "the agent") -> AgentProcess: ...
    def count(self, outcome: str) -> None: ...
    def keepalive(self) -> AbstractContextManager[None]: ...


@dataclass
class _Proc:
    kind: str  # agent | gate | batch_verify | ship
    proc: AgentProcess
    until: float | None = None  # a gate's deadline (monotonic)


@dataclass
class BatchRunner:
    """One claimed carrier: ``step()`` from the shift's loop until ``done``."""

    shift: BatchShift
    task: Task
    done: bool = False
    stopping: bool = False
    state: str = "setup"
    batch: dict[str, Any] = field(default_factory=dict)
    member: dict[str, Any] | None = None
    running: _Proc | None = None
    killed: str | None = None
    started: float = field(default_factory=time.monotonic)
    # the running member agent's task budget (max cost, max tokens), what its task spent before,
    # what this run streamed, and why the runner stopped it for its budget
    budget: tuple[float | None, int | None] = (None, None)
    spent_before: tuple[float, int] = (0.0, 0)
    reader: StreamReader = field(default_factory=StreamReader)
    model: str | None = None  # the member agent's dispatched model (for a cost from the price table)
    over_budget: str | None = None
    marks: Marks = (0, None, None)

    def __post_init__(self) -> None:
        self.batch_id = int(self.task.batch_id or self.task.payload.get("batch") or 0)
        self.lane = self.shift.lane
        self.log = self.shift.log.bind(task=self.task.id, batch=self.batch_id)

    @property
    def token(self) -> Any:
        return self.task.lease_token

    # -- the shift's side

    def progressed(self) -> bool:
        """Progress for the stall detector: a member's agent made some (its log grew, a hook touched
        ``.fleet/progress``, its checkpoint changed); a gate, the tail or a step between counts."""
        r = self.running
        if r is None or r.kind != "agent" or self.member is None:
            return True
        marks = progress_marks(r.proc.log_path, self._ws(self.member))
        if marks == self.marks:
            return False
        self.marks = marks
        return True

    def attention(self) -> str | None:
        """What the running member's agent waits for (``.fleet/attention.json``), if anything."""
        if self.running is None or self.running.kind != "agent" or self.member is None:
            return None
        return waiting_for(self._ws(self.member))

    def lease_gone(self, why: str) -> None:
        """The heartbeat says the carrier's lease is gone (lost, cancelled): stop, write nothing."""
        self.killed = why
        if self.running is not None:
            self.running.proc.kill()
            self.running.proc.release()
        self.running = None
        self.done = True
        self.log.warning("batch stopped: the carrier's lease is gone", reason=why)

    def stop(self) -> None:
        """The shift is ending: stop what runs; the next step hands the carrier off."""
        self.stopping = True
        if self.running is not None:
            self.running.proc.terminate()

    def kill(self) -> None:
        self.stopping = True
        if self.running is not None:
            self.running.proc.kill()

    # -- the machine

    def _call(self, fn: str, **params: Any) -> Any:
        return self.shift.store.batch_call(fn, {"p_carrier": self.task.id, "p_token": self.token, **params})

    def step(self) -> None:
        if self.done:
            return
        try:
            if self.running is not None:
                self._poll()
            elif self.stopping:
                self._hand_off("shift ended between batch steps")
            else:
                getattr(self, f"_{self.state}")()
        except LeaseLost as exc:
            self.log.warning("batch: lease lost", error=str(exc))
            self.lease_gone("lost")
        except DatabaseUnavailable as exc:  # the step is tried again at the next call
            self.log.warning("batch step failed; will try again", state=self.state, error=str(exc))
        except OSError as exc:  # a step's process could not be started (not found, no sandbox)
            self.running = None
            self._block("automation-broken", f"could not start the batch's next process: {exc}",
                        self.member["n"] if self.member is not None else None)

    def _setup(self) -> None:
        from worker.workspace.git import ensure_integration_branch, integration_branch

        if not self.lane.repo:
            error = (f"lane {self.shift.lane_name} has no `repo` in fleet.toml: a batch needs a git "
                     "repository (its members land on an integration branch)")
            self.log.error("batch cannot run", error=error)
            self.shift.store.fail(self.task.id, self.token, error, retryable=False)
            self.done = True
            return
        branch = integration_branch(self.batch_id)
        try:
            with self.shift.keepalive():
                head = ensure_integration_branch(self.shift.mirror(), branch, self.lane.base)
        except FleetError as exc:
            self._block("automation-broken", f"could not set up the integration branch {branch}: {exc}")
            return
        self.batch = self._call("batch_setup", p_base=self.lane.base, p_branch=branch)
        self.log.info("batch set up", branch=branch, head=head[:12], members=len(self.batch["members"]),
                      profile=self.batch.get("profile"))
        self.state = "next"

    def _reload(self) -> None:
        self.batch = self.shift.store.batch_call("batch_get", {"p_batch": self.batch_id}, idempotent=True)

    def _ws(self, m: dict[str, Any]) -> Any:
        return batch_workspace(self.shift.workspaces, self.shift.lane_name,
                             f"batch-{self.batch_id}-m{m['n']}-{m['key']}")

    def _next(self) -> None:
        from worker.workspace.git import cut_member_branch, member_branch

        self._reload()
        todo = [m for m in self.batch["members"] if m["state"] in ("pending", "running")]
        if not todo:
            self.member = None
            self.state = "tail"
            return
        m = self.member = todo[0]
        if m["state"] == "running" and m.get("gate") == "ok":
            self.log.info("batch: the member's gate had passed; landing it", n=m["n"])
            self.state = "land"
            return
        ws = self._ws(m)
        branch = member_branch(self.batch_id, m["n"], m["key"])
        try:
            with self.shift.keepalive():
                head = cut_member_branch(self.shift.mirror(), ws.root, branch, self.batch["integration_branch"])
        except FleetError as exc:
            from worker.workspace.git import BranchDiverged

            reason = "branch-diverged" if isinstance(exc, BranchDiverged) else "automation-broken"
            self._block(reason, f"could not prepare member {m['n']}'s worktree: {exc}", m["n"])
            return
        step = self._call("batch_member_start", p_n=m["n"], p_branch=branch, p_worktree=os.path.abspath(ws.root),
                          p_cut_sha=m.get("cut_sha") or head)
        if step == "blocked":  # its task's earlier runs spent its budget: never run into more spend
            self.log.warning("batch member blocked: its task's budget is spent", n=m["n"], key=m["key"])
            self._tear_down(m)
            self.state = "next"
            return
        m["branch"], m["worktree"] = branch, os.path.abspath(ws.root)
        m["cut_sha"] = m.get("cut_sha") or head
        member_task = self.shift.store.get_task(int(m["task_id"]))
        try:
            cp = ws.read_checkpoint()  # this member's own, from an earlier claim of the carrier on this host
        except UnsafeFile as exc:  # a link or a FIFO the member's agent left: the database's is used
            self.log.warning("member checkpoint not read", member=m["task_id"], error=exc.strerror)
            cp = None
        if cp is not None and m["state"] == "running":
            member_task = member_task.model_copy(update={"checkpoint": cp[0]})
        prepare(ws, member_task, instructions=self.shift.instructions(), lane_handoff=None,
                hidden_sets=self.lane.hidden_files, shift_deadline=self.shift.deadline_at)
        env = self._env(member_task, ws)
        if m["state"] == "running" and m.get("gate") in ("pending", *INCONCLUSIVE) and self.lane.verify:
            self.log.info("batch: member continues at its verify gate", n=m["n"], gate=m.get("gate"))
            self._start_gate(ws, env, member_task)
            return
        self.budget, self.spent_before = self.shift.task_budget(member_task, self.log)  # for the run's own spend
        d = self._dispatch(member_task)
        self.reader, self.model = ADAPTERS[d.agent].reader(), d.model
        self.over_budget, self.marks = None, (0, None, None)
        values = {"prompt_file": str(ws.prompt_file), "workspace": str(ws.root), "model": d.model or "",
                  "task_id": str(member_task.id), "agent_session": member_task.agent_session or ""}
        log = self._log_path(m, "agent")
        self.running = _Proc("agent", self.shift.agent_process(d.argv(values), cwd=ws.root, env=env,
                                                               log_path=log, stdin=ws.prompt_file, dispatch=d))
        self.log.info("batch member started", n=m["n"], key=m["key"], branch=branch, cut=str(m["cut_sha"])[:12],
                      pid=self.running.proc.pid, dispatch=d.describe())

    def _dispatch(self, member_task: Task | None) -> Dispatch:
        # the batch's profile, recorded at creation, for every member and every recovery
        return resolve(self.shift.cfg, self.shift.lane_name, self.batch.get("profile") or self.task.run_profile,
                       member_task.tier if member_task is not None else None)

    def _env(self, member_task: Task, ws: Any) -> dict[str, str]:
        # the member runs under the carrier's claim: its attempt, and `fleet guard` checks its lease
        return self.shift.task_env(member_task, ws, self._dispatch(member_task), attempt=self.task.attempts,
                                    lease=self.token, FLEET_BATCH_ID=str(self.batch_id),
                                    FLEET_BATCH_CARRIER=str(self.task.id), FLEET_GUARD_TASK=str(self.task.id))

    def _log_path(self, m: dict[str, Any] | None, what: str) -> Path:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        who = f"m{m['n']}-{safe_name(m['key'])}" if m else "tail"
        return (self.shift.workspaces / self.shift.lane_name / "logs"
                / f"batch-{self.batch_id}-{who}-{what}-a{self.task.attempts}-{stamp}.log")

    def _start_gate(self, ws: Any, env: dict[str, str], member_task: Task) -> None:
        assert self.member is not None
        self.running = _Proc("gate", self.shift.start_gate(ws, env, self._log_path(self.member, "gate"),
                                                           self._dispatch(member_task)),
                             until=time.monotonic() + self.lane.verify_timeout)
        self.log.info("batch member's verify gate started", n=self.member["n"])

    def _poll(self) -> None:
        r = self.running
        assert r is not None
        if r.kind == "agent" and self.budget != (None, None) and self.over_budget is None:
            self.reader.read(r.proc.log_path)
            cost, tokens = spent(self.reader.reading(), self.model, self.shift.cfg.prices)
            over = over_budget(self.budget, self.spent_before[0] + cost, self.spent_before[1] + tokens)
            if over is not None:
                self.over_budget = over
                r.proc.kill()
                self.log.warning("batch member's agent stopped: its task's budget is spent", spent=over)
        code = r.proc.poll()
        timed_out = False
        if code is None and r.until is not None and time.monotonic() > r.until and not self.stopping:
            r.proc.kill()
            r.proc.wait(10)
            code, timed_out = r.proc.poll(), True
        if code is None:
            return
        r.proc.release()
        self.running = None
        if self.stopping and code != 0:
            self._hand_off(f"shift ended during the batch's {r.kind} ({self.shift.stop_reason})")
            return
        getattr(self, f"_after_{r.kind}")(r, code, timed_out)

    def _spend(self, r: _Proc, code: int) -> tuple[dict[str, Any], bool]:
        """The member's agent's report (its run's tokens, cost, model, session) and whether the
        agent's own end-of-run record said it failed (a stopped run still spent what it streamed)."""
        reading = self.reader.read_all(r.proc.log_path)
        usage = {**run_report(reading, reading.tokens, self.model, self.shift.cfg.prices),
                 "exit_code": code, "log_path": str(r.proc.log_path)}
        usage["cost_usd"] = round(float(usage.get("cost_usd") or 0), 6)
        return usage, reading.final and not reading.succeeded

    def _after_agent(self, r: _Proc, code: int, _timed_out: bool) -> None:
        m = self.member
        assert m is not None
        usage, is_error = self._spend(r, code)
        if self.over_budget is not None:
            self._leave_blocked("budget", self.over_budget, usage)
            return
        if code != 0 or is_error:
            evidence = f"the agent exited {code}" + (" (is_error)" if is_error else "") + \
                f": {tail(r.proc.log_path, 1500).strip()}"
            usage["error_tail"] = evidence[-4000:]
            self._evict(evidence, "task-failed", usage)
            return
        self._call("batch_member_gate", p_n=m["n"], p_gate="pending", p_usage=usage)
        m["gate"] = "pending"
        if self.stopping:  # the next shift runs the gate
            self._hand_off(f"shift ended after member {m['n']}'s agent ({self.shift.stop_reason})")
        elif self.lane.verify:
            member_task = self.shift.store.get_task(int(m["task_id"]))
            ws = self._ws(m)
            self._start_gate(ws, self._env(member_task, ws), member_task)
        else:
            self._follow(self._call("batch_member_gate", p_n=m["n"], p_gate="ok"), "ok", m)

    def _after_gate(self, r: _Proc, code: int, timed_out: bool) -> None:
        m = self.member
        assert m is not None
        outcome, evidence = classify_gate(code, tail(r.proc.log_path, 8000), timed_out=timed_out)
        self.log.info("batch member's gate ended", n=m["n"], gate=outcome)
        step = self._call("batch_member_gate", p_n=m["n"], p_gate=outcome, p_evidence=evidence or None)
        self._follow(step, outcome, m, evidence)

    def _follow(self, step: str, gate: str, m: dict[str, Any], evidence: str = "") -> None:
        """Take the step fleet.batch_member_gate chose for the member's gate outcome: land it, go on
        to the next member (it was evicted), or stop (the batch is blocked)."""
        if step == "land":
            m["gate"] = "ok"
            self.state = "land"
        elif step == "evicted":
            self.log.info("batch member evicted", n=m["n"], key=m["key"], gate=gate)
            self._tear_down(m)
            self.state = "next"
        else:
            self._blocked(gate, evidence, m["n"])

    def _evict(self, evidence: str, gate: str, usage: dict[str, Any] | None = None) -> None:
        """Evict the current member; ``usage``: its agent's report when the agent itself failed."""
        m = self.member
        assert m is not None
        to = self._call("batch_member_evicted", p_n=m["n"], p_evidence=evidence[-4000:], p_gate=gate,
                        p_usage=usage)
        self.log.info("batch member evicted", n=m["n"], key=m["key"], to=to)
        self._tear_down(m)
        self.state = "next"

    def _leave_blocked(self, reason: str, evidence: str, usage: dict[str, Any] | None = None) -> None:
        """The current member leaves the batch blocked (its task's budget is spent): its task waits
        for `fleet resume`, the batch goes on."""
        m = self.member
        assert m is not None
        self._call("batch_member_blocked", p_n=m["n"], p_reason=reason, p_evidence=evidence, p_usage=usage)
        self.log.warning("batch member blocked", n=m["n"], key=m["key"], reason=reason, evidence=evidence)
        self._tear_down(m)
        self.state = "next"

    def _land(self) -> None:
        from worker.workspace.git import GitError, LandingFailed, land_ff_only, member_branch

        m = self.member
        assert m is not None
        branch = m.get("branch") or member_branch(self.batch_id, m["n"], m["key"])
        try:
            with self.shift.keepalive():
                res = land_ff_only(self.shift.mirror(), branch, self.batch["integration_branch"], cut=m.get("cut_sha"))
        except LandingFailed as exc:
            self._block("landing-failed", f"{exc.message}" + (f" ({exc.hint})" if exc.hint else ""), m["n"])
            return
        except GitError as exc:
            self._block("automation-broken", f"landing member {m['n']}: {exc}", m["n"])
            return
        landed_from = res.old_head if not res.already else (m.get("cut_sha") or res.old_head)
        self._call("batch_member_landed", p_n=m["n"], p_from=landed_from, p_to=res.new_head, p_gate="ok")
        self.log.info("batch member landed", n=m["n"], key=m["key"], already=res.already,
                      range=f"{landed_from[:12]}..{res.new_head[:12]}", commits=len(res.commits))
        self._tear_down(m)
        self.state = "next"

    def _tear_down(self, m: dict[str, Any]) -> None:
        from worker.workspace.git import remove_worktree

        try:
            with self.shift.keepalive():
                remove_worktree(self.shift.mirror(), self._ws(m).root)
            self._call("batch_member_torn_down", p_n=m["n"])
        except FleetError as exc:  # a worktree left behind is the reaper's; never fatal
            if isinstance(exc, LeaseLost):
                raise
            self.log.warning("could not remove the member's worktree", n=m["n"], error=str(exc))

    # -- the tail

    def _tail_ws(self) -> Any:
        from worker.workspace.git import ensure_task_worktree

        ws = batch_workspace(self.shift.workspaces, self.shift.lane_name, f"batch-{self.batch_id}")
        with self.shift.keepalive():
            ensure_task_worktree(self.shift.mirror(), ws.root, self.batch["integration_branch"], self.lane.base)
        return ws

    def _landed_keys(self) -> list[str]:
        return [m["key"] for m in self.batch["members"] if m["state"] == "landed"]

    def _tail_env(self, ws: Any) -> dict[str, str]:
        # as a member's: the batch's profile's rules (an allow-list, the sandbox), under the carrier's lease
        return self.shift.environment(self._dispatch(None), self.token, **{
            "FLEET_LANE": self.shift.lane_name, "FLEET_WORKSPACE": str(ws.root), "FLEET_BATCH_ID": str(self.batch_id),
            "FLEET_BATCH_BRANCH": str(self.batch["integration_branch"]),
            "FLEET_BATCH_MEMBERS": " ".join(self._landed_keys()),
            "FLEET_TASK_ID": str(self.task.id), "FLEET_TASK_KEY": self.task.key, "FLEET_GUARD_TASK": str(self.task.id),
        })

    def _tail(self) -> None:
        report = self.batch.get("report") or {}
        step = None
        if self.lane.batch_verify and "batch_verify" not in report and self._landed_keys():
            step, argv = "batch_verify", self.lane.batch_verify
        elif self.lane.ship and "ship" not in report and self._landed_keys():
            step, argv = "ship", self.lane.ship
        if step is None:
            self._finish()
            return
        try:
            ws = self._tail_ws()
        except FleetError as exc:
            self._block("automation-broken", f"could not prepare the integration branch's worktree: {exc}")
            return
        values = {"workspace": str(ws.root), "task_id": str(self.task.id), "model": "", "prompt_file": "",
                  "agent_session": ""}
        env = self._tail_env(ws)
        if step == "ship":
            # recorded before it runs: a takeover that finds a start without an outcome tells the
            # command it may have run already (it can look for the pull request it opened)
            if "ship_started" in report:
                env["FLEET_BATCH_SHIP_RERUN"] = "1"
                self.log.warning("batch: an earlier ship ran without a recorded outcome; shipping again",
                                 starts=len(report["ship_started"]))
            self._call("batch_tail", p_step="ship_started", p_outcome={"attempt": self.task.attempts})
        self.running = _Proc(step, self.shift.agent_process(render_argv(argv, values), cwd=ws.root, env=env,
                                                            log_path=self._log_path(None, step),
                                                            dispatch=self._dispatch(None), label=step),
                             until=time.monotonic() + self.lane.verify_timeout if step == "batch_verify" else None)
        self.log.info(f"batch {step} started", pid=self.running.proc.pid)

    def _after_batch_verify(self, r: _Proc, code: int, timed_out: bool) -> None:
        outcome, evidence = classify_gate(code, tail(r.proc.log_path, 8000), timed_out=timed_out)
        self.log.info("batch_verify ended", gate=outcome)
        report = {"gate": outcome, "exit_code": code} | ({"evidence": evidence[-4000:]} if evidence else {})
        if self._call("batch_tail", p_step="batch_verify", p_outcome=report) == "blocked":
            self._blocked(outcome, evidence)
        else:
            self._reload()

    def _after_ship(self, r: _Proc, code: int, _timed_out: bool) -> None:
        out = tail(r.proc.log_path, 2000).strip()
        if code != 0:
            self._block("ship-failed", f"the ship command exited {code}: {out[-1500:]}")
            return
        self._call("batch_tail", p_step="ship", p_outcome={"exit_code": code, "output": out[-1000:],
                                                           "members": self._landed_keys()})
        self.log.info("batch shipped", members=self._landed_keys())
        self._reload()

    def _finish(self) -> None:
        from worker.workspace.git import remove_worktree

        members = self.batch["members"]
        created = datetime.fromisoformat(str(self.batch["created_at"]))
        report = {
            "landed": [m["key"] for m in members if m["state"] == "landed"],
            "evicted": [m["key"] for m in members if m["state"] == "evicted"],
            "members": [{"n": m["n"], "key": m["key"], "state": m["state"], "gate": m.get("gate"),
                         "tokens": m.get("tokens"), "cost_usd": m.get("cost_usd"),
                         "landed": [m.get("landed_from"), m.get("landed_to")] if m["state"] == "landed" else None}
                        for m in members],
            "tokens": sum(int(m.get("tokens") or 0) for m in members),
            "cost_usd": round(sum(float(m.get("cost_usd") or 0) for m in members), 6),
            "wall_clock_seconds": round((datetime.now(UTC) - created).total_seconds(), 1),
            "ship": (self.batch.get("report") or {}).get("ship"),
        }
        self._call("batch_finish", p_report=report)
        self.log.info("batch done", landed=report["landed"], evicted=report["evicted"])
        self.shift.count("done")
        ws = batch_workspace(self.shift.workspaces, self.shift.lane_name, f"batch-{self.batch_id}")
        try:
            with self.shift.keepalive():
                remove_worktree(self.shift.mirror(), ws.root)
        except FleetError as exc:
            self.log.warning("could not remove the integration branch's worktree", error=str(exc))
        self.done = True

    # -- the ends of a claim

    def _block(self, reason: str, evidence: str, n: int | None = None) -> None:
        self._call("batch_block", p_reason=reason, p_evidence=evidence[-4000:], p_n=n)
        self._blocked(reason, evidence, n)

    def _blocked(self, reason: str, evidence: str, n: int | None = None) -> None:
        """The batch is blocked (by this runner, or by the step the database chose): stop."""
        self.log.warning("batch blocked", reason=reason, n=n, evidence=evidence[-300:])
        self.shift.count("blocked")
        self.done = True

    def _hand_off(self, why: str) -> None:
        """Hand the carrier off (the member's state stays in the database); what the member left
        uncommitted is committed as work in progress and its branch pushed, for another host."""
        from worker.workspace.git import commit_all, push

        m = self.member
        if m is not None and m.get("branch"):
            try:
                ws = self._ws(m)
                with self.shift.keepalive():
                    if (ws.root / ".git").exists():
                        commit_all(self.shift.mirror(), ws.root,
                                   f"lanefleet: work in progress of {m['key']} at hand-off (batch {self.batch_id})")
                    push(self.shift.mirror(), m["branch"])
            except FleetError as exc:
                self.log.warning("could not push the member's branch", error=str(exc))
        snap = {"reason": why, "batch": self.batch_id, "n": m["n"] if m else None, "state": self.state,
                "ran_seconds": round(time.monotonic() - self.started, 1), "host": self.shift.host,
                "shift_session": str(self.shift.session)}
        state = self.shift.store.hand_off(self.task.id, self.token, json.loads(json.dumps(snap, default=str)))
        self.log.info("batch handed off", state=state, n=snap["n"])
        self.shift.count("handed_off")
        self.done = True
