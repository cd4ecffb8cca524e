"""Helpers for tests that call the SQL API of schema ``fleet`` directly over psycopg.

One definition of each: the calls (``enqueue``, ``open_session``, ``claim``, ``complete``, …) as a
test makes them, the reads a test checks them by (``task``, ``runs``, ``kinds``, ``world``), the
refusals (``refused`` and the LF SQLSTATEs), a key's view of the database (``as_key``: what
PostgREST does per request), concurrency (``race``, ``Call``, ``wait_until_waiting``), query plans
(``explain``, ``assert_index_only``) and the statements of a function as production runs them
(``function_body``, ``loop_queries``), and the histories several test files build.

Time-dependent behaviour is driven by setting columns directly (``run_at``, ``deadline``,
``ended_at``, ``heartbeat_at``) instead of sleeping. A running task's lease follows its session
(``fleet._lease_until`` of the session's ``heartbeat_at``): ``expire`` ages the heartbeat of the
sessions holding the tasks; writing ``tasks.lease_expires_at`` (the claim's) changes nothing.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
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
LANE_NOT_ALLOWED = "LF008"
LANE_RETIRED = "LF009"


# an index that reads only the running tasks will do where a plan reads them: the partial index
# of running tasks, or the range (lane, 'running') of tasks_live_lane; the planner picks one by
# the statistics ANALYZE sampled
RUNNING_INDEXES = {"tasks_running_session", "tasks_live_lane"}


# ------------------------------------------------------------------------------------------------
# queries and refusals


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
    """Every row as a dict ([] for a statement that returns none)."""
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, params)
        return cur.fetchall() if cur.description else []


def call(conn: psycopg.Connection, fn: str, *args: Any) -> Any:
    """``select fleet.<fn>(args…)``, a dict argument passed as jsonb; its single value."""
    marks = ", ".join(["%s"] * len(args))
    return one(conn, f"select fleet.{fn}({marks})", tuple(Jsonb(a) if isinstance(a, dict) else a for a in args))


@contextmanager
def as_key(conn: psycopg.Connection, role: str, claims: dict[str, Any] | str | None) -> Iterator[None]:
    """What PostgREST does for a request: one transaction (rolled back), SET LOCAL ROLE, the claims
    GUC (a dict as JSON, a string as it is, None: not set)."""
    with conn.transaction(force_rollback=True):
        conn.execute("select set_config('role', %s, true)", (role,))
        if claims is not None:
            text = claims if isinstance(claims, str) else json.dumps(claims)
            conn.execute("select set_config('request.jwt.claims', %s, true)", (text,))
        yield


# ------------------------------------------------------------------------------------------------
# lanes, tasks, sessions


def add_lane(conn: psycopg.Connection, name: str = "a", **kw: Any) -> str:
    """A row of fleet.lanes written directly (``config``: a dict), lease 60 s, 3 attempts, 10 hand-offs."""
    cols: dict[str, Any] = {"max_running": None, "lease_seconds": 60, "max_attempts": 3, "max_handoffs": 10}
    cols.update(kw)
    if isinstance(cols.get("config"), dict):
        cols["config"] = Jsonb(cols["config"])
    names = ", ".join(["name", *cols])
    marks = ", ".join(["%s"] * (len(cols) + 1))
    conn.execute(f"insert into fleet.lanes ({names}) values ({marks})", [name, *cols.values()])
    return name


def sync_lane(conn: psycopg.Connection, name: str = "a", **settings: Any) -> str:
    """A new lane made by fleet.sync_lane (its defaults for what ``settings`` leaves out)."""
    assert one(conn, "select fleet.sync_lane(%s, %s)", (name, Jsonb(settings))) == "created"
    return name


def enqueue(
    conn: psycopg.Connection,
    lane: str,
    key: str | None = None,
    payload: Any = None,
    priority: int | None = 0,
    run_at: Any = None,
    max_attempts: int | None = None,
    title: str | None = None,
) -> int:
    """A new task (fleet.enqueue_task): its id. Without a key, a fresh one."""
    key = key or f"k-{uuid.uuid4().hex[:10]}"
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
        (lane, key, None if payload is None else Jsonb(payload), priority, run_at, max_attempts, title),
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def fill(conn: psycopg.Connection, lane: str, n: int) -> None:
    """``n`` tasks in ``lane``, keys ``<lane>:1`` … ``<lane>:n``, in one statement."""
    conn.execute("select fleet.enqueue(%s, %s || ':' || g) from generate_series(1, %s) g", (lane, lane, n))


def open_session(
    conn: psycopg.Connection, lane: str, host: str = "host-1", pid: int = 4242, seconds: int = 600
) -> uuid.UUID:
    return one(conn, "select fleet.open_session(%s, %s, %s, now(), %s)", (lane, host, pid, seconds))


def close_session(
    conn: psycopg.Connection, session: uuid.UUID, reason: str | None = "deadline", snapshot: Any = None
) -> int:
    return one(conn, "select fleet.close_session(%s, %s, %s)",
               (session, reason, None if snapshot is None else Jsonb(snapshot)))


def claim(conn: psycopg.Connection, session: uuid.UUID, limit: int = 1) -> list[dict[str, Any]]:
    """What fleet.claim leases to the session, as task rows."""
    return rows(conn, "select * from fleet.claim(%s, %s)", (session, limit))


def claim_exactly(conn: psycopg.Connection, session: uuid.UUID, n: int = 1) -> list[dict[str, Any]]:
    got = claim(conn, session, n)
    assert len(got) == n, got
    return got


def claim_one(conn: psycopg.Connection, session: uuid.UUID) -> dict[str, Any]:
    return claim_exactly(conn, session, 1)[0]


def leases(conn: psycopg.Connection, session: uuid.UUID, limit: int = 1) -> list[tuple[int, uuid.UUID]]:
    """A claim's (task id, lease token) pairs."""
    return [(t["id"], t["lease_token"]) for t in claim(conn, session, limit)]


