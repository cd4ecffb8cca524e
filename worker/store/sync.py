"""The config in the database: a configured lane's ``fleet.lanes`` settings, and ``fleet lanes sync``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.config import FleetConfig, LaneConfig
from worker.store.protocol import Store


def lane_settings(lane: LaneConfig, dispatch: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """The fleet.lanes columns of a configured lane (what ``fleet.sync_lane`` takes).
    ``dispatch``: the lane's pools with their profiles (FleetConfig.dispatch_list). ``retired``
    only when the config says it (left out, a retired lane stays retired)."""
    retired = {} if lane.retired is None else {"retired": lane.retired}
    return retired | {
        "max_running": lane.max_running,
        "lease_seconds": lane.lease_seconds,
        "max_attempts": lane.max_attempts,
        "max_handoffs": lane.max_handoffs,
        "session_timeout_seconds": lane.session_timeout_seconds,
        "backoff_base_seconds": lane.backoff_base_seconds,
        "backoff_max_seconds": lane.backoff_max_seconds,
        "accepts_from": lane.accepts_from,
        "paused": lane.paused,
        "config": {
            "model": lane.model,
            "require_result": lane.require_result,
            "stall_seconds": lane.stall_seconds,
            "max_shifts": lane.max_shifts,
            "tiers": lane.tiers,
            "default_tier": lane.default_tier,
            "escalate_on": lane.escalate_on,
            "profile": lane.profile,
            "dispatch": dispatch or [],
            "stall_action": lane.stall_action,
            "max_cost_usd": lane.max_cost_usd,
            "max_tokens": lane.max_tokens,
            "daily_budget_usd": lane.daily_budget_usd,
            "daily_budget_tokens": lane.daily_budget_tokens,
            "review": lane.review,
            "review_cap": lane.review_cap,
            "triage": lane.triage,
            "workspace_retention_seconds": lane.workspace_retention,
            "max_transient": lane.max_transient,
            "max_payload_bytes": lane.max_payload_bytes,
            "ci": lane.ci,
            "max_ci_fixes": lane.max_ci_fixes,
        },
    }


def sync_config(store: Store, cfg: FleetConfig, paused: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """Write the config's pools, profiles and lanes to the database (`fleet lanes sync`), in that
    order (a profile names its pool, a lane its profile). Name → created | updated | unchanged |
    retired (a lane retired in the database, which stays so).

    ``paused``: the preflight's verdict per lane (worker.preflight: the reason to pause it, None to
    clear a pause it put there before); a lane it leaves out keeps the pause it has."""
    out = {f"pool {n}": store.sync_pool(n, p.slots, {k: w.settings(k) for k, w in p.windows.items()}, p.reserve)
           for n, p in cfg.pools.items()}
    out |= {f"profile {n}": store.sync_profile(n, p.pool, p.models, p.throttle_floor)
            for n, p in cfg.profiles.items()}
    for name, lane in cfg.lanes.items():
        settings = lane_settings(lane, cfg.dispatch_list(name))
        if paused is not None and name in paused:
            settings["paused_reason"] = paused[name]
        out[name] = store.sync_lane(name, settings)
    return out

