"""Do the dashboards stay fast at scale? Build 1,000,000 tasks and 10,000,000 events (default), time
every view of migrations/*_fleet_views.sql, and show that history does not slow the claim or the monitor.

    uv run python bench/views_scale.py [--tasks 1000000] [--events 10000000] [--days 365] [--url ...]
    uv run python bench/views_scale.py --quick     # 20,000 tasks and 200,000 events (under a minute)

It creates (and drops, unless --keep) its own database on the server given by --url (default:
TEST_DATABASE_URL, else the machine's 127.0.0.1:5432).

The history is spread over --days (default a year: about 2,700 tasks a day, the rate of a fleet
of some 60 agents working 30-minute tasks) in 8 lanes: 85 % done at the first attempt, 7 % after
a failed one, 3 % after a hand-off, 1 % after a repair, 1 % routed to another lane, 2 % dead after
three failures, 1 % cancelled; then 200 live tasks (40 running in active shifts, 160 queued).
Runs last 5 to 35 minutes and carry tokens and cost; shifts start every 30 minutes per lane. The
events are what the SQL API would have journalled besides the rows (outcomes other than a
completion, session opened/closed) plus checkpoints up to --events rows of fleet.events, written in
time order as a journal is; the tasks' creations, the claims and the completions are the journal's
entries from the task and run rows (fleet.journal), as the SQL API writes them.

It then runs VACUUM ANALYZE and the first roll-up of fleet.lane_hours (what the monitor pass and
the dashboard commands do), and prints for each view, and for cohort_metrics over a few cohorts,
the median of --repeat runs of `select * from ...`: "server", the execution time the server
reports, and "client", the round trip from Python with every row fetched and converted; whether
it is under 100 ms; and the indexes its plan uses. Last, the median latency of fleet.claim(),
fleet.reconcile() and fleet.heartbeat(), measured before the history was loaded (only the live
work) and after. It exits 1 if a view takes 100 ms or more.

History-independence (issue #7, item 4: claim and reconcile within 1.2x of an empty database):
a second scratch database gets the same live work and no history, and the two are measured call
by call, alternately (so a change of the machine's load hits both alike): --rounds x --calls
committed ``fleet.claim(s, 1)`` of a bench session on each, each followed by a ``fleet.complete``
(the claim alone is timed; a pool of ready tasks is queued for it in lane l0), and as many
``fleet.reconcile()`` and ``fleet.heartbeat(s)`` (rolled back: a pass has nothing to repair, as in
the steady state), after --warmup calls of each that are not counted (right after the load the
first claims on the big database are slower: a cold start, gone after some 200). Both databases
have had their first roll-up of lane-hours, and the live work's leases and heartbeats are renewed
before each round, so no pass finds them expired. The ratio is
full / empty of the medians; the goal is judged on the paired ratio, the median of full / empty
over calls made one right after the other (a burst of load on a shared machine hits both alike).
When a ratio is over 1.2 (or with --explain), the plans of every statement inside the two
functions are printed for both databases: auto_explain (loaded into the bench's own session,
``log_nested_statements``, ``log_analyze``, ``log_buffers``) sends them to the client as notices.
It exits 1 if a ratio is over 1.2 when --assert-ratio is given (not by default: a busy machine
can push a sub-millisecond figure past it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.harness import pct, scratch_db, stamp
from worker.db.migrate import migrate

LANES = 8
LIVE = 200          # the live tasks, at the end of the id range
RUNNING = 40        # of those, running
SLOT = 1800         # a shift every 30 minutes per lane

VIEWS = {
    "lane_overview": "select * from fleet.lane_overview",
    "stuck_tasks": "select * from fleet.stuck_tasks",
    "session_overview": "select * from fleet.session_overview",
    "recent_repairs": "select * from fleet.recent_repairs",
    "dead_letters": "select * from fleet.dead_letters",
    "throughput_hourly": "select * from fleet.throughput_hourly",
    "usage_by_lane_day": "select * from fleet.usage_by_lane_day",
}
# a function over a cohort: its cost follows the cohort's size (about 2,700 tasks a day here)
COHORTS = {
    "cohort_metrics (1 day)": "select * from fleet.cohort_metrics(now() - interval '1 day', now())",
    "cohort_metrics (7 days)": "select * from fleet.cohort_metrics(now() - interval '7 days', now())",
    "cohort_metrics (7 days, one lane)": "select * from fleet.cohort_metrics(now() - interval '7 days', now(), 'l3')",
    "cohort_metrics (7 days, 200 days ago)":
        "select * from fleet.cohort_metrics(now() - interval '200 days', now() - interval '193 days')",
    "cohort_metrics (30 days)": "select * from fleet.cohort_metrics(now() - interval '30 days', now())",
}


LIVE_WINDOW = "select * from fleet.lane_hours_between(fleet._utc_hour(now()) - interval '719 hours', 'infinity')"


def log(msg: str) -> None:
    print(msg, flush=True)


def plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    out = [plan]
    for child in plan.get("Plans", []):
        out += plan_nodes(child)
    return out


def timed(conn: psycopg.Connection[Any], sql: str, n: int, *, rollback: bool = False) -> tuple[float, int]:
    xs, rows = [], 0
    for i in range(n + 1):  # the first call warms the caches and is not counted
        t0 = time.perf_counter()
        if rollback:  # the warming call too: a reconcile's roll-up must not commit before the history
            with conn.transaction(force_rollback=True):
                rows = len(conn.execute(sql).fetchall())
        else:
            rows = len(conn.execute(sql).fetchall())
        if i:
            xs.append((time.perf_counter() - t0) * 1000)
    return statistics.median(xs), rows


# -- the expressions of a task g (1..n): its kind, lanes, times, runs ---------------------------

def kind(n: int) -> str:
    return (f"case when g > {n - RUNNING} then 'running' when g > {n - LIVE} then 'queued' "
            "else (case when g % 100 < 2 then 'dead' when g % 100 = 2 then 'cancelled' "
            "when g % 100 < 10 then 'retried' when g % 100 < 13 then 'handoff' when g % 100 = 13 then 'repaired' "
            "when g % 100 = 14 then 'routed' else 'done' end) end")


def outcomes(k: str) -> str:
    return (f"(case {k} when 'done' then array['done'] when 'retried' then array['failed','done'] "
            "when 'handoff' then array['handed_off','done'] when 'repaired' then array['lost','done'] "
            "when 'routed' then array['routed','done'] when 'dead' then array['failed','failed','failed'] "
            "when 'running' then array[null] else array[]::text[] end)")


def live_sql(n: int, t_end: str, slot: int = SLOT) -> list[str]:
    """Sessions, tasks and runs of the live work (the last LIVE task ids)."""
    k = kind(n)
    return [
        # the active shifts: one per lane, in the current slot
        f"""insert into fleet.sessions (id, lane, host, pid, started_at, heartbeat_at, deadline, state)
            select md5('l' || l || ':' || floor(extract(epoch from {t_end}) / {slot}))::uuid, 'l' || l, 'bench-' || l,
                   1000 + l, {t_end} - interval '5 minutes', {t_end}, {t_end} + interval '25 minutes', 'active'
              from generate_series(0, {LANES - 1}) l""",
        f"""insert into fleet.tasks (id, lane, key, state, run_at, attempts, lease_token, lease_expires_at,
                                    session_id, created_at, updated_at)
            overriding system value
            select g, 'l' || (g % {LANES}), 'bench:' || g, {k}, {t_end} - interval '10 minutes',
                   case when {k} = 'running' then 1 else 0 end,
                   case when {k} = 'running' then md5('lease:' || g)::uuid end,
                   case when {k} = 'running' then {t_end} + interval '10 minutes' end,
                   case when {k} = 'running' then md5('l' || (g % {LANES}) || ':' || floor(extract(epoch from {t_end}) / {slot}))::uuid end,
                   {t_end} - interval '10 minutes', {t_end}
              from generate_series({n - LIVE + 1}::bigint, {n}) g""",
        f"""insert into fleet.runs (task_id, session_id, lane, attempt, lease_token, started_at)
            select t.id, t.session_id, t.lane, 1, t.lease_token, {t_end} - interval '5 minutes'
              from fleet.tasks t where t.state = 'running'""",
    ]


def history_sql(n: int, days: int, t_end: str, slot: int = SLOT) -> list[tuple[str, str]]:
    """Sessions, tasks, runs and lane hand-offs of the finished history (task ids 1..n-LIVE)."""
    k = kind(n)
    created = f"({t_end} - make_interval(secs => {days} * 86400.0 * (1 - g::float8 / {n})))"
    entry = f"('l' || (g % {LANES}))"
    final = f"(case when {k} = 'routed' then 'l' || ((g + 1) % {LANES}) else {entry} end)"
    nruns = f"cardinality({outcomes(k)})"
    # run j of a task starts 1 min after creation, then every 40 min; lasts 5..35 min
    end_of_last = (f"least({created} + make_interval(secs => 60 + ({nruns} - 1) * 2400 "
                   f"+ 300 + ((g * 2654435761 + {nruns}) % 1800)), {t_end} - interval '1 minute')")
    first_slot = f"floor((extract(epoch from {t_end}) - {days + 1} * 86400) / {slot})::bigint"
    last_slot = f"floor(extract(epoch from {t_end}) / {slot})::bigint - 1"
    return [
        ("sessions", f"""
            insert into fleet.sessions (id, lane, host, pid, started_at, heartbeat_at, deadline, ended_at,
                                        end_reason, state)
            select md5('l' || l || ':' || s)::uuid, 'l' || l, 'bench-' || l, 1000 + (s % 30000)::int,
                   to_timestamp(s * {slot}), to_timestamp(s * {slot} + {slot} - 60),
                   to_timestamp(s * {slot} + {slot} - 60), to_timestamp(s * {slot} + {slot} - 30),
                   'deadline', 'ended'
              from generate_series({first_slot}, {last_slot}) s, generate_series(0, {LANES - 1}) l"""),
        ("tasks", f"""
            insert into fleet.tasks (id, lane, key, state, run_at, attempts, failures, evaporations, handoffs,
                                    stages, last_error, dead_reason, created_at, updated_at, finished_at)
            overriding system value
            select g, {final}, 'bench:' || g,
                   case {k} when 'dead' then 'dead' when 'cancelled' then 'cancelled' else 'done' end,
                   {created},
                   case when {k} = 'routed' then 1 else {nruns} end,
                   case {k} when 'retried' then 1 when 'dead' then 3 else 0 end,
                   case when {k} = 'repaired' then 1 else 0 end,
                   case when {k} = 'handoff' then 1 else 0 end,
                   case when {k} = 'routed' then jsonb_build_array(jsonb_build_object('lane', {entry}, 'routed_to', {final}))
                        else '[]'::jsonb end,
                   case when {k} in ('retried', 'dead') then 'exit code 1: tests failed' end,
                   case when {k} = 'dead' then 'attempt-cap' end,
                   {created}, {end_of_last},
                   case when {k} = 'cancelled' then least({created} + interval '10 minutes', {t_end} - interval '1 minute')
                        else {end_of_last} end
              from generate_series(1::bigint, {n - LIVE}) g"""),
        ("runs", f"""
            insert into fleet.runs (task_id, session_id, lane, attempt, lease_token, started_at, ended_at, outcome,
                                   end_id, end_state,
                                   exit_code, model, input_tokens, cache_creation_tokens, cache_read_tokens,
                                   output_tokens, cost_usd, error_tail)
            select g, md5(x.lane || ':' || floor(extract(epoch from x.started) / {slot}))::uuid, x.lane,
                   case when {k} = 'routed' then 1 else o.j end,
                   md5('run:' || g || ':' || o.j)::uuid, x.started, x.ended, o.outcome,
                   nextval('fleet.events_id_seq'), case when o.outcome = 'done' then 'done' end,
                   case o.outcome when 'failed' then 1 when 'lost' then null else 0 end, 'claude-sonnet-4-5',
                   2000 + (g * 7919 + o.j) % 30000, 1000 + (g * 104729 + o.j) % 20000,
                   20000 + (g * 1299709 + o.j) % 400000, 500 + (g * 15485863 + o.j) % 8000,
                   round(((g * 32452843 + o.j) % 90000) / 100000.0 + 0.05, 6),
                   case o.outcome when 'failed' then 'exit code 1: tests failed' when 'lost' then 'released: lease-expired' end
              from generate_series(1::bigint, {n - LIVE}) g
              cross join lateral unnest({outcomes(k)}) with ordinality o (outcome, j)
              cross join lateral (select
                   case when {k} = 'routed' and o.j = 2 then 'l' || ((g + 1) % {LANES}) else {entry} end as lane,
                   least({created} + make_interval(secs => 60 + (o.j - 1) * 2400), {t_end} - interval '1 minute') as started,
                   least({created} + make_interval(secs => 60 + (o.j - 1) * 2400 + 300 + ((g * 2654435761 + o.j) % 1800)),
                         {t_end} - interval '1 minute') as ended) x
             order by x.started"""),
        ("lane hand-offs", """
            insert into fleet.lane_handoffs (lane, session_id, window_start, window_end, end_reason, counts, tokens,
                                            created_at)
            select s.lane, s.id, s.started_at, s.ended_at, 'deadline', '{}', '{}', s.ended_at
              from fleet.sessions s where s.state = 'ended' order by s.ended_at"""),
    ]


def events_sql(t0: str, t1: str, per_run: float) -> str:
    """The journal of [t0, t1), in time order: what the SQL API writes, plus checkpoints."""
    whole, frac = int(per_run), round((per_run - int(per_run)) * 1000)
    return f"""
        insert into fleet.events (ts, kind, lane, task_id, session_id, detail)
        select ts, kind, lane, task_id, session_id, detail from (
            -- (a task's creation, a claim and a completion are their rows' entries in the journal:
            -- fleet.journal reads them from the tasks and runs loaded above)
            select r.ended_at as ts,
                   case r.outcome when 'lost' then 'repaired' else r.outcome end as kind,
                   r.lane, r.task_id, r.session_id,
                   case r.outcome
                        when 'failed' then jsonb_build_object('attempt', r.attempt, 'error', 'exit code 1',
                             'state', case when r.attempt >= 3 then 'dead' else 'queued' end,
                             'reason', case when r.attempt >= 3 then 'attempt-cap' end)
                        when 'handed_off' then jsonb_build_object('attempt', r.attempt, 'handoffs', 1, 'state', 'queued')
                        when 'lost' then jsonb_build_object('reason', 'lease-expired', 'state', 'queued',
                             'attempt', r.attempt, 'evaporations', 1)
                        when 'routed' then jsonb_build_object('from', r.lane, 'to',
                             'l' || ((substr(r.lane, 2)::int + 1) % {LANES}))
                        else jsonb_build_object('attempt', r.attempt) end as detail
              from fleet.runs r where r.ended_at >= {t0} and r.ended_at < {t1} and r.outcome <> 'done'
            union all
            select t.finished_at, 'cancelled', t.lane, t.id, null, jsonb_build_object('was', 'queued')
              from fleet.tasks t
             where t.state = 'cancelled' and t.finished_at >= {t0} and t.finished_at < {t1}
            union all
            select s.started_at, 'session_opened', s.lane, null, s.id,
                   jsonb_build_object('host', s.host, 'pid', s.pid, 'seconds', 1770)
              from fleet.sessions s where s.started_at >= {t0} and s.started_at < {t1}
            union all
            select s.ended_at, 'session_closed', s.lane, null, s.id, jsonb_build_object('reason', 'deadline')
              from fleet.sessions s where s.ended_at >= {t0} and s.ended_at < {t1}
            union all
            select r.started_at + (r.ended_at - r.started_at) * c / (n + 1.0), 'checkpoint', r.lane, r.task_id,
                   r.session_id, jsonb_build_object('seq', c)
              from fleet.runs r
             cross join lateral (select {whole} + case when r.id % 1000 < {frac} then 1 else 0 end as n) k
             cross join lateral generate_series(1, k.n) c
             where r.started_at >= {t0} and r.started_at < {t1} and r.ended_at is not null
        ) e
        order by ts"""


def bench_claim_reconcile(conn: psycopg.Connection[Any], repeat: int) -> dict[str, float]:
    session = conn.execute("select id from fleet.sessions where state = 'active' and lane = 'l1'").fetchone()
    assert session is not None
    claim = f"select * from fleet.claim('{session[0]}', 1)"
    return {"claim": timed(conn, claim, repeat, rollback=True)[0],
            "reconcile": timed(conn, "select * from fleet.reconcile(300, 60)", repeat, rollback=True)[0],
            "heartbeat": timed(conn, f"select * from fleet.heartbeat('{session[0]}')", repeat, rollback=True)[0]}


def build_live(conn: psycopg.Connection[Any], n: int, slot: int = SLOT) -> str:
    """Lanes l0..l7 and the live work; returns the load's now() as an SQL literal."""
    t_end_value = conn.execute("select now()").fetchone()[0]  # type: ignore[index]
    t_end = f"'{t_end_value.isoformat()}'::timestamptz"
    for lane in range(LANES):
        conn.execute("select fleet.sync_lane(%s, %s::jsonb)",
                     (f"l{lane}", json.dumps({"max_running": 50, "lease_seconds": 600,
                                              "config": {"stall_seconds": 3600}})))
    for sql in live_sql(n, t_end, slot):
        conn.execute(sql)
    return t_end


