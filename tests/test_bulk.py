"""The bulk API of issue #7 (migrations/*_fleet_bulk.sql): fleet.enqueue_many and
fleet.complete_many, their store methods on both back-ends, the lane checks and grants, the hot
tables' storage settings, and `fleet enqueue --from`.

The bulk calls must keep every guarantee of their single-task siblings, so most tests compare a
bulk call with what enqueue_task / complete do to a twin task.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fleetkit import Backend
from psycopg.types.json import Jsonb
from supabase_stack import client, key, snapshot, sql
from test_sql_api import (
    add_lane,
    claim,
    complete,
    count,
    enqueue_task,
    one,
    open_session,
    refused,
    rows,
    task,
)

from worker.dev.devstack import DevStack
from worker.errors import InvalidInput, LaneForbidden, UnknownLane
from worker.store.postgres import PostgresStore


def enqueue_many(conn: psycopg.Connection, lane: str | None, tasks: Any) -> list[dict[str, Any]]:
    return rows(conn, "select * from fleet.enqueue_many(%s, %s)", (lane, None if tasks is None else Jsonb(tasks)))


def complete_many(conn: psycopg.Connection, tasks: Any, tokens: Any, results: Any = None) -> list[tuple[int, str]]:
    got = rows(conn, "select * from fleet.complete_many(%s::bigint[], %s::uuid[], %s::jsonb[])",
               (tasks, tokens, None if results is None else [None if r is None else Jsonb(r) for r in results]))
    return [(r["task_id"], r["status"]) for r in got]


def running(conn: psycopg.Connection, lane: str, n: int) -> tuple[uuid.UUID, list[dict[str, Any]]]:
    """n tasks of ``lane`` claimed by one fresh session."""
    enqueue_many(conn, lane, [{"key": f"{lane}:run:{uuid.uuid4().hex[:8]}"} for _ in range(n)])
    s = open_session(conn, lane)
    got = claim(conn, s, n)
    assert len(got) == n
    return s, got


@pytest.fixture
def lanes(conn: psycopg.Connection) -> psycopg.Connection:
    add_lane(conn, "docs")
    add_lane(conn, "bugfix")
    return conn


# ------------------------------------------------------------------------------------------------
# enqueue_many


def test_enqueue_many_returns_every_element_in_input_order(lanes: psycopg.Connection) -> None:
    conn = lanes
    old, _ = enqueue_task(conn, "docs", "old")
    got = enqueue_many(conn, "docs", [{"key": "z"}, {"key": "old"}, {"key": "a"}, {"key": "z"}, {"key": "m"}])
    assert [(r["idx"], r["key"], r["created"]) for r in got] == [
        (0, "z", True), (1, "old", False), (2, "a", True), (3, "z", False), (4, "m", True)]
    ids = {r["key"]: r["id"] for r in got}
    assert ids["old"] == old and got[3]["id"] == got[0]["id"]
    # new tasks numbered in input order, not in key order (the insert runs in key order)
    assert ids["z"] < ids["a"] < ids["m"]
    # one journal row per new task, in input order, as enqueue_task writes it
    events = rows(conn, "select task_id, lane, detail from fleet.events where kind = 'enqueued' and task_id <> %s"
                        " order by id", (old,))
    assert [e["task_id"] for e in events] == [ids["z"], ids["a"], ids["m"]]
    assert events[0]["lane"] == "docs" and events[0]["detail"]["key"] == "z"
    assert set(events[0]["detail"]) >= {"key", "priority", "run_at"}

    # again: nothing new, the same ids, no event
    before = count(conn, "events")
    again = enqueue_many(conn, "docs", [{"key": "m"}, {"key": "z"}])
    assert [(r["id"], r["created"]) for r in again] == [(ids["m"], False), (ids["z"], False)]
    assert count(conn, "events") == before


def test_a_batch_is_claimed_in_the_order_it_was_given(lanes: psycopg.Connection) -> None:
    conn = lanes
    keys = [f"k{c}" for c in "qwertyuiop"]  # not in key order
    enqueue_many(conn, "docs", [{"key": k} for k in keys])
    got = claim(conn, open_session(conn, "docs"), len(keys))
    assert [t["key"] for t in got] == keys


def test_enqueue_many_stores_what_enqueue_task_stores(lanes: psycopg.Connection) -> None:
    conn = lanes
    fields = {"payload": {"issue": 7}, "title": "seven", "priority": 9, "max_attempts": 4}
    enqueue_many(conn, "docs", [
        {"key": "bulk:1", **fields, "run_at": "2030-01-02T03:04:05Z"},
        {"key": "bulk:2", "lane": "bugfix", "delay_seconds": 600},
        {"key": "bulk:3", "payload": None, "title": None, "priority": None, "max_attempts": None, "lane": None},
    ])
    enqueue_task(conn, "docs", "one:1", fields["payload"], 9, "2030-01-02T03:04:05Z", 4, "seven")
    enqueue_task(conn, "docs", "one:3", None, 0, None, None, None)
    same = ("lane", "title", "payload", "priority", "run_at", "max_attempts", "state", "attempts", "resume")
    for bulk, single in (("bulk:1", "one:1"), ("bulk:3", "one:3")):
        b = rows(conn, "select * from fleet.tasks where key = %s", (bulk,))[0]
        s = rows(conn, "select * from fleet.tasks where key = %s", (single,))[0]
        for col in same:
            if col == "run_at" and bulk == "bulk:3":
                continue  # now() of two transactions
            assert b[col] == s[col], (bulk, col, b[col], s[col])
    delayed = one(conn, "select extract(epoch from run_at - now()) from fleet.tasks where key = 'bulk:2'")
    assert 590 < delayed <= 600
    assert one(conn, "select lane from fleet.tasks where key = 'bulk:2'") == "bugfix"
    # p_lane may be NULL when every element names its lane
    got = enqueue_many(conn, None, [{"key": "bulk:4", "lane": "bugfix"}])
    assert got[0]["created"] and task(conn, got[0]["id"])["lane"] == "bugfix"


def test_enqueue_many_takes_a_tier_a_profile_and_a_budget(lanes: psycopg.Connection) -> None:
    """As enqueue_task takes them: stored on the task, tier and profile in the journal."""
    conn = lanes
    conn.execute("""update fleet.lanes set config = '{"tiers": ["small", "large"]}' where name = 'docs'""")
    conn.execute("insert into fleet.profiles (name) values ('opus')")
    fields = {"tier": "large", "profile": "opus", "max_cost_usd": 2.5, "max_tokens": 40000}
    enqueue_many(conn, "docs", [{"key": "bulk:1", **fields}, {"key": "bulk:2"}])
    conn.execute("select fleet.enqueue_task('docs', 'one:1', '{}', 0, now(), null, null, 'large', 'opus', 2.5, 40000)")
    cols = "tier, profile, max_cost_usd, max_tokens"
    bulk = rows(conn, f"select {cols} from fleet.tasks where key = 'bulk:1'")[0]
    assert bulk == rows(conn, f"select {cols} from fleet.tasks where key = 'one:1'")[0]
    assert (bulk["tier"], bulk["profile"], float(bulk["max_cost_usd"]), bulk["max_tokens"]) == (
        "large", "opus", 2.5, 40000)
    assert rows(conn, f"select {cols} from fleet.tasks where key = 'bulk:2'")[0] == dict.fromkeys(
        ("tier", "profile", "max_cost_usd", "max_tokens"))
    detail = one(conn, "select detail from fleet.events e join fleet.tasks t on t.id = e.task_id"
                       " where t.key = 'bulk:1' and e.kind = 'enqueued'")
    assert (detail["tier"], detail["profile"]) == ("large", "opus")
    # the claim runs it at its tier, with its profile
    [got] = claim(conn, open_session(conn, "docs"), 1)
    assert (got["key"], got["tier"], got["run_profile"]) == ("bulk:1", "large", "opus")


def test_an_existing_key_keeps_its_task(lanes: psycopg.Connection) -> None:
    """As enqueue_task: the key's task is returned whatever lane or fields it is given now."""
    conn = lanes
    tid, _ = enqueue_task(conn, "bugfix", "shared", {"v": 1}, 3)
    [got] = enqueue_many(conn, "docs", [{"key": "shared", "payload": {"v": 2}, "priority": 7}])
    assert (got["id"], got["created"]) == (tid, False)
    t = task(conn, tid)
    assert (t["lane"], t["payload"], t["priority"]) == ("bugfix", {"v": 1}, 3)


