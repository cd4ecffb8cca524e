"""Two lanes with every kind of row, to show that a key of one never sees the other's.

``build(conn)`` makes lanes ``lane-a`` and ``lane-b`` through the SQL API, as the database owner,
each with tasks in every state (queued, running and waiting on a prompt, running without progress,
blocked with evidence, in review with a summary, approved, rejected, dead with its error,
cancelled, throttled, transient, repaired, batched and a batch carrier), sessions active, ended
and lost, runs with tokens, a lane hand-off, workspaces, events of every kind the views read, and
hours rolled up into ``fleet.lane_hours``. Pools: ``shared-pool`` (both lanes draw from it),
``lanea-pool`` and ``laneb-pool``; profiles likewise.

Everything of lane B is recognisable wherever it turns up: its texts (keys, titles, payloads,
hosts, errors, notes, pool and profile names) carry ``laneb`` or ``lane-b``, and its ids are
numbers no lane-A row has (lane B is built after lane A with every sequence moved to 900000 and
up, a range per table). :func:`leaks` finds them in any JSON answer.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

A, B = "lane-a", "lane-b"
MARK = {A: "lanea", B: "laneb"}
SHARED_POOL, SHARED_PROFILE = "shared-pool", "shared-prof"
# lane B's tables start their ids here, a range each (no lane-A id, count or size comes near)
B_IDS_FROM = 900_000


@dataclass
class Lane:
    """The ids of one lane's objects (what a probe aims at)."""

    name: str
    mark: str
    task: int = 0  # running, its agent waiting on a prompt
    token: str = ""  # its lease token
    session: str = ""  # the active session holding it
    queued: int = 0
    queued_key: str = ""
    review: int = 0
    blocked: int = 0
    dead: int = 0
    batch: int = 0
    carrier: int = 0
    workspace: int = 0
    host: str = ""
    pool: str = ""
    profile: str = ""
    lost_session: str = ""
    ended_session: str = ""
    source: str = ""  # a source feeding the lane alone
    source_ref: str = ""  # its item


@dataclass
class World:
    a: Lane
    b: Lane
    # every id, uuid and text marker of lane B (filled by build)
    b_ints: set[int] = field(default_factory=set)
    b_uuids: set[str] = field(default_factory=set)


def _rows(conn: psycopg.Connection, query: str, params: Any = None) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, params)
        return cur.fetchall() if cur.description else []


