"""``fleet dev-stack up|down|env``: the local Supabase-compatible stack of :mod:`worker.dev.devstack`."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated

import typer

from worker.cli.context import err_console, rt

app = typer.Typer(no_args_is_help=True,
                  help="A local Supabase-compatible stack (PostgreSQL + PostgREST 12 + a /rest/v1 gateway).")

HomeOpt = Annotated[Path | None, typer.Option("--home", help="where the stack lives (default: <fleet home>/dev-stack)")]


def _home(ctx: typer.Context, home: Path | None) -> tuple[Path, Path]:
    r = rt(ctx)
    fleet_home = r.cfg.path(r.cfg.fleet.home)
    return (home or fleet_home / "dev-stack"), fleet_home / "cache"


@app.command("up")
def up_command(
    ctx: typer.Context,
    home: HomeOpt = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="start over from an empty database")] = False,
    sync: Annotated[bool, typer.Option(help="also sync the config's lanes into the stack")] = True,
) -> None:
    """Start the stack (or find it running), apply the migrations, sync lanes; print where its env is."""
    from worker.dev import devstack
    from worker.store.postgres import PostgresStore
    from worker.store.sync import sync_config

    where, cache = _home(ctx, home)
    stack = devstack.up(where, cache=cache, fresh=fresh)
    if sync:
        with PostgresStore(stack.db_url, max_size=1) as store:
            sync_config(store, rt(ctx).cfg)
    # a line each, to fit 80 columns (but for a long path)
    env_file = _shown_path(stack.env_file)
    print(f"dev stack up: API {stack.url}/rest/v1/ (schema fleet)")
    print(f"database:     {stack.db_url.split('@')[1]}")
    print(f"environment:  {env_file}")
    print(f"load it:      set -a; . {shlex.quote(env_file)}; set +a")
    print("keys:         fleet keys mint --role worker --lane LANE, once it is loaded")


def _shown_path(path: Path) -> str:
    """``path`` relative to the working folder when it is under it (shorter to read and to type)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


@app.command("down")
def down_command(
    ctx: typer.Context,
    home: HomeOpt = None,
    purge: Annotated[bool, typer.Option("--purge", help="also delete the stack's data")] = False,
) -> None:
    """Stop the stack's processes (by their recorded pids)."""
    from worker.dev import devstack

    where, _ = _home(ctx, home)
    print("stopped" if devstack.down(where, purge=purge) else "no stack there")


@app.command("env")
def env_command(
    ctx: typer.Context,
    home: HomeOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Print the stack's environment as export lines (eval "$(fleet dev-stack env)")."""
    from worker.dev import devstack

    where, _ = _home(ctx, home)
    stack = devstack.DevStack.load(where.resolve())
    if stack is None:
        raise devstack.DevStackError(f"no dev stack in {where}", "start one with `fleet dev-stack up`")
    if as_json:
        print(json.dumps({**stack.env(), "running": stack.running()}, indent=2))
        return
    for k, v in stack.env().items():
        print(f"export {k}={shlex.quote(v)}")
    if not stack.running():  # (the exports still print: its data is kept until `down --purge`)
        err_console.print(f"warning: the dev stack in {where} is not running: `fleet dev-stack up` starts it again",
                          highlight=False, soft_wrap=True)
