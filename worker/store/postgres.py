"""The store over a direct database connection (DESIGN §5): :class:`PostgresStore`, psycopg 3
through a connection pool, one thin call site per ``fleet.*`` function (the
:class:`~worker.store.protocol.Store` protocol); no transition is decided here.

Retries: a transient connection failure is retried with tenacity, and so is a conflict. Calls that are
safe to repeat (heartbeat, checkpoint, record_run, enqueue by key, open_session — a duplicate
empty session only times out —, the monitor's repairs, which repair only what is still broken,
and reads) are retried on any connection error; calls that are not (claim, complete, fail, …)
are retried only when the connection could not be had at all, because a call that failed
mid-flight may have committed (the shift then makes it again itself: the lease token fences it).
A conflict — a serialization failure (40001, also what ``fleet.enqueue_task`` raises when a key
changes hands under it: "try again"), a deadlock (40P01), a lock not available (55P03) — rolled the
call's transaction back, so nothing was committed and every call is retried, within the same
budget; when the tries run out it is :class:`~worker.errors.DatabaseUnavailable` naming the
database and the conflict. A constraint violation or an ``LF`` error is never retried, and any
other database error is a :class:`~worker.errors.FleetError` naming it: no psycopg exception
leaves the store.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, LiteralString
from uuid import UUID

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool, PoolTimeout
from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from worker.config import FleetConfig
from worker.db.url import redact
from worker.errors import (
    SQLSTATE_ERRORS,
    DatabaseUnavailable,
    FleetError,
    InvalidInput,
    conflict,
    one_line,
)
from worker.models import Heartbeat, LeaseAnswer, RepairAction, Task
from worker.store.protocol import (
    BATCH_FUNCTIONS,
    SOURCE_FUNCTIONS,
    SOURCE_JSON,
    SOURCE_ROWS,
    CompleteItem,
    bulk_tasks,
)
from worker.store.reads import NamedReads, queries


def _json(value: Any) -> Jsonb | None:
    return None if value is None else Jsonb(value)


def translate(exc: psycopg.Error, name: str = "the database") -> FleetError:
    """The FleetError for a database error: an ``LF`` error's own class, bad input, a missing
    schema, a conflict (:class:`DatabaseUnavailable`: nothing committed, try again), else a plain
    FleetError naming ``name`` (the database), the server's message and its SQLSTATE."""
    diag = exc.diag
    cls = SQLSTATE_ERRORS.get(exc.sqlstate or "")
    if cls is not None:
        return cls(diag.message_primary or str(exc), diag.message_hint)
    if isinstance(exc, psycopg.errors.IntegrityError | psycopg.errors.DataError):
        return InvalidInput(diag.message_primary or str(exc), diag.message_detail)
    if isinstance(exc, psycopg.errors.UndefinedFunction | psycopg.errors.UndefinedTable):
        return FleetError(diag.message_primary or str(exc),
                          "the database is not migrated (run `fleet migrate`), or a newer lanefleet migrated it"
                          " (upgrade this host)")
    message = diag.message_primary or one_line(str(exc)) or type(exc).__name__
    kind = conflict(exc.sqlstate)
    if kind is not None:
        return DatabaseUnavailable(f"{name} rolled the call back ({kind}, {exc.sqlstate}): {message}",
                                   "nothing was committed; try again")
    return FleetError(f"{name} refused the call: {message} ({exc.sqlstate or type(exc).__name__})",
                      diag.message_hint or None)


def deadlines(url: str, budget: float, *, pooler: bool) -> dict[str, Any]:
    """libpq settings so that no call of a connection blocks much past ``budget`` seconds, even on
    a network that silently drops everything (a partition sends no reset): a connect timeout; a TCP
    user timeout (data sent and not acknowledged for that long closes the connection); keepalives
    probing an idle connection every second, so that an answer lost on the way is noticed too; and a
    statement timeout on the server. Not the statement timeout through a pooler in transaction mode,
    which would keep it for other clients' sessions: there the TCP settings alone bound a call."""
    ms = max(1000, int(budget * 1000))
    out: dict[str, Any] = {
        "connect_timeout": max(2, math.ceil(budget)),  # libpq's smallest
        "tcp_user_timeout": ms,
        "keepalives": 1,
        "keepalives_idle": max(1, int(budget / 2)),
        "keepalives_interval": 1,
        "keepalives_count": 2,
    }
    if not pooler:
        given = conninfo_to_dict(url).get("options") or ""
        out["options"] = f"{given} -c statement_timeout={ms}".strip()
    return out


