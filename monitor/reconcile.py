"""The monitor pass (DESIGN §7): host-local pid checks, then ``fleet.reconcile()``.

The SQL function does the repairs under an advisory lock; this module adds what only a host can
see: its own sessions whose process is gone, or whose pid now belongs to another process (pid
and start time differ). Those are declared lost at once, so their tasks are back in the queue
within one pass instead of after a heartbeat timeout or a lease. It also reaps this host's task
workspaces whose task has been finished for its lane's retention (:func:`reap_workspaces`).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any
from uuid import UUID

import structlog

from worker.config import FleetConfig
from worker.errors import FleetError, SessionLost
from worker.models import RepairAction
from worker.proc import process_identity, process_start_time
from worker.store.postgres import PostgresStore
from worker.workspace.disk import (
    UnsafePath,
    disk_use,
    remove_workspace,
    sweep_reaping,
    workspace_path,
)

log = structlog.get_logger("lanefleet.monitor")


def host_checks(store: PostgresStore, host: str | None = None) -> list[RepairAction]:
    """Declare lost the active sessions of this host whose process is gone or was replaced."""
    host = host or socket.gethostname()
    actions: list[RepairAction] = []
    for row in store.query("active_sessions_on_host", host=host):
        reason = _pid_check(row)
        if reason is None:
            continue
        try:
            actions += store.declare_session_lost(UUID(str(row["id"])), reason)
        except SessionLost:
            continue  # ended or repaired meanwhile
    return actions


def _pid_check(row: dict[str, Any]) -> str | None:
    """Why the session's process is not the one that opened it (``pid-gone``, ``pid-reused``), or
    None. By its identity (boot id and start ticks: a clock step changes neither) where the
    session has one; else, for sessions opened before it was recorded, by its start time."""
    pid = int(row["pid"])
    if row.get("pid_identity") is not None and (now := process_identity(pid)) is not None:
        return None if now == row["pid_identity"] else "pid-reused"
    started = process_start_time(pid)
    if started is None:
        return "pid-gone"
    if row["pid_started_at"] is not None and abs((started - row["pid_started_at"]).total_seconds()) > 1.0:
        return "pid-reused"
    return None


def _workspace_action(action: str, row: dict[str, Any], **detail: Any) -> RepairAction:
    return RepairAction(action=action, lane=row.get("lane"), task_id=row.get("task_id"), session_id=None,
                        detail={"workspace": row.get("id"), "path": row.get("path"), **detail})


def reap_workspaces(store: PostgresStore, cfg: FleetConfig, host: str | None = None,
                    *, limit: int = 100) -> list[RepairAction]:
    """Remove this host's workspaces whose task has been finished (done, dead, cancelled) for
    longer than its lane's retention, at most ``limit`` a pass. Each is marked reaped in the
    database first, which re-checks under the task's lock that the task is still finished: a task
    retried since it was listed keeps its directory. Only then is the directory removed, never
    outside the workspaces root (a path outside it is refused and reported, and stays listed)."""
    host = host or socket.gethostname()
    root = cfg.path(cfg.fleet.workspaces)
    sweep_reaping(root)  # what a reaper stopped mid-way left behind (reaped already)
    actions: list[RepairAction] = []
    for row in store.workspaces_to_reap(host, limit):
        path = str(row["path"])
        try:
            workspace_path(root, path)
        except UnsafePath as exc:
            actions.append(_workspace_action("workspace_refused", row, error=str(exc)))
            continue
        measured = disk_use(Path(path))
        if not store.workspace_reaped(int(row["id"]), measured.bytes):
            continue  # its task is live again (retried): the workspace stays
        try:
            removal = remove_workspace(root, path)
        except (UnsafePath, OSError) as exc:
            actions.append(_workspace_action("workspace_refused", row, error=str(exc)))
            continue
        actions.append(_workspace_action("workspace_reaped", row, task_state=row.get("task_state"),
                                         bytes_freed=removal.bytes_freed, left=removal.left,
                                         existed=removal.existed))
    if any(a.action == "workspace_reaped" for a in actions):
        prune_git_worktrees(cfg)
    return actions


def prune_git_worktrees(cfg: FleetConfig) -> None:
    """Forget the worktrees whose directories the reaper removed, in each lane's mirror on this
    host (the task branches stay: they hold the work)."""
    from worker.workspace.git import GitError, Mirror, prune

    for repo in sorted({lane.repo for lane in cfg.lanes.values() if lane.repo}):
        mirror = Mirror(cfg.path(cfg.fleet.git_cache), repo)
        if mirror.path.exists():
            try:
                prune(mirror)
            except GitError as exc:
                log.warning("git worktree prune failed", repo=repo, error=str(exc))


def monitor_pass(store: PostgresStore, cfg: FleetConfig, host: str | None = None,
                 *, local: bool = True) -> list[RepairAction]:
    """One pass: the host's pid checks (unless ``local`` is off), then the fleet-wide repairs, a pass
    of each source (issue trackers), then (unless ``local`` is off) the reaping of this host's stale
    workspaces."""
    actions = host_checks(store, host) if local else []
    actions += store.reconcile(int(cfg.fleet.idle_alert_seconds), 60)
    actions += quiet_agents(store)
    actions += source_passes(store, cfg)
    if local:
        try:
            actions += reap_workspaces(store, cfg, host)
        except FleetError as exc:  # the repairs above stand; the next pass reaps again
            actions.append(RepairAction(action="workspace_reap_failed", lane=None, task_id=None,
                                        session_id=None, detail={"error": str(exc)}))
    return actions


def quiet_agents(store: PostgresStore) -> list[RepairAction]:
    """Liveness is not progress: the running agents without progress for their lane's
    stall_seconds (a lane with stall_action = stop has its shifts stop them at their next
    heartbeat), and those waiting on a question or a permission prompt. Reported, not repaired."""
    out = []
    for row in store.stalled_tasks():
        waiting = row.get("attention")
        out.append(RepairAction(
            action="needs_attention" if waiting else "stalled", lane=row["lane"], task_id=row["task_id"],
            session_id=row["session_id"],
            detail={"key": row["key"], "quiet_seconds": float(row["quiet_seconds"] or 0),
                    "stall_seconds": row["stall_seconds"], "stall_action": row["stall_action"],
                    **({"attention": waiting} if waiting else {})}))
    return out


def source_passes(store: PostgresStore, cfg: FleetConfig) -> list[RepairAction]:
    """A pass of each source of the config (worker.sources): what changed, or why it stopped, as
    one action each (none for a pass that found nothing new)."""
    if not cfg.sources:
        return []
    from worker.sources.passes import run_passes

    out = []
    try:
        reports = run_passes(store, cfg)
    except FleetError as exc:  # the repairs above stand; the next pass tries the sources again
        return [RepairAction(action="source_failed", lane=None, task_id=None, session_id=None,
                             detail={"summary": f"the sources' pass failed: {exc}"})]
    for report in reports:
        changed = {a: n for a, n in report.actions.items() if a != "unchanged"}
        if report.error or changed or report.item_errors:
            out.append(RepairAction(action="source_failed" if report.error else "source_synced", lane=None,
                                    task_id=None, session_id=None,
                                    detail={"source": report.source, "summary": report.line(), **changed}))
    return out