BAD = [
    # element 2 of three: (label, element, p_lane, SQLSTATE, message after the "p_tasks[2] (key …): " prefix)
    ("not an object", [1, 2], "docs", "LF005", "a task must be a JSON object, not a JSON array"),
    ("no key", {"title": "x"}, "docs", "LF005", "a task needs a key"),
    ("key not a string", {"key": 42}, "docs", "LF005", "a task needs a key"),
    ("empty key", {"key": ""}, "docs", "LF005", "task key must be 1 to 200 characters"),
    ("long key", {"key": "k" * 201}, "docs", "LF005", "task key must be 1 to 200 characters"),
    ("unknown field", {"key": "bad", "prio": 5}, "docs", "LF005", "unknown field 'prio'"),
    ("unknown lane", {"key": "bad", "lane": "nope"}, "docs", "LF002", "unknown lane 'nope'"),
    ("lane not a string", {"key": "bad", "lane": 5}, "docs", "LF005", "lane must be a string"),
    ("no lane", {"key": "bad"}, None, "LF005", "no lane"),
    ("payload array", {"key": "bad", "payload": [1]}, "docs", "LF005", "payload must be a JSON object"),
    ("title number", {"key": "bad", "title": 5}, "docs", "LF005", "title must be a string"),
    ("priority too high", {"key": "bad", "priority": 1001}, "docs", "LF005", "priority must be an integer between 0 and 1000"),
    ("priority negative", {"key": "bad", "priority": -1}, "docs", "LF005", "between 0 and 1000, not -1"),
    ("priority fraction", {"key": "bad", "priority": 1.5}, "docs", "LF005", "between 0 and 1000, not 1.5"),
    ("priority string", {"key": "bad", "priority": "5"}, "docs", "LF005", "not a JSON string"),
    ("max_attempts zero", {"key": "bad", "max_attempts": 0}, "docs", "LF005", "max_attempts must be an integer of at least 1"),
    ("max_attempts past int4", {"key": "bad", "max_attempts": 2**31}, "docs", "LF005", "max_attempts must be"),
    ("run_at word", {"key": "bad", "run_at": "2030-13-45"}, "docs", "LF005", "run_at '2030-13-45' is not a timestamp"),
    ("run_at number", {"key": "bad", "run_at": 5}, "docs", "LF005", "run_at must be a timestamp string"),
    ("run_at and delay", {"key": "bad", "run_at": "2030-01-01T00:00:00Z", "delay_seconds": 5}, "docs", "LF005",
     "give run_at or delay_seconds, not both"),
    ("delay past the calendar", {"key": "bad", "delay_seconds": 1e300}, "docs", "LF005", "delay_seconds"),
    ("tier number", {"key": "bad", "tier": 1}, "docs", "LF005", "tier must be a string, not a JSON number"),
    ("unknown tier", {"key": "bad", "tier": "huge"}, "docs", "LF005", "lane docs has no tier 'huge'"),
    ("profile number", {"key": "bad", "profile": 1}, "docs", "LF005", "profile must be a string"),
    ("unknown profile", {"key": "bad", "profile": "nope"}, "docs", "LF005", "unknown profile 'nope'"),
    ("max_cost_usd zero", {"key": "bad", "max_cost_usd": 0}, "docs", "LF005", "max_cost_usd must be at least"),
    ("max_cost_usd huge", {"key": "bad", "max_cost_usd": 1e9}, "docs", "LF005", "below 100,000,000"),
    # as numeric(14,6) stores them: rounded to 0, or up to 100,000,000
    ("max_cost_usd rounds to 0", {"key": "bad", "max_cost_usd": 0.0000001}, "docs", "LF005", "at least 0.000001"),
    ("max_cost_usd rounds up", {"key": "bad", "max_cost_usd": 99999999.9999999}, "docs", "LF005", "below 100,000,000"),
    ("max_cost_usd string", {"key": "bad", "max_cost_usd": "5"}, "docs", "LF005", "max_cost_usd must be a number"),
    ("max_tokens fraction", {"key": "bad", "max_tokens": 1.5}, "docs", "LF005", "max_tokens must be an integer of at least 1"),
    ("max_tokens negative", {"key": "bad", "max_tokens": -5}, "docs", "LF005", "not -5"),
    ("max_tokens string", {"key": "bad", "max_tokens": "5"}, "docs", "LF005", "max_tokens must be an integer, not a JSON string"),
]


