"""The migrator: applies ``migrations/<YYYYMMDDHHMMSS>_<name>.sql`` in order.

It keeps its record in the Supabase CLI's own table, ``supabase_migrations.schema_migrations``
(version, statements, name), so ``fleet migrate`` and ``supabase db push`` agree both ways.

- Each file runs in its own transaction under a transaction-scoped advisory lock, and its row is
  inserted in that same transaction: concurrent migrators (cron!) serialise, and the second one
  finds the file applied and skips it. Transaction-scoped locks also work through a pooler in
  transaction mode.
- An applied file that was edited afterwards stops the run before anything is applied. The CLI
  stores a file as its statements (split at ``;``, trimmed, without the ``;``), not a checksum, so
  the comparison ignores white space and semicolons: both sides are reduced to their other
  characters and compared. An edit that changes any other character is caught; re-indenting is
  not an edit (nor, a known limit, is changing only the spaces inside a string literal).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import psycopg

from worker.errors import MigrationError
from worker.resources import migrations_dir

# pg_advisory_xact_lock key for migrations (any constant that no other code uses)
MIGRATE_LOCK_KEY = 0x6C616E65666C6565  # "lanefle(e)"

_FILE_NAME = re.compile(r"^(?P<version>\d{14})_(?P<name>[A-Za-z0-9_]+)\.sql$")
_NOISE = re.compile(r"[\s;]+")

_ENSURE_TABLE = """
create schema if not exists supabase_migrations;
create table if not exists supabase_migrations.schema_migrations (
    version text not null primary key,
    statements text[],
    name text
);
"""


@dataclass(frozen=True)
class Migration:
    version: str
    name: str
    path: Path
    sql: str

    @cached_property
    def statements(self) -> list[str]:
        return split_statements(self.sql)

    @cached_property
    def fingerprint(self) -> str:
        return fingerprint(self.sql)


@dataclass
class MigrateResult:
    applied: list[Migration] = field(default_factory=list)
    pending: list[Migration] = field(default_factory=list)  # what a dry run would apply
    already: list[str] = field(default_factory=list)  # versions found applied
    newer: list[str] = field(default_factory=list)  # lanefleet migrations applied that this code lacks


def fingerprint(text: str) -> str:
    """A digest of the SQL that ignores white space and semicolons (see the module doc)."""
    return hashlib.sha256(_NOISE.sub("", text).encode()).hexdigest()


def split_statements(sql: str) -> list[str]:
    """Split SQL at top-level semicolons, as the Supabase CLI records a file.

    Knows single and double quotes, dollar quotes (``$$``, ``$tag$``), line and (nested) block
    comments. Statements are trimmed and keep the comments before them; empty ones are dropped.
    Text after the last ``;`` is kept as a statement even if it is only a comment, as the CLI does.
    """
    out: list[str] = []
    start = 0
    i = 0
    n = len(sql)
    while i < n:
        c = sql[i]
        if c == "'" or c == '"':
            j = i + 1
            while j < n:
                if sql[j] == c:
                    if j + 1 < n and sql[j + 1] == c:  # doubled quote inside the literal
                        j += 2
                        continue
                    break
                j += 1
            i = j + 1
        elif c == "-" and sql.startswith("--", i):
            j = sql.find("\n", i)
            i = n if j < 0 else j + 1
        elif c == "/" and sql.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if sql.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif sql.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            i = j
        elif c == "$":
            m = re.match(r"\$([A-Za-z_][A-Za-z0-9_]*)?\$", sql[i:])
            if m and not (i > 0 and (sql[i - 1].isalnum() or sql[i - 1] == "_")):
                tag = m.group(0)
                j = sql.find(tag, i + len(tag))
                i = n if j < 0 else j + len(tag)
            else:
                i += 1
        elif c == ";":
            stmt = sql[start:i].strip()
            if stmt:
                out.append(stmt)
            start = i = i + 1
        else:
            i += 1
    # Whatever follows the last ';' is a statement too, even if it is only a comment: the CLI
    # records it that way, and dropping it would make the file look edited on the next run
    # (its fingerprint would include the comment, the recorded statements would not).
    tail = sql[start:].strip()
    if tail:
        out.append(tail)
    return out


def load_migrations(directory: Path | None = None) -> list[Migration]:
    """The migration files of ``directory`` (default: lanefleet's own), in version order."""
    directory = directory or migrations_dir()
    found: list[Migration] = []
    for path in sorted(directory.glob("*.sql")):
        m = _FILE_NAME.match(path.name)
        if not m:
            raise MigrationError(
                f"migration file {path.name} is not named <YYYYMMDDHHMMSS>_<name>.sql",
                "rename it the way the Supabase CLI names migrations",
            )
        found.append(Migration(m["version"], m["name"], path, path.read_text()))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migration files in {directory} share a version")
    return found


def _applied(conn: psycopg.Connection) -> dict[str, list[str]]:
    exists = conn.execute("select to_regclass('supabase_migrations.schema_migrations')").fetchone()
    if not exists or exists[0] is None:
        return {}
    rows = conn.execute(
        "select version, coalesce(statements, '{}') from supabase_migrations.schema_migrations"
    ).fetchall()
    return {version: list(statements) for version, statements in rows}


def _check_unedited(migrations: Sequence[Migration], applied: dict[str, list[str]]) -> None:
    for m in migrations:
        stored = applied.get(m.version)
        if stored is not None and fingerprint("".join(stored)) != m.fingerprint:
            raise MigrationError(
                f"migration {m.path.name} was edited after it was applied to this database",
                "restore the applied file and put the change in a new migration",
            )


def pending(conn: psycopg.Connection, migrations: Sequence[Migration] | None = None) -> list[Migration]:
    """The migrations not yet applied (raises if an applied one was edited)."""
    migrations = load_migrations() if migrations is None else migrations
    applied = _applied(conn)
    _check_unedited(migrations, applied)
    return [m for m in migrations if m.version not in applied]


def newer(conn: psycopg.Connection, migrations: Sequence[Migration] | None = None) -> list[str]:
    """lanefleet's migrations applied to this database that ``migrations`` (default: this code's)
    do not have, as ``<version>_<name>``: the database was migrated by a newer lanefleet (another
    host, or a later checkout). Only names starting ``fleet_`` count: a Supabase project's table also
    holds the project's own migrations."""
    migrations = load_migrations() if migrations is None else migrations
    exists = conn.execute("select to_regclass('supabase_migrations.schema_migrations')").fetchone()
    if not exists or exists[0] is None:
        return []
    rows = conn.execute(
        "select version, coalesce(name, '') from supabase_migrations.schema_migrations"
        " where name like 'fleet\\_%' order by version"
    ).fetchall()
    return unknown_of([f"{v}_{n}" for v, n in rows], migrations)


def refuse_newer(ahead: Sequence[str], database: str = "the database") -> None:
    """Raise unless ``ahead`` (what :func:`newer` found) is empty or FLEET_ALLOW_NEWER_SCHEMA=1: a
    newer lanefleet's functions may no longer be the ones this code calls. ``database``: the
    database as the message names it."""
    if ahead and os.environ.get("FLEET_ALLOW_NEWER_SCHEMA") != "1":
        raise MigrationError(
            f"{database} was migrated by a newer lanefleet: {len(ahead)} migration(s) this one does not"
            f" have ({ahead[0]}…)",
            "upgrade lanefleet on this host (git pull && uv sync); FLEET_ALLOW_NEWER_SCHEMA=1 runs it anyway",
        )


def unknown_of(applied: Sequence[str], migrations: Sequence[Migration]) -> list[str]:
    """Of ``applied`` (``<version>_<name>``), those whose version ``migrations`` do not have."""
    known = {m.version for m in migrations}
    return [a for a in applied if a.split("_", 1)[0] not in known]


def migrate(
    conninfo: str, *, dry_run: bool = False, migrations: Sequence[Migration] | None = None
) -> MigrateResult:
    """Apply pending migrations, each in one transaction under the migration lock."""
    migrations = load_migrations() if migrations is None else sorted(migrations, key=lambda m: m.version)
    result = MigrateResult()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        with conn.transaction():
            conn.execute("select pg_advisory_xact_lock(%s)", (MIGRATE_LOCK_KEY,))
            applied = _applied(conn)
            _check_unedited(migrations, applied)
        result.already = sorted(v for v in applied if v in {m.version for m in migrations})
        result.newer = newer(conn, migrations)
        if dry_run:
            result.pending = [m for m in migrations if m.version not in applied]
            return result
        for m in migrations:
            if m.version in applied:
                continue
            with conn.transaction():
                conn.execute("select pg_advisory_xact_lock(%s)", (MIGRATE_LOCK_KEY,))
                conn.execute(_ENSURE_TABLE)
                row = conn.execute(
                    "select statements from supabase_migrations.schema_migrations where version = %s",
                    (m.version,),
                ).fetchone()
                if row is not None:  # another migrator applied it while we waited
                    _check_unedited([m], {m.version: list(row[0] or [])})
                    result.already.append(m.version)
                    continue
                try:
                    conn.execute(m.sql.encode())
                except psycopg.Error as exc:
                    raise MigrationError(
                        f"migration {m.path.name} failed: {exc.diag.message_primary or exc}"
                    ) from exc
                conn.execute(
                    "insert into supabase_migrations.schema_migrations (version, statements, name)"
                    " values (%s, %s, %s)",
                    (m.version, m.statements, m.name),
                )
            result.applied.append(m)
    return result