def take_lease(conn: psycopg.Connection, session: uuid.UUID, task_id: int) -> uuid.UUID:
    """Claim exactly this task (``take``): its lease token."""
    return uuid.UUID(str(take(conn, session, task_id)["lease_token"]))


def running_tasks(conn: psycopg.Connection, lane: str, n: int) -> tuple[uuid.UUID, list[dict[str, Any]]]:
    """n new tasks of ``lane`` (fleet.enqueue_many) claimed by one fresh session: it and them."""
    enqueue_many(conn, lane, [{"key": f"{lane}:run:{uuid.uuid4().hex[:8]}"} for _ in range(n)])
    s = open_session(conn, lane)
    return s, claim_exactly(conn, s, n)


def take(conn: psycopg.Connection, session: uuid.UUID, task_id: int) -> dict[str, Any]:
    """Claim exactly this task: it is made the first ready task of its lane for the claim."""
    conn.execute("update fleet.tasks set priority = 1000, run_at = least(run_at, now()) where id = %s",
                 (task_id,))
    got = claim_one(conn, session)
    assert got["id"] == task_id, f"claimed {got['id']}, wanted {task_id}"
    conn.execute("update fleet.tasks set priority = 0 where id = %s", (task_id,))
    return got


# ------------------------------------------------------------------------------------------------
# the calls of a lease's holder and of an operator


def heartbeat(conn: psycopg.Connection, session: uuid.UUID) -> dict[int, str]:
    """Task id → status (the session's own row, task_id NULL, left out: see session_grant)."""
    got = rows(conn, "select task_id, status from fleet.heartbeat(%s) where task_id is not null", (session,))
    out = {r["task_id"]: r["status"] for r in got}
    assert len(out) == len(got), f"a task reported twice: {got}"
    return out


def checkpoint(conn: psycopg.Connection, task_id: int, token: Any, data: Any) -> int:
    return one(conn, "select fleet.checkpoint(%s, %s, %s)", (task_id, token, None if data is None else Jsonb(data)))


def complete(conn: psycopg.Connection, task_id: int, token: Any, result: Any = None) -> str:
    return one(conn, "select fleet.complete(%s, %s, %s)",
               (task_id, token, None if result is None else Jsonb(result)))


