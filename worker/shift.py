"""A lane shift (DESIGN §6): what cron runs as ``fleet shift --lane L``.

One session, a bounded life: claim up to the free slots, run an agent per task, heartbeat every
lease/3 (one call renews every lease of the session), store the agents' checkpoints, collect
results; at the deadline, the task budget, an idle queue (``--once``) or SIGTERM/SIGINT: stop
claiming, give running agents a grace period (SIGTERM, then SIGKILL), hand off what is
unfinished with a snapshot, write the lane hand-off and close the session.

Python only carries: every decision about a task's state is a ``fleet.*`` call. A heartbeat that
says ``lost`` or ``cancelled`` kills that agent at once and nothing more is written for the task
except its run's token count (the tokens were spent either way).
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import structlog

from worker.config import FleetConfig, LaneConfig
from worker.errors import DatabaseUnavailable, FleetError, LeaseLost, SessionLost
from worker.executor import (
    EX_TEMPFAIL,
    AgentProcess,
    agent_env,
    parse_result,
    read_lines,
    render_argv,
    tail,
)
from worker.models import LaneHandoff, Task
from worker.proc import process_start_time
from worker.store import Store
from worker.workspace import Workspace, prepare, safe_name, workspace_for

EXIT_OK = 0
EXIT_SESSION_LOST = 3


@dataclass
class Job:
    task: Task
    ws: Workspace
    agent: AgentProcess
    log_path: Path
    started: float
    killed: str | None = None  # 'lost' | 'cancelled': the lease is gone, write nothing more
    stopping: bool = False  # the shift is ending and asked this agent to stop
    checkpoint_mtime: float | None = None
    checkpoint: Any = None

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


def configure_logging(json_logs: bool | None = None) -> None:
    """structlog: JSON lines when stderr is not a terminal, readable lines when it is."""
    import sys

    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    renderer: Any = structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True), renderer],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


class Shift:
    def __init__(self, store: Store, cfg: FleetConfig, lane: str, *, max_seconds: float | None = None,
                 max_tasks: int | None = None, slots: int | None = None, once: bool = False,
                 poll_seconds: float = 0.5, host: str | None = None) -> None:
        self.store = store
        self.cfg = cfg
        self.lane_name = lane
        self.lane: LaneConfig = cfg.lane(lane)
        self.max_seconds = max_seconds if max_seconds is not None else self.lane.shift_minutes * 60
        self.max_tasks = max_tasks
        self.slots = slots or self.lane.shift_slots()
        self.once = once
        self.poll_seconds = poll_seconds
        self.host = host or socket.gethostname()
        self.heartbeat_every = max(0.5, self.lane.lease_seconds / 3)
        self.workspaces = cfg.path(cfg.fleet.workspaces)
        self.jobs: dict[int, Job] = {}
        # final calls (complete, fail, ...) that hit a connection failure: retried each loop until
        # answered; a retry is safe because the lease token fences it. Each keeps its slot busy.
        self.pending: dict[int, tuple[Callable[[], str], str]] = {}
        self.summary = ShiftSummary()
        self._stop_reason: str | None = None
        self._wake = threading.Event()
        self._lost = False
        self.log = structlog.get_logger("lanefleet.shift").bind(lane=lane)
        self._instructions: str | None = None
        self._lane_handoff: LaneHandoff | None = None

    # -- signals

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
        pid = os.getpid()
        session = self.store.open_session(self.lane_name, self.host, pid, process_start_time(pid),
                                          max(1, math.ceil(self.max_seconds)))
        self.summary.session = session
        self.session = session
        self.log = self.log.bind(session=str(session))
        self.log.info("shift started", slots=self.slots, seconds=self.max_seconds, host=self.host, pid=pid)
        self.deadline = time.monotonic() + self.max_seconds
        self.deadline_at = datetime.now(UTC) + timedelta(seconds=self.max_seconds)
        next_heartbeat = time.monotonic() + self.heartbeat_every
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
                    elif self._budget_left() == 0 and not self.jobs and not self.pending:
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
                if self.once and not claimed and not self.jobs and not self.pending:
                    self._stop_reason = "idle"
                    break
                if not claimed:
                    self._wake.wait(min(self.poll_seconds, max(0.0, next_heartbeat - time.monotonic())))
                    self._wake.clear()
        finally:
            self._shutdown(self._stop_reason or "error")
        return self.summary

    def _budget_left(self) -> int | None:
        return None if self.max_tasks is None else max(0, self.max_tasks - self.summary.claimed)

    def _claim(self) -> list[Task]:
        free = self.slots - len(self.jobs) - len(self.pending)
        budget = self._budget_left()
        if budget is not None:
            free = min(free, budget)
        if free <= 0:
            return []
        try:
            tasks = self.store.claim(self.session, free)
        except SessionLost:
            self._lost = True
            return []
        except DatabaseUnavailable as exc:
            self.log.warning("claim failed; will try again", error=str(exc))
            return []
        for task in tasks:
            self.summary.claimed += 1
            self._start(task)
        return tasks

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
        log = self.log.bind(task=task.id, key=task.key, attempt=task.attempts)
        ws = workspace_for(self.workspaces, self.lane_name, task.key)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        log_path = self.workspaces / self.lane_name / "logs" / f"{task.id}-{safe_name(task.key)}-a{task.attempts}-{stamp}.log"
        try:
            prepare(ws, task, instructions=self.instructions(), lane_handoff=self._lane_handoff,
                    hidden_sets=self.lane.hidden_files, shift_deadline=self.deadline_at)
            values = {"prompt_file": str(ws.prompt_file), "workspace": str(ws.root),
                      "model": self.lane.model or "", "task_id": str(task.id),
                      "agent_session": task.agent_session or ""}
            env = agent_env(os.environ, {
                "FLEET_TASK_ID": str(task.id), "FLEET_TASK_KEY": task.key, "FLEET_LANE": self.lane_name,
                "FLEET_ATTEMPT": str(task.attempts), "FLEET_WORKSPACE": str(ws.root),
                "FLEET_MODEL": self.lane.model or "", "FLEET_AGENT_SESSION": task.agent_session or "",
            })
            agent = AgentProcess(render_argv(self.lane.command, values), cwd=ws.root, env=env,
                                 log_path=log_path)
        except OSError as exc:
            log.error("could not start the agent", error=str(exc))
            error, token = f"could not start the agent: {exc}", task.lease_token
            assert token is not None
            self._call(task.id, lambda: self.store.fail(task.id, token, error), "failed")
            return
        job = Job(task=task, ws=ws, agent=agent, log_path=log_path, started=time.monotonic())
        cp = ws.read_checkpoint()
        if cp is not None:
            job.checkpoint, job.checkpoint_mtime = cp
        self.jobs[task.id] = job
        self._record(job, {"log_path": str(log_path), "model": self.lane.model})
        log.info("agent started", pid=agent.pid, log=str(log_path))

    def _record(self, job: Job, report: dict[str, Any]) -> None:
        try:
            self.store.record_run(job.token, {k: v for k, v in report.items() if v is not None})
        except FleetError as exc:
            self.log.warning("could not record the run", task=job.task.id, error=str(exc))

    def _count(self, outcome: str) -> None:
        self.summary.outcomes[outcome] = self.summary.outcomes.get(outcome, 0) + 1

    def _call(self, task_id: int, fn: Callable[[], str], outcome: str, *, retry: bool = False) -> str | None:
        """Make one fenced final call. A lost lease is logged, not raised; a connection failure
        leaves the call pending, to be made again (the lease stays ours meanwhile: the
        heartbeat names the task)."""
        try:
            state = fn()
        except LeaseLost as exc:
            if retry:  # the first try may have committed before its connection broke
                self.log.info("pending call answered: lease already gone", task=task_id, error=str(exc))
            else:
                self.log.warning("lease lost; result dropped", task=task_id, error=str(exc))
            self._count("lease_lost")
            return None
        except DatabaseUnavailable as exc:
            self.log.warning("final call failed; will retry", task=task_id, outcome=outcome, error=str(exc))
            self.pending[task_id] = (fn, outcome)
            return None
        self._count(outcome)
        return str(state)

    def _retry_pending(self) -> None:
        for task_id, (fn, outcome) in list(self.pending.items()):
            del self.pending[task_id]
            if self._call(task_id, fn, outcome, retry=True) is not None:
                self.log.info("pending call made", task=task_id, outcome=outcome)

    def _store_checkpoint(self, job: Job) -> None:
        cp = job.ws.read_checkpoint()
        if cp is None:
            return
        data, mtime = cp
        if mtime == job.checkpoint_mtime and data == job.checkpoint:
            return
        try:
            seq = self.store.checkpoint(job.task.id, job.token, data)
        except LeaseLost:
            self._kill(job, "lost")
            return
        except DatabaseUnavailable as exc:
            self.log.warning("checkpoint not stored yet", task=job.task.id, error=str(exc))
            return
        job.checkpoint, job.checkpoint_mtime = data, mtime
        self.log.info("checkpoint stored", task=job.task.id, seq=seq)

    def _kill(self, job: Job, why: str) -> None:
        if job.killed is None:
            job.killed = why
            job.agent.kill()
            self.log.warning("agent killed", task=job.task.id, reason=why)

    def _reap(self) -> None:
        for task_id, job in list(self.jobs.items()):
            code = job.agent.poll()
            if code is not None:
                del self.jobs[task_id]
                self._finish(job, code)

    def _snapshot(self, job: Job, reason: str, code: int | None, agent_session: str | None) -> dict[str, Any]:
        return {
            "reason": reason, "attempt": job.task.attempts, "exit_code": code,
            "ran_seconds": round(time.monotonic() - job.started, 1),
            "checkpoint": job.checkpoint, "agent_session": agent_session or job.task.agent_session,
            "log_path": str(job.log_path), "log_tail": tail(job.log_path, 1500),
            "shift_session": str(self.session), "host": self.host,
        }

    def _finish(self, job: Job, code: int) -> None:
        job.agent.release()
        task = job.task
        log = self.log.bind(task=task.id, key=task.key, attempt=task.attempts, exit_code=code)
        result = parse_result(read_lines(job.log_path))
        report: dict[str, Any] = {**result.report(), "exit_code": code, "log_path": str(job.log_path)}
        if code != 0:
            report["error_tail"] = tail(job.log_path, 2000)
        self._record(job, report)  # tokens count even when the lease is gone
        if job.killed is not None:
            log.info("agent ended after its lease was gone", reason=job.killed)
            self._count(job.killed)
            return
        self._store_checkpoint(job)
        if job.killed is not None:  # the checkpoint found the lease gone
            log.info("agent ended after its lease was gone", reason=job.killed)
            self._count(job.killed)
            return
        tid, token = task.id, job.token
        if code == EX_TEMPFAIL or (job.stopping and code != 0):
            why = "agent asked to hand off (exit 75)" if code == EX_TEMPFAIL else f"shift ended ({self._stop_reason})"
            snap = self._snapshot(job, why, code, result.session_id)
            state = self._call(tid, lambda: self.store.hand_off(tid, token, snap), "handed_off")
            log.info("handed off", state=state)
        elif code != 0:
            error = f"exit code {code}: {tail(job.log_path, 800).strip()[-800:]}"
            state = self._call(tid, lambda: self.store.fail(tid, token, error), "failed")
            log.info("attempt failed", state=state)
        elif result.found and result.is_error:
            error = f"the agent reported is_error ({result.subtype}): {result.summary or ''}"[:2000]
            state = self._call(tid, lambda: self.store.fail(tid, token, error), "failed")
            log.info("attempt failed: is_error", state=state)
        elif self.lane.require_result and not result.found:
            error = "unverified exit: exit 0 without a result record"
            state = self._call(tid, lambda: self.store.fail(tid, token, error), "failed")
            log.info("attempt failed: unverified exit", state=state)
        else:
            route = job.ws.read_route()
            if route is not None and "error" in route:
                error = str(route["error"])
                state = self._call(tid, lambda: self.store.fail(tid, token, error), "failed")
                log.info("attempt failed: bad route file", state=state)
            elif route is not None:
                target, note = str(route["lane"]), route.get("note")
                try:
                    state = self._call(tid, lambda: self.store.route(tid, token, target, note), "routed")
                except FleetError as exc:  # unknown lane, refused route: the agent's mistake
                    error = f"route to {target!r} refused: {exc}"
                    state = self._call(tid, lambda: self.store.fail(tid, token, error), "failed")
                log.info("routed", to=target, state=state)
            else:
                res = {"summary": result.summary, "agent_session": result.session_id,
                       "cost_usd": result.cost_usd} if result.found else {"summary": None}
                state = self._call(tid, lambda: self.store.complete(tid, token, res), "done")
                log.info("done", state=state)

    # -- heartbeat

    def _heartbeat(self) -> None:
        try:
            statuses = self.store.heartbeat(self.session, [*self.jobs, *self.pending])
        except SessionLost as exc:
            self.log.error("session lost: stopping every agent", error=str(exc))
            self._lost = True
            for job in self.jobs.values():
                self._kill(job, "lost")
            return
        except DatabaseUnavailable as exc:
            self.log.warning("heartbeat failed; will try again", error=str(exc))
            return
        for task_id, job in self.jobs.items():
            status = statuses.get(task_id, "lost")
            if status != "ok":
                self._kill(job, status)
            else:
                self._store_checkpoint(job)

    # -- the end of the shift

    def _shutdown(self, reason: str) -> None:
        self.summary.reason = reason
        self.log.info("shift ending", reason=reason, running=len(self.jobs))
        if (self.jobs or self.pending) and not self._lost:
            for job in self.jobs.values():
                job.stopping = True
                job.agent.terminate()
            grace_end = time.monotonic() + self.lane.grace_seconds
            next_heartbeat = time.monotonic() + self.heartbeat_every
            while (self.jobs or self.pending) and time.monotonic() < grace_end:
                self._reap()
                self._retry_pending()
                if time.monotonic() >= next_heartbeat:  # keep the leases through the grace period
                    self._heartbeat()
                    next_heartbeat = time.monotonic() + self.heartbeat_every
                time.sleep(0.05)
        for job in self.jobs.values():
            job.stopping = True
            job.agent.kill()
        for job in list(self.jobs.values()):
            try:
                job.agent.wait(10)
            except Exception:
                self.log.error("supervisor did not exit", task=job.task.id, pid=job.agent.pid)
        self._reap()
        self._retry_pending()
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
            flag = " (resume)" if q.get("resume") else ""
            lines.append(f"- {q.get('id')} `{q.get('key')}` priority {q.get('priority')}{flag}")
    if h.notes:
        lines += ["", "## Notes", "", "```json", json.dumps(h.notes, indent=2, default=str), "```"]
    return "\n".join(lines) + "\n"


def write_lane_handoff(folder: Path, h: LaneHandoff) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{h.window_end:%Y%m%dT%H%M%S}-{h.session_id}.md"
    path.write_text(lane_handoff_markdown(h))
    return path
