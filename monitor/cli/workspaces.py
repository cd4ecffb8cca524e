"""``fleet workspaces``: the disk use of task workspaces per lane and host (``fleet.workspace_usage``).

Each shift records its task workspaces in ``fleet.workspaces`` (size measured at the start and the
end of every attempt); the monitor of each host reaps those whose task has been finished for the
lane's ``workspace_retention``. This command shows what is on disk now, and what the next monitor
pass on each host will reap. It reads the view over either store (an operator key on Supabase).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.markup import escape

from worker.cli.context import JsonOpt, WideOpt, console, rt
from worker.tables import Col, FitTable, human_bytes, print_table


def _when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if isinstance(value, datetime) else str(value or "")


def workspaces(
    ctx: typer.Context,
    lane: Annotated[str | None, typer.Option("--lane", help="only this lane")] = None,
    host: Annotated[str | None, typer.Option("--host", help="only this host")] = None,
    wide: WideOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Disk use of task workspaces per lane and host, and what the monitor reaps next."""
    from monitor.dashboards.reads import jsonable

    store = rt(ctx).store()
    store.check_lane(lane)
    rows = [r for r in store.workspace_usage()
            if (lane is None or r["lane"] == lane) and (host is None or r["host"] == host)]
    if as_json:
        print(json.dumps(jsonable(rows), indent=2), flush=True)
        return
    if not rows:
        console.print("no workspaces on disk")
        return
    table = FitTable([Col("lane", "key"), Col("host", "key"), Col("workspaces", "num"), Col("disk use", "num"),
                      Col("live", "num", 2), Col("oldest use", "key", 3), Col("reapable", "num", 1),
                      Col("reapable use", "num", 2), Col("next reap", "key", 1)], title="task workspaces", wide=wide)
    for r in rows:
        table.add_row(escape(str(r["lane"])), escape(str(r["host"])), str(r["workspaces"]), human_bytes(r["bytes"]),
                      str(r["live"]), _when(r["oldest_last_used_at"]), str(r["reapable"]),
                      human_bytes(r["reapable_bytes"]), _when(r["next_reap_at"]))
    total = sum(int(r["bytes"] or 0) for r in rows)
    print_table(console, table, wide=wide)
    console.print(f"total: {human_bytes(total)} in {sum(int(r['workspaces']) for r in rows)} workspace(s)",
                  highlight=False)
