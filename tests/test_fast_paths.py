"""The cheaper claim and completion of migration 20261130160000 keep every guarantee.

The claim locks the lane row only for a lane with a limit counted across claims (max_running,
review_cap, a daily budget); a lane without one lets claims run side by side, while fleet.sync_lane
still never changes a lane under a claim in flight and pools still count their slots under their
own locks. The caller's lane check tests the cheap cases first and answers as before. The hot
helpers are PL/pgSQL. Claims in flight are held open in explicit transactions on their own
connections; a waiter is seen waiting in pg_stat_activity, never inferred from a sleep.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import errors, sql
from psycopg.types.json import Jsonb

ROOT = Path(__file__).resolve().parents[1]
LANE_NOT_ALLOWED = "LF008"


# ------------------------------------------------------------------------------------------------
# helpers


def one(conn: psycopg.Connection, query: str, params: Any = None) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def add_lane(conn: psycopg.Connection, name: str, max_running: int | None = None,
             config: dict[str, Any] | None = None) -> str:
    conn.execute(
        "insert into fleet.lanes (name, max_running, lease_seconds, config) values (%s, %s, 300, %s)",
        (name, max_running, Jsonb(config or {})),
    )
    return name


def fill(conn: psycopg.Connection, lane: str, n: int) -> None:
    conn.execute(
        "select fleet.enqueue(%s, %s || ':' || g) from generate_series(1, %s) g", (lane, lane, n)
    )


def open_session(conn: psycopg.Connection, lane: str, n: int = 1) -> uuid.UUID:
    return one(conn, "select fleet.open_session(%s, %s, %s, now(), 3600)", (lane, f"host-{n}", 1000 + n))


def claim(conn: psycopg.Connection, session: uuid.UUID, limit: int = 1) -> list[tuple[int, uuid.UUID]]:
    return [(r[0], r[1]) for r in conn.execute(
        "select id, lease_token from fleet.claim(%s, %s)", (session, limit)).fetchall()]


def running(conn: psycopg.Connection, lane: str) -> int:
    return int(one(conn, "select count(*) from fleet.tasks where lane = %s and state = 'running'", (lane,)))


def wait_until_waiting(admin: psycopg.Connection, pid: int, timeout: float = 20.0) -> str:
    """The lock the backend ``pid`` waits for (its wait_event), once it waits for one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = admin.execute(
            "select wait_event_type, wait_event from pg_stat_activity where pid = %s", (pid,)
        ).fetchone()
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


@pytest.fixture
def connect(db_url: str) -> Iterator[Callable[..., psycopg.Connection]]:
    made: list[psycopg.Connection] = []

    def make(autocommit: bool = True) -> psycopg.Connection:
        c = psycopg.connect(db_url, autocommit=autocommit)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


# ------------------------------------------------------------------------------------------------
# the helpers


HOT_HELPERS = ["_event(text,text,bigint,uuid,jsonb)", "_end_run(uuid,text,text)", "_lane_allowed(text)",
               "_done_state(text)", "_allowed_lanes()", "_require_lane(text)"]


def test_the_hot_helpers_are_plpgsql_and_claim_and_sync_lane_stay_definer(conn: psycopg.Connection) -> None:
    langs = dict(conn.execute(
        "select p.oid::regprocedure::text, l.lanname from pg_proc p join pg_language l on l.oid = p.prolang"
        " where p.oid = any (%s::regprocedure[])", ([f"fleet.{h}" for h in HOT_HELPERS],)).fetchall())
    assert langs == {f"fleet.{h}": "plpgsql" for h in HOT_HELPERS}
    for fn in ("fleet.claim(uuid, int)", "fleet.sync_lane(text, jsonb)"):
        secdef, config = conn.execute(
            "select prosecdef, proconfig from pg_proc where oid = %s::regprocedure", (fn,)).fetchone() or (None, None)
        assert secdef is True and config == ["search_path=pg_catalog, fleet, pg_temp"], fn
    assert one(conn, "select has_function_privilege('fleet_worker', 'fleet.claim(uuid, int)', 'execute')")
    assert not one(conn, "select has_function_privilege('fleet_worker', 'fleet.sync_lane(text, jsonb)', 'execute')")
    assert not one(conn, "select has_function_privilege('anon', 'fleet.claim(uuid, int)', 'execute')")
    # the same behaviour: a completion closes its run, writes its event, and a review lane reviews
    add_lane(conn, "rv", config={"review": True})
    fill(conn, "rv", 1)
    [(task, token)] = claim(conn, open_session(conn, "rv"))
    assert one(conn, "select fleet.complete(%s, %s)", (task, token)) == "review"
    assert conn.execute("select outcome, ended_at is not null from fleet.runs where task_id = %s",
                        (task,)).fetchall() == [("done", True)]
    assert one(conn, "select detail from fleet.events where task_id = %s and kind = 'completed'",
               (task,)) == {"attempt": 1, "state": "review"}