@pytest.mark.parametrize(("label", "element", "lane", "code", "message"), BAD, ids=[b[0] for b in BAD])
def test_one_bad_element_refuses_the_batch_naming_it(lanes: psycopg.Connection, label: str, element: Any,
                                                     lane: str | None, code: str, message: str) -> None:
    conn = lanes
    enqueue_task(conn, "docs", "existing")
    first = {"key": "good:0", "lane": "docs"}
    before = (count(conn, "tasks"), count(conn, "events"))
    with refused(code) as err:
        enqueue_many(conn, lane, [first, {"key": "existing", "lane": "docs"}, element, {"key": "good:3", "lane": "docs"}])
    text = str(err.value.diag.message_primary)
    assert text.startswith("p_tasks[2]"), text
    if isinstance(element, dict) and isinstance(element.get("key"), str) and element["key"]:
        assert text.startswith(f"p_tasks[2] (key '{element['key'][:100]}'"), text
    assert message in text, text
    assert (count(conn, "tasks"), count(conn, "events")) == before
    assert one(conn, "select count(*) from fleet.tasks where key like 'good:%'") == 0


def test_the_first_bad_element_is_the_one_named(lanes: psycopg.Connection) -> None:
    with refused("LF005") as err:
        enqueue_many(lanes, "docs", [{"key": "a"}, {"key": "b", "priority": -1}, {"key": "c", "title": 1}])
    assert str(err.value.diag.message_primary).startswith("p_tasks[1] (key 'b')")


@pytest.mark.parametrize("tasks", [None, {"key": "a"}, "a", 5], ids=["null", "object", "string", "number"])
def test_enqueue_many_takes_an_array(lanes: psycopg.Connection, tasks: Any) -> None:
    with refused("LF005") as err:
        enqueue_many(lanes, "docs", tasks)
    assert "JSON array" in str(err.value)
    assert enqueue_many(lanes, "docs", []) == []
    assert count(lanes, "tasks") == 0


# ------------------------------------------------------------------------------------------------
# complete_many