def _one(conn: psycopg.Connection, query: str, params: Any = None) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def _lane(conn: psycopg.Connection, name: str) -> Lane:
    """One lane's history, built through the API (the owner's connection: every lane allowed)."""
    m = MARK[name]
    lane = Lane(name, m, host=f"{m}-host-1", pool=f"{m}-pool", profile=f"{m}-prof")
    conn.execute("select fleet.sync_pool(%s, 2, %s)", (lane.pool, Jsonb({"five_hour": {
        "seconds": 18000, "budget_tokens": 10_000_000, "provider_window": "five_hour"}})))
    conn.execute("select fleet.sync_profile(%s, %s, %s)", (lane.profile, lane.pool, Jsonb({"mid": f"{m}-model"})))
    conn.execute("select fleet.sync_lane(%s, %s)", (name, Jsonb({
        "max_attempts": 2, "lease_seconds": 600,
        "config": {"review": True, "stall_seconds": 60, "workspace_retention_seconds": 0,
                   "profile": lane.profile,
                   "dispatch": [{"pool": SHARED_POOL, "profile": SHARED_PROFILE},
                                {"pool": lane.pool, "profile": lane.profile}]}})))

    def enqueue(what: str) -> int:
        return int(_one(conn, "select fleet.enqueue(%s, %s, %s, 0, now(), null, %s)",
                        (name, f"{name}:{what}", Jsonb({"marker": m, "what": what}), f"{m} {what}")))

    def claim(session: str, task: int) -> str:
        """Claim exactly this task (made the first ready one of its lane): its lease token."""
        conn.execute("update fleet.tasks set priority = 1000 where id = %s", (task,))
        got = _rows(conn, "select id, lease_token from fleet.claim(%s, 1)", (session,))
        assert [r["id"] for r in got] == [task], got
        conn.execute("update fleet.tasks set priority = 0 where id = %s", (task,))
        return str(got[0]["lease_token"])

    def report(token: str, n: int) -> None:
        conn.execute("select fleet.record_run(%s, %s)", (token, Jsonb({
            "input_tokens": 100 * n, "output_tokens": 10 * n, "cost_usd": 0.01 * n, "model": f"{m}-model",
            "agent_session": f"{m}-agent-session-{n}", "log_path": f"/logs/{m}/{n}.log"})))

    names = ["attn", "stalled", "blocked", "review", "approved", "rejected", "dead", "cancelled",
             "throttled", "transient", "handoff", "repaired", "spilled", "q1", "q2", "b1", "b2"]
    ids = {what: enqueue(what) for what in names}
    s = str(_one(conn, "select fleet.open_session(%s, %s, 4242, null, 3600)", (name, lane.host)))
    tokens = {}
    for i, what in enumerate(["attn", "stalled", "blocked", "review", "approved", "rejected", "dead",
                              "throttled", "transient", "handoff"], start=1):
        tokens[what] = claim(s, ids[what])
        report(tokens[what], i)
    conn.execute("select fleet.checkpoint(%s, %s, %s)", (ids["attn"], tokens["attn"], Jsonb({"marker": m})))
    lane.workspace = int(_one(conn, "select fleet.touch_workspace(%s, %s, %s, %s, 4096)",
                              (ids["attn"], tokens["attn"], lane.host, f"/ws/{m}/attn")))
    conn.execute("select fleet.touch_workspace(%s, %s, %s, %s, 2048)",
                 (ids["dead"], tokens["dead"], lane.host, f"/ws/{m}/dead"))
    conn.execute("select * from fleet.heartbeat(%s, null, null, %s)",
                 (s, Jsonb({str(ids["attn"]): f"{m} waits for a permission prompt"})))
    conn.execute("select fleet.block(%s, %s, 'automation-broken', %s)",
                 (ids["blocked"], tokens["blocked"], f"{m} gate evidence"))
    for what in ("review", "approved", "rejected"):
        conn.execute("select fleet.complete(%s, %s, %s)",
                     (ids[what], tokens[what], Jsonb({"summary": f"{m} {what} summary"})))
    conn.execute("select fleet.review_approve(%s, %s)", (ids["approved"], f"{m} approve note"))
    conn.execute("select fleet.review_reject(%s, %s)", (ids["rejected"], f"{m} reject note"))
    conn.execute("select fleet.fail(%s, %s, %s, false)", (ids["dead"], tokens["dead"], f"{m} fatal error"))
    conn.execute("select fleet.transient(%s, %s, %s)", (ids["transient"], tokens["transient"], f"{m} overloaded"))
    conn.execute("select fleet.hand_off(%s, %s, %s)", (ids["handoff"], tokens["handoff"], Jsonb({"marker": m})))
    conn.execute("select fleet.throttle(%s, %s, null, %s)",
                 (ids["throttled"], tokens["throttled"], f"{m} usage limit reached"))
    # the shared pool is throttled now: the next claim spills over to the lane's own pool
    tokens["spilled"] = claim(s, ids["spilled"])
    conn.execute("select fleet.cancel(%s)", (ids["cancelled"],))
    # no progress for longer than the lane's stall_seconds
    conn.execute("update fleet.tasks set last_progress_at = now() - interval '10 minutes' where id = %s",
                 (ids["stalled"],))
    conn.execute("update fleet.runs set started_at = now() - interval '10 minutes' where lease_token = %s",
                 (tokens["stalled"],))
    # a shift that vanished: its task repaired
    lost = str(_one(conn, "select fleet.open_session(%s, %s, 4243, null, 3600)", (name, f"{m}-host-2")))
    claim(lost, ids["repaired"])
    conn.execute("select * from fleet.declare_session_lost(%s, %s)", (lost, f"{m} pid-gone"))
    # a shift that ended: its lane hand-off
    ended = str(_one(conn, "select fleet.open_session(%s, %s, 4244, null, 3600)", (name, f"{m}-host-3")))
    conn.execute("select fleet.close_session(%s, %s, %s)", (ended, "deadline", Jsonb({"notes": f"{m} hand-off"})))
    # a batch of two (its carrier queued)
    lane.batch = int(_one(conn, "select fleet.batch_create(%s, %s)", (name, [f"{name}:b1", f"{name}:b2"])))
    lane.carrier = int(_one(conn, "select task_id from fleet.batches where id = %s", (lane.batch,)))
    # a source feeding the lane: an issue mirrored into a task, its pull request, CI, a write-back
    lane.source = f"{m}-source"
    conn.execute("select fleet.source_begin(%s, 'github', %s)", (lane.source, [name]))
    conn.execute("select fleet.source_end(%s, %s, now(), null, null)",
                 (lane.source, Jsonb({f"/repos/{m}/repo/issues": {"etag": f'W/"{m}"', "value": [m]}})))
    ref = f"{m}/repo#1"
    lane.source_ref = ref
    conn.execute("select * from fleet.source_sync(%s, %s)", (lane.source, Jsonb([{
        "ref": ref, "key": f"github:{ref}", "lane": name, "open": True, "selected": True,
        "title": f"{m} issue", "payload": {"marker": m}, "url": f"https://github.test/{m}/repo/issues/1"}])))
    conn.execute("select fleet.source_pr(%s, %s, %s)", (lane.source, ref, Jsonb({
        "number": 2, "url": f"https://github.test/{m}/repo/pull/2", "head_sha": "abcdef1234567", "state": "open"})))
    conn.execute("select fleet.source_ci(%s, %s, 'abcdef1234567', 1, 'pending', null)", (lane.source, ref))
    conn.execute("select fleet.source_posted(%s, %s, %s, %s)", (lane.source, ref, f"{m}:posted", Jsonb(4242)))
    # runs that ended hours ago, for the hours rolled up
    conn.execute("""update fleet.runs set started_at = now() - interval '3 hours 10 minutes',
                                          ended_at = now() - interval '3 hours'
                     where lane = %s and ended_at is not null""", (name,))

    lane.task, lane.token, lane.session = ids["attn"], tokens["attn"], s
    lane.queued, lane.queued_key = ids["q1"], f"{name}:q1"
    lane.review, lane.blocked, lane.dead = ids["review"], ids["blocked"], ids["dead"]
    lane.lost_session, lane.ended_session = lost, ended
    return lane


