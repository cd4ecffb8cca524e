"""Operator dashboards (DESIGN §10): ``fleet status``, ``fleet stats``, ``fleet snapshot``, ``fleet report``.

They read the SQL views of ``migrations/*_fleet_views.sql`` through the named queries of
``monitor/queries.sql``, all in one read-only, repeatable-read transaction per refresh: every
section of a dashboard sees the same moment, and every window counts from that transaction's
``now()`` (the database's clock, never this host's).

The report is one self-contained HTML file: the charts are SVG drawn here, the little script in it
only wires the legends, and nothing is fetched from the network when it is opened.
"""

from __future__ import annotations

import functools
import html
import json
import math
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any
from uuid import UUID

import psycopg
import typer
from psycopg_pool import PoolTimeout
from rich.console import Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from monitor.commands import flag_duration
from worker.cli.context import JsonOpt, console, rt
from worker.errors import DatabaseUnavailable, FleetError, InvalidInput, UnknownLane
from worker.store.postgres import PostgresStore, translate
from worker.store.reads import load_queries

QUERIES = Path(__file__).with_name("queries.sql")
VIEW_DAYS = 30  # what throughput_hourly and usage_by_lane_day keep


@functools.cache
def queries() -> dict[str, str]:
    """The named queries of ``monitor/queries.sql``, loaded once."""
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


def dashboard_store(ctx: typer.Context) -> PostgresStore:
    """The dashboards read the views in one transaction over a database connection."""
    store = rt(ctx).store()
    if not isinstance(store, PostgresStore):
        raise InvalidInput(
            "the dashboards need a database connection (DATABASE_URL); over Supabase's API, read "
            "the views (fleet.lane_overview, …) with an operator key, or in the SQL editor"
        )
    return store


def roll_up(store: PostgresStore) -> None:
    """Roll the closed hours up into ``fleet.lane_hours`` (a read, until an hour closes). The
    monitor pass is to call it too. A role that may not, or a read-only replica, just reads: the
    views compute the hours not rolled up live."""
    try:
        store._run("select fleet.roll_up_lane_hours()")
    except (psycopg.errors.InsufficientPrivilege, psycopg.errors.ReadOnlySqlTransaction):
        pass


@contextmanager
def reading(store: PostgresStore) -> Iterator[Reader]:
    """A :class:`Reader` in a read-only, repeatable-read transaction: one moment for every view."""
    try:
        with store.pool.connection() as conn, conn.transaction():
            conn.execute("set transaction isolation level repeatable read, read only")
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


# -- options


def check_lane(store: PostgresStore, lane: str | None) -> None:
    if lane is None:
        return
    names = store.lane_names()
    if lane not in names:
        raise UnknownLane(f"unknown lane {lane!r}", "known lanes: " + (", ".join(names) or "none"))


LaneOpt = Annotated[str | None, typer.Option("--lane", "-l", help="only this lane")]
SinceOpt = Annotated[str, typer.Option("--since", help="the window: 24h, 7d, ... (counted from the database's now())")]


# -- the data of each command


def status_data(r: Reader, lane: str | None = None, repairs: int = 10) -> dict[str, Any]:
    return {
        "as_of": r.now(),
        "lanes": r.rows("lane_overview", lane=lane),
        "stuck": r.rows("stuck_tasks", lane=lane),
        "blocked": r.rows("blocked_tasks", lane=lane),
        "attention": r.rows("attention_tasks", lane=lane),
        "pools": r.rows("pool_overview"),
        "sessions": r.rows("active_sessions", lane=lane),
        "repairs": r.rows("recent_repairs", lane=lane, limit=repairs),
    }


def _usage_totals(usage: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("runs", "completed", "input_tokens", "cache_creation_tokens", "cache_read_tokens",
            "output_tokens", "total_tokens", "cost_usd")
    by_lane: dict[str, dict[str, Any]] = {}
    for row in usage:
        acc = by_lane.setdefault(row["lane"], {"lane": row["lane"], **{k: 0 for k in keys}})
        for k in keys:
            acc[k] += row[k] or 0
    out = []
    for acc in sorted(by_lane.values(), key=lambda a: str(a["lane"])):
        prompt = acc["input_tokens"] + acc["cache_creation_tokens"] + acc["cache_read_tokens"]
        acc["cache_read_share"] = round(acc["cache_read_tokens"] / prompt, 4) if prompt else None
        acc["cost_per_completed"] = (round(Decimal(acc["cost_usd"]) / acc["completed"], 6)
                                     if acc["completed"] else None)
        acc["tokens_per_completed"] = (round(acc["total_tokens"] / acc["completed"], 1)
                                       if acc["completed"] else None)
        out.append(acc)
    return out


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
            "cohort": cohort, "cohort_by_lane": by_lane,
            # batched vs unbatched: only when the window saw a batch
            "cohort_split": split if any(row["batch_members"] for row in split) else []}


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
        "cohort": stats["cohort"],
        "cohort_by_lane": stats["cohort_by_lane"],
        "cohort_split": stats["cohort_split"],
    }


# -- terminal rendering


def fmt_secs(value: Any) -> str:
    if value is None:
        return "—"
    s = float(value)
    sign = "-" if s < 0 else ""
    s = abs(s)
    if s < 1:
        return f"{sign}{s * 1000:.0f}ms"
    if s < 10:
        return f"{sign}{s:.1f}s".replace(".0s", "s")
    if s < 60:
        return f"{sign}{s:.0f}s"
    if s < 3600:
        return f"{sign}{int(s // 60)}m{int(s % 60):02d}s"
    if s < 86400:
        return f"{sign}{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{sign}{int(s // 86400)}d{int(s % 86400 // 3600):02d}h"