def fail(conn: psycopg.Connection, task_id: int, token: Any, error: str = "boom", retryable: bool = True) -> str:
    return one(conn, "select fleet.fail(%s, %s, %s, %s)", (task_id, token, error, retryable))


def hand_off(conn: psycopg.Connection, task_id: int, token: Any, snapshot: Any = None) -> str:
    return one(conn, "select fleet.hand_off(%s, %s, %s)",
               (task_id, token, None if snapshot is None else Jsonb(snapshot)))


def route(conn: psycopg.Connection, task_id: int, token: Any, lane: str | None, note: Any = None) -> str:
    return one(conn, "select fleet.route(%s, %s, %s, %s)", (task_id, token, lane, None if note is None else Jsonb(note)))


def throttle(conn: psycopg.Connection, task_id: int, token: Any, until: Any = None, note: str | None = None,
             after_seconds: float | None = None, signal: Any = None) -> datetime:
    """fleet.throttle: the reset it answers."""
    return one(conn, "select fleet.throttle(%s, %s, %s, %s, %s, %s)",
               (task_id, token, until, note, after_seconds, None if signal is None else Jsonb(signal)))


def transient(conn: psycopg.Connection, task_id: int, token: Any, error: str = "overloaded",
              after_seconds: float | None = None) -> str:
    return one(conn, "select fleet.transient(%s, %s, %s, %s)", (task_id, token, error, after_seconds))


def drop_session(conn: psycopg.Connection, task_id: int, token: Any, note: str | None = "no such session") -> str:
    return one(conn, "select fleet.drop_session(%s, %s, %s)", (task_id, token, note))


def record_run(conn: psycopg.Connection, token: Any, report: Any) -> None:
    conn.execute("select fleet.record_run(%s, %s)", (token, None if report is None else Jsonb(report)))


def enqueue_many(conn: psycopg.Connection, lane: str | None, tasks: Any) -> list[dict[str, Any]]:
    return rows(conn, "select * from fleet.enqueue_many(%s, %s)", (lane, None if tasks is None else Jsonb(tasks)))


def complete_many(conn: psycopg.Connection, tasks: Any, tokens: Any, results: Any = None) -> list[tuple[int, str]]:
    got = rows(conn, "select * from fleet.complete_many(%s::bigint[], %s::uuid[], %s::jsonb[])",
               (tasks, tokens, None if results is None else [None if r is None else Jsonb(r) for r in results]))
    return [(r["task_id"], r["status"]) for r in got]


def cancel(conn: psycopg.Connection, task_id: int) -> str:
    return one(conn, "select fleet.cancel(%s)", (task_id,))


def retry(conn: psycopg.Connection, task_id: int) -> str:
    return one(conn, "select fleet.retry(%s)", (task_id,))


def release(conn: psycopg.Connection, task_id: int, reason: str = "test") -> str | None:
    """The repair the monitor and close_session make (fleet._release): the task's new state."""
    return one(conn, "select fleet._release(%s, %s)", (task_id, reason))


def reconcile(conn: psycopg.Connection, idle: int = 300, grace: int = 60) -> list[dict[str, Any]]:
    return rows(conn, "select * from fleet.reconcile(%s, %s)", (idle, grace))


def expire(conn: psycopg.Connection, *task_ids: int, ago: str = "1 second") -> None:
    """The sessions holding these tasks went silent: their last heartbeat is a lease plus ``ago``
    ago; every task of such a session expires with it (a task's lease follows its session,
    fleet._lease_until: tasks.lease_expires_at, the claim's, is not what runs out). On a lane whose
    session timeout is the lease (the default), the monitor's pass then finds the session lost
    (heartbeat-timeout); only on a lane whose session timeout is longer does it release the tasks
    one by one as lease-expired."""
    held = rows(conn, "select id from fleet.tasks where id = any(%s) and state = 'running'", (list(task_ids),))
    assert len(held) == len(set(task_ids)), f"not all of {task_ids} are running"
    conn.execute("""
        update fleet.sessions s
           set heartbeat_at = now() - make_interval(secs => l.lease_seconds) - %s::interval
          from fleet.lanes l
         where l.name = s.lane
           and s.id in (select t.session_id from fleet.tasks t where t.id = any(%s))""",
                 (ago, list(task_ids)))


