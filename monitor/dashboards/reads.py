"""The dashboards' reads: the named queries of ``monitor/dashboards/queries.sql`` over the SQL views
of ``migrations/*_fleet_views.sql``, all in one read-only, repeatable-read transaction per refresh
(every section of a dashboard sees the same moment, and every window counts from that
transaction's ``now()``, the database's clock, never this host's), and the data of each dashboard.
"""

from __future__ import annotations

import functools
import json
import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
from psycopg_pool import PoolTimeout

from worker.errors import DatabaseUnavailable, FleetError
from worker.store.postgres import PostgresStore, translate
from worker.store.reads import load_queries

QUERIES = Path(__file__).with_name("queries.sql")
VIEW_DAYS = 30  # what throughput_hourly and usage_by_lane_day keep


@functools.cache
def queries() -> dict[str, str]:
    """The named queries of ``monitor/dashboards/queries.sql``, loaded once."""
    return load_queries(QUERIES)


class Reader:
    """Named queries on one connection, inside one read-only snapshot."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def rows(self, name: str, **params: Any) -> list[dict[str, Any]]:
        cur = self.conn.execute(queries()[name], params)
        return list(cur.fetchall()) if cur.description else []

    def one(self, name: str, **params: Any) -> dict[str, Any]:
        rows = self.rows(name, **params)
        return rows[0] if rows else {}

    def now(self) -> datetime:
        value = self.one("clock")["now"]
        assert isinstance(value, datetime)
        return value


def roll_up(store: PostgresStore) -> None:
    """Roll the closed hours up into ``fleet.lane_hours`` (a read, until an hour closes). The
    monitor pass is to call it too. A role that may not, or a read-only replica, just reads: the
    views compute the hours not rolled up live."""
    try:
        store._run("select fleet.roll_up_lane_hours()")
    except FleetError as exc:  # the store names every database error; its cause says which
        if not isinstance(exc.__cause__, psycopg.errors.InsufficientPrivilege | psycopg.errors.ReadOnlySqlTransaction):
            raise


@contextmanager
def reading(store: PostgresStore) -> Iterator[Reader]:
    """A :class:`Reader` in a read-only, repeatable-read transaction: one moment for every view."""
    try:
        with store.pool.connection() as conn, conn.transaction():
            conn.execute("set transaction isolation level repeatable read, read only")
            # No JIT for these reads (for this transaction only): PostgreSQL compiles a plan whose
            # cost passes jit_above_cost at every execution, and the cohort's plan passes it at 1 M
            # tasks by the branch it does not run (old cohorts), so `fleet stats` paid 150 ms of
            # compiling per cohort read (270 -> 122 ms at 7 days; bench/README.md, "JIT").
            conn.execute("select set_config('jit', 'off', true)")
            yield Reader(conn)
    except (PoolTimeout, psycopg.OperationalError) as exc:
        if isinstance(exc, psycopg.OperationalError) and exc.sqlstate and exc.sqlstate[:2] not in ("08", "57"):
            raise translate(exc) from exc
        raise DatabaseUnavailable(f"the database is unreachable: {exc}".strip()) from None
    except psycopg.Error as exc:
        raise translate(exc) from exc


# -- JSON


def jsonable(value: Any) -> Any:
    """Rows as JSON: numbers stay numbers (Decimal → float), times ISO 8601, ids strings."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() and value.as_tuple().exponent == 0 else float(value)
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, UUID):
        return str(value)
    return value


def dump(data: Any, *, pretty: bool = True) -> str:
    if pretty:
        return json.dumps(jsonable(data), indent=2)
    return json.dumps(jsonable(data), separators=(",", ":"))


# -- the data of each command


def status_data(r: Reader, lane: str | None = None, repairs: int = 10) -> dict[str, Any]:
    return {
        "as_of": r.now(),
        "lanes": r.rows("lane_overview", lane=lane),
        "stuck": r.rows("stuck_tasks", lane=lane),
        "blocked": r.rows("blocked_tasks", lane=lane),
        "attention": r.rows("attention_tasks", lane=lane),
        "pools": r.rows("pool_overview"),
        "windows": r.rows("pool_windows"),
        "sessions": r.rows("active_sessions", lane=lane),
        "repairs": r.rows("recent_repairs", lane=lane, limit=repairs),
    }