def test_a_stale_token_in_the_middle_of_a_batch(lanes: psycopg.Connection) -> None:
    conn = lanes
    s, got = running(conn, "docs", 3)
    a, b, c = got
    stale = uuid.uuid4()
    statuses = complete_many(conn, [c["id"], b["id"], a["id"]], [c["lease_token"], stale, a["lease_token"]],
                             [{"n": 3}, {"n": 2}, None])
    assert statuses == [(c["id"], "done"), (b["id"], "lost"), (a["id"], "done")]  # input order

    kept = task(conn, b["id"])  # untouched: still running under its own lease, its run open
    assert (kept["state"], kept["lease_token"], kept["session_id"], kept["result"]) == (
        "running", b["lease_token"], s, None)
    assert [(r["outcome"], r["ended_at"]) for r in rows(conn, "select * from fleet.runs where task_id = %s",
                                                       (b["id"],))] == [(None, None)]
    assert one(conn, "select count(*) from fleet.events where task_id = %s and kind = 'completed'", (b["id"],)) == 0

    for t, result in ((a, None), (c, {"n": 3})):
        done = task(conn, t["id"])
        assert (done["state"], done["result"], done["lease_token"], done["lease_expires_at"], done["session_id"]) == (
            "done", result, None, None, None)
        assert done["finished_at"] is not None
        [run] = rows(conn, "select * from fleet.runs where task_id = %s", (t["id"],))
        assert run["outcome"] == "done" and run["ended_at"] is not None
        [ev] = rows(conn, "select * from fleet.events where task_id = %s and kind = 'completed'", (t["id"],))
        assert (ev["lane"], ev["session_id"], ev["detail"]) == ("docs", s, {"attempt": 1, "state": "done"})

    # the lost one can still be completed by its holder
    assert complete(conn, b["id"], b["lease_token"]) == "done"


def test_complete_many_does_what_complete_does(lanes: psycopg.Connection) -> None:
    conn = lanes
    _, (one_by_one, bulk) = running(conn, "docs", 2)
    complete(conn, one_by_one["id"], one_by_one["lease_token"], {"ok": True})
    complete_many(conn, [bulk["id"]], [bulk["lease_token"]], [{"ok": True}])
    cols = ("state", "result", "lease_token", "lease_expires_at", "session_id", "attempts", "failures")
    assert {c: task(conn, bulk["id"])[c] for c in cols} == {c: task(conn, one_by_one["id"])[c] for c in cols}
    ev = "select kind, lane, session_id, detail from fleet.events where task_id = %s and kind <> 'enqueued' order by id"
    assert rows(conn, ev, (bulk["id"],)) == rows(conn, ev, (one_by_one["id"],))
    run = "select outcome, attempt, ended_at is not null as ended from fleet.runs where task_id = %s"
    assert rows(conn, run, (bulk["id"],)) == rows(conn, run, (one_by_one["id"],))


def test_a_batch_over_two_lanes_goes_to_review_where_its_lane_requires_one(lanes: psycopg.Connection) -> None:
    conn = lanes
    conn.execute("update fleet.lanes set config = '{\"review\": true}' where name = 'bugfix'")
    _, [d1, d2] = running(conn, "docs", 2)
    _, [b1] = running(conn, "bugfix", 1)
    assert complete_many(conn, [d2["id"], b1["id"], d1["id"]],
                         [d2["lease_token"], b1["lease_token"], d1["lease_token"]]) == [
        (d2["id"], "done"), (b1["id"], "review"), (d1["id"], "done")]
    assert [(r["id"], r["state"], r["finished_at"] is not None) for r in rows(
        conn, "select id, state, finished_at from fleet.tasks where id = any(%s) order by id",
        ([d1["id"], d2["id"], b1["id"]],))] == sorted(
        [(d1["id"], "done", True), (d2["id"], "done", True), (b1["id"], "review", False)])
    assert sorted((r["task_id"], r["lane"], r["detail"]["state"]) for r in rows(
        conn, "select task_id, lane, detail from fleet.events where kind = 'completed'")) == sorted(
        [(d1["id"], "docs", "done"), (d2["id"], "docs", "done"), (b1["id"], "bugfix", "review")])


def test_a_repaired_and_reclaimed_task_is_lost_to_its_old_token(lanes: psycopg.Connection) -> None:
    """The zombie case: the monitor released the task, another shift claimed it; the old shift's
    batch must not complete it under the new holder."""
    conn = lanes
    _, [old] = running(conn, "docs", 1)
    one(conn, "select fleet._release(%s, 'test')", (old["id"],))
    [new] = claim(conn, open_session(conn, "docs", host="host-2"), 1)
    assert new["id"] == old["id"]
    assert complete_many(conn, [old["id"]], [old["lease_token"]]) == [(old["id"], "lost")]
    t = task(conn, new["id"])
    assert (t["state"], t["lease_token"]) == ("running", new["lease_token"])
    assert [r["outcome"] for r in rows(conn, "select outcome from fleet.runs where task_id = %s order by id",
                                       (old["id"],))] == ["lost", None]


def test_finished_and_unknown_tasks(lanes: psycopg.Connection) -> None:
    conn = lanes
    _, [t] = running(conn, "docs", 1)
    assert complete_many(conn, [t["id"], 999999], [t["lease_token"], uuid.uuid4()]) == [
        (t["id"], "done"), (999999, "unknown")]
    # done already: its token no longer holds it (as complete says "lease lost")
    assert complete_many(conn, [t["id"]], [t["lease_token"]]) == [(t["id"], "lost")]
    assert complete_many(conn, [], []) == []
    assert complete_many(conn, [t["id"]], [None]) == [(t["id"], "lost")]


