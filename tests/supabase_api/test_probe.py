"""The key-side probe of issue #19: every table, view and function of schema ``fleet`` that PostgREST
exposes, walked through the real stack (nginx → PostgREST 12 → PostgreSQL) with a lane-A worker key
and a lane-A operator key, and with keys that must not be believed (none, anon, a wrong secret, an
expired one).

The world is tests/laneworld.py: lanes ``lane-a`` and ``lane-b`` with every kind of row, lane B
recognisable wherever it shows (its texts, ids and uuids: ``laneworld.leaks``). What is walked comes
from pg_catalog at test time, so a new view or function is probed without a line here: every
relation gets GET (all rows, and rows of lane B by a filter) and POST, PATCH, DELETE; every function
is called by RPC with arguments built from its signature (pg_proc): lane B's objects substituted by
parameter name (``SUBSTITUTE``: p_task, p_session, p_token, p_lane, p_key, p_batch, ...), the same
call aimed at objects that do not exist, and, for a function that takes a lane and an object, the
object of lane B with the key's own lane. A parameter the probe does not know fails the test (say
in ``SUBSTITUTE`` what lane-B object it names, or in ``NEUTRAL`` that it names none).

Asserted for every call: no row or text of lane B comes back; the answer about lane B's object is
exactly the answer about one that does not exist (status, code, message, details, hint, with the
ids given replaced by their parameter's name, and ids the probe's own calls made by ``<new id>``);
no answer is a 5xx; and the database is unchanged (every fleet table and sequence, compared after
each call) — but for a write to the key's own lane, which is its right: there, lane B's rows stay
unchanged and the call about lane B's objects changes what the call about nothing's changes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import laneworld
import psycopg
import pytest
from psycopg.rows import dict_row
from supabase_stack import key, raw_jwt

from worker.dev.devstack import DevStack

NONE_ID = 987_654_321  # no task, batch or workspace has this id
NONE_LANE, NONE_POOL, NONE_PROFILE, NONE_HOST = "lane-none", "none-pool", "none-prof", "none-host"
NONE_KEY = "lane-none:q1"
NONE_SOURCE, NONE_REF = "none-source", "none/repo#1"
NONE_TOKEN, NONE_SESSION = "00000000-0000-4000-8000-0000000000a1", "00000000-0000-4000-8000-0000000000a2"

# What each parameter name names, as (lane B's, nothing's), from the world and the parameter's type.
Sub = Callable[[laneworld.World, str], tuple[Any, Any]]


SUBSTITUTE: dict[str, Sub] = {
    "p_task": lambda w, t: (w.b.task, NONE_ID),
    "p_carrier": lambda w, t: (w.b.carrier, NONE_ID),
    "p_batch": lambda w, t: (w.b.batch, NONE_ID),
    "p_id": lambda w, t: (w.b.workspace, NONE_ID),  # workspace_reaped
    "p_token": lambda w, t: (w.b.token, NONE_TOKEN),
    "p_session": lambda w, t: (w.b.session, NONE_SESSION),
    "p_lane": lambda w, t: (w.b.name, NONE_LANE),
    "p_pool": lambda w, t: (w.b.pool, NONE_POOL),
    "p_profile": lambda w, t: (w.b.profile, NONE_PROFILE),
    "p_host": lambda w, t: (w.b.host, NONE_HOST),
    "p_key": lambda w, t: (w.b.queued_key, NONE_KEY),
    "p_keys": lambda w, t: ([w.b.queued_key], [NONE_KEY]),
    "p_tasks": lambda w, t: (([{"key": w.b.queued_key}], [{"key": NONE_KEY}]) if t == "jsonb"
                             else ([w.b.task], [NONE_ID])),
    "p_tokens": lambda w, t: ([w.b.token], [NONE_TOKEN]),
    "p_progressed": lambda w, t: ([w.b.task], [NONE_ID]),
    "p_attention": lambda w, t: ({str(w.b.task): "probe"}, {str(NONE_ID): "probe"}),
    "p_source": lambda w, t: (w.b.source, NONE_SOURCE),
    "p_ref": lambda w, t: (w.b.source_ref, NONE_REF),
    "p_lanes": lambda w, t: ([w.b.name], [NONE_LANE]),
}
# p_name is a lane, a pool or a profile, by function
NAME_OF = {"sync_lane": "p_lane", "sync_pool": "p_pool", "sync_profile": "p_profile"}
LANE_PARAMS = {"p_lane"}
OBJECT_PARAMS = set(SUBSTITUTE) - LANE_PARAMS - {"p_pool", "p_profile", "p_host"}

# Parameters that name no lane's object: a value of their type, the same in every variant.
NEUTRAL = {
    "p_reason", "p_note", "p_error", "p_evidence", "p_data", "p_snapshot", "p_report", "p_result",
    "p_results", "p_settings", "p_models", "p_payload", "p_outcome", "p_step", "p_gate", "p_base",
    "p_branch", "p_worktree", "p_cut_sha", "p_from", "p_to", "p_n", "p_size", "p_limit", "p_max",
    "p_lag_seconds", "p_pid", "p_pid_started_at", "p_seconds", "p_delay_seconds", "p_slots",
    "p_priority", "p_kind", "p_detail", "p_code", "p_message", "p_hint", "p_ts", "p_heartbeat",
    "p_lease_seconds", "p_session_timeout_seconds", "p_task_state", "p_finished_at", "p_last_used_at",
    "p_lane_config", "p_usage", "p_tier", "p_bytes", "p_bytes_freed", "p_retryable", "p_until",
    "p_after_seconds", "p_signal", "p_idle_seconds", "p_overdue_grace_seconds", "p_split",
    "p_max_attempts", "p_title", "p_run_at", "p_max_cost_usd", "p_max_tokens", "p_throttle_floor", "p_path",
    "p_failures_before", "p_by", "p_since",
    # a source's pass: what the tracker said
    "p_items", "p_pr", "p_cache", "p_cursor", "p_resume_at", "p_sha", "p_runs", "p_verdict", "p_revert_sha",
    "p_reverted_at", "p_value", "p_why",
    # a pool's usage windows
    "p_windows", "p_reserve", "p_name", "w", "p_reading", "p_room", "p_tokens", "p_usd", "r",
    # rows of a table: the private helpers that take one (no key role may call them)
    "b", "m", "t", "l",
    # a private helper of fleet.route (no key role may call it): the task already holding a key
    "p_holder", "p_holder_lane",
}



# ------------------------------------------------------------------------------------------------
# the catalog: what PostgREST exposes of schema fleet


@dataclass
class Fn:
    name: str
    args: list[tuple[str, str, bool]]  # (name, type, has a default)
    volatile: bool
    trigger: bool
    may: dict[str, bool]  # role -> EXECUTE


@dataclass
class Rel:
    name: str
    kind: str
    columns: list[str]
    types: list[str]


def catalog(db_url: str) -> tuple[list[Rel], list[Fn]]:
    with psycopg.connect(db_url, row_factory=dict_row) as c:
        rels = [Rel(r["relname"], r["relkind"], r["cols"], r["types"]) for r in c.execute("""
            select c.relname, c.relkind::text,
                   array(select a.attname::text from pg_attribute a where a.attrelid = c.oid and a.attnum > 0
                          and not a.attisdropped order by a.attnum) as cols,
                   array(select format_type(a.atttypid, null) from pg_attribute a where a.attrelid = c.oid
                          and a.attnum > 0 and not a.attisdropped order by a.attnum) as types
              from pg_class c
             where c.relnamespace = 'fleet'::regnamespace and c.relkind in ('r', 'p', 'v', 'm')
             order by c.relname""").fetchall()]
        fns = []
        for r in c.execute("""
                select p.proname, p.pronargs, p.pronargdefaults, p.provolatile = 'v' as volatile,
                       p.prorettype = 'trigger'::regtype as trigger,
                       coalesce(p.proargnames, '{}') as names,
                       array(select format_type(t, null) from unnest(p.proargtypes) t) as types,
                       has_function_privilege('fleet_worker', p.oid, 'execute') as worker,
                       has_function_privilege('fleet_operator', p.oid, 'execute') as operator
                  from pg_proc p where p.pronamespace = 'fleet'::regnamespace order by p.proname""").fetchall():
            n, nd = r["pronargs"], r["pronargdefaults"]
            args = [(r["names"][i], r["types"][i], i >= n - nd) for i in range(n)]
            fns.append(Fn(r["proname"], args, r["volatile"], r["trigger"],
                          {"worker": r["worker"], "operator": r["operator"]}))
    return rels, fns


# ------------------------------------------------------------------------------------------------
# the world, the calls, the answers


@dataclass
class Probe:
    stack: DevStack
    world: laneworld.World
    rels: list[Rel]
    fns: list[Fn]
    http: httpx.Client

    def request(self, method: str, path: str, bearer: str | None, *, body: Any = None,
                params: dict[str, str] | None = None, apikey: str | None = "anon") -> tuple[int, Any]:
        headers = {"Accept-Profile": "fleet", "Content-Profile": "fleet", "Content-Type": "application/json"}
        if apikey == "anon":
            headers["apikey"] = self.stack.anon_key
        if bearer:
            headers["Authorization"] = f"Bearer {bearer}"
        r = self.http.request(method, f"{self.stack.url}/rest/v1/{path}", headers=headers,
                              content=None if body is None else json.dumps(body), params=params)
        try:
            return r.status_code, r.json() if r.content else None
        except ValueError:
            return r.status_code, r.text

    def fingerprint(self, lane: str | None = None) -> dict[str, str]:
        """A digest of every row of every fleet table, and every fleet sequence's position; with
        ``lane``, of that lane's rows of each table with a lane column (no sequences)."""
        with psycopg.connect(self.stack.db_url) as c:
            parts = [r[0] for r in c.execute(
                """select format('select %%L, md5(coalesce(string_agg(x::text, ''|'' order by x::text), ''''))'
                                 ' from %%s x', c.relname, c.oid::regclass)
                          || coalesce(' where x.lane = ' || quote_literal(%(lane)s::text), '')
                     from pg_class c where c.relnamespace = 'fleet'::regnamespace and c.relkind in ('r', 'p')
                      and (%(lane)s::text is null
                           or exists (select 1 from pg_attribute a where a.attrelid = c.oid and a.attname = 'lane'
                                         and not a.attisdropped))
                    union all
                   select format('select %%L, last_value::text || is_called::text from %%s', c.relname, c.oid::regclass)
                     from pg_class c where c.relnamespace = 'fleet'::regnamespace and c.relkind = 'S'
                      and %(lane)s::text is null""", {"lane": lane}).fetchall()]
            return dict(c.execute(" union all ".join(parts)).fetchall())  # type: ignore[arg-type]


