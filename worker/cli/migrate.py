"""``fleet migrate`` and ``fleet lanes sync|list|retire|unretire``: the schema and the lanes in the database."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import typer
from rich.markup import escape

from worker.cli.context import JsonOpt, WideOpt, console, emit_json, err_console, rt
from worker.tables import Col, FitTable, print_table

lanes_app = typer.Typer(no_args_is_help=True, help="Lanes: sync them from fleet.toml, list them, retire them.")


def migrate(
    ctx: typer.Context,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="list pending migrations, apply none")] = False,
    sync: Annotated[bool, typer.Option(help="also sync lanes from the config")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Apply pending migrations (each in one transaction, safe to run concurrently)."""
    r = rt(ctx)
    result = r.migrate(dry_run=dry_run)
    # (after applying its own: this host's lane sync and shifts must not call what a newer one changed)
    r.refuse_newer(result.newer)
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
    """Write the config's lanes into fleet.lanes (create or update), after a preflight of each.

    A lane whose config is wrong on this host is paused with the reason; one whose config is
    fixed is unpaused."""
    r = rt(ctx)
    reasons = r.preflight()
    result = r.sync_lanes(reasons)
    rows = r.admin_store().query("list_lanes")
    paused = {name: why for name, why in reasons.items() if why and result.get(name) != "retired"}
    others = [row["name"] for row in rows if row["name"] not in r.cfg.lanes and row["retired_at"] is None]
    if as_json:
        emit_json({"synced": result, "paused": paused, "not_in_config": others})
        return
    for name, what in result.items():
        if what == "retired":
            what = (f"retired (it stays so: `fleet lanes unretire {name}`, or retired = false in "
                    f"[lanes.{name}], brings it back)")
        # (the pools' and profiles' names come as "pool NAME", "profile NAME")
        label = name if name.startswith(("pool ", "profile ")) else f"lane {name}"
        console.print(f"{escape(label)}: {escape(what)}", highlight=False, soft_wrap=True)
    for name, why in paused.items():
        err_console.print(f"lane {name}: paused: {escape(why)} ({escape(r.cfg.fix_hint())} again)",
                          highlight=False, soft_wrap=True)
    for name in others:
        console.print(f"lane {name}: in the database, not in the config (`fleet lanes retire {name}` retires it)",
                      highlight=False, soft_wrap=True)


def lane_state(row: dict[str, Any]) -> str:
    """A lane row's state, as `fleet lanes list` shows it."""
    when = row.get("retired_at")
    if when is not None:
        return f"retired {when:%Y-%m-%d %H:%M %Z}" if isinstance(when, datetime) else f"retired {when}"
    said = ["paused (fleet.toml)"] if row["paused"] else []
    if row.get("paused_reason"):
        said.append(f"paused: {row['paused_reason']}")
    return "; ".join(said) or "active"


@lanes_app.command("list")
def lanes_list(ctx: typer.Context, wide: WideOpt = False, as_json: JsonOpt = False) -> None:
    """The lanes in the database: settings, and whether each is active, paused (and why) or retired."""
    rows = rt(ctx).store().query("list_lanes")
    if as_json:
        emit_json(rows)
        return
    table = FitTable([Col("lane", "key"), Col("max_running", "num"), Col("lease_s", "num", 2),
                      Col("max_attempts", "num", 1), Col("max_handoffs", "num", 3), Col("state", "key"),
                      Col("accepts_from", min_width=16)], wide=wide)
    for row in rows:
        table.add_row(escape(row["name"]), str(row["max_running"] if row["max_running"] is not None else "∞"),
                      str(row["lease_seconds"]), str(row["max_attempts"]), str(row["max_handoffs"]),
                      escape(lane_state(row)), escape(", ".join(row["accepts_from"] or [])))
    print_table(console, table, wide=wide)


@lanes_app.command("retire")
def lanes_retire(ctx: typer.Context, lane: Annotated[str, typer.Argument(help="the lane to retire")]) -> None:
    """Retire a lane: it refuses new tasks and is never claimed; refused while it has live tasks."""
    what = rt(ctx).store().retire_lane(lane)
    console.print(f"lane {lane}: {'retired' if what == 'retired' else 'already retired'}; "
                  f"`fleet lanes unretire {lane}` brings it back", highlight=False)


@lanes_app.command("unretire")
def lanes_unretire(ctx: typer.Context, lane: Annotated[str, typer.Argument(help="the lane to bring back")]) -> None:
    """Bring a retired lane back: it takes tasks again."""
    what = rt(ctx).store().unretire_lane(lane)
    console.print(f"lane {lane}: {'back' if what == 'unretired' else 'was not retired'}", highlight=False)