def fmt_num(value: Any) -> str:
    if value is None:
        return "—"
    v = float(value)
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= limit:
            return f"{v / limit:.1f}{suffix}"
    return f"{v:.0f}" if v == int(v) else f"{v:.1f}"


def fmt_cost(value: Any) -> str:
    return "—" if value is None else f"${float(value):,.4f}"


def fmt_share(value: Any) -> str:
    return "—" if value is None else f"{float(value) * 100:.1f}%"


def _ago(now: datetime, when: Any) -> str:
    if not isinstance(when, datetime):
        return "—"
    return fmt_secs((now - when).total_seconds()) + " ago"


def render_status(data: dict[str, Any]) -> RenderableType:
    now: datetime = data["as_of"]
    lanes = Table("lane", "queued", "ready", "later", "running", "slots", "idle", "oldest ready",
                  "done 24h", "failed", "dead", "cancelled", "retries", "hand-offs", "repairs",
                  "shifts", "last hand-off", title="lanes", title_justify="left")
    for row in data["lanes"]:
        name = row["lane"] + (" [yellow](paused)[/]" if row["paused"] else "")
        lanes.add_row(name, str(row["queued"]), str(row["ready"]), str(row["scheduled"]),
                      str(row["running"]), "∞" if row["slots"] is None else str(row["slots"]),
                      "—" if row["idle_slots"] is None else str(row["idle_slots"]),
                      fmt_secs(row["oldest_ready_seconds"]), str(row["done_24h"]),
                      _red(row["failed_24h"]), _red(row["dead_24h"]), str(row["cancelled_24h"]),
                      str(row["retries_24h"]), str(row["handoffs_24h"]), _red(row["repairs_24h"]),
                      str(row["active_sessions"]), _ago(now, row["last_handoff_at"]))
    parts: list[RenderableType] = [lanes]

    if data["stuck"]:
        stuck = Table("task", "lane", "key", "why", "running", "lane p95", "lease left", "shift",
                      title="stuck tasks", title_justify="left", title_style="bold red")
        for row in data["stuck"]:
            stuck.add_row(str(row["task_id"]), row["lane"], escape(row["key"]), ", ".join(row["reasons"]),
                          fmt_secs(row["running_seconds"]), fmt_secs(row["lane_p95_seconds"]),
                          fmt_secs(row["lease_remaining_seconds"]),
                          f"{escape(row['host'])}:{row['pid']} ({row['session_state']})")
        parts.append(stuck)
    else:
        parts.append(Text("stuck tasks: none", style="green"))

    if data.get("blocked"):
        blocked = Table("task", "lane", "key", "why", "tier", "profile", "blocked", "evidence",
                        title="blocked tasks: `fleet resume TASK` re-runs the gate, `fleet retry TASK` the agent",
                        title_justify="left", title_style="bold yellow")
        for row in data["blocked"]:
            evidence = (row["evidence"] or "").strip().splitlines()
            blocked.add_row(str(row["id"]), row["lane"], escape(row["key"]), row["block_reason"],
                            row["tier"] or "", row["profile"] or "", _ago(now, row["blocked_at"]),
                            escape(evidence[-1][:80] if evidence else ""))
        parts.append(blocked)

    if data.get("attention"):
        waiting = Table("task", "lane", "key", "waits for", "since", "host:pid",
                        title="needs attention (an agent waits on a question or a permission prompt)",
                        title_justify="left", title_style="bold yellow")
        for row in data["attention"]:
            waiting.add_row(str(row["id"]), row["lane"], escape(row["key"]), escape(row["attention"] or ""),
                            _ago(now, row["attention_at"]), f"{escape(row['host'])}:{row['pid']}")
        parts.append(waiting)

    if data.get("pools"):
        pools = Table("pool", "slots", "in use", "throttled until", "throttles today", "spill-overs today",
                      "profiles", title="capacity pools", title_justify="left")
        for row in data["pools"]:
            until = row["throttled_until"]
            pools.add_row(row["pool"], "∞" if row["slots"] is None else str(row["slots"]), str(row["in_use"]),
                          f"[red]{until:%Y-%m-%d %H:%M:%S}[/]" if until else "—", _red(row["throttles_today"]),
                          str(row["spillovers_today"]), escape(row["profiles"] or ""))
        parts.append(pools)

    if data["sessions"]:
        sessions = Table("session", "lane", "host:pid", "age", "deadline in", "heartbeat", "holds",
                         "runs", "done", "failed", "hand-offs", "tokens", "cost",
                         title="active shifts", title_justify="left")
        for row in data["sessions"]:
            sessions.add_row(str(row["session_id"])[:8], row["lane"], f"{escape(row['host'])}:{row['pid']}",
                             fmt_secs(row["age_seconds"]), fmt_secs(row["deadline_in_seconds"]),
                             fmt_secs(row["heartbeat_age_seconds"]) + " ago", str(row["tasks_held"]),
                             str(row["runs"]), str(row["done"]), str(row["failed"]),
                             str(row["handed_off"]), fmt_num(row["tokens"]), fmt_cost(row["cost_usd"]))
        parts.append(sessions)
    else:
        parts.append(Text("active shifts: none"))

    if data["repairs"]:
        repairs = Table("when", "lane", "task", "key", "reason", "→", "host:pid",
                        title="recent repairs (7 days)", title_justify="left")
        for row in data["repairs"]:
            repairs.add_row(_ago(now, row["ts"]), row["lane"] or "", str(row["task_id"]),
                            escape(row["key"] or ""), row["reason"] or "", row["state"] or "",
                            f"{escape(row['host'] or '?')}:{row['pid'] or '?'}")
        parts.append(repairs)
    else:
        parts.append(Text("recent repairs: none in 7 days"))
    parts.append(Text(f"as of {now:%Y-%m-%d %H:%M:%S %Z} (database time)", style="dim"))
    return Group(*parts)


