"""``fleet db url|stop``: the database's URL, and the embedded server."""

from __future__ import annotations

import typer

from worker.cli.context import console, rt
from worker.errors import InvalidInput

db_app = typer.Typer(no_args_is_help=True, help="The database: its URL, the embedded server.")


@db_app.command("url")
def db_url(ctx: typer.Context) -> None:
    """Print the database URL (starting the embedded server if it is the one in use)."""
    print(rt(ctx).url)


@db_app.command("stop")
def db_stop(ctx: typer.Context) -> None:
    """Stop the embedded Postgres (if it runs)."""
    r = rt(ctx)
    if not r.embedded:
        raise InvalidInput("the database is not the embedded one; nothing to stop")
    from worker.db.embedded import stop_embedded

    stopped = stop_embedded(r.cfg.path(r.cfg.fleet.home))
    console.print("stopped" if stopped else "not running")
