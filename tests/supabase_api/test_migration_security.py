"""The security layer of the migrations (migrations/*_fleet_roles_rls.sql and the lane checks in
the SQL API), on the plain test PostgreSQL (the machine's 15, or the embedded 18): what PostgREST
does per request is done here by hand (SET LOCAL ROLE + request.jwt.claims), so the checks are
shown to hold on the server version the other tests run on, without PostgREST.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from supabase_stack import stack_home

from worker.db.migrate import migrate
from worker.dev import devstack

API = {"enqueue_task", "enqueue", "enqueue_after", "open_session", "claim", "heartbeat", "checkpoint", "complete",
       "fail", "hand_off", "route", "record_run", "close_session", "cancel", "retry", "sync_lane", "reconcile",
       "declare_session_lost", "schema_versions",
       # dispatch and guard rails (#8, #9) and the bulk calls (#7)
       "block", "throttle", "resume", "sync_pool", "sync_profile", "task_spend", "set_task_budget",
       "review_approve", "review_reject", "stalled_tasks", "lease_held", "enqueue_many", "complete_many",
       "touch_workspace", "workspaces_to_reap", "workspace_reaped"}


def test_every_fleet_function_is_closed_to_public(conn: psycopg.Connection) -> None:
    """A function without an ACL is EXECUTE-able by PUBLIC: a migration that adds one must revoke."""
    open_ = conn.execute("""
        select p.oid::regprocedure::text
          from pg_proc p
         where p.pronamespace = 'fleet'::regnamespace
           and (p.proacl is null or exists (select 1 from aclexplode(p.proacl) a
                                             where a.grantee = 0 and a.privilege_type = 'EXECUTE'))
    """).fetchall()
    assert open_ == []
    usage = {r[0] for r in conn.execute("""
        select coalesce(r.rolname, 'PUBLIC') from pg_namespace n, aclexplode(n.nspacl) a
          left join pg_roles r on r.oid = a.grantee
         where n.nspname = 'fleet' and a.privilege_type = 'USAGE'""").fetchall()}
    assert {"fleet_worker", "fleet_operator", "service_role"} <= usage, usage
    assert not usage & {"PUBLIC", "anon", "authenticated"}, usage


def test_api_functions_run_as_owner_with_a_pinned_search_path(conn: psycopg.Connection) -> None:
    rows = conn.execute("""
        select p.proname, p.proconfig from pg_proc p
         where p.pronamespace = 'fleet'::regnamespace and p.prosecdef
    """).fetchall()
    definers = dict(rows)
    assert set(definers) >= API
    for name in API:
        assert definers[name] == ["search_path=pg_catalog, fleet, pg_temp"], (name, definers[name])
    for name, config in definers.items():  # any other definer function pins its path too
        assert config and config[0].startswith("search_path=pg_catalog") and "pg_temp" in config[0], name


def test_every_table_has_row_level_security(conn: psycopg.Connection) -> None:
    rows = conn.execute("""
        select c.relname, c.relrowsecurity from pg_class c
         where c.relnamespace = 'fleet'::regnamespace and c.relkind in ('r', 'p')
    """).fetchall()
    assert rows and all(rls for _, rls in rows), rows


def test_roles(conn: psycopg.Connection) -> None:
    rows = {r[0]: r[1] for r in conn.execute("""
        select rolname, rolcanlogin from pg_roles
         where rolname in ('fleet_worker', 'fleet_operator', 'anon', 'authenticated', 'service_role')
    """).fetchall()}
    assert rows == dict.fromkeys(("fleet_worker", "fleet_operator", "anon", "authenticated", "service_role"), False)
    for role in rows:
        assert conn.execute("select pg_has_role('authenticator', %s, 'MEMBER')", (role,)).fetchone()[0]
    # the direct connection (the owner, what `fleet migrate` and trusted hosts use) works every lane
    assert conn.execute("select fleet._allowed_lanes()").fetchone()[0] is None


@contextmanager
def as_key(conn: psycopg.Connection, role: str, claims: dict[str, Any] | None) -> Iterator[None]:
    """What PostgREST does for a request: one transaction, SET LOCAL ROLE, the claims GUC."""
    with conn.transaction(force_rollback=True):
        conn.execute("select set_config('role', %s, true)", (role,))
        if claims is not None:
            conn.execute("select set_config('request.jwt.claims', %s, true)", (json.dumps(claims),))
        yield


@pytest.fixture
def world(conn: psycopg.Connection) -> dict[str, Any]:
    for lane in ("docs", "bugfix"):
        conn.execute("select fleet.sync_lane(%s, '{}')", (lane,))
        conn.execute("select fleet.enqueue(%s, %s)", (lane, f"{lane}:1"))
    s = conn.execute("select fleet.open_session('bugfix', 'h', 1, null, 600)").fetchone()[0]
    task, token = conn.execute("select id, lease_token from fleet.claim(%s, 1)", (s,)).fetchone()
    return {"session": s, "task": task, "token": token}


@pytest.mark.parametrize(("claims", "allowed"), [
    ({"role": "fleet_worker", "fleet_lanes": ["docs"]}, ["docs"]),
    ({"role": "fleet_worker", "fleet_lanes": "docs"}, ["docs"]),
    ({"role": "fleet_worker", "fleet_lanes": ["*"]}, None),
    ({"role": "fleet_worker"}, []),
    ({"role": "fleet_worker", "fleet_lanes": {"docs": True}}, []),
    ({"role": "fleet_worker", "fleet_lanes": [1, "docs"]}, ["1", "docs"]),
    (None, []),  # a worker role without claims (a direct login that did SET ROLE) gets nothing
])
def test_allowed_lanes_of_a_worker(conn: psycopg.Connection, claims: Any, allowed: Any) -> None:
    with as_key(conn, "fleet_worker", claims):
        assert conn.execute("select fleet._allowed_lanes()").fetchone()[0] == allowed


def test_allowed_lanes_of_operators_and_service_role(conn: psycopg.Connection) -> None:
    with as_key(conn, "fleet_operator", {"role": "fleet_operator"}):
        assert conn.execute("select fleet._allowed_lanes()").fetchone()[0] is None
    with as_key(conn, "fleet_operator", {"role": "fleet_operator", "fleet_lanes": ["docs"]}):
        assert conn.execute("select fleet._allowed_lanes()").fetchone()[0] == ["docs"]
    with as_key(conn, "service_role", {"role": "service_role", "fleet_lanes": ["docs"]}):
        assert conn.execute("select fleet._allowed_lanes()").fetchone()[0] is None


def test_lane_checks_on_this_server(conn: psycopg.Connection, world: dict[str, Any]) -> None:
    docs = {"role": "fleet_worker", "fleet_lanes": ["docs"]}
    calls = [
        ("select fleet.enqueue('bugfix', 'x')", ()),
        ("select fleet.open_session('bugfix', 'h', 1, null, 60)", ()),
        ("select * from fleet.claim(%s, 1)", (world["session"],)),
        ("select * from fleet.heartbeat(%s)", (world["session"],)),
        ("select fleet.checkpoint(%s, %s, '{}')", (world["task"], world["token"])),
        ("select fleet.complete(%s, %s)", (world["task"], world["token"])),
        ("select fleet.fail(%s, %s, 'x')", (world["task"], world["token"])),
        ("select fleet.hand_off(%s, %s, '{}')", (world["task"], world["token"])),
        ("select fleet.route(%s, %s, 'docs')", (world["task"], world["token"])),
        ("select fleet.record_run(%s, '{}')", (world["token"],)),
        ("select fleet.close_session(%s, 'x', '{}')", (world["session"],)),
        ("select * from fleet.declare_session_lost(%s, 'x')", (world["session"],)),
        ("select fleet.block(%s, %s, 'budget')", (world["task"], world["token"])),
        ("select fleet.throttle(%s, %s)", (world["task"], world["token"])),
        ("select * from fleet.task_spend(%s)", (world["task"],)),
        ("select * from fleet.complete_many(array[%s]::bigint[], array[%s]::uuid[])", (world["task"], world["token"])),
        ("select * from fleet.enqueue_many('bugfix', '[{\"key\": \"y\"}]')", ()),
        ("select * from fleet.lease_held(%s, %s)", (world["task"], world["token"])),
    ]
    for query, params in calls:
        with pytest.raises(psycopg.Error) as err, as_key(conn, "fleet_worker", docs):
            conn.execute(query, params)
        assert err.value.sqlstate == "LF008", (query, err.value)
    # a worker key may not do an operator's part at all (no grant: 42501)
    for query, params in [("select fleet.resume(%s)", (world["task"],)),
                          ("select fleet.review_approve(%s)", (world["task"],)),
                          ("select fleet.review_reject(%s, 'no')", (world["task"],)),
                          ("select fleet.set_task_budget(%s, 1)", (world["task"],)),
                          ("select fleet.sync_pool('p', 1)", ()),
                          ("select fleet.sync_profile('p', null, '{}')", ())]:
        with pytest.raises(psycopg.Error) as err, as_key(conn, "fleet_worker", {"role": "fleet_worker", "fleet_lanes": ["*"]}):
            conn.execute(query, params)
        assert err.value.sqlstate == "42501", (query, err.value)
    # an operator key limited to docs cannot resume, review or re-budget a bugfix task
    for query in ("select fleet.resume(%s)", "select fleet.review_approve(%s)", "select fleet.set_task_budget(%s, 1)"):
        with pytest.raises(psycopg.Error) as err, as_key(conn, "fleet_operator",
                                                         {"role": "fleet_operator", "fleet_lanes": ["docs"]}):
            conn.execute(query, (world["task"],))
        assert err.value.sqlstate == "LF008", (query, err.value)
    # anon: nothing
    for query in ("select * from fleet.pool_overview", "select fleet.resume(1)", "select * from fleet.stalled_tasks()"):
        with pytest.raises(psycopg.Error) as err, as_key(conn, "anon", {"role": "anon"}):
            conn.execute(query)
        assert err.value.sqlstate == "42501", (query, err.value)
    # RLS: the docs key reads docs rows only
    with as_key(conn, "fleet_worker", docs):
        assert conn.execute("select array_agg(distinct lane) from fleet.tasks").fetchone()[0] == ["docs"]
    # and the same calls as the owner still work
    assert conn.execute("select fleet.checkpoint(%s, %s, '{}')", (world["task"], world["token"])).fetchone()[0] == 1


def test_concurrent_migrations_on_a_fresh_cluster(worker_id: str) -> None:
    """Roles are cluster-wide: six databases migrated at once on a new cluster (as the test
    workers of a fresh CI machine do) must all succeed, each role made once."""
    home = stack_home(worker_id, "-race").resolve()
    devstack.down(home, purge=True)
    home.mkdir(parents=True)
    stack = devstack._new_stack(home, None)
    stack.logs.mkdir(parents=True)
    try:
        devstack._start_postgres(stack)
        stack.save()
        base = stack.db_url.rsplit("/", 1)[0]
        with psycopg.connect(stack.db_url, autocommit=True) as c:
            for i in range(6):
                c.execute(f"create database race{i}")
        errors: list[BaseException] = []
        barrier = threading.Barrier(6)

        def run(i: int) -> None:
            try:
                barrier.wait(30)
                migrate(f"{base}/race{i}")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        with psycopg.connect(stack.db_url) as c:
            members = c.execute("select count(*) from pg_auth_members m join pg_roles r on r.oid = m.member"
                                " where r.rolname = 'authenticator'").fetchone()[0]
            roles = c.execute("select count(*) from pg_roles where rolname in ('anon', 'authenticated',"
                              " 'service_role', 'authenticator', 'fleet_worker', 'fleet_operator')").fetchone()[0]
        assert (members, roles) == (5, 6)
    finally:
        devstack.down(home, purge=True)