# ------------------------------------------------------------------------------------------------
# the lane lock


def test_a_lane_without_limits_claims_while_another_claim_is_uncommitted(connect) -> None:
    setup = connect()
    add_lane(setup, "free")
    fill(setup, "free", 4)
    sa, sb = open_session(setup, "free", 1), open_session(setup, "free", 2)

    a = connect(autocommit=False)
    mine = claim(a, sa, 2)  # its transaction stays open: the claim is not committed
    assert len(mine) == 2
    # no lock of any mode on the lane row: even FOR UPDATE (which every row lock blocks) gets it
    probe = connect()
    probe.execute("set lock_timeout = '2s'")
    assert one(probe, "select name from fleet.lanes where name = 'free' for update nowait") == "free"
    # and a second claimer is served at once, with other tasks
    b = connect()
    b.execute("set lock_timeout = '2s'")
    theirs = claim(b, sb, 5)
    assert len(theirs) == 2 and not {t for t, _ in theirs} & {t for t, _ in mine}
    a.commit()
    assert running(setup, "free") == 4


def test_large_claims_of_a_lane_run_side_by_side(connect) -> None:
    """A claim of 50 is served while another claim of 50 of its lane is uncommitted (they took
    turns from 20261130160000 until 20261130170000), with other tasks."""
    setup = connect()
    add_lane(setup, "bulk")
    fill(setup, "bulk", 120)
    sa, sb = (open_session(setup, "bulk", n) for n in (1, 2))

    a = connect(autocommit=False)
    mine = claim(a, sa, 50)  # uncommitted
    assert len(mine) == 50
    b = connect()
    b.execute("set lock_timeout = '2s'")
    theirs = claim(b, sb, 50)
    assert len(theirs) == 50 and not {t for t, _ in theirs} & {t for t, _ in mine}
    a.commit()
    assert running(setup, "bulk") == 100


LIMITS = {
    "max_running": {"max_running": 10},
    "review_cap": {"config": {"review": True, "review_cap": 10}},
    "daily_budget_usd": {"config": {"daily_budget_usd": 100}},
    "daily_budget_tokens": {"config": {"daily_budget_tokens": 1000000}},
}


@pytest.mark.parametrize("limit", sorted(LIMITS))
def test_a_lane_with_a_limit_still_serialises_its_claims(connect, limit: str) -> None:
    setup = connect()
    add_lane(setup, "held", **LIMITS[limit])
    fill(setup, "held", 4)
    sa, sb = open_session(setup, "held", 1), open_session(setup, "held", 2)

    a = connect(autocommit=False)
    assert len(claim(a, sa, 1)) == 1
    probe = connect()
    with pytest.raises(errors.LockNotAvailable):
        probe.execute("select 1 from fleet.lanes where name = 'held' for no key update nowait")
    b = connect()
    waiting = Call(b, lambda c: claim(c, sb, 1))
    waiting.start()
    assert wait_until_waiting(setup, b.info.backend_pid) in ("tuple", "transactionid")
    a.commit()
    assert len(waiting.outcome()) == 1
    assert running(setup, "held") == 2