@pytest.mark.parametrize(("tasks", "tokens", "results", "message"), [
    ("ab", "a", None, "p_tasks has 2 elements, p_tokens 1"),
    ("a", "ab", None, "p_tasks has 1 elements, p_tokens 2"),
    ("ab", "ab", [None], "p_results 1"),
    ("aa", "ab", None, "is named twice"),
    ("a-", "ab", None, "p_tasks[1] is NULL"),
    (None, "a", None, "needs p_tasks and p_tokens"),
    ("a", None, None, "needs p_tasks and p_tokens"),
], ids=["fewer tokens", "more tokens", "fewer results", "twice", "null task", "no tasks", "no tokens"])
def test_malformed_batches_change_nothing(lanes: psycopg.Connection, tasks: str | None, tokens: str | None,
                                          results: list[Any] | None, message: str) -> None:
    conn = lanes
    _, (a, b) = running(conn, "docs", 2)
    by = {"a": a, "b": b}
    ids = None if tasks is None else [None if c == "-" else by[c]["id"] for c in tasks]
    toks = None if tokens is None else [by[c]["lease_token"] for c in tokens]
    before = rows(conn, "select id, state, lease_token from fleet.tasks order by id")
    with refused("LF005") as err:
        complete_many(conn, ids, toks, results)
    assert message in str(err.value), str(err.value)
    assert rows(conn, "select id, state, lease_token from fleet.tasks order by id") == before
    assert one(conn, "select count(*) from fleet.runs where ended_at is not null") == 0


# ------------------------------------------------------------------------------------------------
# lane checks and grants, on this server (what PostgREST does per request, by hand)


@contextmanager
def as_key(conn: psycopg.Connection, role: str, claims: dict[str, Any] | None) -> Iterator[None]:
    with conn.transaction(force_rollback=True):
        conn.execute("select set_config('role', %s, true)", (role,))
        if claims is not None:
            conn.execute("select set_config('request.jwt.claims', %s, true)", (json.dumps(claims),))
        yield


DOCS_WORKER = {"role": "fleet_worker", "fleet_lanes": ["docs"]}


def test_a_docs_key_cannot_complete_another_lanes_tasks(lanes: psycopg.Connection) -> None:
    conn = lanes
    _, [d] = running(conn, "docs", 1)
    _, [b] = running(conn, "bugfix", 1)
    before = rows(conn, "select id, state from fleet.tasks order by id")
    # the docs task first in the batch: still nothing is completed
    with as_key(conn, "fleet_worker", DOCS_WORKER), refused("LF008") as err:
        complete_many(conn, [d["id"], b["id"]], [d["lease_token"], b["lease_token"]])
    assert "'bugfix' is not allowed" in str(err.value)
    # a stale token does not get past the lane check either
    with as_key(conn, "fleet_worker", DOCS_WORKER), refused("LF008"):
        complete_many(conn, [b["id"]], [uuid.uuid4()])
    assert rows(conn, "select id, state from fleet.tasks order by id") == before
    with as_key(conn, "fleet_worker", DOCS_WORKER):
        assert complete_many(conn, [d["id"]], [d["lease_token"]]) == [(d["id"], "done")]


def test_a_docs_key_cannot_enqueue_many_into_another_lane(lanes: psycopg.Connection) -> None:
    conn = lanes
    enqueue_task(conn, "bugfix", "bug:1")
    with as_key(conn, "fleet_worker", DOCS_WORKER), refused("LF008") as err:
        enqueue_many(conn, "docs", [{"key": "d:1"}, {"key": "b:2", "lane": "bugfix"}])
    assert str(err.value.diag.message_primary).startswith("p_tasks[1] (key 'b:2'): lane 'bugfix' is not allowed")
    with as_key(conn, "fleet_worker", DOCS_WORKER), refused("LF008") as err:
        enqueue_many(conn, "bugfix", [{"key": "b:3"}])
    # an existing key whose task is in a lane the key may not work, as enqueue_task refuses it
    with as_key(conn, "fleet_worker", DOCS_WORKER), refused("LF008") as err:
        enqueue_many(conn, "docs", [{"key": "d:1"}, {"key": "bug:1"}])
    assert str(err.value.diag.message_primary).startswith("p_tasks[1] (key 'bug:1')")
    # an unknown lane is not named to a key that may not see the lanes
    with as_key(conn, "fleet_worker", DOCS_WORKER), refused("LF008") as err:
        enqueue_many(conn, "docs", [{"key": "n:1", "lane": "nope"}])
    assert "known lanes" not in str(err.value)
    assert one(conn, "select array_agg(key order by key) from fleet.tasks") == ["bug:1"]
    with as_key(conn, "fleet_worker", DOCS_WORKER):
        assert [r["created"] for r in enqueue_many(conn, "docs", [{"key": "d:1"}, {"key": "d:2"}])] == [True, True]


@pytest.mark.parametrize("role", ["anon", "authenticated"])
def test_anon_cannot_call_either(lanes: psycopg.Connection, role: str) -> None:
    conn = lanes
    _, [d] = running(conn, "docs", 1)
    for call in (lambda: enqueue_many(conn, "docs", [{"key": "anon:1"}]),
                 lambda: complete_many(conn, [d["id"]], [d["lease_token"]])):
        with as_key(conn, role, {"role": role, "fleet_lanes": ["*"]}), refused("42501"):
            call()
    assert task(conn, d["id"])["state"] == "running"