def build(conn: psycopg.Connection) -> World:
    """Both lanes (A first, then B with its ids apart), the hours rolled up; their ids."""
    conn.execute("select fleet.sync_pool(%s, null)", (SHARED_POOL,))
    conn.execute("select fleet.sync_profile(%s, %s, %s)", (SHARED_PROFILE, SHARED_POOL, Jsonb({"mid": "shared-model"})))
    a = _lane(conn, A)
    conn.execute("update fleet.pools set throttled_until = null, throttle_note = null where name = %s", (SHARED_POOL,))
    seqs = [r["s"] for r in _rows(conn, """select c.oid::regclass::text as s from pg_class c
                                            where c.relnamespace = 'fleet'::regnamespace and c.relkind = 'S'
                                            order by c.relname""")]
    for i, seq in enumerate(seqs):
        conn.execute("select setval(%s, %s)", (seq, B_IDS_FROM + 10_000 * (i + 1)))
    b = _lane(conn, B)  # last: the shared pool's throttle note is lane B's
    conn.execute("select fleet.roll_up_lane_hours(0)")
    world = World(a, b)
    world.b_ints, world.b_uuids = b_identifiers(conn)
    assert world.b_ints and min(world.b_ints) > B_IDS_FROM
    return world


def b_identifiers(conn: psycopg.Connection) -> tuple[set[int], set[str]]:
    """Every id of a lane-B row (of every fleet table with a lane), every uuid of one."""
    ints: set[int] = set()
    uuids: set[str] = set()
    tables = _rows(conn, """
        select c.relname,
               array(select a.attname from pg_attribute a
                      where a.attrelid = c.oid and a.attnum > 0 and not a.attisdropped
                        and a.atttypid in ('bigint'::regtype, 'integer'::regtype)
                        and (a.attname = 'id' or a.attname like '%%\\_id' or a.attname in ('carrier'))) as ints,
               array(select a.attname from pg_attribute a
                      where a.attrelid = c.oid and a.attnum > 0 and not a.attisdropped
                        and a.atttypid = 'uuid'::regtype) as uuids,
               exists (select 1 from pg_attribute a where a.attrelid = c.oid and a.attname = 'lane') as has_lane
          from pg_class c
         where c.relnamespace = 'fleet'::regnamespace and c.relkind in ('r', 'p')""")
    for t in tables:
        if t["has_lane"]:
            where = "lane = %s"
        elif t["relname"] == "batch_members":
            where = "batch_id in (select id from fleet.batches where lane = %s)"
        else:
            continue
        for r in _rows(conn, f"select * from fleet.{t['relname']} where {where}", (B,)):
            ints |= {int(r[c]) for c in t["ints"] if r[c] is not None and int(r[c]) > B_IDS_FROM}
            uuids |= {str(r[c]) for c in t["uuids"] if r[c] is not None}
    return ints, uuids


# ------------------------------------------------------------------------------------------------
# finding lane B in an answer

_TEXT_MARKS = ("laneb", "lane-b")
_NUMBER = re.compile(r"(?<![\d.:])\d{6,}(?![\d])")


def leaks(world: World, value: Any, path: str = "$") -> list[str]:
    """Where lane B shows in a JSON-like value: its texts, its ids (as numbers or inside texts),
    its uuids. [] when it does not."""
    out: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            out += leaks(world, k, f"{path}.<key>")
            out += leaks(world, v, f"{path}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            out += leaks(world, v, f"{path}[{i}]")
    elif isinstance(value, bool) or value is None:
        pass
    elif isinstance(value, int):
        if value in world.b_ints:
            out.append(f"{path}: lane B's id {value}")
    elif isinstance(value, float):
        if value.is_integer() and int(value) in world.b_ints:
            out.append(f"{path}: lane B's id {value}")
    else:
        text = str(value)
        low = text.lower()
        out += [f"{path}: {text[:120]!r} names lane B" for mark in _TEXT_MARKS if mark in low][:1]
        out += [f"{path}: {text[:120]!r} holds lane B's id {n}" for n in _NUMBER.findall(text)
                if int(n) in world.b_ints]
        out += [f"{path}: {text[:120]!r} holds lane B's uuid" for u in world.b_uuids if u in low]
    return out


def as_json(value: Any) -> Any:
    """A row as PostgREST would send it (Decimal, datetime, UUID as JSON)."""
    return json.loads(json.dumps(value, default=str))


def new_uuid() -> str:
    return str(uuid.uuid4())
