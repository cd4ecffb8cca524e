"""The enqueue group (migrations/sources/04_enqueue.sql): fleet.enqueue_task, fleet.enqueue,
fleet.enqueue_after and fleet.enqueue_many, called over psycopg against a real, freshly migrated
PostgreSQL: what a new task holds, idempotence on the key in its lane (keys are per lane, and a
routed task keeps its key in the lanes it left), every refusal (and that it writes nothing, and
names nothing a restricted key may not see), the payload cap, and concurrent enqueues of one key.

The bulk call must keep every guarantee of its single-task sibling, so most enqueue_many tests
compare it with what enqueue_task does to a twin task.
"""

from __future__ import annotations

import random
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from sqlkit import (
    INVALID_ARGUMENT,
    LANE_NOT_ALLOWED,
    LANE_RETIRED,
    UNKNOWN_LANE,
    Call,
    add_lane,
    as_key,
    claim,
    claim_one,
    count,
    enqueue,
    enqueue_many,
    enqueue_task,
    kinds,
    last_event,
    one,
    open_session,
    race,
    refused,
    route,
    rows,
    sync_lane,
    task,
    wait_until_waiting,
    world,
)

# ------------------------------------------------------------------------------------------------
# enqueue_task and enqueue


def test_enqueue_creates_a_queued_task_and_an_event(conn, lane):
    task_id, created = enqueue_task(
        conn, lane, "issue:473", {"repo": "x", "n": 1}, priority=7, max_attempts=5, title="Fix it"
    )
    assert created is True
    t = task(conn, task_id)
    assert t["lane"] == "a"
    assert t["key"] == "issue:473"
    assert t["title"] == "Fix it"
    assert t["payload"] == {"repo": "x", "n": 1}
    assert t["priority"] == 7
    assert t["max_attempts"] == 5
    assert t["state"] == "queued"
    assert (t["attempts"], t["failures"], t["evaporations"], t["handoffs"]) == (0, 0, 0, 0)
    assert t["lease_token"] is None and t["session_id"] is None and t["finished_at"] is None
    assert one(conn, "select run_at <= now() from fleet.tasks where id = %s", (task_id,))
    assert kinds(conn, task_id) == ["enqueued"]
    ev = last_event(conn, task_id)
    assert ev["lane"] == "a"
    assert ev["detail"]["key"] == "issue:473"
    assert ev["detail"]["priority"] == 7


def test_enqueue_wrapper_returns_the_id(conn, lane):
    task_id = one(conn, "select fleet.enqueue('a', 'k1')")
    assert task(conn, task_id)["key"] == "k1"
    assert one(conn, "select fleet.enqueue('a', 'k1', '{\"other\": 1}')") == task_id
    assert count(conn, "tasks") == 1


def test_enqueue_is_idempotent_on_key(conn, lane):
    first, created = enqueue_task(conn, lane, "issue:1", {"v": 1}, priority=3)
    assert created is True
    again, created_again = enqueue_task(conn, lane, "issue:1", {"v": 2}, priority=9)
    assert again == first
    assert created_again is False
    t = task(conn, first)
    assert t["payload"] == {"v": 1}, "the second enqueue must not overwrite the task"
    assert t["priority"] == 3
    assert count(conn, "tasks") == 1
    assert kinds(conn, first) == ["enqueued"], "an idempotent repeat writes no event"


def test_enqueue_defaults(conn, lane):
    task_id = enqueue(conn, lane, "k")
    t = task(conn, task_id)
    assert t["payload"] == {}
    assert t["priority"] == 0
    assert t["max_attempts"] is None
    assert t["title"] is None
    assert t["carry_over"] is False
    assert t["stages"] == []


def test_enqueue_with_future_run_at(conn, lane):
    task_id = enqueue(conn, lane, "later", run_at="2999-01-01T00:00:00Z")
    assert one(
        conn, "select run_at = '2999-01-01T00:00:00Z' from fleet.tasks where id = %s", (task_id,)
    )


def test_enqueue_accepts_bounds(conn, lane):
    enqueue(conn, lane, "p0", priority=0)
    enqueue(conn, lane, "p1000", priority=1000)
    enqueue(conn, lane, "x" * 200)
    enqueue(conn, lane, "cap1", max_attempts=1)
    assert count(conn, "tasks") == 4