def build_history(conn: psycopg.Connection[Any], n: int, events: int, days: int, t_end: str,
                  slot: int = SLOT, say: Any = log) -> None:
    """The finished history and the journal (see the module's doc), then VACUUM ANALYZE."""
    conn.execute("set synchronous_commit = off")
    conn.execute("set maintenance_work_mem = '1GB'")
    conn.execute("set work_mem = '256MB'")
    for label, sql in history_sql(n, days, t_end, slot):
        t0 = time.perf_counter()
        cur = conn.execute(sql)
        say(f"load {label}: {cur.rowcount:,} rows in {time.perf_counter() - t0:.1f} s")
    conn.execute(f"select setval(pg_get_serial_sequence('fleet.tasks', 'id'), {n})")
    conn.execute("analyze fleet.tasks; analyze fleet.runs; analyze fleet.sessions")

    # the journal: drop its secondary indexes, load it in time order, build them again
    indexes = conn.execute(
        "select c.relname, pg_get_indexdef(i.indexrelid) from pg_index i join pg_class c on c.oid = i.indexrelid"
        " where i.indrelid = 'fleet.events'::regclass and not i.indisprimary").fetchall()
    for name, _ in indexes:
        conn.execute(f"drop index fleet.{name}")
    row = conn.execute(
        "select (select count(*) from fleet.runs), (select count(*) from fleet.runs where ended_at is not null),"
        " (select count(*) from fleet.sessions where state = 'ended'),"
        " (select count(*) from fleet.tasks where state = 'cancelled'),"
        " (select count(*) from fleet.runs where outcome = 'done')").fetchone()
    assert row is not None
    _runs, ended, sessions, cancelled, done = row
    fixed = (ended - done) + cancelled + 2 * sessions  # events besides the checkpoints
    per_run = max(0.0, (events - fixed) / max(ended, 1))
    t0 = time.perf_counter()
    lo = conn.execute(f"select ({t_end} - make_interval(days => {days + 2}))::text").fetchone()[0]  # type: ignore[index]
    step_days, total = 15, 0
    for i in range(0, days + 3, step_days):
        a = f"'{lo}'::timestamptz + make_interval(days => {i})"
        b = f"'{lo}'::timestamptz + make_interval(days => {i + step_days})"
        total += conn.execute(events_sql(a, b, per_run)).rowcount
    say(f"load events: {total:,} rows in {time.perf_counter() - t0:.1f} s ({per_run:.2f} checkpoints per run)")
    t0 = time.perf_counter()
    for _, definition in indexes:
        conn.execute(definition)
    say(f"index events: {len(indexes)} indexes in {time.perf_counter() - t0:.1f} s")
    conn.execute("reset synchronous_commit; reset maintenance_work_mem; reset work_mem")
    t0 = time.perf_counter()
    conn.execute("vacuum analyze")
    say(f"vacuum analyze: {time.perf_counter() - t0:.1f} s")