def _red(n: Any) -> str:
    return f"[red]{n}[/]" if n else str(n)


def render_stats(data: dict[str, Any]) -> RenderableType:
    since: datetime = data["since"]
    usage = Table("day (UTC)", "lane", "runs", "completed", "input", "cache write", "cache read",
                  "output", "cache-read share", "cost", "cost/completed", "tokens/completed",
                  title=f"usage since {since:%Y-%m-%d %H:%M} UTC", title_justify="left")
    for row in data["usage"]:
        usage.add_row(str(row["day"]), row["lane"], str(row["runs"]), str(row["completed"]),
                      fmt_num(row["input_tokens"]), fmt_num(row["cache_creation_tokens"]),
                      fmt_num(row["cache_read_tokens"]), fmt_num(row["output_tokens"]),
                      fmt_share(row["cache_read_share"]), fmt_cost(row["cost_usd"]),
                      fmt_cost(row["cost_per_completed"]), fmt_num(row["tokens_per_completed"]))
    if data["usage_totals"]:
        usage.add_section()
        for row in data["usage_totals"]:
            usage.add_row("[bold]total[/]", row["lane"], str(row["runs"]), str(row["completed"]),
                          fmt_num(row["input_tokens"]), fmt_num(row["cache_creation_tokens"]),
                          fmt_num(row["cache_read_tokens"]), fmt_num(row["output_tokens"]),
                          fmt_share(row["cache_read_share"]), fmt_cost(row["cost_usd"]),
                          fmt_cost(row["cost_per_completed"]), fmt_num(row["tokens_per_completed"]))
    cohort = Table("cohort", "tasks", "done", "dead", "cancelled", "open", "makespan", "wall p50",
                   "wall p95", "attempts/task", "failures", "hand-offs", "repairs", "tokens/done",
                   "cost/done", "interventions",
                   title=f"cohort: tasks queued since {since:%Y-%m-%d %H:%M} UTC", title_justify="left")
    rows = [data["cohort"], *data["cohort_by_lane"]]
    for row in rows:
        if not row:
            continue
        cohort.add_row(row["lane"] or "[bold]all lanes[/]", str(row["tasks"]), str(row["completed"]),
                       str(row["dead"]), str(row["cancelled"]), str(row["open"]),
                       fmt_secs(row["makespan_seconds"]), fmt_secs(row["wall_p50_seconds"]),
                       fmt_secs(row["wall_p95_seconds"]),
                       "—" if row["attempts_per_task"] is None else f"{row['attempts_per_task']}",
                       str(row["failures"]), str(row["handoffs"]), str(row["repairs"]),
                       fmt_num(row["tokens_per_completed"]), fmt_cost(row["cost_per_completed"]),
                       f"{row['interventions']} ({row['operator_cancels']} cancels, "
                       f"{row['operator_retries']} retries)")
    if not data.get("cohort_split"):
        return Group(usage, cohort)
    split = Table("tasks", "tasks", "done", "makespan", "tokens/done", "cache-read share", "cost/done",
                  "ship runs/done", "batches", "members", "evicted", "blocks", "interventions",
                  title="the same cohort, batched vs unbatched (fleet.cohort_split)", title_justify="left")
    for row in data["cohort_split"]:
        split.add_row(row["cohort"], str(row["tasks"]), str(row["completed"]), fmt_secs(row["makespan_seconds"]),
                      fmt_num(row["tokens_per_completed"]), fmt_share(row["cache_read_share"]),
                      fmt_cost(row["cost_per_completed"]),
                      "—" if row["ship_runs_per_completed"] is None else f"{row['ship_runs_per_completed']}",
                      str(row["batches"]), str(row["batch_members"]),
                      f"{row['evicted']} ({fmt_share(row['eviction_rate'])})" if row["batch_members"] else "—",
                      str(row["blocks"]), str(row["interventions"]))
    return Group(usage, cohort, split)


# -- the report: data


NICE_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
              86400, 2 * 86400, 7 * 86400]


def nice_step(span: float, target: int) -> int:
    """The smallest round bucket width that cuts ``span`` seconds into at most ``target`` buckets."""
    for step in NICE_STEPS:
        if span / step <= target:
            return step
    return NICE_STEPS[-1]


def _floor(t: datetime, step: int) -> datetime:
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
    line_origin, bar_origin = _floor(start, line_step), _floor(start, bar_step)
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


# -- the report: SVG charts

PALETTE = ["#2f6fd0", "#e0712c", "#2a9d5b", "#c23b5a", "#8a5cc9", "#9a7b1d", "#1f9eb0", "#d14fa8",
           "#5f6b7a", "#6aa12b"]
TOKEN_COLORS = {"input_tokens": "#2f6fd0", "cache_creation_tokens": "#e0a030",
                "cache_read_tokens": "#7fb8e6", "output_tokens": "#2a9d5b"}
TOKEN_LABELS = {"input_tokens": "input (fresh)", "cache_creation_tokens": "cache write",
                "cache_read_tokens": "cache read", "output_tokens": "output"}

