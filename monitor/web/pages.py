"""What each page of the console shows: the reads of :mod:`monitor.web.reads` put together, and the
sparklines drawn by :mod:`monitor.dashboards.charts` (the report's chart code)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from monitor.dashboards.charts import PALETTE, sparkline
from monitor.web.reads import Snapshot
from worker.config import flag_duration
from worker.errors import InvalidInput, UnknownTask

SPARK_HOURS = 24
TAIL_BYTES = 6000
TOKEN_KINDS = ("input_tokens", "cache_creation_tokens", "cache_read_tokens", "output_tokens")


def as_time(value: Any) -> datetime | None:
    """A row's time as a datetime (the REST store leaves some as ISO text)."""
    if isinstance(value, datetime):
        return value
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            return None
    return None


def _hourly(now: datetime, times: list[tuple[datetime, float]]) -> list[float]:
    """``times`` summed into the last SPARK_HOURS UTC hours, oldest first (an empty hour is 0)."""
    end = now.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    start = end - timedelta(hours=SPARK_HOURS - 1)
    out = [0.0] * SPARK_HOURS
    for t, v in times:
        i = int((t.astimezone(UTC) - start).total_seconds() // 3600)
        if 0 <= i < SPARK_HOURS:
            out[i] += v
    return out


def lanes_page(s: Snapshot) -> dict[str, Any]:
    now = s.now()
    since = now - timedelta(hours=SPARK_HOURS)
    done: dict[str, list[tuple[datetime, float]]] = {}
    for row in s.throughput(since):
        hour = as_time(row["hour"])
        if hour is not None:
            done.setdefault(row["lane"], []).append((hour, float(row["done"] or 0) + float(row.get("routed") or 0)))
    lanes = s.lanes()
    for i, lane in enumerate(lanes):
        lane["spark"] = sparkline(_hourly(now, done.get(lane["lane"], [])), name=lane["lane"],
                                  title=f"{lane['lane']}: stages completed per hour, last {SPARK_HOURS} h",
                                  color=PALETTE[i % len(PALETTE)])
    throttled: dict[str, list[tuple[datetime, float]]] = {}
    for ev in s.throttles(since, limit=1000):
        ts, pool = as_time(ev["ts"]), (ev.get("detail") or {}).get("pool")
        if ts is not None and pool:
            throttled.setdefault(pool, []).append((ts, 1.0))
    pools = s.pools()
    for pool in pools:
        pool["spark"] = sparkline(_hourly(now, throttled.get(pool["pool"], [])), name=pool["pool"],
                                  title=f"{pool['pool']}: throttles per hour, last {SPARK_HOURS} h",
                                  color="#c23b5a")
    return {"now": now, "lanes": lanes, "pools": pools, "windows": s.windows(), "stuck": s.stuck()}


@dataclass
class Filters:
    lane: str | None = None
    state: str | None = None
    key: str | None = None
    text: str | None = None

    @classmethod
    def of(cls, params: Any) -> Filters:
        def get(name: str) -> str | None:
            value = str(params.get(name) or "").strip()
            return value or None
        return cls(get("lane"), get("state"), get("key"), get("q"))


def tasks_page(s: Snapshot, f: Filters) -> dict[str, Any]:
    return {"now": s.now(), "filters": f, "tasks": s.tasks(f.lane, f.state, f.key, f.text),
            "lane_names": [r["lane"] for r in s.lanes()]}


def _tail(path: Path) -> str:
    with path.open("rb") as fh:
        fh.seek(0, 2)
        size = fh.tell()
        fh.seek(max(0, size - TAIL_BYTES))
        return fh.read().decode("utf-8", "replace")


def _readable(path: Path, roots: list[Path]) -> bool:
    """Only logs under the fleet's own folders (a path in the database is not trusted to be one)."""
    try:
        real = path.resolve()
    except OSError:
        return False
    return real.is_file() and any(real.is_relative_to(r.resolve()) for r in roots)


def log_of(task: dict[str, Any], runs: list[dict[str, Any]], host: str | None, workspaces: Path,
           roots: list[Path]) -> dict[str, Any]:
    """The log to show: the running attempt's (found by the shift's naming,
    ``<workspaces>/<lane>/logs/<id>-*-a<attempt>-*.log``), else the last run's ``log_path``."""
    path: Path | None = None
    if task["state"] == "running":
        found = sorted((workspaces / task["lane"] / "logs").glob(f"{task['id']}-*-a{task['attempts']}-*.log"),
                       key=lambda p: p.stat().st_mtime)
        path = found[-1] if found else None
        where = workspaces / task["lane"] / "logs"
    else:
        last = next((r["log_path"] for r in reversed(runs) if r.get("log_path")), None)
        path = Path(last) if last else None
        where = path
    if path is not None and _readable(path, roots):
        return {"path": str(path), "text": _tail(path), "live": task["state"] == "running"}
    if where is None:
        return {"path": None, "text": None, "where": None}
    return {"path": None, "text": None, "where": f"on host {host or 'of its shift'}: {where}"}


def task_page(s: Snapshot, task_id: int, workspaces: Path, roots: list[Path]) -> dict[str, Any]:
    task = s.task(task_id)
    if task is None:
        raise UnknownTask(f"no task {task_id}")
    runs = s.runs(task_id)
    for run in runs:
        run["tokens"] = {k: run.get(k) or 0 for k in TOKEN_KINDS}
        start, end = as_time(run.get("started_at")), as_time(run.get("ended_at"))
        run["seconds"] = (end - start).total_seconds() if start and end else None
    host = None
    session = task.get("session_id") or next((r["session_id"] for r in reversed(runs) if r.get("session_id")), None)
    if session:
        row = s.session(str(session))
        host = row["host"] if row else None
    return {"now": s.now(), "task": task, "runs": runs, "events": s.events(task_id), "host": host,
            "log": log_of(task, runs, host, workspaces, roots)}


def queues_page(s: Snapshot) -> dict[str, Any]:
    return {"now": s.now(), "blocked": s.blocked(), "review": s.review(), "dead": s.dead_letters(),
            "attention": s.attention(), "stalled": s.stalled(), "stuck": s.stuck()}


def batches_page(s: Snapshot) -> dict[str, Any]:
    return {"now": s.now(), "batches": s.batches()}


def batch_page(s: Snapshot, batch_id: int) -> dict[str, Any]:
    return {"now": s.now(), "batch": s.batch(batch_id), "batch_id": batch_id}


def history_page(s: Snapshot, window: str) -> dict[str, Any]:
    seconds = flag_duration(window, "window")
    if not 60 <= seconds <= 90 * 86400:
        raise InvalidInput("window: between 1m and 90d")
    now = s.now()
    since = now - timedelta(seconds=seconds)
    repairs = [r for r in s.repairs() if (as_time(r["ts"]) or now) >= since]
    throttles = s.throttles(since)
    reasons = Counter(str(r.get("reason") or "unknown") for r in repairs)
    return {
        "now": now, "window": window, "since": since, "repairs": repairs, "throttles": throttles,
        "reasons": sorted(reasons.items()),
        "repairs_spark": sparkline(_hourly(now, [(t, 1.0) for r in repairs if (t := as_time(r["ts"]))]),
                                   name="repairs", title=f"repairs per hour, last {SPARK_HOURS} h",
                                   color=PALETTE[3], width=240, height=40),
        "throttles_spark": sparkline(_hourly(now, [(t, 1.0) for r in throttles if (t := as_time(r["ts"]))]),
                                     name="throttles", title=f"throttles per hour, last {SPARK_HOURS} h",
                                     color="#c23b5a", width=240, height=40),
        "cohort": s.cohort(since, now),
    }
