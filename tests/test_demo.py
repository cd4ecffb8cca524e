"""The demo (monitor/dev/demo.py): its notion of finished over every task state, on a real database;
and `fleet up --demo` and `fleet up` run for real at 80 columns: one summary of the demo's own run,
a refusal of a config without its lanes, and what a Ctrl-C hands off."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from rich.cells import cell_len

from monitor.dev.demo import demo_finished, demo_states
from worker.models import FINISHED_STATES, TASK_STATES, WAITING_STATES
from worker.store.postgres import PostgresStore

ROOT = Path(__file__).resolve().parents[1]


def test_the_demo_is_finished_when_only_finished_or_waiting_tasks_are_left(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select fleet.sync_lane('docs', '{}'::jsonb)")
        c.execute("select fleet.enqueue('docs', 'demo:x:1')")
        c.execute("select fleet.enqueue('docs', 'demo:x:2')")
        c.execute("select fleet.enqueue('docs', 'other:1')")  # another prefix: never counted
    store = PostgresStore(db_url)
    try:
        assert demo_states(store, "demo:x:") == {"queued": 2}
        assert not demo_finished(demo_states(store, "demo:x:"))
        with psycopg.connect(db_url, autocommit=True) as c:
            c.execute("update fleet.tasks set state = 'blocked', block_reason = 'budget' where key = 'demo:x:1'")
            c.execute("update fleet.tasks set state = 'done', finished_at = now() where key = 'demo:x:2'")
        assert demo_states(store, "demo:x:") == {"blocked": 1, "done": 1}
        assert demo_finished(demo_states(store, "demo:x:"))  # a blocked task waits for a person, not the fleet
    finally:
        store.close()


def test_every_open_state_but_the_waiting_ones_keeps_the_demo_running() -> None:
    for state in TASK_STATES:
        expected = state in FINISHED_STATES or state in WAITING_STATES
        assert demo_finished({state: 1}) is expected, state
    assert {s for s in TASK_STATES if not demo_finished({s: 1})} == {"queued", "running", "batched"}


def test_fleet_up_demo_finishes_and_its_hint_is_how_fleet_was_run(db_url: str, tmp_path: Path) -> None:
    """The quick start, as a subprocess: `uv run fleet up --demo` (uv sets UV_RUN_RECURSION_DEPTH
    for what it runs) ends with a hint that says `uv run fleet`, naming a task that is there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") and k != "DATABASE_URL"}
    env.update(DATABASE_URL=db_url, UV_RUN_RECURSION_DEPTH="1", PYTHONPATH=str(ROOT), COLUMNS="200")
    up = subprocess.run([sys.executable, "-m", "monitor.cli", "up", "--demo", "--timeout", "240"], cwd=tmp_path,
                        env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
    hint = re.search(r"Try:\n  uv run fleet tasks\n  uv run fleet show (demo:\w+:7)\n", up.stdout)
    assert hint is not None, up.stdout[-1000:]
    assert "`fleet " not in up.stdout and "\n  fleet " not in up.stdout  # every command it names is the way it was run
    show = subprocess.run([sys.executable, "-m", "monitor.cli", "show", hint[1]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert show.returncode == 0 and hint[1] in show.stdout, show.stderr


def up(db_url: str, cwd: Path, *args: str, **popen: object) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") and k != "DATABASE_URL"}
    env.update({"DATABASE_URL": db_url, "COLUMNS": "80"})
    return subprocess.Popen([sys.executable, "-c", "from monitor.cli.app import main; main()", "up", *args],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)  # type: ignore[call-overload]


def test_each_demo_prints_one_summary_of_its_own_run(db_url: str, tmp_path: Path) -> None:
    # no fleet.toml here: the built-in example lanes
    outs = []
    for _ in range(2):
        proc = up(db_url, tmp_path, "--demo")
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{out}\n{err}"
        outs.append(out)
    for out in outs:
        lines = out.splitlines()
        assert max(cell_len(line) for line in lines) <= 80 and "…" not in out, out
        assert out.count("this demo's tasks") == 1 and "lanefleet —" not in out, out  # not the live frame too
        docs = next(line.split() for line in lines if line.split()[:1] == ["docs"])
        # its own five docs tasks: four done, the one that always fails dead (not the totals of both runs)
        assert docs[1:5] == ["4", "done,", "1", "dead"], out
        assert "demo finished in" in out and "7 done, 1 dead" in out, out
        assert "tasks in their lane now, tokens in the lane that spent them" in out, out


def test_the_demo_refuses_a_config_without_its_lanes(db_url: str, tmp_path: Path) -> None:
    (tmp_path / "fleet.toml").write_text('[lanes.work]\ncommand = ["true"]\n')
    proc = up(db_url, tmp_path, "--demo")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and out == ""
    assert err.strip().splitlines() == [
        f"error: --demo queues tasks for lanes bugfix, docs, review, and {tmp_path / 'fleet.toml'} lacks bugfix, "
        "docs, review: run it in a folder without a fleet.toml (the built-in example lanes), or add those lanes"]
    with psycopg.connect(db_url) as c:  # nothing started: no lane synced, nothing queued
        assert c.execute("select (select count(*) from fleet.lanes), (select count(*) from fleet.tasks)"
                         ).fetchone() == (0, 0)


def test_ctrl_c_of_fleet_up_says_what_it_handed_off(db_url: str, tmp_path: Path) -> None:
    proc = up(db_url, tmp_path, start_new_session=True)
    try:
        with psycopg.connect(db_url, autocommit=True) as c:
            deadline = time.monotonic() + 60
            while c.execute("select to_regclass('fleet.lanes') is not null and exists "
                            "(select from fleet.lanes where name = 'docs')").fetchone() != (True,):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
            for key in ("slow:1", "slow:2"):
                c.execute("select fleet.enqueue('docs', %s, '{\"steps\": 200, \"sleep\": 0.5}'::jsonb)", (key,))
            while c.execute("select count(*) from fleet.tasks where state = 'running'").fetchone() != (2,):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
            time.sleep(1.5)  # fleet up's display has seen them run
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, f"{out}\n{err}"
            states = c.execute("select state, handoffs from fleet.tasks where key like 'slow:%%'").fetchall()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert states == [("queued", 1), ("queued", 1)]
    assert "stopping: the shifts hand off their 2 running task(s) to the next shift" in out, out
    assert "stopped: 2 task(s) handed off, queued for the next `fleet up` or shift" in out, out
    assert max(cell_len(line) for line in out.splitlines()) <= 80
