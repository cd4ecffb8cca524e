"""The cohorts group (migrations/sources/15_cohorts.sql): fleet.cohort_metrics and fleet.cohort_split,
the figures of the tasks queued in a window, against a real PostgreSQL: a known history made with
the real SQL API, its exact figures asserted.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import psycopg
from sqlkit import (
    cancel,
    complete,
    enqueue,
    fail,
    hand_off,
    one,
    open_session,
    pick,
    record_run,
    release,
    retry,
    route,
    rows,
    set_run,
    sync_lane,
    take,
)

# ------------------------------------------------------------------------------------------------
# cohort_metrics


def test_cohort_metrics_of_a_known_cohort(conn: psycopg.Connection) -> None:
    sync_lane(conn, "a", max_attempts=2, backoff_base_seconds=0)
    sync_lane(conn, "b")
    s = open_session(conn, "a")
    sb = open_session(conn, "b")
    t0 = one(conn, "select date_trunc('hour', now(), 'UTC') - interval '2 days'")
    t1 = t0 + timedelta(days=1)

    def at(minutes: float) -> str:
        return f"'{(t0 + timedelta(minutes=minutes)).isoformat()}'::timestamptz"

    def made(key: str, lane_name: str = "a", minutes: float = 0) -> int:
        task_id = enqueue(conn, lane_name, key)
        conn.execute(f"update fleet.tasks set created_at = {at(minutes)} where id = %s", (task_id,))
        return task_id

    def finish(task_id: int, minutes: float) -> None:
        conn.execute(f"update fleet.tasks set finished_at = {at(minutes)} where id = %s", (task_id,))

    tok_cost = {"input_tokens": 100, "cache_creation_tokens": 10, "cache_read_tokens": 1000, "output_tokens": 20,
                "cost_usd": 0.1}
    c1 = made("c1")                                   # done: wall 10 min
    tok = take(conn, s, c1)["lease_token"]
    record_run(conn, tok, tok_cost)
    complete(conn, c1, tok)
    set_run(conn, tok, at(10), at(20))
    finish(c1, 20)
    c2 = made("c2")                                   # failed, then done: wall 60 min
    tok1 = take(conn, s, c2)["lease_token"]
    record_run(conn, tok1, tok_cost)
    fail(conn, c2, tok1)
    tok2 = take(conn, s, c2)["lease_token"]
    record_run(conn, tok2, tok_cost)
    complete(conn, c2, tok2)
    set_run(conn, tok1, at(5), at(6))
    set_run(conn, tok2, at(30), at(65))
    finish(c2, 65)
    c3 = made("c3")                                   # handed off, then done: wall 120 min
    tok1 = take(conn, s, c3)["lease_token"]
    hand_off(conn, c3, tok1, {})
    s2 = open_session(conn, "a")
    tok2 = take(conn, s2, c3)["lease_token"]
    complete(conn, c3, tok2)
    set_run(conn, tok1, at(60), at(90))
    set_run(conn, tok2, at(100), at(180))
    finish(c3, 180)
    c4 = made("c4")                                   # repaired twice: dead at the cap
    take(conn, s, c4)
    release(conn, c4, "lease-expired")
    take(conn, s, c4)
    release(conn, c4, "lease-expired")
    conn.execute(f"update fleet.runs set started_at = {at(40)}, ended_at = {at(41)} where task_id = %s", (c4,))
    finish(c4, 300)                                   # the last finish
    c5 = made("c5")                                   # cancelled while queued
    cancel(conn, c5)
    c6 = made("c6")                                   # dead (fatal), retried by an operator: queued
    tok = take(conn, s, c6)["lease_token"]
    fail(conn, c6, tok, retryable=False)
    retry(conn, c6)
    set_run(conn, tok, at(2), at(3))
    c7 = made("c7")                                   # a -> b, done in b: wall 240 min, entered by a
    tok1 = take(conn, s, c7)["lease_token"]
    route(conn, c7, tok1, "b")
    tok2 = take(conn, sb, c7)["lease_token"]
    record_run(conn, tok2, tok_cost)
    complete(conn, c7, tok2)
    set_run(conn, tok1, at(1), at(11))
    set_run(conn, tok2, at(200), at(241))
    finish(c7, 241)
    c8 = made("c8", "b", 30)                          # b only: wall 30 min
    tok = take(conn, sb, c8)["lease_token"]
    complete(conn, c8, tok)
    set_run(conn, tok, at(40), at(70))
    finish(c8, 70)
    before = made("c9", "a", -10)                     # queued before the cohort: not in it
    complete(conn, before, take(conn, s, before)["lease_token"])
    after = made("c10", "a", 24 * 60)                 # queued at p_to: not in it
    assert after

    def cohort(lane_name: str | None = None) -> dict[str, Any]:
        got = rows(conn, "select * from fleet.cohort_metrics(%s, %s, %s)", (t0, t1, lane_name))
        assert len(got) == 1
        return got[0]

    everything = cohort()
    assert everything == {
        "lane": None, "cohort_from": t0, "cohort_to": t1,
        "tasks": 8, "completed": 5, "dead": 1, "cancelled": 1, "open": 1,
        "first_claim_at": t0 + timedelta(minutes=1), "last_finish_at": t0 + timedelta(minutes=300),
        "makespan_seconds": Decimal("17940.0"),
        # walls of the done tasks: 10, 60, 120, 240 (c7: since its claim in a), 30 (c8) minutes
        "wall_p50_seconds": Decimal("3600.0"), "wall_p95_seconds": Decimal("12960.0"),
        "runs": 11, "attempts_per_task": Decimal("1.38"), "failures": 2, "handoffs": 1, "repairs": 2,
        "input_tokens": 400, "cache_creation_tokens": 40, "cache_read_tokens": 4000, "output_tokens": 80,
        "total_tokens": 4520, "cost_usd": Decimal("0.400000"),
        "tokens_per_completed": Decimal("904.0"), "cost_per_completed": Decimal("0.080000"),
        "operator_cancels": 1, "operator_retries": 1, "interventions": 2,
        "ci_tasks": 0, "ci_executions": 0, "ci_cycles": 0, "ci_executions_per_task": None, "regressions": 0}
    a = cohort("a")
    assert pick(a, "lane", "tasks", "completed", "dead", "cancelled", "open", "runs", "failures", "handoffs",
                "repairs", "total_tokens", "interventions", "wall_p50_seconds") == {
        "lane": "a", "tasks": 7, "completed": 4, "dead": 1, "cancelled": 1, "open": 1, "runs": 10,
        "failures": 2, "handoffs": 1, "repairs": 2, "total_tokens": 4520, "interventions": 2,
        "wall_p50_seconds": Decimal("5400.0")}
    b = cohort("b")
    assert pick(b, "tasks", "completed", "runs", "makespan_seconds", "wall_p50_seconds", "total_tokens",
                "cost_per_completed") == {
        "tasks": 1, "completed": 1, "runs": 1, "makespan_seconds": Decimal("1800.0"),
        "wall_p50_seconds": Decimal("1800.0"), "total_tokens": 0, "cost_per_completed": Decimal("0.000000")}
    empty = cohort("nope")
    assert pick(empty, "tasks", "completed", "runs", "makespan_seconds", "attempts_per_task",
                "cost_per_completed", "interventions") == {
        "tasks": 0, "completed": 0, "runs": 0, "makespan_seconds": None, "attempts_per_task": None,
        "cost_per_completed": None, "interventions": 0}


def test_cohort_metrics_agree_for_recent_and_old_cohorts(conn: psycopg.Connection) -> None:
    """An old cohort is read task by task, a recent one by range: the same figures either way."""
    sync_lane(conn, "a", backoff_base_seconds=0)
    s = open_session(conn, "a")
    ids = []
    for i in range(4):
        t = enqueue(conn, "a", f"o{i}")
        tok = take(conn, s, t)["lease_token"]
        if i == 0:
            fail(conn, t, tok)
            tok = take(conn, s, t)["lease_token"]
        record_run(conn, tok, {"input_tokens": 10 * (i + 1), "cost_usd": 0.01})
        complete(conn, t, tok)
        ids.append(t)
    query = "select * from fleet.cohort_metrics(now() - interval '1 hour', now() + interval '1 hour')"
    recent = rows(conn, query)[0]
    # the same history, 60 days older
    for table, cols in (("tasks", ["created_at", "updated_at", "finished_at", "run_at"]),
                        ("runs", ["started_at", "ended_at"]), ("events", ["ts"])):
        sets = ", ".join(f"{c} = {c} - interval '60 days'" for c in cols)
        conn.execute(f"update fleet.{table} set {sets}")
    old = rows(conn, query.replace("now() -", "now() - interval '60 days' -").replace(
        "now() +", "now() - interval '60 days' +"))[0]
    for key in ("cohort_from", "cohort_to", "first_claim_at", "last_finish_at"):
        recent.pop(key), old.pop(key)
    assert old == recent
    assert recent["tasks"] == 4 and recent["runs"] == 5 and recent["input_tokens"] == 100


# ------------------------------------------------------------------------------------------------
# cohort_split: batched and unbatched apart (the history: sqlkit.build_batch_history)


WINDOW = "now() - interval '1 hour', now() + interval '1 hour'"


def test_cohort_split_gives_the_batched_and_unbatched_figures_apart(conn: psycopg.Connection,
                                                                    batch_history: dict[str, Any]) -> None:
    got = {r["cohort"]: r for r in rows(conn, f"select * from fleet.cohort_split({WINDOW}, 'code')")}
    assert set(got) == {"batched", "unbatched"}

    def tok(*inputs: int) -> int:  # the tokens of member_usage() reports
        return sum(i + 1 + 10 * i + 2 for i in inputs)

    batched = {k: v for k, v in got["batched"].items() if k not in ("cohort_from", "cohort_to", "first_claim_at",
                                                                      "last_finish_at", "makespan_seconds",
                                                                      "wall_p50_seconds", "wall_p95_seconds")}
    assert batched == {
        "cohort": "batched", "lane": "code", "tasks": 3, "completed": 2, "dead": 0, "cancelled": 0, "open": 1,
        "runs": 4, "attempts_per_task": Decimal("1.33"), "failures": 2, "handoffs": 0, "repairs": 0,
        "input_tokens": 200 + 300 + 400 + 70, "cache_creation_tokens": 4, "cache_read_tokens": 9700,
        "output_tokens": 8, "total_tokens": tok(200, 300, 400, 70),
        "cache_read_share": round(Decimal(9700) / Decimal(970 + 4 + 9700), 4),
        "cost_usd": Decimal("0.040000"), "tokens_per_completed": round(Decimal(tok(200, 300, 400, 70)) / 2, 1),
        "cost_per_completed": Decimal("0.020000"),
        "batches": 1, "batch_members": 3, "evicted": 2, "eviction_rate": Decimal("0.6667"),
        "ship_runs": 1, "ship_runs_per_completed": Decimal("0.5000"), "blocks": 0,
        "operator_cancels": 0, "operator_retries": 0, "operator_resumes": 0, "interventions": 0,
        "ci_tasks": 0, "ci_executions": 0, "ci_cycles": 0, "ci_executions_per_task": None, "regressions": 0}
    u = got["unbatched"]
    assert {k: u[k] for k in ("tasks", "completed", "open", "runs", "total_tokens", "batches", "batch_members",
                              "eviction_rate", "ship_runs", "blocks", "operator_resumes", "interventions")} == {
        "tasks": 2, "completed": 2, "open": 0, "runs": 3, "total_tokens": tok(100, 50, 60), "batches": 0,
        "batch_members": 0, "eviction_rate": None, "ship_runs": 0, "blocks": 1, "operator_resumes": 1,
        "interventions": 1}
    assert got["batched"]["makespan_seconds"] is not None and got["batched"]["wall_p50_seconds"] is not None

    # unsplit, and cohort_metrics: the same cohort, carriers never counted as tasks
    (everything,) = rows(conn, f"select * from fleet.cohort_split({WINDOW}, 'code', false)")
    assert (everything["cohort"], everything["tasks"], everything["runs"], everything["total_tokens"]) == (
        "all", 5, 7, tok(200, 300, 400, 70, 100, 50, 60))
    (metrics,) = rows(conn, f"select * from fleet.cohort_metrics({WINDOW}, 'code')")
    assert {k: metrics[k] for k in ("tasks", "completed", "open", "runs", "total_tokens")} == {
        "tasks": 5, "completed": 4, "open": 1, "runs": 7, "total_tokens": everything["total_tokens"]}
    # an empty cohort: both rows, zeros and no ratios
    empty = rows(conn, "select * from fleet.cohort_split(now() + interval '1 day', now() + interval '2 days')")
    assert [(r["cohort"], r["tasks"], r["runs"], r["eviction_rate"], r["cache_read_share"]) for r in empty] == [
        ("batched", 0, 0, None, None), ("unbatched", 0, 0, None, None)]
