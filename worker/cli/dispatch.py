"""``fleet profiles``: every dispatch profile and every lane's dispatch, resolved exactly as a spawn
resolves it; ``fleet pools list|clear``: the capacity pools in the database, and an operator's
lever on a pool's throttle."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import typer
from rich.markup import escape

from worker.cli.context import JsonTablesOpt, WideOpt, console, emit_json, rt
from worker.tables import Col, FitTable, print_table

pools_app = typer.Typer(no_args_is_help=True, help="Capacity pools: their slots and throttles, and lifting a throttle.")


def profiles(ctx: typer.Context, wide: WideOpt = False, as_json: JsonTablesOpt = False) -> None:
    """Every dispatch profile and each lane's dispatch (pool → profile → agent → tier → model → argv)."""
    from worker.agent.executor import render_argv
    from worker.shift.dispatch import SAMPLE_VALUES, resolved

    data = resolved(rt(ctx).cfg)
    if as_json:
        emit_json(data)
        return
    if not data["profiles"]:
        console.print("no profiles in the config: lanes run their own `command` with their `model`")
    for p in data["profiles"]:
        pool = f"pool {p['pool']} ({'unlimited' if p['slots'] is None else p['slots']} slots)" if p["pool"] else "no pool"
        caption = (escape("resumes a session with: " + " ".join(render_argv(p["resume"], SAMPLE_VALUES)))
                   if p["resume"] is not None else None)
        table = FitTable([Col("tier", "key"), Col("model", "key"), Col("argv", min_width=20)],
                         title=escape(f"profile {p['name']} — agent {p['agent']}, {pool}"), caption=caption, wide=wide)
        for tier, t in p["tiers"].items():
            table.add_row(escape(tier), escape(t["model"] or ""), escape(" ".join(t["argv"])))
        if not p["tiers"]:
            table.add_row("-", escape(p["default_model"] or ""), escape(" ".join(render_argv(p["command"], SAMPLE_VALUES))))
        print_table(console, table, wide=wide)
    table = FitTable([Col("lane", "key"), Col("pool", "key", 2), Col("profile", "key"), Col("agent", "key", 2),
                      Col("tier", "key", 1), Col("model", "key", 3), Col("argv", min_width=20)],
                     title="lanes: what a spawn runs (pools in preference order)", wide=wide)
    for lane, rows in data["lanes"].items():
        for d in rows:
            table.add_row(escape(lane), escape(d["pool"] or "-"), escape(d["profile"] or "(lane command)"),
                          escape(d["agent"]), escape(d["tier"] or "-"), escape(d["model"] or "-"),
                          escape(" ".join(d["argv"])))
    print_table(console, table, wide=wide)
    # what each lane's agents may see of the host (names and paths, never a value)
    table = FitTable([Col("lane", "key"), Col("profile", "key"), Col("sees", min_width=20)],
                     title="lanes: what their agents see (environment, sandbox)", wide=wide)
    for lane, rows in data["lanes"].items():
        seen = dict.fromkeys((d["profile"] or "(lane command)", d["access"]["summary"]) for d in rows)
        for profile, summary in seen:
            table.add_row(escape(lane), escape(profile), escape(summary))
    print_table(console, table, wide=wide)


def _setter(by: dict[str, Any] | None) -> str:
    """Who set a throttle, in a few words: task 12 (lane docs) on host-1, fleet_worker."""
    if not by:
        return ""
    where = f"task {by.get('task')}" + (f" (lane {by['lane']})" if by.get("lane") else "")
    if by.get("host"):
        where += f" on {by['host']}"
    return where + (f", {by['role']}" if by.get("role") else "")


def _when(value: Any) -> str:
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S %Z").strip()
    return str(value) if value is not None else ""


@pools_app.command("list")
def pools_list(ctx: typer.Context, wide: WideOpt = False, as_json: JsonTablesOpt = False) -> None:
    """Every capacity pool in the database: slots, and a throttle with who set it."""
    rows = rt(ctx).store().pools()
    if as_json:
        emit_json(rows)
        return
    if not rows:
        console.print(escape("no pools (they come from fleet.toml's [pools] by `fleet lanes sync`)"))
        return
    table = FitTable([Col("pool", "key"), Col("slots", "num"), Col("throttled until", "key"), Col("note", drop=2),
                      Col("set by", drop=1)], title="capacity pools", wide=wide)
    for r in rows:
        table.add_row(escape(r["name"]), "∞" if r["slots"] is None else str(r["slots"]), _when(r["throttled_until"]),
                      escape(str(r["throttle_note"] or "")[:300]), escape(_setter(r["throttled_by"])))
    print_table(console, table, wide=wide)


@pools_app.command("clear")
def pools_clear(ctx: typer.Context, name: Annotated[str, typer.Argument(help="the pool")],
                as_json: JsonTablesOpt = False) -> None:
    """Lift a pool's throttle now (an operator's call, journaled).

    The pool's lanes claim from it again, and the tasks that waited for its reset are ready."""
    got = rt(ctx).store().clear_throttle(name)
    if as_json:
        emit_json(got)
        return
    if got.get("was_until") is None:
        console.print(f"pool {escape(name)} was not throttled"
                      + (f"; {got['tasks']} waiting task(s) ready now" if got.get("tasks") else ""))
        return
    who = _setter(got.get("set_by"))
    console.print(f"pool {escape(name)}: throttle lifted (it was until {got['was_until']}"
                  + (f", set by {escape(who)}" if who else "") + f"); {got.get('tasks', 0)} waiting task(s) ready now")