W, H = 920, 280
ML, MR, MT, MB = 64, 64, 16, 46  # margins: left, right, top, bottom


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def nice_ticks(value: float, *, integer: bool = False, most: int = 5) -> tuple[float, float]:
    """(top, step): a round tick step and the axis top, a whole number of steps above ``value``
    (steps of 1, 2 or 5 times a power of ten; whole numbers for counts)."""
    value = max(value, 1e-9)
    raw = value / most
    exp = 10.0 ** math.floor(math.log10(raw))
    step = next(m * exp for m in (1, 2, 2.5, 5, 10) if m * exp >= raw)
    if integer:
        step = max(1.0, math.ceil(step))
    return math.ceil(value / step - 1e-9) * step, step


def _num(v: float) -> str:
    return fmt_num(v) if abs(v) >= 1000 or v == int(v) else f"{v:.2g}"


def _time_label(t: datetime, span: float) -> str:
    t = t.astimezone(UTC)
    if span <= 3 * 3600:
        return t.strftime("%H:%M:%S") if span < 600 else t.strftime("%H:%M")
    if span <= 3 * 86400:
        return t.strftime("%m-%d %H:%M")
    return t.strftime("%m-%d")


class Plot:
    """One SVG chart: a frame, a y axis from 0, a time or category x axis, and a legend."""

    def __init__(self, chart: str, y_max: float, *, y_label: str = "", y2_max: float | None = None,
                 y2_label: str = "", integer: bool = True) -> None:
        self.chart = chart
        self.y_max, self.y_step = nice_ticks(y_max, integer=integer)
        self.y2_max: float | None = None
        if y2_max is not None:  # the same gridlines, with round steps of their own
            n = round(self.y_max / self.y_step)
            raw = max(y2_max, 1e-9) / n
            exp = 10.0 ** math.floor(math.log10(raw))
            self.y2_max = n * next(m * exp for m in (1, 2, 2.5, 5, 10) if m * exp >= raw)
        self.y_label, self.y2_label = y_label, y2_label
        self.body: list[str] = []
        self.legend: list[tuple[str, str, str]] = []  # (series, label, color)

    # geometry
    @property
    def plot_w(self) -> float:
        return W - ML - MR

    @property
    def plot_h(self) -> float:
        return H - MT - MB

    def y(self, v: float) -> float:
        return MT + self.plot_h * (1 - v / self.y_max)

    def y2(self, v: float) -> float:
        assert self.y2_max is not None
        return MT + self.plot_h * (1 - v / self.y2_max)

    def axes(self, x_ticks: Sequence[tuple[float, str]]) -> str:
        out = [f'<rect x="{ML}" y="{MT}" width="{self.plot_w:.1f}" height="{self.plot_h:.1f}" class="frame"/>']
        n = round(self.y_max / self.y_step)
        for i in range(n + 1):
            v = self.y_step * i
            yy = self.y(v)
            out.append(f'<line x1="{ML}" x2="{W - MR}" y1="{yy:.1f}" y2="{yy:.1f}" class="grid"/>')
            out.append(f'<text x="{ML - 6}" y="{yy + 4:.1f}" class="tick" text-anchor="end">{_e(_num(v))}</text>')
            if self.y2_max is not None:
                v2 = self.y2_max * i / n
                out.append(f'<text x="{W - MR + 6}" y="{yy + 4:.1f}" class="tick y2">{_e(f"${v2:.4g}")}</text>')
        for x, label in x_ticks:
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MT + self.plot_h:.1f}" y2="{MT + self.plot_h + 4:.1f}" class="axis"/>')
            out.append(f'<text x="{x:.1f}" y="{MT + self.plot_h + 18:.1f}" class="tick" text-anchor="middle">{_e(label)}</text>')
        if self.y_label:
            out.append(f'<text x="14" y="{MT + self.plot_h / 2:.1f}" class="axis-label" '
                       f'transform="rotate(-90 14 {MT + self.plot_h / 2:.1f})" text-anchor="middle">{_e(self.y_label)}</text>')
        if self.y2_label:
            x2 = W - 10
            out.append(f'<text x="{x2}" y="{MT + self.plot_h / 2:.1f}" class="axis-label y2" '
                       f'transform="rotate(90 {x2} {MT + self.plot_h / 2:.1f})" text-anchor="middle">{_e(self.y2_label)}</text>')
        return "".join(out)

    def svg(self, x_ticks: Sequence[tuple[float, str]], title: str) -> str:
        legend = "".join(
            f'<span class="legend-item" data-series="{_e(s)}"><i style="background:{c}"></i>{_e(label)}</span>'
            for s, label, c in self.legend)
        return (f'<figure class="chart" data-chart="{_e(self.chart)}"><figcaption>{_e(title)}</figcaption>'
                f'<div class="legend">{legend}</div>'
                f'<svg class="chart-svg" data-chart="{_e(self.chart)}" viewBox="0 0 {W} {H}" '
                f'width="100%" role="img" aria-label="{_e(title)}" xmlns="http://www.w3.org/2000/svg">'
                f'{self.axes(x_ticks)}{"".join(self.body)}</svg></figure>')


def _time_axis(start: datetime, end: datetime) -> tuple[Any, list[tuple[float, str]]]:
    t0, t1 = start.timestamp(), max(end.timestamp(), start.timestamp() + 1)
    span = t1 - t0

    def x(t: datetime) -> float:
        return ML + (W - ML - MR) * (t.timestamp() - t0) / span

    step = nice_step(span, 6)
    first = math.ceil(t0 / step) * step
    ticks = []
    k = first
    while k <= t1:
        when = datetime.fromtimestamp(k, tz=UTC)
        ticks.append((x(when), _time_label(when, span)))
        k += step
    return x, ticks


