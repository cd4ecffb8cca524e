"""``fleet sources sync [NAME]``: a pass of each source of fleet.toml (what cron or the monitor runs)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape

from worker.cli.context import JsonOpt, console, rt
from worker.errors import InvalidInput

sources_app = typer.Typer(no_args_is_help=True, help="Issue trackers feeding lanes (the sources tables of fleet.toml).")


@sources_app.command("sync")
def sync(ctx: typer.Context,
         name: Annotated[str | None, typer.Argument(help="one source (default: every source)")] = None,
         as_json: JsonOpt = False) -> None:
    """A pass of each source: issues to tasks, closed ones cancelled, PRs and CI read, outcomes posted.

    Exit 1 if a pass stopped on an error (it says which); an item the tracker failed is named in
    the pass's line, and the pass goes on."""
    from worker.logs import configure_logging
    from worker.sources.passes import run_passes

    r = rt(ctx)
    if not r.cfg.sources:
        raise InvalidInput(f"{r.cfg.source or 'the config'} has no [sources.<name>] table: nothing to sync")
    if name is not None and name not in r.cfg.sources:
        raise InvalidInput(f"unknown source {name!r}", f"sources in the config: {', '.join(sorted(r.cfg.sources))}")
    configure_logging()
    reports = run_passes(r.store(), r.cfg, [name] if name else None)
    if as_json:
        print(json.dumps([{"source": p.source, "skipped": p.skipped, "error": p.error, "items": p.items,
                           "actions": dict(p.actions), "requests": p.traffic.requests,
                           "not_modified": p.traffic.not_modified, "waited_seconds": p.traffic.waited_seconds,
                           "resume_at": p.resume_at.isoformat() if p.resume_at else None,
                           "item_errors": p.item_errors} for p in reports]))
    else:
        for p in reports:
            console.print(escape(p.line()), highlight=False, soft_wrap=True)
    if any(p.error for p in reports):
        raise typer.Exit(1)