@pytest.fixture
def probe(stack: DevStack) -> Iterator[Probe]:
    with psycopg.connect(stack.db_url, autocommit=True) as conn:
        world = laneworld.build(conn)
    rels, fns = catalog(stack.db_url)
    with httpx.Client(timeout=30) as http:
        yield Probe(stack, world, rels, fns, http)


def neutral(name: str, typ: str, now: datetime) -> Any:
    if name == "p_to":
        return (now + timedelta(hours=1)).isoformat() if "timestamp" in typ else "probe"
    if "timestamp" in typ:
        return (now - timedelta(days=30)).isoformat()
    if typ in ("jsonb", "json") or typ.startswith("fleet."):
        return {}
    if typ.endswith("[]"):
        return ["probe"]
    return {"integer": 1, "bigint": 1, "smallint": 1, "numeric": 1, "double precision": 1, "boolean": True,
            "uuid": "00000000-0000-4000-8000-0000000000a9"}.get(typ, "probe")


def variants(fn: Fn, world: laneworld.World, now: datetime) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(what, lane B's arguments, nothing's arguments) for each way to aim the call at lane B."""
    theirs: dict[str, Any] = {}
    nothing: dict[str, Any] = {}
    unknown = []
    kinds: dict[str, str] = {}
    for name, typ, has_default in fn.args:
        kind = NAME_OF.get(fn.name, "p_lane") if name == "p_name" else name
        kinds[name] = kind
        if kind in SUBSTITUTE:
            theirs[name], nothing[name] = SUBSTITUTE[kind](world, typ)
        elif has_default:
            continue
        elif name in NEUTRAL:
            theirs[name] = nothing[name] = neutral(name, typ, now)
        else:
            unknown.append(name)
    assert not unknown, (f"fleet.{fn.name}: the probe does not know what {unknown} name: add them to SUBSTITUTE "
                         "(a lane's object) or NEUTRAL (none)")
    out = [("lane B's", theirs, nothing)]
    lanes = [n for n, k in kinds.items() if k in LANE_PARAMS and n in theirs]
    if lanes and any(kinds[n] in OBJECT_PARAMS for n in theirs):
        # the key's own lane, lane B's objects (and nothing's)
        own_b = {**theirs, **dict.fromkeys(lanes, world.a.name)}
        own_none = {**nothing, **dict.fromkeys(lanes, world.a.name)}
        out.append(("own lane, lane B's objects", own_b, own_none))
    return out


def normalised(answer: tuple[int, Any], args: dict[str, Any], world: laneworld.World) -> Any:
    """The answer with each value given in ``args`` replaced by its parameter's name, in texts and
    as numbers (so answers about different ids compare), and each id the probe made by ``<new id>``."""
    values: list[tuple[str, str]] = []
    for name, value in args.items():
        items = value if isinstance(value, list) else list(value) if isinstance(value, dict) else [value]
        for v in items:
            v = v.get("key") if isinstance(v, dict) else v
            if isinstance(v, str | int) and not isinstance(v, bool):
                values.append((str(v), f"<{name}>"))
    values.sort(key=lambda kv: -len(kv[0]))

    def text(t: str) -> str:
        for value, name in values:
            t = re.sub(rf"(?<![\w-]){re.escape(value)}(?![\w-])", name, t)
        return t

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            return {text(str(k)): walk(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [walk(v) for v in x]
        if isinstance(x, str):
            return text(x)
        if isinstance(x, int) and not isinstance(x, bool):
            if text(str(x)) != str(x):
                return text(str(x))
            # an id the probe's own calls made (lane A's ids lie below lane B's, which are known)
            return "<new id>" if x > laneworld.B_IDS_FROM and x not in world.b_ints else x
        return x

    return walk(list(answer))


def masked(x: Any, echoes: Sequence[str]) -> Any:
    """``x`` with each text in ``echoes`` replaced by ``<echo>``."""
    if isinstance(x, dict):
        return {masked(k, echoes): masked(v, echoes) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [masked(v, echoes) for v in x]
    if isinstance(x, str):
        for e in echoes:
            x = x.replace(e, "<echo>")
    return x


def aimed(answer_b: tuple[int, Any], args_b: dict[str, Any], answer_none: tuple[int, Any],
          args_none: dict[str, Any], world: laneworld.World, echoes: Sequence[str] = ()) -> list[str]:
    """What is wrong with an answer about lane B's objects, next to the same call about nothing.
    ``echoes``: texts of lane B's the key itself wrote into its own lane earlier (a task of lane A
    given lane B's key: a key is per lane), which a later read of its lane rightly shows."""
    problems = []
    b, none = normalised(answer_b, args_b, world), normalised(answer_none, args_none, world)
    b, none = masked(b, echoes), masked(none, echoes)
    # (a call that names no object is made twice alike: its answers may differ by the clock)
    if args_b != args_none and b != none:
        problems.append(f"lane B's answer {json.dumps(b)[:300]} differs from nothing's {json.dumps(none)[:300]}")
    leaked = laneworld.leaks(world, b)
    if leaked:
        problems.append(f"shows lane B: {leaked[:3]}")
    if answer_b[0] >= 500 or answer_none[0] >= 500:
        problems.append(f"HTTP {answer_b[0]} / {answer_none[0]}: {json.dumps(b)[:200]}")
    return problems