def test_grants_run_as_owner_and_closed_to_public(conn: psycopg.Connection) -> None:
    got = {r["proname"]: r for r in rows(conn, """
        select p.proname, p.prosecdef, p.proconfig,
               has_function_privilege('fleet_worker', p.oid, 'EXECUTE') as worker,
               has_function_privilege('fleet_operator', p.oid, 'EXECUTE') as operator,
               has_function_privilege('service_role', p.oid, 'EXECUTE') as service,
               exists (select 1 from aclexplode(p.proacl) a where a.grantee = 0) as public
          from pg_proc p
         where p.pronamespace = 'fleet'::regnamespace and p.proname in ('enqueue_many', 'complete_many')""")}
    assert set(got) == {"enqueue_many", "complete_many"}
    for r in got.values():
        assert r["prosecdef"] and r["proconfig"] == ["search_path=pg_catalog, fleet, pg_temp"]
        assert r["service"] and r["worker"] and not r["public"]
    assert got["enqueue_many"]["operator"]  # like enqueue_task
    assert not got["complete_many"]["operator"]  # like complete: a worker call


# ------------------------------------------------------------------------------------------------
# storage settings


def test_hot_table_settings(conn: psycopg.Connection) -> None:
    opts = {r["relname"]: dict(o.split("=", 1) for o in r["reloptions"] or [])
            for r in rows(conn, "select relname, reloptions from pg_class"
                                " where relnamespace = 'fleet'::regnamespace and relname in ('tasks', 'sessions')")}
    assert opts["tasks"]["fillfactor"] == "70" and float(opts["tasks"]["autovacuum_vacuum_scale_factor"]) <= 0.05
    assert opts["sessions"]["fillfactor"] == "70"
    indexes = {r[0] for r in conn.execute("select indexname from pg_indexes where schemaname = 'fleet'").fetchall()}
    assert "sessions_active_heartbeat" not in indexes
    assert {"events_task", "events_session", "events_kind_ts", "events_ts", "tasks_ready"} <= indexes
    # the claim's ORDER BY is the partial index's order, on queued rows
    assert one(conn, "select indexdef from pg_indexes where indexname = 'tasks_ready'").endswith(
        "(lane, priority DESC, resume DESC, run_at, id) WHERE (state = 'queued'::text)")


def test_a_claim_and_a_heartbeat_update_the_session_in_place(lanes: psycopg.Connection) -> None:
    """Without an index on heartbeat_at, the session row's updates are HOT (no index entries)."""
    conn = lanes
    s = open_session(conn, "docs")
    conn.execute("select pg_stat_reset_single_table_counters('fleet.sessions'::regclass)")
    for _ in range(10):
        claim(conn, s, 1)
        conn.execute("select * from fleet.heartbeat(%s)", (s,))
    conn.execute("select pg_stat_force_next_flush()")  # this backend's counters, now (PostgreSQL 15+)
    upd, hot = conn.execute("select n_tup_upd, n_tup_hot_upd from pg_stat_user_tables"
                            " where relid = 'fleet.sessions'::regclass").fetchone()
    assert upd >= 20 and hot == upd, (upd, hot)


# ------------------------------------------------------------------------------------------------
# the store, on both back-ends (supabase: a real PostgREST, a worker key for lane docs)


def test_store_bulk_calls(backend: Backend) -> None:
    direct = PostgresStore(backend.db_url)
    try:
        direct.sync_lane("docs", {})
        direct.sync_lane("bugfix", {})
        store = backend.store(backend.key("worker", ["docs"]))
        try:
            first = store.enqueue_many("docs", [{"key": "s:1", "payload": {"a": 1}}, {"key": "s:2", "title": "two"},
                                                {"key": "s:1"}])
            assert [c for _, c in first] == [True, True, False] and first[0][0] == first[2][0]
            assert store.enqueue_many("docs", [{"key": "s:2"}]) == [(first[1][0], False)]
            assert store.enqueue_many("docs", []) == []
            with pytest.raises(InvalidInput, match=r"^p_tasks\[1\] \(key 's:4'\): priority"):
                store.enqueue_many("docs", [{"key": "s:3"}, {"key": "s:4", "priority": 5000}])
            with pytest.raises(LaneForbidden if backend.rest else UnknownLane):
                store.enqueue_many("docs", [{"key": "s:5", "lane": "nope"}])
            assert direct.query("task_by_key", key="s:3") == []

            session = store.open_session("docs", "host-1", 4242, None, 600)
            a, b = store.claim(session, 2)
            assert a.lease_token and b.lease_token
            got = store.complete_many([(a.id, uuid.uuid4()), (b.id, b.lease_token, {"out": [1, "two"]})])
            assert got == {a.id: "lost", b.id: "done"}
            assert direct.get_task(b.id).result == {"out": [1, "two"]}
            assert direct.get_task(a.id).state == "running"
            assert store.complete_many([(a.id, a.lease_token)]) == {a.id: "done"}
            assert direct.get_task(a.id).result is None
            with pytest.raises(InvalidInput, match="named twice"):
                store.complete_many([(a.id, a.lease_token), (a.id, a.lease_token)])
        finally:
            store.close()
    finally:
        direct.close()


