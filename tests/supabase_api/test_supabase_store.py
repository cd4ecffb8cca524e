"""The supabase store (worker/store/supabase.py) against the real local stack: the same answers and
the same exceptions as the psycopg store, its reads, and its retries (through a flaky loopback
proxy in front of the gateway that fails requests on cue and counts them).
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import httpx
import pytest
from supabase_stack import key, sql, store

from worker.dev.devstack import DevStack, free_port
from worker.errors import (
    ConfigError,
    DatabaseUnavailable,
    InvalidInput,
    InvalidState,
    LaneForbidden,
    LeaseLost,
    MigrationError,
    RouteRefused,
    SessionLost,
    UnknownLane,
    UnknownTask,
)
from worker.models import Task
from worker.runtime import Runtime
from worker.store.postgres import PostgresStore
from worker.store.supabase import AccessDenied, SupabaseStore


@pytest.fixture
def lanes(stack: DevStack) -> DevStack:
    with PostgresStore(stack.db_url, max_size=1) as direct:
        direct.sync_lane("docs", {"max_attempts": 2, "backoff_base_seconds": 0})
        direct.sync_lane("review", {"accepts_from": ["docs"]})
        direct.sync_lane("closed", {"accepts_from": []})
    return stack


@pytest.fixture
def rest(lanes: DevStack) -> Iterator[SupabaseStore]:
    st = store(lanes, key(lanes, "worker", ["docs", "review", "closed"]))
    yield st
    st.close()


@pytest.fixture
def operator(lanes: DevStack) -> Iterator[SupabaseStore]:
    st = store(lanes, key(lanes, "operator"))
    yield st
    st.close()


def claimed(st: SupabaseStore, lane: str = "docs", key_: str | None = None) -> tuple[UUID, Task]:
    st.enqueue(lane, key_ or f"k:{uuid4().hex[:8]}")
    session = st.open_session(lane, "h", 4242, None, 600)
    (task,) = st.claim(session, 1)
    return session, task


# ------------------------------------------------------------------------------------------------
# the same answers as the psycopg store


def script(st: Any) -> list[Any]:
    """One life of a task, recording what each call returns (ids replaced by their order)."""
    out: list[Any] = []
    out.append(st.enqueue("docs", "parity:1", {"a": [1, "x"]}, priority=5, title="t"))
    out.append(st.enqueue("docs", "parity:1", {"other": True}))  # idempotent on key
    session = st.open_session("docs", "host", 77, datetime(2026, 1, 1, tzinfo=datetime.now().astimezone().tzinfo), 600)
    (task,) = st.claim(session, 5)
    out.append((task.key, task.state, task.attempts, task.payload, task.priority, task.title))
    out.append(st.claim(session, 5))
    for beat in (st.heartbeat(session, [task.id]), st.heartbeat(session)):
        out.append((beat, beat.valid_for))  # valid_for: the lane's lease, from the database's now()
    held = st.lease_held(task.id, task.lease_token)
    out.append((held.held, held.state, held.token_matches, 59 < held.valid_for <= 60))
    out.append(st.checkpoint(task.id, task.lease_token, {"step": 1}))
    out.append(st.record_run(task.lease_token, {"input_tokens": 3, "model": "m"}))
    out.append(st.fail(task.id, task.lease_token, "first try failed"))
    (again,) = st.claim(session, 1)
    out.append(st.hand_off(again.id, again.lease_token, {"agent_session": "s-1"}))
    out.append(st.claim(session, 1))  # its own hand-off is for the next shift
    out.append(st.close_session(session, "deadline", {"note": 1}) > 0)
    s2 = st.open_session("docs", "host", 78, None, 600)
    (third,) = st.claim(s2, 1)
    out.append((third.agent_session, third.carry_over, third.attempts))
    out.append(st.route(third.id, third.lease_token, "review", {"why": "done"}))
    s3 = st.open_session("review", "host", 79, None, 600)
    (fourth,) = st.claim(s3, 1)
    out.append(st.complete(fourth.id, fourth.lease_token, {"ok": 1}))
    done = st.get_task("parity:1")
    out.append((done.state, done.lane, len(done.stages), done.result))
    out.append([(r.attempt, r.outcome, r.input_tokens) for r in st.task_runs(done.id)])
    out.append([e.kind for e in st.task_events(done.id)])
    handoff = st.last_lane_handoff("docs")
    out.append((handoff.end_reason, handoff.counts, handoff.notes))
    out.append(st.lane_names())
    out.append([t.key for t in st.list_tasks(lane="review", state="done")])
    return out


def test_the_supabase_store_answers_as_the_psycopg_store(lanes: DevStack) -> None:
    with PostgresStore(lanes.db_url, max_size=1) as direct:
        expected = script(direct)
    sql(lanes, "truncate fleet.events, fleet.runs, fleet.lane_handoffs, fleet.tasks, fleet.sessions"
               " restart identity cascade")
    rest = store(lanes, key(lanes, "worker", ["docs", "review", "closed"]))
    try:
        assert script(rest) == expected
    finally:
        rest.close()


def test_sql_errors_become_the_same_exceptions(rest: SupabaseStore, operator: SupabaseStore,
                                               lanes: DevStack) -> None:
    session, task = claimed(rest)
    with pytest.raises(LeaseLost, match="lease lost"):
        rest.complete(task.id, uuid4())
    with pytest.raises(UnknownTask):
        rest.checkpoint(10**9, uuid4(), {})
    with pytest.raises(UnknownLane):
        operator.enqueue("nope", "k")
    with pytest.raises(InvalidInput, match="priority"):
        rest.enqueue("docs", "p", priority=5000)
    with pytest.raises(InvalidInput):
        rest.enqueue("docs", "p", priority=2**40)  # past int4: PostgREST's 22003
    with pytest.raises(RouteRefused) as refused:
        rest.route(task.id, task.lease_token, "closed")
    assert refused.value.hint and "accepts routes from" in refused.value.hint
    with pytest.raises(InvalidState):
        operator.retry(task.id)  # running, not dead
    rest.close_session(session, "done", {})
    with pytest.raises(SessionLost):
        rest.heartbeat(session)
    with pytest.raises(SessionLost):
        rest.claim(uuid4())
    review_only = store(lanes, key(lanes, "worker", ["review"]))
    try:
        with pytest.raises(LaneForbidden, match="'docs' is not allowed"):
            review_only.enqueue("docs", "x")
    finally:
        review_only.close()


def test_enqueue_with_a_delay_counts_from_the_database_clock(rest: SupabaseStore, lanes: DevStack) -> None:
    task_id, created = rest.enqueue("docs", "later", delay_seconds=3600)
    assert created
    row = sql(lanes, "select run_at - now() as wait from fleet.tasks where id = %s", (task_id,))[0]
    assert timedelta(minutes=59) < row["wait"] <= timedelta(hours=1)
    when = datetime.fromisoformat("2030-01-02T03:04:05+00:00")
    task_id, _ = rest.enqueue("docs", "at", run_at=when, delay_seconds=10)  # run_at wins, as in SQL
    assert sql(lanes, "select run_at from fleet.tasks where id = %s", (task_id,))[0]["run_at"] == when


def test_named_queries_over_rest(rest: SupabaseStore, operator: SupabaseStore, lanes: DevStack) -> None:
    import socket

    started = datetime.now().astimezone()
    session = rest.open_session("docs", socket.gethostname(), 4242, started, 600, "boot-id:1234")
    rest.enqueue("docs", "demo:ab:1")
    rest.enqueue("docs", "demo:ab:2", delay_seconds=600)
    rest.enqueue("review", "demo:zz:1")
    (row,) = rest.query("active_sessions_on_host", host=socket.gethostname())
    assert row["id"] == str(session) and row["pid"] == 4242 and row["pid_identity"] == "boot-id:1234"
    assert isinstance(row["pid_started_at"], datetime)
    assert abs((row["pid_started_at"] - started).total_seconds()) < 0.001
    assert rest.query("active_sessions_on_host", host="elsewhere") == []
    assert operator.query("states_with_prefix", prefix="demo:ab:") == [{"state": "queued", "n": 2}]
    assert sorted((r["lane"], r["ready"]) for r in operator.query("ready_by_lane")) == [("docs", 1), ("review", 1)]
    summary = {r["lane"]: r for r in operator.query("lane_summary")}
    assert summary["docs"]["queued"] == 2 and summary["review"]["queued"] == 1 and summary["closed"]["queued"] == 0
    # the demo's own run: the tasks of its prefix alone, in the lanes that have any
    assert [(r["lane"], r["queued"]) for r in operator.query("summary_with_prefix", prefix="demo:ab:")] == [("docs", 2)]
    lanes_ = rest.query("list_lanes")
    assert [r["name"] for r in lanes_] == ["closed", "docs", "review"]
    assert isinstance(lanes_[0]["created_at"], datetime)
    with pytest.raises(Exception, match="no REST equivalent"):
        rest.query("lane_counts")


def test_check_schema(rest: SupabaseStore, lanes: DevStack) -> None:
    rest.check_schema()
    (last,) = sql(lanes, "select * from supabase_migrations.schema_migrations order by version desc limit 1")
    sql(lanes, "delete from supabase_migrations.schema_migrations where version = %s", (last["version"],))
    try:
        with pytest.raises(MigrationError, match="lacks 1 migration"):
            rest.check_schema()
    finally:
        sql(lanes, "insert into supabase_migrations.schema_migrations (version, statements, name)"
                   " values (%(version)s, %(statements)s, %(name)s)", last)
    rest.check_schema()


def test_check_schema_refuses_a_database_migrated_by_a_newer_lanefleet(
    rest: SupabaseStore, lanes: DevStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLEET_ALLOW_NEWER_SCHEMA", raising=False)
    sql(lanes, "insert into supabase_migrations.schema_migrations (version, statements, name) values"
               " ('20991231000000', '{}', 'fleet_from_the_future'), ('20991231000001', '{}', 'app_orders')")
    try:
        with pytest.raises(MigrationError, match="migrated by a newer lanefleet") as info:
            rest.check_schema()
        assert "20991231000000_fleet_from_the_future" in str(info.value)
        assert "app_orders" not in str(info.value)  # the project's own migrations do not count
        monkeypatch.setenv("FLEET_ALLOW_NEWER_SCHEMA", "1")
        rest.check_schema()
    finally:
        sql(lanes, "delete from supabase_migrations.schema_migrations where version >= '20991231000000'")
    monkeypatch.delenv("FLEET_ALLOW_NEWER_SCHEMA")
    rest.check_schema()


def test_runtime_picks_the_supabase_store_from_config(lanes: DevStack, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "fleet.toml"
    toml.write_text(f'[fleet]\nstore = "supabase"\n\n[supabase]\nurl = "{lanes.url}"\n\n'
                    '[lanes.docs]\ncommand = ["true"]\n')
    for name in ("DATABASE_URL", "FLEET_CONFIG", "SUPABASE_URL", "FLEET_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SUPABASE_ANON_KEY", lanes.anon_key)
    r = Runtime(toml)
    with pytest.raises(ConfigError, match=r"needs .*key"):
        r.store()
    monkeypatch.setenv("FLEET_KEY", key(lanes, "worker", ["docs"]))
    r = Runtime(toml)
    try:
        st = r.store()
        assert isinstance(st, SupabaseStore)
        assert st.enqueue("docs", "via-runtime")[1] is True
        assert r.store() is st  # made once
        assert st.max_rows == 1000  # Supabase's default Max rows
    finally:
        r.close()
    monkeypatch.setenv("FLEET_SUPABASE__MAX_ROWS", "250")  # a project whose Max rows is lower
    r = Runtime(toml)
    try:
        st = r.store()
        assert isinstance(st, SupabaseStore) and st.max_rows == 250
    finally:
        r.close()
    monkeypatch.delenv("FLEET_SUPABASE__MAX_ROWS")
    monkeypatch.delenv("SUPABASE_ANON_KEY")
    with pytest.raises(ConfigError, match="SUPABASE_ANON_KEY"):
        Runtime(toml).store()


# ------------------------------------------------------------------------------------------------
# retries, through a proxy that fails on cue


class FlakyProxy:
    """127.0.0.1:<port> → the stack's gateway; ``plan`` says what the next requests get:
    a status (answered by the proxy, never forwarded), "drop" (forwarded, then the connection is
    closed without an answer: the call ran), or "pass"."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.plan: list[int | str] = []
        self.seen: list[tuple[str, str, int | str]] = []
        self.http = httpx.Client(base_url=upstream, timeout=30)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                what: int | str = proxy.plan.pop(0) if proxy.plan else "pass"
                proxy.seen.append((self.command, self.path, what))
                if isinstance(what, int):
                    payload = b"<html>gateway trouble</html>"
                    self.send_response(what)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                resp = proxy.http.request(self.command, self.path, content=body, headers=headers)
                if what == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.send_response(resp.status_code)
                for k, v in resp.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(resp.content)))
                self.end_headers()
                self.wfile.write(resp.content)

            do_GET = do_POST = do_PATCH = do_DELETE = do_HEAD = do_any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.http.close()

    def calls(self, fn: str) -> list[int | str]:
        return [what for _, path, what in self.seen if path.startswith(f"/rest/v1/rpc/{fn}")]


