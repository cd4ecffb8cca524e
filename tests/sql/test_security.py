"""The security group (migrations/sources/02_security.sql: which lanes the caller's key may work,
LF008) and the security settings beside every function (SECURITY DEFINER, a pinned search_path, no
EXECUTE for PUBLIC, row-level security), on the plain test PostgreSQL: what PostgREST does per
request is done here by hand (sqlkit.as_key: SET LOCAL ROLE + request.jwt.claims), so the checks are
shown to hold on the server version the other tests run on, without PostgREST. (The same refusals
through the real stack: tests/supabase_api/test_security.py.)
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlkit import (
    LANE_NOT_ALLOWED,
    add_lane,
    as_key,
    complete_many,
    enqueue_many,
    enqueue_task,
    fill,
    leases,
    one,
    open_session,
    refused,
    rows,
    running_tasks,
    task,
)

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------
# grants and security settings


API = {"enqueue_task", "enqueue", "enqueue_after", "open_session", "claim", "heartbeat", "checkpoint", "complete",
       "fail", "hand_off", "route", "record_run", "close_session", "cancel", "retry", "sync_lane", "reconcile",
       "declare_session_lost", "schema_versions",
       # dispatch and guard rails and the bulk calls
       "block", "throttle", "transient", "drop_session", "resume", "sync_pool", "sync_profile", "task_spend", "set_task_budget",
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


def test_every_writing_api_function_runs_as_its_owner_with_a_pinned_search_path(conn: psycopg.Connection) -> None:
    """`create or replace function` resets SECURITY DEFINER and SET: a later migration that redefines an
    API function without saying them again would leave a worker key unable to call it (RLS) or open to
    a search_path attack. Every volatile API function a key role may call must keep both."""
    bad = conn.execute("""
        select p.oid::regprocedure::text, p.prosecdef, p.proconfig
          from pg_proc p join pg_namespace n on n.oid = p.pronamespace
         where n.nspname = 'fleet' and p.provolatile = 'v' and p.prokind = 'f' and p.proname !~ '^_'
           and (has_function_privilege('fleet_worker', p.oid, 'execute')
                or has_function_privilege('fleet_operator', p.oid, 'execute'))
           and not (p.prosecdef and exists (select 1 from unnest(p.proconfig) c
                                             where c like 'search_path=pg_catalog,%' and c not like '%public%'))
         order by 1""").fetchall()
    assert bad == []
    callable_by_public = conn.execute("""
        select p.oid::regprocedure::text
          from pg_proc p join pg_namespace n on n.oid = p.pronamespace
         where n.nspname = 'fleet' and p.prosecdef and has_function_privilege('public', p.oid, 'execute')
         order by 1""").fetchall()
    assert callable_by_public == []


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


# ------------------------------------------------------------------------------------------------
# the caller's lanes


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


def _reference_allowed_lanes(conn: psycopg.Connection) -> None:
    """fleet._allowed_lanes as the first migration wrote it, as public.allowed_lanes_before()."""
    text = (ROOT / "migrations" / "20261130100100_fleet_api.sql").read_text()
    m = re.search(r"create or replace function fleet\._allowed_lanes\(\).*?\n\$\$;", text, re.S)
    assert m is not None
    conn.execute(m.group(0).replace("fleet._allowed_lanes()", "public.allowed_lanes_before()"))
    conn.execute("grant execute on function public.allowed_lanes_before() to public")


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
                with as_key(conn, role, claims):
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


# ------------------------------------------------------------------------------------------------
# the lane checks of the API calls


@pytest.fixture
def world(conn: psycopg.Connection) -> dict[str, Any]:
    for lane in ("docs", "bugfix"):
        conn.execute("select fleet.sync_lane(%s, '{}')", (lane,))
        conn.execute("select fleet.enqueue(%s, %s)", (lane, f"{lane}:1"))
    s = conn.execute("select fleet.open_session('bugfix', 'h', 1, null, 600)").fetchone()[0]
    task, token = conn.execute("select id, lease_token from fleet.claim(%s, 1)", (s,)).fetchone()
    return {"session": s, "task": task, "token": token}


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
        ("select fleet.transient(%s, %s, 'overloaded')", (world["task"], world["token"])),
        ("select fleet.drop_session(%s, %s, 'gone')", (world["task"], world["token"])),
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


def test_a_restricted_key_is_refused_another_lanes_work_and_does_its_own(conn: psycopg.Connection) -> None:
    for lane in ("docs", "bugfix"):
        add_lane(conn, lane)
        fill(conn, lane, 2)
    docs_s, bug_s = open_session(conn, "docs", host="host-1"), open_session(conn, "bugfix", host="host-2")
    [(bug_task, bug_token)] = leases(conn, bug_s, 1)
    docs_key = json.dumps({"role": "fleet_worker", "fleet_lanes": ["docs"]})

    for call in (lambda: leases(conn, bug_s, 1),
                 lambda: conn.execute("select fleet.complete(%s, %s)", (bug_task, bug_token)),
                 lambda: conn.execute("select fleet.enqueue('bugfix', 'b:new')"),
                 lambda: conn.execute("select fleet.heartbeat(%s)", (bug_s,))):
        with as_key(conn, "fleet_worker", docs_key), pytest.raises(psycopg.Error) as err:
            call()
        assert err.value.sqlstate == LANE_NOT_ALLOWED, err.value
        assert "'bugfix' is not allowed" in str(err.value)
    # a worker key without claims works no lane at all
    with as_key(conn, "fleet_worker", None), pytest.raises(psycopg.Error) as err:
        leases(conn, docs_s, 1)
    assert err.value.sqlstate == LANE_NOT_ALLOWED
    assert one(conn, "select state from fleet.tasks where id = %s", (bug_task,)) == "running"
    assert one(conn, "select count(*) from fleet.tasks where state = 'running'") == 1

    with as_key(conn, "fleet_worker", docs_key):
        [(task, token)] = leases(conn, docs_s, 1)
        assert one(conn, "select fleet.complete(%s, %s)", (task, token)) == "done"


DOCS_WORKER = {"role": "fleet_worker", "fleet_lanes": ["docs"]}


def test_a_docs_key_cannot_complete_another_lanes_tasks(lanes: psycopg.Connection) -> None:
    conn = lanes
    _, [d] = running_tasks(conn, "docs", 1)
    _, [b] = running_tasks(conn, "bugfix", 1)
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
    bug_id, _ = enqueue_task(conn, "bugfix", "bug:1")
    with as_key(conn, "fleet_worker", DOCS_WORKER), refused("LF008") as err:
        enqueue_many(conn, "docs", [{"key": "d:1"}, {"key": "b:2", "lane": "bugfix"}])
    assert str(err.value.diag.message_primary).startswith("p_tasks[1] (key 'b:2'): lane 'bugfix' is not allowed")
    with as_key(conn, "fleet_worker", DOCS_WORKER), refused("LF008") as err:
        enqueue_many(conn, "bugfix", [{"key": "b:3"}])
    # keys are per lane: a bugfix task's key names another task in docs, and the docs key learns
    # nothing of bugfix's (a key whose task moved on out of sight: tests/sql/test_enqueue.py)
    with as_key(conn, "fleet_worker", DOCS_WORKER):
        got = enqueue_many(conn, "docs", [{"key": "d:1"}, {"key": "bug:1"}])
        assert got[1]["created"] and got[1]["id"] != bug_id
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
    _, [d] = running_tasks(conn, "docs", 1)
    for call in (lambda: enqueue_many(conn, "docs", [{"key": "anon:1"}]),
                 lambda: complete_many(conn, [d["id"]], [d["lease_token"]])):
        with as_key(conn, role, {"role": role, "fleet_lanes": ["*"]}), refused("42501"):
            call()
    assert task(conn, d["id"])["state"] == "running"
