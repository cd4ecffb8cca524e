"""Claims under concurrency, and invariants under random operation sequences.

The acceptance criterion: 8 claimers, each a thread with its own connection and its own session,
drain 1,000 tasks from a lane with max_running 5 while a watcher polls the running count; the
count never exceeds the slots, and no task is claimed twice. Then a few races that must have
exactly one winner, and a hypothesis property test over random sequences of API calls.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

LANE = "conc"
SLOTS = 5
TASKS = 1000
CLAIMERS = 8


def _open_session(conn: psycopg.Connection, lane: str, host: str, pid: int) -> uuid.UUID:
    row = conn.execute(
        "select fleet.open_session(%s, %s, %s, now(), 3600)", (lane, host, pid)
    ).fetchone()
    assert row is not None
    return row[0]


def test_eight_claimers_never_exceed_max_running_nor_claim_twice(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as setup:
        setup.execute(
            "insert into fleet.lanes (name, max_running, lease_seconds, max_attempts, max_handoffs) "
            "values (%s, %s, 300, 3, 10)",
            (LANE, SLOTS),
        )
        setup.execute(
            "select fleet.enqueue(%s, 'task:' || g, jsonb_build_object('n', g), g %% 7) "
            "from generate_series(1, %s) g",
            (LANE, TASKS),
        )

    stop = threading.Event()
    start = threading.Barrier(CLAIMERS + 1)
    errors: list[BaseException] = []
    claimed: list[list[int]] = [[] for _ in range(CLAIMERS)]
    samples: list[int] = []

    def claimer(n: int) -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as c:
                sid = _open_session(c, LANE, f"host-{n}", 1000 + n)
                start.wait(timeout=30)
                while not stop.is_set():
                    got = c.execute(
                        "select id, lease_token from fleet.claim(%s, 2)", (sid,)
                    ).fetchall()
                    if not got:
                        left = c.execute(
                            "select count(*) from fleet.tasks where lane = %s and state = 'queued'",
                            (LANE,),
                        ).fetchone()
                        assert left is not None
                        if left[0] == 0:
                            break
                        time.sleep(0.001)  # every slot is taken: let a holder finish
                        continue
                    for task_id, token in got:
                        claimed[n].append(task_id)
                        row = c.execute(
                            "select fleet.complete(%s, %s, %s)", (task_id, token, Jsonb({"by": n}))
                        ).fetchone()
                        assert row is not None and row[0] == "done"
                c.execute("select fleet.close_session(%s, 'drained', null)", (sid,))
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)
            stop.set()

    def watcher() -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as c:
                while not stop.is_set():
                    row = c.execute(
                        "select count(*) from fleet.tasks where lane = %s and state = 'running'",
                        (LANE,),
                    ).fetchone()
                    assert row is not None
                    samples.append(row[0])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(n,), daemon=True) for n in range(CLAIMERS)]
    watch = threading.Thread(target=watcher, daemon=True)
    watch.start()
    for t in threads:
        t.start()
    began = time.monotonic()
    start.wait(timeout=30)
    for t in threads:
        t.join(timeout=60)
    stop.set()
    watch.join(timeout=10)
    elapsed = time.monotonic() - began

    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a claimer hung"
    assert samples, "the watcher never sampled"
    assert max(samples) <= SLOTS, f"running count reached {max(samples)} > {SLOTS}"
    assert max(samples) >= 2, "the claimers never overlapped; the test proved nothing"

    everything = [task_id for mine in claimed for task_id in mine]
    twice = [task_id for task_id, n in Counter(everything).items() if n > 1]
    assert not twice, f"claimed twice: {twice[:10]}"
    assert len(everything) == TASKS
    assert sum(1 for mine in claimed if mine) >= 2, "one claimer did all the work"

    with psycopg.connect(db_url, autocommit=True) as c:
        states = dict(
            c.execute("select state, count(*) from fleet.tasks group by state").fetchall()
        )
        assert states == {"done": TASKS}
        per_task = c.execute(
            "select count(*) filter (where n <> 1), count(*) from "
            "(select t.id, count(r.id) as n from fleet.tasks t "
            "left join fleet.runs r on r.task_id = t.id group by t.id) x"
        ).fetchone()
        assert per_task == (0, TASKS), "every task has exactly one run row"
        assert c.execute(
            "select count(*) from fleet.runs where outcome = 'done' and attempt = 1"
        ).fetchone() == (TASKS,)
        ev = dict(
            c.execute(
                "select kind, count(*) from fleet.events where task_id is not null group by kind"
            ).fetchall()
        )
        assert ev == {"enqueued": TASKS, "claimed": TASKS, "completed": TASKS}
        handoffs = c.execute(
            "select coalesce(sum((counts ->> 'done')::int), 0), count(*) from fleet.lane_handoffs"
        ).fetchone()
        assert handoffs == (TASKS, CLAIMERS)
    assert elapsed < 60


def _race(db_url: str, n: int, work: Any) -> list[Any]:
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

    results = _race(db_url, 8, work)
    assert all(isinstance(r, tuple) for r in results), results
    assert len({r[0] for r in results}) == 1
    assert sorted(r[1] for r in results) == [False] * 7 + [True]
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute("select count(*) from fleet.tasks").fetchone() == (1,)
        assert c.execute(
            "select count(*) from fleet.events where kind = 'enqueued'"
        ).fetchone() == (1,)


def test_complete_racing_cancel_has_one_winner(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into fleet.lanes (name) values ('a')")
        c.execute("select fleet.enqueue('a', 'k' || g) from generate_series(1, 20) g")
        sid = _open_session(c, "a", "h", 1)
        leases = c.execute("select id, lease_token from fleet.claim(%s, 20)", (sid,)).fetchall()
    assert len(leases) == 20

    def work(c: psycopg.Connection, i: int) -> list[str]:
        got = []
        for task_id, token in leases:
            try:
                if i == 0:
                    row = c.execute("select fleet.complete(%s, %s)", (task_id, token)).fetchone()
                else:
                    row = c.execute("select fleet.cancel(%s)", (task_id,)).fetchone()
                assert row is not None
                got.append(row[0])
            except psycopg.Error as exc:
                got.append(str(exc.sqlstate))
        return got

    completer, canceller = _race(db_url, 2, work)
    for (task_id, _), done, cancelled in zip(leases, completer, canceller, strict=True):
        # complete first: cancel is refused (LF004); cancel first: complete has lost its lease
        assert (done, cancelled) in {("done", "LF004"), ("LF001", "cancelled")}, (
            task_id,
            done,
            cancelled,
        )
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute(
            "select count(*) from fleet.runs where outcome is null or ended_at is null"
        ).fetchone() == (0,)


def test_concurrent_close_session_writes_one_snapshot(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into fleet.lanes (name) values ('a')")
        c.execute("select fleet.enqueue('a', 'k' || g) from generate_series(1, 5) g")
        sid = _open_session(c, "a", "h", 1)
        c.execute("select fleet.claim(%s, 5)", (sid,))

    def work(c: psycopg.Connection, i: int) -> int:
        row = c.execute("select fleet.close_session(%s, 'race', null)", (sid,)).fetchone()
        assert row is not None
        return row[0]

    results = _race(db_url, 4, work)
    assert all(isinstance(r, int) for r in results), results
    assert len(set(results)) == 1
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute("select count(*) from fleet.lane_handoffs").fetchone() == (1,)
        assert c.execute(
            "select sum(evaporations), count(*) filter (where state = 'queued') from fleet.tasks"
        ).fetchone() == (5, 5), "each held task released exactly once"


def _wait_until_blocked(watch: psycopg.Connection, pid: int) -> None:
    """Wait (on the server's own record, not a sleep guess) until backend pid waits for a lock."""
    for _ in range(1000):
        row = watch.execute(
            "select wait_event_type from pg_stat_activity where pid = %s", (pid,)
        ).fetchone()
        if row is not None and row[0] == "Lock":
            return
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} never blocked")