def walk_functions(p: Probe, role: str, bearer: str | None, apikey: str | None = "anon") -> dict[str, list[str]]:
    """Every function, every variant: function name -> what is wrong ([] when nothing)."""
    now = datetime.now(UTC)
    found: dict[str, list[str]] = {}
    echoes: list[str] = []
    for fn in p.fns:
        problems: list[str] = []
        for what, args_b, args_none in variants(fn, p.world, now):
            before, b_before = p.fingerprint(), p.fingerprint(p.world.b.name)
            answer_b = p.request("POST", f"rpc/{fn.name}", bearer, body=args_b, apikey=apikey)
            after_b = p.fingerprint()
            answer_none = p.request("POST", f"rpc/{fn.name}", bearer, body=args_none, apikey=apikey)
            after_none, b_after = p.fingerprint(), p.fingerprint(p.world.b.name)
            problems += [f"{what}: {x}" for x in aimed(answer_b, args_b, answer_none, args_none, p.world, echoes)]
            if what.startswith("own lane") and answer_b[0] < 400:
                echoes += [v for k, v in args_b.items() if isinstance(v, str) and k in OBJECT_PARAMS]
            changed_b = sorted(k for k in before if before[k] != after_b.get(k))
            changed_none = sorted(k for k in after_b if after_b[k] != after_none.get(k))
            if b_after != b_before:
                problems.append(f"{what}: changed lane B's rows of "
                                f"{sorted(k for k in b_before if b_before[k] != b_after.get(k))}: {answer_b}")
            elif what.startswith("own lane"):
                # a write to its own lane is the key's right; what it writes must not depend on
                # whether the objects it names are lane B's or nothing's
                if changed_b != changed_none:
                    problems.append(f"{what}: the call about lane B's objects changed {changed_b}, "
                                    f"about nothing's {changed_none}: {answer_b}")
            else:
                for label, changed in (("lane B's", changed_b), ("nothing's", changed_none)):
                    if changed:
                        problems.append(f"{what}: the call about {label} objects changed {changed}: {answer_b}")
            if not fn.may.get(role, False) and answer_b[0] < 400:
                problems.append(f"{what}: answered {answer_b[0]} without EXECUTE")
        found[fn.name] = problems
    return found


