"""A lane shift (DESIGN §6): what cron runs as ``fleet shift --lane L``.

One session, a bounded life: claim up to the free slots, run an agent per task, heartbeat every
lease/3 (one call renews every lease of the session), store the agents' checkpoints, collect
results; at the deadline, the task budget, an idle queue (``--once``) or SIGTERM/SIGINT: stop
claiming, give running agents a grace period (SIGTERM, then SIGKILL), hand off what is
unfinished with a snapshot, write the lane hand-off and close the session.

While an agent runs, the shift watches the usage windows its output reports (Claude Code's
``rate_limit_event``, Codex's snapshots): a window near its end (``allowed_warning``, or
utilisation at WINDOW_HANDOFF_UTILIZATION) is told to the agent once, in
``.fleet/window_closing.json``; an agent that then exits 75 is handed off with the reason
``window-closing``, and the run report carries the last reading of each window (``windows``).

Python only carries: every decision about a task's state is a ``fleet.*`` call. A heartbeat that
says ``lost`` or ``cancelled`` kills that agent at once and nothing more is written for the task
except its run's token count (the tokens were spent either way).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from uuid import UUID

import structlog

from worker import files
from worker.agent.adapters import ADAPTERS, Reading, StreamReader, Tokens
from worker.agent.adapters.base import WindowReading, latest_windows
from worker.agent.executor import (
    EX_TEMPFAIL,
    AgentProcess,
    ProgramNotFound,
    agent_env,
    base_env,
    render_argv,
    tail,
)
from worker.agent.prices import run_report, spent
from worker.agent.sandbox import (
    AgentRules,
    CannotConfine,
    Sandbox,
    bwrap_problem,
    read_env_file,
    rules_for,
)
from worker.agent.supervisor import CANNOT_START
from worker.config import FleetConfig, LaneConfig
from worker.errors import ConfigError, DatabaseUnavailable, FleetError, LeaseLost, SessionLost
from worker.files import UnsafeFile, write_atomic
from worker.models import LaneHandoff, Task
from worker.preflight import lane_problems, reason
from worker.proc import process_identity, process_start_time
from worker.shift.batch import BatchRunner
from worker.shift.dispatch import (
    Dispatch,
    banner,
    cannot_start_line,
    classify_gate,
    lane_dispatch,
    resolve,
)
from worker.shift.fence import Fence, term_window
from worker.shift.guard import GuardServer
from worker.shift.limits import judge
from worker.shift.progress import Marks, over_budget, progress_marks, waiting_for
from worker.shift.storable import StorableStore
from worker.store.protocol import Store
from worker.workspace.disk import disk_use
from worker.workspace.folder import Workspace, prepare, resolve_workspace, safe_name

if TYPE_CHECKING:
    from worker.workspace.git import Mirror

EXIT_OK = 0
#: the longest an idle shift waits between claims (it backs off from poll_seconds while the lane's
#: queue stays empty; a freed slot or a claimed task claims again at once)
IDLE_CLAIM_MAX = 5.0
EXIT_SESSION_LOST = 3
#: a usage window this full (0..1), or one its provider says is near its end (allowed_warning),
#: asks the agent to hand off before it closes (``.fleet/window_closing.json``)
WINDOW_HANDOFF_UTILIZATION = 0.95
WINDOW_CLOSING = "window_closing.json"

# the outcome of a final call whose effect the database chose (fleet.gate_verdict): the summary
# counts it by the state the task is left in
VERDICT = "verdict"
_COUNT_BY_STATE = {"done": "done", "review": "done", "queued": "failed", "dead": "failed", "blocked": "blocked"}


def session_windows(agent: str, reading: Reading, workspace: Path,
                    environ: Mapping[str, str] | None = None) -> list[WindowReading]:
    """The usage-window readings the agent's CLI kept beside its output (Codex's session rollout),
    looked for where its home may be: CODEX_HOME, the sandbox's home in the workspace, this user's."""
    from worker.agent.sandbox import TASK_HOME

    known = ADAPTERS.get(agent)
    read = known.session_windows if known is not None else None
    if read is None:
        return []
    environ = os.environ if environ is None else environ
    homes = [Path(environ["CODEX_HOME"])] if environ.get("CODEX_HOME") else []
    homes += [workspace / TASK_HOME / ".codex", Path.home() / ".codex"]
    return read(reading, homes)


@dataclass
class Job:
    task: Task
    ws: Workspace
    agent: AgentProcess
    log_path: Path
    started: float
    dispatch: Dispatch  # what this attempt runs with (profile, tier, model, command)
    killed: str | None = None  # 'lost' | 'cancelled': the lease is gone, write nothing more
    stopping: bool = False  # the shift is ending and asked this agent to stop
    fenced: bool = False  # the shift's lease was not renewed in time: stopped, to be handed off
    checkpoint_mtime: float | None = None
    checkpoint: Any = None
    refused_checkpoint: tuple[float, Any] | None = None  # (mtime, data) the database refused
    # the verify gate runs in ``agent``'s place once the agent exited 0 (or at once, for a task an
    # operator resumed): ``gate_until`` is its deadline (monotonic)
    gate_until: float | None = None
    reader: StreamReader = field(default_factory=StreamReader)  # the agent's output, read as it streams
    resumed: bool = False  # this attempt was told to resume the task's agent session
    result: Reading | None = None  # the agent's reading, kept for the completion after the gate
    spent_before: tuple[float, int] = (0.0, 0)  # the task's earlier runs: cost, tokens
    budget: tuple[float | None, int | None] = (None, None)  # the task's: max cost, max tokens
    over_budget: str | None = None  # why the shift stopped the agent for its budget
    progress_marks: Marks = (0, None, None)
    window_closing: dict[str, Any] | None = None  # what .fleet/window_closing.json told the agent, once
    windows_seen: int = 0  # how many of the reader's window readings were looked at

    @property
    def token(self) -> UUID:
        assert self.task.lease_token is not None
        return self.task.lease_token


@dataclass
class ShiftSummary:
    session: UUID | None = None
    reason: str = ""
    claimed: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    lane_handoff: int | None = None
    handoff_file: Path | None = None
    exit_code: int = EXIT_OK


def call_budget(lane: LaneConfig) -> float:
    """The most seconds one store call of a shift may take: a third of what a heartbeat grants (the
    lease, or the session timeout when shorter), so that the shift keeps heartbeating its agents
    through a database outage and no call blocks past its lease."""
    return max(1.0, lane.lease_grant() / 3)


class Shift:
    def __init__(self, store: Store, cfg: FleetConfig, lane: str, *, max_seconds: float | None = None,
                 max_tasks: int | None = None, slots: int | None = None, once: bool = False,
                 poll_seconds: float = 0.5, host: str | None = None) -> None:
        # what it sends comes in part from its agents: made storable on the way (worker.shift.storable)
        self.store: Store = cast(Store, StorableStore(store))
        self.cfg = cfg
        self.lane_name = lane
        self.lane: LaneConfig = cfg.lane(lane)
        self.max_seconds = max_seconds if max_seconds is not None else self.lane.shift_minutes * 60
        self.max_tasks = max_tasks
        self.slots = slots or self.lane.shift_slots()
        self.once = once
        self.poll_seconds = poll_seconds
        self.host = host or socket.gethostname()
        # the seconds a heartbeat or a claim makes the session's lease hold (the database says so
        # at each heartbeat; until the first, the lane's own settings): a heartbeat every third
        self._grant = self.lane.lease_grant()
        self.heartbeat_every = max(0.5, self._grant / 3)
        self.workspaces = cfg.path(cfg.fleet.workspaces)
        self.jobs: dict[int, Job] = {}
        # claimed batch carriers (task kind 'batch'), each run by its state machine (worker.shift.batch)
        self.batches: dict[int, BatchRunner] = {}
        # final calls (complete, fail, ...) that hit a connection failure: retried each loop until
        # answered; a retry is safe because the lease token fences it. Each keeps its slot busy.
        self.pending: dict[int, tuple[Callable[[], str], str]] = {}
        # tasks this session holds whose agent is not running: claimed and not started yet, or
        # ended and not yet answered for (their branch being pushed). Named by every heartbeat,
        # which would otherwise release them.
        self.held: set[int] = set()
        # a claim failed with no answer (the connection broke, a request timed out): it may have
        # committed, its tasks this session's and unknown here. Until fleet.claimed says which, no
        # heartbeat names the tasks this shift runs (it would release those as not-run-by-shift,
        # an attempt spent on work that never ran) and no idle stop ends the shift.
        self._claim_unanswered = False
        self.summary = ShiftSummary()
        self._stop_reason: str | None = None
        self._wake = threading.Event()
        self._lost = False
        self.log = structlog.get_logger("lanefleet.shift").bind(lane=lane)
        self._instructions: str | None = None
        self._git_mirror: Mirror | None = None
        self._lane_handoff: LaneHandoff | None = None
        # idle back-off: after an empty claim the next waits claim_delay (doubling from poll_seconds
        # up to IDLE_CLAIM_MAX) unless a slot was freed since (fewer busy than at that claim)
        self._claim_delay = poll_seconds
        self._next_claim = 0.0
        self._busy_at_empty = 0
        # what agents may see (worker.agent.sandbox): the rules of each dispatch, the agent_env_files
        # read (at the start, and then at the first use of a profile only a task named)
        self._rules: dict[tuple[str | None, str], AgentRules] = {}
        self._env_files: dict[Path, dict[str, str]] = {}
        self._sandbox: Sandbox | None = None

    # -- signals

    @property
    def stop_reason(self) -> str | None:
        """Why the shift is ending (deadline, task-budget, idle, SIGTERM, ...); None while it runs."""
        return self._stop_reason

    def request_stop(self, reason: str) -> None:
        if self._stop_reason is None:
            self._stop_reason = reason
        self._wake.set()

    def install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: object) -> None:
            self.request_stop(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    # -- the loop

    def run(self) -> ShiftSummary:
        self.preflight()  # before anything is written: a shift whose agents cannot run as asked refuses
        pid = os.getpid()
        session = self.store.open_session(self.lane_name, self.host, pid, process_start_time(pid),
                                          max(1, math.ceil(self.max_seconds)), process_identity(pid))
        self.summary.session = session
        self.session = session
        self.log = self.log.bind(session=str(session))
        self.log.info("shift started", slots=self.slots, seconds=self.max_seconds, host=self.host, pid=pid)
        # `fleet guard` in an agent asks it whether the task's lease still holds (never raises)
        self._guard = GuardServer(self.store, log=self.log)
        self._guard.start()
        # stops the agents before the lease could run out, whatever the main loop is blocked in
        self._fence = Fence(self._fence_agents, term_window=term_window(self.lane.lease_seconds,
                                                                        self.lane.grace_seconds),
                            on_renew=self._fence_supervisors, log=self.log)
        self._fence.start()
        # what this lane's agents run, resolved exactly as a spawn resolves it (`fleet profiles`)
        self.log.info("dispatch", dispatch=banner(self.cfg, self.lane_name),
                      verify=" ".join(self.lane.verify) if self.lane.verify else None)
        self.log.info("what agents see", access=sorted({self.rules(d).describe()
                                                        for d in lane_dispatch(self.cfg, self.lane_name)}))
        self.deadline = time.monotonic() + self.max_seconds
        self.deadline_at = datetime.now(UTC) + timedelta(seconds=self.max_seconds)
        next_heartbeat = time.monotonic()  # at once: the database says how long its lease holds
        try:
            try:
                self._lane_handoff = self.store.last_lane_handoff(self.lane_name)
            except DatabaseUnavailable as exc:
                self.log.warning("could not read the lane's last hand-off", error=str(exc))
            while True:
                self._reap()
                self._retry_pending()
                now = time.monotonic()
                if self._stop_reason is None:
                    if now >= self.deadline:
                        self._stop_reason = "deadline"
                    elif self._budget_left() == 0 and not self._busy():
                        self._stop_reason = "task-budget"
                if self._stop_reason is not None:
                    break
                if now >= next_heartbeat:
                    self._heartbeat()
                    next_heartbeat = now + self.heartbeat_every
                claimed = [] if self._lost else self._claim()
                if self._lost:  # the heartbeat or the claim found the session declared lost
                    self._stop_reason = "session-lost"
                    break
                if self.once and not claimed and not self._busy() and not self._claim_unanswered:
                    self._stop_reason = "idle"
                    break
                if not claimed:
                    self._wake.wait(min(self.poll_seconds, max(0.0, next_heartbeat - time.monotonic())))
                    self._wake.clear()
        finally:
            self._shutdown(self._stop_reason or "error")
        return self.summary

    def _busy(self) -> bool:
        return bool(self.jobs or self.pending or self.batches)

    def _budget_left(self) -> int | None:
        return None if self.max_tasks is None else max(0, self.max_tasks - self.summary.claimed)

    def _claim(self) -> list[Task]:
        if self._claim_unanswered:
            found = self._claimed()
            if found is None:
                return []
            if found:
                self._run_claimed(found)
                return found
        free = self.slots - len(self.jobs) - len(self.pending) - len(self.batches)
        budget = self._budget_left()
        if budget is not None:
            free = min(free, budget)
        if free <= 0:
            return []
        now = time.monotonic()
        busy = len(self.jobs) + len(self.pending) + len(self.batches)
        if not self.once and now < self._next_claim and busy >= self._busy_at_empty:
            return []  # the queue was empty a moment ago and no slot was freed since
        self._compose_batch()
        sent = time.monotonic()
        try:
            tasks = self.store.claim(self.session, free)
        except SessionLost:
            self._lost = True
            return []
        except DatabaseUnavailable as exc:
            self.log.warning("claim failed; will ask what it claimed, then try again", error=str(exc))
            self._claim_unanswered = True
            return []
        self._fence.renewed(sent, self._grant)  # a claim renews the session's lease (before any agent starts)
        if tasks:
            self._claim_delay, self._next_claim = self.poll_seconds, 0.0
        else:
            self._busy_at_empty, self._next_claim = busy, now + self._claim_delay
            self._claim_delay = min(self._claim_delay * 2, max(self.poll_seconds, IDLE_CLAIM_MAX))
        self._run_claimed(tasks)
        return tasks

    def _run_claimed(self, tasks: list[Task]) -> None:
        self.held.update(t.id for t in tasks)
        for task in tasks:
            self.summary.claimed += 1
            try:
                self._start(task)
            finally:
                self.held.discard(task.id)

    def _known(self) -> list[int]:
        """The tasks this shift answers for: running, batches, final calls pending, held."""
        return [*self.jobs, *self.pending, *self.batches, *self.held]

    def _claimed(self) -> list[Task] | None:
        """After a claim without an answer: the tasks it made this session's (fleet.claimed), or
        None while the database does not answer."""
        try:
            tasks = self.store.claimed(self.session, self._known())
        except SessionLost:
            self._lost = True
            return None
        except DatabaseUnavailable as exc:
            self.log.warning("could not ask what the unanswered claim claimed; will try again", error=str(exc))
            return None
        except FleetError as exc:  # refused: the heartbeats name the shift's tasks again, as before
            self.log.error("could not ask what the unanswered claim claimed", error=str(exc))
            tasks = []
        self._claim_unanswered = False
        if tasks:
            self.log.warning("a claim's answer was lost; its tasks found", tasks=[t.id for t in tasks])
        return tasks

    def _compose_batch(self) -> None:
        """A lane with ``batch_size`` (and a ``repo``): make a batch of its ready tasks before the
        claim (fleet.batch_compose, in claim order; none when fewer than two are ready)."""
        if not self.lane.batch_size or not self.lane.repo:
            return
        try:
            batch = self.store.batch_call("batch_compose", {"p_lane": self.lane_name, "p_size": self.lane.batch_size,
                                                            "p_profile": None})
        except FleetError as exc:
            self.log.warning("could not compose a batch", error=str(exc))
            return
        if batch is not None:
            self.log.info("batch composed", batch=batch, size=self.lane.batch_size)

    # -- one task

    def instructions(self) -> str:
        if self._instructions is None:
            path = self.cfg.instructions_path(self.lane_name)
            try:
                self._instructions = path.read_text()
            except OSError:
                self.log.warning("no lane instructions", path=str(path))
                self._instructions = f"# Lane: {self.lane_name}\n"
        return self._instructions

    def _start(self, task: Task) -> None:
        if task.kind == "batch":  # a batch carrier: its members run one after another (worker.shift.batch)
            self.batches[task.id] = BatchRunner(self, task)
            self.log.info("batch claimed", task=task.id, batch=task.batch_id, attempt=task.attempts)
            return
        old = self.jobs.pop(task.id, None)
        if old is not None:
            # the task's lease ended under its agent (a stall, a repair) and the claim handed it back
            # at once: the old attempt ends first, so what it streamed is recorded under its own run
            self._kill(old, old.killed or "lost")
            self._finish(old, old.agent.wait(30))
        log = self.log.bind(task=task.id, key=task.key, attempt=task.attempts)
        ws = self._workspace(task, log)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        log_path = self.workspaces / self.lane_name / "logs" / f"{task.id}-{safe_name(task.key)}-a{task.attempts}-{stamp}.log"
        d = resolve(self.cfg, self.lane_name, task.run_profile, task.tier, task.pool)
        gate_only = task.verify_pending and bool(self.lane.verify)
        # (a task whose earlier runs spent its budget was blocked by the claim: this run's own
        # spend is watched while it streams)
        budget, spent_before = self.task_budget(task, log)
        session = self.resumable(task, d)  # the agent session this attempt resumes, if it can
        if self.lane.repo:
            try:
                head = self._git_worktree(task, ws)
            except FleetError as exc:  # GitError: the repo or the mirror is unreachable, a branch diverged
                from worker.workspace.git import BranchDiverged

                error, lease_ = f"could not prepare the git worktree: {exc}"[:4000], task.lease_token
                assert lease_ is not None
                if isinstance(exc, BranchDiverged):
                    # this host's commits and origin's both hold work: a person decides which to keep
                    # (no attempt is spent on it); `fleet resume` then runs the agent again
                    log.error("blocked: the task's branch diverged from origin", error=str(exc))
                    self._call(task.id, lambda: self.store.block(task.id, lease_, "branch-diverged", error), "blocked")
                    return
                log.error("could not prepare the git worktree", error=str(exc))
                self._call(task.id, lambda: self.store.fail(task.id, lease_, error), "failed")
                return
            log.info("git worktree ready", branch=self._branch(task), head=head[:12])
        try:
            prepare(ws, task, instructions=self.instructions(), lane_handoff=self._lane_handoff,
                    hidden_sets=self.lane.hidden_files, shift_deadline=self.deadline_at)
            files.unlink(ws.root, ws.fleet / WINDOW_CLOSING)  # an earlier attempt's: not this one's
            self._touch_workspace(task, ws)
            env = self.task_env(task, ws, d)
            if gate_only:
                agent = self.start_gate(ws, env, _gate_log(log_path), d)
            else:
                values = {"prompt_file": str(ws.prompt_file), "workspace": str(ws.root),
                          "model": d.model or "", "task_id": str(task.id),
                          "agent_session": session or ""}
                agent = self.agent_process(d.argv(values), cwd=ws.root, env=env, log_path=log_path,
                                           stdin=ws.prompt_file, dispatch=d)
        except ProgramNotFound as exc:
            held = task.lease_token
            assert held is not None
            if gate_only:
                evidence = _cannot_start("verify gate", exc)
                log.error("the verify gate cannot start", error=evidence)
                self._call(task.id, lambda: self.store.gate_verdict(task.id, held, "automation-broken", evidence, None),
                           VERDICT)
            else:
                self._not_started(task, held, _cannot_start("the agent", exc), log)
            return
        except OSError as exc:
            log.error("could not start the agent", error=str(exc))
            error, token = f"could not start {'the verify gate' if gate_only else 'the agent'}: {exc}", task.lease_token
            assert token is not None
            self._call(task.id, lambda: self.store.fail(task.id, token, error), "failed")
            return
        job = Job(task=task, ws=ws, agent=agent, log_path=log_path, started=time.monotonic(), dispatch=d,
                  spent_before=spent_before, budget=budget, reader=ADAPTERS[d.agent].reader(),
                  resumed=bool(session) and not gate_only)
        if gate_only:
            job.gate_until = time.monotonic() + self.lane.verify_timeout
        try:
            cp = ws.read_checkpoint()
        except UnsafeFile:
            cp = None  # (said when the shift would store it: _store_checkpoint)
        if cp is not None:
            job.checkpoint, job.checkpoint_mtime = cp
        self.jobs[task.id] = job
        self._record(job, {"log_path": str(log_path), "model": d.model, "tier": d.tier, "agent": d.agent})
        if gate_only:
            log.info("verify gate started (resumed task: the gate only)", pid=agent.pid, log=str(log_path))
        else:
            log.info("agent started", pid=agent.pid, log=str(log_path), dispatch=d.describe())

    def resumable(self, task: Task, d: Dispatch) -> str | None:
        """The task's agent session, if this attempt can resume it: an agent keeps its sessions on
        the host that ran it (Claude Code under ~/.claude), under the profile (agent, account) it
        ran with. Elsewhere the attempt starts fresh, with the checkpoint, the hand-off and the
        stage history in its prompt."""
        if task.agent_session and task.agent_session_host == self.host and task.agent_session_profile == d.profile:
            return task.agent_session
        return None

    def task_budget(self, task: Task, log: Any) -> tuple[tuple[float | None, int | None], tuple[float, int]]:
        """The task's budget (its own, else the lane's: max cost, max tokens) and what its earlier
        runs spent (cost, tokens; read only when there is a budget)."""
        budget = (float(task.max_cost_usd) if task.max_cost_usd is not None else self.lane.max_cost_usd,
                  task.max_tokens if task.max_tokens is not None else self.lane.max_tokens)
        before = (0.0, 0)
        if budget != (None, None):
            try:
                before = self.store.task_spend(task.id)
            except FleetError as exc:
                log.warning("could not read the task's spend; its budget counts this run only", error=str(exc))
        return budget, before

    def task_env(self, task: Task, ws: Workspace, d: Dispatch, *, attempt: int | None = None,
                 lease: UUID | None = None, **extra: str) -> dict[str, str]:
        """An agent's (or a gate's) environment. ``attempt`` and ``lease``: the task's own unless
        given (a batch member runs under its carrier's claim); ``extra``: more FLEET_* variables."""
        return self.environment(d, task.lease_token if lease is None else lease, **{
            "FLEET_TASK_ID": str(task.id), "FLEET_TASK_KEY": task.key, "FLEET_LANE": self.lane_name,
            "FLEET_ATTEMPT": str(task.attempts if attempt is None else attempt), "FLEET_WORKSPACE": str(ws.root),
            "FLEET_MODEL": d.model or "", "FLEET_TIER": d.tier or "", "FLEET_PROFILE": d.profile or "",
            "FLEET_AGENT_SESSION": self.resumable(task, d) or "",
            **extra,
        })

    def environment(self, d: Dispatch, lease: UUID | None, **task_vars: str) -> dict[str, str]:
        """The environment of whatever the shift runs in a workspace for dispatch ``d`` (an agent, a
        gate, a batch step): an allow-list (worker.agent.executor.agent_env) of the shift's own —
        the base set and the names its lane and profile pass (``agent_env``) — then their
        ``agent_env_file`` values, then ``task_vars`` (FLEET_*) and ``fleet guard``'s for ``lease``.
        CannotConfine (an OSError) if an agent_env_file cannot be used."""
        rules = self.rules(d)
        values = self._env_values(rules)
        path = base_env(os.environ, rules.env, values).get("PATH")
        # the task `fleet guard` asks of, as it picks it (worker.cli.agent_calls): a batch member's
        # lease is its carrier's
        guarded = task_vars.get("FLEET_GUARD_TASK") or task_vars.get("FLEET_TASK_ID")
        # (the guard answers for this lease from now on: FLEET_GUARD_SOCKET, FLEET_LEASE_TOKEN,
        # FLEET_BIN and PATH with `fleet` first on it)
        guard = self._guard.agent_env(int(guarded) if guarded else None, lease,
                                      path if path is not None else os.environ.get("PATH"))
        return agent_env(os.environ, {**task_vars, **guard}, names=rules.env, values=values)

    # -- what agents may see (worker.agent.sandbox)

    def rules(self, d: Dispatch) -> AgentRules:
        """What the agents of dispatch ``d`` may see: its lane's settings and its profile's."""
        key = (d.profile, d.agent)
        if key not in self._rules:
            self._rules[key] = rules_for(self.cfg, self.lane_name, d.profile, d.agent)
        return self._rules[key]

    def preflight(self) -> None:
        """Refuse to start (a ConfigError: one line naming the field and the fix) a shift whose agents
        could not run as their lane asks, before the shift opens its session.

        What only this host's setup decides — an ``agent_env_file`` that is missing, not the shift
        user's or readable by others; a bwrap sandbox this host cannot make — refuses with nothing
        written. What is wrong with the lane's config (worker/preflight.py: its instructions, its
        agent programs on the PATH its agents get, its hidden-file sets) also pauses the lane with
        the reason, so that no shift claims its tasks into the same mistake until ``fleet lanes
        sync`` of a fixed config clears it."""
        paths: dict[str, str | None] = {}
        for d in lane_dispatch(self.cfg, self.lane_name):
            rules = self.rules(d)
            for where, path in rules.env_files:
                self._env_file(where, path)
            if rules.sandbox == "bwrap" and (why := bwrap_problem()) is not None:
                raise ConfigError(*_no_sandbox(self.lane_name, rules, why))
            missing = [name for name in rules.env if name not in os.environ]
            if missing:
                self.log.warning("agent_env names variables the shift's environment does not have",
                                 where=rules.where, missing=missing)
            field = f"profiles.{d.profile}" if d.profile else f"lanes.{self.lane_name}"
            paths.setdefault(field, base_env(os.environ, rules.env, self._env_values(rules)).get("PATH"))
        problems = lane_problems(self.cfg, self.lane_name, host=self.host,
                                 path=lambda where: paths.get(where.rsplit(".", 1)[0], os.environ.get("PATH")))
        why = reason(problems)
        if why is not None:
            self.store.pause_lane(self.lane_name, why)
            self.log.error("lane paused: its config is wrong", reason=why)
            raise ConfigError(f"lane {self.lane_name} paused: {why}", self.cfg.fix_hint())

    def _env_file(self, where: str, path: Path) -> dict[str, str]:
        if path not in self._env_files:
            self._env_files[path] = read_env_file(where, path)
        return self._env_files[path]

    def _env_values(self, rules: AgentRules) -> dict[str, str]:
        """The rules' agent_env_file values (a profile's over its lane's)."""
        values: dict[str, str] = {}
        for where, path in rules.env_files:
            try:
                values.update(self._env_file(where, path))
            except ConfigError as exc:  # a profile only a task named: its attempt fails with the reason
                raise CannotConfine(str(exc)) from None
        return values

    def sandbox(self) -> Sandbox:
        """The bwrap prefix maker of this shift's agents (made at its first use, once the guard runs)."""
        if self._sandbox is None:
            guard: GuardServer | None = getattr(self, "_guard", None)
            sock = guard.socket_path if guard is not None and guard.running else None
            self._sandbox = Sandbox(self.cfg, os.environ, guard_dir=sock.parent if sock is not None else None)
        return self._sandbox

    def start_gate(self, ws: Workspace, env: dict[str, str], gate_log: Path, d: Dispatch) -> AgentProcess:
        """The lane's verify gate in the workspace, under a supervisor like an agent (it dies with
        the shift; in the agent's sandbox, since it runs the agent's work), writing to ``gate_log``."""
        assert self.lane.verify is not None
        argv = render_argv(self.lane.verify, {"workspace": str(ws.root), "task_id": env["FLEET_TASK_ID"],
                                              "model": env["FLEET_MODEL"], "prompt_file": str(ws.prompt_file),
                                              "agent_session": env["FLEET_AGENT_SESSION"]})
        return self.agent_process(argv, cwd=ws.root, env={**env, "FLEET_GATE": "1"}, log_path=gate_log, dispatch=d,
                                  label="verify gate")

    def agent_process(self, argv: list[str], *, cwd: Path, env: dict[str, str], log_path: Path,
                      dispatch: Dispatch, stdin: Path | None = None, label: str = "the agent") -> AgentProcess:
        """Start an agent (or a gate, or a batch step) of ``dispatch`` under its supervisor, which is
        told at once when this shift's lease could run out (see worker/shift/fence.py); in a bwrap
        sandbox when its rules say so (OSError when it cannot be: the program is not found, or
        CannotConfine, bwrap cannot run)."""
        rules = self.rules(dispatch)
        prefix: list[str] = []
        if rules.sandbox == "bwrap":
            why = bwrap_problem()
            if why is not None:
                raise CannotConfine(" ".join(_no_sandbox(self.lane_name, rules, why)))
            name = argv[0] if os.path.isabs(argv[0]) or os.sep not in argv[0] else str(cwd / argv[0])
            program = shutil.which(name, path=env.get("PATH", os.defpath))
            if program is None:
                raise ProgramNotFound(2, "not found on the PATH it gets", argv[0])
            from worker.workspace.git import agent_binds

            mirror = self.mirror() if self.lane.repo else None
            # the mirror read-write but for its control files, the worktree's .git (read-only)
            writable, protect = ([], []) if mirror is None else agent_binds(mirror, cwd)
            prefix = self.sandbox().argv(rules, cwd, program=program, writable=writable,
                                         secret=[mirror.origin_url_file] if mirror else [], protect=protect)
        proc = AgentProcess(argv, cwd=cwd, env=env, log_path=log_path, stdin=stdin, sandbox=prefix, label=label)
        if self._fence.term_at is not None and self._fence.kill_at is not None:
            proc.fence(self._fence.term_at, self._fence.kill_at)
        return proc

    # -- git workspaces

    def mirror(self) -> Mirror:
        """This host's mirror of the lane's repository (made at the first use)."""
        from worker.workspace.git import Mirror

        if self._git_mirror is None:
            assert self.lane.repo is not None
            # hidden files never get committed: the mirror's shared info/exclude lists them
            excludes = ["/.fleet/"] + [f"/.{name}/" for name in self.lane.hidden_files if name != "fleet"]
            self._git_mirror = Mirror(self.cfg.path(self.cfg.fleet.git_cache), self.lane.repo, excludes=tuple(excludes))
        return self._git_mirror

    def _branch(self, task: Task) -> str:
        from worker.workspace.git import branch_name

        return branch_name(self.lane_name, task.key)

    def _git_worktree(self, task: Task, ws: Workspace) -> str:
        """The task's worktree on its branch: cut from the lane's base at the first claim, reused
        (commits kept) by later attempts on this host, recreated from the pushed branch on another."""
        from worker.workspace.git import ensure_task_worktree

        with self.keepalive():
            return str(ensure_task_worktree(self.mirror(), ws.root, self._branch(task), self.lane.base))

    def _git_push(self, job: Job, *, commit_wip: bool) -> None:
        """Push the task's branch so another host can continue from it (at a hand-off, uncommitted
        work is committed first as a work-in-progress commit). Best effort: logged, never fatal."""
        if not self.lane.repo:
            return
        from worker.workspace.git import commit_all, push

        self.held.add(job.task.id)  # its agent has ended: its final call comes after the push
        try:
            with self.keepalive():
                if commit_wip:
                    commit_all(self.mirror(), job.ws.root,
                               f"lanefleet: work in progress of {job.task.key} at hand-off (attempt {job.task.attempts})")
                sha = push(self.mirror(), self._branch(job.task))
            self.log.info("branch pushed", task=job.task.id, branch=self._branch(job.task), head=str(sha)[:12])
        except FleetError as exc:
            self.log.warning("could not push the task's branch", task=job.task.id, error=str(exc))
        finally:
            self.held.discard(job.task.id)

    @contextmanager
    def keepalive(self) -> Iterator[None]:
        """Heartbeat from a thread while the main loop waits on git (a fetch of a large repository,
        another shift's hold on this host's mirror: minutes, past a lease), so that the other
        agents' leases, the session's and the tasks it holds (:attr:`held`) are renewed meanwhile.
        The main loop is parked here: the thread has the shift's state to itself."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.heartbeat_every):
                self._heartbeat()

        thread = threading.Thread(target=beat, name="lanefleet-keepalive", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _workspace(self, task: Task, log: Any) -> Workspace:
        """The task's directory on this host: the one its row names (a workspace made under an
        older naming keeps being used), else a new ``<slug>-<hash>``. Best effort: without an
        answer from the database, the new name."""
        recorded = None
        if task.lease_token is not None:
            try:
                recorded = self.store.task_workspace(task.id, task.lease_token, self.host)
            except Exception as exc:  # the lookup never costs the attempt (its touch records the path)
                log.warning("could not look up the task's workspace", error=str(exc))
        return resolve_workspace(self.workspaces, self.lane_name, task.key, recorded)

    def _touch_workspace(self, task: Task, ws: Workspace) -> None:
        """Record the task's workspace on this host with its size (fleet.workspaces), at the start
        and the end of an attempt. Best effort: a failure is logged, never fatal."""
        if task.lease_token is None:
            return
        try:
            use = disk_use(ws.root, max_seconds=0.5)
            self.store.touch_workspace(task.id, task.lease_token, self.host, os.path.abspath(ws.root), use.bytes)
        except Exception as exc:  # the workspace record never costs the attempt
            self.log.warning("could not record the workspace", task=task.id, error=str(exc))

    def _record(self, job: Job, report: dict[str, Any]) -> None:
        try:
            self.store.record_run(job.token, {k: v for k, v in report.items() if v is not None})
        except FleetError as exc:
            self.log.warning("could not record the run", task=job.task.id, error=str(exc))

    def count(self, outcome: str) -> None:
        self.summary.outcomes[outcome] = self.summary.outcomes.get(outcome, 0) + 1

    def _call(self, task_id: int, fn: Callable[[], str], outcome: str, *, retry: bool = False,
              refused: Callable[[FleetError], Callable[[], str]] | None = None) -> str | None:
        """Make one fenced final call. A lost lease is logged, not raised; a connection failure
        leaves the call pending, to be made again (the lease stays ours meanwhile: the
        heartbeat names the task). A call the database refuses is the task's problem, never the
        shift's: ``refused(error)`` is the call made instead (a failure that says why), else it is
        logged and the task, no longer named by a heartbeat, goes back to the queue."""
        try:
            state = fn()
        except LeaseLost as exc:
            if retry:  # the first try may have committed before its connection broke
                self.log.info("pending call answered: lease already gone", task=task_id, error=str(exc))
            else:
                self.log.warning("lease lost; result dropped", task=task_id, error=str(exc))
            self.count("lease_lost")
            return None
        except DatabaseUnavailable as exc:
            self.log.warning("final call failed; will retry", task=task_id, outcome=outcome, error=str(exc))
            self.pending[task_id] = (fn, outcome)
            return None
        except FleetError as exc:
            if refused is not None:  # said here: the caller hears None, as for any call not made
                instead = self._call(task_id, refused(exc), "failed", retry=retry)
                self.log.warning("final call refused by the database: the attempt failed instead", task=task_id,
                                 outcome=outcome, error=str(exc), state=instead)
                return None
            self.log.error("final call refused by the database", task=task_id, outcome=outcome, error=str(exc))
            self.count("refused")
            return None
        self.count(_COUNT_BY_STATE.get(str(state), "failed") if outcome == VERDICT else outcome)
        return str(state)

    def _retry_pending(self) -> None:
        for task_id, (fn, outcome) in list(self.pending.items()):
            del self.pending[task_id]
            if self._call(task_id, fn, outcome, retry=True) is not None:
                self.log.info("pending call made", task=task_id, outcome=outcome)

    def _store_checkpoint(self, job: Job) -> None:
        try:
            cp = job.ws.read_checkpoint()
        except UnsafeFile as exc:  # a link, a FIFO, more than READ_LIMIT: said once per version of it
            seen = (job.ws.mtime(job.ws.checkpoint_file) or 0.0, None)
            if job.refused_checkpoint != seen:
                self.log.warning("checkpoint not read", task=job.task.id, error=exc.strerror)
                job.refused_checkpoint = seen
            return
        if cp is None:
            return
        data, mtime = cp
        if (mtime, data) in ((job.checkpoint_mtime, job.checkpoint), job.refused_checkpoint):
            return
        try:
            seq = self.store.checkpoint(job.task.id, job.token, data)
        except LeaseLost:
            self._kill(job, "lost")
            return
        except DatabaseUnavailable as exc:
            self.log.warning("checkpoint not stored yet", task=job.task.id, error=str(exc))
            return
        except FleetError as exc:  # the agent's file (a checkpoint of null): sent again when it changes
            self.log.warning("checkpoint refused", task=job.task.id, error=str(exc))
            job.refused_checkpoint = (mtime, data)
            return
        job.checkpoint, job.checkpoint_mtime = data, mtime
        self.log.info("checkpoint stored", task=job.task.id, seq=seq)

    def _kill(self, job: Job, why: str) -> None:
        if job.killed is None:
            job.killed = why
            job.agent.kill()
            self.log.warning("agent killed", task=job.task.id, reason=why)

    def _reap(self) -> None:
        for task_id, runner in list(self.batches.items()):
            runner.step()
            if runner.done:
                del self.batches[task_id]
        for task_id, job in list(self.jobs.items()):
            if job.gate_until is None:
                job.reader.read(job.log_path)
                self._check_budget(job)
                self._check_windows(job)
            code = job.agent.poll()
            timed_out = False
            if code is None and job.gate_until is not None and time.monotonic() > job.gate_until \
                    and job.killed is None and not job.stopping:
                job.agent.kill()  # a gate past its timeout: automation-broken
                job.agent.wait(10)
                code, timed_out = job.agent.poll(), True
            if code is None:
                continue
            del self.jobs[task_id]
            if job.gate_until is not None:
                self._finish_gate(job, code, timed_out=timed_out)
            else:
                self._finish(job, code)

    def _check_budget(self, job: Job) -> None:
        if job.over_budget is not None or job.killed is not None or job.budget == (None, None):
            return
        cost, tokens = spent(job.reader.reading(), job.dispatch.model, self.cfg.prices)
        over = over_budget(job.budget, job.spent_before[0] + cost, job.spent_before[1] + tokens)
        if over is not None:
            job.over_budget = over
            job.agent.kill()
            self.log.warning("budget crossed: agent stopped", task=job.task.id, spent=over)

    def _check_windows(self, job: Job) -> None:
        """A usage window near its end: tell the agent once (it checkpoints and exits 75)."""
        windows = job.reader.reading().windows
        if job.window_closing is not None or job.killed is not None or job.stopping \
                or len(windows) == job.windows_seen:
            return
        job.windows_seen = len(windows)
        window = closing_window(windows, WINDOW_HANDOFF_UTILIZATION)
        if window is None:
            return
        asked = {
            "window": window.window, "utilization": window.utilization,
            "resets_at": window.resets_at.isoformat() if window.resets_at is not None else None,
            "asked_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        try:
            write_atomic(job.ws.root, job.ws.fleet / WINDOW_CLOSING, json.dumps(asked))
        except OSError as exc:  # tried again at the next reading
            self.log.warning("could not ask the agent to hand off before its window closes", task=job.task.id,
                             error=str(exc))
            return
        job.window_closing = asked
        self.log.info("usage window closing: the agent is asked to hand off", task=job.task.id,
                      provider=window.provider, window=window.window, status=window.status,
                      utilization=window.utilization, resets_at=asked["resets_at"])

    def _snapshot(self, job: Job, reason: str, code: int | None, agent_session: str | None) -> dict[str, Any]:
        return {
            "reason": reason, "attempt": job.task.attempts, "exit_code": code,
            "ran_seconds": round(time.monotonic() - job.started, 1),
            "checkpoint": job.checkpoint, "agent_session": agent_session or job.task.agent_session,
            "log_path": str(job.log_path), "log_tail": tail(job.log_path, 1500),
            "shift_session": str(self.session), "host": self.host,
        }

    def _stopping(self, job: Job) -> bool:
        """Whether the shift is stopping ``job``'s agent: it told it to, or a stop was asked
        (the signal that stops a shift under systemd reaches its agents too, and one may end of
        it before the shift tells them)."""
        return job.stopping or self._stop_reason is not None

    def _finish(self, job: Job, code: int) -> None:
        # stopped by its supervisor at the fence's moment while this shift could not act (frozen,
        # stalled): that is the fence's doing, not a failed attempt
        job.fenced = job.fenced or job.agent.fence_passed()
        job.agent.release()
        task = job.task
        log = self.log.bind(task=task.id, key=task.key, attempt=task.attempts, exit_code=code)
        reading = job.reader.read_all(job.log_path)  # what it streamed, and its end-of-run record
        report: dict[str, Any] = {**run_report(reading, self._own_tokens(job, reading), job.dispatch.model,
                                               self.cfg.prices),
                                  "exit_code": code, "log_path": str(job.log_path)}
        if reading.session_missing is not None and job.resumed:
            report.pop("agent_session", None)  # a new id the agent made up for a session it could not find
        if code != 0:
            report["error_tail"] = tail(job.log_path, 2000)
        reading.windows += session_windows(job.dispatch.agent, reading, job.ws.root)
        if reading.windows:  # the provider's last word on each usage window (fleet.pool_windows)
            report["windows"] = [w.report() for w in latest_windows(reading.windows)]
        self._record(job, report)  # tokens count even when the lease is gone
        if job.killed is not None:
            log.info("agent ended after its lease was gone", reason=job.killed)
            self.count(job.killed)
            return
        self._store_checkpoint(job)
        if job.killed is not None:  # the checkpoint found the lease gone
            log.info("agent ended after its lease was gone", reason=job.killed)
            self.count(job.killed)
            return
        self._touch_workspace(task, job.ws)  # while the lease still holds: before the final call
        tid, token = task.id, job.token
        if job.over_budget is not None:
            over = job.over_budget
            state = self._call(tid, lambda: self.store.block(tid, token, "budget", over), "blocked")
            log.warning("blocked: the run crossed the task's budget", spent=over, state=state)
            return
        stopping = self._stopping(job)
        if code == EX_TEMPFAIL or ((stopping or job.fenced) and code != 0):
            why = ("window-closing" if code == EX_TEMPFAIL and job.window_closing is not None
                   else "agent asked to hand off (exit 75)" if code == EX_TEMPFAIL
                   else "stopped before the shift's lease could run out (it could not be renewed in time)"
                   if job.fenced and not stopping else f"shift ended ({self._stop_reason})")
            snap = self._snapshot(job, why, code, reading.session_id)
            if why == "window-closing":
                snap["window_closing"] = job.window_closing
            self._git_push(job, commit_wip=True)
            state = self._call(tid, lambda: self.store.hand_off(tid, token, snap), "handed_off")
            if state is not None:  # else _call said why (refused, or pending)
                log.info("handed off", state=state)
            return
        if code == CANNOT_START and not reading.final:
            # "command not found": the agent never ran, so no attempt is spent; the lane pauses
            said = cannot_start_line(tail(job.log_path, 2000))
            self._not_started(task, token, f"{said} (exit {code})" if said else
                              f"the agent {job.agent.argv[0]!r} exited {code} (command not found)", log)
            return
        profile = self.cfg.profiles.get(job.dispatch.profile) if job.dispatch.profile else None
        verdict = judge(reading, code, profile, tail(job.log_path, 4000, whole_lines=True), resumed=job.resumed)
        if verdict.kind == "throttled":
            # never a success, never a spent attempt: the pool pauses, the task waits for the reset
            limit = verdict.limit
            assert limit is not None
            until = self._call(tid, lambda: str(self.store.throttle(tid, token, limit.until, limit.note,
                                                                    limit.after_seconds, limit.signal_report())),
                               "throttled")
            log.warning("usage limit: pool throttled, task requeued for after the reset",
                        pool=task.pool, until=until, signal=limit.signal, note=limit.note)
        elif verdict.kind == "transient":
            state = self._call(tid, lambda: self.store.transient(tid, token, verdict.why), "transient")
            log.warning("provider error: retried without spending an attempt", state=state, error=verdict.why[:300])
        elif verdict.kind == "session_dropped":
            missing = verdict.why
            state = self._call(tid, lambda: self.store.drop_session(tid, token, missing), "session_dropped")
            log.warning("the agent could not resume its session: the next attempt starts fresh", state=state,
                        note=missing[:300])
        elif verdict.kind == "failed":
            state = self._call(tid, lambda: self.store.fail(tid, token, verdict.why, reason="unverified-exit"), "failed")
            log.info("attempt failed", state=state, error=verdict.why[:300])
        elif self.lane.require_result and not reading.final:
            error = "unverified exit: exit 0 without a result record"
            state = self._call(tid, lambda: self.store.fail(tid, token, error, reason="unverified-exit"), "failed")
            log.info("attempt failed: unverified exit", state=state)
        elif self.lane.verify and job.ws.read_route() is None:
            # exit 0: the gate decides; the job keeps its slot while the gate runs
            try:
                job.agent = self.start_gate(job.ws, self.task_env(task, job.ws, job.dispatch),
                                             _gate_log(job.log_path), job.dispatch)
            except OSError as exc:
                self._end_gate(job, "automation-broken", _cannot_start("verify gate", exc))
                return
            job.gate_until = time.monotonic() + self.lane.verify_timeout
            job.result = reading
            self.jobs[tid] = job
            log.info("verify gate started", pid=job.agent.pid)
        else:
            route = job.ws.read_route()
            if route is not None and "error" in route:
                error = str(route["error"])
                state = self._call(tid, lambda: self.store.fail(tid, token, error), "failed")
                log.info("attempt failed: bad route file", state=state)
            elif route is not None:
                target, note = str(route["lane"]), route.get("note")
                # an unknown lane, a refused route: the agent's mistake, a failed attempt
                state = self._call(tid, lambda: self.store.route(tid, token, target, note), "routed",
                                   refused=lambda exc: lambda: self.store.fail(
                                       tid, token, f"route to {target!r} refused: {exc}"))
                if state is not None:  # else _call said why (refused, or pending)
                    log.info("routed", to=target, state=state)
            else:
                res = _result(reading, report)
                self._git_push(job, commit_wip=False)  # the work, where other hosts and people see it
                state = self._call(tid, lambda: self.store.complete(tid, token, res), "done")
                if state is not None:  # else _call said why (refused, or pending)
                    log.info("done", state=state)

    def _not_started(self, task: Task, token: UUID, why: str, log: Any) -> None:
        """The task's agent program could not start on this host: the task goes back unspent and its
        lane is paused with the reason (fleet.cannot_start), which stops this shift's claims too."""
        error = f"lanes.{self.lane_name}: {why} on host {self.host}"
        state = self._call(task.id, lambda: self.store.cannot_start(task.id, token, error), "not_started")
        log.error("the agent cannot start: task handed back unspent, lane paused", error=error, state=state)

    def _own_tokens(self, job: Job, reading: Reading) -> Tokens:
        """The run's own tokens: a CLI that reports its session's running total (Codex across
        `exec resume`) less what the earlier runs of that session recorded."""
        if not (reading.session_total and job.resumed and reading.session_id):
            return reading.tokens
        try:
            earlier = [r for r in self.store.task_runs(job.task.id)
                       if r.agent_session == reading.session_id and r.attempt < job.task.attempts]
        except FleetError as exc:
            self.log.warning("could not read the session's earlier runs; counting its running total",
                             task=job.task.id, error=str(exc))
            return reading.tokens
        before = Tokens(sum(r.input_tokens for r in earlier), sum(r.cache_creation_tokens for r in earlier),
                        sum(r.cache_read_tokens for r in earlier), sum(r.output_tokens for r in earlier),
                        sum(r.reasoning_tokens for r in earlier))
        return reading.tokens.minus(before)

    def _finish_gate(self, job: Job, code: int, *, timed_out: bool = False) -> None:
        job.fenced = job.fenced or job.agent.fence_passed()
        job.agent.release()
        if job.killed is not None:
            self.log.info("gate ended after its lease was gone", task=job.task.id, reason=job.killed)
            self.count(job.killed)
            return
        self._touch_workspace(job.task, job.ws)
        stopping = self._stopping(job)
        if (stopping or job.fenced) and code != 0:  # stopped under the gate: the next shift re-runs it
            why = ("stopped during the verify gate before the shift's lease could run out" if job.fenced
                   and not stopping else f"shift ended during the verify gate ({self._stop_reason})")
            self._hand_off_to_gate(job, why, job.result, code)
            return
        outcome, evidence = classify_gate(code, tail(job.agent.log_path, 8000), timed_out=timed_out)
        self._end_gate(job, outcome, evidence)

    def _hand_off_to_gate(self, job: Job, why: str, reading: Reading | None, code: int) -> None:
        """Hand off work the agent finished (exit 0) that its gate has not judged: committed and
        pushed as at any hand-off, and marked so that the next attempt runs the gate only
        (``verify_pending``), on the agent session that did the work."""
        snap = self._snapshot(job, why, code, reading.session_id if reading is not None else None)
        snap["verify_pending"] = True
        self._git_push(job, commit_wip=True)
        tid, token = job.task.id, job.token
        state = self._call(tid, lambda: self.store.hand_off(tid, token, snap), "handed_off")
        if state is not None:
            self.log.info("handed off before its verify gate judged the work", task=tid, state=state, why=why)

    def _end_gate(self, job: Job, outcome: str, evidence: str) -> None:
        """Report the gate's outcome; fleet.gate_verdict decides what it does to the task (ok: done;
        task-failed: a failed attempt that escalates; could not judge: blocked)."""
        task, tid, token = job.task, job.task.id, job.token
        log = self.log.bind(task=tid, key=task.key, attempt=task.attempts, gate=outcome)
        self._record(job, {"gate": outcome})
        res: dict[str, Any] | None = None
        if outcome == "ok":  # passed work is pushed before it counts as done, where others see it
            result = job.result
            res = _result(result, None) if result is not None else {"summary": None}
            self._git_push(job, commit_wip=False)
        state = self._call(tid, lambda: self.store.gate_verdict(tid, token, outcome, evidence, res), VERDICT)
        log.info("the verify gate judged the work", state=state, evidence=evidence[-300:])

    # -- heartbeat

    def _progress(self) -> tuple[list[int], dict[int, str]]:
        """The jobs whose agent made progress since the last heartbeat (its log grew, a hook touched
        ``.fleet/progress``, its checkpoint changed; a running gate counts), and the agents waiting
        on a question or a permission prompt (``.fleet/attention.json``, the Notification hook's)."""
        progressed: list[int] = []
        attention: dict[int, str] = {}
        for task_id, job in self.jobs.items():
            marks = progress_marks(job.agent.log_path, job.ws)
            if marks != job.progress_marks or job.gate_until is not None:
                progressed.append(task_id)
                job.progress_marks = marks
            waiting = waiting_for(job.ws)
            if waiting:
                attention[task_id] = waiting
        return progressed, attention

    def _heartbeat(self) -> None:
        progressed, attention = self._progress()
        try:
            progressed += [tid for tid, runner in self.batches.items() if runner.progressed()]
            attention.update({tid: w for tid, runner in self.batches.items() if (w := runner.attention())})
            sent = time.monotonic()
            # (none named while a claim is unanswered: what it claimed is held, not released)
            statuses = self.store.heartbeat(self.session, None if self._claim_unanswered else self._known(),
                                            progressed, attention)
        except SessionLost as exc:
            self.log.error("session lost: stopping every agent", error=str(exc))
            self._lost = True
            for job in self.jobs.values():
                self._kill(job, "lost")
            for runner in self.batches.values():
                runner.lease_gone("lost")
            return
        except DatabaseUnavailable as exc:
            self.log.warning("heartbeat failed; will try again", error=str(exc),
                             lease_left=_rounded(self._fence.remaining()))
            return
        except FleetError as exc:  # never the shift's end: the fence stops the agents if it lasts
            self.log.error("heartbeat refused; will try again", error=str(exc),
                           lease_left=_rounded(self._fence.remaining()))
            return
        if statuses.valid_for is not None:
            self._grant = statuses.valid_for
            self.heartbeat_every = max(0.5, min(self.heartbeat_every, statuses.valid_for / 3))
            self._fence.renewed(sent, statuses.valid_for)
        for task_id, job in self.jobs.items():
            status = statuses.get(task_id, "lost")
            if status != "ok":
                self._kill(job, status)
            else:
                self._store_checkpoint(job)
        for task_id, runner in self.batches.items():
            status = statuses.get(task_id, "lost")
            if status != "ok":
                runner.lease_gone(status)

    def _fence_agents(self, stage: str, first: bool) -> None:
        """The fence's order (from its thread): 'term' asks every agent to stop (once), 'kill' kills
        them. Their jobs are handed off when they exit; batches hand their carrier off."""
        for job in _values(self.jobs):
            job.fenced = True
            if stage == "kill":
                job.agent.kill()
            elif first:
                job.agent.terminate()
        for runner in _values(self.batches):
            if stage == "kill":
                runner.kill()
            elif first:
                runner.stop()

    def _fence_supervisors(self, term_at: float, kill_at: float) -> None:
        """A renewal: every agent's supervisor hears when to stop it unless renewed again."""
        for job in _values(self.jobs):
            job.agent.fence(term_at, kill_at)
        for runner in _values(self.batches):
            if runner.running is not None:
                runner.running.proc.fence(term_at, kill_at)

    # -- the end of the shift

    def _give_back_unanswered_claim(self) -> None:
        """The shift ends with a claim unanswered: what it claimed goes back to the queue at once,
        as a transient error (its answer lost on the way says nothing about the work: no failure,
        no evaporation), not released by close_session at the cost of an attempt."""
        why = "the claim's answer was lost on the way and the shift ended before it could start the task"

        def give_back(task_id: int, token: UUID) -> Callable[[], str]:
            return lambda: self.store.transient(task_id, token, why, 0.0)

        for task in self._claimed() or []:
            assert task.lease_token is not None
            self.summary.claimed += 1
            self._call(task.id, give_back(task.id, task.lease_token), "transient")

    def _shutdown(self, reason: str) -> None:
        self.summary.reason = reason
        self.log.info("shift ending", reason=reason, running=len(self.jobs))
        if self._busy() and not self._lost:
            for job in self.jobs.values():
                job.stopping = True
                job.agent.terminate()
            for runner in self.batches.values():
                runner.stop()
            grace_end = time.monotonic() + self.lane.grace_seconds
            next_heartbeat = time.monotonic() + self.heartbeat_every
            while self._busy() and time.monotonic() < grace_end:
                self._reap()
                self._retry_pending()
                if time.monotonic() >= next_heartbeat:  # keep the leases through the grace period
                    self._heartbeat()
                    next_heartbeat = time.monotonic() + self.heartbeat_every
                time.sleep(0.05)
        for job in self.jobs.values():
            job.stopping = True
            job.agent.kill()
        for runner in list(self.batches.values()):
            runner.kill()
            if runner.running is not None:
                try:
                    runner.running.proc.wait(10)
                except Exception:
                    self.log.error("supervisor did not exit", task=runner.task.id, pid=runner.running.proc.pid)
        for job in list(self.jobs.values()):
            try:
                job.agent.wait(10)
            except Exception:
                self.log.error("supervisor did not exit", task=job.task.id, pid=job.agent.pid)
        self._reap()
        self._retry_pending()
        if self._claim_unanswered and not self._lost:
            self._give_back_unanswered_claim()
        if self.pending:  # close_session releases them (each counts as an evaporation)
            self.log.error("final calls never answered", tasks=sorted(self.pending))
        self.summary.exit_code = EXIT_SESSION_LOST if self._lost else EXIT_OK
        try:
            notes = {"reason": reason, "host": self.host, "pid": os.getpid(), "slots": self.slots,
                     "claimed": self.summary.claimed, "outcomes": self.summary.outcomes}
            self.summary.lane_handoff = self.store.close_session(self.session, reason, notes)
            handoff = self.store.last_lane_handoff(self.lane_name)
            if handoff is not None and handoff.id == self.summary.lane_handoff:
                self.summary.handoff_file = write_lane_handoff(self.workspaces / self.lane_name / "handoffs",
                                                               handoff)
        except FleetError as exc:
            self.log.error("could not close the session", error=str(exc))
        self.log.info("shift ended", reason=reason, claimed=self.summary.claimed, **self.summary.outcomes)
        self._fence.stop()
        self._guard.stop()  # last: an agent's `fleet guard` now finds no shift, and refuses


