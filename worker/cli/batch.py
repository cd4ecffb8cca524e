"""``fleet batch create|show``: integration-branch batches of a lane's queued tasks."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape

from worker.cli.context import JsonTablesOpt, WideOpt, console, emit_json, rt
from worker.tables import Col, FitTable, fmt_cost, fmt_num, print_table

batch_app = typer.Typer(no_args_is_help=True, help="Batches: members of a lane run one after another, "
                        "landed on one integration branch, shipped once.")


@batch_app.command("create")
def batch_create(
    ctx: typer.Context,
    lane: Annotated[str, typer.Argument(help="the lane (it must have a repo)")],
    keys: Annotated[list[str], typer.Argument(help="the members' task keys, in the order they run")],
    max_members: Annotated[int, typer.Option("--max", help="at most this many members")] = 4,
    profile: Annotated[str | None, typer.Option("--profile", help="the dispatch profile of every member "
                                                "and every recovery (default: the lane's)")] = None,
    as_json: JsonTablesOpt = False,
) -> None:
    """Make a batch of queued tasks of LANE: one slot, members run one after another in one shift."""
    from worker.shift.batch import require_repo  # here: every `fleet` command imports this module

    r = rt(ctx)
    require_repo(r.cfg, lane)
    batch_id = r.store().batch_call("batch_create", {"p_lane": lane, "p_keys": list(keys), "p_max": max_members,
                                                     "p_profile": profile})
    if as_json:
        emit_json({"batch": batch_id, "lane": lane, "members": list(keys), "profile": profile})
    else:
        console.print(f"batch {batch_id}: {len(keys)} members in lane {lane} (carrier batch:{batch_id})")


@batch_app.command("show")
def batch_show(ctx: typer.Context, batch_id: Annotated[int, typer.Argument(help="the batch id")],
               wide: WideOpt = False, as_json: JsonTablesOpt = False) -> None:
    """A batch and its members: state, branch, landed range, gate, spend."""
    b = rt(ctx).store().batch_call("batch_get", {"p_batch": batch_id}, idempotent=True)
    if as_json:
        emit_json(b)
        return
    console.print(f"batch {b['id']} · lane {b['lane']} · {b['state']}"
                  + (f" ({b['block_reason']})" if b.get("block_reason") else "")
                  + f" · branch {b.get('integration_branch') or '-'} · profile {b.get('profile') or '-'}")
    table = FitTable([Col("n", "num"), Col("key", "key"), Col("state", "key"), Col("gate", "key", 2),
                      Col("branch", "key", 3), Col("landed", "key", 1), Col("tokens", "num"), Col("cost", "num")],
                     wide=wide)
    for m in b["members"]:
        landed = f"{str(m['landed_from'])[:10]}..{str(m['landed_to'])[:10]}" if m.get("landed_to") else ""
        table.add_row(str(m["n"]), escape(m["key"]), m["state"], escape(m.get("gate") or ""),
                      escape(m.get("branch") or ""), landed, fmt_num(m.get("tokens") or 0),
                      fmt_cost(m.get("cost_usd") or 0))
    print_table(console, table, wide=wide)
    if b.get("report", {}).get("ship"):
        console.print(f"ship: {escape(json.dumps(b['report']['ship']))}")
