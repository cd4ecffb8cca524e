"""What a command needs at run time: the config, the database URL and the store, made lazily.

No DATABASE_URL and no ``[database] url``: the embedded Postgres in ``[database] path``, by default
``pgdata`` in ``[fleet] home`` (``.fleet/`` beside the config file). :attr:`Runtime.where` names the
database in every message about it.
"""

from __future__ import annotations

import sys
from functools import cached_property
from pathlib import Path
from typing import cast

import psycopg
from psycopg.conninfo import conninfo_to_dict

from worker.agent.adapters import check_config
from worker.config import FleetConfig, load_config
from worker.db.migrate import newer, pending, refuse_newer
from worker.errors import DatabaseUnavailable, MigrationError
from worker.store.postgres import PostgresStore
from worker.store.sync import sync_config


class Runtime:
    def __init__(self, config_path: Path | None = None) -> None:
        self.config_path = config_path
        self._store: PostgresStore | None = None

    @cached_property
    def cfg(self) -> FleetConfig:
        cfg = load_config(self.config_path)
        check_config(cfg)  # the agents it names: known to worker.agent.adapters
        return cfg

    @property
    def embedded(self) -> bool:
        return not self.cfg.database.url

    @property
    def home(self) -> Path:
        """The fleet's home on this host (``.fleet/`` beside the config file): logs, locks."""
        return self.cfg.path(self.cfg.fleet.home)

    @property
    def pgdata(self) -> Path:
        """The embedded server's data folder (used only when :attr:`embedded`)."""
        from worker.db.embedded import data_dir

        path = self.cfg.database.path
        return data_dir(self.home, self.cfg.path(path) if path is not None else None)

    @property
    def up_lock(self) -> Path:
        """The lock of `fleet up` here (:mod:`worker.db.uplock`): in the home, or beside the
        embedded database's folder when ``[database] path`` puts it elsewhere (one per database)."""
        from worker.db.uplock import LOCK_NAME

        if self.embedded and self.cfg.database.path is not None:
            return self.pgdata.parent / f"{self.pgdata.name}.{LOCK_NAME}"
        return self.home / LOCK_NAME

    @property
    def where(self) -> str:
        """The database, for a message: ``the embedded database in /x/.fleet/pgdata`` or ``the
        database fleet on 127.0.0.1:5432`` (never a password)."""
        if self.embedded:
            return f"the embedded database in {self.pgdata}"
        try:
            parts = conninfo_to_dict(self.cfg.database.url or "")
        except psycopg.ProgrammingError:
            return "the database of DATABASE_URL"
        host = parts.get("host") or "localhost"
        port = f":{parts['port']}" if parts.get("port") else ""
        return f"the database {parts.get('dbname') or parts.get('user') or ''} on {host}{port}".replace("  ", " ")

    @cached_property
    def url(self) -> str:
        if self.cfg.database.url:
            return self.cfg.database.url
        from worker.db.embedded import embedded_url

        return embedded_url(self.home, pgdata=self.pgdata, say=lambda line: print(line, file=sys.stderr))

    def store(self, *, check_schema: bool = True, call_budget: float | None = None) -> PostgresStore:
        """The store (made once). ``call_budget``: see :class:`PostgresStore`.

        ``[fleet] store = "supabase"``: a :class:`~worker.store.supabase.SupabaseStore` (the same
        methods over Supabase's REST API; no database URL is used).
        """
        if self._store is None and self.cfg.fleet.store == "supabase":
            from worker.store.supabase import SupabaseStore

            rest = SupabaseStore.from_config(self.cfg, call_budget=call_budget)
            if check_schema:
                rest.check_schema()
            self._store = cast(PostgresStore, rest)  # duck-typed: every method callers use
        if self._store is None:
            if check_schema:
                self.check_schema()
            self._store = PostgresStore.from_config(self.cfg, self.url, call_budget=call_budget)
        return self._store

    def check_schema(self) -> None:
        """Refuse to work on a database that lacks migrations this code needs, or that a newer
        lanefleet migrated (its functions may no longer be the ones this code calls).
        FLEET_ALLOW_NEWER_SCHEMA=1 allows the latter."""
        try:
            with psycopg.connect(self.url, connect_timeout=10) as conn:
                missing = pending(conn)
                ahead = newer(conn)
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(f"cannot connect to {self.where}: {exc}".strip()) from None
        if missing:
            raise MigrationError(
                f"the database lacks {len(missing)} migration(s) ({missing[0].path.name}…)",
                "run `fleet migrate`",
            )
        refuse_newer(ahead)

    def sync_lanes(self) -> dict[str, str]:
        store = self.store()
        return sync_config(store, self.cfg)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
