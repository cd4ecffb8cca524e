"""The monitor pass (DESIGN §7): host-local pid checks, then ``fleet.reconcile()``.

The SQL function does the repairs under an advisory lock; this module adds what only a host can
see: its own sessions whose process is gone, or whose pid now belongs to another process (pid
and start time differ). Those are declared lost at once, so their tasks are back in the queue
within one pass instead of after a heartbeat timeout or a lease.
"""

from __future__ import annotations

import socket
from uuid import UUID

from worker.config import FleetConfig
from worker.errors import SessionLost
from worker.models import RepairAction
from worker.proc import process_start_time
from worker.store import PostgresStore


def host_checks(store: PostgresStore, host: str | None = None) -> list[RepairAction]:
    """Declare lost the active sessions of this host whose process is gone or was replaced."""
    host = host or socket.gethostname()
    actions: list[RepairAction] = []
    for row in store.query("active_sessions_on_host", host=host):
        started = process_start_time(int(row["pid"]))
        if started is None:
            reason = "pid-gone"
        elif row["pid_started_at"] is not None and abs(
            (started - row["pid_started_at"]).total_seconds()
        ) > 1.0:
            reason = "pid-reused"
        else:
            continue
        try:
            actions += store.declare_session_lost(UUID(str(row["id"])), reason)
        except SessionLost:
            continue  # ended or repaired meanwhile
    return actions


def monitor_pass(store: PostgresStore, cfg: FleetConfig, host: str | None = None,
                 *, local: bool = True) -> list[RepairAction]:
    """One pass: the host's pid checks (unless ``local`` is off), then the fleet-wide repairs."""
    actions = host_checks(store, host) if local else []
    actions += store.reconcile(int(cfg.fleet.idle_alert_seconds), 60)
    return actions
