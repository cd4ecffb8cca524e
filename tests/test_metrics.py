"""``/metrics`` (monitor/metrics.py): the exposition of a scrape, parsed by prometheus_client's own
parser, holds what the tables count, on both back-ends; a key of some lanes gets those lanes' series
only (through the real PostgREST stack); a store that cannot be read is one clear error, never a
crash. (fleet.metrics() itself, its counters across a roll-up and its plan: tests/sql/test_metrics.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import prometheus_client
import psycopg
import pytest
from fleetkit import Backend
from prometheus_client.parser import text_string_to_metric_families

from monitor.metrics import SPECS, MetricsUnavailable, metrics_payload, registry_for
from worker.config import LaneConfig
from worker.dev.devstack import DevStack
from worker.store.postgres import PostgresStore
from worker.store.sync import lane_settings

Series = tuple[str, frozenset[tuple[str, str]]]
CLOCK = {"lanefleet_oldest_ready_seconds", "lanefleet_pool_throttled_seconds", "lanefleet_scrape_duration_seconds"}


def settings(**kw: Any) -> dict[str, Any]:
    return lane_settings(LaneConfig(command=["true"], **kw))


def scrape(store: Any) -> tuple[dict[Series, float], list[Any]]:
    """One scrape: {(sample name, labels): value} and the families, as Prometheus's parser reads them."""
    body, content_type = metrics_payload(store)
    assert content_type == prometheus_client.CONTENT_TYPE_LATEST
    fams = list(text_string_to_metric_families(body.decode()))
    out: dict[Series, float] = {}
    for fam in fams:
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"{key} twice"
            out[key] = s.value
    return out, fams


def series(name: str, **labels: str) -> Series:
    return (name, frozenset(labels.items()))


def build(db_url: str) -> None:
    """Lanes docs (3 slots, profile prof of pool ``pool``, 2 slots) and ops; a shift of each; every
    outcome the scrape counts, made through the store's calls."""
    direct = PostgresStore(db_url)
    try:
        direct.sync_pool("pool", 2)
        direct.sync_profile("prof", "pool", {})
        direct.sync_lane("docs", settings(profile="prof", max_running=3, backoff_base_seconds=0))
        direct.sync_lane("ops", settings(backoff_base_seconds=0))
        for i in range(5):
            direct.enqueue("docs", f"d:{i}")
        direct.enqueue("ops", "o:1")
        direct.enqueue("ops", "o:2")
        s = direct.open_session("docs", "host-1", 4242, None, 600)
        done, failed = direct.claim(s, 2)  # the pool's 2 slots
        assert done.lease_token and failed.lease_token
        for t, tokens in ((done, 100), (failed, 7)):
            direct.record_run(t.lease_token, {"input_tokens": tokens, "cache_creation_tokens": 2 * tokens,
                                              "cache_read_tokens": 3 * tokens, "output_tokens": 4 * tokens,
                                              "cost_usd": tokens / 100, "model": "m"})
        assert direct.complete(done.id, done.lease_token) == "done"
        [throttled] = direct.claim(s, 1)
        assert throttled.lease_token
        assert direct.fail(failed.id, failed.lease_token, "tests failed") == "queued"
        direct.throttle(throttled.id, throttled.lease_token, after_seconds=900, note="usage limit")
        so = direct.open_session("ops", "host-2", 4243, None, 600)
        [o] = direct.claim(so, 1)
        assert o.lease_token is not None
        assert direct.complete(o.id, o.lease_token) == "done"
    finally:
        direct.close()


def counted(db_url: str, lane: str) -> dict[Series, float]:
    """The series of ``lane`` counted from the tables by SQL of their own."""
    with psycopg.connect(db_url) as conn:
        def n(query: str) -> float:
            row = conn.execute(query, {"lane": lane}).fetchone()
            assert row is not None
            return float(row[0])

        runs = "select count(*) from fleet.runs where lane = %(lane)s and outcome = "
        out = {series("lanefleet_tasks", lane=lane, state=state):
               n(f"select count(*) from fleet.tasks where lane = %(lane)s and state = '{state}'")
               for state in ("queued", "running", "blocked", "review", "ci", "batched", "dead")}
        out |= {
            series("lanefleet_tasks_ready", lane=lane):
                n("select count(*) from fleet.tasks where lane = %(lane)s and state = 'queued' and run_at <= now()"),
            series("lanefleet_claims_total", lane=lane): n("select count(*) from fleet.runs where lane = %(lane)s"),
            series("lanefleet_completions_total", lane=lane): n(runs + "'done'"),
            series("lanefleet_failures_total", lane=lane): n(runs + "'failed'"),
            series("lanefleet_repairs_total", lane=lane): n(runs + "'lost'"),
            series("lanefleet_enqueued_total", lane=lane): n("select count(*) from fleet.tasks where lane = %(lane)s"),
            series("lanefleet_shifts_active", lane=lane):
                n("select count(*) from fleet.sessions where lane = %(lane)s and state = 'active'"),
            series("lanefleet_cost_usd_total", lane=lane):
                n("select coalesce(sum(cost_usd), 0) from fleet.runs where lane = %(lane)s and ended_at is not null"),
        }
        for kind in ("input", "cache_creation", "cache_read", "output"):
            out[series("lanefleet_tokens_total", lane=lane, kind=kind)] = n(
                f"select coalesce(sum({kind}_tokens), 0) from fleet.runs where lane = %(lane)s and ended_at is not null")
        return out


