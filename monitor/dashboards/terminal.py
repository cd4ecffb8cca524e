"""The dashboards in a terminal: ``fleet status`` and ``fleet stats`` as rich tables, and the
number formats every dashboard uses (durations, counts, costs, shares, bytes)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text


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
        name = row["lane"] + (" [dim](retired)[/]" if row.get("retired") else
                              " [yellow](paused)[/]" if row["paused"] else "")
        lanes.add_row(name, str(row["queued"]), str(row["ready"]), str(row["scheduled"]),
                      str(row["running"]), "∞" if row["slots"] is None else str(row["slots"]),
                      "—" if row["idle_slots"] is None else str(row["idle_slots"]),
                      fmt_secs(row["oldest_ready_seconds"]), str(row["done_24h"]),
                      _red(row["failed_24h"]), _red(row["dead_24h"]), str(row["cancelled_24h"]),
                      str(row["retries_24h"]), str(row["handoffs_24h"]), _red(row["repairs_24h"]),
                      str(row["active_sessions"]), _ago(now, row["last_handoff_at"]))
    parts: list[RenderableType] = [lanes]
    for row in data["lanes"]:
        if row.get("paused_reason") and not row.get("retired"):
            parts.append(Text(f"lane {row['lane']} paused: {row['paused_reason']} (fix fleet.toml, then "
                              "`fleet lanes sync`)", style="yellow"))

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
        pools = Table("pool", "slots", "in use", "throttled until", "throttles today", "provider errors today",
                      "spill-overs today", "profiles", title="capacity pools", title_justify="left")
        for row in data["pools"]:
            until = row["throttled_until"]
            pools.add_row(row["pool"], "∞" if row["slots"] is None else str(row["slots"]), str(row["in_use"]),
                          f"[red]{until:%Y-%m-%d %H:%M:%S}[/]" if until else "—", _red(row["throttles_today"]),
                          _red(row["transients_today"]), str(row["spillovers_today"]), escape(row["profiles"] or ""))
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




def human_bytes(n: int | float | None) -> str:
    """1536 → "1.5 KiB"."""
    value = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
