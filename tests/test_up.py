"""``fleet up`` on a directory: one per directory and database (worker/db/uplock.py), ``fleet db
stop`` that refuses while the embedded server is in use (worker/cli/db.py), and ``fleet up``
through a restart of its database (monitor/outage.py) — ``fleet`` run for real as subprocesses,
on a real embedded PostgreSQL in a folder of the test's own."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from fleetkit import one_line

from worker.db.embedded import running_url, stop_embedded
from worker.db.uplock import UpLock, UpRunning, holder
from worker.runtime import Runtime

ROOT = Path(__file__).resolve().parents[1]
FLEET_TOML = """\
[fleet]
monitor_every = "1s"

[lanes.docs]
command = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]
max_running = 2
"""
QUICK = '{"steps": 1, "sleep": 0.05}'


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------------
# the lock


_HOLD = """
import sys, time
from pathlib import Path
from worker.db.uplock import UpLock
UpLock(Path(sys.argv[1])).acquire(config=None, database="the test's")
print("held", flush=True)
time.sleep(600)
"""


def test_the_up_lock_names_its_holder_and_is_free_once_the_holder_dies(tmp_path: Path) -> None:
    path = tmp_path / ".fleet" / "up.lock"
    assert holder(path) is None  # no file: nobody
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        who = holder(path)
        assert who is not None and who.pid == child.pid and who.database == "the test's"
        with pytest.raises(UpRunning) as err:
            UpLock(path).acquire(config=None, database="mine")
        assert f"pid {child.pid}" in str(err.value) and str(path) in str(err.value)
        assert "\n" not in str(err.value)
    finally:
        os.kill(child.pid, signal.SIGKILL)  # however it dies, the kernel frees its flock
        child.wait(10)
    assert holder(path) is None
    with UpLock(path) as mine:
        mine.acquire(config=None, database="mine")
        assert (who := holder(path)) is not None and who.pid == os.getpid()
    assert holder(path) is None


def test_the_embedded_database_lives_beside_the_config_or_at_database_path(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "fleet.toml").write_text(FLEET_TOML)
    r = Runtime(elsewhere / "fleet.toml")
    assert r.embedded and r.pgdata == (elsewhere / ".fleet" / "pgdata").resolve()
    assert r.up_lock == elsewhere / ".fleet" / "up.lock"
    assert r.database == f"the embedded database in {(elsewhere / '.fleet' / 'pgdata').resolve()}"

    (elsewhere / "fleet.toml").write_text('[database]\npath = "../shared/pg"\n\n' + FLEET_TOML)
    r = Runtime(elsewhere / "fleet.toml")
    shared = (tmp_path / "shared" / "pg").resolve()
    assert r.pgdata == shared and r.up_lock == shared.parent / "pg.up.lock"  # one lock per database
    assert str(shared) in r.database

    (elsewhere / "fleet.toml").write_text('[database]\nurl = "postgresql://fleet:secret@db.example:6543/prod"\n\n'
                                          + FLEET_TOML)
    r = Runtime(elsewhere / "fleet.toml")
    assert not r.embedded and "secret" not in r.database and "db.example:6543/prod" in r.database  # never the password


# ------------------------------------------------------------------------------------------------
# fleet up, fleet db stop and a restart, on the embedded database


@pytest.fixture
def project() -> Iterator[Path]:
    """A project folder with a fleet.toml and no database configured: the embedded one, made in
    ``.fleet/pgdata`` by the first command. (As root the server runs as the system user
    embedded_postgres: every parent of its folder must be traversable, which pytest's tmp_path
    is not.)"""
    home = Path(tempfile.mkdtemp(prefix="lf-up-", dir="/tmp"))
    home.chmod(0o755)
    (home / "fleet.toml").write_text(FLEET_TOML)
    try:
        yield home
    finally:
        stop_embedded(home / ".fleet")
        shutil.rmtree(home, ignore_errors=True)


def env_of(project: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLEET_", "PG")) and k != "DATABASE_URL"}
    return {**env, "FLEET_CONFIG": str(project / "fleet.toml"), "COLUMNS": "200"}


def fleet(project: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "monitor.cli", *args], cwd=ROOT, env=env_of(project),
                          capture_output=True, text=True, timeout=timeout)


def state_of(project: Path, key: str) -> str | None:
    url = running_url((project / ".fleet" / "pgdata").resolve())
    if url is None:
        return None
    try:
        with psycopg.connect(url, connect_timeout=3) as c:
            row = c.execute("select state from fleet.tasks where key = %s", (key,)).fetchone()
    except psycopg.OperationalError:
        return None
    return None if row is None else str(row[0])


def test_one_fleet_up_per_directory_db_stop_refuses_and_up_survives_a_restart(project: Path) -> None:
    pgdata = (project / ".fleet" / "pgdata").resolve()
    out, err = project / "up.out", project / "up.err"
    with out.open("w") as o, err.open("w") as e:
        up = subprocess.Popen([sys.executable, "-m", "monitor.cli", "up"], cwd=ROOT, env=env_of(project),
                              stdout=o, stderr=e)
    try:
        wait_for("fleet up to start", lambda: " is ready; " in out.read_text(), timeout=180)
        # the first command made the database, and said where
        assert f"created a new embedded database in {pgdata}" in err.read_text()
        assert str(pgdata) in out.read_text()

        # a second `fleet up` in the directory: one line naming the first, exit 1, nothing started
        second = one_line(fleet(project, "up"))
        assert "another `fleet up` runs" in second and f"pid {up.pid}" in second, second

        # `fleet db stop` while it runs: refused, naming the database and who uses it
        refused = one_line(fleet(project, "db", "stop"))
        assert "is in use" in refused and str(pgdata) in refused and f"`fleet up` (pid {up.pid}" in refused, refused
        assert "lanefleet up" in refused and "--force" in refused, refused
        assert running_url(pgdata) is not None

        assert fleet(project, "enqueue", "docs", "--key", "before", "--payload", QUICK).returncode == 0
        wait_for("the task queued before the restart", lambda: state_of(project, "before") == "done")

        # --force stops it under `fleet up`, which waits for it to come back
        forced = fleet(project, "db", "stop", "--force")
        assert forced.returncode == 0, forced.stderr
        assert forced.stdout.strip() == f"stopped: the embedded database in {pgdata}"
        # within a call's budget (monitor.cli.run.CALL_BUDGET, 5 s) and a loop's turn, not the five
        # tries of 10 s of a store without one (the store it synced the lanes with)
        wait_for("fleet up to notice", lambda: "database restarting, reconnecting" in out.read_text(), timeout=20)
        time.sleep(2)  # a few failed tries (with backoff) while nobody restarts it
        assert up.poll() is None

        restarted = fleet(project, "db", "url")  # the next command starts it again
        assert restarted.returncode == 0 and f"started the embedded database in {pgdata}" in restarted.stderr
        assert fleet(project, "enqueue", "docs", "--key", "after", "--payload", QUICK).returncode == 0
        wait_for("the task queued after the restart", lambda: state_of(project, "after") == "done")
        wait_for("fleet up to say the database is back", lambda: "database back after" in out.read_text())

        up.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop
        assert up.wait(60) == 0, err.read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
    text = out.read_text()
    assert text.count("database restarting, reconnecting") == 1, text  # said once
    said = " ".join(text.split())  # (wrapped at the terminal's width)
    assert f"reconnecting: the embedded database in {pgdata} is unreachable" in said, text  # named once
    assert "summary" in text
    assert "Traceback" not in err.read_text() and "psycopg.pool" not in err.read_text(), err.read_text()
    assert holder(project / ".fleet" / "up.lock") is None  # released: the next `fleet up` may start
    # no `fleet up` any more, nothing connected: stopped without --force
    stopped = fleet(project, "db", "stop")
    assert stopped.returncode == 0 and stopped.stdout.strip() == f"stopped: the embedded database in {pgdata}", \
        stopped.stderr


def test_a_monitor_pass_on_a_database_that_does_not_answer_is_said_once_and_tried_again(db_url: str) -> None:
    """`fleet run`'s monitor job (monitor.outage.Outage.attempt) on a real store whose server is
    gone: no exception out of the job, one line for the outage, one when it answers again."""
    from monitor.outage import Outage
    from monitor.reconcile import monitor_pass
    from worker.config import load_config
    from worker.store.postgres import PostgresStore

    cfg = load_config(None, environ={})
    said: list[str] = []
    outage = Outage("the database on 127.0.0.1:1", said.append)
    gone = PostgresStore("postgresql://postgres@127.0.0.1:1/fleet", call_budget=2.0)
    try:
        assert outage.attempt(lambda: monitor_pass(gone, cfg)) is False
        assert outage.attempt(lambda: monitor_pass(gone, cfg)) is False
    finally:
        gone.close()
    assert len(said) == 1 and said[0].startswith("database restarting, reconnecting (the database on 127.0.0.1:1: ")
    back = PostgresStore(db_url)
    try:
        assert outage.attempt(lambda: monitor_pass(back, cfg)) is True
    finally:
        back.close()
    assert len(said) == 2 and said[1].startswith("database back after ")
