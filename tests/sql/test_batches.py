"""The batches group (migrations/sources/11_batches.sql), called over psycopg: a batch member's agent is
a run of its own task (closed, with the member's usage, following the member), recorded once, and a
malformed usage report is refused. (Batches through real shifts and git, on both back-ends:
tests/test_batches.py.)
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from sqlkit import (
    as_key,
    call,
    enqueue,
    member_usage,
    one,
    open_session,
    rows,
    sync_lane,
    take_lease,
)


def task_state(conn: psycopg.Connection, task_id: int) -> str:
    return str(one(conn, "select state from fleet.tasks where id = %s", (task_id,)))


def one_member_batch(conn: psycopg.Connection, keys: list[str]) -> tuple[int, Any, int]:
    """A batch of ``keys`` in lane code, set up, its first member started and its gate pending:
    (carrier, carrier token, batch)."""
    sync_lane(conn, "code")
    s = open_session(conn, "code")
    for k in keys:
        enqueue(conn, "code", k)
    batch = call(conn, "batch_create", "code", keys, 4, None)
    carrier = one(conn, "select task_id from fleet.batches where id = %s", (batch,))
    ctok = take_lease(conn, s, carrier)
    call(conn, "batch_setup", carrier, ctok, "main", f"batch/{batch}")
    call(conn, "batch_member_start", carrier, ctok, 1, "b", "/w", "c0")
    call(conn, "batch_member_gate", carrier, ctok, 1, "pending", None, member_usage(10))
    return carrier, ctok, batch


# ------------------------------------------------------------------------------------------------
# a member's agent is a run of its own task


def test_a_members_agent_is_a_closed_run_of_its_own_task_that_follows_the_member(
        conn: psycopg.Connection, batch_history: dict[str, Any]) -> None:
    ids = batch_history["ids"]

    def runs_of(key: str) -> list[dict[str, Any]]:
        return rows(conn, "select * from fleet.runs where task_id = %s order by id", (ids[key],))

    (b1,) = runs_of("b1")
    assert (b1["outcome"], b1["gate"], b1["reason"], b1["exit_code"], b1["attempt"]) == ("done", "ok", None, 0, 1)
    assert (b1["input_tokens"], b1["cache_read_tokens"], b1["cost_usd"]) == (200, 2000, Decimal("0.010000"))
    assert b1["session_id"] == batch_history["session"] and b1["ended_at"] is not None and b1["model"] == "m-test"
    b2_member, b2_alone = runs_of("b2")
    assert (b2_member["outcome"], b2_member["gate"], b2_member["reason"]) == ("failed", "task-failed", "verify-failed")
    assert b2_member["input_tokens"] == 300 and b2_alone["attempt"] == 2 and b2_alone["outcome"] == "done"
    (b3,) = runs_of("b3")
    assert (b3["outcome"], b3["reason"], b3["exit_code"], b3["input_tokens"]) == ("failed", "agent-failed", 1, 400)
    # the member's agent session is kept for its next attempt; the member rows point at their runs
    assert one(conn, "select agent_session from fleet.tasks where id = %s", (ids["b3"],)) == "s-400"
    members = rows(conn, "select n, run_id, tokens from fleet.batch_members where batch_id = %s order by n",
                   (batch_history["batch"],))
    assert [m["run_id"] for m in members] == [b1["id"], b2_member["id"], b3["id"]]
    assert [m["tokens"] for m in members] == [200 + 1 + 2000 + 2, 300 + 1 + 3000 + 2, 400 + 1 + 4000 + 2]
    # the carrier's run spent nothing of theirs; no run is left open
    (carrier,) = rows(conn, "select * from fleet.runs where task_id = %s", (batch_history["carrier"],))
    assert carrier["outcome"] == "done" and carrier["input_tokens"] == 0 and carrier["cost_usd"] == 0
    assert one(conn, "select count(*) from fleet.runs where ended_at is null") == 0


def test_a_gate_re_reported_after_a_takeover_records_the_members_run_once(conn: psycopg.Connection) -> None:
    carrier, ctok, batch = one_member_batch(conn, ["m"])  # its gate reported pending once
    call(conn, "batch_member_gate", carrier, ctok, 1, "pending", None, member_usage(10))
    call(conn, "batch_member_gate", carrier, ctok, 1, "automation-broken", "the gate crashed", None)
    (run,) = rows(conn, "select r.* from fleet.runs r join fleet.tasks t on t.id = r.task_id where t.key = 'm'")
    assert (run["input_tokens"], run["outcome"], run["reason"]) == (10, "blocked", "automation-broken")
    assert one(conn, "select tokens from fleet.batch_members where batch_id = %s", (batch,)) == 10 + 1 + 100 + 2


@pytest.mark.parametrize("bad, names", [
    ({"input_tokens": -1}, "input_tokens"), ({"output_tokens": 1.5}, "output_tokens"),
    ({"cost_usd": "a lot"}, "cost_usd"), (["not", "an", "object"], "JSON object")])
def test_a_malformed_member_usage_is_refused_and_changes_nothing(conn: psycopg.Connection, bad: Any,
                                                                 names: str) -> None:
    sync_lane(conn, "code")
    s = open_session(conn, "code")
    enqueue(conn, "code", "m")
    batch = call(conn, "batch_create", "code", ["m"], 4, None)
    carrier = one(conn, "select task_id from fleet.batches where id = %s", (batch,))
    ctok = take_lease(conn, s, carrier)
    call(conn, "batch_setup", carrier, ctok, "main", f"batch/{batch}")
    call(conn, "batch_member_start", carrier, ctok, 1, "b", "/w", "c0")
    with pytest.raises(psycopg.Error) as err:
        one(conn, "select fleet.batch_member_gate(%s, %s, 1, 'pending', null, %s)", (carrier, ctok, Jsonb(bad)))
    assert err.value.sqlstate == "LF005" and names in str(err.value)
    assert one(conn, "select gate from fleet.batch_members where batch_id = %s", (batch,)) is None
    assert one(conn, "select count(*) from fleet.runs r join fleet.tasks t on t.id = r.task_id where t.key = 'm'") == 0


# ------------------------------------------------------------------------------------------------
# the gate outcome decides the member's next step (fleet._gate_transition, in the finish group)


@pytest.mark.parametrize("gate, step, member, batch_state, task_state", [
    ("ok", "land", "running", "running", "batched"),
    ("task-failed", "evicted", "evicted", "running", "queued"),
    ("automation-broken", "blocked", "running", "blocked", "batched"),
    ("capability-unavailable", "blocked", "running", "blocked", "batched"),
])
def test_the_members_gate_outcome_chooses_its_next_step(conn: psycopg.Connection, gate: str, step: str,
                                                         member: str, batch_state: str, task_state: str) -> None:
    carrier, ctok, batch = one_member_batch(conn, ["m", "n"])
    assert call(conn, "batch_member_gate", carrier, ctok, 1, gate, "evidence", None) == step
    got = one(conn, "select state from fleet.batch_members where batch_id = %s and n = 1", (batch,))
    assert got == member
    assert one(conn, "select state from fleet.batches where id = %s", (batch,)) == batch_state
    assert one(conn, "select state from fleet.tasks where key = 'm'") == task_state


def test_an_unknown_gate_outcome_is_refused_and_changes_nothing(conn: psycopg.Connection) -> None:
    carrier, ctok, batch = one_member_batch(conn, ["m"])
    with pytest.raises(psycopg.Error, match="'maybe' is not a gate outcome") as err:
        call(conn, "batch_member_gate", carrier, ctok, 1, "maybe", None, None)
    assert err.value.sqlstate == "LF005"
    assert one(conn, "select gate from fleet.batch_members where batch_id = %s and n = 1", (batch,)) == "pending"


@pytest.mark.parametrize("gate, answer, reason", [
    ("ok", "recorded", None), ("task-failed", "blocked", "batch-verify-failed"),
    ("automation-broken", "blocked", "automation-broken")])
def test_the_batchs_own_gate_blocks_it_unless_ok(conn: psycopg.Connection, gate: str, answer: str,
                                                 reason: str | None) -> None:
    carrier, ctok, batch = one_member_batch(conn, ["m"])
    call(conn, "batch_member_gate", carrier, ctok, 1, "ok", None, None)
    call(conn, "batch_member_landed", carrier, ctok, 1, "c0", "c1", "ok")
    got = call(conn, "batch_tail", carrier, ctok, "batch_verify", Jsonb({"gate": gate, "evidence": "out"}))
    assert got == answer
    row = rows(conn, "select state, block_reason from fleet.batches where id = %s", (batch,))[0]
    assert row["block_reason"] == reason and (row["state"] == "blocked") == (answer == "blocked")


def test_a_member_whose_task_spent_its_budget_leaves_the_batch_at_its_start(conn: psycopg.Connection) -> None:
    sync_lane(conn, "code")
    s = open_session(conn, "code")
    task_id = one(conn, "select task_id from fleet.enqueue_task('code', 'spent', p_max_tokens => 100)")
    enqueue(conn, "code", "fresh")
    # an earlier, unbatched run of the task spent 500 tokens and failed
    token = take_lease(conn, s, task_id)
    call(conn, "record_run", token, {"exit_code": 1, "input_tokens": 500})
    one(conn, "select fleet.fail(%s, %s, 'x', true, null)", (task_id, token))
    conn.execute("update fleet.tasks set run_at = now() where id = %s", (task_id,))
    batch = call(conn, "batch_create", "code", ["spent", "fresh"], 4, None)
    carrier = one(conn, "select task_id from fleet.batches where id = %s", (batch,))
    ctok = take_lease(conn, s, carrier)
    call(conn, "batch_setup", carrier, ctok, "main", f"batch/{batch}")
    assert call(conn, "batch_member_start", carrier, ctok, 1, "b1", "/w1", "c0") == "blocked"
    t = rows(conn, "select state, block_reason, last_error, batch_id from fleet.tasks where id = %s", (task_id,))[0]
    assert (t["state"], t["block_reason"], t["batch_id"]) == ("blocked", "budget", None)
    assert t["last_error"] == "blocked in batch 1 (budget): spent 500 tokens of the task's 100 budget"
    # the batch goes on with its next member
    assert call(conn, "batch_member_start", carrier, ctok, 2, "b2", "/w2", "c0") == "running"


# ------------------------------------------------------------------------------------------------
# a batch names its members by their keys in its lane


def test_a_batch_takes_the_keys_of_its_own_lane(conn: psycopg.Connection) -> None:
    sync_lane(conn, "code")
    sync_lane(conn, "docs")
    mine = {k: enqueue(conn, "code", k) for k in ("m1", "m2")}
    theirs = {k: enqueue(conn, "docs", k) for k in ("m1", "m2", "only-docs")}
    batch = call(conn, "batch_create", "code", ["m2", "m1"], 4, None)
    members = rows(conn, "select n, task_id from fleet.batch_members where batch_id = %s order by n", (batch,))
    assert [m["task_id"] for m in members] == [mine["m2"], mine["m1"]]
    assert one(conn, "select array_agg(state::text order by id) from fleet.tasks where lane = 'docs'") == ["queued"] * 3
    assert one(conn, "select array_agg(key::text) from fleet.tasks where lane = 'code' and kind = 'batch'") == [
        f"batch:{batch}"]
    # a key only another lane has is no member of this one
    with pytest.raises(psycopg.Error) as err:
        call(conn, "batch_create", "code", ["only-docs"], 4, None)
    assert err.value.sqlstate == "LF003"
    assert "unknown task 'only-docs' in lane code" in str(err.value)
    assert task_state(conn, theirs["only-docs"]) == "queued"


def test_a_task_holding_the_carriers_key_is_never_made_a_carrier(conn: psycopg.Connection) -> None:
    sync_lane(conn, "code")
    member = enqueue(conn, "code", "m1")
    next_batch = one(conn, "select coalesce(max(id), 0) + 1 from fleet.batches")
    squatter = enqueue(conn, "code", f"batch:{next_batch}")
    with pytest.raises(psycopg.Error) as err:
        call(conn, "batch_create", "code", ["m1"], 4, None)
    assert err.value.sqlstate == "LF004" and f"already has a task of key 'batch:{next_batch}'" in str(err.value)
    assert (task_state(conn, member), task_state(conn, squatter)) == ("queued", "queued")
    assert one(conn, "select kind from fleet.tasks where id = %s", (squatter,)) == "task"
    assert one(conn, "select count(*) from fleet.batches") == 0


def test_an_unknown_batch_profile_names_only_what_the_key_may_see(conn: psycopg.Connection) -> None:
    conn.execute("select fleet.sync_pool('p', null)")
    for name in ("code-prof", "secret-prof"):
        conn.execute("select fleet.sync_profile(%s, 'p', '{}')", (name,))
    sync_lane(conn, "code", config={"profile": "code-prof"})
    enqueue(conn, "code", "m1")
    with as_key(conn, "fleet_operator", {"role": "fleet_operator", "fleet_lanes": ["code"]}), \
            pytest.raises(psycopg.Error) as err:
        call(conn, "batch_create", "code", ["m1"], 4, "nope")
    assert err.value.sqlstate == "LF005" and "unknown profile 'nope'" in str(err.value)
    assert err.value.diag.message_hint == "the profiles of lane code: code-prof"


def test_an_evicted_member_waits_the_lanes_backoff_as_a_failed_attempt_does(conn: psycopg.Connection) -> None:
    carrier, ctok, _batch = one_member_batch(conn, ["m", "n"])
    conn.execute("update fleet.lanes set backoff_base_seconds = 100, backoff_max_seconds = 150 where name = 'code'")
    assert call(conn, "batch_member_gate", carrier, ctok, 1, "task-failed", "2 tests fail", None) == "evicted"
    wait = one(conn, "select extract(epoch from run_at - now()) from fleet.tasks where key = 'm'")
    assert 95 < wait <= 100, wait  # base * 2^0: its first failure
    # not claimed again at once (a fresh session of the lane, with free slots, takes nothing of it)
    s = open_session(conn, "code", host="host-2")
    assert "m" not in [r["key"] for r in rows(conn, "select * from fleet.claim(%s, 5)", (s,))]
    # the rule is fleet.fail's: a second failure waits twice as long, within backoff_max_seconds
    conn.execute("update fleet.tasks set failures = 1 where key = 'm'")
    assert one(conn, "select extract(epoch from fleet._backoff(l, 1)) from fleet.lanes l where name = 'code'") == 150
