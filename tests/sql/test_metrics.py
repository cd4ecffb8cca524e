"""The metrics group (migrations/sources/18_metrics.sql): fleet.metrics(), the samples of a Prometheus
scrape, checked against direct counts of the tables after a small real history; its counters never
go down across a roll-up; a key limited to some lanes gets its lanes' samples alone. (The exposition
built from it: tests/test_metrics.py.)
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from sqlkit import (
    as_key,
    call,
    claim_one,
    complete,
    enqueue,
    explain,
    fail,
    function_body,
    hand_off,
    one,
    open_session,
    parenthesised_after,
    record_run,
    release,
    roll_up,
    scans_of,
    sync_lane,
    take,
    throttle,
)

Sample = tuple[str, str | None, str | None, str | None]


def metrics(conn: psycopg.Connection) -> dict[Sample, float]:
    """fleet.metrics() as {(metric, lane, pool, label): value}; a sample given twice fails."""
    got = one(conn, "select fleet.metrics()")
    out = {(m["metric"], m["lane"], m["pool"], m["label"]): m["value"] for m in got}
    assert len(out) == len(got), "a sample given twice"
    return out


def usage(tokens: int, cost: float) -> dict[str, Any]:
    return {"input_tokens": tokens, "cache_creation_tokens": 2 * tokens, "cache_read_tokens": 3 * tokens,
            "output_tokens": 4 * tokens, "cost_usd": cost, "model": "m-test"}


def block(conn: psycopg.Connection, task_id: int, token: Any, reason: str, evidence: str) -> str:
    return str(one(conn, "select fleet.block(%s, %s, %s, %s)", (task_id, token, reason, evidence)))


def build_history(conn: psycopg.Connection) -> dict[str, int]:
    """Lane ``a`` (3 slots, profile ``prof`` drawing from pool ``pool`` of 2 slots) and lane ``b``
    (review, no limit, a batch of two): every outcome a scrape counts, made by the SQL API."""
    one(conn, "select fleet.sync_pool('pool', 2)")
    one(conn, "select fleet.sync_profile('prof', 'pool', '{}')")
    sync_lane(conn, "a", max_running=3, max_attempts=2, backoff_base_seconds=0, config={"profile": "prof"})
    sync_lane(conn, "b", backoff_base_seconds=0, config={"review": True})
    s = open_session(conn, "a")
    ids = {k: enqueue(conn, "a", k) for k in ("done", "retried", "throttled", "repaired", "running",
                                              "handed", "dead", "blocked", "ci", "later")}
    tok = take(conn, s, ids["done"])["lease_token"]
    record_run(conn, tok, usage(100, 0.25))
    complete(conn, ids["done"], tok)
    tok = take(conn, s, ids["retried"])["lease_token"]
    record_run(conn, tok, usage(10, 0.01))
    fail(conn, ids["retried"], tok)
    take(conn, s, ids["repaired"])
    release(conn, ids["repaired"], "lease-expired")
    hand_off(conn, ids["handed"], take(conn, s, ids["handed"])["lease_token"], {})
    for _ in range(2):
        fail(conn, ids["dead"], take(conn, s, ids["dead"])["lease_token"])
    block(conn, ids["blocked"], take(conn, s, ids["blocked"])["lease_token"], "automation-broken", "gate crashed")
    take(conn, s, ids["running"])
    # the last claim of the lane: the pool is throttled after it (its reset in 10 minutes)
    throttle(conn, ids["throttled"], take(conn, s, ids["throttled"])["lease_token"], after_seconds=600)
    # ci: a task a source fed waits there for its pull request's checks (fleet._done_state); set here
    conn.execute("update fleet.tasks set state = 'ci' where id = %s", (ids["ci"],))
    conn.execute("update fleet.tasks set run_at = now() + interval '1 hour' where id = %s", (ids["later"],))
    conn.execute("update fleet.tasks set run_at = now() - interval '90 seconds' where state = 'queued'"
                 " and lane = 'a' and id <> all(%s)", ([ids["later"], ids["throttled"]],))
    sb = open_session(conn, "b")
    for key in ("b1", "b2"):
        enqueue(conn, "b", key)
    b1 = claim_one(conn, sb)
    record_run(conn, b1["lease_token"], usage(1000, 1.5))
    assert complete(conn, b1["id"], b1["lease_token"]) == "review"
    call(conn, "close_session", sb, "deadline", {})
    for key in ("b3", "b4"):
        enqueue(conn, "b", key)
    call(conn, "batch_create", "b", ["b3", "b4"], 4, None)  # its members wait in state batched
    return ids


def direct(conn: psycopg.Connection, lane: str) -> dict[str, float]:
    """The figures of a lane counted from the tables, each its own query."""
    def n(query: str) -> float:
        return float(one(conn, query, {"lane": lane}))

    runs = "select count(*) from fleet.runs where lane = %(lane)s and outcome = "
    tokens = "select coalesce(sum({}), 0) from fleet.runs where lane = %(lane)s and ended_at is not null"
    return {
        **{f"tasks/{state}": n(f"select count(*) from fleet.tasks where lane = %(lane)s and state = '{state}'")
           for state in ("queued", "running", "blocked", "review", "ci", "batched", "dead")},
        "tasks_ready": n("select count(*) from fleet.tasks where lane = %(lane)s and state = 'queued'"
                         " and run_at <= now()"),
        "claims_total": n("select count(*) from fleet.runs where lane = %(lane)s"),
        "completions_total": n(runs + "'done'"),
        "failures_total": n(runs + "'failed'"),
        "handoffs_total": n(runs + "'handed_off'"),
        "repairs_total": n(runs + "'lost'"),
        "cancellations_total": n(runs + "'cancelled'"),
        "repaired events": n("select count(*) from fleet.journal where lane = %(lane)s and kind = 'repaired'"),
        "enqueued_total": n("select count(*) from fleet.tasks where lane = %(lane)s"),
        "shifts_active": n("select count(*) from fleet.sessions where lane = %(lane)s and state = 'active'"),
        **{f"tokens_total/{kind}": n(tokens.format(f"{kind}_tokens"))
           for kind in ("input", "cache_creation", "cache_read", "output")},
        "cost_usd_total": n(tokens.format("cost_usd")),
    }


def test_metrics_are_the_counts_of_the_tables(conn: psycopg.Connection) -> None:
    ids = build_history(conn)
    m = metrics(conn)
    for lane in ("a", "b"):
        want = direct(conn, lane)
        got = {k: m.get((k.split("/")[0], lane, None, k.split("/")[1] if "/" in k else None))
               for k in want if k != "repaired events"}
        assert got == {k: v for k, v in want.items() if k != "repaired events"}, lane
        assert want["repaired events"] == want["repairs_total"]  # a repair is a lost run
    # the history made the figures it was built for
    a = direct(conn, "a")
    assert (a["tasks/queued"], a["tasks_ready"], a["tasks/running"], a["tasks/blocked"], a["tasks/ci"],
            a["tasks/dead"], a["repairs_total"], a["failures_total"], a["handoffs_total"]) == (
        5, 3, 1, 1, 1, 1, 1, 3, 1)
    assert m[("tasks", "b", None, "review")] == 1
    assert m[("tasks", "b", None, "batched")] == 2
    assert m[("tokens_total", "b", None, "output")] == 4000
    assert m[("cost_usd_total", "b", None, None)] == 1.5
    # slots and the oldest ready task
    assert m[("lane_slots", "a", None, None)] == 3
    assert m[("lane_idle_slots", "a", None, None)] == 2
    assert ("lane_slots", "b", None, None) not in m  # unlimited: no sample
    assert 89 <= m[("oldest_ready_seconds", "a", None, None)] < 120
    assert m[("oldest_ready_seconds", "b", None, None)] >= 0
    assert m[("shifts_active", "a", None, None)] == 1 and m[("shifts_active", "b", None, None)] == 0
    assert m[("lane_paused", "a", None, None)] == 0
    # throttles by lane and pool: the runs, and the journal, say one
    assert m[("throttles_total", "a", "pool", None)] == 1 == one(
        conn, "select count(*) from fleet.journal where kind = 'throttled' and lane = 'a'"
              " and detail ->> 'pool' = 'pool'")
    # the pool now: 2 slots, the running task of a in it, throttled for some 10 minutes
    assert m[("pool_slots", None, "pool", None)] == 2
    assert m[("pool_in_use", None, "pool", None)] == one(
        conn, "select count(*) from fleet.tasks where state = 'running' and pool = 'pool'") == 1
    assert m[("pool_throttled", None, "pool", None)] == 1
    assert 500 < m[("pool_throttled_seconds", None, "pool", None)] <= 600
    assert one(conn, "select state from fleet.tasks where id = %s", (ids["throttled"],)) == "queued"


def _time_passes(conn: psycopg.Connection, hours: int) -> None:
    """``hours`` pass: every time of the history, the rolled-up hours and how far the roll-up came,
    moved back by that much (its hours close, for the roll-up to take)."""
    ago = f"interval '{hours} hours'"
    conn.execute(f"update fleet.runs set started_at = started_at - {ago}, ended_at = ended_at - {ago}")
    conn.execute(f"update fleet.tasks set created_at = created_at - {ago}, run_at = run_at - {ago},"
                 f" updated_at = updated_at - {ago}, finished_at = finished_at - {ago}")
    conn.execute(f"update fleet.events set ts = ts - {ago}")
    conn.execute(f"update fleet.sessions set started_at = started_at - {ago}, heartbeat_at = heartbeat_at - {ago},"
                 f" deadline = deadline - {ago}, ended_at = ended_at - {ago}")
    # (the hours one by one would collide with the primary key: all of them out, and back in)
    conn.execute("create temp table moved as select * from fleet.lane_hours")
    conn.execute(f"delete from fleet.lane_hours; update moved set hour = hour - {ago}")
    conn.execute("insert into fleet.lane_hours select * from moved; drop table moved")
    conn.execute(f"update fleet.lane_hours_rollup set rolled_until = rolled_until - {ago}")


def counters(m: dict[Sample, float]) -> dict[Sample, float]:
    return {k: v for k, v in m.items() if k[0].endswith("_total")}


def test_counters_never_go_down_across_a_roll_up(conn: psycopg.Connection) -> None:
    build_history(conn)
    _time_passes(conn, 3)
    live = counters(metrics(conn))  # nothing rolled up: every hour computed live
    assert one(conn, "select count(*) from fleet.lane_hours") == 0
    assert roll_up(conn) > 0
    assert one(conn, "select count(*) from fleet.lane_hours") > 0
    assert counters(metrics(conn)) == live  # the same figures, now from the rolled-up hours

    # more work in the hour not rolled up yet, then that hour rolled up too
    s = open_session(conn, "b")
    t = enqueue(conn, "b", "b5")
    tok = take(conn, s, t)["lease_token"]
    record_run(conn, tok, usage(5, 0.05))
    complete(conn, t, tok)
    later = counters(metrics(conn))
    assert all(later[k] >= v for k, v in live.items()), {k: (v, later[k]) for k, v in live.items() if later[k] < v}
    assert later[("completions_total", "b", None, None)] == live[("completions_total", "b", None, None)] + 1
    _time_passes(conn, 1)
    assert roll_up(conn) > 0  # the hour of that work closed
    assert one(conn, "select count(*) from fleet.lane_hours where lane = 'b' and done > 0") == 2
    assert counters(metrics(conn)) == later


CLOCK = {"oldest_ready_seconds", "pool_throttled_seconds"}  # figures that follow the clock


def test_a_key_of_some_lanes_gets_their_samples_alone(conn: psycopg.Connection) -> None:
    build_history(conn)
    every = metrics(conn)
    sync_lane(conn, "c")
    for lanes, pools in ((["b"], set()), (["a"], {"pool"})):
        with as_key(conn, "fleet_operator", {"role": "fleet_operator", "fleet_lanes": lanes}):
            got = metrics(conn)
        assert {k[1] for k in got if k[1] is not None} == set(lanes)
        assert {k[2] for k in got if k[2] is not None} == pools
        # the samples of its lanes are what every lane's key sees of them
        assert {k: v for k, v in got.items() if k[0] not in CLOCK} == {
            k: v for k, v in every.items()
            if k[0] not in CLOCK and (k[1] in lanes or (k[1] is None and k[2] in pools))}
        assert {k for k in got if k[0] in CLOCK} == {
            k for k in every if k[0] in CLOCK and (k[1] in lanes or (k[1] is None and k[2] in pools))}
    with as_key(conn, "fleet_operator", {"role": "fleet_operator", "fleet_lanes": []}):
        assert metrics(conn) == {}
    with as_key(conn, "fleet_worker", {"role": "fleet_worker", "fleet_lanes": ["a"]}), \
            pytest.raises(psycopg.errors.InsufficientPrivilege):
        metrics(conn)


def test_a_fleet_without_lanes_is_an_empty_scrape(conn: psycopg.Connection) -> None:
    assert one(conn, "select fleet.metrics()") == []


def test_the_scrape_reads_no_table_whole(long_history: psycopg.Connection) -> None:
    """fleet.metrics() on a long history (50,000 done tasks and their runs, 1 % of them throttled,
    5,000 shifts, 20,000 events), rolled up, reads tasks, runs, events and sessions through indexes
    only: what keeps a scrape cheap at 1 M tasks (bench/metrics_scale.py)."""
    conn = long_history
    conn.execute("""
        insert into fleet.runs (task_id, lane, attempt, lease_token, started_at, ended_at, outcome)
        select t.id, t.lane, 1, gen_random_uuid(), t.finished_at - interval '5 minutes', t.finished_at,
               case when t.id % 100 = 0 then 'throttled' else 'done' end
          from fleet.tasks t where t.state = 'done'""")
    conn.execute("analyze fleet.runs")
    roll_up(conn)
    nodes = explain(conn, parenthesised_after(function_body(conn, "fleet.metrics()"), "return"))
    for table in ("tasks", "runs", "events", "sessions", "lane_hours"):
        scans = scans_of(nodes, table)
        assert all(kind != "Seq Scan" for kind, _ in scans), (table, scans)
    # the throttles are counted from their events (events_kind_ts), not from every run
    assert "events_kind_ts" in {index for _, index in scans_of(nodes, "events")}
    assert scans_of(nodes, "lane_hours") == []  # the rolled-up hours are read as their sums
    assert {r[0] for r in conn.execute("select lane from fleet.lane_totals").fetchall()} == {"a", "b", "c", "d"}


def test_the_scrape_is_planned_below_the_cost_that_compiles_it(conn: psycopg.Connection) -> None:
    """A server with JIT compiles a statement whose estimated cost passes jit_above_cost, at every
    execution: with the pool functions' default estimate (1,000 rows each) the scrape cost 12.5 M
    and each scrape spent 1.3 s compiling 3 ms of work (bench/metrics_scale.py). So do the pool
    dashboards that read the same functions."""
    ceiling = float(one(conn, "select current_setting('jit_above_cost')"))
    for query in (parenthesised_after(function_body(conn, "fleet.metrics()"), "return"),
                  "select * from fleet.pool_overview", "select * from fleet.pool_windows"):
        (doc,) = conn.execute("explain (format json) " + query).fetchone()  # type: ignore[misc]
        assert doc[0]["Plan"]["Total Cost"] < ceiling, (query[:60], doc[0]["Plan"]["Total Cost"])