def test_sync_lane_waits_for_the_claims_in_flight_and_the_next_claim_sees_its_limit(connect) -> None:
    setup = connect()
    add_lane(setup, "free")
    add_lane(setup, "other")
    fill(setup, "free", 6)
    fill(setup, "other", 1)
    sa, sb, so = open_session(setup, "free", 1), open_session(setup, "free", 2), open_session(setup, "other", 3)

    # an unlimited claim in flight; the lane is given max_running 3 meanwhile
    a = connect(autocommit=False)
    assert len(claim(a, sa, 3)) == 3
    s = connect()
    sync = Call(s, lambda c: one(c, "select fleet.sync_lane('free', '{\"max_running\": 3}')"))
    sync.start()
    assert wait_until_waiting(setup, s.info.backend_pid) == "advisory"
    a.commit()
    assert sync.outcome() == "updated"
    # had the sync not waited, this claim would not see the three above (uncommitted) and take 3 more
    b = connect()
    assert claim(b, sb, 3) == []
    assert running(setup, "free") == 3

    # a sync not yet committed holds back the claims of its lane only
    s2 = connect(autocommit=False)
    assert one(s2, "select fleet.sync_lane('free', '{\"max_running\": 4}')") == "updated"
    b.execute("set lock_timeout = '300ms'")
    with pytest.raises(errors.LockNotAvailable):
        claim(b, sb, 1)
    o = connect()
    o.execute("set lock_timeout = '2s'")
    assert len(claim(o, so, 1)) == 1
    s2.commit()
    assert len(claim(b, sb, 3)) == 1  # the new limit: 4


def test_pools_still_count_their_slots_under_their_own_lock(connect) -> None:
    setup = connect()
    setup.execute("select fleet.sync_pool('shared', 1)")
    setup.execute("select fleet.sync_profile('agent', 'shared', '{}')")
    for lane in ("pa", "pb"):
        add_lane(setup, lane, config={"profile": "agent"})  # no lane limit: no lane lock
        fill(setup, lane, 2)
    sa, sb = open_session(setup, "pa", 1), open_session(setup, "pb", 2)

    a = connect(autocommit=False)
    assert len(claim(a, sa, 1)) == 1  # the pool's one slot, not yet committed
    b = connect()
    waiting = Call(b, lambda c: claim(c, sb, 1))
    waiting.start()
    assert wait_until_waiting(setup, b.info.backend_pid) in ("tuple", "transactionid")
    a.commit()
    assert waiting.outcome() == []
    assert one(setup, "select count(*) from fleet.tasks where state = 'running' and pool = 'shared'") == 1


# ------------------------------------------------------------------------------------------------
# gates under real concurrent claimers

CLAIMERS = 6