def test_enqueue_unknown_lane_is_refused_and_writes_nothing(conn, lane):
    with refused(UNKNOWN_LANE) as info:
        enqueue_task(conn, "nope", "k")
    assert "nope" in str(info.value)
    assert count(conn, "tasks") == 0
    assert count(conn, "events") == 0


@pytest.mark.parametrize(
    ("label", "kwargs"),
    [
        ("payload is an array", {"payload": [1, 2]}),
        ("payload is a string", {"payload": "text"}),
        ("payload is a number", {"payload": 3}),
        ("priority below 0", {"priority": -1}),
        ("priority above 1000", {"priority": 1001}),
        ("priority null", {"priority": None}),
        ("max_attempts 0", {"max_attempts": 0}),
        ("max_attempts negative", {"max_attempts": -3}),
        ("empty key", {"key": ""}),
        ("null key", {"key": None}),
        ("key of 201 characters", {"key": "k" * 201}),
    ],
)
def test_enqueue_invalid_argument_is_refused_and_writes_nothing(conn, lane, label, kwargs):
    args: dict[str, Any] = {"lane": lane, "key": "k"} | kwargs
    with refused(INVALID_ARGUMENT):
        enqueue_task(conn, **args)
    assert count(conn, "tasks") == 0, label
    assert count(conn, "events") == 0, label


def test_enqueue_invalid_argument_for_an_existing_key_changes_nothing(conn, lane):
    task_id = enqueue(conn, lane, "k", {"v": 1})
    before = world(conn)
    with refused(INVALID_ARGUMENT):
        enqueue_task(conn, lane, "k", [1])
    assert world(conn) == before
    assert task(conn, task_id)["payload"] == {"v": 1}


# ------------------------------------------------------------------------------------------------
# keys are per lane


def test_the_same_key_in_two_lanes_is_two_tasks(conn, lane):
    add_lane(conn, "b")
    in_a = enqueue(conn, lane, "issue:9", {"for": "a"})
    in_b, created = enqueue_task(conn, "b", "issue:9", {"for": "b"})
    assert created is True and in_b != in_a
    assert (task(conn, in_a)["lane"], task(conn, in_a)["payload"]) == ("a", {"for": "a"})
    assert (task(conn, in_b)["lane"], task(conn, in_b)["payload"]) == ("b", {"for": "b"})
    assert kinds(conn, in_b) == ["enqueued"]
    # each is idempotent in its own lane
    assert enqueue_task(conn, lane, "issue:9") == (in_a, False)
    assert enqueue_task(conn, "b", "issue:9") == (in_b, False)
    assert one(conn, "select fleet.enqueue('b', 'issue:9')") == in_b
    assert one(conn, "select task_id from fleet.enqueue_after(5, 'a', 'issue:9')") == in_a
    # and the bulk call takes the lane of each element the same way
    add_lane(conn, "c")
    got = enqueue_many(conn, "a", [{"key": "issue:9"}, {"key": "issue:9", "lane": "b"},
                                   {"key": "issue:9", "lane": "c"}, {"key": "issue:9", "lane": "c"}])
    assert [(r["id"], r["created"]) for r in got[:2]] == [(in_a, False), (in_b, False)]
    assert got[2]["created"] is True and got[3] == got[2] | {"idx": 3, "created": False}
    assert task(conn, got[2]["id"])["lane"] == "c"
    assert count(conn, "tasks") == 3


def test_a_routed_task_keeps_its_key_in_the_lane_it_left(conn, lane, session):
    """An enqueue of the key into the lane it came from answers with the task, wherever it went:
    the producer that re-enqueues its work makes no duplicate once the work moved on."""
    add_lane(conn, "b")
    task_id = enqueue(conn, lane, "issue:7")
    t = claim_one(conn, session)
    assert route(conn, task_id, t["lease_token"], "b") == "queued"
    before = world(conn)
    assert enqueue_task(conn, lane, "issue:7") == (task_id, False)
    assert enqueue_task(conn, "b", "issue:7") == (task_id, False)
    got = enqueue_many(conn, "a", [{"key": "issue:7"}, {"key": "issue:7", "lane": "b"}])
    assert [(r["id"], r["created"]) for r in got] == [(task_id, False), (task_id, False)]
    assert world(conn) == before
    # a lane it never was in has a key of its own
    add_lane(conn, "c")
    other, created = enqueue_task(conn, "c", "issue:7")
    assert created and other != task_id