def lease_left(conn: psycopg.Connection, task_id: int) -> float:
    """Seconds task_id's lease still holds (negative: it ran out), by the rule every reader shares:
    fleet._lease_until of its session's last heartbeat."""
    return float(one(conn, """
        select extract(epoch from fleet._lease_until(s.heartbeat_at, l.lease_seconds, l.session_timeout_seconds)
                                  - now())
          from fleet.tasks t join fleet.sessions s on s.id = t.session_id join fleet.lanes l on l.name = t.lane
         where t.id = %s""", (task_id,)))


def roll_up(conn: psycopg.Connection) -> int:
    return int(one(conn, "select fleet.roll_up_lane_hours(0)"))


# ------------------------------------------------------------------------------------------------
# reading what the calls did


def task(conn: psycopg.Connection, task_id: int) -> dict[str, Any]:
    got = rows(conn, "select * from fleet.tasks where id = %s", (task_id,))
    assert len(got) == 1
    return got[0]


def runs(conn: psycopg.Connection, task_id: int) -> list[dict[str, Any]]:
    return rows(conn, "select * from fleet.runs where task_id = %s order by id", (task_id,))


def session_row(conn: psycopg.Connection, session: uuid.UUID) -> dict[str, Any]:
    return rows(conn, "select * from fleet.sessions where id = %s", (session,))[0]


def kinds(conn: psycopg.Connection, task_id: int) -> list[str]:
    """The kinds of a task's journal entries, oldest first."""
    return [r["kind"] for r in rows(conn, "select kind from fleet.journal where task_id = %s order by id", (task_id,))]


def last_event(conn: psycopg.Connection, task_id: int) -> dict[str, Any]:
    got = rows(conn, "select * from fleet.journal where task_id = %s order by id desc limit 1", (task_id,))
    assert got
    return got[0]


def events(conn: psycopg.Connection, kind: str, lane: str | None = None) -> list[dict[str, Any]]:
    return rows(conn, "select * from fleet.journal where kind = %s and (%s::text is null or lane = %s) order by id",
                (kind, lane, lane))


def repaired_events(conn: psycopg.Connection, task_id: int) -> list[dict[str, Any]]:
    return rows(conn, "select * from fleet.journal where kind = 'repaired' and task_id = %s order by id", (task_id,))


def count(conn: psycopg.Connection, table: str) -> int:
    return one(conn, f"select count(*) from fleet.{table}")


def running(conn: psycopg.Connection, lane: str) -> int:
    """How many tasks of ``lane`` run now."""
    return int(one(conn, "select count(*) from fleet.tasks where lane = %s and state = 'running'", (lane,)))


def seconds_between(conn: psycopg.Connection, task_id: int, later: str, earlier: str) -> float:
    """Seconds from one timestamp column of a task to another (both set by one transaction's now())."""
    return float(one(conn, f"select extract(epoch from {later} - {earlier}) from fleet.tasks where id = %s",
                     (task_id,)))


def world(conn: psycopg.Connection) -> dict[str, Any]:
    """Everything the API can change, to compare before and after a refused call."""
    return {
        table: one(conn, f"select coalesce(jsonb_agg(to_jsonb(x) order by x.id), '[]') from fleet.{table} x")
        for table in ("tasks", "runs", "events", "sessions", "lane_handoffs")
    } | {"lanes": one(conn, "select jsonb_agg(to_jsonb(l) order by l.name) from fleet.lanes l")}


def assert_fenced(conn: psycopg.Connection, task_id: int, token: uuid.UUID) -> None:
    """The token no longer holds the task: complete and checkpoint say "lease lost"."""
    with refused(LEASE_LOST):
        conn.execute("select fleet.complete(%s, %s, null)", (task_id, token))
    with refused(LEASE_LOST):
        conn.execute("select fleet.checkpoint(%s, %s, '{}')", (task_id, token))


