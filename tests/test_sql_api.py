"""The SQL API of DESIGN §4–§5, called directly over psycopg against a real, freshly migrated Postgres.

Every transition, every refusal (SQLSTATE class LF), the fence of every worker call, and the
events row each transition writes. Time-dependent behaviour is driven by setting columns directly
(``run_at``, ``deadline``, ``ended_at``) instead of sleeping.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

LEASE_LOST = "LF001"
UNKNOWN_LANE = "LF002"
UNKNOWN_TASK = "LF003"
INVALID_STATE = "LF004"
INVALID_ARGUMENT = "LF005"
SESSION_NOT_ACTIVE = "LF006"
ROUTE_REFUSED = "LF007"


# ------------------------------------------------------------------------------------------------
# helpers


@contextmanager
def refused(code: str) -> Iterator[pytest.ExceptionInfo[psycopg.Error]]:
    """Expect the block to raise a database error with exactly this SQLSTATE."""
    with pytest.raises(psycopg.Error) as info:
        yield info
    assert info.value.sqlstate == code, f"expected {code}, got {info.value.sqlstate}: {info.value}"


def one(conn: psycopg.Connection, query: str, params: Any = None) -> Any:
    """The single value of a single-row, single-column query."""
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def rows(conn: psycopg.Connection, query: str, params: Any = None) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, params)
        return cur.fetchall()


def add_lane(conn: psycopg.Connection, name: str = "a", **kw: Any) -> str:
    cols: dict[str, Any] = {
        "max_running": None,
        "lease_seconds": 60,
        "max_attempts": 3,
        "max_handoffs": 10,
    }
    cols.update(kw)
    names = ", ".join(["name", *cols])
    marks = ", ".join(["%s"] * (len(cols) + 1))
    conn.execute(f"insert into fleet.lanes ({names}) values ({marks})", [name, *cols.values()])
    return name


def enqueue(
    conn: psycopg.Connection,
    lane: str,
    key: str,
    payload: Any = None,
    priority: int | None = 0,
    run_at: Any = None,
    max_attempts: int | None = None,
    title: str | None = None,
) -> int:
    task_id, created = enqueue_task(conn, lane, key, payload, priority, run_at, max_attempts, title)
    assert created
    return task_id


def enqueue_task(
    conn: psycopg.Connection,
    lane: str | None,
    key: str | None,
    payload: Any = None,
    priority: int | None = 0,
    run_at: Any = None,
    max_attempts: int | None = None,
    title: str | None = None,
) -> tuple[int, bool]:
    row = conn.execute(
        "select task_id, created from fleet.enqueue_task(%s, %s, %s, %s, %s::timestamptz, %s, %s)",
        (
            lane,
            key,
            None if payload is None else Jsonb(payload),
            priority,
            run_at,
            max_attempts,
            title,
        ),
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def open_session(
    conn: psycopg.Connection, lane: str, host: str = "host-1", pid: int = 4242, seconds: int = 600
) -> uuid.UUID:
    return one(conn, "select fleet.open_session(%s, %s, %s, now(), %s)", (lane, host, pid, seconds))


def claim(conn: psycopg.Connection, session: uuid.UUID, limit: int = 1) -> list[dict[str, Any]]:
    return rows(conn, "select * from fleet.claim(%s, %s)", (session, limit))


def claim_one(conn: psycopg.Connection, session: uuid.UUID) -> dict[str, Any]:
    got = claim(conn, session, 1)
    assert len(got) == 1, got
    return got[0]


def task(conn: psycopg.Connection, task_id: int) -> dict[str, Any]:
    got = rows(conn, "select * from fleet.tasks where id = %s", (task_id,))
    assert len(got) == 1
    return got[0]


def runs(conn: psycopg.Connection, task_id: int) -> list[dict[str, Any]]:
    return rows(conn, "select * from fleet.runs where task_id = %s order by id", (task_id,))


def kinds(conn: psycopg.Connection, task_id: int) -> list[str]:
    return [
        r["kind"]
        for r in rows(
            conn, "select kind from fleet.events where task_id = %s order by id", (task_id,)
        )
    ]


def last_event(conn: psycopg.Connection, task_id: int) -> dict[str, Any]:
    got = rows(
        conn, "select * from fleet.events where task_id = %s order by id desc limit 1", (task_id,)
    )
    assert got
    return got[0]


def count(conn: psycopg.Connection, table: str) -> int:
    return one(conn, f"select count(*) from fleet.{table}")


def release(conn: psycopg.Connection, task_id: int, reason: str = "test") -> str | None:
    return one(conn, "select fleet._release(%s, %s)", (task_id, reason))


def complete(conn: psycopg.Connection, task_id: int, token: Any, result: Any = None) -> str:
    return one(
        conn,
        "select fleet.complete(%s, %s, %s)",
        (task_id, token, None if result is None else Jsonb(result)),
    )


def fail(
    conn: psycopg.Connection, task_id: int, token: Any, error: str = "boom", retryable: bool = True
) -> str:
    return one(conn, "select fleet.fail(%s, %s, %s, %s)", (task_id, token, error, retryable))


def hand_off(conn: psycopg.Connection, task_id: int, token: Any, snapshot: Any = None) -> str:
    return one(
        conn,
        "select fleet.hand_off(%s, %s, %s)",
        (task_id, token, None if snapshot is None else Jsonb(snapshot)),
    )


def route(
    conn: psycopg.Connection, task_id: int, token: Any, lane: str | None, note: Any = None
) -> str:
    return one(
        conn,
        "select fleet.route(%s, %s, %s, %s)",
        (task_id, token, lane, None if note is None else Jsonb(note)),
    )


def checkpoint(conn: psycopg.Connection, task_id: int, token: Any, data: Any) -> int:
    return one(
        conn,
        "select fleet.checkpoint(%s, %s, %s)",
        (task_id, token, None if data is None else Jsonb(data)),
    )


def record_run(conn: psycopg.Connection, token: Any, report: Any) -> None:
    conn.execute(
        "select fleet.record_run(%s, %s)", (token, None if report is None else Jsonb(report))
    )


def heartbeat(conn: psycopg.Connection, session: uuid.UUID) -> dict[int, str]:
    got = rows(conn, "select task_id, status from fleet.heartbeat(%s)", (session,))
    out = {r["task_id"]: r["status"] for r in got}
    assert len(out) == len(got), f"a task reported twice: {got}"
    return out


def close_session(
    conn: psycopg.Connection,
    session: uuid.UUID,
    reason: str | None = "deadline",
    snapshot: Any = None,
) -> int:
    return one(
        conn,
        "select fleet.close_session(%s, %s, %s)",
        (session, reason, None if snapshot is None else Jsonb(snapshot)),
    )


def cancel(conn: psycopg.Connection, task_id: int) -> str:
    return one(conn, "select fleet.cancel(%s)", (task_id,))


def retry(conn: psycopg.Connection, task_id: int) -> str:
    return one(conn, "select fleet.retry(%s)", (task_id,))


def seconds_between(conn: psycopg.Connection, task_id: int, later: str, earlier: str) -> float:
    """Seconds from one timestamp column of a task to another (both set by one transaction's now())."""
    return float(
        one(
            conn,
            f"select extract(epoch from {later} - {earlier}) from fleet.tasks where id = %s",
            (task_id,),
        )
    )


def world(conn: psycopg.Connection) -> dict[str, Any]:
    """Everything the API can change, to compare before and after a refused call."""
    return {
        table: one(
            conn,
            f"select coalesce(jsonb_agg(to_jsonb(x) order by x.id), '[]') from fleet.{table} x",
        )
        for table in ("tasks", "runs", "events", "sessions", "lane_handoffs")
    } | {"lanes": one(conn, "select jsonb_agg(to_jsonb(l) order by l.name) from fleet.lanes l")}


@pytest.fixture
def lane(conn: psycopg.Connection) -> str:
    return add_lane(conn, "a")


@pytest.fixture
def session(conn: psycopg.Connection, lane: str) -> uuid.UUID:
    return open_session(conn, lane)


# ------------------------------------------------------------------------------------------------
# enqueue


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
    assert t["resume"] is False
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
# sessions


def test_open_session(conn, lane):
    sid = open_session(conn, lane, host="box", pid=77, seconds=300)
    s = rows(
        conn, "select *, extract(epoch from deadline - started_at) as len from fleet.sessions"
    )[0]
    assert s["id"] == sid
    assert s["lane"] == "a" and s["host"] == "box" and s["pid"] == 77
    assert s["state"] == "active" and s["ended_at"] is None
    assert s["pid_started_at"] is not None
    assert float(s["len"]) == 300
    ev = rows(conn, "select * from fleet.events where session_id = %s", (sid,))
    assert [e["kind"] for e in ev] == ["session_opened"]
    assert ev[0]["detail"] == {"host": "box", "pid": 77, "seconds": 300}


@pytest.mark.parametrize(
    ("code", "args"),
    [
        (UNKNOWN_LANE, ("nope", "h", 1, 60)),
        (UNKNOWN_LANE, (None, "h", 1, 60)),
        (INVALID_ARGUMENT, ("a", "", 1, 60)),
        (INVALID_ARGUMENT, ("a", None, 1, 60)),
        (INVALID_ARGUMENT, ("a", "h", 0, 60)),
        (INVALID_ARGUMENT, ("a", "h", -5, 60)),
        (INVALID_ARGUMENT, ("a", "h", None, 60)),
        (INVALID_ARGUMENT, ("a", "h", 1, 0)),
        (INVALID_ARGUMENT, ("a", "h", 1, -60)),
        (INVALID_ARGUMENT, ("a", "h", 1, None)),
    ],
)
def test_open_session_refusals_write_nothing(conn, lane, code, args):
    with refused(code):
        conn.execute("select fleet.open_session(%s, %s, %s, now(), %s)", args)
    assert count(conn, "sessions") == 0
    assert count(conn, "events") == 0


# ------------------------------------------------------------------------------------------------
# claim


def test_claim_leases_the_task(conn, lane, session):
    conn.execute("update fleet.lanes set lease_seconds = 45 where name = 'a'")
    task_id = enqueue(conn, lane, "k")
    got = claim(conn, session)
    assert [t["id"] for t in got] == [task_id]
    t = task(conn, task_id)
    assert got[0]["lease_token"] == t["lease_token"] is not None
    assert t["state"] == "running"
    assert t["attempts"] == 1
    assert t["session_id"] == session
    assert seconds_between(conn, task_id, "lease_expires_at", "updated_at") == 45
    [run] = runs(conn, task_id)
    assert run["attempt"] == 1
    assert run["session_id"] == session
    assert run["lane"] == "a"
    assert run["lease_token"] == t["lease_token"]
    assert run["ended_at"] is None and run["outcome"] is None
    assert kinds(conn, task_id) == ["enqueued", "claimed"]
    ev = last_event(conn, task_id)
    assert ev["session_id"] == session and ev["detail"] == {"attempt": 1}


def test_claim_renews_the_session_heartbeat(conn, lane, session):
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '1 hour'")
    assert claim(conn, session) == []
    assert one(conn, "select heartbeat_at > now() - interval '1 minute' from fleet.sessions")


def test_claim_takes_only_its_own_lane(conn, lane, session):
    add_lane(conn, "b")
    other = enqueue(conn, "b", "in-b", priority=1000)
    mine = enqueue(conn, lane, "in-a")
    assert [t["id"] for t in claim(conn, session, 10)] == [mine]
    assert task(conn, other)["state"] == "queued"


def test_claim_order_priority_then_resume_then_run_at_then_id(conn, lane, session):
    same = "2020-01-01T00:00:00Z"
    a = enqueue(conn, lane, "a", priority=5, run_at="2019-01-01T00:00:00Z")
    b = enqueue(conn, lane, "b", priority=10, run_at="2021-01-01T00:00:00Z")
    c = enqueue(conn, lane, "c", priority=10, run_at=same)
    d = enqueue(conn, lane, "d", priority=10, run_at=same)
    e = enqueue(conn, lane, "e", priority=5, run_at="2022-01-01T00:00:00Z")
    conn.execute("update fleet.tasks set resume = true where id = %s", (e,))
    future = enqueue(conn, lane, "f", priority=1000, run_at="2999-01-01T00:00:00Z")
    order = [claim_one(conn, session)["id"] for _ in range(5)]
    assert order == [c, d, b, e, a]
    assert claim(conn, session) == [], "a task whose run_at is in the future is not claimed"
    assert task(conn, future)["state"] == "queued"
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s' where id = %s", (future,))
    assert claim_one(conn, session)["id"] == future


def test_claim_batch_returns_tasks_in_claim_order(conn, lane, session):
    old = enqueue(conn, lane, "old", priority=5, run_at="2019-01-01T00:00:00Z")
    resumed = enqueue(conn, lane, "resumed", priority=5, run_at="2022-01-01T00:00:00Z")
    top = enqueue(conn, lane, "top", priority=9, run_at="2023-01-01T00:00:00Z")
    conn.execute("update fleet.tasks set resume = true where id = %s", (resumed,))
    got = claim(conn, session, 10)
    assert [t["id"] for t in got] == [top, resumed, old]
    assert all(t["resume"] is False for t in got), "a claim clears resume"


def test_claim_limit(conn, lane, session):
    ids = [enqueue(conn, lane, f"k{i}") for i in range(5)]
    assert [t["id"] for t in claim(conn, session, 3)] == ids[:3]
    assert claim(conn, session, 0) == []
    assert [t["id"] for t in claim(conn, session, 10)] == ids[3:]
    assert claim(conn, session, 10) == []
    assert count(conn, "runs") == 5


@pytest.mark.parametrize("limit", [-1, None])
def test_claim_invalid_limit(conn, lane, session, limit):
    enqueue(conn, lane, "k")
    before = world(conn)
    with refused(INVALID_ARGUMENT):
        claim(conn, session, limit)
    assert world(conn) == before


def test_claim_run_at_in_the_future_is_not_claimed(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    conn.execute("update fleet.tasks set run_at = now() + interval '1 minute'")
    assert claim(conn, session) == []
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s'")
    assert claim_one(conn, session)["id"] == task_id


def test_claim_paused_lane_gives_nothing(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    conn.execute("update fleet.lanes set paused = true")
    assert claim(conn, session, 5) == []
    assert task(conn, task_id)["state"] == "queued"
    assert count(conn, "runs") == 0
    conn.execute("update fleet.lanes set paused = false")
    assert claim_one(conn, session)["id"] == task_id


def test_claim_respects_max_running_across_sessions(conn, session):
    conn.execute("update fleet.lanes set max_running = 2 where name = 'a'")
    other = open_session(conn, "a", host="host-2")
    ids = [enqueue(conn, "a", f"k{i}") for i in range(5)]
    first = claim(conn, session, 10)
    assert [t["id"] for t in first] == ids[:2]
    assert claim(conn, other, 10) == []
    assert claim(conn, session, 10) == []
    complete(conn, first[0]["id"], first[0]["lease_token"])
    assert [t["id"] for t in claim(conn, other, 10)] == [ids[2]]
    assert claim(conn, session, 10) == []
    assert one(conn, "select count(*) from fleet.tasks where state = 'running'") == 2


def test_claim_max_running_zero_and_unlimited(conn, lane, session):
    for i in range(4):
        enqueue(conn, lane, f"k{i}")
    conn.execute("update fleet.lanes set max_running = 0")
    assert claim(conn, session, 10) == []
    conn.execute("update fleet.lanes set max_running = null")
    assert len(claim(conn, session, 10)) == 4


def test_claim_counts_running_tasks_of_other_lanes_separately(conn, lane, session):
    add_lane(conn, "b", max_running=1)
    sb = open_session(conn, "b")
    enqueue(conn, "b", "b1")
    enqueue(conn, "b", "b2")
    conn.execute("update fleet.lanes set max_running = 1 where name = 'a'")
    enqueue(conn, lane, "a1")
    assert len(claim(conn, sb, 5)) == 1
    assert len(claim(conn, session, 5)) == 1


def test_claim_after_the_session_deadline_gives_nothing(conn, lane, session):
    enqueue(conn, lane, "k")
    conn.execute("update fleet.sessions set deadline = now() - interval '1 s'")
    assert claim(conn, session, 5) == []
    assert count(conn, "runs") == 0


def test_claim_increments_attempts_and_writes_one_run_per_claim(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    first = claim_one(conn, session)
    assert first["attempts"] == 1
    release(conn, task_id)
    second = claim_one(conn, session)
    assert second["attempts"] == 2
    assert second["lease_token"] != first["lease_token"]
    assert [(r["attempt"], r["lease_token"]) for r in runs(conn, task_id)] == [
        (1, first["lease_token"]),
        (2, second["lease_token"]),
    ]
    assert kinds(conn, task_id) == ["enqueued", "claimed", "repaired", "claimed"]


def test_claim_with_an_ended_session_is_refused(conn, lane, session):
    enqueue(conn, lane, "k")
    close_session(conn, session)
    before = world(conn)
    with refused(SESSION_NOT_ACTIVE):
        claim(conn, session)
    assert world(conn) == before


def test_claim_with_a_lost_session_is_refused(conn, lane, session):
    enqueue(conn, lane, "k")
    conn.execute("update fleet.sessions set state = 'lost', ended_at = now(), end_reason = 'gone'")
    with refused(SESSION_NOT_ACTIVE) as info:
        claim(conn, session)
    assert "lost" in str(info.value)
    assert count(conn, "runs") == 0


def test_claim_with_an_unknown_session_is_refused(conn, lane):
    enqueue(conn, lane, "k")
    with refused(SESSION_NOT_ACTIVE):
        claim(conn, uuid.uuid4())
    with refused(SESSION_NOT_ACTIVE):
        claim(conn, None)  # type: ignore[arg-type]
    assert count(conn, "runs") == 0


def test_claim_skips_done_dead_and_cancelled_tasks(conn, lane, session):
    ids = [enqueue(conn, lane, f"k{i}") for i in range(4)]
    cancel(conn, ids[0])
    t = claim_one(conn, session)
    complete(conn, t["id"], t["lease_token"])
    t = claim_one(conn, session)
    fail(conn, t["id"], t["lease_token"], retryable=False)
    assert [t["id"] for t in claim(conn, session, 10)] == [ids[3]]


# ------------------------------------------------------------------------------------------------
# heartbeat


def test_heartbeat_renews_the_leases_of_its_session_only(conn, lane, session):
    other = open_session(conn, lane, host="host-2")
    mine = [enqueue(conn, lane, f"m{i}") for i in range(2)]
    theirs = enqueue(conn, lane, "t")
    claim(conn, session, 2)
    claim(conn, other, 1)
    conn.execute(
        "update fleet.tasks set lease_expires_at = now() + interval '1 s' where state = 'running'"
    )
    conn.execute("update fleet.sessions set heartbeat_at = now() - interval '20 s'")
    assert heartbeat(conn, session) == {mine[0]: "ok", mine[1]: "ok"}
    for task_id in mine:
        assert one(
            conn,
            "select lease_expires_at > now() + interval '50 s' from fleet.tasks where id = %s",
            (task_id,),
        )
    assert one(
        conn,
        "select lease_expires_at < now() + interval '2 s' from fleet.tasks where id = %s",
        (theirs,),
    ), "another session's lease is not renewed"
    assert one(
        conn,
        "select heartbeat_at > now() - interval '5 s' from fleet.sessions where id = %s",
        (session,),
    )
    assert one(
        conn,
        "select heartbeat_at < now() - interval '5 s' from fleet.sessions where id = %s",
        (other,),
    )


def test_heartbeat_with_nothing_held(conn, lane, session):
    assert heartbeat(conn, session) == {}


def test_heartbeat_reports_a_released_task_as_lost(conn, lane, session):
    kept = enqueue(conn, lane, "kept")
    lost = enqueue(conn, lane, "lost")
    claim(conn, session, 2)
    release(conn, lost, "lease-expired")
    assert heartbeat(conn, session) == {kept: "ok", lost: "lost"}
    # reported again at the next heartbeat, in case an answer was lost on the way
    assert heartbeat(conn, session) == {kept: "ok", lost: "lost"}


def test_heartbeat_reports_lost_when_another_session_reclaimed_the_task(conn, lane, session):
    other = open_session(conn, lane, host="host-2")
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    release(conn, task_id)
    claim_one(conn, other)
    assert heartbeat(conn, session) == {task_id: "lost"}
    assert heartbeat(conn, other) == {task_id: "ok"}


def test_heartbeat_reports_a_cancelled_task(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    cancel(conn, task_id)
    assert heartbeat(conn, session) == {task_id: "cancelled"}


def test_heartbeat_forgets_old_losses(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    release(conn, task_id)
    conn.execute("update fleet.runs set ended_at = now() - interval '1 day'")
    assert heartbeat(conn, session) == {}


def test_heartbeat_does_not_report_finished_tasks(conn, lane, session):
    done = enqueue(conn, lane, "done")
    failed = enqueue(conn, lane, "failed")
    handed = enqueue(conn, lane, "handed")
    got = {t["id"]: t["lease_token"] for t in claim(conn, session, 3)}
    complete(conn, done, got[done])
    fail(conn, failed, got[failed])
    hand_off(conn, handed, got[handed])
    assert heartbeat(conn, session) == {}


@pytest.mark.parametrize("how", ["closed", "lost", "unknown"])
def test_heartbeat_of_an_inactive_session_is_refused(conn, lane, session, how):
    sid = session
    if how == "closed":
        close_session(conn, session)
    elif how == "lost":
        conn.execute("update fleet.sessions set state = 'lost', ended_at = now()")
    else:
        sid = uuid.uuid4()
    before = world(conn)
    with refused(SESSION_NOT_ACTIVE):
        heartbeat(conn, sid)
    assert world(conn) == before


# ------------------------------------------------------------------------------------------------
# checkpoint


def test_checkpoint_increments_seq_and_records_progress(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    claimed_at = task(conn, task_id)["last_progress_at"]
    assert claimed_at is not None, "an attempt's progress clock starts at its claim"
    assert checkpoint(conn, task_id, t["lease_token"], {"step": 1}) == 1
    after = task(conn, task_id)
    assert after["checkpoint"] == {"step": 1}
    assert after["checkpoint_seq"] == 1
    assert after["last_progress_at"] > claimed_at
    assert checkpoint(conn, task_id, t["lease_token"], {"step": 2}) == 2
    assert task(conn, task_id)["checkpoint"] == {"step": 2}
    assert kinds(conn, task_id) == ["enqueued", "claimed", "checkpoint", "checkpoint"]
    assert last_event(conn, task_id)["detail"] == {"seq": 2}
    assert task(conn, task_id)["state"] == "running"


def test_checkpoint_survives_a_release_and_keeps_counting(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    checkpoint(conn, task_id, t["lease_token"], {"step": 1})
    release(conn, task_id)
    t2 = claim_one(conn, session)
    assert t2["checkpoint"] == {"step": 1}, "the next attempt sees the last checkpoint"
    assert checkpoint(conn, task_id, t2["lease_token"], {"step": 2}) == 2


def test_checkpoint_null_data_is_refused(conn, lane, session):
    enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(INVALID_ARGUMENT):
        checkpoint(conn, t["id"], t["lease_token"], None)
    assert world(conn) == before


def test_fenced_calls_on_an_unknown_task(conn, lane, session):
    with refused(UNKNOWN_TASK):
        checkpoint(conn, 999, uuid.uuid4(), {})
    with refused(UNKNOWN_TASK):
        complete(conn, 999, uuid.uuid4())
    with refused(UNKNOWN_TASK):
        fail(conn, 999, uuid.uuid4())
    with refused(UNKNOWN_TASK):
        hand_off(conn, 999, uuid.uuid4())


# ------------------------------------------------------------------------------------------------
# complete


def test_complete(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    assert complete(conn, task_id, t["lease_token"], {"pr": 12}) == "done"
    after = task(conn, task_id)
    assert after["state"] == "done"
    assert after["result"] == {"pr": 12}
    assert after["finished_at"] is not None
    assert after["lease_token"] is None
    assert after["lease_expires_at"] is None
    assert after["session_id"] is None
    [run] = runs(conn, task_id)
    assert run["outcome"] == "done" and run["ended_at"] is not None
    assert kinds(conn, task_id) == ["enqueued", "claimed", "completed"]
    ev = last_event(conn, task_id)
    assert ev["session_id"] == session and ev["detail"] == {"attempt": 1, "state": "done"}


def test_complete_twice_is_lease_lost(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    complete(conn, task_id, t["lease_token"])
    before = world(conn)
    with refused(LEASE_LOST):
        complete(conn, task_id, t["lease_token"])
    assert world(conn) == before


# ------------------------------------------------------------------------------------------------
# fail


def test_fail_requeues_with_backoff(conn, session):
    conn.execute(
        "update fleet.lanes set backoff_base_seconds = 10, backoff_max_seconds = 35, max_attempts = 9"
    )
    task_id = enqueue(conn, "a", "k")
    delays = []
    for attempt in range(1, 5):
        conn.execute(
            "update fleet.tasks set run_at = now() - interval '1 s' where id = %s", (task_id,)
        )
        t = claim_one(conn, session)
        assert t["attempts"] == attempt
        assert fail(conn, task_id, t["lease_token"], f"error {attempt}") == "queued"
        after = task(conn, task_id)
        assert after["state"] == "queued"
        assert after["failures"] == attempt
        assert after["last_error"] == f"error {attempt}"
        assert after["lease_token"] is None and after["session_id"] is None
        assert after["finished_at"] is None
        delays.append(seconds_between(conn, task_id, "run_at", "updated_at"))
        assert one(conn, "select run_at > now() from fleet.tasks where id = %s", (task_id,))
        assert claim(conn, session) == [], "a task in backoff is not claimable"
    assert delays == [10, 20, 35, 35]  # base * 2^(failures-1), capped at backoff_max
    outcomes = [(r["outcome"], r["error_tail"]) for r in runs(conn, task_id)]
    assert outcomes == [("failed", f"error {i}") for i in range(1, 5)]
    assert kinds(conn, task_id).count("failed") == 4
    ev = last_event(conn, task_id)
    assert ev["kind"] == "failed"
    assert ev["detail"]["state"] == "queued" and ev["detail"]["retryable"] is True
    assert ev["detail"]["error"] == "error 4"


def test_fail_at_the_attempt_cap_is_dead(conn, lane, session):
    task_id = enqueue(conn, lane, "k")  # lane cap: 3
    for attempt in range(1, 4):
        conn.execute("update fleet.tasks set run_at = now() - interval '1 s'")
        t = claim_one(conn, session)
        state = fail(conn, task_id, t["lease_token"], f"e{attempt}")
        assert state == ("dead" if attempt == 3 else "queued")
    after = task(conn, task_id)
    assert after["state"] == "dead"
    assert after["dead_reason"] == "attempt-cap"
    assert after["failures"] == 3
    assert after["finished_at"] is not None
    assert after["lease_token"] is None
    assert after["last_error"] == "e3"
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s'")
    assert claim(conn, session) == []
    ev = last_event(conn, task_id)
    assert ev["detail"]["state"] == "dead" and ev["detail"]["reason"] == "attempt-cap"


def test_fail_cap_counts_evaporations(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    for _ in range(2):
        claim_one(conn, session)
        assert release(conn, task_id) == "queued"
    t = claim_one(conn, session)
    assert fail(conn, task_id, t["lease_token"]) == "dead"
    after = task(conn, task_id)
    assert (after["failures"], after["evaporations"], after["dead_reason"]) == (1, 2, "attempt-cap")


def test_fail_not_retryable_is_dead_at_once(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    assert fail(conn, task_id, t["lease_token"], "bad input", retryable=False) == "dead"
    after = task(conn, task_id)
    assert after["state"] == "dead"
    assert after["dead_reason"] == "fatal"
    assert after["failures"] == 1
    assert after["last_error"] == "bad input"
    assert runs(conn, task_id)[0]["outcome"] == "failed"
    ev = last_event(conn, task_id)
    assert ev["kind"] == "failed"
    assert ev["detail"]["retryable"] is False and ev["detail"]["reason"] == "fatal"


def test_fail_per_task_max_attempts_overrides_the_lane(conn, lane, session):
    one_shot = enqueue(conn, lane, "one", max_attempts=1)
    t = claim_one(conn, session)
    assert t["id"] == one_shot
    assert fail(conn, one_shot, t["lease_token"]) == "dead"
    assert task(conn, one_shot)["dead_reason"] == "attempt-cap"

    patient = enqueue(conn, lane, "patient", max_attempts=5)
    for _ in range(4):
        conn.execute(
            "update fleet.tasks set run_at = now() - interval '1 s' where id = %s", (patient,)
        )
        t = claim_one(conn, session)
        assert fail(conn, patient, t["lease_token"]) == "queued", (
            "the lane's cap of 3 does not apply"
        )
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s' where id = %s", (patient,))
    t = claim_one(conn, session)
    assert fail(conn, patient, t["lease_token"]) == "dead"
    assert task(conn, patient)["failures"] == 5


def test_fail_keeps_a_long_error_whole_on_the_task_and_bounded_elsewhere(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    error = "x" * 10_000
    fail(conn, task_id, t["lease_token"], error)
    assert task(conn, task_id)["last_error"] == error
    assert len(runs(conn, task_id)[0]["error_tail"]) == 4000
    assert len(last_event(conn, task_id)["detail"]["error"]) == 1000


# ------------------------------------------------------------------------------------------------
# hand_off


def test_hand_off_requeues_without_spending_an_attempt(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    checkpoint(conn, task_id, t["lease_token"], {"step": 3})
    snap = {"agent_session": "agent-abc", "summary": "half way"}
    assert hand_off(conn, task_id, t["lease_token"], snap) == "queued"
    after = task(conn, task_id)
    assert after["state"] == "queued"
    assert after["handoffs"] == 1
    assert (after["failures"], after["evaporations"]) == (0, 0)
    assert after["handoff"] == snap
    assert after["agent_session"] == "agent-abc"
    assert after["checkpoint"] == {"step": 3}, "the checkpoint is kept for the next shift"
    assert after["resume"] is True
    assert after["lease_token"] is None and after["session_id"] is None
    assert after["finished_at"] is None
    assert runs(conn, task_id)[0]["outcome"] == "handed_off"
    assert kinds(conn, task_id) == ["enqueued", "claimed", "checkpoint", "handed_off"]
    assert last_event(conn, task_id)["detail"] == {"attempt": 1, "handoffs": 1, "state": "queued"}


def test_hand_off_does_not_count_against_the_attempt_cap(conn, lane):
    conn.execute("update fleet.lanes set max_attempts = 1, max_handoffs = 5")
    task_id = enqueue(conn, "a", "k")
    for _ in range(5):
        t = claim_one(conn, open_session(conn, lane))  # a hand-off is for the next shift
        assert hand_off(conn, task_id, t["lease_token"], {}) == "queued"
    after = task(conn, task_id)
    assert after["state"] == "queued" and after["handoffs"] == 5 and after["attempts"] == 5


def test_hand_off_is_claimed_before_older_tasks_of_the_same_priority(conn, lane, session):
    handed = enqueue(conn, lane, "handed")
    t = claim_one(conn, session)
    older = [enqueue(conn, lane, f"old{i}", run_at="2000-01-01T00:00:00Z") for i in range(3)]
    higher = enqueue(conn, lane, "higher", priority=1, run_at="2030-01-01T00:00:00Z")
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s' where id = %s", (higher,))
    hand_off(conn, handed, t["lease_token"], {})
    next_shift = open_session(conn, lane)
    order = [claim_one(conn, next_shift)["id"] for _ in range(5)]
    assert order == [higher, handed, *older], "higher priority first, then the resumed task"
    assert task(conn, handed)["resume"] is False


def test_a_session_does_not_reclaim_a_task_it_handed_off(conn, lane, session):
    handed = enqueue(conn, lane, "handed")
    t = claim_one(conn, session)
    hand_off(conn, handed, t["lease_token"], {})
    other = enqueue(conn, lane, "other")
    assert [r["id"] for r in claim(conn, session, 5)] == [other]
    assert [r["id"] for r in claim(conn, open_session(conn, lane), 5)] == [handed]


def test_heartbeat_with_task_list_releases_what_the_shift_does_not_name(conn, lane, session):
    a, b, c = (enqueue(conn, lane, k) for k in ("a", "b", "c"))
    claim(conn, session, 3)
    one(conn, "select fleet.cancel(%s)", (c,))
    rows = dict(conn.execute("select task_id, status from fleet.heartbeat(%s, %s::bigint[])",
                             (session, [a, c])).fetchall())
    assert rows == {a: "ok", c: "cancelled"}
    released = task(conn, b)
    assert released["state"] == "queued" and released["evaporations"] == 1
    kinds = [r[0] for r in conn.execute(
        "select detail->>'reason' from fleet.events where task_id = %s and kind = 'repaired'", (b,))]
    assert kinds == ["not-run-by-shift"]
    assert task(conn, a)["state"] == "running"


def test_hand_off_agent_session_is_kept_when_the_snapshot_has_none(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    hand_off(conn, task_id, t["lease_token"], {"agent_session": "s1"})
    t = claim_one(conn, session := open_session(conn, lane))
    hand_off(conn, task_id, t["lease_token"], {"notes": "no session this time"})
    after = task(conn, task_id)
    assert after["agent_session"] == "s1"
    assert after["handoff"] == {"notes": "no session this time"}
    t = claim_one(conn, session := open_session(conn, lane))
    hand_off(conn, task_id, t["lease_token"], None)
    assert task(conn, task_id)["handoff"] == {}


def test_hand_off_beyond_max_handoffs_is_dead(conn, session):
    conn.execute("update fleet.lanes set max_handoffs = 2")
    task_id = enqueue(conn, "a", "k")
    states = []
    for _ in range(3):
        t = claim_one(conn, open_session(conn, "a"))  # a hand-off is for the next shift
        states.append(hand_off(conn, task_id, t["lease_token"], {"n": len(states)}))
    assert states == ["queued", "queued", "dead"]
    after = task(conn, task_id)
    assert after["state"] == "dead"
    assert after["dead_reason"] == "handoff-cap"
    assert after["handoffs"] == 3
    assert after["resume"] is False
    assert after["finished_at"] is not None
    assert claim(conn, session) == []
    assert last_event(conn, task_id)["detail"]["state"] == "dead"


def test_hand_off_with_max_handoffs_zero_is_dead_at_once(conn, session):
    conn.execute("update fleet.lanes set max_handoffs = 0")
    task_id = enqueue(conn, "a", "k")
    t = claim_one(conn, session)
    assert hand_off(conn, task_id, t["lease_token"], {}) == "dead"
    assert task(conn, task_id)["dead_reason"] == "handoff-cap"


@pytest.mark.parametrize("snapshot", [[1], "text", 5])
def test_hand_off_snapshot_must_be_an_object(conn, lane, session, snapshot):
    enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(INVALID_ARGUMENT):
        hand_off(conn, t["id"], t["lease_token"], snapshot)
    assert world(conn) == before


# ------------------------------------------------------------------------------------------------
# route


def test_route_to_another_lane_starts_fresh_and_keeps_history(conn, lane, session):
    add_lane(conn, "review")
    task_id = enqueue(conn, lane, "k", {"repo": "r"}, priority=4)
    # a first attempt that evaporated, a second that failed, a third that handed off
    claim_one(conn, session)
    release(conn, task_id)
    t = claim_one(conn, session)
    fail(conn, task_id, t["lease_token"])
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s'")
    t = claim_one(conn, session)
    hand_off(conn, task_id, t["lease_token"], {"agent_session": "ag-1"})
    t = claim_one(conn, session := open_session(conn, lane))
    checkpoint(conn, task_id, t["lease_token"], {"stage": "triaged"})
    assert route(conn, task_id, t["lease_token"], "review", {"why": "ready"}) == "queued"

    after = task(conn, task_id)
    assert after["lane"] == "review"
    assert after["state"] == "queued"
    assert after["key"] == "k" and after["payload"] == {"repo": "r"} and after["priority"] == 4
    assert (after["attempts"], after["failures"], after["evaporations"], after["handoffs"]) == (
        0,
        0,
        0,
        0,
    )
    assert after["checkpoint"] is None and after["checkpoint_seq"] == 0
    assert after["agent_session"] is None and after["handoff"] is None
    assert after["last_error"] is None
    assert after["resume"] is False
    assert after["lease_token"] is None and after["session_id"] is None
    [stage] = after["stages"]
    assert stage["lane"] == "a"
    assert stage["routed_to"] == "review"
    assert (stage["attempts"], stage["failures"], stage["evaporations"], stage["handoffs"]) == (
        4,
        1,
        1,
        1,
    )
    assert stage["agent_session"] == "ag-1"
    assert stage["checkpoint"] == {"stage": "triaged"}
    assert stage["note"] == {"why": "ready"}
    assert stage["finished_at"]
    assert runs(conn, task_id)[-1]["outcome"] == "routed"
    assert kinds(conn, task_id)[-2:] == ["checkpoint", "routed"]
    assert last_event(conn, task_id)["detail"] == {
        "from": "a",
        "to": "review",
        "note": {"why": "ready"},
    }

    # the next lane claims it as its own attempt 1; a second route appends to the history
    review = open_session(conn, "review")
    assert claim(conn, session) == []
    t = claim_one(conn, review)
    assert t["attempts"] == 1
    assert route(conn, task_id, t["lease_token"], "a") == "queued"
    stages = task(conn, task_id)["stages"]
    assert [(s["lane"], s["routed_to"], s["attempts"]) for s in stages] == [
        ("a", "review", 4),
        ("review", "a", 1),
    ]
    assert stages[1]["note"] is None


def test_route_unknown_lane_is_refused(conn, lane, session):
    enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(UNKNOWN_LANE):
        route(conn, t["id"], t["lease_token"], "nope")
    with refused(UNKNOWN_LANE):
        route(conn, t["id"], t["lease_token"], None)
    assert world(conn) == before


def test_route_to_the_same_lane_is_refused(conn, lane, session):
    enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(INVALID_ARGUMENT):
        route(conn, t["id"], t["lease_token"], "a")
    assert world(conn) == before


def test_route_refused_by_accepts_from_changes_nothing(conn, lane, session):
    add_lane(conn, "review", accepts_from=["implement"])
    add_lane(conn, "closed", accepts_from=[])
    add_lane(conn, "implement")
    enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(ROUTE_REFUSED) as info:
        route(conn, t["id"], t["lease_token"], "review")
    assert "implement" in str(info.value.diag.message_hint)
    with refused(ROUTE_REFUSED):
        route(conn, t["id"], t["lease_token"], "closed")
    assert world(conn) == before
    # the lease is intact: routing to a lane that accepts it still works
    assert route(conn, t["id"], t["lease_token"], "implement") == "queued"


def test_route_accepted_by_accepts_from(conn, lane, session):
    add_lane(conn, "review", accepts_from=["x", "a"])
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    assert route(conn, task_id, t["lease_token"], "review") == "queued"
    assert task(conn, task_id)["lane"] == "review"


# ------------------------------------------------------------------------------------------------
# fencing: a call with a stale, random or null token changes nothing and says "lease lost"


def _fenced_call(name: str) -> Callable[[psycopg.Connection, int, Any], Any]:
    calls: dict[str, Callable[[psycopg.Connection, int, Any], Any]] = {
        "checkpoint": lambda c, i, tok: checkpoint(c, i, tok, {"zombie": True}),
        "complete": lambda c, i, tok: complete(c, i, tok, {"zombie": True}),
        "fail": lambda c, i, tok: fail(c, i, tok, "zombie"),
        "fail-fatal": lambda c, i, tok: fail(c, i, tok, "zombie", retryable=False),
        "hand_off": lambda c, i, tok: hand_off(c, i, tok, {"agent_session": "zombie"}),
        "route": lambda c, i, tok: route(c, i, tok, "b"),
    }
    return calls[name]


FENCED = ["checkpoint", "complete", "fail", "fail-fatal", "hand_off", "route"]


@pytest.mark.parametrize("call", FENCED)
@pytest.mark.parametrize("token", ["stale", "random", "null"])
def test_fenced_call_with_a_bad_token_is_lease_lost_and_changes_nothing(conn, lane, call, token):
    add_lane(conn, "b")
    s1 = open_session(conn, lane, host="zombie")
    s2 = open_session(conn, lane, host="healthy")
    task_id = enqueue(conn, lane, "k")
    first = claim_one(conn, s1)
    assert release(conn, task_id, "lease-expired") == "queued"
    second = claim_one(conn, s2)
    bad = {"stale": first["lease_token"], "random": uuid.uuid4(), "null": None}[token]

    before = world(conn)
    with refused(LEASE_LOST) as info:
        _fenced_call(call)(conn, task_id, bad)
    assert "lease lost" in str(info.value)
    assert world(conn) == before

    # the live lease still works: the fence refused the token, not the call
    _fenced_call(call)(conn, task_id, second["lease_token"])
    assert world(conn) != before


@pytest.mark.parametrize("call", FENCED)
@pytest.mark.parametrize("how", ["completed", "cancelled", "released", "dead"])
def test_fenced_call_after_the_lease_ended_is_lease_lost(conn, lane, session, call, how):
    add_lane(conn, "b")
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    if how == "completed":
        complete(conn, task_id, t["lease_token"])
    elif how == "cancelled":
        cancel(conn, task_id)
    elif how == "released":
        release(conn, task_id)
    else:
        fail(conn, task_id, t["lease_token"], retryable=False)
    before = world(conn)
    with refused(LEASE_LOST):
        _fenced_call(call)(conn, task_id, t["lease_token"])
    assert world(conn) == before


def test_a_token_holds_only_its_own_task(conn, lane, session):
    a = enqueue(conn, lane, "a")
    b = enqueue(conn, lane, "b")
    _ta, tb = claim(conn, session, 2)
    before = world(conn)
    with refused(LEASE_LOST):
        complete(conn, a, tb["lease_token"])
    assert world(conn) == before
    assert complete(conn, b, tb["lease_token"]) == "done"


# ------------------------------------------------------------------------------------------------
# record_run


TOKENS = {
    "exit_code": 0,
    "tier": "large",
    "model": "claude-x",
    "agent_session": "ag-9",
    "input_tokens": 1200,
    "cache_creation_tokens": 300,
    "cache_read_tokens": 45000,
    "output_tokens": 800,
    "cost_usd": 0.4321,
    "log_path": "/logs/1.log",
    "error_tail": "warning: something",
}


def test_record_run_records_tokens_and_cost(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    record_run(conn, t["lease_token"], TOKENS)
    [run] = runs(conn, task_id)
    for field, value in TOKENS.items():
        if field == "cost_usd":
            assert float(run[field]) == value
        else:
            assert run[field] == value, field
    assert task(conn, task_id)["agent_session"] == "ag-9"
    assert run["ended_at"] is None, "recording a run does not end it"
    assert task(conn, task_id)["state"] == "running"


def test_record_run_merges_partial_reports(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    record_run(conn, t["lease_token"], {"model": "m1", "input_tokens": 10})
    record_run(conn, t["lease_token"], {"output_tokens": 5})
    [run] = runs(conn, task_id)
    assert (run["model"], run["input_tokens"], run["output_tokens"]) == ("m1", 10, 5)


def test_record_run_is_allowed_after_the_lease_is_gone(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    complete(conn, task_id, t["lease_token"])
    record_run(conn, t["lease_token"], {"input_tokens": 7, "cost_usd": 1.5, "exit_code": 0})
    [run] = runs(conn, task_id)
    assert run["input_tokens"] == 7 and float(run["cost_usd"]) == 1.5
    assert run["outcome"] == "done"

    # a fenced (released) run still spent its tokens
    other = enqueue(conn, lane, "other")
    t = claim_one(conn, session)
    release(conn, other)
    record_run(conn, t["lease_token"], {"output_tokens": 99})
    assert runs(conn, other)[0]["output_tokens"] == 99


def test_record_run_agent_session_only_from_the_latest_run(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    first = claim_one(conn, session)
    release(conn, task_id)
    second = claim_one(conn, session)
    record_run(conn, first["lease_token"], {"agent_session": "old", "input_tokens": 1})
    assert task(conn, task_id)["agent_session"] is None, "a superseded run does not set it"
    assert runs(conn, task_id)[0]["agent_session"] == "old", "but its run row keeps it"
    record_run(conn, second["lease_token"], {"agent_session": "new"})
    assert task(conn, task_id)["agent_session"] == "new"
    record_run(conn, first["lease_token"], {"agent_session": "older"})
    assert task(conn, task_id)["agent_session"] == "new"


def test_record_run_without_agent_session_keeps_the_tasks(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    hand_off(conn, task_id, t["lease_token"], {"agent_session": "from-snapshot"})
    record_run(conn, t["lease_token"], {"input_tokens": 3})
    assert task(conn, task_id)["agent_session"] == "from-snapshot"


def test_record_run_after_a_route_does_not_leak_the_agent_session_into_the_next_lane(
    conn, lane, session
):
    add_lane(conn, "review")
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    route(conn, task_id, t["lease_token"], "review")
    # the shift reports the finished run after routing it (allowed: the lease is gone)
    record_run(conn, t["lease_token"], {"agent_session": "triage-agent", "input_tokens": 5})
    after = task(conn, task_id)
    assert after["lane"] == "review"
    assert after["agent_session"] is None, "the review stage starts with a fresh agent session"
    assert runs(conn, task_id)[0]["agent_session"] == "triage-agent"


def test_record_run_refusals(conn, lane, session):
    enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(UNKNOWN_TASK):
        record_run(conn, uuid.uuid4(), {"input_tokens": 1})
    with refused(UNKNOWN_TASK):
        record_run(conn, None, {"input_tokens": 1})
    for bad in (None, [1], "x", 3):
        with refused(INVALID_ARGUMENT):
            record_run(conn, t["lease_token"], bad)
    assert world(conn) == before


# ------------------------------------------------------------------------------------------------
# close_session


def test_close_session_writes_the_lane_handoff(conn, lane, session):
    conn.execute("update fleet.lanes set backoff_base_seconds = 600")
    done, failed, handed, held, waiting = (
        enqueue(conn, lane, k) for k in ("done", "failed", "handed", "held", "waiting")
    )
    urgent = enqueue(conn, lane, "urgent", priority=50)
    claimed = claim(conn, session, 5)
    assert {t["id"] for t in claimed} == {urgent, done, failed, handed, held}
    tok = {t["id"]: t["lease_token"] for t in claimed}
    complete(conn, urgent, tok[urgent])
    complete(conn, done, tok[done])
    fail(conn, failed, tok[failed], "oops")
    hand_off(conn, handed, tok[handed], {"agent_session": "x"})
    record_run(
        conn,
        tok[done],
        {
            "input_tokens": 100,
            "cache_creation_tokens": 10,
            "cache_read_tokens": 1000,
            "output_tokens": 50,
            "cost_usd": 0.25,
        },
    )
    record_run(conn, tok[failed], {"input_tokens": 20, "output_tokens": 5, "cost_usd": 0.5})
    record_run(conn, tok[held], {"input_tokens": 1})
    # a run of another session is not counted
    other = open_session(conn, lane, host="host-2")
    extra = enqueue(conn, lane, "extra")
    conn.execute("update fleet.tasks set priority = 99 where id = %s", (extra,))
    t = claim_one(conn, other)
    record_run(conn, t["lease_token"], {"input_tokens": 100000})
    complete(conn, extra, t["lease_token"])

    hid = close_session(conn, session, "deadline", {"summary": "a good shift"})
    [h] = rows(conn, "select * from fleet.lane_handoffs where session_id = %s", (session,))
    assert h["id"] == hid
    assert h["lane"] == "a"
    assert h["end_reason"] == "deadline"
    assert h["counts"] == {
        "runs": 5,
        "done": 2,
        "failed": 1,
        "handed_off": 1,
        "routed": 0,
        "lost": 1,
        "cancelled": 0,
    }
    assert h["completed"] == [urgent, done]
    assert h["failed"] == [failed]
    assert h["handed_off"] == [handed]
    assert h["tokens"] == {"input": 121, "cache_creation": 10, "cache_read": 1000, "output": 55}
    assert float(h["cost_usd"]) == 0.75
    assert h["notes"] == {"summary": "a good shift"}
    assert h["window_start"] <= h["window_end"]
    # the queue head, in claim order: the resumed hand-off, then the waiting task (older run_at),
    # the released one (run_at reset to its release), the failed one (in backoff, still queued)
    head = [q["id"] for q in h["queue_head"]]
    assert head == [handed, waiting, held, failed]
    assert h["queue_head"][0]["resume"] is True
    assert set(h["queue_head"][0]) >= {"id", "key", "title", "priority", "resume", "run_at"}

    # the still-held task was released, counting an evaporation
    released = task(conn, held)
    assert released["state"] == "queued"
    assert released["evaporations"] == 1
    assert released["lease_token"] is None
    assert runs(conn, held)[0]["outcome"] == "lost"
    assert runs(conn, held)[0]["error_tail"] == "released: session-closed"
    assert kinds(conn, held)[-1] == "repaired"
    assert last_event(conn, held)["detail"]["reason"] == "session-closed"

    s = rows(conn, "select * from fleet.sessions where id = %s", (session,))[0]
    assert s["state"] == "ended" and s["ended_at"] is not None and s["end_reason"] == "deadline"
    ev = rows(
        conn,
        "select * from fleet.events where session_id = %s and kind = 'session_closed'",
        (session,),
    )
    assert len(ev) == 1
    assert ev[0]["detail"] == {"reason": "deadline", "lane_handoff": hid}


def test_close_session_release_at_the_cap_is_dead(conn, session):
    conn.execute("update fleet.lanes set max_attempts = 1")
    task_id = enqueue(conn, "a", "k")
    claim_one(conn, session)
    close_session(conn, session)
    after = task(conn, task_id)
    assert after["state"] == "dead" and after["dead_reason"] == "attempt-cap"
    assert after["evaporations"] == 1 and after["finished_at"] is not None


def test_close_session_twice_returns_the_same_id(conn, lane, session):
    enqueue(conn, lane, "k")
    claim_one(conn, session)
    first = close_session(conn, session, "deadline", {"n": 1})
    before = world(conn)
    assert close_session(conn, session, "sigterm", {"n": 2}) == first
    assert world(conn) == before, "closing again is a no-op"


def test_close_session_empty(conn, lane, session):
    hid = close_session(conn, session, None, None)
    [h] = rows(conn, "select * from fleet.lane_handoffs where id = %s", (hid,))
    assert h["counts"]["runs"] == 0
    assert h["completed"] == [] and h["failed"] == [] and h["handed_off"] == []
    assert h["tokens"] == {"input": 0, "cache_creation": 0, "cache_read": 0, "output": 0}
    assert h["queue_head"] == [] and h["notes"] == {}
    assert h["end_reason"] == "closed"
    assert one(conn, "select end_reason from fleet.sessions") == "closed"


def test_close_session_queue_head_is_ten_of_its_lane(conn, lane, session):
    add_lane(conn, "b")
    enqueue(conn, "b", "other-lane", priority=1000)
    ids = [enqueue(conn, lane, f"k{i:02}", priority=i % 3) for i in range(15)]
    hid = close_session(conn, session)
    head = one(conn, "select queue_head from fleet.lane_handoffs where id = %s", (hid,))
    expected = sorted(ids, key=lambda i: (-((i - ids[0]) % 3), i))[:10]
    assert [q["id"] for q in head] == expected


def test_close_session_of_a_lost_session_still_writes_the_snapshot(conn, lane, session):
    conn.execute("update fleet.sessions set state = 'lost', ended_at = now(), end_reason = 'gone'")
    hid = close_session(conn, session, "late")
    assert hid is not None
    s = rows(conn, "select * from fleet.sessions")[0]
    assert s["state"] == "lost" and s["end_reason"] == "gone", "a lost session stays lost"


def test_close_session_refusals(conn, lane, session):
    before = world(conn)
    with refused(SESSION_NOT_ACTIVE):
        close_session(conn, uuid.uuid4())
    with refused(INVALID_ARGUMENT):
        close_session(conn, session, "x", [1])
    assert world(conn) == before


# ------------------------------------------------------------------------------------------------
# cancel


def test_cancel_a_queued_task(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    assert cancel(conn, task_id) == "cancelled"
    after = task(conn, task_id)
    assert after["state"] == "cancelled" and after["finished_at"] is not None
    assert claim(conn, session) == []
    assert kinds(conn, task_id) == ["enqueued", "cancelled"]
    ev = last_event(conn, task_id)
    assert ev["detail"] == {"was": "queued"} and ev["session_id"] is None


def test_cancel_a_resumable_task_clears_resume(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    hand_off(conn, task_id, t["lease_token"], {})
    cancel(conn, task_id)
    assert task(conn, task_id)["resume"] is False


def test_cancel_a_running_task(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    assert cancel(conn, task_id) == "cancelled"
    after = task(conn, task_id)
    assert after["state"] == "cancelled"
    assert after["lease_token"] is None and after["session_id"] is None
    assert after["finished_at"] is not None
    [run] = runs(conn, task_id)
    assert run["outcome"] == "cancelled" and run["ended_at"] is not None
    ev = last_event(conn, task_id)
    assert ev["kind"] == "cancelled"
    assert ev["detail"] == {"was": "running"} and ev["session_id"] == session


def test_cancel_again_is_a_no_op(conn, lane):
    task_id = enqueue(conn, lane, "k")
    cancel(conn, task_id)
    before = world(conn)
    assert cancel(conn, task_id) == "cancelled"
    assert world(conn) == before


@pytest.mark.parametrize("end", ["done", "dead"])
def test_cancel_a_finished_task_is_refused(conn, lane, session, end):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    if end == "done":
        complete(conn, task_id, t["lease_token"])
    else:
        fail(conn, task_id, t["lease_token"], retryable=False)
    before = world(conn)
    with refused(INVALID_STATE):
        cancel(conn, task_id)
    assert world(conn) == before


def test_cancel_unknown_task(conn, lane):
    with refused(UNKNOWN_TASK):
        cancel(conn, 12345)


# ------------------------------------------------------------------------------------------------
# retry


def test_retry_a_dead_task(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    release(conn, task_id)
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s'")
    t = claim_one(conn, session)
    hand_off(conn, task_id, t["lease_token"], {})
    t = claim_one(conn, session := open_session(conn, lane))
    fail(conn, task_id, t["lease_token"], "fatal thing", retryable=False)
    assert retry(conn, task_id) == "queued"
    after = task(conn, task_id)
    assert after["state"] == "queued"
    assert (after["failures"], after["evaporations"], after["handoffs"]) == (0, 0, 0)
    assert after["attempts"] == 3, "attempts count claims, for the record"
    assert after["dead_reason"] is None and after["finished_at"] is None
    assert after["resume"] is False
    assert kinds(conn, task_id)[-1] == "retried"
    assert last_event(conn, task_id)["detail"] == {"was": "dead", "reason": "fatal"}
    t = claim_one(conn, session)
    assert t["id"] == task_id and t["attempts"] == 4


def test_retry_gives_a_fresh_cap(conn, session):
    conn.execute("update fleet.lanes set max_attempts = 1")
    task_id = enqueue(conn, "a", "k")
    t = claim_one(conn, session)
    assert fail(conn, task_id, t["lease_token"]) == "dead"
    retry(conn, task_id)
    t = claim_one(conn, session)
    assert fail(conn, task_id, t["lease_token"]) == "dead", "one more try, as the cap says"
    retry(conn, task_id)
    t = claim_one(conn, session)
    assert complete(conn, task_id, t["lease_token"]) == "done"


def test_retry_a_cancelled_task(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    cancel(conn, task_id)
    assert retry(conn, task_id) == "queued"
    after = task(conn, task_id)
    assert after["state"] == "queued" and after["finished_at"] is None
    assert last_event(conn, task_id)["detail"] == {"was": "cancelled", "reason": None}
    assert claim_one(conn, session)["id"] == task_id


@pytest.mark.parametrize("state", ["queued", "running", "done"])
def test_retry_refused_unless_dead_or_cancelled(conn, lane, session, state):
    task_id = enqueue(conn, lane, "k")
    if state != "queued":
        t = claim_one(conn, session)
        if state == "done":
            complete(conn, task_id, t["lease_token"])
    before = world(conn)
    with refused(INVALID_STATE):
        retry(conn, task_id)
    assert world(conn) == before


def test_retry_unknown_task(conn, lane):
    with refused(UNKNOWN_TASK):
        retry(conn, 12345)


# ------------------------------------------------------------------------------------------------
# _release (the repair shared by close_session and the monitor)


def test_release_requeues_then_kills_at_the_cap(conn, session):
    conn.execute("update fleet.lanes set max_attempts = 2")
    task_id = enqueue(conn, "a", "k")
    claim_one(conn, session)
    assert release(conn, task_id, "lease-expired") == "queued"
    t = task(conn, task_id)
    assert t["evaporations"] == 1 and t["state"] == "queued" and t["lease_token"] is None
    ev = last_event(conn, task_id)
    assert ev["kind"] == "repaired"
    assert ev["detail"]["reason"] == "lease-expired" and ev["detail"]["state"] == "queued"
    claim_one(conn, session)
    assert release(conn, task_id, "session-lost") == "dead"
    t = task(conn, task_id)
    assert t["state"] == "dead" and t["dead_reason"] == "attempt-cap" and t["evaporations"] == 2
    assert [r["outcome"] for r in runs(conn, task_id)] == ["lost", "lost"]


def test_release_of_a_task_not_running_does_nothing(conn, lane):
    task_id = enqueue(conn, lane, "k")
    before = world(conn)
    assert release(conn, task_id) is None
    assert release(conn, 999) is None
    assert world(conn) == before


# ------------------------------------------------------------------------------------------------
# the journal: every transition of one task's life, in order


def test_every_transition_writes_its_event(conn, lane, session):
    add_lane(conn, "b")
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    checkpoint(conn, task_id, t["lease_token"], {})
    hand_off(conn, task_id, t["lease_token"], {})
    t = claim_one(conn, session := open_session(conn, lane))
    fail(conn, task_id, t["lease_token"])
    conn.execute("update fleet.tasks set run_at = now() - interval '1 s'")
    t = claim_one(conn, session)
    route(conn, task_id, t["lease_token"], "b")
    sb = open_session(conn, "b")
    claim_one(conn, sb)
    release(conn, task_id)
    t = claim_one(conn, sb)
    cancel(conn, task_id)
    retry(conn, task_id)
    t = claim_one(conn, sb)
    complete(conn, task_id, t["lease_token"])
    assert kinds(conn, task_id) == [
        "enqueued",
        "claimed",
        "checkpoint",
        "handed_off",
        "claimed",
        "failed",
        "claimed",
        "routed",
        "claimed",
        "repaired",
        "claimed",
        "cancelled",
        "retried",
        "claimed",
        "completed",
    ]
    lanes = [
        r["lane"]
        for r in rows(
            conn, "select lane from fleet.events where task_id = %s order by id", (task_id,)
        )
    ]
    assert lanes == ["a"] * 8 + ["b"] * 7
    close_session(conn, session)
    session_kinds = [
        r["kind"]
        for r in rows(
            conn,
            "select kind from fleet.events where task_id is null and session_id = %s order by id",
            (session,),
        )
    ]
    assert session_kinds == ["session_opened", "session_closed"]


def test_a_refused_call_writes_no_event(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    complete(conn, task_id, t["lease_token"])
    n = count(conn, "events")
    for call in (
        lambda: cancel(conn, task_id),
        lambda: retry(conn, task_id),
        lambda: complete(conn, task_id, t["lease_token"]),
    ):
        with pytest.raises(psycopg.Error):
            call()
    assert count(conn, "events") == n


# ------------------------------------------------------------------------------------------------
# the table's own constraints refuse impossible states, whatever writes them


@pytest.mark.parametrize(
    ("label", "update"),
    [
        ("running without lease token", "lease_token = null"),
        ("running without lease expiry", "lease_expires_at = null"),
        ("running without session", "session_id = null"),
        ("queued with a lease", "state = 'queued'"),
        (
            "done without finished_at",
            "state = 'done', lease_token = null, lease_expires_at = null, session_id = null",
        ),
        ("negative attempts", "attempts = -1"),
        ("priority out of range", "priority = 1001"),
        ("payload not an object", "payload = '[]'"),
        ("unknown state", "state = 'paused'"),
    ],
)
def test_constraints_refuse_impossible_task_states(conn, lane, session, label, update):
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    before = world(conn)
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(f"update fleet.tasks set {update} where id = %s", (task_id,))
    assert world(conn) == before, label


def test_constraint_refuses_a_queued_task_with_a_lease(conn, lane, session):
    task_id = enqueue(conn, lane, "k")
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(
            "update fleet.tasks set lease_token = gen_random_uuid() where id = %s", (task_id,)
        )
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("update fleet.tasks set state = 'running' where id = %s", (task_id,))


def test_constraint_refuses_an_active_session_with_an_end(conn, lane, session):
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("update fleet.sessions set ended_at = now()")
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("update fleet.sessions set state = 'ended'")


# ------------------------------------------------------------------------------------------------
# found while testing


def test_heartbeat_reports_each_task_once_with_its_latest_outcome(conn, lane, session):
    # lost (released), re-claimed by the same session, then cancelled: one row, 'cancelled'
    task_id = enqueue(conn, lane, "k")
    claim_one(conn, session)
    release(conn, task_id)
    claim_one(conn, session)
    cancel(conn, task_id)
    got = rows(conn, "select task_id, status from fleet.heartbeat(%s)", (session,))
    assert got == [{"task_id": task_id, "status": "cancelled"}]
    # and the other way round: cancelled, retried, re-claimed, released: 'lost'
    retry(conn, task_id)
    claim_one(conn, session)
    release(conn, task_id)
    got = rows(conn, "select task_id, status from fleet.heartbeat(%s)", (session,))
    assert got == [{"task_id": task_id, "status": "lost"}]


@pytest.mark.parametrize(
    "report",
    [
        {"input_tokens": -1},
        {"output_tokens": "many"},
        {"cost_usd": -0.5},
        {"exit_code": 1.5},
        {"exit_code": "zero"},
        {"cache_read_tokens": 1e30},
    ],
)
def test_record_run_malformed_numbers_are_invalid_arguments(conn, lane, session, report):
    enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    before = world(conn)
    with refused(INVALID_ARGUMENT):
        record_run(conn, t["lease_token"], report | {"agent_session": "x"})
    assert world(conn) == before


def test_enqueue_of_an_existing_key_in_another_lane_returns_the_existing_task(conn, lane):
    # pinned as it is: the key is global, so the second lane's enqueue is a silent no-op
    add_lane(conn, "b")
    task_id = enqueue(conn, lane, "issue:9")
    again, created = enqueue_task(conn, "b", "issue:9")
    assert (again, created) == (task_id, False)
    assert task(conn, task_id)["lane"] == "a"


def test_the_fence_is_the_token_not_the_clock(conn, lane, session):
    # a lease that expired but was not yet repaired still holds the task: only a repair (the
    # monitor's _release) ends it, so a slow worker racing the monitor is decided by the row lock
    task_id = enqueue(conn, lane, "k")
    t = claim_one(conn, session)
    conn.execute("update fleet.tasks set lease_expires_at = now() - interval '1 hour'")
    assert complete(conn, task_id, t["lease_token"]) == "done"
