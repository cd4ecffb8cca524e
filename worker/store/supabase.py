"""The store over Supabase's REST API (DESIGN §8): every call an RPC to a ``fleet.*`` function
through PostgREST, with the official ``supabase`` client; reads are table selects under RLS.

For hosts that have a project URL and a key but no database password. The client sends the
project's anon key as ``apikey`` (what Supabase's gateway checks) and the host's fleet key, a JWT
from ``fleet keys mint``, as ``Authorization: Bearer`` (what PostgREST switches role by). It is
made once per store: ``create_client`` is not cheap.

Errors: PostgREST answers a failed call with the SQLSTATE in ``code``; the ``LF`` ones become the
same exceptions as with :class:`worker.store.postgres.PostgresStore` (a lost lease through HTTP is still
:class:`~worker.errors.LeaseLost`). Retries follow the psycopg store: a call that never reached the
database (connection refused, 503, 429, PostgREST's own connection errors) is retried with
jittered backoff; one that may have run (a timeout, 502, 504) is retried only if it is safe to
repeat, else it is :class:`~worker.errors.DatabaseUnavailable` and the shift makes it again itself
(the lease token fences it). SQL errors are read by their SQLSTATE as the psycopg store reads them,
whatever status PostgREST gave them (a 500): a cancelled statement (57014, a statement timeout,
class 57) is retried if the call is safe to repeat, else it is DatabaseUnavailable; a conflict
(:data:`~worker.errors.CONFLICTS`: 40001, 40P01, 55P03) rolled the call back, so it is retried
for any call, and is DatabaseUnavailable naming it when the tries run out. Any other 4xx is never
retried.

Long answers: PostgREST cuts every set of rows at its db-max-rows (Supabase's "Max rows", 1,000 by
default), silently. Table reads are read page by page (``max_rows`` rows a page, in a total order).
A set-returning function is called with ``count=exact`` (its result is materialized once, so the
count costs no second run) and the count says whether the answer was cut: a function that only
reads is then read on page by page; one that writes can never be called again to read the rest, so
those whose answer has no bound have a twin that answers one JSON value (``enqueue_many_json``,
``complete_many_json``, ``reconcile_json``: the same transaction, never cut), a claim asks for at
most ``max_rows`` tasks (it answers "up to"), and the others (a heartbeat, a session declared lost,
a source's page) answer a row per task of one shift or item of one page: if one was cut all the
same, that is an error saying so rather than a silent loss.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

import httpx
from postgrest.exceptions import APIError
from postgrest.types import CountMethod
from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from worker.config import FleetConfig, supabase_setting
from worker.errors import (
    SQLSTATE_ERRORS,
    ConfigError,
    DatabaseUnavailable,
    FleetError,
    InvalidInput,
    MigrationError,
    conflict,
)
from worker.models import Heartbeat, LeaseAnswer, RepairAction, Task
from worker.store.protocol import (
    BATCH_FUNCTIONS,
    SOURCE_FUNCTIONS,
    SOURCE_ROWS,
    CompleteItem,
    bulk_tasks,
)
from worker.store.reads import NamedReads

#: the calls that write the config (`fleet lanes sync`): granted to the database's owner alone
_OWNER_CALLS = frozenset({"sync_lane", "sync_pool", "sync_profile"})


class AccessDenied(FleetError):
    """The key was refused: not valid (signature, expiry), or its role may not make this call."""


class _Transient(Exception):
    """A failure that is safe to retry."""


class _Conflict(_Transient):
    """A conflict (:data:`~worker.errors.CONFLICTS`): the call was rolled back; safe to retry."""

    def __init__(self, what: str, error: APIError) -> None:
        super().__init__(f"{what}: {error.code} {error.message}")
        self.what = what
        self.error = error


# PostgREST's own "cannot reach the database" errors (503, and 504 waiting for a pool connection):
# the call never ran
_NOT_RUN = {"PGRST000", "PGRST001", "PGRST002", "PGRST003"}
_NOT_FOUND = {"PGRST202", "PGRST205", "42883", "42P01"}
_TIME_COLUMNS = {"ts", "deadline", "window_start", "window_end", "throttled_until"}
#: PostgREST's db-max-rows on Supabase (its "Max rows" setting), in the dev stack and in the recipe
MAX_ROWS = 1000
#: the set-returning functions the store calls that only read (stable): an answer cut at
#: db-max-rows is read on, page by page (tests/supabase_api/test_supabase_store.py checks that each
#: is stable in the database)
PAGED_READS = frozenset({"stalled_tasks", "task_spend", "lease_held", "workspaces_to_reap", "ready_by_lane",
                         "lane_summary", "source_work", "cohort_metrics"})


def _times(row: dict[str, Any]) -> dict[str, Any]:
    """ISO timestamps of a row as datetimes (what psycopg gives the named queries' callers)."""
    for k, v in row.items():
        if isinstance(v, str) and (k.endswith("_at") or k in _TIME_COLUMNS):
            try:
                row[k] = datetime.fromisoformat(v)
            except ValueError:
                pass
    return row


class SupabaseStore(NamedReads):
    """The store over PostgREST (supabase-py)."""

    def __init__(self, url: str, anon_key: str, key: str, *, attempts: int = 5, timeout: float = 10.0,
                 call_budget: float | None = None, max_rows: int = MAX_ROWS) -> None:
        """``url``: the project URL (``https://<ref>.supabase.co``); ``anon_key``: the project's
        anon key; ``key``: the host's fleet key. ``call_budget``: the most seconds one call may
        spend on retries (see :class:`worker.store.postgres.PostgresStore`). ``max_rows``: the
        project's db-max-rows (its Max rows), the longest page asked for; a lower one that a
        function's count shows is taken instead."""
        from supabase import ClientOptions, create_client

        if max_rows < 1:
            raise ConfigError(f"max_rows must be at least 1, not {max_rows}")
        self.url = url
        self.max_rows = max_rows
        self._attempts = attempts
        self._budget = call_budget
        per_try = timeout if call_budget is None else max(0.5, min(timeout, call_budget))
        self._status = threading.local()  # the HTTP status of this thread's last response

        def remember(response: httpx.Response) -> None:
            self._status.code = response.status_code

        self._http = httpx.Client(timeout=httpx.Timeout(per_try, connect=min(per_try, 5.0)),
                                  event_hooks={"response": [remember]}, follow_redirects=True)
        options = ClientOptions(schema="fleet", headers={"Authorization": f"Bearer {key}"},
                                postgrest_client_retry=False,  # retries are ours, and know what is safe
                                httpx_client=self._http, auto_refresh_token=False, persist_session=False)
        try:
            self.client = create_client(url, anon_key, options)
        except Exception as exc:  # supabase raises its own exception for a malformed URL or key
            raise ConfigError(f"cannot make a Supabase client for {url!r}: {exc}") from None

    @classmethod
    def from_config(cls, cfg: FleetConfig, environ: Mapping[str, str] | None = None,
                    **kwargs: Any) -> SupabaseStore:
        """From ``[supabase] url / key`` (or FLEET_SUPABASE__URL / __KEY), falling back to
        SUPABASE_URL and FLEET_KEY; the anon key from ``[supabase] anon_key`` or SUPABASE_ANON_KEY."""
        env = os.environ if environ is None else environ
        url, key, anon = (supabase_setting(cfg, f, env) for f in ("url", "key", "anon_key"))
        missing = [name for name, value in (("[supabase] url (or SUPABASE_URL)", url),
                                            ("[supabase] key (or FLEET_KEY): the host's fleet key", key),
                                            ("SUPABASE_ANON_KEY: the project's anon key", anon)) if not value]
        if missing:
            raise ConfigError(f"store = \"supabase\" needs {', '.join(missing)}",
                              "mint a fleet key with `fleet keys mint`" if not key else None)
        assert url and key and anon
        kwargs.setdefault("max_rows", cfg.supabase.max_rows)
        return cls(url, anon, key, **kwargs)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SupabaseStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing

    def _error(self, exc: APIError, what: str = "") -> Exception:
        """The FleetError for a PostgREST error that is not a transient one (``what``: the call)."""
        code = exc.code or ""
        status = getattr(self._status, "code", None)
        message = exc.message or str(exc)
        hint = exc.hint or None
        cls = SQLSTATE_ERRORS.get(code)
        if cls is not None:
            return cls(message, hint)
        kind = conflict(code)
        if kind is not None:
            return DatabaseUnavailable(f"the database behind the Supabase API at {self.url} rolled the call back"
                                       f" ({kind}, {code}): {message}", "nothing was committed; try again")
        if code[:2] == "57":  # the statement was cancelled: a statement timeout (57014), a shutdown
            return DatabaseUnavailable(f"the database behind the Supabase API at {self.url} cancelled the call"
                                       f" ({code}): {message}")
        if code[:2] in ("22", "23"):  # data exception, integrity constraint: the caller's input
            return InvalidInput(message, exc.details if isinstance(exc.details, str) else hint)
        if code in _NOT_FOUND:
            return FleetError(message, "the database is not migrated (`fleet migrate`), or schema fleet "
                                       "is not exposed in the project's API settings")
        if code == "PGRST106":
            return FleetError(message, "expose schema fleet in the project's API settings")
        if code == "42501" and what in _OWNER_CALLS:
            return AccessDenied(message, hint or "no fleet key may write the config: run `fleet lanes sync` (or "
                                "`fleet migrate`) with DATABASE_URL set to the project's connection string")
        if code == "42501":
            return AccessDenied(message, hint or "this key's role may not make this call: shifts need a worker "
                                "key, the monitor and operator commands an operator key (`fleet keys mint`)")
        if code.startswith("PGRST3") or status in (401, 403):
            return AccessDenied(f"the API refused the key: {message}", hint)
        return FleetError(f"the API refused the call: {message} ({code or status})", hint)

    def _call(self, what: str, fn: Callable[[], Any], *, idempotent: bool) -> Any:
        """``fn()`` (a request's execute) with the retries above; its response."""
        def once() -> Any:
            self._status.code = None
            try:
                return fn()
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                raise _Transient(f"{what}: {exc!r}") from exc  # nothing was sent
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                if idempotent:
                    raise _Transient(f"{what}: {exc!r}") from exc
                raise DatabaseUnavailable(
                    f"the connection to the Supabase API at {self.url} failed during {what}, which may have committed: {exc!r}") from exc
            except APIError as exc:
                status = self._status.code
                if exc.code in _NOT_RUN or status in (429, 503):  # refused before it ran
                    raise _Transient(f"{what}: {status} {exc.message}") from exc
                if conflict(exc.code):  # rolled back: nothing committed, any call may be repeated
                    raise _Conflict(what, exc) from exc
                if (exc.code or "")[:2] == "57":  # cancelled (a statement timeout), as the psycopg store reads it
                    if idempotent:
                        raise _Transient(f"{what}: {exc.code} {exc.message}") from exc
                    raise DatabaseUnavailable(
                        f"the database behind the Supabase API at {self.url} cancelled {what} ({exc.code}:"
                        f" {exc.message}), which is not safe to repeat") from exc
                if status in (502, 504):
                    if idempotent:
                        raise _Transient(f"{what}: {status} {exc.message}") from exc
                    raise DatabaseUnavailable(
                        f"the Supabase API at {self.url} answered {status} to {what}, which may have committed") from exc
                raise self._error(exc, what) from exc

        budget = self._budget if self._budget is not None else float("inf")
        tries = 0
        try:
            for attempt in Retrying(retry=retry_if_exception_type(_Transient),
                                    stop=stop_after_attempt(self._attempts) | stop_after_delay(budget),
                                    wait=wait_exponential_jitter(multiplier=0.1, max=5, jitter=0.5),
                                    reraise=True):
                with attempt:
                    tries += 1
                    return once()
        except _Conflict as exc:
            raise DatabaseUnavailable(
                f"the database behind the Supabase API at {self.url} rolled {what} back {tries} time(s) for a"
                f" conflict with other transactions ({conflict(exc.error.code)}, {exc.error.code}): {exc.error.message}",
                "nothing was committed; try again") from exc.error
        except _Transient as exc:
            raise DatabaseUnavailable(f"the Supabase API at {self.url} is unreachable: {exc}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _rpc(self, fn: str, params: dict[str, Any], *, idempotent: bool = True) -> Any:
        """A function's answer as PostgREST gives it: for one value (never cut by db-max-rows)."""
        return self._call(fn, lambda: self.client.rpc(fn, params).execute(), idempotent=idempotent).data

    def _rpc_rows(self, fn: str, params: dict[str, Any], *, idempotent: bool = True) -> list[dict[str, Any]]:
        """Every row a set-returning function answers (see the module's "Long answers")."""
        response = self._call(fn, lambda: self.client.rpc(fn, params, count=CountMethod.exact).execute(),
                              idempotent=idempotent)
        rows = [dict(r) for r in response.data or []]
        total = response.count
        if total is None or len(rows) >= total:
            return rows
        if rows:
            self.max_rows = min(self.max_rows, len(rows))  # the project's cap is lower than we were told
        if fn not in PAGED_READS:
            raise FleetError(f"fleet.{fn} answered {total} rows and the Supabase API at {self.url} passed on only"
                             f" {len(rows)} (its Max rows, db-max-rows): the call was made, the other answers are lost",
                             "raise the project's Max rows in its API settings")

        def page(start: int, size: int) -> Any:
            return self.client.rpc(fn, params).range(start, start + size - 1).execute()

        while len(rows) < total:
            page_rows = self._call(fn, functools.partial(page, len(rows), self.max_rows), idempotent=True).data or []
            if not page_rows:  # fewer rows now than when it was counted
                break
            rows += [dict(r) for r in page_rows]
        return rows

    def _rows(self, what: str, build: Callable[[Any], Any], *, limit: int | None = None) -> list[dict[str, Any]]:
        """The rows of a table or view read (``build`` makes the request, in a total order: pages are
        read by offset), at most ``limit`` of them, ``max_rows`` a page, until a shorter page."""
        if limit is not None and limit < 0:
            raise InvalidInput(f"LIMIT must not be negative, not {limit}")
        def page(start: int, size: int) -> Any:
            return build(self.client).range(start, start + size - 1).execute()

        rows: list[Any] = []
        while limit is None or len(rows) < limit:
            size = self.max_rows if limit is None else min(self.max_rows, limit - len(rows))
            page_rows = self._call(what, functools.partial(page, len(rows), size), idempotent=True).data or []
            rows += page_rows
            if len(page_rows) < size:
                break
        return [_times(dict(r)) for r in rows]

    # -- the SQL API

    def enqueue(self, lane: str, key: str, payload: dict[str, Any] | None = None, priority: int = 0,
                run_at: datetime | None = None, max_attempts: int | None = None,
                title: str | None = None, delay_seconds: float | None = None, tier: str | None = None,
                profile: str | None = None, max_cost_usd: float | None = None,
                max_tokens: int | None = None) -> tuple[int, bool]:
        """Queue a task; (id, created). ``delay_seconds`` counts from the database's now()."""
        common = {"p_lane": lane, "p_key": key, "p_payload": payload if payload is not None else {},
                  "p_priority": priority, "p_max_attempts": max_attempts, "p_title": title,
                  "p_tier": tier, "p_profile": profile, "p_max_cost_usd": max_cost_usd,
                  "p_max_tokens": max_tokens}
        if run_at is None and delay_seconds is not None:
            rows = self._rpc("enqueue_after", {"p_delay_seconds": delay_seconds, **common})
        else:
            rows = self._rpc("enqueue_task", {**common, "p_run_at": run_at.isoformat() if run_at else None})
        return int(rows[0]["task_id"]), bool(rows[0]["created"])

    def enqueue_many(self, lane: str | None, tasks: Sequence[Mapping[str, Any]]) -> list[tuple[int, bool]]:
        """Queue many tasks in one transaction (see :meth:`worker.store.postgres.PostgresStore.enqueue_many`)."""
        if not tasks:
            return []
        rows = self._rpc("enqueue_many_json", {"p_lane": lane, "p_tasks": bulk_tasks(tasks)})  # one value: never cut
        return [(int(r["id"]), bool(r["created"])) for r in sorted(rows or [], key=lambda r: int(r["idx"]))]

    def open_session(self, lane: str, host: str, pid: int, pid_started_at: datetime | None,
                     seconds: int, pid_identity: str | None = None) -> UUID:
        return UUID(str(self._rpc("open_session", {
            "p_lane": lane, "p_host": host, "p_pid": pid,
            "p_pid_started_at": pid_started_at.isoformat() if pid_started_at else None,
            "p_seconds": seconds, "p_pid_identity": pid_identity})))

    def claim(self, session: UUID, limit: int = 1) -> list[Task]:
        # at most max_rows: more would be cut by db-max-rows, claimed and never told (a claim answers "up to")
        rows = self._rpc_rows("claim", {"p_session": str(session), "p_limit": min(limit, self.max_rows)},
                              idempotent=False)
        return [Task.model_validate(r) for r in rows]

    def claimed(self, session: UUID, known: list[int]) -> list[Task]:
        """What a claim whose answer was lost made the session's (see
        :meth:`worker.store.postgres.PostgresStore.claimed`)."""
        return [Task.model_validate(r) for r in self._rpc_rows("claimed", {"p_session": str(session),
                                                                            "p_known": known})]

    def heartbeat(self, session: UUID, tasks: list[int] | None = None, progressed: list[int] | None = None,
                  attention: dict[int, str] | None = None) -> Heartbeat:
        """Renew the session's lease (see :meth:`worker.store.postgres.PostgresStore.heartbeat`)."""
        rows = self._rpc_rows("heartbeat", {"p_session": str(session), "p_tasks": tasks, "p_progressed": progressed,
                                            "p_attention": ({str(k): v for k, v in attention.items()}
                                                            if attention is not None else None)})
        return Heartbeat.of_rows(rows)

    def stalled_tasks(self) -> list[dict[str, Any]]:
        return self._rpc_rows("stalled_tasks", {})

    def task_spend(self, task: int) -> tuple[float, int]:
        row = self._rpc_rows("task_spend", {"p_task": task})[0]
        return float(row["cost_usd"]), int(row["tokens"])

    def review_approve(self, task: int, note: str | None = None) -> str:
        return str(self._rpc("review_approve", {"p_task": task, "p_note": note}, idempotent=False))

    def review_reject(self, task: int, note: str) -> str:
        return str(self._rpc("review_reject", {"p_task": task, "p_note": note}, idempotent=False))

    def lease_held(self, task: int, token: UUID) -> LeaseAnswer:
        """See :meth:`worker.store.postgres.PostgresStore.lease_held`."""
        return LeaseAnswer.of_row(self._rpc_rows("lease_held", {"p_task": task, "p_token": str(token)})[0])

    def checkpoint(self, task: int, token: UUID, data: Any) -> int:
        return int(self._rpc("checkpoint", {"p_task": task, "p_token": str(token), "p_data": data}))

    def complete(self, task: int, token: UUID, result: Any = None) -> str:
        return str(self._rpc("complete", {"p_task": task, "p_token": str(token), "p_result": result},
                             idempotent=False))

    def complete_many(self, items: Sequence[CompleteItem]) -> dict[int, str]:
        """Complete many tasks, each fenced by its token (see :meth:`worker.store.postgres.PostgresStore.complete_many`)."""
        if not items:
            return {}
        results = [i[2] if len(i) > 2 else None for i in items]
        rows = self._rpc("complete_many_json", {  # one value: never cut
            "p_tasks": [i[0] for i in items], "p_tokens": [str(i[1]) for i in items],
            "p_results": results if any(r is not None for r in results) else None}, idempotent=False)
        return {int(r["task_id"]): str(r["status"]) for r in rows or []}

    def fail(self, task: int, token: UUID, error: str, retryable: bool = True, reason: str | None = None) -> str:
        return str(self._rpc("fail", {"p_task": task, "p_token": str(token), "p_error": error,
                                      "p_retryable": retryable, "p_reason": reason}, idempotent=False))

    def block(self, task: int, token: UUID, reason: str, evidence: str | None = None) -> str:
        return str(self._rpc("block", {"p_task": task, "p_token": str(token), "p_reason": reason,
                                       "p_evidence": evidence}, idempotent=False))

    def gate_verdict(self, task: int, token: UUID, gate: str, evidence: str | None = None,
                     result: Any = None) -> str:
        return str(self._rpc("gate_verdict", {"p_task": task, "p_token": str(token), "p_gate": gate,
                                              "p_evidence": evidence, "p_result": result}, idempotent=False))

    def throttle(self, task: int, token: UUID, until: datetime | None = None, note: str | None = None,
                 after_seconds: float | None = None, signal: dict[str, Any] | None = None) -> datetime:
        value = self._rpc("throttle", {"p_task": task, "p_token": str(token),
                                       "p_until": until.isoformat() if until else None, "p_note": note,
                                       "p_after_seconds": after_seconds, "p_signal": signal}, idempotent=False)
        return datetime.fromisoformat(str(value))

    def transient(self, task: int, token: UUID, error: str, after_seconds: float | None = None) -> str:
        return str(self._rpc("transient", {"p_task": task, "p_token": str(token), "p_error": error,
                                           "p_after_seconds": after_seconds}, idempotent=False))

    def drop_session(self, task: int, token: UUID, note: str | None) -> str:
        return str(self._rpc("drop_session", {"p_task": task, "p_token": str(token), "p_note": note},
                             idempotent=False))

    def cannot_start(self, task: int, token: UUID, error: str) -> str:
        return str(self._rpc("cannot_start", {"p_task": task, "p_token": str(token), "p_error": error},
                             idempotent=False))

    def resume(self, task: int, max_cost_usd: float | None = None, max_tokens: int | None = None) -> str:
        return str(self._rpc("resume", {"p_task": task, "p_max_cost_usd": max_cost_usd, "p_max_tokens": max_tokens},
                             idempotent=False))

    def batch_call(self, fn: str, params: dict[str, Any], *, idempotent: bool = False) -> Any:
        """One of the batch functions (:data:`~worker.store.protocol.BATCH_FUNCTIONS`) through PostgREST RPC."""
        if fn not in BATCH_FUNCTIONS:
            raise ValueError(f"not a batch function: {fn}")
        return self._rpc(fn, {k: (str(v) if isinstance(v, UUID) else v) for k, v in params.items()},
                         idempotent=idempotent)

    def source_call(self, fn: str, params: dict[str, Any], *, idempotent: bool = False) -> Any:
        """One of a source's functions (:data:`~worker.store.protocol.SOURCE_FUNCTIONS`) through
        PostgREST RPC: its rows or its one value, as the Postgres store answers."""
        if fn not in SOURCE_FUNCTIONS:
            raise ValueError(f"not a source function: {fn}")
        if fn in SOURCE_ROWS:
            return self._rpc_rows(fn, params, idempotent=idempotent)
        return self._rpc(fn, params, idempotent=idempotent)

    def sync_pool(self, name: str, slots: int | None, windows: dict[str, Any] | None = None,
                  reserve: float | None = None) -> str:
        return str(self._rpc("sync_pool", {"p_name": name, "p_slots": slots, "p_windows": windows,
                                           "p_reserve": reserve}))

    def clear_throttle(self, pool: str) -> dict[str, Any]:
        value = self._rpc("clear_throttle", {"p_pool": pool}, idempotent=False)
        assert isinstance(value, dict)
        return value

    def sync_profile(self, name: str, pool: str | None, models: dict[str, str],
                     throttle_floor: float = 60.0) -> str:
        return str(self._rpc("sync_profile", {"p_name": name, "p_pool": pool, "p_models": models,
                                              "p_throttle_floor": throttle_floor}))

    def hand_off(self, task: int, token: UUID, snapshot: dict[str, Any]) -> str:
        return str(self._rpc("hand_off", {"p_task": task, "p_token": str(token), "p_snapshot": snapshot},
                             idempotent=False))

    def route(self, task: int, token: UUID, lane: str, note: Any = None) -> str:
        return str(self._rpc("route", {"p_task": task, "p_token": str(token), "p_lane": lane, "p_note": note},
                             idempotent=False))

    def record_run(self, token: UUID, report: dict[str, Any]) -> None:
        self._rpc("record_run", {"p_token": str(token), "p_report": report})

    def close_session(self, session: UUID, reason: str, snapshot: dict[str, Any]) -> int:
        # idempotent in SQL: closing twice returns the same lane hand-off
        return int(self._rpc("close_session", {"p_session": str(session), "p_reason": reason,
                                               "p_snapshot": snapshot}))

    def cancel(self, task: int) -> str:
        return str(self._rpc("cancel", {"p_task": task}))

    def retry(self, task: int) -> str:
        return str(self._rpc("retry", {"p_task": task}, idempotent=False))

    def sync_lane(self, name: str, settings: dict[str, Any]) -> str:
        return str(self._rpc("sync_lane", {"p_name": name, "p_settings": settings}))

    def pause_lane(self, name: str, reason: str) -> str:
        return str(self._rpc("pause_lane", {"p_lane": name, "p_reason": reason}))

    def retire_lane(self, name: str) -> str:
        return str(self._rpc("retire_lane", {"p_lane": name}))

    def unretire_lane(self, name: str) -> str:
        return str(self._rpc("unretire_lane", {"p_lane": name}))

    def reconcile(self, idle_seconds: int = 300, overdue_grace_seconds: int = 60) -> list[RepairAction]:
        rows = self._rpc("reconcile_json", {"p_idle_seconds": idle_seconds,  # one value: never cut
                                            "p_overdue_grace_seconds": overdue_grace_seconds})
        return [RepairAction.model_validate(r) for r in rows or []]

    def declare_session_lost(self, session: UUID, reason: str) -> list[RepairAction]:
        rows = self._rpc_rows("declare_session_lost", {"p_session": str(session), "p_reason": reason})
        return [RepairAction.model_validate(r) for r in rows]

    # -- workspaces (see :class:`worker.store.postgres.PostgresStore`)

    def touch_workspace(self, task: int, token: UUID, host: str, path: str, size: int | None = None) -> int:
        return int(self._rpc("touch_workspace", {"p_task": task, "p_token": str(token), "p_host": host,
                                                 "p_path": path, "p_bytes": size}))

    def task_workspace(self, task: int, token: UUID, host: str) -> str | None:
        path = self._rpc("task_workspace", {"p_task": task, "p_token": str(token), "p_host": host})
        return None if path is None else str(path)

    def workspaces_to_reap(self, host: str, limit: int = 100) -> list[dict[str, Any]]:
        rows = self._rpc_rows("workspaces_to_reap", {"p_host": host, "p_limit": limit})
        return [_times(r) for r in rows]

    def workspace_reaped(self, workspace: int, bytes_freed: int | None = None) -> bool:
        return bool(self._rpc("workspace_reaped", {"p_id": workspace, "p_bytes_freed": bytes_freed}))

    def workspace_usage(self) -> list[dict[str, Any]]:
        return self._rows("workspace_usage", lambda c: c.table("workspace_usage").select("*")
                          .order("lane").order("host"))

    def metrics_rows(self) -> list[dict[str, Any]]:
        """fleet.metrics() over RPC (see :meth:`worker.store.postgres.PostgresStore.metrics_rows`)."""
        return [dict(r) for r in self._rpc("metrics", {}) or []]  # one jsonb value: no db-max-rows cut

    # -- reads

    def check_schema(self) -> None:
        """Refuse to work on a database that lacks migrations this code needs, or that a newer
        lanefleet migrated (FLEET_ALLOW_NEWER_SCHEMA=1 allows the latter)."""
        from worker.db.migrate import load_migrations, refuse_newer, unknown_of

        try:
            applied = set(self._rpc("schema_versions", {}) or [])
        except FleetError as exc:
            if isinstance(exc, AccessDenied | DatabaseUnavailable):
                raise
            raise MigrationError(f"the Supabase project at {self.url} does not have lanefleet's schema: {exc.message}",
                                 "run `fleet migrate` with the project's connection string, and expose "
                                 "schema fleet in the API settings") from None
        ours = load_migrations()
        missing = [m for m in ours if m.version not in applied]
        if missing:
            raise MigrationError(f"the database of the Supabase project at {self.url} lacks {len(missing)} migration(s) "
                                 f"({missing[0].path.name}…)",
                                 "run `fleet migrate` with the project's connection string")
        refuse_newer(unknown_of(self._rpc("schema_migration_names", {}) or [], ours),
                     f"the database of the Supabase project at {self.url}")

    def query(self, name: str, **params: Any) -> list[dict[str, Any]]:
        """The named queries of queries.sql, each as its REST equivalent (same rows)."""
        if name == "task_by_id":
            return self._rows(name, lambda c: c.table("tasks").select("*").eq("id", int(params["id"])))
        if name == "task_by_key":
            return self._rows(name, lambda c: c.table("tasks").select("*").eq("key", params["key"]).order("id"))
        if name == "list_tasks":
            def build(c: Any) -> Any:
                q = c.table("tasks").select("*")
                if params.get("lane") is not None:
                    q = q.eq("lane", params["lane"])
                if params.get("state") is not None:
                    q = q.eq("state", params["state"])
                return q.order("id", desc=True)
            return self._rows(name, build, limit=int(params["limit"]))
        if name == "task_events":
            return self._rows(name, lambda c: c.table("journal").select("*").eq("task_id", int(params["id"]))
                              .order("id"))
        if name == "task_runs":
            return self._rows(name, lambda c: c.table("runs").select("*").eq("task_id", int(params["id"]))
                              .order("id"))
        if name == "last_lane_handoff":
            return self._rows(name, lambda c: c.table("lane_handoffs").select("*").eq("lane", params["lane"])
                              .order("id", desc=True), limit=1)
        if name == "list_lanes":
            return self._rows(name, lambda c: c.table("lanes").select("*").order("name"))
        if name == "list_pools":
            return self._rows(name, lambda c: c.table("pools").select(
                "name,slots,throttled_until,throttle_note,throttled_by").order("name"))
        if name == "active_sessions_on_host":
            return self._rows(name, lambda c: c.table("sessions").select("id,lane,pid,pid_started_at,pid_identity")
                              .eq("state", "active").eq("host", params["host"]).order("id"))
        if name in ("ready_by_lane", "lane_summary"):
            return [_times(r) for r in self._rpc_rows(name, {})]
        if name == "summary_with_prefix":
            return [_times(r) for r in self._rpc_rows("lane_summary", {"p_key_prefix": params["prefix"]})]
        if name == "states_with_prefix":
            found = self._rows(name, lambda c: c.table("tasks").select("state")
                               .like("key", str(params["prefix"]) + "*").order("id"))
            return [{"state": st, "n": n} for st, n in sorted(Counter(r["state"] for r in found).items())]
        raise FleetError(f"the named query {name!r} has no REST equivalent in the supabase store")
