"""The demo's notion of finished (monitor/dev/demo.py) over every task state, on a real database."""

from __future__ import annotations

import psycopg

from monitor.dev.demo import demo_finished, demo_states
from worker.models import FINISHED_STATES, TASK_STATES, WAITING_STATES
from worker.store.postgres import PostgresStore


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
