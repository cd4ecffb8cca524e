"""What the console reads, on both back-ends: a :class:`Snapshot` of the views for one page.

The figures are the views' (migrations/sources/14_dashboards.sql and the others): the console
defines none of its own. On Postgres a snapshot is the dashboards' own reader
(:func:`monitor.dashboards.reads.reading`: one read-only, repeatable-read transaction, their named
queries, and monitor/web/queries.sql for what only the console reads). Over Supabase's REST API
(a host with only the project URL and a fleet key) PostgREST reads the same views and tables with
the same filters and order, as the key's role: row level security and the SQL functions' own
checks decide what a lane-scoped key sees.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from monitor.dashboards.reads import Reader, reading
from worker.errors import InvalidInput
from worker.models import TASK_STATES
from worker.store.postgres import PostgresStore
from worker.store.reads import load_queries
from worker.store.supabase import SupabaseStore

QUERIES = Path(__file__).with_name("queries.sql")
STATES = TASK_STATES
# characters a REST filter value would have to quote (PostgREST's or=(...) syntax): refused on
# both back-ends alike, so a filter means the same everywhere
_RESERVED = set(',()"*\\%_')


@functools.cache
def queries() -> dict[str, str]:
    """The console's own named queries (monitor/web/queries.sql), loaded once."""
    return load_queries(QUERIES)


def check_filters(lane: str | None, state: str | None, key: str | None, text: str | None) -> None:
    """InvalidInput naming the filter that cannot be one."""
    if state is not None and state not in STATES:
        raise InvalidInput(f"state {state!r} is not a task state ({', '.join(STATES)})")
    for name, value in (("lane", lane), ("key", key), ("text", text)):
        if value is not None and (len(value) > 200 or any(c in _RESERVED for c in value)):
            raise InvalidInput(f"the {name} filter may not hold , ( ) \" * \\ % _ or be over 200 characters")


class Snapshot:
    """The reads of one page. Rows are dicts; times are datetimes where the back-end says so."""

    def now(self) -> datetime: raise NotImplementedError
    def lanes(self) -> list[dict[str, Any]]: raise NotImplementedError
    def pools(self) -> list[dict[str, Any]]: raise NotImplementedError
    def windows(self) -> list[dict[str, Any]]: raise NotImplementedError
    def throughput(self, since: datetime) -> list[dict[str, Any]]: raise NotImplementedError
    def tasks(self, lane: str | None, state: str | None, key: str | None, text: str | None,
              limit: int = 100) -> list[dict[str, Any]]: raise NotImplementedError
    def task(self, task: int) -> dict[str, Any] | None: raise NotImplementedError
    def runs(self, task: int) -> list[dict[str, Any]]: raise NotImplementedError
    def events(self, task: int, limit: int = 200) -> list[dict[str, Any]]: raise NotImplementedError
    def session(self, session: str) -> dict[str, Any] | None: raise NotImplementedError
    def blocked(self) -> list[dict[str, Any]]: raise NotImplementedError
    def review(self) -> list[dict[str, Any]]: raise NotImplementedError
    def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]: raise NotImplementedError
    def attention(self) -> list[dict[str, Any]]: raise NotImplementedError
    def stuck(self) -> list[dict[str, Any]]: raise NotImplementedError
    def stalled(self) -> list[dict[str, Any]]: raise NotImplementedError
    def batches(self, limit: int = 50) -> list[dict[str, Any]]: raise NotImplementedError
    def batch(self, batch: int) -> dict[str, Any]: raise NotImplementedError
    def repairs(self, limit: int = 200) -> list[dict[str, Any]]: raise NotImplementedError
    def throttles(self, since: datetime, limit: int = 200) -> list[dict[str, Any]]: raise NotImplementedError
    def cohort(self, since: datetime, until: datetime) -> dict[str, Any]: raise NotImplementedError