def server_ms(conn: psycopg.Connection[Any], sql: str, n: int) -> float:
    """The median execution time the server reports (EXPLAIN ANALYZE, no per-node timing)."""
    xs = []
    for _ in range(n):
        plan = conn.execute(f"explain (analyze, timing off, format json) {sql}").fetchone()[0][0]  # type: ignore[index]
        xs.append(float(plan["Execution Time"]))
    return statistics.median(xs)


# -- history-independence: the claim and the monitor, empty database against full ------------------

GOAL = 1.2
CLAIM_LANE = "l0"


def renew_live(conn: psycopg.Connection[Any]) -> None:
    """The live shifts heartbeat and their leases are renewed, as a live fleet's would be."""
    conn.execute("update fleet.sessions set heartbeat_at = now(),"
                 " deadline = greatest(deadline, now() + interval '25 minutes') where state = 'active'")
    conn.execute("update fleet.tasks set lease_expires_at = now() + interval '10 minutes' where state = 'running'")


def prepare_compare(conn: psycopg.Connection[Any], pool: int) -> str:
    """A bench session in CLAIM_LANE and ``pool`` ready tasks for it to claim; the session id."""
    conn.execute(f"select count(fleet.enqueue('{CLAIM_LANE}', 'claimpool:' || clock_timestamp() || ':' || g))"
                 f" from generate_series(1, {pool}) g")
    # the first roll-up of lane-hours, committed (the first monitor pass does it): the passes timed
    # below are rolled back, and must not redo it every time on one database and not the other
    conn.execute("select fleet.roll_up_lane_hours()")
    conn.execute("vacuum analyze fleet.tasks")
    row = conn.execute(f"select fleet.open_session('{CLAIM_LANE}', 'bench-claim', 1, null, 86400)").fetchone()
    assert row is not None
    return str(row[0])