_USAGE_SUMS = ("runs", "completed", "input_tokens", "cache_creation_tokens", "cache_read_tokens",
               "output_tokens", "total_tokens", "cost_usd")


def _usage_sum(rows: list[dict[str, Any]], lane: str | None) -> dict[str, Any]:
    """The usage rows added up, with the shares and per-completed figures of the sums."""
    acc: dict[str, Any] = {"lane": lane, **{k: sum(row[k] or 0 for row in rows) for k in _USAGE_SUMS}}
    prompt = acc["input_tokens"] + acc["cache_creation_tokens"] + acc["cache_read_tokens"]
    acc["cache_read_share"] = round(acc["cache_read_tokens"] / prompt, 4) if prompt else None
    acc["cost_per_completed"] = (round(Decimal(acc["cost_usd"]) / acc["completed"], 6)
                                 if acc["completed"] else None)
    acc["tokens_per_completed"] = (round(acc["total_tokens"] / acc["completed"], 1)
                                   if acc["completed"] else None)
    return acc


def _usage_totals(usage: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per lane, its days added up."""
    by_lane: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in usage:
        by_lane[row["lane"]].append(row)
    return [_usage_sum(rows, lane) for lane, rows in sorted(by_lane.items())]


def stats_data(r: Reader, since_seconds: float, lane: str | None = None) -> dict[str, Any]:
    now = r.now()
    since = now - timedelta(seconds=since_seconds)
    usage = r.rows("usage_since", since=since, lane=lane)
    cohort = r.one("cohort", **{"from": since, "to": now, "lane": lane})
    by_lane = [] if lane is not None else [
        r.one("cohort", **{"from": since, "to": now, "lane": row["lane"]})
        for row in r.rows("entry_lanes", since=since)]
    split = r.rows("cohort_split", **{"from": since, "to": now, "lane": lane})
    return {"as_of": now, "since": since, "usage": usage, "usage_totals": _usage_totals(usage),
            "usage_total": _usage_sum(usage, None) if usage else None,
            "cohort": cohort, "cohort_by_lane": by_lane,
            # batched vs unbatched: only when the window saw a batch
            "cohort_split": split if any(row["batch_members"] for row in split) else [],
            # the triage lanes' verdicts of the window (none: no triage lane routed a task)
            "triage": r.rows("triage", **{"from": since, "to": now, "lane": lane})}


def snapshot_data(r: Reader, since_seconds: float, limit: int = 1000) -> dict[str, Any]:
    now = r.now()
    since = now - timedelta(seconds=since_seconds)
    stats = stats_data(r, since_seconds)
    return {
        "snapshot": "lanefleet",
        "version": 1,
        "taken_at": now,
        "since": since,
        "lanes": r.rows("lane_overview", lane=None),
        "stuck": r.rows("stuck_tasks", lane=None),
        "sessions": r.rows("sessions", lane=None),
        "repairs": r.rows("recent_repairs", lane=None, limit=limit),
        "dead_letters": r.rows("dead_letters", lane=None, limit=limit),
        "throughput": r.rows("throughput_since", since=since, lane=None),
        "usage": stats["usage"],
        "usage_totals": stats["usage_totals"],
        "usage_total": stats["usage_total"],
        "cohort": stats["cohort"],
        "cohort_by_lane": stats["cohort_by_lane"],
        "cohort_split": stats["cohort_split"],
        "windows": r.rows("pool_windows"),
        "window_outcomes": r.rows("window_outcomes", since=since),
    }


# -- the report: data


NICE_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
              86400, 2 * 86400, 7 * 86400]


def nice_step(span: float, target: int) -> int:
    """The smallest round bucket width that cuts ``span`` seconds into at most ``target`` buckets."""
    for step in NICE_STEPS:
        if span / step <= target:
            return step
    return NICE_STEPS[-1]


def bucket_floor(t: datetime, step: int) -> datetime:
    """The start of the ``step``-second bucket (from the epoch) that holds ``t``."""
    epoch = t.timestamp()
    return datetime.fromtimestamp(math.floor(epoch / step) * step, tz=UTC)


@dataclass
class ReportData:
    now: datetime
    since: datetime
    start: datetime  # where the charts begin: the window, or its first activity if later
    lane: str | None
    lanes: list[dict[str, Any]]
    cohort: dict[str, Any]
    dead_letters: list[dict[str, Any]]
    line_step: int
    bar_step: int
    # lane -> [(time, queued, running)]
    depth: dict[str, list[tuple[datetime, int, int]]] = field(default_factory=dict)
    # bucket start -> lane -> completed
    throughput: dict[datetime, dict[str, int]] = field(default_factory=dict)
    failed: dict[datetime, dict[str, int]] = field(default_factory=dict)
    wallclock: dict[str, list[float]] = field(default_factory=dict)
    usage: list[dict[str, Any]] = field(default_factory=list)
    # bucket start -> reason -> n
    repairs: dict[datetime, dict[str, int]] = field(default_factory=dict)


def report_data(r: Reader, since_seconds: float, lane: str | None = None) -> ReportData:
    now = r.now()
    since = now - timedelta(seconds=since_seconds)
    first = r.one("first_activity", since=since).get("first_ts")
    start = max(since, first - timedelta(seconds=1)) if isinstance(first, datetime) else since
    span = max((now - start).total_seconds(), 1.0)
    line_step, bar_step = nice_step(span, 150), nice_step(span, 40)
    line_origin, bar_origin = bucket_floor(start, line_step), bucket_floor(start, bar_step)
    data = ReportData(now=now, since=since, start=start, lane=lane,
                      lanes=r.rows("lane_overview", lane=lane),
                      cohort=r.one("cohort", **{"from": since, "to": now, "lane": lane}),
                      dead_letters=r.rows("dead_letters", lane=lane, limit=20),
                      line_step=line_step, bar_step=bar_step)

    # queue depth and running over time: the counts now, walked back through the journal's deltas
    live = {row["lane"]: (int(row["queued"]), int(row["running"])) for row in r.rows("live_counts")}
    deltas: dict[str, dict[datetime, tuple[int, int]]] = defaultdict(dict)
    for row in r.rows("queue_deltas", step=float(line_step), origin=line_origin):
        deltas[row["lane"]][row["bucket"]] = (int(row["dq"]), int(row["dr"]))
    n_buckets = int((now - line_origin).total_seconds() // line_step) + 1
    for name in sorted(set(live) | set(deltas)):
        if lane is not None and name != lane:
            continue
        q, run = live.get(name, (0, 0))
        q -= sum(d[0] for d in deltas[name].values())
        run -= sum(d[1] for d in deltas[name].values())
        points = [(line_origin, q, run)]
        for k in range(n_buckets):
            bucket = line_origin + timedelta(seconds=k * line_step)
            dq, dr = deltas[name].get(bucket, (0, 0))
            q, run = q + dq, run + dr
            points.append((min(bucket + timedelta(seconds=line_step), now), q, run))
        data.depth[name] = points

    for row in r.rows("run_outcomes", step=float(bar_step), origin=bar_origin, lane=lane):
        data.throughput.setdefault(row["bucket"], {})[row["lane"]] = int(row["completed"])
        data.failed.setdefault(row["bucket"], {})[row["lane"]] = int(row["failed"])
    for row in r.rows("stage_wallclock", origin=start, lane=lane):
        data.wallclock.setdefault(row["lane"], []).append(float(row["seconds"]))
    data.usage = r.rows("usage_days", origin=start, lane=lane)
    for row in r.rows("repairs_by_bucket", step=float(bar_step), origin=bar_origin, lane=lane):
        data.repairs.setdefault(row["bucket"], {})[row["reason"]] = int(row["n"])
    return data