class PostgresSnapshot(Snapshot):
    """The dashboards' reader, in its one transaction."""

    def __init__(self, reader: Reader) -> None:
        self.r = reader

    def _ours(self, name: str, **params: Any) -> list[dict[str, Any]]:
        cur = self.r.conn.execute(queries()[name], params)
        return list(cur.fetchall()) if cur.description else []

    def now(self) -> datetime:
        return self.r.now()

    def lanes(self) -> list[dict[str, Any]]:
        return self.r.rows("lane_overview", lane=None)

    def pools(self) -> list[dict[str, Any]]:
        return self.r.rows("pool_overview")

    def windows(self) -> list[dict[str, Any]]:
        return self.r.rows("pool_windows")

    def throughput(self, since: datetime) -> list[dict[str, Any]]:
        return self.r.rows("throughput_since", since=since, lane=None)

    def tasks(self, lane: str | None, state: str | None, key: str | None, text: str | None,
              limit: int = 100) -> list[dict[str, Any]]:
        check_filters(lane, state, key, text)
        return self._ours("find_tasks", lane=lane, state=state, key=key, text=text, limit=limit)

    def task(self, task: int) -> dict[str, Any] | None:
        rows = self._ours("task", id=task)
        return rows[0] if rows else None

    def runs(self, task: int) -> list[dict[str, Any]]:
        return self._ours("task_runs", id=task)

    def events(self, task: int, limit: int = 200) -> list[dict[str, Any]]:
        return self._ours("task_events", id=task, limit=limit)

    def session(self, session: str) -> dict[str, Any] | None:
        rows = self._ours("session", id=session)
        return rows[0] if rows else None

    def blocked(self) -> list[dict[str, Any]]:
        return self.r.rows("blocked_tasks", lane=None)

    def review(self) -> list[dict[str, Any]]:
        return self._ours("review_queue")

    def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]:
        return self.r.rows("dead_letters", lane=None, limit=limit)

    def attention(self) -> list[dict[str, Any]]:
        return self.r.rows("attention_tasks", lane=None)

    def stuck(self) -> list[dict[str, Any]]:
        return self.r.rows("stuck_tasks", lane=None)

    def stalled(self) -> list[dict[str, Any]]:
        return self._ours("stalled_tasks")

    def batches(self, limit: int = 50) -> list[dict[str, Any]]:
        return self._ours("batch_overview", limit=limit)

    def batch(self, batch: int) -> dict[str, Any]:
        return cast(dict[str, Any], self._ours("batch_get", id=batch)[0]["batch"])

    def repairs(self, limit: int = 200) -> list[dict[str, Any]]:
        return self.r.rows("recent_repairs", lane=None, limit=limit)

    def throttles(self, since: datetime, limit: int = 200) -> list[dict[str, Any]]:
        return self._ours("throttles_since", since=since, limit=limit)

    def cohort(self, since: datetime, until: datetime) -> dict[str, Any]:
        return self.r.one("cohort", **{"from": since, "to": until, "lane": None})