def set_run(conn: psycopg.Connection, token: Any, started: str | None = None, ended: str | None = None) -> None:
    """Move a run's start and end (SQL expressions, e.g. ``now() - interval '1 hour'``)."""
    if started:
        conn.execute(f"update fleet.runs set started_at = {started} where lease_token = %s", (token,))
    if ended:
        conn.execute(f"update fleet.runs set ended_at = {ended} where lease_token = %s", (token,))


def view(conn: psycopg.Connection, name: str, where: str = "true", params: Any = None) -> list[dict[str, Any]]:
    return rows(conn, f"select * from fleet.{name} where {where}", params)


def pick(row: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: row[k] for k in keys}


def utc_hour(conn: psycopg.Connection, offset_hours: int) -> datetime:
    """The start of the UTC hour ``offset_hours`` from the current one (the database's clock)."""
    return one(conn, "select date_trunc('hour', now(), 'UTC') + make_interval(hours => %s)", (offset_hours,))


# ------------------------------------------------------------------------------------------------
# concurrency


def race(db_url: str, n: int, work: Callable[[psycopg.Connection, int], Any]) -> list[Any]:
    """Run work(conn, i) in n threads at once, each with its own connection; results or errors."""
    barrier = threading.Barrier(n)
    out: list[Any] = [None] * n

    def run(i: int) -> None:
        with psycopg.connect(db_url, autocommit=True) as c:
            barrier.wait(timeout=30)
            try:
                out[i] = work(c, i)
            except psycopg.Error as exc:
                out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def wait_until_waiting(watch: psycopg.Connection, pid: int, timeout: float = 20.0) -> str:
    """The lock the backend ``pid`` waits for (its wait_event), once it waits for one: read from the
    server's own record, never guessed from a sleep."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = watch.execute("select wait_event_type, wait_event from pg_stat_activity where pid = %s",
                            (pid,)).fetchone()
        if row is not None and row[0] == "Lock":
            return str(row[1])
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} never waited for a lock")


class Call(threading.Thread):
    """A statement run on its own connection in a thread, so the test can watch it wait."""

    def __init__(self, conn: psycopg.Connection, fn: Callable[[psycopg.Connection], Any]) -> None:
        super().__init__(daemon=True)
        self.conn, self.fn = conn, fn
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(self.conn)
        except BaseException as exc:  # surfaced by outcome()
            self.error = exc

    def outcome(self, timeout: float = 30.0) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "the call never returned"
        if self.error is not None:
            raise self.error
        return self.result


# ------------------------------------------------------------------------------------------------
# query plans, and the statements a function runs


def function_body(conn: psycopg.Connection, signature: str) -> str:
    """The body of a function as the database runs it (what its source in migrations/sources made)."""
    return str(one(conn, "select prosrc from pg_proc where oid = %s::regprocedure", (signature,)))


def loop_queries(body: str) -> list[str]:
    """The queries of a PL/pgSQL body's ``for <var> in <query> loop`` statements, in order
    (comments dropped)."""
    text = re.sub(r"--[^\n]*", "", body)
    return [q.strip() for q in re.findall(r"\bfor\s+\w+\s+in\s+(select\b.*?)\s+loop\b", text, re.S | re.I)]


def parenthesised_after(body: str, marker: str) -> str:
    """The text inside the parentheses that open right after ``marker`` in a function body (e.g. a
    CTE: ``parenthesised_after(body, "ready as")``), comments dropped."""
    text = re.sub(r"--[^\n]*", "", body)
    m = re.search(re.escape(marker) + r"\s*\(", text)
    assert m is not None, f"{marker!r} not in the body"
    depth, start = 1, m.end()
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    raise AssertionError(f"the parentheses after {marker!r} do not close")


def bind(query: str, values: dict[str, str]) -> str:
    """A PL/pgSQL statement made runnable on its own: each variable (a whole word, e.g. ``s.lane``
    or ``p_idle_seconds``) replaced by an SQL literal."""
    for name, literal in values.items():
        query, n = re.subn(rf"(?<![\w.]){re.escape(name)}(?![\w])", literal, query)
        assert n, f"{name} is not in {query}"
    return query


def plan_nodes(plan: Any) -> list[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) document or plan."""
    out: list[dict[str, Any]] = []
    stack = [plan]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if "Node Type" in node:
                out.append(node)
            stack.extend(v for v in node.values() if isinstance(v, list | dict))
    return out