def filter_of(rel: Rel, world: laneworld.World) -> tuple[str, str, str] | None:
    """(column, lane B's value, nothing's value) to aim a request at lane B's rows of ``rel``."""
    if "lane" in rel.columns:
        return "lane", world.b.name, NONE_LANE
    if rel.name in ("pools", "profiles"):
        return "name", {"pools": world.b.pool, "profiles": world.b.profile}[rel.name], NONE_POOL
    if rel.name == "lanes":
        return "name", world.b.name, NONE_LANE
    if rel.name == "batch_members":
        return "batch_id", str(world.b.batch), str(NONE_ID)
    return None


def send(p: Probe, method: str, rel: str, column: str, value: str, bearer: str | None,
         apikey: str | None) -> tuple[int, Any]:
    """A request on ``rel`` aimed at its rows whose ``column`` is ``value`` (POST: one such row)."""
    if method == "POST":
        return p.request("POST", rel, bearer, body={column: value}, apikey=apikey)
    return p.request(method, rel, bearer, params={column: f"eq.{value}"},
                     body={column: value} if method == "PATCH" else None, apikey=apikey)


def walk_relations(p: Probe, bearer: str | None, apikey: str | None = "anon") -> tuple[dict[str, list[str]], dict[str, Any]]:
    """Every table and view: GET, GET lane B's rows, POST, PATCH and DELETE aimed at them. Also the
    rows each GET gave (relation -> rows, or the refusal)."""
    found: dict[str, list[str]] = {}
    got: dict[str, Any] = {}
    for rel in p.rels:
        problems: list[str] = []
        before = p.fingerprint()
        status, rows = p.request("GET", rel.name, bearer, params={"select": "*"}, apikey=apikey)
        got[rel.name] = rows if status == 200 else (status, rows)
        if status >= 500:
            problems.append(f"GET: HTTP {status} {rows}")
        if status == 200:
            leaked = laneworld.leaks(p.world, rows)
            if leaked:
                problems.append(f"GET shows lane B: {leaked[:3]}")
        aim = filter_of(rel, p.world)
        if aim:
            column, b_value, none_value = aim
        else:  # a table of no lane (the roll-up's mark): a value of its first column's type, twice
            column = rel.columns[0]
            b_value = none_value = {"boolean": "true", "integer": "1", "bigint": "1"}.get(rel.types[0], "probe")
        for method in ("GET", "POST", "PATCH", "DELETE"):
            answer_b, answer_none = (send(p, method, rel.name, column, v, bearer, apikey) for v in (b_value, none_value))
            problems += [f"{method} aimed at lane B: {x}"
                         for x in aimed(answer_b, {column: b_value}, answer_none, {column: none_value}, p.world)]
            if method != "GET" and (answer_b[0] < 400 or answer_b[0] >= 500
                                    or not isinstance(answer_b[1], dict) or answer_b[1].get("code") not in
                                    ("42501", "PGRST301", "PGRST302", None)):
                problems.append(f"{method} is not refused as a privilege: {answer_b}")
        after = p.fingerprint()
        if after != before:
            problems.append(f"changed {sorted(k for k in before if before[k] != after.get(k))}")
        found[rel.name] = problems
    return found, got


