"""Every refusal of a fleet key, through the real stack (supabase-py → nginx → PostgREST 12 →
PostgreSQL), each checking through a direct connection that nothing changed.

The world: lanes ``docs`` and ``bugfix``, a running shift (session + claimed task) in each, a
queued task in each and a dead one in bugfix. A ``docs`` worker key must not see, claim,
heartbeat, checkpoint, complete (or anything else) bugfix work, nor enqueue into bugfix.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import httpx
import pytest
from postgrest.exceptions import APIError
from supabase import Client, ClientOptions, create_client
from supabase_stack import client, key, raw_jwt, snapshot, sql, store

from worker.dev.devstack import DevStack
from worker.errors import InvalidInput, LaneForbidden, SessionLost, UnknownLane, UnknownTask
from worker.store.supabase import AccessDenied

ZERO = "00000000-0000-0000-0000-000000000000"


@dataclass
class World:
    stack: DevStack
    docs_session: str
    docs_task: int
    docs_token: str
    docs_queued: int
    bug_session: str
    bug_task: int
    bug_token: str
    bug_queued: int
    bug_dead: int


@pytest.fixture
def world(stack: DevStack) -> World:
    """Built through a direct connection as the database owner (the trusted path)."""
    def one(q: str, params: Any = ()) -> Any:
        return next(iter(sql(stack, q, params)[0].values()))

    for lane in ("docs", "bugfix"):
        one("select fleet.sync_lane(%s, '{\"max_attempts\": 1}')", (lane,))
    ids = {}
    for lane in ("docs", "bugfix"):
        ids[lane] = [one("select fleet.enqueue(%s, %s, %s::jsonb)", (lane, f"{lane}:{i}", json.dumps({"n": i})))
                     for i in range(3)]
    sessions, claimed = {}, {}
    for lane in ("docs", "bugfix"):
        sessions[lane] = str(one("select fleet.open_session(%s, 'host-a', 4242, null, 600)", (lane,)))
        row = sql(stack, "select id, lease_token from fleet.claim(%s, 1)", (sessions[lane],))[0]
        claimed[lane] = (row["id"], str(row["lease_token"]))
    # the third bugfix task: claimed and failed for good (a dead letter, for retry)
    s = one("select fleet.open_session('bugfix', 'host-b', 4243, null, 600)")
    row = sql(stack, "select id, lease_token from fleet.claim(%s, 1)", (s,))[0]
    one("select fleet.fail(%s, %s, 'boom', false)", (row["id"], row["lease_token"]))
    one("select fleet.close_session(%s, 'done', '{}')", (s,))
    d = one("select fleet.open_session('docs', 'host-b', 4244, null, 600)")
    one("select fleet.close_session(%s, 'done', '{}')", (d,))  # a lane hand-off in each lane
    return World(stack, sessions["docs"], claimed["docs"][0], claimed["docs"][1], ids["docs"][1],
                 sessions["bugfix"], claimed["bugfix"][0], claimed["bugfix"][1], ids["bugfix"][1], row["id"])


def refused(call: Callable[[], Any], code: str | set[str]) -> APIError:
    """The call fails with that SQLSTATE/PostgREST code (a success fails the test)."""
    codes = {code} if isinstance(code, str) else code
    with pytest.raises(APIError) as err:
        res = call()
        pytest.fail(f"expected a refusal {codes}, got {getattr(res, 'data', res)!r}")
    assert err.value.code in codes, (err.value.code, err.value.message)
    return err.value


def every_call(w: World) -> dict[str, dict[str, Any]]:
    """Each RPC of the API with arguments aimed at bugfix work (what a docs key must not touch)."""
    return {
        "enqueue": {"p_lane": "bugfix", "p_key": "new:1"},
        "enqueue_task": {"p_lane": "bugfix", "p_key": "new:2", "p_payload": {}},
        "enqueue_after": {"p_delay_seconds": 0, "p_lane": "bugfix", "p_key": "new:3"},
        "open_session": {"p_lane": "bugfix", "p_host": "h", "p_pid": 1, "p_pid_started_at": None, "p_seconds": 60},
        "claim": {"p_session": w.bug_session, "p_limit": 1},
        "heartbeat": {"p_session": w.bug_session, "p_tasks": None},
        "checkpoint": {"p_task": w.bug_task, "p_token": w.bug_token, "p_data": {"x": 1}},
        "complete": {"p_task": w.bug_task, "p_token": w.bug_token, "p_result": None},
        "fail": {"p_task": w.bug_task, "p_token": w.bug_token, "p_error": "x", "p_retryable": True},
        "hand_off": {"p_task": w.bug_task, "p_token": w.bug_token, "p_snapshot": {}},
        "transient": {"p_task": w.bug_task, "p_token": w.bug_token, "p_error": "overloaded"},
        "drop_session": {"p_task": w.bug_task, "p_token": w.bug_token, "p_note": "gone"},
        "route": {"p_task": w.bug_task, "p_token": w.bug_token, "p_lane": "docs", "p_note": None},
        "record_run": {"p_token": w.bug_token, "p_report": {"input_tokens": 1}},
        "close_session": {"p_session": w.bug_session, "p_reason": "x", "p_snapshot": {}},
        "declare_session_lost": {"p_session": w.bug_session, "p_reason": "x"},
        "cancel": {"p_task": w.bug_task},
        "retry": {"p_task": w.bug_dead},
        "sync_lane": {"p_name": "bugfix", "p_settings": {"paused": True}},
        "reconcile": {"p_idle_seconds": 0, "p_overdue_grace_seconds": 0},
        "_release": {"p_task": w.bug_task, "p_reason": "x"},
        "_fenced": {"p_task": w.bug_task, "p_token": w.bug_token},
    }


# ------------------------------------------------------------------------------------------------
# anon (and a Supabase user's JWT) get nothing


@pytest.mark.parametrize("who", ["anon", "authenticated"])
def test_anon_and_plain_users_are_refused_everything(world: World, who: str) -> None:
    s = world.stack
    c = client(s) if who == "anon" else client(s, raw_jwt({"role": "authenticated", "aud": "authenticated",
                                                         "fleet_lanes": ["*"]}, s.jwt_secret))
    before = snapshot(s)
    for fn, params in {**every_call(world), "schema_versions": {}, "lane_summary": {},
                       "ready_by_lane": {}}.items():
        refused(lambda fn=fn, params=params: c.rpc(fn, params).execute(), "42501")
    for table in ("tasks", "sessions", "runs", "events", "lanes", "lane_handoffs", "lane_overview"):
        refused(lambda table=table: c.table(table).select("*").execute(), "42501")
    refused(lambda: c.table("tasks").insert({"lane": "docs", "key": "anon:1"}).execute(), "42501")
    refused(lambda: c.table("tasks").update({"state": "done"}).eq("id", world.docs_queued).execute(), "42501")
    refused(lambda: c.table("tasks").delete().eq("id", world.docs_queued).execute(), "42501")
    refused(lambda: c.table("lanes").upsert({"name": "docs", "paused": True}).execute(), "42501")
    assert snapshot(s) == before


# ------------------------------------------------------------------------------------------------
# a docs worker key and bugfix work


def test_docs_key_cannot_see_bugfix_rows(world: World) -> None:
    s = world.stack
    docs = client(s, key(s, "worker", ["docs"]))
    for table, lane_col in (("tasks", "lane"), ("sessions", "lane"), ("runs", "lane"), ("events", "lane"),
                            ("lane_handoffs", "lane"), ("lanes", "name")):
        rows = docs.table(table).select("*").execute().data
        assert rows and {r[lane_col] for r in rows} == {"docs"}, (table, rows)
        assert docs.table(table).select("*").eq(lane_col, "bugfix").execute().data == []
    # by id, by key, and through the store's reads
    assert docs.table("tasks").select("*").eq("id", world.bug_task).execute().data == []
    assert docs.table("tasks").select("*").eq("key", "bugfix:1").execute().data == []
    st = store(s, key(s, "worker", ["docs"]))
    try:
        with pytest.raises(UnknownTask):
            st.get_task(world.bug_task)
        with pytest.raises(UnknownTask):
            st.get_task("bugfix:1")
        assert st.get_task(world.docs_task).lane == "docs"
        assert st.task_runs(world.bug_task) == [] and st.task_events(world.bug_task) == []
        assert st.last_lane_handoff("bugfix") is None
        assert st.lane_names() == ["docs"]
        assert {t.lane for t in st.list_tasks()} == {"docs"}
        assert st.query("active_sessions_on_host", host="host-a") == [
            {"id": world.docs_session, "lane": "docs", "pid": 4242, "pid_started_at": None, "pid_identity": None}]
    finally:
        st.close()
    # nor the dashboards (views read as their owner, past RLS: a worker key gets none of them)
    refused(lambda: docs.table("lane_overview").select("*").execute(), "42501")


# what a docs key hears when it aims a worker call at bugfix: a lane it names is refused by name
# (LF008); a bugfix session or task it names by id is unknown to it (LF006, LF003), as one that does
# not exist. record_run, close_session and declare_session_lost (05_sessions, 08_finish) still answer
# LF008 (tests/supabase_api/test_probe.py, KNOWN): refused all the same.
REFUSAL = {"enqueue": "LF008", "enqueue_task": "LF008", "enqueue_after": "LF008", "open_session": "LF008",
           "claim": "LF006", "heartbeat": "LF006", "checkpoint": "LF003", "complete": "LF003", "fail": "LF003",
           "hand_off": "LF003", "transient": "LF003", "drop_session": "LF003", "route": "LF003",
           "record_run": {"LF008", "LF003"}, "close_session": {"LF008", "LF006"},
           "declare_session_lost": {"LF008", "LF006"}}


@pytest.mark.parametrize("fn", list(REFUSAL))
def test_docs_key_cannot_touch_bugfix_work(world: World, fn: str) -> None:
    """Each worker call aimed at bugfix is refused before anything is written, naming no more than
    the caller gave."""
    s = world.stack
    docs = client(s, key(s, "worker", ["docs"]))
    before = snapshot(s)
    err = refused(lambda: docs.rpc(fn, every_call(world)[fn]).execute(), REFUSAL[fn])
    if err.code == "LF008":
        assert "not allowed for this key" in (err.message or "")
    else:
        assert (err.message or "").startswith("unknown ") and "bugfix" not in str(err), err
    assert snapshot(s) == before


def test_docs_key_cannot_learn_a_bugfix_task_through_an_existing_key(world: World) -> None:
    """Keys are per lane: a bugfix task's key enqueued into docs is another task, never answered
    with the bugfix task's id; a docs task routed on into bugfix keeps its key in docs, and an
    enqueue of that key is refused without naming where it went."""
    s = world.stack
    st = store(s, key(s, "worker", ["docs"]))
    sql(s, "select fleet.route(%s, %s, 'bugfix')", (world.docs_task, world.docs_token))  # docs:0 moves on
    before = snapshot(s)
    try:
        assert st.enqueue("docs", "docs:1") == (world.docs_queued, False)  # its own: idempotent
        with pytest.raises(LaneForbidden) as err:
            st.enqueue("docs", "docs:0")
        assert "moved on to a lane not allowed for this key" in str(err.value) and "bugfix" not in str(err.value)
        assert snapshot(s) == before
        task_id, created = st.enqueue("docs", "bugfix:1")
        assert created and task_id != world.bug_queued
    finally:
        st.close()


def test_docs_key_refusals_are_lane_forbidden_through_the_store(world: World) -> None:
    s = world.stack
    st = store(s, key(s, "worker", ["docs"]))
    token = UUID(world.bug_token)
    before = snapshot(s)
    try:
        calls: list[tuple[Callable[[], Any], Any]] = [
            (lambda: st.enqueue("bugfix", "x:1"), LaneForbidden),
            (lambda: st.enqueue("bugfix", "x:2", delay_seconds=5), LaneForbidden),
            (lambda: st.open_session("bugfix", "h", 1, None, 60), LaneForbidden),
            (lambda: st.route(world.docs_task, UUID(world.docs_token), "bugfix"), LaneForbidden),  # nor route into it
            # bugfix's sessions and tasks are unknown to it
            (lambda: st.claim(UUID(world.bug_session), 1), SessionLost),
            (lambda: st.heartbeat(UUID(world.bug_session), [world.bug_task]), SessionLost),
            (lambda: st.checkpoint(world.bug_task, token, {"step": 1}), UnknownTask),
            (lambda: st.complete(world.bug_task, token, {"ok": True}), UnknownTask),
            (lambda: st.fail(world.bug_task, token, "no"), UnknownTask),
            (lambda: st.hand_off(world.bug_task, token, {}), UnknownTask),
            (lambda: st.transient(world.bug_task, token, "overloaded"), UnknownTask),
            (lambda: st.drop_session(world.bug_task, token, "gone"), UnknownTask),
            (lambda: st.route(world.bug_task, token, "docs"), UnknownTask),
            # (05_sessions, 08_finish: still LF008, test_probe.py KNOWN)
            (lambda: st.record_run(token, {"input_tokens": 5}), (LaneForbidden, UnknownTask)),
            (lambda: st.close_session(UUID(world.bug_session), "x", {}), (LaneForbidden, SessionLost)),
            (lambda: st.declare_session_lost(UUID(world.bug_session), "x"), (LaneForbidden, SessionLost)),
        ]
        for call, error in calls:
            with pytest.raises(error):
                call()
        # the operator calls are not a worker's at all
        for call in (lambda: st.cancel(world.docs_queued), lambda: st.retry(world.bug_dead),
                     lambda: st.reconcile(), lambda: st.sync_lane("docs", {})):
            with pytest.raises(AccessDenied):
                call()
    finally:
        st.close()
    assert snapshot(s) == before


def test_docs_key_works_its_own_lane(world: World) -> None:
    """The same key is not refused its own work: the refusals above are about the lane."""
    s = world.stack
    st = store(s, key(s, "worker", ["docs"]))
    try:
        assert st.enqueue("docs", "docs:new") == (st.get_task("docs:new").id, True)
        assert st.heartbeat(UUID(world.docs_session), [world.docs_task]) == {world.docs_task: "ok"}
        assert st.checkpoint(world.docs_task, UUID(world.docs_token), {"step": 1}) == 1
        st.record_run(UUID(world.docs_token), {"input_tokens": 7})
        assert st.complete(world.docs_task, UUID(world.docs_token), {"ok": True}) == "done"
        assert [t.id for t in st.claim(UUID(world.docs_session), 1)] == [world.docs_queued]
    finally:
        st.close()
    t = sql(s, "select state, result from fleet.tasks where id = %s", (world.docs_task,))[0]
    assert t == {"state": "done", "result": {"ok": True}}
    assert sql(s, "select input_tokens from fleet.runs where task_id = %s", (world.docs_task,))[0]["input_tokens"] == 7


def test_docs_key_cannot_write_tables_directly(world: World) -> None:
    s = world.stack
    docs = client(s, key(s, "worker", ["docs"]))
    before = snapshot(s)
    refused(lambda: docs.table("tasks").insert({"lane": "docs", "key": "direct:1"}).execute(), "42501")
    refused(lambda: docs.table("tasks").update({"state": "done"}).eq("id", world.docs_task).execute(), "42501")
    refused(lambda: docs.table("tasks").delete().eq("id", world.docs_task).execute(), "42501")
    refused(lambda: docs.table("lanes").update({"paused": True}).eq("name", "docs").execute(), "42501")
    refused(lambda: docs.rpc("_release", {"p_task": world.docs_task, "p_reason": "x"}).execute(), "42501")
    assert snapshot(s) == before


def test_a_key_for_several_lanes_and_a_lane_scoped_operator(world: World) -> None:
    s = world.stack
    both = client(s, key(s, "worker", ["docs", "bugfix"]))
    lanes = {r["lane"] for r in both.table("tasks").select("lane").execute().data}
    assert lanes == {"docs", "bugfix"}
    op_docs = store(s, key(s, "operator", ["docs"]))
    op_all = store(s, key(s, "operator"))
    before = snapshot(s)
    try:
        with pytest.raises(UnknownTask, match=f"unknown task {world.bug_queued}$"):
            op_docs.cancel(world.bug_queued)  # another lane's task: as one that does not exist
        with pytest.raises(UnknownTask, match=f"unknown task {world.bug_dead}$"):
            op_docs.retry(world.bug_dead)
        with pytest.raises(LaneForbidden):
            op_docs.reconcile()  # a pass repairs every lane
        with pytest.raises(AccessDenied):
            op_all.claim(UUID(world.bug_session))  # an operator is not a worker
        assert snapshot(s) == before
        assert {t.lane for t in op_docs.list_tasks()} == {"docs"}
        assert {t.lane for t in op_all.list_tasks()} == {"docs", "bugfix"}
        assert op_all.retry(world.bug_dead) == "queued"
        assert op_all.cancel(world.bug_queued) == "cancelled"
        assert op_all.reconcile() == []
    finally:
        op_docs.close()
        op_all.close()


# ------------------------------------------------------------------------------------------------
# keys that must not be believed


def forged_keys(stack: DevStack) -> dict[str, str]:
    wrong = "w" * 40
    return {
        "wrong secret": raw_jwt({"role": "fleet_worker", "fleet_lanes": ["bugfix"]}, wrong),
        "expired": raw_jwt({"role": "fleet_worker", "fleet_lanes": ["bugfix"]}, stack.jwt_secret, ttl=-120),
        "forged service_role": raw_jwt({"role": "service_role"}, wrong),
        "alg none": jwt_none({"role": "service_role", "exp": 4_000_000_000}),
        "tampered claims": tamper(key(stack, "worker", ["docs"]), {"fleet_lanes": ["bugfix"]}),
        "role postgres, signed": raw_jwt({"role": "postgres"}, stack.jwt_secret),
    }


def jwt_none(claims: dict[str, Any]) -> str:
    import base64
    import json

    def b64(d: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()

    return f"{b64({'alg': 'none', 'typ': 'JWT'})}.{b64(claims)}."


def tamper(token: str, extra: dict[str, Any]) -> str:
    """The same header and signature over changed claims."""
    import base64
    import json

    head, body, sig = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims.update(extra)
    new = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{head}.{new}.{sig}"


@pytest.mark.parametrize("which", ["wrong secret", "expired", "forged service_role", "alg none",
                                   "tampered claims", "role postgres, signed"])
def test_bad_keys_are_refused(world: World, which: str) -> None:
    s = world.stack
    bad = forged_keys(s)[which]
    c = client(s, bad)
    before = snapshot(s)
    codes = {"PGRST301", "PGRST300", "PGRST302", "42501"}
    refused(lambda: c.table("tasks").select("*").execute(), codes)
    refused(lambda: c.rpc("complete", every_call(world)["complete"]).execute(), codes)
    refused(lambda: c.rpc("enqueue", {"p_lane": "bugfix", "p_key": "forged:1"}).execute(), codes)
    refused(lambda: c.rpc("sync_lane", {"p_name": "bugfix", "p_settings": {"paused": True}}).execute(), codes)
    st = store(s, bad)
    try:
        with pytest.raises(AccessDenied):
            st.complete(world.bug_task, UUID(world.bug_token))
    finally:
        st.close()
    assert snapshot(s) == before


def test_the_gateway_takes_only_project_keys_as_apikey(world: World) -> None:
    """As on hosted Supabase: a fleet key in ``apikey`` is refused before PostgREST sees it."""
    s = world.stack
    worker = key(s, "worker", ["docs"])
    c = create_client(s.url, worker, ClientOptions(schema="fleet", postgrest_client_retry=False,
                                                    httpx_client=httpx.Client(timeout=30)))
    err = refused(lambda: c.table("tasks").select("*").execute(), {None, "401"})  # type: ignore[arg-type]
    assert "Invalid API key" in (err.message or "") + str(err.details)
    service: Client = client(s, apikey=s.service_role_key)  # and the service key sees everything
    assert {r["lane"] for r in service.table("tasks").select("lane").execute().data} == {"docs", "bugfix"}


# ------------------------------------------------------------------------------------------------
# hostile input: stored verbatim or refused with a clear error, never executed

META = [
    "x'; drop table fleet.tasks; --",
    "\"); delete from fleet.lanes; --",
    "$$ language sql; select pg_sleep(10); $$",
    "' or '1'='1",
    "\\' ; truncate fleet.events cascade ; --",
    "*,lanes(*)",  # PostgREST select syntax
    "eq.bugfix",  # a PostgREST filter
    "%_",  # LIKE wildcards
]


def test_metacharacters_in_keys_and_payloads_are_stored_verbatim(world: World) -> None:
    s = world.stack
    st = store(s, key(s, "worker", ["docs"]))
    try:
        for i, meta in enumerate(META):
            payload = {"text": meta, meta: [meta], "nested": {"sql": meta}}
            task_id, created = st.enqueue("docs", f"meta:{i}:{meta}", payload, title=meta)
            assert created
            row = sql(s, "select key, title, payload from fleet.tasks where id = %s", (task_id,))[0]
            assert row == {"key": f"meta:{i}:{meta}", "title": meta, "payload": payload}
            assert st.get_task(f"meta:{i}:{meta}").id == task_id  # a filter value, not syntax
    finally:
        st.close()
    assert {r["n"] for r in sql(s, "select count(*) as n from fleet.tasks where lane = 'bugfix'")} == {3}
    assert sql(s, "select count(*) as n from fleet.lanes")[0]["n"] == 2


def test_metacharacters_in_lane_names_and_claims_are_refused_or_harmless(world: World) -> None:
    s = world.stack
    service = store(s, s.service_role_key)
    docs = store(s, key(s, "worker", ["docs"]))
    before = snapshot(s)
    try:
        for meta in META:
            with pytest.raises(InvalidInput, match="is not a lane name"):
                service.sync_lane(meta, {})
            with pytest.raises(UnknownLane):
                service.enqueue(meta, "k")
            with pytest.raises(LaneForbidden):
                docs.enqueue(meta, "k")
            with pytest.raises(UnknownTask):
                docs.get_task(meta)
        # a key whose claimed lane is an injection attempt can see nothing
        sneaky = client(s, raw_jwt({"role": "fleet_worker", "fleet_lanes": ["docs' or '1'='1", "*'"]},
                                   s.jwt_secret))
        assert sneaky.table("tasks").select("*").execute().data == []
        refused(lambda: sneaky.rpc("enqueue", {"p_lane": "docs", "p_key": "k"}).execute(), "LF008")
    finally:
        service.close()
        docs.close()
    assert snapshot(s) == before


def test_one_megabyte_inputs(world: World) -> None:
    s = world.stack
    big = "x" * (1 << 20)
    st = store(s, key(s, "worker", ["docs"]))
    service = store(s, s.service_role_key)
    before = snapshot(s)
    try:
        with pytest.raises(InvalidInput, match="1 to 200 characters"):
            st.enqueue("docs", big)
        with pytest.raises(LaneForbidden):
            st.enqueue(big, "k")  # the message quotes the lane, cut short
        with pytest.raises(UnknownLane):
            service.enqueue(big, "k")
        with pytest.raises(InvalidInput, match="is not a lane name"):
            service.sync_lane(big, {})
        with pytest.raises(InvalidInput):
            st.enqueue("docs", "nul:1", {"text": "a\u0000b"})  # PostgreSQL text has no NUL
        assert snapshot(s) == before
        # a payload past the lane's cap (1 MiB) is refused; one just under it (and a 1 MB
        # checkpoint) is stored verbatim
        with pytest.raises(InvalidInput, match="more than lane docs's max_payload_bytes of 1048576"):
            st.enqueue("docs", "big:0", {"blob": big})
        assert snapshot(s) == before
        payload = {"blob": big[:(1 << 20) - 40000], "quote": "'; drop table fleet.tasks; --" * 1000}
        task_id, _ = st.enqueue("docs", "big:1", payload)
        assert sql(s, "select payload from fleet.tasks where id = %s", (task_id,))[0]["payload"] == payload
        assert st.checkpoint(world.docs_task, UUID(world.docs_token), {"blob": big}) == 1
        stored = sql(s, "select checkpoint from fleet.tasks where id = %s", (world.docs_task,))[0]
        assert stored["checkpoint"] == {"blob": big}
    finally:
        st.close()
        service.close()