class RestSnapshot(Snapshot):
    """The same reads through PostgREST, as the key of ``store``. There is no transaction across
    requests: each list is read at its own moment (a page's lists may be a few ms apart)."""

    def __init__(self, store: SupabaseStore) -> None:
        self.s = store

    def _view(self, view: str, *, order: list[tuple[str, bool]] | None = None, limit: int | None = None,
              eq: dict[str, Any] | None = None, gte: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        def build(c: Any) -> Any:
            q = c.table(view).select("*")
            for col, value in (eq or {}).items():
                if value is not None:
                    q = q.eq(col, value)
            for col, value in (gte or {}).items():
                q = q.gte(col, value.isoformat() if isinstance(value, datetime) else value)
            for col, desc in order or []:
                q = q.order(col, desc=desc)
            return q
        return self.s._rows(view, build, limit=limit)

    def now(self) -> datetime:
        # PostgREST tells no clock: this host's (only the page's "as of" and the windows use it)
        return datetime.now(UTC)

    def lanes(self) -> list[dict[str, Any]]:
        return self._view("lane_overview", order=[("lane", False)])

    def pools(self) -> list[dict[str, Any]]:
        return self._view("pool_overview", order=[("pool", False)])

    def windows(self) -> list[dict[str, Any]]:
        return self._view("pool_windows", order=[("pool", False), ("window_name", False)])

    def throughput(self, since: datetime) -> list[dict[str, Any]]:
        hour = since.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
        return self._view("throughput_hourly", gte={"hour": hour}, order=[("hour", False), ("lane", False)])

    def tasks(self, lane: str | None, state: str | None, key: str | None, text: str | None,
              limit: int = 100) -> list[dict[str, Any]]:
        check_filters(lane, state, key, text)

        def build(c: Any) -> Any:
            q = c.table("tasks").select("*")
            for col, value in (("lane", lane), ("state", state), ("key", key)):
                if value is not None:
                    q = q.eq(col, value)
            if text is not None:
                q = q.or_(f"key.ilike.*{text}*,title.ilike.*{text}*")
            return q.order("id", desc=True)
        return self.s._rows("tasks", build, limit=limit)

    def task(self, task: int) -> dict[str, Any] | None:
        rows = self._view("tasks", eq={"id": task})
        return rows[0] if rows else None

    def runs(self, task: int) -> list[dict[str, Any]]:
        return self._view("runs", eq={"task_id": task}, order=[("id", False)])

    def events(self, task: int, limit: int = 200) -> list[dict[str, Any]]:
        return self._view("journal", eq={"task_id": task}, order=[("id", True)], limit=limit)

    def session(self, session: str) -> dict[str, Any] | None:
        rows = self._view("session_overview", eq={"session_id": session})
        return rows[0] if rows else None

    def blocked(self) -> list[dict[str, Any]]:
        return self._view("blocked_tasks", order=[("blocked_at", False), ("id", False)])

    def review(self) -> list[dict[str, Any]]:
        return self._view("review_queue", order=[("since", False), ("id", False)])

    def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]:
        return self._view("dead_letters", order=[("died_at", True), ("task_id", True)], limit=limit)

    def attention(self) -> list[dict[str, Any]]:
        return self._view("attention_tasks", order=[("attention_at", False), ("id", False)])

    def stuck(self) -> list[dict[str, Any]]:
        return self._view("stuck_tasks", order=[("stage_started_at", False), ("task_id", False)])

    def stalled(self) -> list[dict[str, Any]]:
        return self.s.stalled_tasks()

    def batches(self, limit: int = 50) -> list[dict[str, Any]]:
        return self._view("batch_overview", order=[("id", True)], limit=limit)

    def batch(self, batch: int) -> dict[str, Any]:
        return cast(dict[str, Any], self.s.batch_call("batch_get", {"p_batch": batch}, idempotent=True))

    def repairs(self, limit: int = 200) -> list[dict[str, Any]]:
        return self._view("recent_repairs", order=[("ts", True), ("event_id", True)], limit=limit)

    def throttles(self, since: datetime, limit: int = 200) -> list[dict[str, Any]]:
        return self._view("events", eq={"kind": "throttled"}, gte={"ts": since}, order=[("id", True)],
                          limit=limit)

    def cohort(self, since: datetime, until: datetime) -> dict[str, Any]:
        rows = self.s._rpc_rows("cohort_metrics", {"p_from": since.isoformat(), "p_to": until.isoformat(),
                                                   "p_lane": None})
        return dict(rows[0]) if rows else {}


@contextmanager
def snapshot(store: PostgresStore | SupabaseStore) -> Iterator[Snapshot]:
    """The reads of one page on ``store``'s back-end."""
    if isinstance(store, SupabaseStore):
        yield RestSnapshot(store)
        return
    with reading(store) as r:
        yield PostgresSnapshot(r)