def test_a_key_whose_task_moved_on_to_a_lane_the_key_may_not_see_is_refused_without_naming_it(conn, lane, session):
    add_lane(conn, "secret")
    task_id = enqueue(conn, lane, "issue:5")
    route(conn, task_id, claim_one(conn, session)["lease_token"], "secret")
    before = world(conn)
    a_worker = {"role": "fleet_worker", "fleet_lanes": ["a"]}
    for call in (lambda: enqueue_task(conn, lane, "issue:5"),
                 lambda: enqueue_many(conn, lane, [{"key": "fresh"}, {"key": "issue:5"}])):
        with as_key(conn, "fleet_worker", a_worker), refused(LANE_NOT_ALLOWED) as err:
            call()
        text = f"{err.value.diag.message_primary} {err.value.diag.message_hint}"
        assert "moved on to a lane not allowed for this key" in text and "secret" not in text, text
        assert f"task {task_id}" not in text and f"({task_id})" not in text, text
    with as_key(conn, "fleet_worker", a_worker), refused(LANE_NOT_ALLOWED) as err:
        enqueue_many(conn, lane, [{"key": "fresh"}, {"key": "issue:5"}])
    assert str(err.value.diag.message_primary).startswith("p_tasks[1] (key 'issue:5'): ")
    assert world(conn) == before
    # a key that may see where it went gets the task
    with as_key(conn, "fleet_worker", {"role": "fleet_worker", "fleet_lanes": ["a", "secret"]}):
        assert enqueue_task(conn, lane, "issue:5") == (task_id, False)


