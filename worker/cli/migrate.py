"""``fleet migrate`` and ``fleet lanes sync|list``: the schema and the lanes in the database."""

from __future__ import annotations

from typing import Annotated

import psycopg
import typer
from rich.markup import escape

from worker.cli.context import JsonOpt, console, emit_json, rt
from worker.db.migrate import migrate as run_migrations
from worker.db.migrate import refuse_newer
from worker.errors import DatabaseUnavailable
from worker.tables import Col, FitTable

lanes_app = typer.Typer(no_args_is_help=True, help="Lanes: sync them from fleet.toml, list them.")


def migrate(
    ctx: typer.Context,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="list pending migrations, apply none")] = False,
    sync: Annotated[bool, typer.Option(help="also sync lanes from the config")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Apply pending migrations (each in one transaction, safe to run concurrently)."""
    r = rt(ctx)
    try:
        result = run_migrations(r.url, dry_run=dry_run)
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot connect to the database: {exc}") from None
    # (after applying its own: this host's lane sync and shifts must not call what a newer one changed)
    refuse_newer(result.newer)
    lanes = r.sync_lanes() if sync and not dry_run else {}
    if as_json:
        emit_json({
            "applied": [m.path.name for m in result.applied],
            "pending": [m.path.name for m in result.pending],
            "already_applied": len(result.already),
            "newer": result.newer,
            "lanes": lanes,
        })
        return
    if dry_run:
        if result.pending:
            console.print(f"{len(result.pending)} pending:")
            for m in result.pending:
                console.print(f"  {m.path.name}")
        else:
            console.print("nothing pending")
        return
    for m in result.applied:
        console.print(f"applied {m.path.name}")
    if not result.applied:
        console.print(f"nothing to apply ({len(result.already)} already applied)")
    for name, what in lanes.items():
        if what != "unchanged":
            console.print(f"lane {name}: {what}")


@lanes_app.command("sync")
def lanes_sync(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Write the lanes of the config into fleet.lanes (create or update)."""
    result = rt(ctx).sync_lanes()
    if as_json:
        emit_json(result)
        return
    for name, what in result.items():
        console.print(f"lane {name}: {what}")


@lanes_app.command("list")
def lanes_list(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """The lanes in the database."""
    rows = rt(ctx).store().query("list_lanes")
    if as_json:
        emit_json(rows)
        return
    table = FitTable([Col("lane", "key"), Col("max_running", "num"), Col("lease_s", "num", 2),
                      Col("max_attempts", "num", 1), Col("max_handoffs", "num", 3), Col("paused", "key"),
                      Col("accepts_from", min_width=16)])
    for row in rows:
        table.add_row(escape(row["name"]), str(row["max_running"] if row["max_running"] is not None else "∞"),
                      str(row["lease_seconds"]), str(row["max_attempts"]), str(row["max_handoffs"]),
                      "yes" if row["paused"] else "", escape(", ".join(row["accepts_from"] or [])))
    console.print(table)