def chart_queue(d: ReportData) -> str:
    """Queue depth (solid) and running (dashed) per lane over time."""
    peak = max([max(q, run) for pts in d.depth.values() for _, q, run in pts] + [1])
    p = Plot("queue", peak, y_label="tasks")
    first = min((pts[0][0] for pts in d.depth.values()), default=d.start)
    x, ticks = _time_axis(first, d.now)
    for i, (name, pts) in enumerate(sorted(d.depth.items())):
        color = PALETTE[i % len(PALETTE)]
        for kind, idx, dash in (("queued", 1, ""), ("running", 2, ' stroke-dasharray="5 3"')):
            values = [(t, q if idx == 1 else run) for t, q, run in pts]
            coords = " ".join(f"{x(t):.1f},{p.y(v):.1f}" for t, v in values)
            p.body.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.8"{dash} '
                          f'data-series="{_e(name)}" data-kind="{kind}"/>')
            for t, v in values:
                p.body.append(f'<circle cx="{x(t):.1f}" cy="{p.y(v):.1f}" r="1.6" fill="{color}" '
                              f'data-series="{_e(name)}" data-kind="{kind}" data-t="{_iso(t)}" data-v="{v}">'
                              f'<title>{_e(name)} {kind} at {_iso(t)}: {v}</title></circle>')
        last = pts[-1]
        p.body.append(f'<text x="{x(last[0]) - 4:.1f}" y="{p.y(last[1]) - 5:.1f}" class="end-label" '
                      f'text-anchor="end" fill="{color}" data-series="{_e(name)}" data-end="queued">{last[1]}</text>')
        p.legend.append((name, f"{name}: queued ━ running ╌", color))
    return p.svg(ticks, "Queue depth (solid) and running (dashed) per lane — from the journal")


def _stacked_bars(p: Plot, x: Any, buckets: Sequence[datetime], step: int,
                  stacks: dict[datetime, dict[str, int]], names: list[str], colors: dict[str, str],
                  kind: str) -> None:
    width = max(1.0, (x(buckets[0] + timedelta(seconds=step)) - x(buckets[0])) * 0.8) if buckets else 1.0
    for b in buckets:
        base = 0
        for name in names:
            v = stacks.get(b, {}).get(name, 0)
            if not v:
                continue
            y0, y1 = p.y(base), p.y(base + v)
            p.body.append(f'<rect x="{x(b) + width * 0.1:.1f}" y="{y1:.1f}" width="{width:.1f}" '
                          f'height="{max(y0 - y1, 0.5):.1f}" fill="{colors[name]}" data-series="{_e(name)}" '
                          f'data-kind="{kind}" data-t="{_iso(b)}" data-v="{v}">'
                          f'<title>{_e(name)} {_iso(b)}: {v} {kind}</title></rect>')
            base += v


def chart_throughput(d: ReportData) -> str:
    names = sorted({n for per in d.throughput.values() for n in per if per[n]})
    colors = {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(sorted(set(names) | set(d.depth)))}
    peak = max([sum(per.values()) for per in d.throughput.values()] + [1])
    p = Plot("throughput", peak, y_label=f"completed per {fmt_secs(d.bar_step)}")
    buckets = sorted(d.throughput)
    origin = _floor(d.start, d.bar_step)
    x, ticks = _time_axis(origin, d.now + timedelta(seconds=d.bar_step))
    _stacked_bars(p, x, buckets, d.bar_step, d.throughput, names, colors, "completed")
    total = {n: sum(per.get(n, 0) for per in d.throughput.values()) for n in names}
    for n in names:
        p.legend.append((n, f"{n}: {total[n]}", colors[n]))
    return p.svg(ticks, f"Throughput per lane — tasks (or stages) completed per {fmt_secs(d.bar_step)}")


def histogram_bins(values: list[float], n: int = 16) -> list[tuple[float, float, int]]:
    """Bins over the values: log-spaced when they span more than a decade, else even."""
    if not values:
        return []
    lo, hi = min(values), max(values)
    if hi <= lo:
        return [(lo, hi, len(values))]
    if lo > 0 and hi / lo > 10:
        edges = [lo * (hi / lo) ** (i / n) for i in range(n + 1)]
    else:
        edges = [lo + (hi - lo) * i / n for i in range(n + 1)]
    counts = [0] * n
    for v in values:
        i = min(int(next((k for k in range(n) if v < edges[k + 1]), n - 1)), n - 1)
        counts[i] += 1
    return [(edges[i], edges[i + 1], counts[i]) for i in range(n)]


