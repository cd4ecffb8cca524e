"""The fleet in Prometheus's exposition format: what ``/metrics`` of the console serves.

One read per scrape: the store's ``metrics_rows()`` calls ``fleet.metrics()`` (migrations/sources/
18_metrics.sql), which reads the dashboards' views (``fleet.lane_overview``, ``fleet.pool_overview``)
and the hourly roll-up (``fleet.lane_hours``, summed per lane in ``fleet.lane_totals``, and the
hours after it computed live) in one statement; this module only names the samples.
:class:`FleetCollector` is a prometheus_client custom collector over those rows, registered in a
:class:`~prometheus_client.CollectorRegistry` of its own (:func:`registry_for`), never the
process-wide default one: an app serves its store's fleet and nothing else.
:func:`metrics_payload` is what a web handler returns, or :class:`MetricsUnavailable` (a 503) when
the store cannot be read.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.errors import FleetError

PREFIX = "lanefleet_"


class MetricsStore(Protocol):
    """What the collector needs of a store (both back-ends have it)."""

    def metrics_rows(self) -> list[dict[str, Any]]: ...


class MetricsUnavailable(FleetError):
    """The store could not be read for a scrape (the console answers 503)."""


@dataclass(frozen=True)
class Spec:
    """One metric family: ``counter`` or ``gauge``, its HELP text, the label of fleet.metrics()'s
    ``label`` column (``state``, ``kind``) if it has one, and whether its samples are per lane and
    per pool."""

    kind: str
    help: str
    label: str | None = None
    lane: bool = True
    pool: bool = False


# fleet.metrics()'s metric column -> its family (the name gets the lanefleet_ prefix; a counter's
# name ends in _total, which prometheus_client adds back to the family's name)
SPECS: dict[str, Spec] = {
    "tasks": Spec("gauge", "Tasks of the lane now, by state (queued, running, blocked, review, ci, batched, dead).",
                  label="state"),
    "tasks_ready": Spec("gauge", "Queued tasks whose run_at has come: a claim would take them now."),
    "tasks_needing_attention": Spec("gauge", "Running agents waiting on a question or a permission prompt."),
    "oldest_ready_seconds": Spec("gauge", "Seconds the lane's oldest ready task has waited since its run_at (0: none ready)."),
    "lane_slots": Spec("gauge", "The lane's max_running: slots across the fleet (absent: unlimited)."),
    "lane_idle_slots": Spec("gauge", "Slots of the lane no task runs in (absent: unlimited)."),
    "lane_paused": Spec("gauge", "1 while the lane is paused (by the operator, or by lanefleet for a broken config)."),
    "shifts_active": Spec("gauge", "Shifts of the lane running now (an active session)."),
    "enqueued_total": Spec("counter", "Tasks queued in the lane (counted in the lane they entered)."),
    "routed_in_total": Spec("counter", "Tasks routed into the lane from another lane."),
    "claims_total": Spec("counter", "Claims: runs started in the lane."),
    "completions_total": Spec("counter", "Runs that completed their task."),
    "routes_total": Spec("counter", "Runs that completed their stage and routed the task to another lane."),
    "failures_total": Spec("counter", "Failed attempts (retried or dead)."),
    "handoffs_total": Spec("counter", "Runs handed off to the next shift."),
    "repairs_total": Spec("counter", "Runs the monitor (or a closing shift) repaired: the claim evaporated."),
    "cancellations_total": Spec("counter", "Running tasks an operator cancelled."),
    "tokens_total": Spec("counter", "Tokens of the lane's runs that ended, by kind (input, cache_creation, cache_read, output).",
                         label="kind"),
    "cost_usd_total": Spec("counter", "Cost of the lane's runs that ended, in USD, as the agents reported it."),
    "throttles_total": Spec("counter", "Usage limits hit, by lane and the pool the run drew from.", pool=True),
    "pool_slots": Spec("gauge", "The pool's slots: agents at once across the fleet (absent: unlimited).",
                       lane=False, pool=True),
    "pool_in_use": Spec("gauge", "Running tasks drawing from the pool.", lane=False, pool=True),
    "pool_throttled": Spec("gauge", "1 while the pool is throttled (a usage limit): no claims from it.",
                           lane=False, pool=True),
    "pool_throttled_seconds": Spec("gauge", "Seconds until the pool's throttle ends (0: not throttled).",
                                   lane=False, pool=True),
    "pool_window_utilization": Spec("gauge", "How full a usage window of the pool is (0..1: the provider's reading "
                                    "where there is one, else the estimate from its runs).",
                                    label="window", lane=False, pool=True),
    "pool_window_reset_seconds": Spec("gauge", "Seconds until the pool's usage window resets (frees).",
                                      label="window", lane=False, pool=True),
}
SCRAPE_SECONDS = "scrape_duration_seconds"


def families(rows: Iterable[Mapping[str, Any]], seconds: float | None = None) -> list[Metric]:
    """The metric families of fleet.metrics()'s rows, every family of :data:`SPECS` included (one
    without samples still says HELP and TYPE). A metric the code does not know (a newer database)
    is left out."""
    out: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for metric, spec in SPECS.items():
        labels = [*(["lane"] if spec.lane else []), *(["pool"] if spec.pool else []),
                  *([spec.label] if spec.label else [])]
        cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
        out[metric] = cls(PREFIX + metric, spec.help, labels=labels)
    for row in rows:
        known = SPECS.get(str(row.get("metric")))
        if known is None or row.get("value") is None:
            continue
        values = [*([row.get("lane") or ""] if known.lane else []),
                  *([row.get("pool") or ""] if known.pool else []),
                  *([row.get("label") or ""] if known.label else [])]
        out[str(row["metric"])].add_metric(values, float(row["value"]))
    result: list[Metric] = list(out.values())
    if seconds is not None:
        result.append(GaugeMetricFamily(PREFIX + SCRAPE_SECONDS,
                                        "Seconds the scrape's read of the database took (fleet.metrics()).",
                                        value=seconds))
    return result


class FleetCollector(Collector):
    """A custom collector: each ``collect()`` is one read of the store. A store error propagates
    (prometheus_client's handlers answer 500); :func:`metrics_payload` turns it into
    :class:`MetricsUnavailable`."""

    def __init__(self, store: MetricsStore) -> None:
        self.store = store

    def collect(self) -> Iterable[Metric]:
        t0 = time.perf_counter()
        rows = self.store.metrics_rows()
        return families(rows, time.perf_counter() - t0)

    def describe(self) -> Iterable[Metric]:
        """Nothing: registering the collector must not read the database."""
        return []


def registry_for(store: MetricsStore) -> CollectorRegistry:
    """A registry of the fleet's metrics alone (not prometheus_client's global one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(store))
    return registry


def metrics_payload(store: MetricsStore, registry: CollectorRegistry | None = None) -> tuple[bytes, str]:
    """The exposition of one scrape and its Content-Type. ``registry``: one made by
    :func:`registry_for` for this store, kept by the app (default: a new one). Raises
    :class:`MetricsUnavailable` with one line saying why when the store cannot be read."""
    try:
        body = generate_latest(registry or registry_for(store))
    except FleetError as exc:
        raise MetricsUnavailable(f"cannot read the fleet's metrics: {exc.message}", exc.hint) from exc
    except Exception as exc:  # a driver's own error (psycopg, httpx) the store did not name
        first = (str(exc).strip().splitlines() or [""])[0]  # (a server's error quotes the statement below it)
        raise MetricsUnavailable(f"cannot read the fleet's metrics: {type(exc).__name__}: {first}") from exc
    return body, CONTENT_TYPE_LATEST