class _Transient(Exception):
    """A connection failure that is safe to retry."""


class _Conflict(_Transient):
    """A conflict (:data:`worker.errors.CONFLICTS`): the call's transaction was rolled back; safe to retry."""

    def __init__(self, error: psycopg.Error) -> None:
        super().__init__(str(error))
        self.error = error


class PostgresStore(NamedReads):
    """The store over a direct connection (psycopg 3 + pool)."""

    def __init__(self, url: str, *, pooler: bool = False, min_size: int = 1, max_size: int = 8,
                 attempts: int = 5, timeout: float = 10.0, call_budget: float | None = None,
                 name: str | None = None) -> None:
        """``call_budget``: the most seconds one call may spend on retries and on waiting for a
        connection (None: ``attempts`` tries of up to ``timeout`` each). A shift sets it to a
        fraction of its lease, so a database outage never stops it from noticing its agents.
        ``name``: the database as messages name it (default: the URL without its password)."""
        self.url = url
        self.name = name or f"the database {redact(url)}"
        self._attempts = attempts
        self._budget = call_budget
        kwargs: dict[str, Any] = {"autocommit": True, "row_factory": dict_row}
        if pooler:
            kwargs["prepare_threshold"] = None  # no server-side prepared statements through a pooler
        if call_budget is not None:
            kwargs.update(deadlines(url, call_budget, pooler=pooler))
        self.pool: ConnectionPool[Any] = ConnectionPool(
            url, kwargs=kwargs, min_size=min_size, max_size=max_size, open=False,
            check=ConnectionPool.check_connection, timeout=timeout, name="lanefleet",
        )
        try:
            self.pool.open(wait=False)
        except psycopg.Error as exc:  # pragma: no cover - open(wait=False) rarely raises
            raise DatabaseUnavailable(f"cannot open a pool to {self.name}: {exc}") from exc

    @classmethod
    def from_config(cls, cfg: FleetConfig, url: str, **kwargs: Any) -> PostgresStore:
        return cls(url, pooler=cfg.database.pooler, min_size=cfg.database.pool_min,
                   max_size=cfg.database.pool_max, **kwargs)

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> PostgresStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing

    def _run(self, query: LiteralString, params: Sequence[Any] | dict[str, Any] = (), *,
             idempotent: bool = True) -> list[dict[str, Any]]:
        deadline = None if self._budget is None else time.monotonic() + self._budget
        tries = 0

        def once() -> list[dict[str, Any]]:
            nonlocal tries
            tries += 1
            wait = None if deadline is None else max(0.1, deadline - time.monotonic())
            try:
                conn = self.pool.getconn(timeout=wait)
            except (PoolTimeout, psycopg.OperationalError) as exc:
                raise _Transient(str(exc)) from exc  # nothing was sent: always safe to retry
            try:
                cur = conn.execute(query, params)
                return cur.fetchall() if cur.description else []
            except psycopg.Error as exc:
                if conflict(exc.sqlstate):
                    raise _Conflict(exc) from exc  # rolled back: nothing committed, any call may be repeated
                lost = exc.sqlstate is None or exc.sqlstate[:2] in ("08", "57") or exc.sqlstate == "40003"
                if not isinstance(exc, psycopg.OperationalError) or not lost:
                    raise translate(exc, self.name) from exc
                reason = exc.diag.message_primary or one_line(str(exc))  # one line, without CONTEXT
                if idempotent:
                    raise _Transient(reason) from exc
                raise DatabaseUnavailable(
                    f"the connection to {self.name} failed during a call that may have committed: {reason}"
                ) from exc
            finally:
                self.pool.putconn(conn)  # the pool discards a broken connection

        try:
            for attempt in Retrying(retry=retry_if_exception_type(_Transient),
                                    stop=stop_after_attempt(self._attempts) | stop_after_delay(
                                        self._budget if self._budget is not None else float("inf")),
                                    # (the jitter: callers that conflicted do not all come back at once)
                                    wait=wait_exponential(multiplier=0.2, max=5) + wait_random(0, 0.05),
                                    reraise=True):
                with attempt:
                    return once()
        except _Conflict as exc:
            raise DatabaseUnavailable(
                f"{self.name} rolled the call back {tries} time(s) for a conflict with other transactions"
                f" ({conflict(exc.error.sqlstate)}, {exc.error.sqlstate}):"
                f" {exc.error.diag.message_primary or exc}",
                "nothing was committed; try again") from exc.error
        except _Transient as exc:
            raise DatabaseUnavailable(f"{self.name} is unreachable: {exc}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _one(self, query: LiteralString, params: Sequence[Any] = (), *,
             idempotent: bool = True) -> Any:
        rows = self._run(query, params, idempotent=idempotent)
        return next(iter(rows[0].values())) if rows else None

    # -- the SQL API

    def enqueue(self, lane: str, key: str, payload: dict[str, Any] | None = None, priority: int = 0,
                run_at: datetime | None = None, max_attempts: int | None = None,
                title: str | None = None, delay_seconds: float | None = None, tier: str | None = None,
                profile: str | None = None, max_cost_usd: float | None = None,
                max_tokens: int | None = None) -> tuple[int, bool]:
        """Queue a task; (id, created). ``delay_seconds`` counts from the database's now()."""
        rows = self._run(
            # ::int: a Python int past int4 is sent as bigint, which matches no fleet.enqueue_task
            # ("function does not exist", read as "not migrated"); cast, and it is out of range
            "select task_id, created from fleet.enqueue_task(%s, %s, %s, %s::int,"
            " coalesce(%s::timestamptz, now() + make_interval(secs => coalesce(%s, 0))), %s::int, %s,"
            " %s, %s, %s::numeric, %s::bigint)",
            (lane, key, _json(payload if payload is not None else {}), priority, run_at, delay_seconds,
             max_attempts, title, tier, profile, max_cost_usd, max_tokens),
        )
        return int(rows[0]["task_id"]), bool(rows[0]["created"])

    def enqueue_many(self, lane: str | None, tasks: Sequence[Mapping[str, Any]]) -> list[tuple[int, bool]]:
        """Queue many tasks in one transaction, all or nothing (``fleet.enqueue_many``). Each task is
        a mapping with ``key`` and optionally ``lane`` (default: ``lane``), ``payload``, ``title``,
        ``priority``, ``run_at`` (a datetime or ISO text) or ``delay_seconds``, ``max_attempts``,
        ``tier``, ``profile``, ``max_cost_usd``, ``max_tokens``.
        (id, created) per task, in order; idempotent on key, so a retry is safe. A bad task raises
        the error enqueue would, its message starting ``p_tasks[<index>] (key '<key>'):``."""
        if not tasks:
            return []
        rows = self._run("select idx, id, created from fleet.enqueue_many(%s, %s)",
                         (lane, Jsonb(bulk_tasks(tasks))))
        return [(int(r["id"]), bool(r["created"])) for r in sorted(rows, key=lambda r: int(r["idx"]))]

    def open_session(self, lane: str, host: str, pid: int, pid_started_at: datetime | None,
                     seconds: int, pid_identity: str | None = None) -> UUID:
        return UUID(str(self._one("select fleet.open_session(%s, %s, %s, %s, %s, %s)",
                                  (lane, host, pid, pid_started_at, seconds, pid_identity))))

    def claim(self, session: UUID, limit: int = 1) -> list[Task]:
        rows = self._run("select * from fleet.claim(%s, %s)", (session, limit), idempotent=False)
        return [Task.model_validate(r) for r in rows]

    def claimed(self, session: UUID, known: list[int]) -> list[Task]:
        """The tasks the session holds that are not in ``known``: what a claim whose answer was
        lost made the session's (fleet.claimed), to be started as that claim's answer would have
        been."""
        rows = self._run("select * from fleet.claimed(%s, %s::bigint[])", (session, known))
        return [Task.model_validate(r) for r in rows]

    def heartbeat(self, session: UUID, tasks: list[int] | None = None, progressed: list[int] | None = None,
                  attention: dict[int, str] | None = None) -> Heartbeat:
        """Renew the session's lease, which every task it holds follows: ``tasks`` are the ones it
        runs (the others it holds are released; None: all of them). ``progressed``: tasks whose
        agent made progress since the last heartbeat; ``attention``: agents waiting on a question
        or a prompt (the others' flags are cleared). Task id → ok | lost | cancelled | stalled, and
        how long the lease holds (:class:`~worker.models.Heartbeat`)."""
        return Heartbeat.of_rows(self._run(
            "select task_id, status, valid_for from fleet.heartbeat(%s, %s::bigint[], %s::bigint[], %s)",
            (session, tasks, progressed,
             _json({str(k): v for k, v in attention.items()}) if attention is not None else None)))

    def stalled_tasks(self) -> list[dict[str, Any]]:
        """Running tasks without progress for their lane's stall_seconds, and agents waiting on a
        prompt (what the monitor reports)."""
        return [dict(r) for r in self._run("select * from fleet.stalled_tasks()", ())]

    def task_spend(self, task: int) -> tuple[float, int]:
        """What a task has spent over all its runs: (cost in USD, tokens of every kind)."""
        row = self._run("select cost_usd, tokens from fleet.task_spend(%s)", (task,))[0]
        return float(row["cost_usd"]), int(row["tokens"])

    def review_approve(self, task: int, note: str | None = None) -> str:
        return str(self._one("select fleet.review_approve(%s, %s)", (task, note), idempotent=False))

    def review_reject(self, task: int, note: str) -> str:
        return str(self._one("select fleet.review_reject(%s, %s)", (task, note), idempotent=False))

    def lease_held(self, task: int, token: UUID) -> LeaseAnswer:
        """(held, the task's state, seconds it still holds) at this moment, by the database's
        clock: held only while the task runs under ``token``, its session is active and its lease
        has not run out. Read only (what ``fleet guard`` asks)."""
        return LeaseAnswer.of_row(self._run("select held, state, valid_for, token_matches from fleet.lease_held(%s, %s)",
                                            (task, token))[0])

    def checkpoint(self, task: int, token: UUID, data: Any) -> int:
        return int(self._one("select fleet.checkpoint(%s, %s, %s)", (task, token, _json(data))))

    def complete(self, task: int, token: UUID, result: Any = None) -> str:
        return str(self._one("select fleet.complete(%s, %s, %s)", (task, token, _json(result)),
                             idempotent=False))

    def complete_many(self, items: Sequence[CompleteItem]) -> dict[int, str]:
        """Complete many tasks in one call (``fleet.complete_many``), each fenced by its own token:
        items are (task, token) or (task, token, result). Task id → done | lost (the token no longer
        holds it: nothing changed for that task) | unknown (no such task, or one of a lane the key may not work: the same answer)."""
        if not items:
            return {}
        results = [_json(i[2]) if len(i) > 2 else None for i in items]
        rows = self._run(
            "select task_id, status from fleet.complete_many(%s::bigint[], %s::uuid[], %s::jsonb[])",
            ([i[0] for i in items], [i[1] for i in items],
             results if any(r is not None for r in results) else None),
            idempotent=False)
        return {int(r["task_id"]): str(r["status"]) for r in rows}

    def fail(self, task: int, token: UUID, error: str, retryable: bool = True, reason: str | None = None) -> str:
        """``reason``: why (unverified-exit, verify-failed, stalled, ...); the lane's escalate_on
        reasons move the next attempt one tier up."""
        return str(self._one("select fleet.fail(%s, %s, %s, %s, %s)", (task, token, error, retryable, reason),
                             idempotent=False))

    def block(self, task: int, token: UUID, reason: str, evidence: str | None = None) -> str:
        return str(self._one("select fleet.block(%s, %s, %s, %s)", (task, token, reason, evidence),
                             idempotent=False))

    def gate_verdict(self, task: int, token: UUID, gate: str, evidence: str | None = None,
                     result: Any = None) -> str:
        """A verify gate's outcome on the task's work; the database decides what it does (done,
        a failed attempt, blocked) and answers the task's state."""
        return str(self._one("select fleet.gate_verdict(%s, %s, %s, %s, %s)",
                             (task, token, gate, evidence, _json(result)), idempotent=False))

    def throttle(self, task: int, token: UUID, until: datetime | None = None, note: str | None = None,
                 after_seconds: float | None = None, signal: dict[str, Any] | None = None) -> datetime:
        """``signal``: what matched ({"signal", "text", "reset": the reset as read}), for the event.
        The database keeps the pause at least the profile's throttle floor."""
        value = self._one("select fleet.throttle(%s, %s, %s, %s, %s, %s)",
                          (task, token, until, note, after_seconds, _json(signal)), idempotent=False)
        assert isinstance(value, datetime)
        return value

    def transient(self, task: int, token: UUID, error: str, after_seconds: float | None = None) -> str:
        """A provider-side error that says nothing about the work: queued again without a failure,
        up to the lane's max_transient (then a failure, as :meth:`fail`). The task's state."""
        return str(self._one("select fleet.transient(%s, %s, %s, %s)", (task, token, error, after_seconds),
                             idempotent=False))

    def drop_session(self, task: int, token: UUID, note: str | None) -> str:
        """The agent session the task was to resume does not exist: queued again without it."""
        return str(self._one("select fleet.drop_session(%s, %s, %s)", (task, token, note), idempotent=False))

    def cannot_start(self, task: int, token: UUID, error: str) -> str:
        """The task's agent program could not be started: back to the queue unspent, its lane paused."""
        return str(self._one("select fleet.cannot_start(%s, %s, %s)", (task, token, error), idempotent=False))

    def resume(self, task: int, max_cost_usd: float | None = None, max_tokens: int | None = None) -> str:
        return str(self._one("select fleet.resume(%s, %s::numeric, %s::bigint)", (task, max_cost_usd, max_tokens),
                             idempotent=False))

    def batch_call(self, fn: str, params: dict[str, Any], *, idempotent: bool = False) -> Any:
        """One of the batch functions (:data:`~worker.store.protocol.BATCH_FUNCTIONS`), with named
        arguments (``p_carrier``, ``p_token``, ...); its one value."""
        from psycopg import sql

        if fn not in BATCH_FUNCTIONS:
            raise ValueError(f"not a batch function: {fn}")
        args = sql.SQL(", ").join(sql.SQL("{} => {}").format(sql.Identifier(k), sql.Placeholder(k)) for k in params)
        query = sql.SQL("select fleet.{}({})").format(sql.Identifier(fn), args)
        values = {k: (_json(v) if isinstance(v, (dict, list)) and k not in ("p_keys",) else v) for k, v in params.items()}
        return self._one(query, values, idempotent=idempotent)  # type: ignore[arg-type]

    def source_call(self, fn: str, params: dict[str, Any], *, idempotent: bool = False) -> Any:
        """One of a source's functions (:data:`~worker.store.protocol.SOURCE_FUNCTIONS`), with named
        arguments: its rows (those of :data:`~worker.store.protocol.SOURCE_ROWS`) or its one value."""
        from psycopg import sql

        if fn not in SOURCE_FUNCTIONS:
            raise ValueError(f"not a source function: {fn}")
        args = sql.SQL(", ").join(sql.SQL("{} => {}").format(sql.Identifier(k), sql.Placeholder(k)) for k in params)
        values = {k: (Jsonb(v) if k in SOURCE_JSON else v) for k, v in params.items()}
        if fn in SOURCE_ROWS:
            query = sql.SQL("select * from fleet.{}({})").format(sql.Identifier(fn), args)
            return [dict(r) for r in self._run(query, values, idempotent=idempotent)]  # type: ignore[arg-type]
        query = sql.SQL("select fleet.{}({})").format(sql.Identifier(fn), args)
        return self._one(query, values, idempotent=idempotent)  # type: ignore[arg-type]

    def sync_pool(self, name: str, slots: int | None, windows: dict[str, Any] | None = None,
                  reserve: float | None = None) -> str:
        return str(self._one("select fleet.sync_pool(%s, %s, %s, %s::numeric)", (name, slots, _json(windows), reserve)))

    def clear_throttle(self, pool: str) -> dict[str, Any]:
        """An operator lifts the pool's throttle (``fleet.clear_throttle``): {pool, was_until (None:
        it was not throttled), note, set_by, tasks (how many waiting tasks are ready now)}."""
        value = self._one("select fleet.clear_throttle(%s)", (pool,), idempotent=False)
        assert isinstance(value, dict)
        return value

    def sync_profile(self, name: str, pool: str | None, models: dict[str, str],
                     throttle_floor: float = 60.0) -> str:
        return str(self._one("select fleet.sync_profile(%s, %s, %s, %s)",
                             (name, pool, _json(models), throttle_floor)))

    def hand_off(self, task: int, token: UUID, snapshot: dict[str, Any]) -> str:
        return str(self._one("select fleet.hand_off(%s, %s, %s)", (task, token, _json(snapshot)),
                             idempotent=False))

    def route(self, task: int, token: UUID, lane: str, note: Any = None) -> str:
        return str(self._one("select fleet.route(%s, %s, %s, %s)", (task, token, lane, _json(note)),
                             idempotent=False))

    def record_run(self, token: UUID, report: dict[str, Any]) -> None:
        self._run("select fleet.record_run(%s, %s)", (token, _json(report)))

    def close_session(self, session: UUID, reason: str, snapshot: dict[str, Any]) -> int:
        # idempotent in SQL: closing twice returns the same lane hand-off
        return int(self._one("select fleet.close_session(%s, %s, %s)", (session, reason, _json(snapshot))))

    def cancel(self, task: int) -> str:
        return str(self._one("select fleet.cancel(%s)", (task,)))

    def retry(self, task: int) -> str:
        return str(self._one("select fleet.retry(%s)", (task,), idempotent=False))

    def sync_lane(self, name: str, settings: dict[str, Any]) -> str:
        return str(self._one("select fleet.sync_lane(%s, %s)", (name, _json(settings))))

    def pause_lane(self, name: str, reason: str) -> str:
        """Pause a lane whose config a preflight found wrong: 'paused' or 'unchanged'."""
        return str(self._one("select fleet.pause_lane(%s, %s)", (name, reason)))

    def retire_lane(self, name: str) -> str:
        return str(self._one("select fleet.retire_lane(%s)", (name,)))

    def unretire_lane(self, name: str) -> str:
        return str(self._one("select fleet.unretire_lane(%s)", (name,)))

    def reconcile(self, idle_seconds: int = 300, overdue_grace_seconds: int = 60) -> list[RepairAction]:
        rows = self._run("select * from fleet.reconcile(%s, %s)", (idle_seconds, overdue_grace_seconds))
        return [RepairAction.model_validate(r) for r in rows]

    def declare_session_lost(self, session: UUID, reason: str) -> list[RepairAction]:
        rows = self._run("select * from fleet.declare_session_lost(%s, %s)", (session, reason))
        return [RepairAction.model_validate(r) for r in rows]

    # -- workspaces (fleet.workspaces)

    def touch_workspace(self, task: int, token: UUID, host: str, path: str, size: int | None = None) -> int:
        """Record the task's workspace on ``host`` (fenced by the lease): made, or used again;
        ``size`` in bytes (None keeps the last). Returns the workspace id."""
        return int(self._one("select fleet.touch_workspace(%s, %s, %s, %s, %s::bigint)",
                             (task, token, host, path, size)))

    def task_workspace(self, task: int, token: UUID, host: str) -> str | None:
        """The path of the task's active workspace on ``host`` in its lane (fenced by the lease),
        or None: where a shift works it, instead of a name computed from its key."""
        path = self._one("select fleet.task_workspace(%s, %s, %s)", (task, token, host))
        return None if path is None else str(path)

    def workspaces_to_reap(self, host: str, limit: int = 100) -> list[dict[str, Any]]:
        """The host's workspaces whose task has been finished for longer than its lane's retention."""
        return self._run("select * from fleet.workspaces_to_reap(%s, %s::int)", (host, limit))

    def workspace_reaped(self, workspace: int, bytes_freed: int | None = None) -> bool:
        """Mark a workspace reaped; False if it must stay (its task is live again)."""
        return bool(self._one("select fleet.workspace_reaped(%s, %s::bigint)", (workspace, bytes_freed)))

    def workspace_usage(self) -> list[dict[str, Any]]:
        """fleet.workspace_usage: disk use per lane and host."""
        return self._run("select * from fleet.workspace_usage order by lane, host")

    def metrics_rows(self) -> list[dict[str, Any]]:
        """fleet.metrics(): every sample of a Prometheus scrape, as {metric, lane, pool, label, value}."""
        return list(self._one("select fleet.metrics()") or [])

    # -- reads

    def query(self, name: str, **params: Any) -> list[dict[str, Any]]:
        """Run a named query of queries.sql."""
        return self._run(queries()[name], params)
