"""``fleet shift`` (what cron starts on a host) and ``fleet checkpoint`` (what an agent calls)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from worker.cli.context import console, rt


def shift(
    ctx: typer.Context,
    lane: Annotated[str, typer.Option("--lane", "-l", help="the lane to work")],
    max_seconds: Annotated[float | None, typer.Option("--max-seconds", help="shift length (default: the lane's shift_minutes)")] = None,
    max_tasks: Annotated[int | None, typer.Option("--max-tasks", min=1, help="claim at most this many tasks")] = None,
    slots: Annotated[int | None, typer.Option("--slots", min=1, help="agents at once (default: the lane's slots)")] = None,
    once: Annotated[bool, typer.Option("--once", help="exit as soon as nothing is ready and nothing runs")] = False,
    poll: Annotated[float, typer.Option("--poll", min=0.05, help="seconds between claims when idle")] = 0.5,
    json_logs: Annotated[bool | None, typer.Option("--json-logs/--text-logs", help="log format (default: JSON unless a terminal)")] = None,
) -> None:
    """Run one shift of a lane (what cron starts): claim, run agents, hand off at exit."""
    from worker.logs import configure_logging
    from worker.shift.shift import Shift, call_budget

    r = rt(ctx)
    r.cfg.lane(lane)  # an unknown lane is an error before anything starts
    configure_logging(json_logs)
    store = r.store(call_budget=call_budget(r.cfg.lane(lane)))
    s = Shift(store, r.cfg, lane, max_seconds=max_seconds, max_tasks=max_tasks, slots=slots,
              once=once, poll_seconds=poll)
    s.install_signal_handlers()
    summary = s.run()
    raise typer.Exit(summary.exit_code)


def checkpoint(
    data: Annotated[str, typer.Option("--data", "-d", help="the checkpoint, a JSON value (or @file)")],
    workspace: Annotated[Path | None, typer.Option(envvar="FLEET_WORKSPACE", help="the task workspace")] = None,
) -> None:
    """For agents: save a checkpoint; the shift stores it at its next heartbeat."""
    from worker.workspace.folder import save_checkpoint

    save_checkpoint(workspace, data)
    console.print("checkpoint saved; stored at the next heartbeat")