@pytest.fixture
def flaky(lanes: DevStack) -> Iterator[tuple[FlakyProxy, SupabaseStore]]:
    proxy = FlakyProxy(lanes.url)
    st = SupabaseStore(proxy.url, lanes.anon_key, key(lanes, "worker", ["docs"]), attempts=4)
    yield proxy, st
    st.close()
    proxy.close()


def test_transient_failures_are_retried_and_4xx_are_not(flaky: tuple[FlakyProxy, SupabaseStore],
                                                        lanes: DevStack) -> None:
    proxy, st = flaky
    session, task = claimed(st)

    proxy.plan = [503, 502, 504]  # a heartbeat is safe to repeat: any of them
    assert st.heartbeat(session, [task.id]) == {task.id: "ok"}
    assert proxy.calls("heartbeat") == [503, 502, 504, "pass"]

    _, other = claimed(st)
    proxy.plan = [503, 429]  # refused before it ran: even complete is repeated
    proxy.seen.clear()
    assert st.complete(other.id, other.lease_token) == "done"
    assert proxy.calls("complete") == [503, 429, "pass"]

    proxy.seen.clear()
    proxy.plan = [504]  # may have run: complete is not repeated, and says so
    with pytest.raises(DatabaseUnavailable, match="may have committed"):
        st.complete(task.id, task.lease_token)
    assert proxy.calls("complete") == [504]
    assert sql(lanes, "select state from fleet.tasks where id = %s", (task.id,))[0]["state"] == "running"

    proxy.seen.clear()
    proxy.plan = ["drop"]  # it ran, the answer was lost: the shift's own retry then meets the fence
    with pytest.raises(DatabaseUnavailable, match="may have committed"):
        st.complete(task.id, task.lease_token)
    assert sql(lanes, "select state from fleet.tasks where id = %s", (task.id,))[0]["state"] == "done"
    with pytest.raises(LeaseLost):
        st.complete(task.id, task.lease_token)
    assert proxy.calls("complete") == ["drop", "pass"]

    proxy.seen.clear()
    with pytest.raises(LeaseLost):  # a 400: answered at once, never repeated
        st.checkpoint(task.id, task.lease_token, {"x": 1})
    assert proxy.calls("checkpoint") == ["pass"]
    bad = SupabaseStore(proxy.url, lanes.anon_key, "not-a-jwt")
    try:
        with pytest.raises(AccessDenied):
            bad.heartbeat(session)
    finally:
        bad.close()
    assert proxy.calls("heartbeat")[-1] == "pass" and len(proxy.calls("heartbeat")) == 1

    proxy.plan = [503] * 10  # retries are bounded
    with pytest.raises(DatabaseUnavailable, match="unreachable"):
        st.heartbeat(session)
    assert len(proxy.calls("heartbeat")) == 1 + 4


def test_an_unreachable_api_is_database_unavailable_within_the_budget(lanes: DevStack) -> None:
    port = free_port()  # nothing listens there
    st = SupabaseStore(f"http://127.0.0.1:{port}", lanes.anon_key, key(lanes, "worker", ["docs"]),
                       call_budget=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(DatabaseUnavailable, match="unreachable"):
            st.claim(uuid4(), 1)  # nothing was sent: safe to retry, until the budget runs out
        assert time.monotonic() - t0 < 3
    finally:
        st.close()
