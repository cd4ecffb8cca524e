"""``fleet profiles``: every dispatch profile and every lane's dispatch, resolved exactly as a spawn
resolves it; ``fleet pools list|clear``: the capacity pools in the database, and an operator's
lever on a pool's throttle."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from worker.agent.executor import render_argv
from worker.cli.context import JsonTablesOpt, console, emit_json, rt
from worker.shift.dispatch import SAMPLE_VALUES, resolved

pools_app = typer.Typer(no_args_is_help=True, help="Capacity pools: their slots and throttles, and lifting a throttle.")


def profiles(ctx: typer.Context, as_json: JsonTablesOpt = False) -> None:
    """Every dispatch profile and each lane's dispatch (pool → profile → agent → tier → model → argv)."""
    data = resolved(rt(ctx).cfg)
    if as_json:
        emit_json(data)
        return
    if not data["profiles"]:
        console.print("no profiles in the config: lanes run their own `command` with their `model`")
    for p in data["profiles"]:
        pool = f"pool {p['pool']} ({'unlimited' if p['slots'] is None else p['slots']} slots)" if p["pool"] else "no pool"
        table = Table(title=f"profile {p['name']} — agent {p['agent']}, {pool}", title_justify="left")
        table.add_column("tier")
        table.add_column("model")
        table.add_column("argv")
        for tier, t in p["tiers"].items():
            table.add_row(tier, escape(t["model"] or ""), escape(" ".join(t["argv"])))
        if not p["tiers"]:
            table.add_row("-", escape(p["default_model"] or ""), escape(" ".join(render_argv(p["command"], SAMPLE_VALUES))))
        if p["resume"] is not None:
            table.caption = escape("resumes a session with: " + " ".join(render_argv(p["resume"], SAMPLE_VALUES)))
        console.print(table)
    table = Table(title="lanes: what a spawn runs (pools in preference order)", title_justify="left")
    for col in ("lane", "pool", "profile", "agent", "tier", "model", "argv"):
        table.add_column(col)
    for lane, rows in data["lanes"].items():
        for d in rows:
            table.add_row(lane, d["pool"] or "-", d["profile"] or "(lane command)", d["agent"], d["tier"] or "-",
                          escape(d["model"] or "-"), escape(" ".join(d["argv"])))
    console.print(table)
    # what each lane's agents may see of the host (names and paths, never a value)
    table = Table(title="lanes: what their agents see (environment, sandbox)", title_justify="left")
    for col in ("lane", "profile", "sees"):
        table.add_column(col)
    for lane, rows in data["lanes"].items():
        seen = dict.fromkeys((d["profile"] or "(lane command)", d["access"]["summary"]) for d in rows)
        for profile, summary in seen:
            table.add_row(lane, profile, escape(summary))
    console.print(table)


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
def pools_list(ctx: typer.Context, as_json: JsonTablesOpt = False) -> None:
    """Every capacity pool in the database: slots, and a throttle with who set it."""
    rows = rt(ctx).store().pools()
    if as_json:
        emit_json(rows)
        return
    if not rows:
        console.print("no pools (they come from fleet.toml's [pools] by `fleet lanes sync`)")
        return
    table = Table("pool", "slots", "throttled until", "note", "set by", title="capacity pools", title_justify="left")
    for r in rows:
        table.add_row(r["name"], "∞" if r["slots"] is None else str(r["slots"]), _when(r["throttled_until"]),
                      escape(str(r["throttle_note"] or ""))[:80], escape(_setter(r["throttled_by"])))
    console.print(table)


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
