"""``fleet profiles``: every dispatch profile and every lane's dispatch, resolved exactly as a spawn
resolves it."""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.table import Table

from worker.agent.executor import render_argv
from worker.cli.context import JsonTablesOpt, console, emit_json, rt
from worker.shift.dispatch import SAMPLE_VALUES, resolved


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