def explain(conn: psycopg.Connection, query: str, params: Any = None) -> list[dict[str, Any]]:
    (doc,) = conn.execute("explain (format json) " + query, params).fetchone()  # type: ignore[misc]
    return plan_nodes(doc)


def scans_of(nodes: list[dict[str, Any]], table: str) -> list[tuple[str, str | None]]:
    """(node type, index name) of every scan of ``table``; a bitmap heap scan counts once per
    bitmap index scan under it."""
    out: list[tuple[str, str | None]] = []
    for n in nodes:
        if n.get("Relation Name") != table:
            continue
        if n["Node Type"] == "Bitmap Heap Scan":
            below = [m for m in plan_nodes(n.get("Plans", [])) if m["Node Type"] == "Bitmap Index Scan"]
            out += [(n["Node Type"], m.get("Index Name")) for m in below] or [(n["Node Type"], None)]
        else:
            out.append((n["Node Type"], n.get("Index Name")))
    return out


def assert_index_only(conn: psycopg.Connection, query: str, table: str, allowed: set[str],
                      params: Any = None) -> None:
    """Every scan of fleet.``table`` in the plan of ``query`` goes through one of ``allowed``."""
    scans = scans_of(explain(conn, query, params), table)
    assert scans, f"no scan of {table} in the plan of {query}"
    for node_type, index in scans:
        assert node_type != "Seq Scan", f"{query}\nseq scan of fleet.{table}: {scans}"
        assert index in allowed, f"{query}\nscans fleet.{table} through {index}, not one of {allowed}"


def generic_plans(conn: psycopg.Connection, call: Callable[[], Any]) -> list[str]:
    """The plan of every statement run inside the functions ``call`` calls, as the plan cache keeps
    them for later calls: generic plans (made for any parameter values, forced here), logged by
    auto_explain with its nested statements. Each is its query text and its plan."""
    notices: list[str] = []

    def keep(d: psycopg.errors.Diagnostic) -> None:
        notices.append(d.message_primary or "")

    conn.add_notice_handler(keep)
    try:
        for setting in ("load 'auto_explain'", "set auto_explain.log_min_duration = 0",
                        "set auto_explain.log_nested_statements = on", "set plan_cache_mode = force_generic_plan",
                        "set client_min_messages = log"):
            conn.execute(setting)
        call()
    finally:
        conn.execute("set client_min_messages = notice")
        conn.execute("reset plan_cache_mode")
        conn.remove_notice_handler(keep)
    return [n for n in notices if n.startswith("duration:")]


# ------------------------------------------------------------------------------------------------
# histories that several test files read


def build_long_history(conn: psycopg.Connection) -> None:
    """A database with a long history (50,000 done tasks, 5,000 ended sessions, 20,000 events)
    and a little active work: 4 lanes, 6 running tasks, 4 ready ones, 2 active sessions."""
    for name in ("a", "b", "c", "d"):
        sync_lane(conn, name, lease_seconds=60, max_attempts=3, backoff_base_seconds=0, max_running=8)
    conn.execute("""
        insert into fleet.sessions (lane, host, pid, started_at, heartbeat_at, deadline, ended_at,
                                    end_reason, state)
        select (array['a','b','c','d'])[1 + g % 4], 'old-host', 1000 + g,
               now() - make_interval(hours => g % 5000), now() - make_interval(hours => g % 5000),
               now() - make_interval(hours => g % 5000), now() - make_interval(hours => g % 5000),
               'deadline', case when g % 10 = 0 then 'lost' else 'ended' end
          from generate_series(1, 5000) g""")
    conn.execute("""
        insert into fleet.tasks (lane, key, state, attempts, created_at, updated_at, finished_at)
        select (array['a','b','c','d'])[1 + g % 4], 'old:' || g, 'done', 1,
               now() - make_interval(mins => g), now() - make_interval(mins => g),
               now() - make_interval(mins => g)
          from generate_series(1, 50000) g""")
    conn.execute("""
        insert into fleet.events (ts, kind, lane, task_id, session_id, detail)
        select now() - make_interval(mins => g), (array['completed','claimed','repaired','idle_capacity'])[1 + g % 4],
               (array['a','b','c','d'])[1 + g % 4], g, null, '{}'
          from generate_series(1, 20000) g""")
    for name in ("a", "b"):
        for _ in range(5):
            enqueue(conn, name)
        claim_exactly(conn, open_session(conn, name, host="h1"), 3)
    conn.execute("analyze")


