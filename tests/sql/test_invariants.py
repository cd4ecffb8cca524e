"""The SQL API as a whole (every group at once), over psycopg against a real PostgreSQL: every
transition of one task's life writes its journal entry, a refused call writes none, and a
hypothesis property test over random sequences of API calls keeps the invariants of the state.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb
from sqlkit import (
    add_lane,
    cancel,
    checkpoint,
    claim_one,
    close_session,
    complete,
    count,
    enqueue,
    expire,
    fail,
    hand_off,
    kinds,
    open_session,
    release,
    retry,
    route,
    rows,
)

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
            conn, "select lane from fleet.journal where task_id = %s order by id", (task_id,)
        )
    ]
    assert lanes == ["a"] * 8 + ["b"] * 7
    close_session(conn, session)
    session_kinds = [
        r["kind"]
        for r in rows(
            conn,
            "select kind from fleet.journal where task_id is null and session_id = %s order by id",
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
# property test: random operation sequences keep the invariants


INVARIANTS: dict[str, str] = {
    "running count within max_running": """
        select l.name, count(t.id) from fleet.lanes l
          join fleet.tasks t on t.lane = l.name and t.state = 'running'
         where l.max_running is not null
         group by l.name, l.max_running having count(t.id) > l.max_running""",
    "running iff leased": """
        select id from fleet.tasks
         where (state = 'running') <> (lease_token is not null and lease_expires_at is not null
                                       and session_id is not null)""",
    "a running task's session is active": """
        select t.id from fleet.tasks t join fleet.sessions s on s.id = t.session_id
         where t.state = 'running' and s.state <> 'active'""",
    "attempts (over all stages) equal run rows": """
        select t.id from fleet.tasks t
         where t.attempts + coalesce((select sum((s ->> 'attempts')::int)
                                        from jsonb_array_elements(t.stages) s), 0)
               <> (select count(*) from fleet.runs r where r.task_id = t.id)""",
    "one open run per running task, holding its token": """
        select t.id from fleet.tasks t
         where (select count(*) from fleet.runs r where r.task_id = t.id and r.ended_at is null)
               <> (case when t.state = 'running' then 1 else 0 end)
            or (t.state = 'running' and not exists (
                   select 1 from fleet.runs r where r.task_id = t.id and r.ended_at is null
                      and r.lease_token = t.lease_token))""",
    "a claimed event per run": """
        select t.id from fleet.tasks t
         where (select count(*) from fleet.journal e where e.task_id = t.id and e.kind = 'claimed')
               <> (select count(*) from fleet.runs r where r.task_id = t.id)""",
    "live tasks are under their caps": """
        select t.id from fleet.tasks t join fleet.lanes l on l.name = t.lane
         where t.state in ('queued', 'running')
           and (t.failures + t.evaporations >= coalesce(t.max_attempts, l.max_attempts)
                or t.handoffs > l.max_handoffs)""",
    "dead tasks say why": """
        select id from fleet.tasks
         where (state = 'dead') <> (dead_reason is not null)
            or dead_reason not in ('attempt-cap', 'fatal', 'handoff-cap')""",
    "finished iff finished_at": """
        select id from fleet.tasks
         where (state in ('done', 'dead', 'cancelled')) <> (finished_at is not null)""",
    "carry_over only on a queued task carried over from a run (a hand-off, a repair, a throttle)": """
        select id from fleet.tasks t where carry_over
           and (state <> 'queued' or not exists (select 1 from fleet.runs r where r.task_id = t.id))""",
}


OPS = [
    "enqueue",
    "open_session",
    "claim",
    "complete",
    "fail",
    "fail_fatal",
    "hand_off",
    "route",
    "checkpoint",
    "cancel",
    "retry",
    "release",
    "heartbeat",
    "close_session",
    "ready",
    "stale_token",
    "expire_lease",
    "go_silent",
    "reconcile",
]


LANES = {
    # name: (max_running, max_attempts, max_handoffs, accepts_from, session_timeout_seconds); the
    # lease is 60 s. The sessions of lanes a and c may be declared lost only after more silence
    # than that: a session silent for its lease alone (expire_lease) loses its tasks by the
    # lease-expired path there, by the heartbeat-timeout path in lane b (its timeout: the lease)
    "a": (2, 2, 1, None, 120),
    "b": (1, 3, 2, ["a"], None),
    "c": (None, 1, 0, ["b"], 90),
}


def _check_invariants(conn: psycopg.Connection, after: list[tuple[str, int, int]]) -> None:
    for name, query in INVARIANTS.items():
        bad = conn.execute(query).fetchall()
        assert not bad, f"invariant {name!r} broken by {bad} after {after}"


def _apply(conn: psycopg.Connection, op: str, a: int, b: int, tokens: list[Any]) -> None:
    """One API call chosen by op, its targets picked from the database by a and b."""

    def pick(query: str, params: Any = None) -> Any:
        found = conn.execute(query, params).fetchall()
        return found[a % len(found)] if found else None

    lanes = sorted(LANES)
    if op == "enqueue":
        conn.execute(
            "select fleet.enqueue(%s, %s, '{}', %s)",
            (
                lanes[a % len(lanes)],
                f"k{conn.execute('select count(*) from fleet.tasks').fetchone()[0]}",  # type: ignore[index]
                b % 3,
            ),
        )
    elif op == "open_session":
        open_session(conn, lanes[a % len(lanes)], f"h{b}", 1 + b)
    elif op == "claim":
        s = pick("select id from fleet.sessions where state = 'active' order by started_at, id")
        if s:
            for row in conn.execute(
                "select lease_token from fleet.claim(%s, %s)", (s[0], 1 + b % 3)
            ):
                tokens.append(row[0])
    elif op in {"complete", "fail", "fail_fatal", "hand_off", "route", "checkpoint"}:
        t = pick(
            "select id, lease_token, lane from fleet.tasks where state = 'running' order by id"
        )
        if t is None:
            return
        task_id, token, lane = t
        if op == "complete":
            conn.execute("select fleet.complete(%s, %s)", (task_id, token))
        elif op == "fail":
            conn.execute("select fleet.fail(%s, %s, 'e', true)", (task_id, token))
        elif op == "fail_fatal":
            conn.execute("select fleet.fail(%s, %s, 'e', false)", (task_id, token))
        elif op == "hand_off":
            conn.execute(
                "select fleet.hand_off(%s, %s, %s)",
                (task_id, token, Jsonb({"agent_session": f"s{b}"})),
            )
        elif op == "checkpoint":
            conn.execute("select fleet.checkpoint(%s, %s, %s)", (task_id, token, Jsonb({"b": b})))
        else:
            target = lanes[b % len(lanes)]
            accepts = LANES[target][3]
            try:
                conn.execute("select fleet.route(%s, %s, %s)", (task_id, token, target))
            except psycopg.Error as exc:
                expected = "LF005" if target == lane else "LF007"
                assert exc.sqlstate == expected, exc
                assert target == lane or (accepts is not None and lane not in accepts)
            else:
                assert target != lane and (accepts is None or lane in accepts)
    elif op in {"cancel", "retry"}:
        t = pick("select id, state from fleet.tasks order by id")
        if t is None:
            return
        allowed = {"queued", "running", "cancelled"} if op == "cancel" else {"dead", "cancelled"}
        try:
            conn.execute(f"select fleet.{op}(%s)", (t[0],))
        except psycopg.Error as exc:
            assert exc.sqlstate == "LF004" and t[1] not in allowed, (op, t, exc)
        else:
            assert t[1] in allowed, (op, t)
    elif op == "release":
        t = pick("select id from fleet.tasks where state = 'running' order by id")
        if t:
            assert conn.execute("select fleet._release(%s, 'test')", (t[0],)).fetchone()[0] in {  # type: ignore[index]
                "queued",
                "dead",
            }
    elif op == "heartbeat":
        s = pick("select id from fleet.sessions where state = 'active' order by started_at, id")
        if s:
            got = conn.execute(
                "select task_id, status from fleet.heartbeat(%s)", (s[0],)
            ).fetchall()
            assert got[0] == (None, "session"), got
            held = {
                r[0]
                for r in conn.execute(
                    "select id from fleet.tasks where session_id = %s and state = 'running'",
                    (s[0],),
                )
            }
            assert {tid for tid, status in got if status == "ok"} == held
    elif op == "close_session":
        s = pick("select id from fleet.sessions order by started_at, id")
        if s:
            conn.execute("select fleet.close_session(%s, 'test', null)", (s[0],))
            assert conn.execute(
                "select count(*) from fleet.tasks where session_id = %s", (s[0],)
            ).fetchone() == (0,)
    elif op == "ready":
        conn.execute(
            "update fleet.tasks set run_at = now() where state = 'queued' and run_at > now()"
        )
    elif op == "expire_lease":
        t = pick("select id from fleet.tasks where state = 'running' order by id")
        if t:
            expire(conn, t[0])  # its session silent for a lease: every task of it expires
    elif op == "go_silent":
        s = pick("select id from fleet.sessions where state = 'active' order by started_at, id")
        if s:
            conn.execute(
                "update fleet.sessions set heartbeat_at = now() - interval '1 day' where id = %s",
                (s[0],),
            )
    elif op == "reconcile":
        conn.execute("select * from fleet.reconcile()").fetchall()
        assert conn.execute(
            "select count(*) from fleet.tasks t join fleet.sessions s on s.id = t.session_id"
            "  join fleet.lanes l on l.name = t.lane"
            " where t.state = 'running'"
            "   and fleet._lease_until(s.heartbeat_at, l.lease_seconds, l.session_timeout_seconds) < now()"
        ).fetchone() == (0,), "an expired lease survived a monitor pass"
        assert conn.execute(
            "select count(*) from fleet.sessions where state = 'active' "
            "and heartbeat_at < now() - interval '1 hour'"
        ).fetchone() == (0,), "a silent session survived a monitor pass"
    elif op == "stale_token":
        live = {
            r[0]
            for r in conn.execute("select lease_token from fleet.tasks where state = 'running'")
        }
        stale = [tok for tok in tokens if tok not in live]
        t = pick("select id from fleet.tasks order by id")
        if not stale or t is None:
            return
        before = conn.execute(
            "select jsonb_agg(to_jsonb(x) order by id) from fleet.tasks x"
        ).fetchone()
        with pytest.raises(psycopg.Error) as info:
            conn.execute("select fleet.complete(%s, %s)", (t[0], stale[b % len(stale)]))
        assert info.value.sqlstate == "LF001"
        after = conn.execute(
            "select jsonb_agg(to_jsonb(x) order by id) from fleet.tasks x"
        ).fetchone()
        assert before == after


# claims are what everything else needs, so they come up three times as often
_WEIGHTED_OPS = [*OPS, "claim", "claim"]


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    st.lists(
        st.tuples(st.sampled_from(_WEIGHTED_OPS), st.integers(0, 20), st.integers(0, 20)),
        min_size=10,
        max_size=60,
    )
)
def test_random_operation_sequences_keep_the_invariants(
    conn: psycopg.Connection, steps: list[tuple[str, int, int]]
) -> None:
    conn.execute(
        "truncate fleet.events, fleet.lane_handoffs, fleet.runs, fleet.tasks, fleet.sessions, "
        "fleet.lanes restart identity cascade"
    )
    for name, (max_running, max_attempts, max_handoffs, accepts_from, timeout) in LANES.items():
        conn.execute(
            "insert into fleet.lanes (name, max_running, max_attempts, max_handoffs, accepts_from, "
            "backoff_base_seconds, lease_seconds, session_timeout_seconds) values (%s, %s, %s, %s, %s, 5, 60, %s)",
            (name, max_running, max_attempts, max_handoffs, accepts_from, timeout),
        )
    # a fixed prologue, so that the random steps act on something: work and a shift in every lane
    for i, name in enumerate(sorted(LANES) * 2):
        conn.execute("select fleet.enqueue(%s, %s, '{}', %s)", (name, f"seed{i}", i % 3))
    for i, name in enumerate(sorted(LANES)):
        open_session(conn, name, f"seed-host-{i}", 100 + i)
    _check_invariants(conn, [])
    tokens: list[Any] = []
    done: list[tuple[str, int, int]] = []
    for op, a, b in steps:
        done.append((op, a, b))
        _apply(conn, op, a, b, tokens)
        _check_invariants(conn, done)


def test_invariant_queries_can_fail(conn: psycopg.Connection) -> None:
    """The invariants above are not vacuous: a state that breaks them is reported."""
    conn.execute("insert into fleet.lanes (name, max_running) values ('a', 1)")
    conn.execute("select fleet.enqueue('a', 'k' || g) from generate_series(1, 2) g")
    sid = open_session(conn, "a", "h", 1)
    conn.execute("select fleet.claim(%s, 1)", (sid,))
    conn.execute("update fleet.lanes set max_running = null")
    conn.execute("select fleet.claim(%s, 1)", (sid,))
    conn.execute("update fleet.lanes set max_running = 1")
    conn.execute("update fleet.tasks set attempts = 5 where id = 1")
    with pytest.raises(AssertionError, match="running count within max_running"):
        _check_invariants(conn, [])
    conn.execute("update fleet.lanes set max_running = 2")
    with pytest.raises(AssertionError, match="attempts"):
        _check_invariants(conn, [])