def test_concurrent_enqueues_of_one_key_into_two_lanes_make_one_task_each(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into fleet.lanes (name) values ('a'), ('b')")

    def work(c: psycopg.Connection, i: int) -> tuple[int, bool]:
        row = c.execute("select task_id, created from fleet.enqueue_task(%s, 'same-key')",
                        ("ab"[i % 2],)).fetchone()
        assert row is not None
        return row[0], row[1]

    results = race(db_url, 8, work)
    assert all(isinstance(r, tuple) for r in results), results
    assert len({r[0] for r in results[0::2]}) == 1 and len({r[0] for r in results[1::2]}) == 1
    assert sorted(r[1] for r in results) == [False] * 6 + [True] * 2
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute("select array_agg(lane order by lane) from fleet.tasks").fetchone() == (["a", "b"],)


def test_concurrent_enqueue_of_one_key_creates_one_task(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into fleet.lanes (name) values ('a')")

    def work(c: psycopg.Connection, i: int) -> tuple[int, bool]:
        row = c.execute(
            "select task_id, created from fleet.enqueue_task('a', 'same-key', %s)",
            (Jsonb({"from": i}),),
        ).fetchone()
        assert row is not None
        return row[0], row[1]

    results = race(db_url, 8, work)
    assert all(isinstance(r, tuple) for r in results), results
    assert len({r[0] for r in results}) == 1
    assert sorted(r[1] for r in results) == [False] * 7 + [True]
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute("select count(*) from fleet.tasks").fetchone() == (1,)
        assert c.execute(
            "select count(*) from fleet.journal where kind = 'enqueued'"
        ).fetchone() == (1,)


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
    events = rows(conn, "select task_id, lane, detail from fleet.journal where kind = 'enqueued' and task_id <> %s"
                        " order by id", (old,))
    assert [e["task_id"] for e in events] == [ids["z"], ids["a"], ids["m"]]
    assert events[0]["lane"] == "docs" and events[0]["detail"]["key"] == "z"
    assert events[0]["detail"] == {"key": "z", "priority": 0}

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
    same = ("lane", "title", "payload", "priority", "run_at", "max_attempts", "state", "attempts", "carry_over")
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
    conn.execute("select fleet.enqueue_task('docs', 'one:2', '{}')")
    cols = "tier, profile, max_cost_usd, max_tokens"
    bulk = rows(conn, f"select {cols} from fleet.tasks where key = 'bulk:1'")[0]
    assert bulk == rows(conn, f"select {cols} from fleet.tasks where key = 'one:1'")[0]
    assert (bulk["tier"], bulk["profile"], float(bulk["max_cost_usd"]), bulk["max_tokens"]) == (
        "large", "opus", 2.5, 40000)
    # none named: the lane's default tier (its lowest here), nothing else
    plain = rows(conn, f"select {cols} from fleet.tasks where key = 'bulk:2'")[0]
    assert plain == rows(conn, f"select {cols} from fleet.tasks where key = 'one:2'")[0]
    assert plain == {"tier": "small", "profile": None, "max_cost_usd": None, "max_tokens": None}
    detail = one(conn, "select detail from fleet.journal e join fleet.tasks t on t.id = e.task_id"
                       " where t.key = 'bulk:1' and e.kind = 'enqueued'")
    assert detail == {"key": "bulk:1", "priority": 0, "profile": "opus"}
    # the claim runs it at its tier, with its profile
    [got] = claim(conn, open_session(conn, "docs"), 1)
    assert (got["key"], got["tier"], got["run_profile"]) == ("bulk:1", "large", "opus")


def test_an_existing_key_keeps_its_task(lanes: psycopg.Connection) -> None:
    """As enqueue_task: the key's task in the lane is returned whatever fields it is given now;
    the same key in another lane is another task."""
    conn = lanes
    tid, _ = enqueue_task(conn, "bugfix", "shared", {"v": 1}, 3)
    [got] = enqueue_many(conn, "bugfix", [{"key": "shared", "payload": {"v": 2}, "priority": 7}])
    assert (got["id"], got["created"]) == (tid, False)
    t = task(conn, tid)
    assert (t["lane"], t["payload"], t["priority"]) == ("bugfix", {"v": 1}, 3)
    [other] = enqueue_many(conn, "docs", [{"key": "shared", "payload": {"v": 2}, "priority": 7}])
    assert other["created"] is True and other["id"] != tid
    assert (task(conn, other["id"])["lane"], task(conn, other["id"])["payload"]) == ("docs", {"v": 2})



def test_a_batch_of_new_repeated_existing_and_routed_keys(conn, lane, session) -> None:
    """Each element as enqueue_task answers it: the key of a routed task, in the lane it left and in
    the one it went to, answers with that task (nothing written to it); an existing key with its
    task; a key repeated in the batch with the task of its first element; new tasks numbered and
    journaled in input order."""
    add_lane(conn, "b")
    routed = enqueue(conn, lane, "issue:7")
    assert route(conn, routed, claim_one(conn, session)["lease_token"], "b") == "queued"
    old, _ = enqueue_task(conn, "b", "old")
    before = task(conn, routed)
    got = enqueue_many(conn, "a", [{"key": "new:1"}, {"key": "issue:7"}, {"key": "new:2", "lane": "b"},
                                   {"key": "issue:7", "lane": "b"}, {"key": "old", "lane": "b"},
                                   {"key": "new:1"}, {"key": "old"}, {"key": "new:0"}])
    assert [(r["idx"], r["key"], r["created"]) for r in got] == [
        (0, "new:1", True), (1, "issue:7", False), (2, "new:2", True), (3, "issue:7", False),
        (4, "old", False), (5, "new:1", False), (6, "old", True), (7, "new:0", True)]
    ids = [r["id"] for r in got]
    assert ids[1] == ids[3] == routed and ids[4] == old and ids[5] == ids[0]
    assert ids[0] < ids[2] < ids[6] < ids[7]
    assert task(conn, routed) == before
    assert {ids[i]: task(conn, ids[i])["lane"] for i in (0, 2, 6, 7)} == {
        ids[0]: "a", ids[2]: "b", ids[6]: "a", ids[7]: "a"}
    events = rows(conn, "select task_id, lane, detail from fleet.journal where kind = 'enqueued'"
                        " and task_id <> all (%s) order by id", ([routed, old],))
    assert [(e["task_id"], e["lane"], e["detail"]["key"]) for e in events] == [
        (ids[0], "a", "new:1"), (ids[2], "b", "new:2"), (ids[6], "a", "old"), (ids[7], "a", "new:0")]
    assert count(conn, "tasks") == 6


def test_enqueue_many_calls_no_function_per_element(lanes: psycopg.Connection) -> None:
    """The checks, each key's task and the insert are set-based: whatever functions a call runs, it
    runs as often for 40 elements as for 4 (tiers, a profile and budgets named, some keys known, for
    a key of every lane and for one of some lanes)."""
    conn = lanes
    conn.execute("""update fleet.lanes set config = '{"tiers": ["small", "large"], "profile": "opus"}'
                     where name = 'docs'""")
    conn.execute("insert into fleet.profiles (name) values ('opus')")
    for i in range(40):
        enqueue_task(conn, "docs", f"old:{i}")
    worker = {"role": "fleet_worker", "fleet_lanes": ["docs"]}

    def calls(n: int, claims: dict[str, Any] | None) -> dict[str, int]:
        batch = [{"key": f"new:{n}:{i}", "tier": "large", "profile": "opus", "max_cost_usd": 1.5,
                  "max_tokens": 1000, "payload": {"i": i}, "delay_seconds": 5} for i in range(n)]
        batch += [{"key": f"old:{i}"} for i in range(n)]
        def counts() -> dict[str, int]:  # (of this backend, not yet flushed: read before and after)
            return {r["funcname"]: r["calls"] for r in rows(
                conn, "select funcname, calls from pg_stat_xact_user_functions where schemaname = 'fleet'")}

        with conn.transaction(force_rollback=True):
            conn.execute("set local track_functions = 'all'")
            before = counts()
            if claims is None:
                got = enqueue_many(conn, "docs", batch)
            else:
                with as_key(conn, "fleet_worker", claims):
                    got = enqueue_many(conn, "docs", batch)
            assert [r["created"] for r in got] == [True] * n + [False] * n
            return {f: c - before.get(f, 0) for f, c in counts().items() if c > before.get(f, 0)}

    for claims in (None, worker):
        few, many = calls(4, claims), calls(40, claims)
        assert few == many, (claims, few, many)
        assert few["enqueue_many"] == 1, few

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



def test_a_refused_element_is_named_before_a_bad_time_of_an_earlier_one(lanes: psycopg.Connection) -> None:
    """Every check before any time is read, as before; and every element's time is read, also one
    whose key names a task already or repeats an earlier element's."""
    conn = lanes
    with refused("LF005") as err:
        enqueue_many(conn, "docs", [{"key": "a", "run_at": "2030-13-45"}, {"key": "b"}, {"key": "c", "priority": -1}])
    assert str(err.value.diag.message_primary).startswith("p_tasks[2] (key 'c'): priority"), str(err.value)
    enqueue_task(conn, "docs", "old")
    for bad in ({"key": "old", "run_at": "2030-13-45"}, {"key": "x", "delay_seconds": 1e300}):
        with refused("LF005") as err:
            enqueue_many(conn, "docs", [{"key": "x"}, bad, {"key": "y"}])
        assert str(err.value.diag.message_primary).startswith(f"p_tasks[1] (key '{bad['key']}'): "), str(err.value)
    assert count(conn, "tasks") == 1


def test_the_first_unknown_field_in_name_order_is_the_one_named(lanes: psycopg.Connection) -> None:
    with refused("LF005") as err:
        enqueue_many(lanes, "docs", [{"key": "a", "zeta": 1, "priority": 5, "alpha": 2}])
    assert str(err.value.diag.message_primary) == "p_tasks[0] (key 'a'): unknown field 'alpha'"

@pytest.mark.parametrize("tasks", [None, {"key": "a"}, "a", 5], ids=["null", "object", "string", "number"])
def test_enqueue_many_takes_an_array(lanes: psycopg.Connection, tasks: Any) -> None:
    with refused("LF005") as err:
        enqueue_many(lanes, "docs", tasks)
    assert "JSON array" in str(err.value)
    assert enqueue_many(lanes, "docs", []) == []
    assert count(lanes, "tasks") == 0



@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_a_key_another_call_inserts_while_the_batch_waits_for_it(connect, outcome: str) -> None:
    """The insert waits for the other transaction's row of the key. Committed: the batch answers
    with that task (created false, for both of its elements of the key), makes its other task and
    journals only that one. Rolled back: the batch makes the task itself."""
    setup = connect()
    add_lane(setup, "docs")
    other = connect(autocommit=False)
    theirs, created = enqueue_task(other, "docs", "contested")
    assert created
    b = connect()
    batch = Call(b, lambda c: enqueue_many(c, "docs", [{"key": "mine"}, {"key": "contested"}, {"key": "contested"}]))
    batch.start()
    assert wait_until_waiting(setup, b.info.backend_pid) == "transactionid"
    getattr(other, outcome)()
    got = batch.outcome()
    assert [(r["key"], r["created"]) for r in got] == [
        ("mine", True), ("contested", outcome == "rollback"), ("contested", False)]
    assert got[1]["id"] == got[2]["id"]
    assert (got[1]["id"] == theirs) is (outcome == "commit")
    assert rows(setup, "select key, count(*) as n from fleet.tasks group by key order by key") == [
        {"key": "contested", "n": 1}, {"key": "mine", "n": 1}]
    made = [got[0]["id"]] + ([got[1]["id"]] if outcome == "rollback" else [])
    journal = rows(setup, "select task_id from fleet.journal where kind = 'enqueued' order by id")
    assert [e["task_id"] for e in journal] == ([theirs] if outcome == "commit" else []) + made


def test_concurrent_batches_of_overlapping_keys_make_one_task_per_key(db_url: str) -> None:
    """Six calls at once, each the same 2,000 keys (and one of its own) in its own order: no deadlock
    (the inserts take the key index in one order), every key one task, created by exactly one call,
    journaled once; every call answers every element with that task."""
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into fleet.lanes (name) values ('a')")
    keys = [f"k:{i}" for i in range(2000)]

    def work(c: psycopg.Connection, i: int) -> list[tuple[str, int, bool]]:
        mine = [*keys, f"own:{i}"]
        random.Random(i).shuffle(mine)
        got = c.execute("select key, id, created from fleet.enqueue_many('a', %s) order by idx",
                        (Jsonb([{"key": k} for k in mine]),)).fetchall()
        assert [g[0] for g in got] == mine
        return got

    results = race(db_url, 6, work)
    assert all(isinstance(r, list) for r in results), results
    with psycopg.connect(db_url, autocommit=True) as c:
        tasks = dict(c.execute("select key, id from fleet.tasks").fetchall())
        journaled = c.execute("select count(*), count(distinct task_id) from fleet.journal where kind = 'enqueued'").fetchone()
    assert len(tasks) == 2006 and journaled == (2006, 2006)
    created: dict[str, int] = {}
    for got in results:
        for key, task_id, made in got:
            assert task_id == tasks[key], key
            created[key] = created.get(key, 0) + made
    assert created == dict.fromkeys(tasks, 1)

def test_a_batch_that_comes_while_its_lane_is_retired_reads_it_retired(connect) -> None:
    """The lanes a batch names are locked FOR KEY SHARE in its one statement: it waits for a retire
    under way and reads the row the retire left."""
    setup = connect()
    sync_lane(setup, "old")
    sync_lane(setup, "new")
    r = connect(autocommit=False)
    assert one(r, "select fleet.retire_lane('old')") == "retired"
    e = connect()
    late = Call(e, lambda c: enqueue_many(c, "new", [{"key": "fine"}, {"key": "late", "lane": "old"}]))
    late.start()
    wait_until_waiting(setup, e.info.backend_pid)
    r.commit()
    with refused(LANE_RETIRED) as err:
        late.outcome()
    assert str(err.value.diag.message_primary).startswith("p_tasks[1] (key 'late'): lane old is retired")
    assert count(setup, "tasks") == 0

# ------------------------------------------------------------------------------------------------
# the payload cap: the lane's max_payload_bytes (1 MiB by default), on every way in

MIB = 1048576


def payload_of(size: int) -> dict[str, str]:
    """A payload whose JSON text (as jsonb prints it) is exactly ``size`` bytes."""
    return {"blob": "x" * (size - len('{"blob": ""}'))}


def test_a_payload_over_the_lanes_cap_is_refused_naming_its_size_and_the_cap(conn, lane):
    assert one(conn, "select octet_length(%s::jsonb::text)", (Jsonb(payload_of(MIB)),)) == MIB
    at_cap = enqueue(conn, lane, "at-cap", payload_of(MIB))
    assert len(task(conn, at_cap)["payload"]["blob"]) == MIB - 12
    before = world(conn)
    calls = {
        "enqueue_task": lambda: enqueue_task(conn, lane, "over", payload_of(MIB + 1)),
        "enqueue": lambda: conn.execute("select fleet.enqueue('a', 'over', %s)", (Jsonb(payload_of(MIB + 1)),)),
        "enqueue_after": lambda: conn.execute("select * from fleet.enqueue_after(5, 'a', 'over', %s)",
                                              (Jsonb(payload_of(MIB + 1)),)),
        "enqueue_many": lambda: enqueue_many(conn, lane, [{"key": "fine"}, {"key": "over", "payload": payload_of(MIB + 1)}]),
        # an existing key with a payload too large is refused as any bad argument is
        "existing key": lambda: enqueue_task(conn, lane, "at-cap", payload_of(2 * MIB)),
    }
    for name, call in calls.items():
        with refused(INVALID_ARGUMENT) as err:
            call()
        text = str(err.value.diag.message_primary)
        size = 2 * MIB if name == "existing key" else MIB + 1
        assert f"payload is {size} bytes, more than lane a's max_payload_bytes of {MIB}" in text, (name, text)
        assert "max_payload_bytes in fleet.toml" in str(err.value.diag.message_hint), name
    with refused(INVALID_ARGUMENT) as err:
        enqueue_many(conn, lane, [{"key": "fine"}, {"key": "over", "payload": payload_of(MIB + 1)}])
    assert str(err.value.diag.message_primary).startswith("p_tasks[1] (key 'over'): payload is")
    assert world(conn) == before


def test_the_payload_cap_is_the_lanes_setting(conn):
    add_lane(conn, "small", config={"max_payload_bytes": 100})
    add_lane(conn, "large", config={"max_payload_bytes": 4 * MIB})
    enqueue(conn, "small", "fits", payload_of(100))
    with refused(INVALID_ARGUMENT) as err:
        enqueue_task(conn, "small", "big", payload_of(101))
    assert "payload is 101 bytes, more than lane small's max_payload_bytes of 100" in str(err.value)
    with refused(INVALID_ARGUMENT):  # each element by its own lane's cap
        enqueue_many(conn, "large", [{"key": "big", "payload": payload_of(2 * MIB)},
                                     {"key": "big", "lane": "small", "payload": payload_of(101)}])
    got = enqueue_many(conn, "large", [{"key": "big", "payload": payload_of(2 * MIB)},
                                       {"key": "big", "lane": "small", "payload": payload_of(100)}])
    assert [r["created"] for r in got] == [True, True]
    assert enqueue_task(conn, "large", "bigger", payload_of(4 * MIB))[1] is True


# ------------------------------------------------------------------------------------------------
# an unknown profile names only the profiles the caller may know of


def _profiles(conn: psycopg.Connection) -> None:
    for name in ("pool-a", "pool-secret"):
        conn.execute("select fleet.sync_pool(%s, null)", (name,))
    for name, pool in (("mine", "pool-a"), ("spill", "pool-a"), ("secret-opus", "pool-secret")):
        conn.execute("select fleet.sync_profile(%s, %s, '{}')", (name, pool))
    add_lane(conn, "docs", config={"profile": "mine", "dispatch": [{"pool": "pool-a", "profile": "mine"},
                                                                   {"pool": "pool-a", "profile": "spill"}]})
    add_lane(conn, "bugfix", config={"profile": "secret-opus"})


def test_an_unknown_profile_is_named_with_the_profiles_the_caller_may_see(conn):
    _profiles(conn)
    docs = {"role": "fleet_worker", "fleet_lanes": ["docs"]}
    calls = [lambda: conn.execute("select * from fleet.enqueue_task('docs', 'k', '{}', 0, now(), null, null, null, 'nope')"),
             lambda: enqueue_many(conn, "docs", [{"key": "k", "profile": "nope"}])]
    for call in calls:
        with as_key(conn, "fleet_worker", docs), refused(INVALID_ARGUMENT) as err:
            call()
        assert "unknown profile 'nope'" in str(err.value.diag.message_primary)
        hint = str(err.value.diag.message_hint)
        assert hint == "the profiles of lane docs: mine, spill", hint
        # a caller that works every lane is told every profile
        with refused(INVALID_ARGUMENT) as err:
            call()
        assert "known profiles: mine, secret-opus, spill" in str(err.value.diag.message_hint)
    # a lane with no profiles of its own names none
    add_lane(conn, "plain")
    with as_key(conn, "fleet_worker", {"role": "fleet_worker", "fleet_lanes": ["plain"]}), \
            refused(INVALID_ARGUMENT) as err:
        enqueue_many(conn, "plain", [{"key": "k", "profile": "secret"}])
    assert "secret-opus" not in str(err.value) and "mine" not in str(err.value), str(err.value)
    assert count(conn, "tasks") == 0


def test_a_key_of_some_lanes_cannot_dispatch_with_another_lanes_profile(conn):
    """Lane bugfix's profile draws on lane bugfix's pool: to a key of lane docs it is unknown, the
    same answer as a profile that does not exist; a caller of every lane may name any profile."""
    _profiles(conn)
    docs = {"role": "fleet_worker", "fleet_lanes": ["docs"]}
    calls = {
        "enqueue_task": lambda p: conn.execute(
            "select * from fleet.enqueue_task('docs', 'k', '{}', 0, now(), null, null, null, %s)", (p,)),
        "enqueue_many": lambda p: enqueue_many(conn, "docs", [{"key": "k", "profile": p}]),
        "batch_create": lambda p: conn.execute("select fleet.batch_create('docs', array['k'], 5, %s)", (p,)),
    }
    for name, call in calls.items():
        answers = []
        for profile in ("secret-opus", "no-such-profile"):
            role = "fleet_operator" if name == "batch_create" else "fleet_worker"
            with as_key(conn, role, {**docs, "role": role}), refused(INVALID_ARGUMENT) as err:
                call(profile)
            answers.append((str(err.value.diag.message_primary).replace(profile, "<p>"),
                            err.value.diag.message_hint))
        assert answers[0] == answers[1], (name, answers)
        assert "unknown profile '<p>'" in answers[0][0], (name, answers)
    with as_key(conn, "fleet_worker", docs):  # the lane's own dispatch profiles are fine
        assert enqueue_many(conn, "docs", [{"key": "k", "profile": "spill"}])[0]["created"] is True
    assert count(conn, "tasks") == 0  # (rolled back with the key's transaction)
    # every lane's caller: any profile
    assert enqueue_many(conn, "docs", [{"key": "k", "profile": "secret-opus"}])[0]["created"] is True


def test_enqueue_many_json_is_enqueue_many_answering_one_value(conn, lane):
    """What the Supabase store calls (PostgREST cuts rows at db-max-rows, never one value): the same
    answer, in input order, the same refusals, one transaction."""
    tasks = [{"key": "j:1"}, {"key": "j:2", "title": "two"}, {"key": "j:1"}]
    got = one(conn, "select fleet.enqueue_many_json(%s, %s)", (lane, Jsonb(tasks)))
    assert [(r["idx"], r["key"], r["created"]) for r in got] == [(0, "j:1", True), (1, "j:2", True), (2, "j:1", False)]
    assert [{**r, "created": False} for r in got] == [dict(r) for r in enqueue_many(conn, lane, tasks)]
    assert one(conn, "select fleet.enqueue_many_json(%s, '[]')", (lane,)) == []
    with refused(INVALID_ARGUMENT) as info:
        one(conn, "select fleet.enqueue_many_json(%s, %s)", (lane, Jsonb([{"key": "j:3"}, {"key": "j:4", "priority": 5000}])))
    assert info.value.diag.message_primary.startswith("p_tasks[1] (key 'j:4'): priority")
    assert count(conn, "tasks") == 2
