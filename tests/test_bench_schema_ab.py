"""bench/schema_ab.py runs and compares: two schemas, every task of every block done (its own
check), the three figures printed; a directory without migrations is refused by name. Times are
never asserted (bench/README.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def schema_ab(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.schema_ab", *args, "--url", url], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("clients", [1, 3])
def test_schema_ab_compares_two_schemas_block_by_block(pg_server: str, tmp_path: Path, clients: int) -> None:
    # schema a: the migrations up to the domains (as `git archive <rev> migrations` would give)
    old = tmp_path / "migrations"
    old.mkdir()
    for f in sorted((ROOT / "migrations").glob("*.sql")):
        if f.name < "20261203":
            (old / f.name).write_text(f.read_text())
    done = schema_ab("--a", str(old), "--blocks", "2", "--jobs", "30", "--clients", str(clients), url=pg_server)
    assert done.returncode == 0, done.stderr
    # "<mode>   <µs a>   <µs b>   <q1> <median> <q3>" per mode
    line = re.compile(r"^(\S.*?)\s{2,}([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", re.M)
    rows = {m.group(1): (float(m.group(2)), float(m.group(3)), float(m.group(5))) for m in line.finditer(done.stdout)}
    assert set(rows) == {"enqueue_many", "durable (claim 10, complete)", "bulk (claim 100, complete_many)"}, done.stdout
    assert all(a > 0 and b > 0 and ratio > 0 for a, b, ratio in rows.values())
    assert f"a: {old}" in done.stdout and f"{clients} client" in done.stdout


def test_schema_ab_refuses_a_folder_without_migrations(pg_server: str, tmp_path: Path) -> None:
    refused = schema_ab("--a", str(tmp_path), url=pg_server)
    assert refused.returncode == 2
    assert f"{tmp_path}: no lanefleet migrations there" in refused.stderr
    assert "Traceback" not in refused.stderr
