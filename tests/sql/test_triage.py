"""Triage with a denominator (issue #21 item 5): fleet.route out of a triage lane records the verdict
(migrations/sources/08_finish.sql), fleet.triage_metrics counts the verdicts of a window and those
that were wrong (migrations/sources/15_cohorts.sql). A known history made with the real SQL API,
its exact figures asserted, one task per way a verdict ends.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from sqlkit import (
    as_key,
    call,
    cancel,
    complete,
    enqueue,
    explain,
    fail,
    fill,
    hand_off,
    last_event,
    member_usage,
    one,
    open_session,
    release,
    retry,
    route,
    rows,
    scans_of,
    sync_lane,
    take_lease,
)

WINDOW = "now() - interval '1 hour', now() + interval '1 hour'"
FIGURES = ("verdicts", "misclassified", "routed_again", "evicted", "failed", "correct", "cancelled", "undecided",
           "misclassification_rate")


def metrics(conn: psycopg.Connection, lane: str | None = None, window: str = WINDOW) -> dict[Any, dict[str, Any]]:
    """(triage lane, verdict lane) -> its figures; verdict lane None: the triage lane's total."""
    got = rows(conn, f"select * from fleet.triage_metrics({window}, %s)", (lane,))
    return {(r["triage_lane"], r["verdict_lane"]): {k: r[k] for k in FIGURES} for r in got}


def figures(verdicts: int, routed: int = 0, evicted: int = 0, failed: int = 0, correct: int = 0,
            cancelled: int = 0, undecided: int = 0) -> dict[str, Any]:
    missed = routed + evicted + failed
    assert verdicts == missed + correct + cancelled + undecided
    decided = missed + correct
    return {"verdicts": verdicts, "misclassified": missed, "routed_again": routed, "evicted": evicted,
            "failed": failed, "correct": correct, "cancelled": cancelled, "undecided": undecided,
            "misclassification_rate": round(Decimal(missed) / decided, 4) if decided else None}