def closing_window(windows: list[WindowReading], threshold: float) -> WindowReading | None:
    """The first window whose last reading says it is near its end: ``allowed_warning``, or
    utilisation at ``threshold`` or more (a rejected one is the throttle's, not a hand-off's)."""
    for w in latest_windows(windows):
        if w.status == "rejected":
            continue
        if w.status == "allowed_warning" or (w.utilization is not None and w.utilization >= threshold):
            return w
    return None


def _no_sandbox(lane: str, rules: AgentRules, why: str) -> tuple[str, str]:
    """The one-line refusal of an agent that asks for a sandbox this host cannot make, and its fix."""
    field = rules.sandbox_from if rules.sandbox_from.endswith(".sandbox") else None
    section = field.rsplit(".", 1)[0] if field else f"lanes.{lane}"
    asked = f"{field} = \"bwrap\"" if field else rules.sandbox_from
    return (f"lanes.{lane}: its agents ({rules.where}) run in a bwrap sandbox ({asked}), but {why}; "
            "they are not started unsandboxed",
            f"install bubblewrap, e.g. apt-get install bubblewrap, or set sandbox = \"none\" in [{section}]")


def _cannot_start(label: str, exc: OSError) -> str:
    """One line: what could not be started (``label``: the agent, verify gate) and why."""
    program = exc.filename if exc.filename is not None else "?"
    return f"{label} {str(program)!r} cannot start: {exc.strerror or exc}"


