"""The demo: its notion of finished (monitor/dev/demo.py) over every task state, on a real database, and
`fleet up --demo` itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg

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
    hint = re.search(r"Try `uv run fleet tasks` and `uv run fleet show (demo:\w+:7)`", up.stdout)
    assert hint is not None, up.stdout[-1000:]
    assert "`fleet " not in up.stdout  # every command it names is the way it was run
    show = subprocess.run([sys.executable, "-m", "monitor.cli", "show", hint[1]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert show.returncode == 0 and hint[1] in show.stdout, show.stderr