def build_throughput_history(conn: psycopg.Connection) -> dict[str, Any]:
    """Two lanes, two hours H and H+1 (H = three hours ago), every kind of outcome."""
    sync_lane(conn, "a", max_attempts=3, backoff_base_seconds=0, accepts_from=None)
    sync_lane(conn, "b")
    h = utc_hour(conn, -3)

    def at(minutes: float) -> str:
        return f"'{(h + timedelta(minutes=minutes)).isoformat()}'::timestamptz"

    def created(task_id: int, minutes: float) -> None:
        conn.execute(f"update fleet.tasks set created_at = {at(minutes)} where id = %s", (task_id,))

    s = open_session(conn, "a")
    s2 = open_session(conn, "a")
    sb = open_session(conn, "b")
    # t1: one run, 10 min: done in H
    t1 = enqueue(conn, "a", "t1")
    created(t1, 5)
    tok = take(conn, s, t1)["lease_token"]
    complete(conn, t1, tok)
    set_run(conn, tok, at(10), at(20))
    # t2: failed at H+1m..2m, then done H+30m .. H+70m: stage wall-clock 69 min, done in H+1
    t2 = enqueue(conn, "a", "t2")
    created(t2, 0)
    tok1 = take(conn, s, t2)["lease_token"]
    fail(conn, t2, tok1)
    tok2 = take(conn, s, t2)["lease_token"]
    complete(conn, t2, tok2)
    set_run(conn, tok1, at(1), at(2))
    set_run(conn, tok2, at(30), at(70))
    # t3: handed off H+5m..15m, then done by the next shift H+20m..40m: 35 min, done in H
    t3 = enqueue(conn, "a", "t3")
    created(t3, 4)
    tok1 = take(conn, s, t3)["lease_token"]
    hand_off(conn, t3, tok1, {})
    tok2 = take(conn, s2, t3)["lease_token"]
    complete(conn, t3, tok2)
    set_run(conn, tok1, at(5), at(15))
    set_run(conn, tok2, at(20), at(40))
    # t4: claimed H+50m, repaired H+55m
    t4 = enqueue(conn, "a", "t4")
    created(t4, 49)
    tok = take(conn, s, t4)["lease_token"]
    release(conn, t4, "lease-expired")
    set_run(conn, tok, at(50), at(55))
    # t5: a routes it to b H+3m..13m (10 min), b does it H+60m..90m (30 min)
    t5 = enqueue(conn, "a", "t5")
    created(t5, 2)
    tok1 = take(conn, s, t5)["lease_token"]
    route(conn, t5, tok1, "b", {"why": "review"})
    tok2 = take(conn, sb, t5)["lease_token"]
    complete(conn, t5, tok2)
    set_run(conn, tok1, at(3), at(13))
    set_run(conn, tok2, at(60), at(90))
    conn.execute(f"update fleet.events set ts = {at(13)} where task_id = %s and kind = 'routed'", (t5,))
    # t6: claimed H+105m, still running
    t6 = enqueue(conn, "a", "t6")
    created(t6, 100)
    tok = take(conn, s, t6)["lease_token"]
    set_run(conn, tok, at(105))
    # t7: claimed H+100m, cancelled while running H+110m
    t7 = enqueue(conn, "a", "t7")
    created(t7, 100)
    tok = take(conn, s, t7)["lease_token"]
    cancel(conn, t7)
    set_run(conn, tok, at(100), at(110))
    # t8: 31 days ago: out of the window
    t8 = enqueue(conn, "a", "t8")
    tok = take(conn, s, t8)["lease_token"]
    complete(conn, t8, tok)
    conn.execute("update fleet.tasks set created_at = now() - interval '31 days' where id = %s", (t8,))
    set_run(conn, tok, "now() - interval '31 days'", "now() - interval '31 days' + interval '1 minute'")
    return {"h": h, "h1": h + timedelta(hours=1)}