def report(found: dict[str, list[str]]) -> str:
    return "\n".join(f"  fleet.{name}: " + "\n      ".join(problems) for name, problems in found.items() if problems)


# ------------------------------------------------------------------------------------------------
# the keys of lane A


@pytest.mark.parametrize("role", ["worker", "operator"])
def test_a_lane_a_key_learns_nothing_of_lane_b_anywhere(probe: Probe, role: str) -> None:
    p, w = probe, probe.world
    bearer = key(p.stack, role, [laneworld.A])

    relations, rows = walk_relations(p, bearer)
    assert report(relations) == "", "\n" + report(relations)
    # not vacuous: the key reads lane A where it may
    assert {r["lane"] for r in rows["tasks"]} == {laneworld.A}
    if role == "operator":
        for view in ("lane_overview", "stuck_tasks", "session_overview", "recent_repairs", "dead_letters",
                     "blocked_tasks", "attention_tasks", "review_queue", "review_accept_rate",
                     "throughput_hourly", "usage_by_lane_day", "workspace_usage", "batch_overview"):
            assert rows[view] and {r["lane"] for r in rows[view]} == {laneworld.A}, (view, rows[view])
        assert {r["pool"] for r in rows["pool_overview"]} == {laneworld.SHARED_POOL, "lanea-pool"}
        assert rows["pools"] == []  # the table: keys of every lane only (its rows carry the note)
    else:
        assert rows["lane_overview"][0] in (401, 403)

    functions = walk_functions(p, role, bearer)
    assert report(functions) == "", "\n" + report(functions)
    # every function was called: none skipped
    assert set(functions) == {fn.name for fn in p.fns}
    assert w.b.task in w.b_ints