def claim_once(conn: psycopg.Connection[Any], session: str) -> tuple[float, float]:
    """One fleet.claim(s, 1) in its own transaction, then the completion of what it claimed (not
    timed). The claim's round trip alone, and with its commit: the commit waits for the WAL flush,
    which costs the same whatever the history and, on a machine whose disk others write to, is
    most of the noise."""
    t0 = time.perf_counter()
    with conn.transaction():
        row = conn.execute("select id, lease_token from fleet.claim(%s, 1)", (session,)).fetchone()
        t1 = time.perf_counter()
    t2 = time.perf_counter()
    assert row is not None, "the claim pool ran dry"
    assert conn.execute("select fleet.complete(%s, %s)", row).fetchone() == ("done",)
    return (t1 - t0) * 1000, (t2 - t0) * 1000


def rolled_back(conn: psycopg.Connection[Any], sql: str) -> float:
    t0 = time.perf_counter()
    with conn.transaction(force_rollback=True):
        rows = conn.execute(sql).fetchall()
    ms = (time.perf_counter() - t0) * 1000
    assert not [r for r in rows if r[0] in ("released", "lost")], f"a pass repaired: {rows}"
    return ms


def nested_plans(conn: psycopg.Connection[Any], sql: str) -> list[dict[str, Any]]:
    """The statements run inside ``sql`` (one rolled-back call) with their plans: auto_explain,
    loaded into this session only, sends each as a notice."""
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute("load 'auto_explain'")
    for k, v in (("log_min_duration", "0"), ("log_analyze", "on"), ("log_buffers", "on"),
                 ("log_nested_statements", "on"), ("log_timing", "on"), ("log_format", "json"),
                 ("log_level", "notice")):
        conn.execute(f"set auto_explain.{k} = '{v}'")
    try:
        with conn.transaction(force_rollback=True):
            conn.execute(sql).fetchall()
    finally:
        conn.execute("set auto_explain.log_min_duration = -1")
    out = []
    for text in notices:
        if "plan:" not in text:
            continue
        head, _, body = text.partition("plan:")
        plan = json.loads(body)
        nodes = plan_nodes(plan["Plan"])
        out.append({
            "ms": float(head.split("duration:")[1].split("ms")[0]),
            "query": " ".join(plan.get("Query Text", "").split())[:90],
            "hit": int(plan["Plan"].get("Shared Hit Blocks", 0)),
            "read": int(plan["Plan"].get("Shared Read Blocks", 0)),
            "indexes": sorted({x["Index Name"] for x in nodes if "Index Name" in x}),
            "seq": sorted({x["Relation Name"] for x in nodes if x["Node Type"] == "Seq Scan"}),
        })
    return out


