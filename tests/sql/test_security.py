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


API = {"enqueue_task", "enqueue", "enqueue_after", "open_session", "claim", "claimed", "heartbeat", "checkpoint", "complete",
       "fail", "hand_off", "route", "record_run", "close_session", "cancel", "retry", "sync_lane", "reconcile",
       "declare_session_lost", "schema_versions",
       # dispatch and guard rails and the bulk calls
       "block", "throttle", "transient", "drop_session", "resume", "sync_pool", "sync_profile", "task_spend",
       "review_approve", "review_reject", "stalled_tasks", "lease_held", "enqueue_many", "complete_many",
       "touch_workspace", "task_workspace", "workspaces_to_reap", "workspace_reaped",
       # the twins that answer one value (the Supabase store's: PostgREST cuts rows at db-max-rows)
       "enqueue_many_json", "complete_many_json", "reconcile_json"}


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
         where p.pronamespace = 'fleet'::regnamespace
           and p.proname in ('enqueue_many', 'complete_many', 'enqueue_many_json', 'complete_many_json')""")}
    assert set(got) == {"enqueue_many", "complete_many", "enqueue_many_json", "complete_many_json"}
    for r in got.values():
        assert r["prosecdef"] and r["proconfig"] == ["search_path=pg_catalog, fleet, pg_temp"]
        assert r["service"] and r["worker"] and not r["public"]
    for name in ("enqueue_many", "enqueue_many_json"):
        assert got[name]["operator"]  # like enqueue_task
    for name in ("complete_many", "complete_many_json"):
        assert not got[name]["operator"]  # like complete: a worker call


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


def test_service_role_and_superusers_are_answered_without_reading_the_catalog(conn: psycopg.Connection) -> None:
    """By their settings (role, is_superuser); any other caller reads pg_authid and pg_namespace
    once. (Reads: this transaction's scans of the two catalogs and their indexes, counted by
    pg_stat_get_xact_numscans, which reads no catalog itself.)"""
    count = ("select sum(pg_stat_get_xact_numscans(r))::int from unnest(array['pg_namespace',"
             " 'pg_namespace_nspname_index', 'pg_namespace_oid_index', 'pg_authid', 'pg_authid_rolname_index',"
             " 'pg_authid_oid_index']::regclass[]) r")

    def reads(role: str, claims: str | None) -> int:
        with as_key(conn, role, claims):
            conn.execute("select fleet._allowed_lanes()")  # (once first: the caches of the call itself)
            before = one(conn, count)
            conn.execute("select fleet._allowed_lanes()")
            return int(one(conn, count)) - int(before)

    assert reads("postgres", None) == 0 and reads("service_role", "{}") == 0
    assert reads("fleet_worker", '{"fleet_lanes": ["docs"]}') > 0
    assert reads("fleet_operator", None) > 0


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


# what a docs key hears of bugfix work: a lane it names itself is refused by name (LF008); an
# object of bugfix it names by id answers as one that does not exist
UNKNOWN = 987654321


def _as_unknown(query: str, params: tuple[Any, ...], world: dict[str, Any]) -> tuple[Any, ...]:
    """The same call aimed at nothing: the bugfix task, token and session replaced by unknown ones."""
    swap = {world["task"]: UNKNOWN, world["token"]: uuid.UUID(int=7), world["session"]: uuid.UUID(int=8)}
    return tuple(swap.get(p, p) for p in params)


def _answer(conn: psycopg.Connection, claims: dict[str, Any], query: str, params: tuple[Any, ...],
            names: dict[str, str]) -> tuple[Any, ...]:
    """(sqlstate, message, hint) of a refused call, or ('ok', rows); each given value in the message
    replaced by its name (so two answers about different ids compare)."""
    with as_key(conn, claims["role"], claims):
        try:
            got: Any = ("ok", conn.execute(query, params).fetchall())
        except psycopg.Error as exc:
            got = (exc.sqlstate, exc.diag.message_primary, exc.diag.message_hint)
    text = repr(got)
    for value, name in sorted(names.items(), key=lambda kv: -len(kv[0])):  # uuids before ids
        text = re.sub(rf"(?<![\w-]){re.escape(value)}(?![\w-])", name, text)
    return (text,)


def test_lane_checks_on_this_server(conn: psycopg.Connection, world: dict[str, Any]) -> None:
    docs = {"role": "fleet_worker", "fleet_lanes": ["docs"]}
    named = [  # a lane the caller names: refused by its name
        ("select fleet.enqueue('bugfix', 'x')", ()),
        ("select fleet.open_session('bugfix', 'h', 1, null, 60)", ()),
        ("select * from fleet.enqueue_many('bugfix', '[{\"key\": \"y\"}]')", ()),
        ("select fleet.route(%s, %s, 'bugfix')", (world["task"], world["token"])),
    ]
    for query, params in named:
        with pytest.raises(psycopg.Error) as err, as_key(conn, "fleet_worker", docs):
            conn.execute(query, params)
        assert err.value.sqlstate == "LF008", (query, err.value)
        assert "'bugfix' is not allowed" in str(err.value)
    by_id = [  # a bugfix object named by id: exactly what an unknown one answers
        ("select * from fleet.claim(%s, 1)", (world["session"],)),
        ("select * from fleet.heartbeat(%s)", (world["session"],)),
        ("select fleet.checkpoint(%s, %s, '{}')", (world["task"], world["token"])),
        ("select fleet.complete(%s, %s)", (world["task"], world["token"])),
        ("select fleet.fail(%s, %s, 'x')", (world["task"], world["token"])),
        ("select fleet.hand_off(%s, %s, '{}')", (world["task"], world["token"])),
        ("select fleet.route(%s, %s, 'docs')", (world["task"], world["token"])),
        ("select fleet.block(%s, %s, 'budget')", (world["task"], world["token"])),
        ("select fleet.throttle(%s, %s)", (world["task"], world["token"])),
        ("select fleet.transient(%s, %s, 'overloaded')", (world["task"], world["token"])),
        ("select fleet.drop_session(%s, %s, 'gone')", (world["task"], world["token"])),
        ("select fleet.gate_verdict(%s, %s, 'ok')", (world["task"], world["token"])),
        ("select fleet.touch_workspace(%s, %s, 'h', '/w')", (world["task"], world["token"])),
        ("select fleet.task_workspace(%s, %s, 'h')", (world["task"], world["token"])),
        ("select * from fleet.lease_held(%s, %s)", (world["task"], world["token"])),
    ]
    names = {str(world["task"]): "<task>", str(UNKNOWN): "<task>", str(world["session"]): "<session>",
             str(uuid.UUID(int=8)): "<session>"}
    for query, params in by_id:
        theirs = _answer(conn, docs, query, params, names)
        nothing = _answer(conn, docs, query, _as_unknown(query, params, world), names)
        assert theirs == nothing, (query, theirs, nothing)
        assert "LF008" not in theirs[0] and "bugfix" not in theirs[0], (query, theirs)
    # what other groups still answer with LF008 for another lane's object (tests/supabase_api/
    # test_probe.py KNOWN lists them): refused all the same
    for query, params in [("select fleet.record_run(%s, '{}')", (world["token"],)),
                          ("select fleet.close_session(%s, 'x', '{}')", (world["session"],)),
                          ("select * from fleet.declare_session_lost(%s, 'x')", (world["session"],)),
                          ("select * from fleet.task_spend(%s)", (world["task"],))]:
        with pytest.raises(psycopg.Error) as err, as_key(conn, "fleet_worker", docs):
            conn.execute(query, params)
        assert err.value.sqlstate in ("LF008", "LF003", "LF006"), (query, err.value)
    # complete_many answers per task: another lane's, with its real token, as a missing one
    with as_key(conn, "fleet_worker", docs):
        got = conn.execute("select task_id, status from fleet.complete_many(array[%s, %s]::bigint[], "
                           "array[%s, %s]::uuid[])", (world["task"], UNKNOWN, world["token"], uuid.uuid4())).fetchall()
    assert got == [(world["task"], "unknown"), (UNKNOWN, "unknown")]
    # a worker key may not do an operator's part at all (no grant: 42501)
    for query, params in [("select fleet.resume(%s)", (world["task"],)),
                          ("select fleet.review_approve(%s)", (world["task"],)),
                          ("select fleet.review_reject(%s, 'no')", (world["task"],)),
                          ("select fleet.resume(%s, 1)", (world["task"],)),
                          ("select fleet.sync_pool('p', 1)", ()),
                          ("select fleet.sync_profile('p', null, '{}')", ())]:
        with pytest.raises(psycopg.Error) as err, as_key(conn, "fleet_worker", {"role": "fleet_worker", "fleet_lanes": ["*"]}):
            conn.execute(query, params)
        assert err.value.sqlstate == "42501", (query, err.value)
    # an operator key limited to docs cannot resume, review, re-budget, cancel or retry a bugfix
    # task: they are unknown to it
    op_docs = {"role": "fleet_operator", "fleet_lanes": ["docs"]}
    for query in ("select fleet.resume(%s)", "select fleet.review_approve(%s)", "select fleet.review_reject(%s, 'n')",
                  "select fleet.resume(%s, p_max_tokens => 1)", "select fleet.cancel(%s)", "select fleet.retry(%s)"):
        theirs = _answer(conn, op_docs, query, (world["task"],), names)
        assert theirs == _answer(conn, op_docs, query, (UNKNOWN,), names), query
        assert "LF003" in theirs[0] and "unknown task <task>" in theirs[0], (query, theirs)
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

    for call, code in ((lambda: leases(conn, bug_s, 1), "LF006"),
                       (lambda: conn.execute("select fleet.complete(%s, %s)", (bug_task, bug_token)), "LF003"),
                       (lambda: conn.execute("select fleet.enqueue('bugfix', 'b:new')"), LANE_NOT_ALLOWED),
                       (lambda: conn.execute("select fleet.heartbeat(%s)", (bug_s,)), "LF006")):
        with as_key(conn, "fleet_worker", docs_key), pytest.raises(psycopg.Error) as err:
            call()
        assert err.value.sqlstate == code, err.value
        if code == LANE_NOT_ALLOWED:
            assert "'bugfix' is not allowed" in str(err.value)
        else:
            assert "bugfix" not in str(err.value) and "unknown" in str(err.value)
    # a worker key without claims works no lane at all (its own sessions are unknown to it)
    with as_key(conn, "fleet_worker", None), pytest.raises(psycopg.Error) as err:
        leases(conn, docs_s, 1)
    assert err.value.sqlstate == "LF006"
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
    # the bugfix task, with its real token or a made-up one, is unknown to a docs key (like a task
    # that does not exist) and left untouched
    with as_key(conn, "fleet_worker", DOCS_WORKER):
        assert complete_many(conn, [b["id"]], [b["lease_token"]]) == [(b["id"], "unknown")]
        assert complete_many(conn, [b["id"]], [uuid.uuid4()]) == [(b["id"], "unknown")]
    assert rows(conn, "select id, state from fleet.tasks order by id") == before
    with as_key(conn, "fleet_worker", DOCS_WORKER):
        assert complete_many(conn, [d["id"], b["id"]], [d["lease_token"], b["lease_token"]]) == [
            (d["id"], "done"), (b["id"], "unknown")]
    assert task(conn, b["id"])["state"] == "running"


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
    assert one(conn, "select array_agg(key::text order by key) from fleet.tasks") == ["bug:1"]
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


# ------------------------------------------------------------------------------------------------
# what a lane-scoped key reads: every view and table of schema fleet (tests/laneworld.py: two lanes
# with every kind of row; lane B recognisable wherever it turns up)


def _relations(conn: psycopg.Connection) -> list[tuple[str, str]]:
    """(name, kind) of every table and view of schema fleet: a new one is read here too."""
    return [(r["relname"], r["relkind"]) for r in rows(conn, """
        select relname, relkind::text from pg_class
         where relnamespace = 'fleet'::regnamespace and relkind in ('r', 'p', 'v', 'm') order by relname""")]


def _has_lane(conn: psycopg.Connection, rel: str) -> bool:
    return bool(one(conn, "select count(*) from pg_attribute where attrelid = %s::regclass and attname = 'lane'"
                          " and not attisdropped", (f"fleet.{rel}",)))


def _read(conn: psycopg.Connection, rel: str, claims: dict[str, Any] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | str]:
    """In one transaction (one now()): the owner's rows, then the key's (or its error's SQLSTATE),
    in one order (a view without ORDER BY may give its rows in another order to another plan)."""
    query = f"select * from fleet.{rel} x order by x::text"
    with conn.transaction(force_rollback=True):
        owner = rows(conn, query)
        if claims is None:
            return owner, owner
        conn.execute("select set_config('role', %s, true)", (claims["role"],))
        conn.execute("select set_config('request.jwt.claims', %s, true)", (json.dumps(claims),))
        try:
            with conn.transaction():
                return owner, rows(conn, query)
        except psycopg.Error as exc:
            return owner, str(exc.sqlstate)


@pytest.fixture
def two_lanes(conn: psycopg.Connection) -> Any:
    import laneworld

    return laneworld.build(conn)


def test_every_view_and_table_gives_a_lane_scoped_operator_its_lanes_rows_only(
        conn: psycopg.Connection, two_lanes: Any) -> None:
    import laneworld

    op_a = {"role": "fleet_operator", "fleet_lanes": [laneworld.A]}
    relations = _relations(conn)
    assert {"lane_overview", "throughput_hourly", "pool_overview", "tasks", "pools"} <= {r for r, _ in relations}
    for rel, kind in relations:
        owner, mine = _read(conn, rel, op_a)
        assert isinstance(mine, list), f"fleet.{rel}: {mine} for an operator key"
        leaked = laneworld.leaks(two_lanes, laneworld.as_json(mine))
        assert leaked == [], f"fleet.{rel} shows lane B to a lane-A operator: {leaked[:5]}"
        if _has_lane(conn, rel):
            # exactly the owner's rows of lane A: nothing missing, figures counted the same
            assert mine == [r for r in owner if r["lane"] == laneworld.A], f"fleet.{rel}"
            assert mine, f"fleet.{rel}: lane A has rows there"
        elif kind == "v":
            assert mine, f"fleet.{rel}: lane A has rows there"


def test_what_a_lane_scoped_operator_sees_of_the_shared_pools(conn: psycopg.Connection, two_lanes: Any) -> None:
    import laneworld

    op_a = {"role": "fleet_operator", "fleet_lanes": [laneworld.A]}
    owner, mine = _read(conn, "pool_overview", op_a)
    assert isinstance(mine, list)
    # the pools its lanes draw from, not lane B's own
    assert {r["pool"] for r in owner} == {"shared-pool", "lanea-pool", "laneb-pool"}
    assert {r["pool"] for r in mine} == {"shared-pool", "lanea-pool"}
    shared = {r["pool"]: r for r in owner}["shared-pool"], {r["pool"]: r for r in mine}["shared-pool"]
    # the pool's own state as it is (it decides when lane A claims too); lane B's message not
    assert shared[1]["slots"] == shared[0]["slots"] and shared[1]["throttled_until"] == shared[0]["throttled_until"]
    assert shared[0]["throttle_note"] == "laneb usage limit reached" and shared[1]["throttle_note"] is None
    # counts of lane A's tasks and events only
    in_use_a = one(conn, "select count(*) from fleet.tasks where state = 'running' and pool = 'shared-pool'"
                         " and lane = %s", (laneworld.A,))
    assert 0 < shared[1]["in_use"] == in_use_a < shared[0]["in_use"]
    assert shared[1]["throttles_today"] == 1 < shared[0]["throttles_today"] == 2
    assert shared[1]["profiles"] == "shared-prof"
    _, profiles = _read(conn, "profiles", op_a)
    assert isinstance(profiles, list) and {p["name"] for p in profiles} == {"shared-prof", "lanea-prof"}
    # the table itself, whose rows carry the note: to keys of every lane only
    _, pools = _read(conn, "pools", op_a)
    assert pools == []
    _, rates = _read(conn, "pool_accept_rate", op_a)
    assert isinstance(rates, list) and {r["pool"] for r in rates} <= {"shared-pool", "lanea-pool"}
    assert sum(r["runs"] for r in rates) == one(conn, "select count(*) from fleet.runs where lane = %s"
                                                      " and pool is not null", (laneworld.A,))


def test_a_worker_key_reads_its_lanes_tables_and_no_view(conn: psycopg.Connection, two_lanes: Any) -> None:
    import laneworld

    worker_a = {"role": "fleet_worker", "fleet_lanes": [laneworld.A]}
    for rel, kind in _relations(conn):
        _, mine = _read(conn, rel, worker_a)
        if isinstance(mine, str):  # no grant: the views, pools, profiles, the roll-ups
            assert mine == "42501", f"fleet.{rel}: {mine}"
            assert kind == "v" or rel in ("pools", "profiles", "lane_hours", "lane_hours_rollup", "sources",
                                          "source_items", "pool_window_readings"), rel
            continue
        # (fleet.journal: the journal a worker could read as fleet.events, the rows it reads with
        # them; an invoker's view, through the same row policies)
        assert kind != "v" or rel == "journal", f"a worker key reads the view fleet.{rel}"
        assert laneworld.leaks(two_lanes, laneworld.as_json(mine)) == [], f"fleet.{rel}"
        if rel == "journal":
            assert {r["lane"] for r in mine} == {laneworld.A}


def test_an_operator_key_without_lanes_reads_everything(conn: psycopg.Connection, two_lanes: Any) -> None:
    """Every view and table, as the owner reads it: throughput_hourly and usage_by_lane_day too."""
    for claims in ({"role": "fleet_operator"}, {"role": "fleet_operator", "fleet_lanes": ["*"]},
                   {"role": "service_role"}):
        for rel, _ in _relations(conn):
            owner, mine = _read(conn, rel, claims)
            assert mine == owner, (claims, rel, mine if isinstance(mine, str) else len(mine))


def test_the_read_functions_give_a_lane_scoped_operator_its_lanes_only(conn: psycopg.Connection,
                                                                       two_lanes: Any) -> None:
    import laneworld

    op_a = {"role": "fleet_operator", "fleet_lanes": [laneworld.A]}
    calls = ["select * from fleet.lane_summary()", "select * from fleet.ready_by_lane()",
             "select * from fleet.stalled_tasks()",
             "select * from fleet.lane_hours_since(now() - interval '30 days')",
             "select * from fleet.lane_hours_between(now() - interval '30 days', now())",
             "select * from fleet.cohort_metrics(now() - interval '1 day', now() + interval '1 hour')",
             "select * from fleet.cohort_split(now() - interval '1 day', now() + interval '1 hour')",
             "select * from fleet.workspaces_to_reap('laneb-host-1')",
             "select * from fleet.workspaces_to_reap('lanea-host-1')",
             "select * from fleet._lane_spend_today('lane-b')"]
    for query in calls:
        with as_key(conn, "fleet_operator", op_a):
            got = rows(conn, query)
        assert laneworld.leaks(two_lanes, laneworld.as_json(got)) == [], query
        assert got or "laneb-host" in query, query  # lane A has some
    # a lane it may not see counts as a lane without anything
    for fn in ("cohort_metrics", "cohort_split"):
        q = f"select * from fleet.{fn}(now() - interval '1 day', now() + interval '1 hour', %s)"
        with as_key(conn, "fleet_operator", op_a):
            theirs, nothing = rows(conn, q, (laneworld.B,)), rows(conn, q, ("lane-none",))
        assert [{**r, "lane": None} for r in theirs] == [{**r, "lane": None} for r in nothing], fn
        assert all(r["tasks"] == 0 for r in theirs)
    # and the roll-up, which writes every lane's hours, is refused
    with as_key(conn, "fleet_operator", op_a), refused("LF008"):
        conn.execute("select fleet.roll_up_lane_hours(0)")


def test_every_view_is_read_only_for_every_key(conn: psycopg.Connection) -> None:
    """SELECT is the only privilege a key role holds on a view, and each view has the read_only
    trigger, so that a write is refused by the privilege check (42501) and never by "cannot update
    view" (55000, an HTTP 500 through PostgREST)."""
    views = [r[0] for r in conn.execute("select relname from pg_class where relnamespace = 'fleet'::regnamespace"
                                        " and relkind = 'v' order by 1").fetchall()]
    assert "lane_overview" in views
    for view in views:
        triggers = rows(conn, """select t.tgname, t.tgfoid::regproc::text as fn from pg_trigger t
                                  where t.tgrelid = %s::regclass and not t.tgisinternal""", (f"fleet.{view}",))
        assert triggers == [{"tgname": "read_only", "fn": "fleet._read_only_view"}], view
        for role in ("fleet_operator", "fleet_worker", "anon", "authenticated"):
            for privilege in ("INSERT", "UPDATE", "DELETE", "TRUNCATE"):
                assert not one(conn, "select has_table_privilege(%s, %s, %s)", (role, f"fleet.{view}", privilege)), \
                    (view, role, privilege)
    # as the owner (every privilege), the trigger refuses
    with refused("42501") as err:
        conn.execute("insert into fleet.blocked_tasks (id, lane, key) values (1, 'a', 'k')")
    assert "read-only view" in str(err.value)
