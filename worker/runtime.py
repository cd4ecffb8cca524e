"""What a command needs at run time: the config, the database URL and the store, made lazily.

No DATABASE_URL and no ``[database] url``: the embedded Postgres in ``[database] path``, by default
``pgdata`` in ``[fleet] home`` (``.fleet/`` beside the config file). Every message about the
database names it (:attr:`Runtime.database`): its URL without the password and where the URL came
from, or the embedded server's data folder.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import cast

import psycopg

from worker.agent.adapters import check_config
from worker.config import FleetConfig, database_origin, load_config
from worker.db.migrate import MigrateResult, newer, pending, refuse_newer
from worker.db.migrate import migrate as run_migrations
from worker.db.url import check_url, redact
from worker.errors import ConfigError, DatabaseUnavailable, MigrationError, one_line
from worker.preflight import preflight
from worker.store.postgres import PostgresStore
from worker.store.sync import sync_config


class Runtime:
    def __init__(self, config_path: Path | None = None) -> None:
        self.config_path = config_path
        self._stores: dict[float | None, PostgresStore] = {}
        self._direct: PostgresStore | None = None  # (sql_store on a supabase host)

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

    @cached_property
    def url(self) -> str:
        """The database's URL; the embedded server's (started when it is down) when none is
        configured, except on a supabase host, where that would be a database of its own and not
        the project's: there a command that needs the database itself is refused."""
        if self.cfg.database.url:
            return check_url(self.cfg.database.url, database_origin(self.cfg, os.environ) or "database.url")
        if self.cfg.fleet.store == "supabase":
            raise ConfigError(
                'this command works on the database itself, and store = "supabase" names none (the host '
                "calls the project's API): set DATABASE_URL to the project's connection string",
                "Supabase dashboard → Connect: the direct connection or the session pooler on port 5432")
        from worker.db.embedded import embedded_url

        with self._on_database():
            return embedded_url(self.home, pgdata=self.pgdata, say=lambda line: print(line, file=sys.stderr))

    @property
    def database(self) -> str:
        """The database as a message names it: ``the database postgresql://u@host/db (DATABASE_URL)``
        or ``the embedded database in /…/.fleet/pgdata``."""
        if self.embedded:
            return f"the embedded database in {self.pgdata}"
        assert self.cfg.database.url is not None
        return f"the database {redact(self.cfg.database.url)} ({database_origin(self.cfg, os.environ)})"

    def _why_embedded(self) -> str:
        """Why the embedded database is the one in use (a hint for a surprised user)."""
        where = f"neither DATABASE_URL nor {self.cfg.source}" if self.cfg.source else "no DATABASE_URL and no fleet.toml"
        return f"it is the one in use because {where} names a database"

    @contextmanager
    def _on_database(self) -> Iterator[None]:
        """Errors of a direct connection to the database, as one line that names it."""
        try:
            yield
        except psycopg.OperationalError as exc:
            reason = one_line(str(exc))
            raise DatabaseUnavailable(f"cannot connect to {self.database}: {reason}") from None
        except MigrationError as exc:
            raise MigrationError(f"{self.database}: {exc.message}", exc.hint) from None
        except psycopg.Error as exc:  # reached, but refused (no privilege to read or make the schema)
            reason = exc.diag.message_primary or one_line(str(exc))
            raise MigrationError(f"{self.database} refused: {reason}") from None

    def migrate(self, *, dry_run: bool = False) -> MigrateResult:
        """Apply the pending migrations (``dry_run``: list them); see :func:`worker.db.migrate.migrate`."""
        url = self.url
        with self._on_database():
            return run_migrations(url, dry_run=dry_run)

    def refuse_newer(self, ahead: list[str]) -> None:
        """Raise unless ``ahead`` is empty (see :func:`worker.db.migrate.refuse_newer`)."""
        refuse_newer(ahead, self.database)

    def store(self, *, call_budget: float | None = None) -> PostgresStore:
        """The store whose calls keep to ``call_budget`` (see :class:`PostgresStore`), made once per
        budget: a command that synced its lanes through the plain store and then loops on a
        budgeted one (``fleet up``) gets the budget it asked for, not the first store's.

        ``[fleet] store = "supabase"``: a :class:`~worker.store.supabase.SupabaseStore` (the same
        methods over Supabase's REST API; no database URL is used).
        """
        made = self._stores.get(call_budget)
        if made is not None:
            return made
        check_schema = not self._stores  # (once: the schema is the same for all)
        if self.cfg.fleet.store == "supabase":
            from worker.store.supabase import SupabaseStore

            rest = SupabaseStore.from_config(self.cfg, call_budget=call_budget)
            if check_schema:
                rest.check_schema()
            made = cast(PostgresStore, rest)  # duck-typed: every method callers use
        else:
            if check_schema:
                self.check_schema()
            made = PostgresStore.from_config(self.cfg, self.url, call_budget=call_budget, name=self.database)
        self._stores[call_budget] = made
        return made

    def sql_store(self) -> PostgresStore:
        """The store over the database itself, for what only SQL does (the dashboards' reads in one
        transaction, the lanes' sync, which only the database's owner may write): :meth:`store` on
        a postgres host; on a supabase host, a direct connection to ``DATABASE_URL`` (an admin's),
        refused when none is set (:attr:`url`)."""
        if self.cfg.fleet.store != "supabase":
            return self.store()
        if self._direct is None:
            url = self.url
            self.check_schema()
            self._direct = PostgresStore.from_config(self.cfg, url, name=self.database)
        return self._direct

    def admin_store(self) -> PostgresStore:
        """The store the config is written through (``fleet lanes sync``, ``fleet migrate``): the
        database itself (:meth:`sql_store`) whenever a URL is set, since a fleet key, even an
        operator's, may not write lanes; on a supabase host without one, the host's store (a
        service_role key may)."""
        return self.sql_store() if self.cfg.database.url else self.store()

    def check_schema(self) -> None:
        """Refuse to work on a database that lacks migrations this code needs, or that a newer
        lanefleet migrated (its functions may no longer be the ones this code calls).
        FLEET_ALLOW_NEWER_SCHEMA=1 allows the latter."""
        url = self.url
        with self._on_database(), psycopg.connect(url, connect_timeout=10) as conn:
            missing = pending(conn)
            ahead = newer(conn)
        if missing:
            raise MigrationError(
                f"{self.database} lacks {len(missing)} migration(s) ({missing[0].path.name}…)",
                "run `fleet migrate`" + (f"; {self._why_embedded()}" if self.embedded else ""),
            )
        self.refuse_newer(ahead)

    def sync_lanes(self, paused: Mapping[str, str | None] | None = None) -> dict[str, str]:
        """Write the config to the database through :meth:`admin_store`; ``paused``: the
        preflight's verdicts (see sync_config)."""
        store = self.admin_store()
        return sync_config(store, self.cfg, paused)

    def preflight(self, lanes: Iterable[str] | None = None) -> dict[str, str | None]:
        """Lane → why to pause it on this host (None: nothing wrong); see worker/preflight.py."""
        return preflight(self.cfg, lanes)

    def close(self) -> None:
        for store in [*self._stores.values(), *([self._direct] if self._direct else [])]:
            store.close()
        self._stores.clear()
        self._direct = None