def test_an_operator_key_of_every_lane_reads_every_view(probe: Probe) -> None:
    """throughput_hourly and usage_by_lane_day included (their helpers are granted to operators)."""
    p = probe
    for bearer in (key(p.stack, "operator"), key(p.stack, "operator", ["*"])):
        for rel in p.rels:
            status, rows = p.request("GET", rel.name, bearer, params={"select": "*"})
            assert status == 200, (rel.name, status, rows)
            if "lane" in rel.columns:
                assert {laneworld.A, laneworld.B} <= {r["lane"] for r in rows}, rel.name


def test_every_relation_and_function_is_probed(probe: Probe) -> None:
    """What the walks cover is what the catalog has."""
    with psycopg.connect(probe.stack.db_url) as c:
        names = {r[0] for r in c.execute("select proname from pg_proc where pronamespace = 'fleet'::regnamespace")}
        relations = {r[0] for r in c.execute("select relname from pg_class where relnamespace = 'fleet'::regnamespace"
                                              " and relkind in ('r', 'p', 'v', 'm')")}
    assert {f.name for f in probe.fns} == names and {r.name for r in probe.rels} == relations
    # every parameter is one the probe knows (variants() fails on any other)
    for fn in probe.fns:
        assert variants(fn, probe.world, datetime.now(UTC)), fn.name


# ------------------------------------------------------------------------------------------------
# keys that must not be believed


def bad_keys(stack: DevStack) -> dict[str, tuple[str | None, str | None]]:
    """name -> (bearer, apikey)."""
    return {
        "no key": (None, None),
        "anon": (None, "anon"),
        "wrong secret": (raw_jwt({"role": "fleet_operator", "fleet_lanes": [laneworld.B]}, "w" * 40), "anon"),
        "expired": (raw_jwt({"role": "fleet_operator", "fleet_lanes": [laneworld.B]}, stack.jwt_secret, ttl=-120),
                    "anon"),
    }


@pytest.mark.parametrize("which", ["no key", "anon", "wrong secret", "expired"])
def test_keys_that_must_not_be_believed_learn_nothing(probe: Probe, which: str) -> None:
    p = probe
    bearer, apikey = bad_keys(p.stack)[which]
    before = p.fingerprint()
    relations, rows = walk_relations(p, bearer, apikey)
    assert report(relations) == "", "\n" + report(relations)
    for rel, answer in rows.items():
        assert isinstance(answer, tuple) and answer[0] in (401, 403), (rel, answer)
    functions = walk_functions(p, "anon", bearer, apikey)
    assert report(functions) == "", "\n" + report(functions)
    assert p.fingerprint() == before
    # nor does the API's description name what it holds
    status, doc = p.request("GET", "", bearer, apikey=apikey)
    assert status in (401, 403) or not any(r.name in json.dumps(doc) for r in p.rels if len(r.name) > 5), doc


def test_the_probe_catches_a_view_that_shows_another_lane(probe: Probe) -> None:
    """The walk is not vacuous: a view that reads as its owner again is found (and put back)."""
    p = probe
    with psycopg.connect(p.stack.db_url, autocommit=True) as c:
        c.execute("alter view fleet.blocked_tasks reset (security_invoker)")
        try:
            relations, _ = walk_relations(p, key(p.stack, "operator", [laneworld.A]))
        finally:
            c.execute("alter view fleet.blocked_tasks set (security_invoker = true)")
    assert set(name for name, problems in relations.items() if problems) == {"blocked_tasks"}
    assert "shows lane B" in relations["blocked_tasks"][0]