def test_the_exposition_holds_what_the_tables_count(backend: Backend) -> None:
    build(backend.db_url)
    store = backend.store(backend.key("operator"))
    try:
        got, fams = scrape(store)
    finally:
        store.close()
    for lane in ("docs", "ops"):
        want = counted(backend.db_url, lane)
        assert {k: got.get(k) for k in want} == want, lane
    # the figures the history was made for
    assert got[series("lanefleet_tasks", lane="docs", state="queued")] == 4  # 2 never claimed, failed, throttled
    assert got[series("lanefleet_tasks", lane="docs", state="running")] == 0
    assert got[series("lanefleet_tokens_total", lane="docs", kind="output")] == 428
    assert got[series("lanefleet_completions_total", lane="ops")] == 1
    assert got[series("lanefleet_throttles_total", lane="docs", pool="pool")] == 1
    assert got[series("lanefleet_lane_slots", lane="docs")] == 3
    assert got[series("lanefleet_lane_idle_slots", lane="docs")] == 3
    assert series("lanefleet_lane_slots", lane="ops") not in got  # unlimited
    assert got[series("lanefleet_oldest_ready_seconds", lane="docs")] >= 0
    assert got[series("lanefleet_pool_slots", pool="pool")] == 2
    assert got[series("lanefleet_pool_in_use", pool="pool")] == 0
    assert got[series("lanefleet_pool_throttled", pool="pool")] == 1
    assert 800 < got[series("lanefleet_pool_throttled_seconds", pool="pool")] <= 900
    assert 0 < got[series("lanefleet_scrape_duration_seconds")] < 10
    # every family the collector names is there with its HELP and TYPE, counters as counters
    types = {f.name: f.type for f in fams}
    for metric, spec in SPECS.items():
        name = "lanefleet_" + metric.removesuffix("_total")
        assert types.get(name) == spec.kind, metric
    assert all(f.documentation for f in fams)


def test_a_key_of_some_lanes_scrapes_their_series_only(stack: DevStack) -> None:
    """Through the real stack (nginx → PostgREST → PostgreSQL): an operator key of lane ops gets
    ops's series and no pool (ops draws from none); one of docs gets docs's and its pool's."""
    backend = Backend("supabase", stack.db_url, stack)
    build(stack.db_url)
    stores = [backend.store(backend.key("operator", lanes)) for lanes in (None, ["ops"], ["docs"])]
    try:
        (every, _), (ops, _), (docs, _) = (scrape(s) for s in stores)
    finally:
        for s in stores:
            s.close()

    def of(got: dict[Series, float]) -> tuple[set[str], set[str]]:
        labels = [dict(k[1]) for k in got]
        return {lb["lane"] for lb in labels if "lane" in lb}, {lb["pool"] for lb in labels if "pool" in lb}

    assert of(every) == ({"docs", "ops"}, {"pool"})
    assert of(ops) == ({"ops"}, set())
    assert of(docs) == ({"docs"}, {"pool"})
    for mine, lane in ((ops, "ops"), (docs, "docs")):
        # its lanes' series are what a key of every lane scrapes of them
        theirs = {k: v for k, v in every.items() if dict(k[1]).get("lane") == lane
                  or (lane == "docs" and "pool" in dict(k[1]) and "lane" not in dict(k[1]))}
        assert {k for k in mine if k[0] not in CLOCK} == {k for k in theirs if k[0] not in CLOCK}
        assert {k: v for k, v in mine.items() if k[0] not in CLOCK} == {
            k: v for k, v in theirs.items() if k[0] not in CLOCK}


@pytest.fixture
def nowhere() -> Iterator[PostgresStore]:
    """A store of a server that is not there (a closed loopback port), one quick attempt."""
    store = PostgresStore("postgresql://postgres@127.0.0.1:9/none", attempts=1, timeout=1.0, call_budget=2.0)
    yield store
    store.close()


def test_a_store_that_cannot_be_read_is_one_clear_error(nowhere: PostgresStore, empty_db_url: str) -> None:
    registry = registry_for(nowhere)  # registering reads nothing
    with pytest.raises(MetricsUnavailable, match=r"^cannot read the fleet's metrics: .*unreachable") as info:
        metrics_payload(nowhere, registry)
    assert "\n" not in str(info.value)
    # a database without the migrations: what to do about it
    unmigrated = PostgresStore(empty_db_url, attempts=1)
    try:
        with pytest.raises(MetricsUnavailable, match='schema "fleet" does not exist') as info:
            metrics_payload(unmigrated)
        assert "\n" not in str(info.value)
    finally:
        unmigrated.close()


def test_the_fleets_metrics_stay_out_of_the_process_wide_registry(db_url: str) -> None:
    store = PostgresStore(db_url)
    try:
        registry = registry_for(store)
        body, _ = metrics_payload(store, registry)
        assert b"lanefleet_claims_total{" not in body  # no lane: no series, the families alone
        assert b"# TYPE lanefleet_claims_total counter" in body
        assert prometheus_client.generate_latest(prometheus_client.REGISTRY).count(b"lanefleet_") == 0
        store.sync_lane("docs", settings())
        body, _ = metrics_payload(store, registry)  # the app's registry, scraped again: read again
        assert b'lanefleet_claims_total{lane="docs"} 0.0' in body
    finally:
        store.close()