def test_store_complete_many_refuses_another_lane(stack: DevStack) -> None:
    """Over REST with a worker key for lane docs (a direct connection works every lane)."""
    backend = Backend("supabase", stack.db_url, stack)
    direct = PostgresStore(backend.db_url)
    try:
        for lane in ("docs", "bugfix"):
            direct.sync_lane(lane, {})
        direct.enqueue("bugfix", "bug:1")
        s = direct.open_session("bugfix", "host-1", 1, None, 600)
        [bug] = direct.claim(s, 1)
        assert bug.lease_token is not None
        docs = backend.store(backend.key("worker", ["docs"]))
        try:
            with pytest.raises(LaneForbidden):
                docs.complete_many([(bug.id, bug.lease_token)])
            with pytest.raises(LaneForbidden):
                docs.enqueue_many("bugfix", [{"key": "x:1"}])
        finally:
            docs.close()
        assert direct.get_task(bug.id).state == "running"
        assert direct.query("task_by_key", key="x:1") == []
    finally:
        direct.close()


def test_anon_and_operators_over_rest(stack: DevStack) -> None:
    """anon cannot call either; an operator key may enqueue_many (as enqueue) but not complete_many."""
    sql(stack, "select fleet.sync_lane('docs', '{}')")
    sql(stack, "select fleet.enqueue('docs', 'r:1')")
    s = sql(stack, "select fleet.open_session('docs', 'h', 1, null, 600) as s")[0]["s"]
    t = sql(stack, "select id, lease_token from fleet.claim(%s, 1)", (s,))[0]
    before = snapshot(stack)
    calls = {"enqueue_many": {"p_lane": "docs", "p_tasks": [{"key": "anon:1"}]},
             "complete_many": {"p_tasks": [t["id"]], "p_tokens": [str(t["lease_token"])], "p_results": None}}
    anon = client(stack)
    for fn, params in calls.items():
        with pytest.raises(Exception) as err:
            anon.rpc(fn, params).execute()
        assert getattr(err.value, "code", None) == "42501", err.value
    operator = client(stack, key(stack, "operator"))
    with pytest.raises(Exception) as err:
        operator.rpc("complete_many", calls["complete_many"]).execute()
    assert getattr(err.value, "code", None) == "42501", err.value
    assert snapshot(stack) == before
    assert operator.rpc("enqueue_many", {"p_lane": "docs", "p_tasks": [{"key": "op:1"}]}).execute().data[0]["created"]


def test_prepared_statements_stay_on_unless_a_pooler(db_url: str) -> None:
    """psycopg prepares a statement server-side after prepare_threshold runs on a connection; a
    transaction-mode pooler cannot keep them, so only `[database] pooler = true` turns them off."""
    for pooler, expected in ((False, 5), (True, None)):
        store = PostgresStore(db_url, pooler=pooler)
        try:
            with store.pool.connection() as c:
                assert c.prepare_threshold == expected
        finally:
            store.close()


# ------------------------------------------------------------------------------------------------
# fleet enqueue --from


FLEET_TOML = """\
[lanes.docs]
command = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]

[lanes.review]
command = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]
"""


@pytest.fixture
def cli(db_url: str, tmp_path: Path):  # -> a function running `fleet …` against the test database
    import os

    (tmp_path / "fleet.toml").write_text(FLEET_TOML)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update({"DATABASE_URL": db_url, "FLEET_CONFIG": str(tmp_path / "fleet.toml"), "COLUMNS": "200"})
    store = PostgresStore(db_url)
    for lane in ("docs", "review"):
        store.sync_lane(lane, {})
    store.close()

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "monitor.cli", *args], cwd=tmp_path, env=env, input=stdin,
                              capture_output=True, text=True, timeout=120)
    return run


def tasks_of(db_url: str) -> list[tuple[str, str, str | None, int, dict[str, Any]]]:
    with psycopg.connect(db_url) as c:
        return c.execute("select key, lane, title, priority, payload from fleet.tasks order by id").fetchall()


def test_enqueue_from_a_file(cli: Any, db_url: str, tmp_path: Path) -> None:
    (tmp_path / "tasks.jsonl").write_text(
        '{"key": "t:1", "title": "one", "payload": {"n": 1}}\n'
        "\n"
        '{"key": "t:2", "lane": "review", "priority": 5}\n'
        '   \n'
        '{"key": "t:1"}\n')
    r = cli("enqueue", "--from", "tasks.jsonl", "--lane", "docs")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "2 created, 1 already existed"
    assert tasks_of(db_url) == [("t:1", "docs", "one", 0, {"n": 1}), ("t:2", "review", None, 5, {})]
    r = cli("enqueue", "docs", "--from", "tasks.jsonl", "--json")
    data = json.loads(r.stdout)
    assert (data["created"], data["existing"]) == (0, 3)
    assert [(t["line"], t["key"], t["created"]) for t in data["tasks"]] == [
        (1, "t:1", False), (3, "t:2", False), (5, "t:1", False)]
    # the single-task form still works
    r = cli("enqueue", "docs", "--key", "t:3", "--priority", "2")
    assert r.returncode == 0 and r.stdout.strip().isdigit(), r.stderr
    assert tasks_of(db_url)[-1][:4] == ("t:3", "docs", None, 2)