def compare(empty_url: str, full_url: str, rounds: int, calls: int, explain: bool,
            warmup: int = 200) -> dict[str, float]:
    """Fresh connections to both: neither brings plan caches or settings of its own."""
    with psycopg.connect(empty_url, autocommit=True) as empty, psycopg.connect(full_url, autocommit=True) as full:
        return compare_on(empty, full, rounds, calls, explain, warmup)


def compare_on(empty: psycopg.Connection[Any], full: psycopg.Connection[Any], rounds: int, calls: int,
               explain: bool, warmup: int = 200) -> dict[str, float]:
    """``warmup`` calls of each function on each database first, not counted: right after the load
    the first claims on the big database are slower (1.3-1.4x in quick runs, 1.0x after some 200
    claims, on the same databases), a cold start that a running fleet does not see."""
    conns = (empty, full)
    sessions = [prepare_compare(c, rounds * calls + warmup + 20) for c in conns]
    calls_of: dict[str, Callable[[int], float | tuple[float, float]]] = {
        "claim": lambda i: claim_once(conns[i], sessions[i]),
        "reconcile": lambda i: rolled_back(conns[i], "select * from fleet.reconcile(300, 60)"),
        "heartbeat": lambda i: rolled_back(conns[i], f"select * from fleet.heartbeat('{sessions[i]}')"),
    }
    keys = ["claim", "claim + commit", "reconcile", "heartbeat"]
    got: list[dict[str, list[float]]] = [{k: [] for k in keys}, {k: [] for k in keys}]
    for r in range(rounds):
        for i in (0, 1):
            renew_live(conns[i])
        for c in range(calls + (warmup if r == 0 else 0)):
            for key, fn in calls_of.items():
                # call by call, alternating which database goes first: a change of the machine's
                # load between two calls hits both alike
                for i in ((0, 1) if (r + c) % 2 == 0 else (1, 0)):
                    ms = fn(i)
                    if r == 0 and c < warmup:
                        continue
                    if isinstance(ms, tuple):
                        got[i]["claim"].append(ms[0])
                        got[i]["claim + commit"].append(ms[1])
                    else:
                        got[i][key].append(ms)
    log("")
    log(f"history-independence: {rounds * calls} calls of each function on each database, alternating, "
        f"after {warmup} not counted (claim committed; reconcile, heartbeat rolled back); ms")
    log(f"  {'call':22s} {'empty p50':>9s} {'p90':>7s} {'full p50':>9s} {'p90':>7s} {'ratio':>6s} {'paired':>6s}"
        f"  goal ≤ {GOAL} (paired)")
    ratios = {}
    labels = {"claim": "fleet.claim()", "claim + commit": "  with its commit", "reconcile": "fleet.reconcile()",
              "heartbeat": "fleet.heartbeat()"}
    for key in keys:
        e, f = got[0][key], got[1][key]
        # "ratio": of the two medians; "paired": the median of full/empty over calls made one right
        # after the other, which a burst of load on the machine hits alike (the goal is judged on it)
        ratio = statistics.median(f) / statistics.median(e)
        paired = statistics.median(b / a for a, b in zip(e, f, strict=True))
        ratios[key] = paired
        verdict = ("met" if paired <= GOAL else "NOT met") if key in ("claim", "reconcile") else "(not a goal)"
        log(f"  {labels[key]:22s} {statistics.median(e):9.3f} {pct(e, 90):7.3f} {statistics.median(f):9.3f} "
            f"{pct(f, 90):7.3f} {ratio:6.2f} {paired:6.2f}  {verdict}")
    if explain or any(ratios[k] > GOAL for k in ("claim", "reconcile")):
        renew_live(empty)
        renew_live(full)
        for label, template in (("fleet.claim(s, 1)", "select * from fleet.claim('{}', 1)"),
                                ("fleet.reconcile()", "select * from fleet.reconcile(300, 60)"),
                                ("fleet.heartbeat(s)", "select * from fleet.heartbeat('{}')")):
            log("")
            log(f"  {label}: statements inside, empty → full database "
                "(ms; shared buffers hit/read; indexes the full one uses)")
            a_plans = nested_plans(empty, template.format(sessions[0]))
            b_plans = nested_plans(full, template.format(sessions[1]))
            for b in b_plans:  # each statement of the full database beside the same one of the empty
                b["query"] = b["query"].replace(sessions[1], "<session>")
                a = next((x for x in a_plans if x["query"].replace(sessions[0], "<session>") == b["query"]),
                         {"ms": 0.0, "hit": 0, "read": 0})
                if a in a_plans:
                    a_plans.remove(a)
                seq = f" seq: {','.join(b['seq'])}" if b["seq"] else ""
                log(f"    {a['ms']:7.3f} → {b['ms']:7.3f}  {a['hit']:>4d}/{a['read']:<3d} → {b['hit']:>4d}/{b['read']:<3d} "
                    f"{','.join(b['indexes']) or '-'}{seq}  {b['query']}")
    return ratios


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20,000 tasks, 200,000 events, 30 days, fewer repeats")
    ap.add_argument("--tasks", type=int)
    ap.add_argument("--events", type=int)
    ap.add_argument("--days", type=int, help="the history spans this many days (default 365, --quick 30)")
    ap.add_argument("--repeat", type=int, help="timed runs per query (the median is printed; default 7, --quick 5)")
    ap.add_argument("--rounds", type=int, help="rounds of the empty/full comparison (default 20, --quick 8)")
    ap.add_argument("--calls", type=int, default=25, help="calls of each function per round on each database")
    ap.add_argument("--warmup", type=int, default=200, help="calls of each function on each database first, not counted")
    ap.add_argument("--explain", action="store_true", help="print the plans inside claim and reconcile anyway")
    ap.add_argument("--assert-ratio", action="store_true", help="exit 1 if claim or reconcile is over 1.2x")
    ap.add_argument("--url", default=os.environ.get("TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    ap.add_argument("--keep", action="store_true", help="keep the database (its name is printed)")
    args = ap.parse_args()
    args.tasks = args.tasks or (20_000 if args.quick else 1_000_000)
    args.events = args.events or (200_000 if args.quick else 10_000_000)
    args.days = args.days or (30 if args.quick else 365)
    args.repeat = args.repeat or (5 if args.quick else 7)
    args.rounds = args.rounds or (8 if args.quick else 20)
    n = args.tasks
    if n <= LIVE * 2:
        ap.error(f"--tasks must be more than {LIVE * 2}")
    name = f"lf_bench_views_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.url, autocommit=True) as admin:
        admin.execute(f'create database "{name}"')
    url = make_conninfo(args.url, dbname=name)
    started = time.perf_counter()
    failures = 0
    broken = False
    try:
        migrate(url)
        with psycopg.connect(url, autocommit=True) as conn, \
                scratch_db(args.url, "views_empty", keep=args.keep) as empty_url, \
                psycopg.connect(empty_url, autocommit=True) as empty:
            log(stamp(conn))
            build_live(empty, n)  # the same live work, and never any history
            empty.execute("vacuum analyze")
            t_end = build_live(conn, n)
            conn.execute("vacuum analyze")
            before = bench_claim_reconcile(conn, args.repeat)
            log(f"live work only: claim {before['claim']:.2f} ms, reconcile {before['reconcile']:.2f} ms, "
                f"heartbeat {before['heartbeat']:.2f} ms")
            build_history(conn, n, args.events, args.days, t_end)
            row = conn.execute(
                "select (select count(*) from fleet.tasks), (select count(*) from fleet.events),"
                " (select count(*) from fleet.runs), (select count(*) from fleet.sessions),"
                " pg_size_pretty(pg_database_size(current_database()))").fetchone()
            assert row is not None
            log(f"data: {row[0]:,} tasks, {row[1]:,} events, {row[2]:,} runs, {row[3]:,} sessions, "
                f"{row[4]} on disk; loaded in {time.perf_counter() - started:.0f} s")

            # what the monitor pass does: roll the closed hours up (the first call: 30 days)
            live, _ = timed(conn, LIVE_WINDOW, 3)
            log(f"30 days of lane-hours computed live (no roll-up yet): {live:.0f} ms")
            t0 = time.perf_counter()
            written = conn.execute("select fleet.roll_up_lane_hours()").fetchone()[0]  # type: ignore[index]
            log(f"first roll-up (30 days): {written:,} lane-hours in {(time.perf_counter() - t0) * 1000:.0f} ms")
            if written <= 0:  # the 30-day views below would read an empty roll-up and time nothing
                log("FAILED: the first roll-up wrote no lane-hours (was one committed before the history?)")
                broken = True
            noop, _ = timed(conn, "select fleet.roll_up_lane_hours()", args.repeat, rollback=True)
            log(f"a roll-up before the next hour closes (no-op): {noop:.2f} ms")
            xs = []
            for _ in range(args.repeat):
                with conn.transaction(force_rollback=True):
                    conn.execute("update fleet.lane_hours_rollup set rolled_until = rolled_until - interval '1 hour'")
                    t0 = time.perf_counter()
                    conn.execute("select fleet.roll_up_lane_hours()").fetchall()
                    xs.append((time.perf_counter() - t0) * 1000)
            log(f"a roll-up when an hour has closed (recomputes 3 hours): {statistics.median(xs):.1f} ms")

            log("")
            log(f"{'query':36s} {'server':>9s} {'client':>9s} {'rows':>6s}  <100ms  indexes / seq scans")
            for label, sql in [*VIEWS.items(), *COHORTS.items()]:
                if label in COHORTS and label == next(iter(COHORTS)):
                    log("(functions: not views; the cost follows the cohort)")
                ms, rows = timed(conn, sql, args.repeat)
                server = server_ms(conn, sql, args.repeat)
                plan = conn.execute(f"explain (format json) {sql}").fetchone()[0][0]["Plan"]  # type: ignore[index]
                nodes = plan_nodes(plan)
                idx = sorted({x["Index Name"] for x in nodes if "Index Name" in x})
                seq = sorted({x["Relation Name"] for x in nodes if x["Node Type"] == "Seq Scan"})
                ok = server < 100
                failures += 0 if ok or label in COHORTS else 1
                log(f"{label:36s} {server:6.1f} ms {ms:6.1f} ms {rows:6d}  {'yes' if ok else 'NO ':6s} "
                    f"{','.join(idx) or '-'}{' / seq: ' + ','.join(seq) if seq else ''}")
            renew_live(conn)
            after = bench_claim_reconcile(conn, args.repeat)
            log("")
            log(f"{'':36s} {'live only':>10s} {'with history':>13s}   (one database, before and after the load)")
            for key in ("claim", "reconcile", "heartbeat"):
                log(f"{'fleet.' + key + '()':36s} {before[key]:7.2f} ms {after[key]:10.2f} ms")
            ratios = compare(empty_url, url, args.rounds, args.calls, args.explain, args.warmup)
            over = [k for k in ("claim", "reconcile") if ratios[k] > GOAL]
            if args.assert_ratio:
                failures += len(over)
            log(json.dumps({"views_over_100ms": failures, "ratios_full_to_empty": {k: round(v, 3) for k, v in ratios.items()},
                            "over_goal": over, "seconds": round(time.perf_counter() - started)}))
    finally:
        if not args.keep:
            with psycopg.connect(args.url, autocommit=True) as admin:
                admin.execute(f'drop database if exists "{name}" with (force)')
        else:
            log(f"kept database {name}")
    return 1 if failures or broken else 0


if __name__ == "__main__":
    sys.exit(main())
