"""The dashboards in a terminal: ``fleet status`` and ``fleet stats`` as tables that fit the
terminal (:class:`worker.tables.FitTable`: fewer columns at 80, every one with ``--wide``)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.text import Text

from worker.tables import Col, FitTable, fmt_cost, fmt_num, fmt_secs, fmt_share


def _unblocking(reasons: Iterable[str]) -> str:
    """What unblocks the reasons shown: a gate's task is resumed (the gate runs again) or retried
    (the agent runs again); a budget's is resumed with a new budget (without one it is refused)."""
    seen = set(reasons)
    hints = []
    if seen - {"budget"}:
        hints.append("`fleet resume TASK` re-runs the gate, `fleet retry TASK` the agent")
    if "budget" in seen:
        hints.append("a budget: `fleet resume TASK --max-tokens N` (or `--max-cost USD`)")
    return "; ".join(hints)


def _ago(now: datetime, when: Any) -> str:
    if not isinstance(when, datetime):
        return "—"
    return fmt_secs((now - when).total_seconds()) + " ago"


def render_status(data: dict[str, Any], wide: bool = False) -> RenderableType:
    now: datetime = data["as_of"]
    lanes = FitTable([Col("lane", "key"), Col("queued", "num"), Col("ready", "num"), Col("later", "num", 5),
                      Col("running", "num"), Col("slots", "num"), Col("idle", "num", 6),
                      Col("oldest ready", "num", 1), Col("done 24h", "num", 2), Col("failed", "num", 1),
                      Col("dead", "num", 1), Col("cancelled", "num", 5), Col("retries", "num", 4),
                      Col("hand-offs", "num", 4), Col("repairs", "num", 3), Col("shifts", "num", 3),
                      Col("last hand-off", "key", 6)],
                     title="lanes (counts of the last 24h)", wide=wide)
    for row in data["lanes"]:
        name = escape(row["lane"]) + (" [dim](retired)[/]" if row.get("retired") else
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
        stuck = FitTable([Col("task", "num"), Col("lane", "key", 2), Col("key", "key"), Col("why", min_width=14),
                          Col("running", "num", 2), Col("lane p95", "num", 3), Col("lease left", "num", 1),
                          Col("shift", "key", 2)],
                         title="stuck tasks", title_style="bold red", wide=wide)
        for row in data["stuck"]:
            stuck.add_row(str(row["task_id"]), escape(row["lane"]), escape(row["key"]), ", ".join(row["reasons"]),
                          fmt_secs(row["running_seconds"]), fmt_secs(row["lane_p95_seconds"]),
                          fmt_secs(row["lease_remaining_seconds"]),
                          f"{escape(row['host'])}:{row['pid']} ({row['session_state']})")
        parts.append(stuck)
    else:
        parts.append(Text("stuck tasks: none", style="green"))

    if data.get("blocked"):
        blocked = FitTable([Col("task", "num"), Col("lane", "key", 2), Col("key", "key"), Col("why", "key"),
                            Col("tier", "key", 3), Col("profile", "key", 3), Col("blocked", "key", 2),
                            Col("evidence", drop=1)],
                           title=f"blocked tasks: {_unblocking(row['block_reason'] for row in data['blocked'])}",
                           title_style="bold yellow", wide=wide)
        for row in data["blocked"]:
            evidence = (row["evidence"] or "").strip().splitlines()
            blocked.add_row(str(row["id"]), escape(row["lane"]), escape(row["key"]), escape(row["block_reason"]),
                            escape(row["tier"] or ""), escape(row["profile"] or ""), _ago(now, row["blocked_at"]),
                            escape(evidence[-1][:200] if evidence else ""))
        parts.append(blocked)

    if data.get("attention"):
        waiting = FitTable([Col("task", "num"), Col("lane", "key", 2), Col("key", "key"), Col("waits for"),
                            Col("since", "key", 1), Col("host:pid", "key", 2)],
                           title="needs attention (an agent waits on a question or a permission prompt)",
                           title_style="bold yellow", wide=wide)
        for row in data["attention"]:
            waiting.add_row(str(row["id"]), escape(row["lane"]), escape(row["key"]), escape(row["attention"] or ""),
                            _ago(now, row["attention_at"]), f"{escape(row['host'])}:{row['pid']}")
        parts.append(waiting)

    if data.get("pools"):
        pools = FitTable([Col("pool", "key"), Col("slots", "num"), Col("in use", "num"),
                          Col("throttled until", "key"), Col("throttles today", "num", 1),
                          Col("provider errors today", "num", 2), Col("spill-overs today", "num", 2),
                          Col("profiles", drop=3)],
                         title="capacity pools", wide=wide)
        for row in data["pools"]:
            until = row["throttled_until"]
            pools.add_row(escape(row["pool"]), "∞" if row["slots"] is None else str(row["slots"]), str(row["in_use"]),
                          f"[red]{until:%Y-%m-%d %H:%M:%S}[/]" if until else "—", _red(row["throttles_today"]),
                          _red(row["transients_today"]), str(row["spillovers_today"]), escape(row["profiles"] or ""))
        parts.append(pools)

    if data.get("windows"):
        parts.append(_windows_table(data["windows"], wide))

    if data["sessions"]:
        sessions = FitTable([Col("session", "key"), Col("lane", "key"), Col("host:pid", "key", 1),
                             Col("age", "num", 3), Col("deadline in", "num", 2), Col("heartbeat", "num", 1),
                             Col("holds", "num"), Col("runs", "num", 4), Col("done", "num", 3),
                             Col("failed", "num", 3), Col("hand-offs", "num", 4), Col("tokens", "num", 2),
                             Col("cost", "num", 2)],
                            title="active shifts", wide=wide)
        for row in data["sessions"]:
            sessions.add_row(str(row["session_id"])[:8], escape(row["lane"]), f"{escape(row['host'])}:{row['pid']}",
                             fmt_secs(row["age_seconds"]), fmt_secs(row["deadline_in_seconds"]),
                             fmt_secs(row["heartbeat_age_seconds"]) + " ago", str(row["tasks_held"]),
                             str(row["runs"]), str(row["done"]), str(row["failed"]),
                             str(row["handed_off"]), fmt_num(row["tokens"]), fmt_cost(row["cost_usd"]))
        parts.append(sessions)
    else:
        parts.append(Text("active shifts: none"))

    if data["repairs"]:
        repairs = FitTable([Col("when", "key"), Col("lane", "key", 2), Col("task", "num"), Col("key", "key"),
                            Col("reason", "key"), Col("→", "key"), Col("host:pid", "key", 1)],
                           title="recent repairs (7 days)", wide=wide)
        for row in data["repairs"]:
            repairs.add_row(_ago(now, row["ts"]), escape(row["lane"] or ""), str(row["task_id"]),
                            escape(row["key"] or ""), escape(row["reason"] or ""), row["state"] or "",
                            f"{escape(row['host'] or '?')}:{row['pid'] or '?'}")
        parts.append(repairs)
    else:
        parts.append(Text("recent repairs: none in 7 days"))
    parts.append(Text(f"as of {now:%Y-%m-%d %H:%M:%S %Z} (database time)", style="dim"))
    return Group(*parts)


def _red(n: Any) -> str:
    return f"[red]{n}[/]" if n else str(n)


_USAGE = [Col("day (UTC)", "key"), Col("lane", "key"), Col("runs", "num", 3), Col("done", "num"),
          Col("tokens", "num", 1), Col("input", "num", 4), Col("cache write", "num", 5), Col("cache read", "num", 4),
          Col("output", "num", 4), Col("cache-read share", "num", 3), Col("cost", "num"),
          Col("cost/done", "num", 1), Col("tokens/done", "num", 2)]


def _usage_row(row: dict[str, Any], day: str, lane: str) -> list[str]:
    return [day, lane, str(row["runs"]), str(row["completed"]), fmt_num(row["total_tokens"]),
            fmt_num(row["input_tokens"]), fmt_num(row["cache_creation_tokens"]),
            fmt_num(row["cache_read_tokens"]), fmt_num(row["output_tokens"]),
            fmt_share(row["cache_read_share"]), fmt_cost(row["cost_usd"]),
            fmt_cost(row["cost_per_completed"]), fmt_num(row["tokens_per_completed"])]


def render_stats(data: dict[str, Any], wide: bool = False) -> RenderableType:
    since: datetime = data["since"]
    # the three tables count a routed task differently: say how, where a number is read
    usage = FitTable(_USAGE, title=f"usage since {since:%Y-%m-%d %H:%M} UTC", wide=wide,
                     caption="done: tasks or stages finished in the lane" if data["usage"]
                     else "no run ended in this window")
    for row in data["usage"]:
        usage.add_row(*_usage_row(row, str(row["day"]), escape(row["lane"])))
    # a lane's total where it has more than one day, and the fleet's over more than one row: a
    # total that would repeat its one row says nothing
    days: dict[str, int] = {}
    for row in data["usage"]:
        days[row["lane"]] = days.get(row["lane"], 0) + 1
    subtotals = [row for row in data["usage_totals"] if days.get(row["lane"], 0) > 1]
    total = data.get("usage_total") if len(data["usage"]) > 1 and len(days) > 1 else None
    if subtotals or total:
        usage.add_section()
        for row in subtotals:
            usage.add_row(*_usage_row(row, "[bold]total[/]", escape(row["lane"])))
        if total:
            usage.add_row(*_usage_row(total, "[bold]total[/]", "[bold]all lanes[/]"))
    cohort = FitTable([Col("cohort", "key"), Col("tasks", "num"), Col("done", "num"), Col("dead", "num"),
                       Col("cancelled", "num", 4), Col("open", "num"), Col("makespan", "num", 2),
                       Col("wall p50", "num", 3), Col("wall p95", "num", 1), Col("attempts/task", "num", 4),
                       Col("failures", "num", 3), Col("hand-offs", "num", 4), Col("repairs", "num", 4),
                       Col("tokens/done", "num", 2), Col("cost/done", "num", 1),
                       Col("interventions", drop=5, min_width=14)],
                      title=f"cohort: tasks queued since {since:%Y-%m-%d %H:%M} UTC", wide=wide,
                      caption="each task in the lane it entered by")
    rows = [data["cohort"], *data["cohort_by_lane"]]
    for row in rows:
        if not row:
            continue
        cohort.add_row(escape(row["lane"]) if row["lane"] else "[bold]all lanes[/]", str(row["tasks"]),
                       str(row["completed"]), str(row["dead"]), str(row["cancelled"]), str(row["open"]),
                       fmt_secs(row["makespan_seconds"]), fmt_secs(row["wall_p50_seconds"]),
                       fmt_secs(row["wall_p95_seconds"]),
                       "—" if row["attempts_per_task"] is None else f"{row['attempts_per_task']}",
                       str(row["failures"]), str(row["handoffs"]), str(row["repairs"]),
                       fmt_num(row["tokens_per_completed"]), fmt_cost(row["cost_per_completed"]),
                       f"{row['interventions']} ({row['operator_cancels']} cancels, "
                       f"{row['operator_retries']} retries)")
    parts: list[RenderableType] = [usage, cohort]
    if any(row and row.get("ci_tasks") for row in rows):
        parts.append(_ci_table([row for row in rows if row], since, wide))
    if data.get("cohort_split"):
        parts.append(_split_table(data["cohort_split"], wide))
    if data.get("triage"):
        parts.append(_triage_table(data["triage"], since, wide))
    return Group(*parts)


def _windows_table(rows: list[dict[str, Any]], wide: bool) -> FitTable:
    """fleet.pool_windows: each usage window of a pool, how full (the provider's figure or the
    estimate from the runs), when it resets."""
    table = FitTable([Col("pool", "key"), Col("window", "key"), Col("full", "num"), Col("used", "num", 2),
                      Col("budget", "num", 2), Col("resets", "key", 1), Col("from", "key", 3),
                      Col("estimate off by", "num", 4)],
                     title="usage windows", wide=wide)
    for row in rows:
        full = float(row["utilization"] or 0)
        used = (fmt_num(row["used_tokens"]) if row["budget_tokens"] is not None else fmt_cost(row["used_usd"]))
        budget = (fmt_num(row["budget_tokens"]) if row["budget_tokens"] is not None else fmt_cost(row["budget_usd"]))
        resets = row["resets_at"]
        off = row["estimate_off_by"]
        table.add_row(escape(row["pool"]), escape(row["window_name"]),
                      f"[red]{full:.0%}[/]" if full >= 0.9 else f"{full:.0%}", used, budget,
                      f"{resets:%Y-%m-%d %H:%M}" if resets else "—", escape(row["source"] or ""),
                      "—" if off is None else f"{float(off):+.0%}")
    return table


def _ci_table(rows: list[dict[str, Any]], since: datetime, wide: bool) -> FitTable:
    """The cohort's tasks a source fed: their pull requests' CI (executions: workflow runs; cycles:
    head SHAs checked) and the merges reverted within 7 days."""
    table = FitTable([Col("cohort", "key"), Col("with a PR", "num"), Col("CI runs", "num"), Col("cycles", "num"),
                      Col("runs/task", "num", 1), Col("regressions", "num")],
                     title=f"CI of the tasks queued since {since:%Y-%m-%d %H:%M} UTC from sources", wide=wide)
    for row in rows:
        table.add_row(escape(row["lane"]) if row["lane"] else "[bold]all lanes[/]", str(row["ci_tasks"]),
                      str(row["ci_executions"]), str(row["ci_cycles"]),
                      "—" if row["ci_executions_per_task"] is None else str(row["ci_executions_per_task"]),
                      str(row["regressions"]))
    return table


def _split_table(rows: list[dict[str, Any]], wide: bool) -> FitTable:
    split = FitTable([Col("cohort", "key"), Col("tasks", "num"), Col("done", "num"), Col("makespan", "num", 2),
                      Col("tokens/done", "num", 2), Col("cache-read share", "num", 3), Col("cost/done", "num"),
                      Col("ship runs/done", "num", 3), Col("batches", "num", 4), Col("members", "num", 1),
                      Col("evicted", "key", 1), Col("blocks", "num", 4), Col("interventions", "num", 4)],
                     title="the same cohort, batched vs unbatched (fleet.cohort_split)", wide=wide)
    for row in rows:
        split.add_row(row["cohort"], str(row["tasks"]), str(row["completed"]), fmt_secs(row["makespan_seconds"]),
                      fmt_num(row["tokens_per_completed"]), fmt_share(row["cache_read_share"]),
                      fmt_cost(row["cost_per_completed"]),
                      "—" if row["ship_runs_per_completed"] is None else f"{row['ship_runs_per_completed']}",
                      str(row["batches"]), str(row["batch_members"]),
                      f"{row['evicted']} ({fmt_share(row['eviction_rate'])})" if row["batch_members"] else "—",
                      str(row["blocks"]), str(row["interventions"]))
    return split


def _triage_table(rows: list[dict[str, Any]], since: datetime, wide: bool) -> FitTable:
    """The verdicts of each triage lane (fleet.triage_metrics): per verdict lane, and the lane's
    total above them when it sent tasks to more than one lane (one would only repeat it)."""
    table = FitTable([Col("triage lane", "key"), Col("verdict", "key"), Col("verdicts", "num"),
                      Col("misclassified", "num"), Col("rate", "num"), Col("undecided", "num"),
                      Col("correct", "num", 1), Col("routed again", "num", 3), Col("evicted", "num", 3),
                      Col("failed", "num", 2), Col("cancelled", "num", 4)],
                     title=f"triage: verdicts since {since:%Y-%m-%d %H:%M} UTC (fleet.triage_metrics)",
                     caption="misclassified: the task left the verdict lane (routed again, evicted, failed "
                             "there); rate: of the decided", wide=wide)
    by_lane: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_lane.setdefault(row["triage_lane"], []).append(row)
    for n, (lane, lane_rows) in enumerate(by_lane.items()):
        if n:
            table.add_section()
        verdicts = [r for r in lane_rows if r["verdict_lane"] is not None]
        total = [r for r in lane_rows if r["verdict_lane"] is None and len(verdicts) > 1]
        for row in total + verdicts:
            table.add_row(escape(lane), "[bold]all[/]" if row["verdict_lane"] is None else escape(row["verdict_lane"]),
                          str(row["verdicts"]), _red(row["misclassified"]), fmt_share(row["misclassification_rate"]),
                          str(row["undecided"]), str(row["correct"]), str(row["routed_again"]), str(row["evicted"]),
                          str(row["failed"]), str(row["cancelled"]))
    return table
