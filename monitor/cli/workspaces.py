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
from rich.table import Table

from monitor.dashboards.reads import jsonable
from worker.cli.context import JsonOpt, console, rt
from worker.tables import human_bytes


def _when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if isinstance(value, datetime) else str(value or "")


def workspaces(
    ctx: typer.Context,
    lane: Annotated[str | None, typer.Option("--lane", help="only this lane")] = None,
    host: Annotated[str | None, typer.Option("--host", help="only this host")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Disk use of task workspaces per lane and host, and what the monitor reaps next."""
    rows = [r for r in rt(ctx).store().workspace_usage()
            if (lane is None or r["lane"] == lane) and (host is None or r["host"] == host)]
    if as_json:
        print(json.dumps(jsonable(rows), indent=2), flush=True)
        return
    if not rows:
        console.print("no workspaces on disk")
        return
    table = Table("lane", "host", "workspaces", "disk use", "live", "oldest use", "reapable", "reapable use",
                  "next reap", title="task workspaces")
    for r in rows:
        table.add_row(str(r["lane"]), str(r["host"]), str(r["workspaces"]), human_bytes(r["bytes"]),
                      str(r["live"]), _when(r["oldest_last_used_at"]), str(r["reapable"]),
                      human_bytes(r["reapable_bytes"]), _when(r["next_reap_at"]))
    total = sum(int(r["bytes"] or 0) for r in rows)
    console.print(table)
    console.print(f"total: {human_bytes(total)} in {sum(int(r['workspaces']) for r in rows)} workspace(s)",
                  highlight=False)