def _percentile(values: list[float], q: float) -> float | None:
    """percentile_cont, as the views compute it."""
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def chart_wallclock(d: ReportData) -> str:
    values = [v for vs in d.wallclock.values() for v in vs]
    bins = histogram_bins(values)
    p = Plot("wallclock", max([c for _, _, c in bins] + [1]), y_label="stages completed")
    n = max(len(bins), 1)
    bw = p.plot_w / n
    ticks = []
    for i, (lo, hi, c) in enumerate(bins):
        x0 = ML + i * bw
        if c:
            p.body.append(f'<rect x="{x0 + 1:.1f}" y="{p.y(c):.1f}" width="{bw - 2:.1f}" '
                          f'height="{p.y(0) - p.y(c):.1f}" fill="#2f6fd0" data-series="stages" '
                          f'data-lo="{lo:.3f}" data-hi="{hi:.3f}" data-v="{c}">'
                          f'<title>{fmt_secs(lo)} – {fmt_secs(hi)}: {c}</title></rect>')
        if i % max(1, n // 8) == 0:
            ticks.append((x0, fmt_secs(lo)))
    if bins:
        ticks.append((ML + n * bw, fmt_secs(bins[-1][1])))
        for name, q, color in (("p50", 0.5, "#2a9d5b"), ("p95", 0.95, "#c23b5a")):
            v = _percentile(values, q)
            assert v is not None
            idx = next((i for i, (lo, hi, _) in enumerate(bins) if lo <= v <= hi), len(bins) - 1)
            lo, hi, _ = bins[idx]
            frac = 0.5 if hi <= lo else (v - lo) / (hi - lo)
            xx = ML + (idx + frac) * bw
            p.body.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{MT}" y2="{MT + p.plot_h}" stroke="{color}" '
                          f'stroke-width="1.5" stroke-dasharray="4 3" data-marker="{name}" data-v="{v:.1f}"/>')
            right = xx > W - MR - 90  # near the right edge: the label goes left of its line
            p.body.append(f'<text x="{xx - 4 if right else xx + 4:.1f}" y="{MT + 12 + (14 if name == "p95" else 0)}" '
                          f'class="marker" fill="{color}" text-anchor="{"end" if right else "start"}">'
                          f'{name} {fmt_secs(v)}</text>')
            p.legend.append((name, f"{name} {fmt_secs(v)}", color))
    p.legend.insert(0, ("stages", f"{len(values)} stages", "#2f6fd0"))
    return p.svg(ticks, "Wall-clock distribution — first claim in the lane → finish, of the stages completed")


def chart_usage(d: ReportData) -> str:
    kinds = list(TOKEN_COLORS)
    days = [row["day"] for row in d.usage]
    peak = max([sum(int(row[k]) for k in kinds) for row in d.usage] + [1])
    cost_peak = max([float(row["cost_usd"]) for row in d.usage] + [0.0001])
    p = Plot("usage", peak, y_label="tokens", y2_max=cost_peak, y2_label="cost (USD)", integer=True)
    n = max(len(days), 1)
    bw = p.plot_w / n
    bar = min(bw * 0.7, 56.0)
    ticks = []
    cost_pts = []
    for i, row in enumerate(d.usage):
        x0 = ML + i * bw
        base = 0
        for k in kinds:
            v = int(row[k])
            if v:
                p.body.append(f'<rect x="{x0 + (bw - bar) / 2:.1f}" y="{p.y(base + v):.1f}" width="{bar:.1f}" '
                              f'height="{max(p.y(base) - p.y(base + v), 0.5):.1f}" fill="{TOKEN_COLORS[k]}" '
                              f'data-series="{k}" data-day="{row["day"]}" data-v="{v}">'
                              f'<title>{row["day"]} {TOKEN_LABELS[k]}: {v:,}</title></rect>')
            base += v
        p.body.append(f'<text x="{x0 + bw / 2:.1f}" y="{p.y(base) - 4:.1f}" class="bar-label" text-anchor="middle" '
                      f'data-day="{row["day"]}" data-total="{base}">{fmt_num(base)}</text>')
        cost = float(row["cost_usd"])
        cost_pts.append((x0 + bw / 2, p.y2(cost), cost, row["day"]))
        if n <= 16 or i % math.ceil(n / 16) == 0:
            ticks.append((x0 + bw / 2, str(row["day"])))
    if cost_pts:
        p.body.append('<polyline points="' + " ".join(f"{cx:.1f},{cy:.1f}" for cx, cy, _, _ in cost_pts)
                      + '" fill="none" stroke="#c23b5a" stroke-width="2" data-series="cost"/>')
        for cx, cy, cost, day in cost_pts:
            p.body.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3.5" fill="#c23b5a" data-series="cost" '
                          f'data-day="{day}" data-v="{cost:.6f}"><title>{day} cost: ${cost:.4f}</title></circle>')
    for k in kinds:
        p.legend.append((k, TOKEN_LABELS[k], TOKEN_COLORS[k]))
    p.legend.append(("cost", "cost (right axis)", "#c23b5a"))
    return p.svg(ticks, "Tokens by kind (bars) and cost (line) per UTC day — modelUsage sums")


def chart_repairs(d: ReportData) -> str:
    reasons = sorted({r for per in d.repairs.values() for r in per})
    colors = {r: PALETTE[(i + 3) % len(PALETTE)] for i, r in enumerate(reasons)}
    peak = max([sum(per.values()) for per in d.repairs.values()] + [1])
    p = Plot("repairs", peak, y_label=f"repairs per {fmt_secs(d.bar_step)}")
    origin = _floor(d.start, d.bar_step)
    x, ticks = _time_axis(origin, d.now + timedelta(seconds=d.bar_step))
    _stacked_bars(p, x, sorted(d.repairs), d.bar_step, d.repairs, reasons, colors, "repairs")
    for r in reasons:
        p.legend.append((r, f"{r}: {sum(per.get(r, 0) for per in d.repairs.values())}", colors[r]))
    if not reasons:
        p.body.append(f'<text x="{W / 2}" y="{H / 2}" class="empty" text-anchor="middle">no repairs in this window</text>')
    return p.svg(ticks, "Repairs over time — evaporated claims the monitor released, by reason")


# -- the report: HTML

