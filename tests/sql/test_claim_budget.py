"""fleet.claim blocks a task whose earlier runs spent its budget, in the claim's own transaction."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row


def q(conn: psycopg.Connection, query: str, *params: Any) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, params)
        return cur.fetchall() if cur.description else []


@pytest.fixture
def db(conn: psycopg.Connection) -> psycopg.Connection:
    q(conn, "select fleet.sync_lane('b', '{}'::jsonb)")
    return conn


def session(conn: psycopg.Connection) -> Any:
    return q(conn, "select fleet.open_session('b', 'host', 1, now(), 600) as s")[0]["s"]


def spend(conn: psycopg.Connection, task: int, tokens: int, cost: float) -> None:
    """One run of the task that spent ``tokens`` and ``cost``, failed and queued again at once."""
    s = session(conn)
    (t,) = q(conn, "select * from fleet.claim(%s, 1)", s)
    assert t["id"] == task
    q(conn, "select fleet.record_run(%s, %s::jsonb)", t["lease_token"],
      json.dumps({"exit_code": 1, "input_tokens": tokens, "cost_usd": cost}))
    q(conn, "select fleet.fail(%s, %s, 'spent', true, null)", task, t["lease_token"])
    q(conn, "update fleet.tasks set run_at = now() where id = %s", task)


def enqueue(conn: psycopg.Connection, key: str, **budget: Any) -> int:
    (row,) = q(conn, "select task_id as id from fleet.enqueue_task('b', %s, p_max_cost_usd => %s, p_max_tokens => %s)",
               key, budget.get("max_cost_usd"), budget.get("max_tokens"))
    return int(row["id"])


def test_a_task_whose_runs_spent_its_token_budget_is_blocked_by_the_claim(db: psycopg.Connection) -> None:
    over = enqueue(db, "over", max_tokens=1000)
    fits = enqueue(db, "fits", max_tokens=1000)
    spend(db, over, 1500, 0.01)
    q(db, "update fleet.tasks set priority = 5 where id = %s", over)  # first in line
    claimed = q(db, "select id from fleet.claim(%s, 5)", session(db))
    assert [c["id"] for c in claimed] == [fits]
    (row,) = q(db, "select state, block_reason, last_error, failures from fleet.tasks where id = %s", over)
    assert (row["state"], row["block_reason"], row["failures"]) == ("blocked", "budget", 1)
    assert row["last_error"] == "spent 1,500 tokens of the task's 1,000 budget ($0.0100)"
    (run,) = q(db, "select outcome, reason from fleet.runs where task_id = %s and attempt = 2", over)
    assert (run["outcome"], run["reason"]) == ("blocked", "budget")
    kinds = [r["kind"] for r in q(db, "select kind from fleet.events where task_id = %s order by id", over)]
    assert kinds[-2:] == ["claimed", "blocked"]


def test_the_lanes_synced_budget_counts_when_the_task_has_none(db: psycopg.Connection) -> None:
    t = enqueue(db, "lane-budget")
    spend(db, t, 10, 0.75)
    assert [c["id"] for c in q(db, "select id from fleet.claim(%s, 1)", session(db))] == [t]  # no budget yet
    q(db, "select fleet.fail(%s, (select lease_token from fleet.tasks where id = %s), 'x', true, null)", t, t)
    q(db, "update fleet.tasks set run_at = now() where id = %s", t)
    q(db, "select fleet.sync_lane('b', '{\"config\": {\"max_cost_usd\": 0.5}}'::jsonb)")
    assert q(db, "select id from fleet.claim(%s, 1)", session(db)) == []
    (row,) = q(db, "select state, last_error from fleet.tasks where id = %s", t)
    assert row == {"state": "blocked", "last_error": "spent $0.7500 of the task's $0.5000 budget (10 tokens)"}


def test_a_blocked_task_takes_no_pool_slot(db: psycopg.Connection) -> None:
    q(db, "select fleet.sync_pool('p', 1)")
    q(db, "select fleet.sync_profile('prof', 'p', '{}'::jsonb)")
    q(db, "select fleet.sync_lane('b', '{\"config\": {\"profile\": \"prof\"}}'::jsonb)")
    over = enqueue(db, "over", max_tokens=10)
    fits = enqueue(db, "fits")
    spend(db, over, 50, 0)
    q(db, "update fleet.tasks set priority = 5 where id = %s", over)
    claimed = q(db, "select id, pool from fleet.claim(%s, 2)", session(db))
    assert claimed == [{"id": fits, "pool": "p"}]  # the pool's one slot went to the task that may run
    assert q(db, "select state from fleet.tasks where id = %s", over) == [{"state": "blocked"}]


def test_within_budget_the_claim_is_as_before(db: psycopg.Connection) -> None:
    t = enqueue(db, "ok", max_cost_usd=1)
    spend(db, t, 10, 0.25)
    assert [c["id"] for c in q(db, "select id from fleet.claim(%s, 1)", session(db))] == [t]
