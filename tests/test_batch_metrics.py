"""A batch member's agent as a run of its own task, and the cohort figures split batched vs
unbatched (issue #10, item 6: migrations/20261130160100_fleet_batch_member_runs.sql), against a real
Postgres: a known history made with the real SQL API, its exact figures asserted."""

from __future__ import annotations

import json
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from test_dashboards import FLEET_TOML, ok, run_fleet
from test_sql_api import complete, enqueue, one, open_session, record_run, rows
from test_views import lane, take

WINDOW = "now() - interval '1 hour', now() + interval '1 hour'"


def usage(tokens: int, cost: float = 0.01, **extra: Any) -> dict[str, Any]:
    """A member's agent report: ``tokens`` input, 10× that cache-read, 1 cache-creation, 2 output."""
    return {"input_tokens": tokens, "cache_creation_tokens": 1, "cache_read_tokens": 10 * tokens,
            "output_tokens": 2, "cost_usd": cost, "model": "m-test", "agent_session": f"s-{tokens}", **extra}


def call(conn: psycopg.Connection, fn: str, *args: Any) -> Any:
    marks = ", ".join(["%s"] * len(args))
    return one(conn, f"select fleet.{fn}({marks})", tuple(Jsonb(a) if isinstance(a, dict) else a for a in args))


def first(conn: psycopg.Connection, session: uuid.UUID, task_id: int) -> uuid.UUID:
    """Claim exactly ``task_id`` (test_views.take): its lease token."""
    return uuid.UUID(str(take(conn, session, task_id)["lease_token"]))


@pytest.fixture
def history(conn: psycopg.Connection) -> dict[str, Any]:
    """Two unbatched tasks (one blocked and resumed on the way) and a batch of three: b1 lands, b2 is
    evicted by its gate and then done as an ordinary task, b3 is evicted because its agent failed and
    waits in the queue. The batch ships once."""
    lane(conn, "code", backoff_base_seconds=0, max_attempts=5)
    s = open_session(conn, "code")
    ids = {k: enqueue(conn, "code", k) for k in ("u1", "u2", "b1", "b2", "b3")}

    tok = first(conn, s, ids["u1"])
    record_run(conn, tok, usage(100))
    complete(conn, ids["u1"], tok)
    tok = first(conn, s, ids["u2"])
    record_run(conn, tok, usage(50))
    call(conn, "block", ids["u2"], tok, "automation-broken", "the gate crashed")
    assert call(conn, "resume", ids["u2"]) in ("queued", "resumed")
    tok = first(conn, s, ids["u2"])
    record_run(conn, tok, usage(60))
    complete(conn, ids["u2"], tok)

    batch = call(conn, "batch_create", "code", ["b1", "b2", "b3"], 4, None)
    carrier = one(conn, "select task_id from fleet.batches where id = %s", (batch,))
    ctok = first(conn, s, carrier)
    call(conn, "batch_setup", carrier, ctok, "main", f"batch/{batch}")
    call(conn, "batch_member_start", carrier, ctok, 1, f"batch/{batch}-m1-b1", "/w/m1", "c0")
    call(conn, "batch_member_gate", carrier, ctok, 1, "pending", None, usage(200, exit_code=0))
    call(conn, "batch_member_gate", carrier, ctok, 1, "ok", None, None)
    assert call(conn, "batch_member_landed", carrier, ctok, 1, "c0", "c1", "ok") == "landed"
    call(conn, "batch_member_start", carrier, ctok, 2, f"batch/{batch}-m2-b2", "/w/m2", "c1")
    call(conn, "batch_member_gate", carrier, ctok, 2, "pending", None, usage(300, exit_code=0))
    assert call(conn, "batch_member_evicted", carrier, ctok, 2, "FAILED test_x", "task-failed", None) == "queued"
    call(conn, "batch_member_start", carrier, ctok, 3, f"batch/{batch}-m3-b3", "/w/m3", "c1")
    assert call(conn, "batch_member_evicted", carrier, ctok, 3, "the agent exited 1", "task-failed",
                usage(400, exit_code=1)) == "queued"
    call(conn, "batch_tail", carrier, ctok, "ship", {"exit_code": 0})
    assert call(conn, "batch_finish", carrier, ctok, {}) == "done"

    tok = first(conn, s, ids["b2"])  # the evicted b2, now an ordinary task
    record_run(conn, tok, usage(70))
    complete(conn, ids["b2"], tok)
    return {"ids": ids, "batch": batch, "carrier": carrier, "session": s}


