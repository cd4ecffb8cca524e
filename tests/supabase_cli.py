"""The real Supabase CLI (npm package ``supabase``), for tests that check ``fleet migrate`` and
``supabase db push`` agree on the migration history.

The CLI is installed with npm into a cache folder under the repo's git-ignored ``.fleet/``, once;
later runs reuse it. Parallel test workers (pytest-xdist) serialise the install with a file lock.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from npmkit import npm_install
from psycopg.conninfo import conninfo_to_dict

from worker.db.migrate import Migration

VERSION = "2.117.0"
ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".fleet" / "cache" / "supabase-cli"
RUN_TIMEOUT = 180


class CliUnavailable(Exception):
    """npm is not on PATH: the CLI cannot be installed here."""


def _binary(folder: Path) -> Path:
    return folder / "node_modules" / ".bin" / "supabase"


def _version(binary: Path) -> str | None:
    if not binary.exists():
        return None
    try:
        out = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def ensure_cli(folder: Path = CACHE) -> Path:
    """The path of the CLI binary, installing ``supabase@VERSION`` into ``folder`` if needed.

    Raises CliUnavailable if npm is missing; any other install failure is an error (RuntimeError).
    """
    binary = _binary(folder)
    npm_install(folder, "supabase", VERSION, lambda: _version(binary), CliUnavailable)
    return binary


def tcp_url(conninfo: str, dbname: str) -> str | None:
    """A postgresql:// URL of ``dbname`` on the server of ``conninfo``, for ``--db-url``.

    None if the server is only reachable through a Unix socket (the CLI wants host and port).
    """
    params = conninfo_to_dict(conninfo)
    host = str(params.get("host") or params.get("hostaddr") or "")
    if not host or host.startswith("/") or host.startswith("@") or "," in host:
        return None
    port = str(params.get("port") or "5432")
    user = quote(str(params.get("user") or os.environ.get("PGUSER") or "postgres"), safe="")
    password = params.get("password") or os.environ.get("PGPASSWORD")
    auth = f"{user}:{quote(str(password), safe='')}" if password else user
    sslmode = str(params.get("sslmode") or "disable")
    netloc = f"[{host}]" if ":" in host else host
    return f"postgresql://{auth}@{netloc}:{port}/{quote(dbname, safe='')}?sslmode={sslmode}"


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def write_project(folder: Path, migrations: list[Migration]) -> Path:
    """A CLI project in ``folder``: the given migrations in ``supabase/migrations``.

    Each file gets the text the Migration was loaded with (not the file as it is now), so the CLI
    and ``migrate(migrations=...)`` see the same SQL even if the source file changes meanwhile.
    """
    target = folder / "supabase" / "migrations"
    target.mkdir(parents=True, exist_ok=True)
    for m in migrations:
        (target / m.path.name).write_text(m.sql, encoding="utf-8", newline="")
    return folder


def db_push(binary: Path, project: Path, db_url: str) -> CliResult:
    """``supabase db push --db-url URL --yes`` in ``project`` (which holds supabase/migrations)."""
    env = dict(os.environ, DO_NOT_TRACK="1")
    proc = subprocess.run(
        [str(binary), "db", "push", "--db-url", db_url, "--yes"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
        env=env,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)
