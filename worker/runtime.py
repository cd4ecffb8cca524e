"""What a command needs at run time: the config, the database URL and the store, made lazily.

No DATABASE_URL and no ``[database] url``: the embedded Postgres under ``[fleet] home``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from typing import cast

import psycopg

from worker.agent.adapters import check_config
from worker.config import FleetConfig, load_config
from worker.db.migrate import newer, pending, refuse_newer
from worker.errors import DatabaseUnavailable, MigrationError
from worker.preflight import preflight
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

    @cached_property
    def url(self) -> str:
        if self.cfg.database.url:
            return self.cfg.database.url
        from worker.db.embedded import embedded_url

        return embedded_url(self.cfg.path(self.cfg.fleet.home))

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
            raise DatabaseUnavailable(f"cannot connect to the database: {exc}".strip()) from None
        if missing:
            raise MigrationError(
                f"the database lacks {len(missing)} migration(s) ({missing[0].path.name}…)",
                "run `fleet migrate`",
            )
        refuse_newer(ahead)

    def sync_lanes(self, paused: Mapping[str, str | None] | None = None) -> dict[str, str]:
        """Write the config to the database; ``paused``: the preflight's verdicts (see sync_config)."""
        store = self.store()
        return sync_config(store, self.cfg, paused)

    def preflight(self, lanes: Iterable[str] | None = None) -> dict[str, str | None]:
        """Lane → why to pause it on this host (None: nothing wrong); see worker/preflight.py."""
        return preflight(self.cfg, lanes)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