CSS = """
:root { color-scheme: light; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 24px auto;
       max-width: 980px; color: #1d232b; background: #fbfbfc; padding: 0 16px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 8px; }
.meta { color: #5f6b7a; margin-bottom: 16px; }
.chart { margin: 18px 0; padding: 12px 12px 6px; background: #fff; border: 1px solid #e3e6ea; border-radius: 6px; }
.chart figcaption { font-weight: 600; margin-bottom: 4px; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 12px; color: #3b4450; margin-bottom: 4px; }
.legend-item { cursor: pointer; user-select: none; } .legend-item.off { opacity: .35; }
.legend-item i { display: inline-block; width: 10px; height: 10px; margin-right: 5px; border-radius: 2px; }
svg text { font: 11px system-ui, sans-serif; fill: #5f6b7a; }
svg .frame { fill: none; stroke: #d4d8dd; } svg .grid { stroke: #eef0f2; } svg .axis { stroke: #9aa3ad; }
svg .axis-label { font-size: 11px; fill: #3b4450; } svg .y2 { fill: #c23b5a; }
svg .end-label, svg .bar-label, svg .marker { font-weight: 600; font-size: 11px; }
svg .empty { font-size: 13px; fill: #9aa3ad; }
table { border-collapse: collapse; width: 100%; font-size: 12.5px; background: #fff; }
th, td { border: 1px solid #e3e6ea; padding: 3px 7px; text-align: right; }
.scroll { overflow-x: auto; }
th { background: #f3f5f7; } td.l, th.l { text-align: left; }
.kv td:first-child { text-align: left; color: #3b4450; }
.note { color: #5f6b7a; font-size: 12px; }
"""

# The script only wires the legends (click to hide a series) and shows local times; it marks the
# page rendered at its end, so a browser test can tell that it ran without an error.
SCRIPT = """
(function () {
  "use strict";
  var root = document.documentElement;
  document.querySelectorAll("figure.chart").forEach(function (fig) {
    fig.querySelectorAll(".legend-item").forEach(function (item) {
      item.addEventListener("click", function () {
        var off = item.classList.toggle("off");
        var name = item.getAttribute("data-series");
        fig.querySelectorAll("svg [data-series]").forEach(function (el) {
          if (el.getAttribute("data-series") === name) { el.style.display = off ? "none" : ""; }
        });
      });
    });
  });
  document.querySelectorAll("time[datetime]").forEach(function (t) {
    var d = new Date(t.getAttribute("datetime"));
    if (!isNaN(d.getTime())) { t.title = d.toLocaleString(); }
  });
  var counts = {};
  document.querySelectorAll("svg.chart-svg").forEach(function (svg) {
    counts[svg.getAttribute("data-chart")] = svg.querySelectorAll("[data-v]").length;
  });
  root.setAttribute("data-points", JSON.stringify(counts));
  root.setAttribute("data-rendered", "ok");
})();
"""


def _table(headers: list[str], rows: list[list[Any]], left: int = 1) -> str:
    head = "".join(f'<th class="{"l" if i < left else ""}">{_e(h)}</th>' for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{_e(v)}</td>' for i, v in enumerate(row))
                   + "</tr>" for row in rows)
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def render_report(d: ReportData) -> str:
    lanes = _table(
        ["lane", "queued", "ready", "running", "slots", "oldest ready", "done 24h", "failed 24h",
         "dead 24h", "retries 24h", "hand-offs 24h", "repairs 24h", "shifts"],
        [[r["lane"] + (" (paused)" if r["paused"] else ""), r["queued"], r["ready"], r["running"],
          "∞" if r["slots"] is None else r["slots"], fmt_secs(r["oldest_ready_seconds"]), r["done_24h"],
          r["failed_24h"], r["dead_24h"], r["retries_24h"], r["handoffs_24h"], r["repairs_24h"],
          r["active_sessions"]] for r in d.lanes])
    c = d.cohort
    cohort = ""
    if c:
        cohort = '<table class="kv"><tbody>' + "".join(
            f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in [
                ("tasks queued in the window", c["tasks"]),
                ("completed / dead / cancelled / open",
                 f'{c["completed"]} / {c["dead"]} / {c["cancelled"]} / {c["open"]}'),
                ("makespan (first claim → last finish)", fmt_secs(c["makespan_seconds"])),
                ("wall-clock p50 / p95 (first claim → finish)",
                 f'{fmt_secs(c["wall_p50_seconds"])} / {fmt_secs(c["wall_p95_seconds"])}'),
                ("attempts per task", c["attempts_per_task"] if c["attempts_per_task"] is not None else "—"),
                ("failures / hand-offs / repairs", f'{c["failures"]} / {c["handoffs"]} / {c["repairs"]}'),
                ("tokens per completed task", fmt_num(c["tokens_per_completed"])),
                ("cost per completed task", fmt_cost(c["cost_per_completed"])),
                ("total cost", fmt_cost(c["cost_usd"])),
                ("operator interventions (cancels + retries)",
                 f'{c["interventions"]} ({c["operator_cancels"]} + {c["operator_retries"]})'),
            ]) + "</tbody></table>"
    dead = _table(["task", "lane", "key", "reason", "last error", "attempts", "died"],
                  [[r["task_id"], r["lane"], r["key"], r["dead_reason"], (r["last_error"] or "")[:80],
                    r["attempts"], r["died_at"].strftime("%Y-%m-%d %H:%M:%S") if r["died_at"] else ""]
                   for r in d.dead_letters], left=5) if d.dead_letters else '<p class="note">none in 30 days</p>'
    title = "lanefleet report" + (f" — lane {d.lane}" if d.lane else "")
    charts = "".join([chart_queue(d), chart_throughput(d), chart_wallclock(d), chart_usage(d), chart_repairs(d)])
    return f"""<!DOCTYPE html>
<html lang="en" data-generated="{_iso(d.now)}">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>{_e(title)}</title>
<style>{CSS}</style>
</head>
<body>
<h1>{_e(title)}</h1>
<div class="meta">Generated <time datetime="{_iso(d.now)}">{_iso(d.now)}</time> (database time, UTC).
Window: <time datetime="{_iso(d.since)}">{_iso(d.since)}</time> → now; charts start at the window's
first activity, <time datetime="{_iso(d.start)}">{_iso(d.start)}</time>.</div>
<h2>Lanes now</h2>
{lanes}
{charts}
<h2>Cohort: the tasks queued in the window</h2>
{cohort}
<h2>Dead letters (last 30 days, newest first)</h2>
{dead}
<p class="note">Every figure comes from the views and tables of schema <code>fleet</code>; see docs/dashboards.md.</p>
<script>{SCRIPT}</script>
</body>
</html>
"""