def test_enqueue_from_a_file_with_tiers_profiles_and_budgets(cli: Any, db_url: str, tmp_path: Path) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("""update fleet.lanes set config = '{"tiers": ["small", "large"]}' where name = 'docs'""")
        c.execute("insert into fleet.profiles (name) values ('opus')")
    (tmp_path / "tasks.jsonl").write_text(
        '{"key": "b:1", "tier": "large", "profile": "opus", "max_cost_usd": 1.25, "max_tokens": 5000}\n'
        '{"key": "b:2", "max_cost_usd": 3}\n')
    r = cli("enqueue", "--from", "tasks.jsonl", "--lane", "docs")
    assert r.returncode == 0, r.stderr
    with psycopg.connect(db_url) as c:
        got = c.execute("select key, tier, profile, max_cost_usd::float8, max_tokens from fleet.tasks order by id").fetchall()
    assert got == [("b:1", "large", "opus", 1.25, 5000), ("b:2", None, None, 3.0, None)]
    # a tier the lane does not name is found by the database and named by the line
    (tmp_path / "more.jsonl").write_text('{"key": "b:3"}\n{"key": "b:4", "tier": "huge"}\n')
    r = cli("enqueue", "--from", "more.jsonl", "--lane", "docs")
    assert r.returncode == 1 and "more.jsonl line 2 (key 'b:4'): lane docs has no tier 'huge'" in r.stderr, r.stderr
    assert len(tasks_of(db_url)) == 2


def test_enqueue_from_stdin(cli: Any, db_url: str) -> None:
    r = cli("enqueue", "--from", "-", "-l", "review", stdin='{"key": "in:1", "run_at": "+10m"}\n{"key": "in:2"}\n')
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "2 created, 0 already existed"
    with psycopg.connect(db_url) as c:
        later = c.execute("select key, run_at > now() + interval '9 minutes' from fleet.tasks order by id").fetchall()
    assert later == [("in:1", True), ("in:2", False)]


@pytest.mark.parametrize(("content", "lane", "message"), [
    ('{"key": "b:1"}\n{"key": "b:2",\n', "docs", "tasks.jsonl line 2: not valid JSON"),
    ('{"key": "b:1"}\n\n{"title": "no key"}\n', "docs", "tasks.jsonl line 3: a task needs a \"key\""),
    ('{"key": "b:1"}\n["b:2"]\n', "docs", "tasks.jsonl line 2: a task must be a JSON object"),
    ('{"key": "b:1"}\n{"key": "b:2", "priority": "high"}\n', "docs", "tasks.jsonl line 2: \"priority\" must be an integer"),
    ('{"key": "b:1"}\n{"key": "b:2", "priority": true}\n', "docs", "tasks.jsonl line 2: \"priority\""),
    ('{"key": "b:1"}\n{"key": "b:2", "payload": [1]}\n', "docs", "tasks.jsonl line 2: \"payload\" must be a JSON object"),
    ('{"key": "b:1"}\n{"key": "b:2", "run_at": "tomorrow"}\n', "docs", "tasks.jsonl line 2: \"run_at\" 'tomorrow'"),
    ('{"key": "b:1"}\n{"key": "b:2", "colour": "red"}\n', "docs", "tasks.jsonl line 2: unknown field 'colour'"),
    ('{"key": "b:1", "lane": "docs"}\n{"key": "b:2"}\n', None, "tasks.jsonl line 2: no lane"),
    ('{"key": "b:1"}\n{"key": "b:2", "tier": 2}\n', "docs", "tasks.jsonl line 2: \"tier\" must be a string"),
    ('{"key": "b:1"}\n{"key": "b:2", "max_cost_usd": -1}\n', "docs", "tasks.jsonl line 2: \"max_cost_usd\" must be"),
    ('{"key": "b:1"}\n{"key": "b:2", "max_tokens": true}\n', "docs", "tasks.jsonl line 2: \"max_tokens\" must be"),
    # found by the database, named by the line: an unknown lane (one line checked only there)
    ('{"key": "b:1"}\n\n{"key": "b:2", "lane": "nope"}\n', "docs", "tasks.jsonl line 3 (key 'b:2'): unknown lane 'nope'"),
], ids=["json", "key", "array", "priority-type", "priority-bool", "payload", "run-at", "field", "no-lane",
        "tier-type", "cost", "tokens", "unknown-lane"])
def test_a_bad_line_queues_nothing(cli: Any, db_url: str, tmp_path: Path, content: str, lane: str | None,
                                   message: str) -> None:
    (tmp_path / "tasks.jsonl").write_text(content)
    r = cli("enqueue", "--from", "tasks.jsonl", *(["--lane", lane] if lane else []))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert message in r.stderr, r.stderr
    assert tasks_of(db_url) == []


def test_enqueue_from_refuses_single_task_options(cli: Any, db_url: str, tmp_path: Path) -> None:
    (tmp_path / "tasks.jsonl").write_text('{"key": "x:1"}\n')
    r = cli("enqueue", "docs", "--from", "tasks.jsonl", "--key", "x:2", "--priority", "3")
    assert r.returncode == 1 and "drop --key, --priority" in r.stderr, r.stderr
    r = cli("enqueue", "docs", "--from", "missing.jsonl")
    assert r.returncode == 1 and "cannot read missing.jsonl" in r.stderr, r.stderr
    r = cli("enqueue", "docs")
    assert r.returncode == 1 and "--key" in r.stderr, r.stderr
    assert tasks_of(db_url) == []