class Fleet:
    """Lanes triage (a triage lane), plain (not one), fix and docs; a session in each."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn
        sync_lane(conn, "triage", config={"triage": True}, backoff_base_seconds=0)
        sync_lane(conn, "plain", backoff_base_seconds=0)
        sync_lane(conn, "fix", backoff_base_seconds=0, max_attempts=3, max_handoffs=0)
        sync_lane(conn, "docs", backoff_base_seconds=0)
        self.sessions = {lane: open_session(conn, lane) for lane in ("triage", "plain", "fix", "docs")}

    def lease(self, task_id: int) -> uuid.UUID:
        lane = one(self.conn, "select lane from fleet.tasks where id = %s", (task_id,))
        return take_lease(self.conn, self.sessions[lane], task_id)

    def triaged(self, key: str, to: str, source: str = "triage") -> int:
        """A task queued in ``source`` and routed from there to ``to``."""
        task_id = enqueue(self.conn, source, key)
        route(self.conn, task_id, self.lease(task_id), to)
        return task_id

    def done(self, task_id: int) -> None:
        complete(self.conn, task_id, self.lease(task_id))


@pytest.fixture
def fleet(conn: psycopg.Connection) -> Fleet:
    return Fleet(conn)


# ------------------------------------------------------------------------------------------------
# the verdict


def test_a_route_out_of_a_triage_lane_records_its_verdict(conn: psycopg.Connection, fleet: Fleet) -> None:
    judged = fleet.triaged("t1", "fix")
    event = last_event(conn, judged)
    assert (event["kind"], event["lane"]) == ("routed", "triage")
    assert event["detail"] == {"from": "triage", "to": "fix", "note": None, "verdict": "fix"}
    # a route out of a lane that is no triage lane is no verdict, and counts nowhere
    plain = fleet.triaged("p1", "fix", source="plain")
    assert last_event(conn, plain)["detail"] == {"from": "plain", "to": "fix", "note": None}
    # and neither is the next route of a triaged task, out of its verdict lane
    route(conn, judged, fleet.lease(judged), "docs")
    assert "verdict" not in last_event(conn, judged)["detail"]
    assert set(metrics(conn)) == {("triage", None), ("triage", "fix")}


def test_the_setting_is_read_at_the_route(conn: psycopg.Connection, fleet: Fleet) -> None:
    """A lane made a triage lane later does not turn its earlier routes into verdicts."""
    fleet.triaged("p1", "fix", source="plain")
    assert metrics(conn) == {}
    assert one(conn, "select fleet.sync_lane('plain', %s::jsonb)", ('{"config": {"triage": true}}',)) == "updated"
    fleet.triaged("p2", "fix", source="plain")
    assert metrics(conn) == {("plain", None): figures(1, undecided=1), ("plain", "fix"): figures(1, undecided=1)}


# ------------------------------------------------------------------------------------------------
# each way a verdict ends


def test_a_verdict_done_there_is_correct_and_an_open_one_undecided(conn: psycopg.Connection, fleet: Fleet) -> None:
    fleet.done(fleet.triaged("c1", "fix"))
    running = fleet.triaged("c2", "fix")
    fleet.lease(running)
    fleet.triaged("c3", "fix")  # queued there
    cancel(conn, fleet.triaged("c4", "fix"))
    # a failed attempt in the triage lane, before the verdict, is not the verdict's
    before = enqueue(conn, "triage", "c5")
    fail(conn, before, fleet.lease(before), "flaky")
    route(conn, before, fleet.lease(before), "fix")
    fleet.done(before)
    assert metrics(conn) == {("triage", None): figures(5, correct=2, cancelled=1, undecided=2),
                             ("triage", "fix"): figures(5, correct=2, cancelled=1, undecided=2)}


def test_a_task_routed_again_out_of_its_verdict_lane_was_misclassified(conn: psycopg.Connection,
                                                                        fleet: Fleet) -> None:
    onward = fleet.triaged("r1", "fix")
    route(conn, onward, fleet.lease(onward), "docs")
    fleet.done(onward)                           # done in docs: still a wrong verdict
    back = fleet.triaged("r2", "fix")
    route(conn, back, fleet.lease(back), "triage")
    route(conn, back, fleet.lease(back), "docs")  # triaged again: a second verdict, undecided
    assert metrics(conn) == {("triage", None): figures(3, routed=2, undecided=1),
                             ("triage", "docs"): figures(1, undecided=1),
                             ("triage", "fix"): figures(2, routed=2)}


def test_a_failed_attempt_or_a_death_there_is_a_misclassification(conn: psycopg.Connection, fleet: Fleet) -> None:
    again = fleet.triaged("f1", "fix")
    fail(conn, again, fleet.lease(again), "flaky")   # back to the queue, then done: a wrong verdict all the same
    fleet.done(again)
    fatal = fleet.triaged("f2", "fix")
    assert fail(conn, fatal, fleet.lease(fatal), "cannot", retryable=False) == "dead"
    handoffs = fleet.triaged("f3", "fix")
    assert hand_off(conn, handoffs, fleet.lease(handoffs), {}) == "dead"  # fix: max_handoffs 0
    lost = fleet.triaged("f4", "fix")
    for _ in range(3):  # three lost runs: the attempt cap of fix
        fleet.lease(lost)
        release(conn, lost, "lease-expired")
    assert one(conn, "select state from fleet.tasks where id = %s", (lost,)) == "dead"
    # a hand-off and a lost run that leave the task queued are no misclassification
    fine = fleet.triaged("f5", "docs")
    hand_off(conn, fine, fleet.lease(fine), {})
    fleet.sessions["docs"] = open_session(conn, "docs")  # a hand-off is for the next shift
    fleet.lease(fine)
    release(conn, fine, "lease-expired")
    fleet.done(fine)
    # dead, retried by the operator and done: it died there
    revived = fleet.triaged("f6", "docs")
    fail(conn, revived, fleet.lease(revived), "cannot", retryable=False)
    retry(conn, revived)
    fleet.done(revived)
    assert metrics(conn) == {("triage", None): figures(6, failed=5, correct=1),
                             ("triage", "docs"): figures(2, failed=1, correct=1),
                             ("triage", "fix"): figures(4, failed=4)}


def test_a_task_evicted_from_a_batch_there_was_misclassified(conn: psycopg.Connection, fleet: Fleet) -> None:
    ids = {k: fleet.triaged(k, "fix") for k in ("b1", "b2", "b3")}
    batch = call(conn, "batch_create", "fix", ["b1", "b2", "b3"], 4, None)
    carrier = one(conn, "select task_id from fleet.batches where id = %s", (batch,))
    ctok = fleet.lease(carrier)
    call(conn, "batch_setup", carrier, ctok, "main", f"batch/{batch}")
    call(conn, "batch_member_start", carrier, ctok, 1, f"batch/{batch}-m1", "/w/m1", "c0")
    call(conn, "batch_member_gate", carrier, ctok, 1, "pending", None, member_usage(200, exit_code=0))
    call(conn, "batch_member_gate", carrier, ctok, 1, "ok", None, None)
    assert call(conn, "batch_member_landed", carrier, ctok, 1, "c0", "c1", "ok") == "landed"
    call(conn, "batch_member_start", carrier, ctok, 2, f"batch/{batch}-m2", "/w/m2", "c1")
    call(conn, "batch_member_gate", carrier, ctok, 2, "pending", None, member_usage(300, exit_code=0))
    assert call(conn, "batch_member_evicted", carrier, ctok, 2, "FAILED test_x", "task-failed", None) == "queued"
    call(conn, "batch_member_start", carrier, ctok, 3, f"batch/{batch}-m3", "/w/m3", "c1")
    assert call(conn, "batch_member_evicted", carrier, ctok, 3, "the agent exited 1", "task-failed",
                member_usage(400, exit_code=1)) == "queued"
    fleet.done(ids["b2"])  # done as an ordinary task after its eviction: the verdict was wrong
    assert one(conn, "select state from fleet.tasks where id = %s", (ids["b1"],)) == "done"
    # the carrier was never triaged: no verdict of its own
    assert metrics(conn) == {("triage", None): figures(3, evicted=2, correct=1),
                             ("triage", "fix"): figures(3, evicted=2, correct=1)}


# ------------------------------------------------------------------------------------------------
# the window, the lane, the keys


def test_the_window_and_the_lane(conn: psycopg.Connection, fleet: Fleet) -> None:
    fleet.done(fleet.triaged("w1", "fix"))
    old = fleet.triaged("w2", "docs")
    conn.execute("update fleet.events set ts = now() - interval '2 days' where task_id = %s and kind = 'routed'",
                 (old,))
    fleet.triaged("p1", "docs", source="plain")
    assert metrics(conn) == {("triage", None): figures(1, correct=1), ("triage", "fix"): figures(1, correct=1)}
    assert metrics(conn, window="now() - interval '3 days', now() - interval '1 day'") == {
        ("triage", None): figures(1, undecided=1), ("triage", "docs"): figures(1, undecided=1)}
    # p_lane: the verdicts from that lane or to it
    assert metrics(conn, "fix") == metrics(conn, "triage") == metrics(conn)
    assert metrics(conn, "docs") == metrics(conn, "plain") == metrics(conn, "lane-none") == {}


def test_a_lane_scoped_key_sees_the_verdicts_of_its_lanes_only(conn: psycopg.Connection, fleet: Fleet) -> None:
    fleet.done(fleet.triaged("k1", "fix"))
    fleet.triaged("k2", "docs")
    everything = metrics(conn)
    assert set(everything) == {("triage", None), ("triage", "fix"), ("triage", "docs")}

    def as_lanes(*lanes: str, lane: str | None = None) -> dict[Any, dict[str, Any]]:
        with as_key(conn, "fleet_operator", {"role": "fleet_operator", "fleet_lanes": list(lanes)}):
            return metrics(conn, lane)

    # a verdict counts for a key of both its lanes: its outcome is read in the verdict lane
    assert as_lanes("triage", "fix") == {("triage", None): figures(1, correct=1),
                                         ("triage", "fix"): figures(1, correct=1)}
    assert as_lanes("triage") == as_lanes("fix") == as_lanes("fix", "docs") == {}
    assert as_lanes("triage", "fix", lane="docs") == {}
    assert as_lanes("*") == everything
    with as_key(conn, "fleet_worker", {"role": "fleet_worker", "fleet_lanes": ["triage", "fix"]}), \
            pytest.raises(psycopg.errors.InsufficientPrivilege):
        metrics(conn)


# ------------------------------------------------------------------------------------------------
# the plan


def test_triage_metrics_reads_through_indexes(conn: psycopg.Connection, fleet: Fleet) -> None:
    """5,000 tasks and a year of their journal: the window's routes by events_kind_ts, each verdict's
    later events by events_task, its task by its key."""
    fill(conn, "fix", 5000)
    conn.execute("""
        insert into fleet.events (ts, kind, lane, task_id, detail)
        select now() - (g % 365) * interval '1 day' - (g % 86400) * interval '1 second',
               (array['claimed', 'completed', 'failed', 'routed', 'checkpoint'])[1 + g % 5],
               (array['triage', 'fix', 'docs'])[1 + g % 3],
               (select min(id) from fleet.tasks) + g % 5000,
               case when g % 5 = 3 then jsonb_build_object('verdict', 'fix') else '{}' end
          from generate_series(1, 60000) g""")
    conn.execute("analyze fleet.events")
    conn.execute("analyze fleet.tasks")
    nodes = explain(conn, "select * from fleet.triage_metrics(now() - interval '7 days', now())")
    events, tasks = scans_of(nodes, "events"), scans_of(nodes, "tasks")
    assert "Seq Scan" not in {node for node, _ in events + tasks}, (events, tasks)
    assert {index for _, index in events} == {"events_kind_ts", "events_task"}, events
    assert {index for _, index in tasks} == {"tasks_pkey"}, tasks
