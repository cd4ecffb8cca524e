"""A host whose fleet.toml says ``store = "supabase"``, running the commands that work on the
database itself (worker/runtime.py ``url``, ``sql_store``, ``admin_store``): migrations, the lanes'
sync, the dashboards. With the project's ``DATABASE_URL`` they use it (an admin's machine);
without one they are refused in one line, and no embedded database of the host's own is made in
its place (it would be migrated and synced while the project stayed as it was). The REST side
(the refusal of a fleet key's sync over the API, its hint) is in tests/supabase_api/.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[1]
TOML = """\
[fleet]
store = "supabase"

[supabase]
url = "http://127.0.0.1:9"   # never reached by these commands

[lanes.docs]
command = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]
"""


@pytest.fixture
def host(tmp_path: Path) -> Path:
    (tmp_path / "fleet.toml").write_text(TOML)
    return tmp_path


def fleet(host: Path, *args: str, url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "SUPABASE_")) and k != "DATABASE_URL"}
    env.update({"FLEET_CONFIG": str(host / "fleet.toml"), "SUPABASE_ANON_KEY": "anon", "FLEET_KEY": "not-a-key",
                "COLUMNS": "200"})
    if url is not None:
        env["DATABASE_URL"] = url
    return subprocess.run([sys.executable, "-m", "monitor.cli", *args], cwd=host, env=env, capture_output=True,
                          text=True, timeout=120)


# (`fleet lanes sync` without one goes over the API: a service_role key may write lanes)
@pytest.mark.parametrize("args", [["migrate"], ["migrate", "--dry-run"], ["status"], ["stats"], ["snapshot"],
                                  ["db", "url"]])
def test_without_a_database_url_the_database_commands_are_refused(host: Path, args: list[str]) -> None:
    done = fleet(host, *args)
    assert done.returncode == 1, done
    assert done.stderr.startswith("error: this command works on the database itself, and store = \"supabase\" "
                                  "names none"), done.stderr
    assert "DATABASE_URL" in done.stderr and "Traceback" not in done.stderr
    assert not (host / ".fleet" / "pgdata").exists(), "an embedded database was made in the project's place"


def test_with_the_projects_url_an_admin_migrates_syncs_and_reads_the_dashboards(host: Path, db_url: str) -> None:
    migrated = fleet(host, "migrate", url=db_url)
    assert migrated.returncode == 0, migrated.stderr
    assert "nothing to apply" in migrated.stdout and "lane docs: created" in migrated.stdout, migrated.stdout
    with psycopg.connect(db_url) as c:
        assert c.execute("select count(*) from fleet.lanes where name = 'docs'").fetchone() == (1,)
    synced = fleet(host, "lanes", "sync", url=db_url)
    assert synced.returncode == 0 and "lane docs: unchanged" in synced.stdout, synced.stderr
    for command, shows in (("status", "docs"), ("stats", "usage since"), ("snapshot", '"docs"')):
        shown = fleet(host, command, url=db_url)
        assert shown.returncode == 0 and shows in shown.stdout, (command, shown.stderr)
    assert not (host / ".fleet" / "pgdata").exists()
