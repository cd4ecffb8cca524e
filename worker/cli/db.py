"""``fleet db url|stop``: the database's URL, and the embedded server."""

from __future__ import annotations

from typing import Annotated

import typer

from worker.cli.context import console, rt
from worker.errors import InvalidInput

db_app = typer.Typer(no_args_is_help=True, help="The database: its URL, the embedded server.")


@db_app.command("url")
def db_url(ctx: typer.Context) -> None:
    """Print the database URL (starting the embedded server if it is the one in use)."""
    print(rt(ctx).url)


@db_app.command("stop")
def db_stop(
    ctx: typer.Context,
    force: Annotated[bool, typer.Option("--force", help="stop it even while fleet up, shifts or other clients use it")] = False,
) -> None:
    """Stop the embedded Postgres (if it runs), unless fleet up, a shift or another client uses it."""
    from worker.db.embedded import (
        DatabaseInUse,
        connections,
        describe_connections,
        running_url,
        stop_embedded,
    )
    from worker.db.uplock import holder

    r = rt(ctx)
    if not r.embedded:
        raise InvalidInput(f"{r.database} is not the embedded one (DATABASE_URL or [database] url); nothing to stop")
    url = running_url(r.pgdata, "postgres")
    if url is None:
        console.print(f"not running: {r.database}", highlight=False)
        return
    up = holder(r.up_lock)
    users = connections(url)
    if not force and (up is not None or users):
        who = [f"`fleet up` ({up.describe()})"] if up is not None else []
        if users:
            who.append(describe_connections(users))
        raise DatabaseInUse(f"{r.database} is in use: {' and '.join(who)}",
                            "stop them first, or `fleet db stop --force`: a running `fleet up` then waits for it to come back")
    stopped = stop_embedded(r.home, pgdata=r.pgdata)
    console.print(f"{'stopped' if stopped else 'not running'}: {r.database}", highlight=False)
