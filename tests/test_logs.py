"""One log stream (worker/logs.py): the libraries' ``logging`` records and Python's ``warnings``
come out through the shift's structlog renderer, one JSON object per line.

Each case runs in a subprocess of its own: configure_logging sets process-wide state (the root
logger, ``warnings``), and what is checked is the process's real stderr.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
from conftest import dbname_of
from fleetkit import ROOT, Backend, Fleet, lane_defaults, wait_for
from psycopg import sql

# logs through lanefleet, a library logger, warnings and a psycopg_pool that cannot connect
SCRIPT = """
import logging, warnings
import structlog
from psycopg_pool import ConnectionPool, PoolTimeout
from worker.logs import configure_logging

configure_logging(json_logs={json_logs})
configure_logging(json_logs={json_logs})  # idempotent: still one handler
structlog.get_logger("lanefleet.test").info("own event", n=1)
structlog.get_logger("lanefleet.test").debug("own debug")
logging.getLogger("httpx").info("HTTP Request: GET http://x 200 OK")
warnings.warn("careful now", stacklevel=1)
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("apscheduler.executors.default").exception("job raised")
pool = ConnectionPool("host=127.0.0.1 port={port} connect_timeout=2", min_size=1, open=False,
                      name="lanefleet")
try:
    pool.open(wait=True, timeout=2)
except PoolTimeout:
    pass
pool.close()
"""


def free_port() -> int:
    """A loopback port where nothing listens (bound, read, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_script(json_logs: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    code = SCRIPT.format(json_logs=json_logs, port=free_port())
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    environ.update(env or {})
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of ``text`` as a JSON object, with the four fields every line has; fails on any
    line that is not one."""
    records = []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\n--- all of it:\n{text}") from None
        assert isinstance(obj, dict), line
        assert {"event", "level", "timestamp", "logger"} <= obj.keys(), line
        records.append(obj)
    return records


def test_library_records_and_warnings_are_json_lines_with_their_logger_and_level() -> None:
    records = json_lines(run_script().stderr)
    by_logger: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_logger.setdefault(r["logger"], []).append(r)

    # lanefleet's own events: every level, once each (a second configure added no handler)
    own = [(r["event"], r["level"]) for r in by_logger["lanefleet.test"]]
    assert own == [("own event", "info"), ("own debug", "debug")], own
    assert by_logger["lanefleet.test"][0]["n"] == 1

    # the pool that could not connect: its warning, under its own logger name
    pool = by_logger["psycopg.pool"]
    assert any(r["event"].startswith("error connecting in 'lanefleet'") and r["level"] == "warning"
               for r in pool), pool
    # warnings.warn, through logging.captureWarnings
    (warned,) = by_logger["py.warnings"]
    assert warned["level"] == "warning" and "UserWarning: careful now" in warned["event"], warned
    assert not warned["event"].endswith("\n")
    # an exception is a field of its record, not a traceback across lines
    (raised,) = by_logger["apscheduler.executors.default"]
    assert raised["level"] == "error" and raised["event"] == "job raised"
    assert raised["exception"].startswith("Traceback") and "ZeroDivisionError" in raised["exception"]
    # libraries log from WARNING up: no line per HTTP request
    assert "httpx" not in by_logger
    assert all(r["timestamp"].endswith("Z") for r in records)


def test_fleet_log_level_sets_the_libraries_level_and_not_lanefleets() -> None:
    info = {r["logger"] for r in json_lines(run_script(env={"FLEET_LOG_LEVEL": "info"}).stderr)}
    assert {"httpx", "psycopg.pool", "lanefleet.test"} <= info, info

    quiet = json_lines(run_script(env={"FLEET_LOG_LEVEL": "ERROR"}).stderr)
    loggers = {r["logger"] for r in quiet}
    assert "psycopg.pool" not in loggers and "py.warnings" not in loggers, loggers
    assert "apscheduler.executors.default" in loggers  # an error is still an error
    assert [r["event"] for r in quiet if r["logger"] == "lanefleet.test"] == ["own event", "own debug"]

    bad = json_lines(run_script(env={"FLEET_LOG_LEVEL": "loud"}).stderr)
    said = [r for r in bad if r["logger"] == "lanefleet.logs"]  # at each of the script's two calls
    assert said and all(r["level"] == "warning" and r["value"] == "loud" for r in said), said
    assert {"psycopg.pool", "py.warnings"} <= {r["logger"] for r in bad}  # WARNING, the default
    assert "httpx" not in {r["logger"] for r in bad}


def test_text_logs_render_library_records_the_same_way() -> None:
    err = re.sub(r"\x1b\[[0-9;]*m", "", run_script(json_logs=False).stderr)  # no colours
    # a record starts with its timestamp (a message or a traceback may take more lines)
    records = re.split(r"\n(?=\d{4}-\d\d-\d\dT)", err.strip())
    pool = [r for r in records if "error connecting in 'lanefleet'" in r]
    assert pool and all(r.split()[1:3] == ["[warning", "]"] and "[psycopg.pool]" in r for r in pool), err
    assert any("own event" in r and "[lanefleet.test]" in r for r in records), err
    (raised,) = [r for r in records if "job raised" in r]
    assert "[apscheduler.executors.default]" in raised and "ZeroDivisionError" in raised, raised
    assert "locals" not in raised  # frames' locals (URLs, keys) are not printed
    assert "HTTP Request" not in err


def test_a_shift_log_stays_json_while_the_database_is_unreachable(pg_server: str, db_url: str,
                                                                   tmp_path: Path) -> None:
    fleet = Fleet(Backend("postgres", db_url), tmp_path, {"work": lane_defaults(lease_seconds=3)})
    name = dbname_of(db_url)
    log = tmp_path / "shift.log"
    task_id = fleet.enqueue("work", "slow", {"steps": 40, "sleep": 0.2})
    shift = fleet.spawn_shift("work", "--max-seconds", "60", log=log)
    admin = psycopg.connect(pg_server, autocommit=True)
    try:
        wait_for("the task to run", lambda: fleet.task(task_id)["state"] == "running", timeout=20)
        fleet.close()  # the test's own pool: nothing of it reconnects while the database is shut
        # the database goes away under the running shift: its connections cut, new ones refused
        admin.execute(sql.SQL("alter database {} allow_connections false").format(sql.Identifier(name)))
        admin.execute("select pg_terminate_backend(pid) from pg_stat_activity where datname = %s", (name,))
        wait_for("the shift's pool and the shift to log that they cannot reach the database",
                 lambda: all(said in log.read_text() for said in ("error connecting in 'lanefleet'",
                                                                  "will try again")),
                 timeout=20, every=0.1)
        admin.execute(sql.SQL("alter database {} allow_connections true").format(sql.Identifier(name)))
        shift.send_signal(signal.SIGTERM)  # back again: the shift hands its task off and ends
        assert shift.wait(timeout=60) == 0
    finally:
        admin.execute(sql.SQL("alter database {} allow_connections true").format(sql.Identifier(name)))
        admin.close()
        fleet.close()
        if shift.poll() is None:
            shift.kill()
            shift.wait()
    records = json_lines(log.read_text())
    pool = [r for r in records if r["logger"] == "psycopg.pool"]
    assert pool and all(r["level"] == "warning" for r in pool), pool
    own = [r for r in records if r["logger"] == "lanefleet.shift"]
    # the shift said what failed (a claim or a heartbeat) and carried on to its deadline
    assert any(r["level"] == "warning" and r["event"].endswith("will try again") for r in own), \
        [r["event"] for r in own]
    assert own[-1]["event"] == "shift ended", own[-1]
