"""Typed rows: what the store returns. Field names are the SQL columns."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any, NamedTuple
from uuid import UUID

from pydantic import BaseModel, ConfigDict

# Every state of a task, as the schema's domain fleet.task_state lists them (a test holds them
# equal), and the finished ones (finished_at is set exactly for these: CHECK finished_has_time).
# Any other state is open: queued or running, blocked or in review (waiting for a person), batched,
# in ci (waiting for its pull request's checks: a source's pass moves it on).
TASK_STATES = ("queued", "running", "blocked", "review", "batched", "ci", "done", "dead", "cancelled")
FINISHED_STATES = ("done", "dead", "cancelled")
WAITING_STATES = ("blocked", "review", "ci")  # open, but only a person (or the CI of a PR) moves them on


class Heartbeat(dict[int, str]):
    """What ``fleet.heartbeat`` answered: task id → ok | lost | cancelled | stalled, and
    ``valid_for``, the seconds the session's lease holds from the database's now() (None: an
    answer without it). The shift counts them from before it sent the call (see
    :class:`worker.shift.fence.Fence`)."""

    valid_for: float | None = None

    @classmethod
    def of_rows(cls, rows: list[dict[str, Any]]) -> Heartbeat:
        beat = cls()
        for r in rows:
            if r.get("task_id") is None:
                if r.get("valid_for") is not None:
                    beat.valid_for = float(r["valid_for"])
            else:
                beat[int(r["task_id"])] = str(r["status"])
        return beat


class LeaseAnswer(NamedTuple):
    """What ``fleet.lease_held`` answered: does the token hold the task, the task's state, for how
    many more seconds the lease holds from the database's now() (0 when not held), and whether the
    token is still the task's own (held or not: a lease that ran out unrepaired)."""

    held: bool
    state: str
    valid_for: float
    token_matches: bool = False

    @classmethod
    def of_row(cls, row: dict[str, Any]) -> LeaseAnswer:
        return cls(bool(row["held"]), str(row["state"]), float(row.get("valid_for") or 0.0),
                   bool(row.get("token_matches")))


class _Row(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class Task(_Row):
    id: int
    lane: str
    key: str
    title: str | None = None
    payload: dict[str, Any] = {}
    priority: int = 0
    state: str
    run_at: datetime
    carry_over: bool = False  # work carried over from an earlier run: claimed first among its priority
    attempts: int = 0
    failures: int = 0
    evaporations: int = 0
    handoffs: int = 0
    max_attempts: int | None = None
    last_progress_at: datetime | None = None
    lease_token: UUID | None = None
    lease_expires_at: datetime | None = None
    session_id: UUID | None = None
    agent_session: str | None = None
    agent_session_host: str | None = None  # where agent_session lives: the host of the run that reported it
    agent_session_profile: str | None = None  # and that run's profile (resume it only there)
    transients: int = 0  # transient provider errors retried without a failure
    checkpoint: Any = None
    checkpoint_seq: int = 0
    handoff: dict[str, Any] | None = None
    stages: list[dict[str, Any]] = []
    last_error: str | None = None
    dead_reason: str | None = None
    result: Any = None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None = None
    tier: str | None = None
    profile: str | None = None  # asked at enqueue (None: the lane's)
    run_profile: str | None = None  # what the current (last) claim dispatched with
    pool: str | None = None
    block_reason: str | None = None
    verify_pending: bool = False
    max_cost_usd: Decimal | None = None
    max_tokens: int | None = None
    review_note: str | None = None
    ci_feedback: str | None = None  # the failing checks of its pull request, for the next attempt
    attention: str | None = None
    kind: str = "task"  # 'batch': the task carries a batch (fleet.batches), run by worker.shift.batch
    batch_id: int | None = None  # a carrier's batch, or a member's while it is batched


class Run(_Row):
    id: int
    task_id: int
    session_id: UUID | None
    lane: str
    attempt: int
    started_at: datetime
    ended_at: datetime | None
    outcome: str | None
    exit_code: int | None
    tier: str | None
    model: str | None
    agent_session: str | None
    input_tokens: int
    cache_creation_tokens: int
    cache_read_tokens: int
    output_tokens: int
    cost_usd: Decimal
    log_path: str | None
    error_tail: str | None
    profile: str | None = None
    pool: str | None = None
    reason: str | None = None
    gate: str | None = None
    agent: str | None = None  # the adapter that read its output: claude, codex, opencode, gemini, generic
    reasoning_tokens: int = 0  # part of output_tokens
    cost_source: str | None = None  # 'reported' by the agent CLI, 'computed' from the price table, None: no price


class Event(_Row):
    id: int
    ts: datetime
    kind: str
    lane: str | None
    task_id: int | None
    session_id: UUID | None
    detail: dict[str, Any]


class LaneHandoff(_Row):
    id: int
    lane: str
    session_id: UUID
    window_start: datetime
    window_end: datetime
    end_reason: str | None
    counts: dict[str, Any]
    completed: list[int]
    failed: list[int]
    handed_off: list[int]
    tokens: dict[str, Any]
    cost_usd: Decimal
    notes: dict[str, Any]
    queue_head: list[dict[str, Any]]
    created_at: datetime


class RepairAction(_Row):
    action: str
    lane: str | None
    task_id: int | None
    session_id: UUID | None
    detail: dict[str, Any]
