"""``fleet web``: the live operator console in a browser (monitor/web; README "The web console")."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from worker.cli.context import rt


def web(
    ctx: typer.Context,
    bind: Annotated[str, typer.Option("--bind", envvar="FLEET_WEB_BIND",
                                      help="HOST:PORT to listen on (beyond loopback it needs a credential)")] = "127.0.0.1:8765",
    read_only: Annotated[bool, typer.Option("--read-only", help="show no action forms; refuse every POST")] = False,
    token_env: Annotated[str | None, typer.Option(
        "--token-env", metavar="NAME",
        help="Postgres back-end: the environment variable holding the console token persons log in with")] = None,
) -> None:
    """The live console: lanes, pools, tasks, the queues to act on, batches, repairs, cohorts."""
    from monitor.web.app import Console, server
    from monitor.web.auth import Access, is_loopback, parse_bind
    from worker.config import supabase_setting
    from worker.errors import ConfigError
    from worker.store.supabase import SupabaseStore

    host, port = parse_bind(bind)
    runtime = rt(ctx)
    cfg = runtime.cfg
    token = None
    if token_env is not None:
        token = os.environ.get(token_env)
        if not token:
            raise ConfigError(f"--token-env {token_env}: that environment variable is not set or empty")
        if len(token) < 16:
            raise ConfigError(f"--token-env {token_env}: a console token has at least 16 characters")
    access = Access(backend=cfg.fleet.store, loopback=is_loopback(host), read_only=read_only, token=token)
    access.check_start()  # before any connection: a refused start changes nothing
    if cfg.fleet.store == "supabase":
        url, anon = supabase_setting(cfg, "url", os.environ), supabase_setting(cfg, "anon_key", os.environ)
        if not url or not anon:
            raise ConfigError("store = \"supabase\" needs [supabase] url (or SUPABASE_URL) and the anon key "
                              "(SUPABASE_ANON_KEY)")
        access.rest = (url, anon)
        if access.loopback and supabase_setting(cfg, "key", os.environ):
            rest = runtime.store()
            assert isinstance(rest, SupabaseStore)
            access.host_store = rest
    else:
        access.host_store = runtime.store()
    workspaces = cfg.path(cfg.fleet.workspaces)
    console = Console(access=access, workspaces=workspaces, log_roots=[workspaces, runtime.home])
    srv = server(console, host, port)
    typer.echo(f"fleet web: http://{bind} ({cfg.fleet.store}{', read-only' if read_only else ''}); Ctrl-C stops it",
               err=True)
    srv.run()