# -- the commands


def status(
    ctx: typer.Context,
    lane: LaneOpt = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="refresh in place until Ctrl-C")] = False,
    interval: Annotated[str, typer.Option("--interval", help="--watch: seconds between refreshes (2s, 10s, 1m)")] = "2s",
    as_json: JsonOpt = False,
) -> None:
    """The fleet at a glance: lanes, stuck tasks, active shifts, recent repairs."""
    every = flag_duration(interval, "--interval")
    if watch and as_json:
        raise InvalidInput("--watch and --json exclude each other (use `fleet snapshot` in a loop)")
    store = dashboard_store(ctx)
    check_lane(store, lane)

    def fetch() -> dict[str, Any]:
        roll_up(store)
        with reading(store) as r:
            return status_data(r, lane)

    if as_json:
        print(dump(fetch()))
        return
    if not watch:
        console.print(render_status(fetch()))
        return
    last: RenderableType = render_status(fetch())
    # Ctrl-C ends the watch between refreshes: a KeyboardInterrupt inside a query or the pool could
    # leave the exit waiting on them. A second Ctrl-C interrupts at once. (The handler only flips a
    # flag: taking a lock in a signal handler can deadlock against the code it interrupted.)
    stopping: list[bool] = []

    def on_sigint(_signum: int, _frame: object) -> None:
        if stopping:
            raise KeyboardInterrupt
        stopping.append(True)

    def pause() -> bool:
        """Wait one interval; False once Ctrl-C was pressed."""
        end = time.monotonic() + every
        while not stopping and time.monotonic() < end:
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))
        return not stopping

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with Live(last, console=console, refresh_per_second=4, transient=False) as live:
            while pause():
                try:
                    last = render_status(fetch())
                    live.update(last)
                except FleetError as exc:  # keep watching through an outage
                    live.update(Group(last, Text(f"refresh failed: {exc}", style="red")))
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, previous)


def stats(
    ctx: typer.Context,
    since: SinceOpt = "7d",
    lane: LaneOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Usage and cost per lane and day, and the cohort figures of the tasks queued in the window."""
    seconds = flag_duration(since, "--since")
    if seconds > VIEW_DAYS * 86400:
        raise InvalidInput(f"--since {since}: at most {VIEW_DAYS}d (usage_by_lane_day keeps the last "
                           f"{VIEW_DAYS} days; for older cohorts call fleet.cohort_metrics() in SQL)")
    store = dashboard_store(ctx)
    check_lane(store, lane)
    roll_up(store)
    with reading(store) as r:
        data = stats_data(r, seconds, lane)
    if as_json:
        print(dump(data))
        return
    console.print(render_stats(data))


def snapshot(
    ctx: typer.Context,
    since: SinceOpt = "24h",
    limit: Annotated[int, typer.Option(min=1, help="at most this many repairs and dead letters")] = 1000,
    pretty: Annotated[bool, typer.Option("--pretty", help="indent the JSON (default: one line, for a log)")] = False,
) -> None:
    """One JSON document of every dashboard (one line: append it to a log daily)."""
    seconds = flag_duration(since, "--since")
    if seconds > VIEW_DAYS * 86400:
        raise InvalidInput(f"--since {since}: at most {VIEW_DAYS}d (the views keep the last {VIEW_DAYS} days)")
    store = dashboard_store(ctx)
    roll_up(store)
    with reading(store) as r:
        data = snapshot_data(r, seconds, limit)
    print(dump(data, pretty=pretty), flush=True)


def report(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", "-o", help="the HTML file to write")] = Path("report.html"),
    since: SinceOpt = "7d",
    lane: LaneOpt = None,
) -> None:
    """A self-contained HTML report with charts (no network needed to view it)."""
    seconds = flag_duration(since, "--since")
    store = dashboard_store(ctx)
    check_lane(store, lane)
    roll_up(store)
    with reading(store) as r:
        data = report_data(r, seconds, lane)
    text = render_report(data)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)
    except OSError as exc:
        raise InvalidInput(f"--out: cannot write {out}: {exc.strerror}") from None
    console.print(f"wrote {out} ({len(text) // 1024} KiB)", highlight=False)


COMMANDS: dict[str, Callable[..., None]] = {"status": status, "stats": stats, "snapshot": snapshot, "report": report}


def register(app: typer.Typer) -> None:
    """Add the dashboard commands to the composed ``fleet`` app (once: a second call changes nothing)."""
    have = {c.name or (c.callback.__name__ if c.callback else None) for c in app.registered_commands}
    for name, fn in COMMANDS.items():
        if name not in have:
            app.command(name)(fn)
