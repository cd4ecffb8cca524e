"""The meta group (migrations/sources/16_meta.sql): fleet.schema_versions and
fleet.schema_migration_names, what a host reads before it works (a REST-only host through PostgREST)
to refuse a database that lacks a migration or was migrated by a newer lanefleet. Called over psycopg
against a real, freshly migrated PostgreSQL. (How the migrator and the stores act on them:
tests/test_migrate.py, tests/test_store.py, tests/supabase_api/test_supabase_store.py.)
"""

from __future__ import annotations

import psycopg
from sqlkit import as_key, one

from worker.db.migrate import load_migrations

APP_MIGRATION = ("20991231000000", "app_orders")  # a project's own migration in the same record


def test_schema_versions_are_every_applied_version_in_order(conn: psycopg.Connection) -> None:
    ours = [m.version for m in load_migrations()]
    assert one(conn, "select fleet.schema_versions()") == ours
    conn.execute("insert into supabase_migrations.schema_migrations (version, statements, name)"
                 " values (%s, '{}', %s)", APP_MIGRATION)
    assert one(conn, "select fleet.schema_versions()") == [*ours, APP_MIGRATION[0]]


def test_schema_migration_names_are_lanefleets_own(conn: psycopg.Connection) -> None:
    ours = [f"{m.version}_{m.name}" for m in load_migrations()]
    assert ours and all(name.split("_", 1)[1].startswith("fleet_") for name in ours)
    assert one(conn, "select fleet.schema_migration_names()") == ours
    conn.execute("insert into supabase_migrations.schema_migrations (version, statements, name)"
                 " values (%s, '{}', %s)", APP_MIGRATION)
    assert one(conn, "select fleet.schema_migration_names()") == ours, "another project's migration is not ours"


def test_without_a_migration_record_both_are_empty(conn: psycopg.Connection) -> None:
    with conn.transaction(force_rollback=True):
        conn.execute("alter table supabase_migrations.schema_migrations rename to schema_migrations_away")
        assert one(conn, "select fleet.schema_versions()") == []
        assert one(conn, "select fleet.schema_migration_names()") == []


def test_every_key_role_may_read_them(conn: psycopg.Connection) -> None:
    ours = [m.version for m in load_migrations()]
    for role in ("fleet_worker", "fleet_operator", "service_role"):
        with as_key(conn, role, {"role": role}):  # a worker key without lanes too: no lane is read
            assert one(conn, "select fleet.schema_versions()") == ours, role
            assert len(one(conn, "select fleet.schema_migration_names()")) == len(ours), role