def _values(d: dict[int, Any]) -> list[Any]:
    """The values of a dict the main loop may change meanwhile (from another thread)."""
    while True:
        try:
            return list(d.values())
        except RuntimeError:  # pragma: no cover - changed size during the copy
            continue


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _gate_log(log_path: Path) -> Path:
    """The verify gate's log beside its run's."""
    return log_path.with_name(log_path.stem + "-gate.log")


def lane_handoff_markdown(h: LaneHandoff) -> str:
    c, t = h.counts, h.tokens
    lines = [
        f"# Lane hand-off: {h.lane}", "",
        f"- session: `{h.session_id}`",
        f"- window: {h.window_start:%Y-%m-%d %H:%M:%S} → {h.window_end:%H:%M:%S} UTC ({h.end_reason})",
        f"- runs: {c.get('runs', 0)} — done {c.get('done', 0)}, failed {c.get('failed', 0)}, "
        f"handed off {c.get('handed_off', 0)}, routed {c.get('routed', 0)}, lost {c.get('lost', 0)}, "
        f"cancelled {c.get('cancelled', 0)}",
        f"- tokens: input {t.get('input', 0)}, cache creation {t.get('cache_creation', 0)}, "
        f"cache read {t.get('cache_read', 0)}, output {t.get('output', 0)}; cost ${h.cost_usd:.4f}",
    ]
    for label, ids in (("completed", h.completed), ("failed", h.failed), ("handed off", h.handed_off)):
        if ids:
            lines.append(f"- {label}: {', '.join(str(i) for i in ids)}")
    if h.queue_head:
        lines += ["", "## Head of the queue", ""]
        for q in h.queue_head:
            # (hand-offs written before the column was renamed call it "resume")
            flag = " (carried over)" if q.get("carry_over", q.get("resume")) else ""
            lines.append(f"- {q.get('id')} `{q.get('key')}` priority {q.get('priority')}{flag}")
    if h.notes:
        lines += ["", "## Notes", "", "```json", json.dumps(h.notes, indent=2, default=str), "```"]
    return "\n".join(lines) + "\n"


def write_lane_handoff(folder: Path, h: LaneHandoff) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{h.window_end:%Y%m%dT%H%M%S}-{h.session_id}.md"
    path.write_text(lane_handoff_markdown(h))
    return path


def _result(reading: Reading, report: dict[str, Any] | None) -> dict[str, Any]:
    """A completed task's ``result``: the agent's final message, session and cost."""
    if not reading.final:
        return {"summary": None}
    cost = report["cost_usd"] if report is not None else reading.cost_usd
    return {"summary": reading.summary, "agent_session": reading.session_id, "cost_usd": cost}