def member_usage(tokens: int, cost: float = 0.01, **extra: Any) -> dict[str, Any]:
    """A batch member's agent report: ``tokens`` input, 10× that cache-read, 1 cache-creation, 2 output."""
    return {"input_tokens": tokens, "cache_creation_tokens": 1, "cache_read_tokens": 10 * tokens,
            "output_tokens": 2, "cost_usd": cost, "model": "m-test", "agent_session": f"s-{tokens}", **extra}


def build_batch_history(conn: psycopg.Connection) -> dict[str, Any]:
    """Two unbatched tasks (one blocked and resumed on the way) and a batch of three: b1 lands, b2 is
    evicted by its gate and then done as an ordinary task, b3 is evicted because its agent failed and
    waits in the queue. The batch ships once."""
    sync_lane(conn, "code", backoff_base_seconds=0, max_attempts=5)
    s = open_session(conn, "code")
    ids = {k: enqueue(conn, "code", k) for k in ("u1", "u2", "b1", "b2", "b3")}

    def first(task_id: int) -> uuid.UUID:
        return take_lease(conn, s, task_id)

    tok = first(ids["u1"])
    record_run(conn, tok, member_usage(100))
    complete(conn, ids["u1"], tok)
    tok = first(ids["u2"])
    record_run(conn, tok, member_usage(50))
    call(conn, "block", ids["u2"], tok, "automation-broken", "the gate crashed")
    assert call(conn, "resume", ids["u2"]) in ("queued", "resumed")
    tok = first(ids["u2"])
    record_run(conn, tok, member_usage(60))
    complete(conn, ids["u2"], tok)

    batch = call(conn, "batch_create", "code", ["b1", "b2", "b3"], 4, None)
    carrier = one(conn, "select task_id from fleet.batches where id = %s", (batch,))
    ctok = first(carrier)
    call(conn, "batch_setup", carrier, ctok, "main", f"batch/{batch}")
    call(conn, "batch_member_start", carrier, ctok, 1, f"batch/{batch}-m1-b1", "/w/m1", "c0")
    call(conn, "batch_member_gate", carrier, ctok, 1, "pending", None, member_usage(200, exit_code=0))
    call(conn, "batch_member_gate", carrier, ctok, 1, "ok", None, None)
    assert call(conn, "batch_member_landed", carrier, ctok, 1, "c0", "c1", "ok") == "landed"
    call(conn, "batch_member_start", carrier, ctok, 2, f"batch/{batch}-m2-b2", "/w/m2", "c1")
    call(conn, "batch_member_gate", carrier, ctok, 2, "pending", None, member_usage(300, exit_code=0))
    assert call(conn, "batch_member_evicted", carrier, ctok, 2, "FAILED test_x", "task-failed", None) == "queued"
    call(conn, "batch_member_start", carrier, ctok, 3, f"batch/{batch}-m3-b3", "/w/m3", "c1")
    assert call(conn, "batch_member_evicted", carrier, ctok, 3, "the agent exited 1", "task-failed",
                member_usage(400, exit_code=1)) == "queued"
    call(conn, "batch_tail", carrier, ctok, "ship", {"exit_code": 0})
    assert call(conn, "batch_finish", carrier, ctok, {}) == "done"

    tok = first(ids["b2"])  # the evicted b2, now an ordinary task
    record_run(conn, tok, member_usage(70))
    complete(conn, ids["b2"], tok)
    return {"ids": ids, "batch": batch, "carrier": carrier, "session": s}
