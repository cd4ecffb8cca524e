"""``fleet report``: one self-contained HTML file of the charts and tables; the little script in it
only wires the legends, and nothing is fetched from the network when it is opened."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from monitor.dashboards.charts import (
    chart_queue,
    chart_repairs,
    chart_throughput,
    chart_usage,
    chart_wallclock,
    html_escape,
    utc_iso,
)
from monitor.dashboards.reads import ReportData
from worker.errors import InvalidInput
from worker.tables import fmt_cost, fmt_num, fmt_secs

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
    head = "".join(f'<th class="{"l" if i < left else ""}">{html_escape(h)}</th>' for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{html_escape(v)}</td>' for i, v in enumerate(row))
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
            f"<tr><td>{html_escape(k)}</td><td>{html_escape(v)}</td></tr>" for k, v in [
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
                  [[r["task_id"], r["lane"], r["key"], r["dead_reason"], (r["last_error"] or "")[:300],
                    r["attempts"], r["died_at"].strftime("%Y-%m-%d %H:%M:%S") if r["died_at"] else ""]
                   for r in d.dead_letters], left=5) if d.dead_letters else '<p class="note">none in 30 days</p>'
    title = "lanefleet report" + (f" — lane {d.lane}" if d.lane else "")
    charts = "".join([chart_queue(d), chart_throughput(d), chart_wallclock(d), chart_usage(d), chart_repairs(d)])
    return f"""<!DOCTYPE html>
<html lang="en" data-generated="{utc_iso(d.now)}">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>{html_escape(title)}</title>
<style>{CSS}</style>
</head>
<body>
<h1>{html_escape(title)}</h1>
<div class="meta">Generated <time datetime="{utc_iso(d.now)}">{utc_iso(d.now)}</time> (database time, UTC).
Window: <time datetime="{utc_iso(d.since)}">{utc_iso(d.since)}</time> → now; charts start at the window's
first activity, <time datetime="{utc_iso(d.start)}">{utc_iso(d.start)}</time>.</div>
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




def check_out(out: Path) -> None:
    """InvalidInput unless ``out`` can be written where it is: its folder must exist (a typo in a
    path would otherwise make directories nobody asked for), and it must not be a folder."""
    if not out.parent.is_dir():
        raise InvalidInput(f"--out {out}: there is no directory {out.parent}")
    if out.is_dir():
        raise InvalidInput(f"--out {out}: that is a directory; name the HTML file to write")


def write_report(out: Path, text: str) -> None:
    """Write the report to ``out`` atomically (a temporary file beside it, then a rename)."""
    check_out(out)
    try:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)
    except OSError as exc:
        raise InvalidInput(f"--out: cannot write {out}: {exc.strerror}") from None