@pytest.mark.parametrize("transition", ["cancel", "release", "complete"])
def test_record_run_racing_a_transition_of_its_task_does_not_deadlock(
    db_url: str, transition: str
) -> None:
    """record_run must take its locks in the order every transition does: task, then run.

    The interleaving is arranged with a third transaction holding the run row: record_run queues
    on the run row first, then the transition locks the task and queues behind it. Taking the run
    row before the task (as record_run did) then closes a cycle, and Postgres kills one side with
    a deadlock error (40P01) - a lost token report or a lost cancel.
    """
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("insert into fleet.lanes (name) values ('a')")
        c.execute("select fleet.enqueue('a', 'k')")
        sid = _open_session(c, "a", "h", 1)
        task_id, token = c.execute(
            "select id, lease_token from fleet.claim(%s, 1)", (sid,)
        ).fetchone()  # type: ignore[misc]

    with (
        psycopg.connect(db_url, autocommit=True) as watch,
        psycopg.connect(db_url) as holder,
        psycopg.connect(db_url, autocommit=True) as reporter,
        psycopg.connect(db_url, autocommit=True) as actor,
    ):
        holder.execute("select 1 from fleet.runs where lease_token = %s for update", (token,))
        results: dict[str, Any] = {}

        def call(name: str, conn: psycopg.Connection, query: str, params: Any) -> None:
            try:
                results[name] = conn.execute(query, params).fetchone()
            except psycopg.Error as exc:
                results[name] = exc

        report = threading.Thread(
            target=call,
            args=(
                "record_run",
                reporter,
                "select fleet.record_run(%s, %s)",
                (token, Jsonb({"agent_session": "ag", "input_tokens": 10})),
            ),
        )
        report.start()
        _wait_until_blocked(watch, reporter.info.backend_pid)
        query = {
            "cancel": ("select fleet.cancel(%s)", (task_id,)),
            "release": ("select fleet._release(%s, 'lease-expired')", (task_id,)),
            "complete": ("select fleet.complete(%s, %s)", (task_id, token)),
        }[transition]
        act = threading.Thread(target=call, args=(transition, actor, *query))
        act.start()
        _wait_until_blocked(watch, actor.info.backend_pid)
        holder.rollback()
        report.join(timeout=30)
        act.join(timeout=30)

    errors = {k: v for k, v in results.items() if isinstance(v, BaseException)}
    assert not errors, errors
    with psycopg.connect(db_url, autocommit=True) as c:
        assert c.execute("select input_tokens from fleet.runs").fetchone() == (10,)
        state = c.execute("select state from fleet.tasks").fetchone()
        assert state == (
            {"cancel": "cancelled", "release": "queued", "complete": "done"}[transition],
        )


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
         where (select count(*) from fleet.events e where e.task_id = t.id and e.kind = 'claimed')
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
    "only a hand-off leaves resume set": """
        select id from fleet.tasks where resume and (state <> 'queued' or handoffs = 0)""",
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
    # name: (max_running, max_attempts, max_handoffs, accepts_from)
    "a": (2, 2, 1, None),
    "b": (1, 3, 2, ["a"]),
    "c": (None, 1, 0, ["b"]),
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
        _open_session(conn, lanes[a % len(lanes)], f"h{b}", 1 + b)
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
            conn.execute(
                "update fleet.tasks set lease_expires_at = now() - interval '1 s' where id = %s",
                (t[0],),
            )
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
            "select count(*) from fleet.tasks where state = 'running' and lease_expires_at < now()"
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
    for name, (max_running, max_attempts, max_handoffs, accepts_from) in LANES.items():
        conn.execute(
            "insert into fleet.lanes (name, max_running, max_attempts, max_handoffs, accepts_from, "
            "backoff_base_seconds) values (%s, %s, %s, %s, %s, 5)",
            (name, max_running, max_attempts, max_handoffs, accepts_from),
        )
    # a fixed prologue, so that the random steps act on something: work and a shift in every lane
    for i, name in enumerate(sorted(LANES) * 2):
        conn.execute("select fleet.enqueue(%s, %s, '{}', %s)", (name, f"seed{i}", i % 3))
    for i, name in enumerate(sorted(LANES)):
        _open_session(conn, name, f"seed-host-{i}", 100 + i)
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
    sid = _open_session(conn, "a", "h", 1)
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