def _drain(db_url: str, lane: str, batch: int, after_claim: Callable[[psycopg.Connection, int, uuid.UUID], None]
           ) -> list[list[int]]:
    """CLAIMERS threads, each with its own connection and session, claim until nothing comes."""
    start = threading.Barrier(CLAIMERS)
    claimed: list[list[int]] = [[] for _ in range(CLAIMERS)]
    errs: list[BaseException] = []

    def claimer(n: int) -> None:
        try:
            with psycopg.connect(db_url, autocommit=True) as c:
                sid = open_session(c, lane, n)
                start.wait(timeout=30)
                while got := claim(c, sid, batch):
                    for task, token in got:
                        claimed[n].append(task)
                        after_claim(c, task, token)
        except BaseException as exc:
            errs.append(exc)

    threads = [threading.Thread(target=claimer, args=(n,), daemon=True) for n in range(CLAIMERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errs, errs
    assert not any(t.is_alive() for t in threads), "a claimer hung"
    return claimed


def test_claimers_of_a_lane_without_limits_take_each_task_once(db_url: str, conn: psycopg.Connection) -> None:
    add_lane(conn, "free")
    fill(conn, "free", 600)

    def done(c: psycopg.Connection, task: int, token: uuid.UUID) -> None:
        assert one(c, "select fleet.complete(%s, %s)", (task, token)) == "done"

    claimed = _drain(db_url, "free", 3, done)
    every = [t for mine in claimed for t in mine]
    assert not [t for t, k in Counter(every).items() if k > 1], "a task was claimed twice"
    assert len(every) == 600 and sum(1 for mine in claimed if mine) >= 2
    assert conn.execute("select state, attempts, count(*) from fleet.tasks group by 1, 2").fetchall() == [
        ("done", 1, 600)]
    assert one(conn, "select count(*) from fleet.runs where outcome = 'done'") == 600
    assert conn.execute("select kind, count(*) from fleet.events where task_id is not null group by 1 order by 1"
                        ).fetchall() == [("claimed", 600), ("completed", 600), ("enqueued", 600)]


@pytest.mark.parametrize("gate", ["review_cap", "daily_budget_tokens"])
def test_gated_lanes_stop_claiming_at_their_limit_under_concurrent_claimers(
        db_url: str, conn: psycopg.Connection, gate: str) -> None:
    cap = 8
    config: dict[str, Any] = ({"review": True, "review_cap": cap} if gate == "review_cap"
                              else {"daily_budget_tokens": cap * 100})
    add_lane(conn, "gated", config=config)
    fill(conn, "gated", 100)

    def spend_and_complete(c: psycopg.Connection, task: int, token: uuid.UUID) -> None:
        # each task spends 100 tokens: the budget is cap tasks; a review lane holds each in review
        c.execute("select fleet.record_run(%s, %s)", (token, Jsonb({"input_tokens": 100})))
        c.execute("select fleet.complete(%s, %s)", (task, token))

    claimed = _drain(db_url, "gated", 1, spend_and_complete)
    n = sum(len(mine) for mine in claimed)
    # a claim sees only what committed before it: up to CLAIMERS - 1 claims may overlap the one
    # that reaches the limit, never more; and the gate closes (nothing claimed past that)
    assert cap <= n <= cap + CLAIMERS - 1, n
    assert one(conn, "select count(*) from fleet.tasks where state = 'queued'") == 100 - n
    sid = open_session(conn, "gated", 99)
    assert claim(conn, sid, 5) == []


# ------------------------------------------------------------------------------------------------
# the caller's lane check


def _reference_allowed_lanes(conn: psycopg.Connection) -> None:
    """fleet._allowed_lanes as the first migration wrote it, as public.allowed_lanes_before()."""
    text = (ROOT / "migrations" / "20261130100100_fleet_api.sql").read_text()
    m = re.search(r"create or replace function fleet\._allowed_lanes\(\).*?\n\$\$;", text, re.S)
    assert m is not None
    conn.execute(m.group(0).replace("fleet._allowed_lanes()", "public.allowed_lanes_before()"))
    conn.execute("grant execute on function public.allowed_lanes_before() to public")


@contextmanager
def as_role(conn: psycopg.Connection, role: str, claims: str | None) -> Iterator[None]:
    """What PostgREST does per request: the key's role, its claims, in one transaction."""
    with conn.transaction(force_rollback=True):
        conn.execute("select set_config('role', %s, true)", (role,))
        if claims is not None:
            conn.execute("select set_config('request.jwt.claims', %s, true)", (claims,))
        yield


CLAIMS = [None, "", "{}", '{"fleet_lanes": ["docs"]}', '{"fleet_lanes": "docs"}', '{"fleet_lanes": ["*"]}',
          '{"fleet_lanes": []}', '{"fleet_lanes": 7}', '{"fleet_lanes": ["docs", null]}',
          '{"fleet_lanes": ["bugfix", "docs"]}']


def test_the_lane_check_answers_as_before_for_every_kind_of_caller(conn: psycopg.Connection) -> None:
    _reference_allowed_lanes(conn)
    tag = uuid.uuid4().hex[:10]
    bypass, member = f"lf_ff_bypass_{tag}", f"lf_ff_member_{tag}"
    owner = one(conn, "select nspowner::regrole::text from pg_namespace where nspname = 'fleet'")
    try:
        conn.execute(sql.SQL("create role {} nologin bypassrls").format(sql.Identifier(bypass)))
        conn.execute(sql.SQL("create role {} nologin").format(sql.Identifier(member)))
        conn.execute(sql.SQL("grant {} to {}").format(sql.Identifier(owner), sql.Identifier(member)))
        for r in (bypass, member):
            conn.execute(sql.SQL("grant usage on schema fleet to {}").format(sql.Identifier(r)))
            conn.execute(sql.SQL("grant execute on function fleet._allowed_lanes(), fleet._lane_allowed(text)"
                                 " to {}").format(sql.Identifier(r)))
        seen: dict[tuple[str, str | None], Any] = {}
        for role in ("postgres", "service_role", "fleet_worker", "fleet_operator", bypass, member):
            for claims in CLAIMS:
                with as_role(conn, role, claims):
                    now, before = conn.execute(
                        "select fleet._allowed_lanes(), public.allowed_lanes_before()").fetchone() or (0, 1)
                    assert now == before, (role, claims)
                    for lane in ("docs", "bugfix", None):
                        allowed, expected = conn.execute(
                            "select fleet._lane_allowed(%s::text), (select b is null or (%s::text is not null"
                            " and %s::text = any (b)) from public.allowed_lanes_before() b)",
                            (lane, lane, lane)).fetchone() or (0, 1)
                        assert allowed is expected, (role, claims, lane)
                seen[(role, claims)] = now
        # the matrix did exercise every branch
        assert seen[("postgres", None)] is None and seen[("service_role", "{}")] is None
        assert seen[(bypass, None)] is None and seen[(member, None)] is None
        assert seen[("fleet_worker", None)] == [] and seen[("fleet_operator", None)] is None
        assert seen[("fleet_worker", '{"fleet_lanes": "docs"}')] == ["docs"]
        assert seen[("fleet_worker", '{"fleet_lanes": ["*"]}')] is None
    finally:  # roles belong to the cluster, not to the test's database
        for r in (bypass, member):
            if one(conn, "select count(*) from pg_roles where rolname = %s", (r,)):
                conn.execute(sql.SQL("drop owned by {}").format(sql.Identifier(r)))
                conn.execute(sql.SQL("drop role {}").format(sql.Identifier(r)))


def test_a_restricted_key_is_refused_another_lanes_work_and_does_its_own(conn: psycopg.Connection) -> None:
    for lane in ("docs", "bugfix"):
        add_lane(conn, lane)
        fill(conn, lane, 2)
    docs_s, bug_s = open_session(conn, "docs", 1), open_session(conn, "bugfix", 2)
    [(bug_task, bug_token)] = claim(conn, bug_s, 1)
    docs_key = json.dumps({"role": "fleet_worker", "fleet_lanes": ["docs"]})

    for call in (lambda: claim(conn, bug_s, 1),
                 lambda: conn.execute("select fleet.complete(%s, %s)", (bug_task, bug_token)),
                 lambda: conn.execute("select fleet.enqueue('bugfix', 'b:new')"),
                 lambda: conn.execute("select fleet.heartbeat(%s)", (bug_s,))):
        with as_role(conn, "fleet_worker", docs_key), pytest.raises(psycopg.Error) as err:
            call()
        assert err.value.sqlstate == LANE_NOT_ALLOWED, err.value
        assert "'bugfix' is not allowed" in str(err.value)
    # a worker key without claims works no lane at all
    with as_role(conn, "fleet_worker", None), pytest.raises(psycopg.Error) as err:
        claim(conn, docs_s, 1)
    assert err.value.sqlstate == LANE_NOT_ALLOWED
    assert one(conn, "select state from fleet.tasks where id = %s", (bug_task,)) == "running"
    assert one(conn, "select count(*) from fleet.tasks where state = 'running'") == 1

    with as_role(conn, "fleet_worker", docs_key):
        [(task, token)] = claim(conn, docs_s, 1)
        assert one(conn, "select fleet.complete(%s, %s)", (task, token)) == "done"