def test_a_members_agent_is_a_closed_run_of_its_own_task_that_follows_the_member(
        conn: psycopg.Connection, history: dict[str, Any]) -> None:
    ids = history["ids"]

    def runs_of(key: str) -> list[dict[str, Any]]:
        return rows(conn, "select * from fleet.runs where task_id = %s order by id", (ids[key],))

    (b1,) = runs_of("b1")
    assert (b1["outcome"], b1["gate"], b1["reason"], b1["exit_code"], b1["attempt"]) == ("done", "ok", None, 0, 1)
    assert (b1["input_tokens"], b1["cache_read_tokens"], b1["cost_usd"]) == (200, 2000, Decimal("0.010000"))
    assert b1["session_id"] == history["session"] and b1["ended_at"] is not None and b1["model"] == "m-test"
    b2_member, b2_alone = runs_of("b2")
    assert (b2_member["outcome"], b2_member["gate"], b2_member["reason"]) == ("failed", "task-failed", "verify-failed")
    assert b2_member["input_tokens"] == 300 and b2_alone["attempt"] == 2 and b2_alone["outcome"] == "done"
    (b3,) = runs_of("b3")
    assert (b3["outcome"], b3["reason"], b3["exit_code"], b3["input_tokens"]) == ("failed", "agent-failed", 1, 400)
    # the member's agent session is kept for its next attempt; the member rows point at their runs
    assert one(conn, "select agent_session from fleet.tasks where id = %s", (ids["b3"],)) == "s-400"
    members = rows(conn, "select n, run_id, tokens from fleet.batch_members where batch_id = %s order by n",
                   (history["batch"],))
    assert [m["run_id"] for m in members] == [b1["id"], b2_member["id"], b3["id"]]
    assert [m["tokens"] for m in members] == [200 + 1 + 2000 + 2, 300 + 1 + 3000 + 2, 400 + 1 + 4000 + 2]
    # the carrier's run spent nothing of theirs; no run is left open
    (carrier,) = rows(conn, "select * from fleet.runs where task_id = %s", (history["carrier"],))
    assert carrier["outcome"] == "done" and carrier["input_tokens"] == 0 and carrier["cost_usd"] == 0
    assert one(conn, "select count(*) from fleet.runs where ended_at is null") == 0


def test_a_gate_re_reported_after_a_takeover_records_the_members_run_once(conn: psycopg.Connection) -> None:
    lane(conn, "code")
    s = open_session(conn, "code")
    enqueue(conn, "code", "m")
    batch = call(conn, "batch_create", "code", ["m"], 4, None)
    carrier = one(conn, "select task_id from fleet.batches where id = %s", (batch,))
    ctok = first(conn, s, carrier)
    call(conn, "batch_setup", carrier, ctok, "main", f"batch/{batch}")
    call(conn, "batch_member_start", carrier, ctok, 1, "b", "/w", "c0")
    call(conn, "batch_member_gate", carrier, ctok, 1, "pending", None, usage(10))
    call(conn, "batch_member_gate", carrier, ctok, 1, "pending", None, usage(10))
    call(conn, "batch_member_gate", carrier, ctok, 1, "automation-broken", "the gate crashed", None)
    (run,) = rows(conn, "select r.* from fleet.runs r join fleet.tasks t on t.id = r.task_id where t.key = 'm'")
    assert (run["input_tokens"], run["outcome"], run["reason"]) == (10, "blocked", "automation-broken")
    assert one(conn, "select tokens from fleet.batch_members where batch_id = %s", (batch,)) == 10 + 1 + 100 + 2


@pytest.mark.parametrize("bad, names", [
    ({"input_tokens": -1}, "input_tokens"), ({"output_tokens": 1.5}, "output_tokens"),
    ({"cost_usd": "a lot"}, "cost_usd"), (["not", "an", "object"], "JSON object")])
def test_a_malformed_member_usage_is_refused_and_changes_nothing(conn: psycopg.Connection, bad: Any,
                                                                 names: str) -> None:
    lane(conn, "code")
    s = open_session(conn, "code")
    enqueue(conn, "code", "m")
    batch = call(conn, "batch_create", "code", ["m"], 4, None)
    carrier = one(conn, "select task_id from fleet.batches where id = %s", (batch,))
    ctok = first(conn, s, carrier)
    call(conn, "batch_setup", carrier, ctok, "main", f"batch/{batch}")
    call(conn, "batch_member_start", carrier, ctok, 1, "b", "/w", "c0")
    with pytest.raises(psycopg.Error) as err:
        one(conn, "select fleet.batch_member_gate(%s, %s, 1, 'pending', null, %s)", (carrier, ctok, Jsonb(bad)))
    assert err.value.sqlstate == "LF005" and names in str(err.value)
    assert one(conn, "select gate from fleet.batch_members where batch_id = %s", (batch,)) is None
    assert one(conn, "select count(*) from fleet.runs r join fleet.tasks t on t.id = r.task_id where t.key = 'm'") == 0


def test_cohort_split_gives_the_batched_and_unbatched_figures_apart(conn: psycopg.Connection,
                                                                    history: dict[str, Any]) -> None:
    got = {r["cohort"]: r for r in rows(conn, f"select * from fleet.cohort_split({WINDOW}, 'code')")}
    assert set(got) == {"batched", "unbatched"}

    def tok(*inputs: int) -> int:  # the tokens of usage() reports
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
        "operator_cancels": 0, "operator_retries": 0, "operator_resumes": 0, "interventions": 0}
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


def test_fleet_stats_shows_the_split_when_the_window_saw_a_batch(conn: psycopg.Connection, db_url: str,
                                                                 tmp_path: Path, history: dict[str, Any]) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "fleet.toml").write_text(FLEET_TOML)
    data = json.loads(ok(run_fleet("stats", "--json", "--lane", "code", url=db_url, home=home)))
    assert [(r["cohort"], r["tasks"], r["batch_members"], r["ship_runs"]) for r in data["cohort_split"]] == [
        ("batched", 3, 3, 1), ("unbatched", 2, 0, 0)]
    out = ok(run_fleet("stats", "--lane", "code", url=db_url, home=home))
    assert "batched vs unbatched" in out
    batched = next(line for line in out.splitlines() if line.strip().strip("│┃ ").startswith("batched"))
    assert "66.7%" in batched  # 2 of 3 members evicted
