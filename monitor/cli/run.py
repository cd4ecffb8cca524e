"""The commands that run the fleet on a host: ``fleet monitor``, ``run``, ``crontab`` and ``up``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from datetime import UTC
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.live import Live
from rich.markup import escape

from worker.cli.context import JsonOpt, console, err_console, rt
from worker.errors import DatabaseUnavailable, FleetError, InvalidInput, LaneRetired
from worker.tables import Col, FitTable, fmt_cost, fmt_num

if TYPE_CHECKING:
    from monitor.host import ShiftLauncher
    from worker.config import FleetConfig
    from worker.models import RepairAction
    from worker.runtime import Runtime


def actions_table(actions: list[RepairAction]) -> FitTable:
    table = FitTable([Col("action", "key"), Col("lane", "key"), Col("task", "num"), Col("session", "key", 1),
                      Col("detail", min_width=16)], title="monitor pass", hint=None)
    for a in actions:
        table.add_row(escape(a.action), escape(a.lane or ""), "" if a.task_id is None else str(a.task_id),
                      str(a.session_id or "")[:8], escape(json.dumps(a.detail, default=str)[:300]))
    return table


def finding(a: RepairAction) -> str:
    """A monitor action as one short line: ``monitor: released, lane docs, task 4 (lease-expired)``."""
    why = a.detail.get("reason") if a.detail else None
    return (f"monitor: {a.action}" + (f", lane {a.lane}" if a.lane else "")
            + (f", task {a.task_id}" if a.task_id is not None else "") + (f" ({why})" if why else ""))


# what a monitor pass reports of a state that lasts (a stall, idle capacity, a session past its
# deadline, a workspace it may not remove, a source that fails, another monitor at work), not of
# what it did: found again by every pass while it lasts
STATES = frozenset({"stalled", "needs_attention", "idle_capacity", "overdue", "workspace_refused",
                    "workspace_reap_failed", "source_failed", "skipped"})


class Findings:
    """What of each monitor pass a long-running command says (`fleet run`'s log, `fleet up`'s
    screen): every repair, and a state (``STATES``) when it begins — not again on each pass while it
    lasts, and again if it comes back after a pass without it."""

    def __init__(self) -> None:
        self._last: set[tuple[Any, ...]] = set()

    def new(self, actions: list[RepairAction]) -> list[RepairAction]:
        now: set[tuple[Any, ...]] = set()
        out = []
        for a in actions:
            if a.action in STATES:
                detail = a.detail or {}
                key = (a.action, a.lane, a.task_id, a.session_id, detail.get("workspace"), detail.get("source"))
                now.add(key)
                if key in self._last:
                    continue
            out.append(a)
        self._last = now
        return out


def log_actions(actions: list[RepairAction]) -> None:
    """What a monitor pass of `fleet run` did and found (what ``Findings`` lets through), a log
    line each (as `fleet monitor` prints them in a table): repairs, stalls, idle capacity."""
    import structlog

    log = structlog.get_logger("lanefleet.monitor")
    for a in actions:
        log.info(f"monitor: {a.action}", lane=a.lane, task=a.task_id,
                 session=str(a.session_id)[:8] if a.session_id else None, **{"detail": a.detail} if a.detail else {})


def paused_warning(cfg: FleetConfig, lane: str, why: str) -> None:
    err_console.print(f"warning: lane {lane} is paused: {escape(why)} ({escape(cfg.fix_hint())})",
                      highlight=False, soft_wrap=True)


def monitor(
    ctx: typer.Context,
    once: Annotated[bool, typer.Option("--once", help="one pass, then exit (the default)")] = False,
    every: Annotated[str | None, typer.Option("--every", help="loop: a pass every 30s, 1m, ...")] = None,
    no_local: Annotated[bool, typer.Option("--no-local", help="skip this host's pid checks and workspace reaping")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Repair evaporated claims and report stalls and idle capacity (one pass, or --every)."""
    from monitor.host import require_operator_key
    from monitor.reconcile import monitor_pass
    from worker.config import flag_duration

    interval = flag_duration(every, "--every") if every is not None else None
    if once and interval:
        raise InvalidInput("--once and --every exclude each other")
    from worker.logs import configure_logging

    # on stderr: structlog's default would print a pass's warnings on stdout, amid the --json
    configure_logging()
    r = rt(ctx)
    require_operator_key(r.cfg, os.environ, "fleet monitor")
    store = r.store()
    stop = threading.Event()
    if interval:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    while True:
        try:
            actions = monitor_pass(store, r.cfg, local=not no_local)
        except FleetError as exc:
            if not interval:
                raise
            # a loop outlives a database outage: the next pass repairs what this one could not
            err_console.print(f"monitor pass failed: {exc}", highlight=False)
            if stop.wait(interval):
                return
            continue
        if as_json:
            print(json.dumps([a.model_dump(mode="json") for a in actions]), flush=True)
        elif actions:
            console.print(actions_table(actions))
        elif not interval:
            console.print("nothing to repair")
        if not interval or stop.wait(interval):
            return


def run(
    ctx: typer.Context,
    lanes: Annotated[list[str] | None, typer.Option("--lane", help="only these lanes (repeatable)")] = None,
    duration: Annotated[str | None, typer.Option("--for", help="stop after this long (e.g. 1h); default: until SIGTERM")] = None,
) -> None:
    """Host the fleet: each lane's cron launches shifts (never past max_shifts); the monitor runs on its interval."""
    from apscheduler.schedulers.background import BackgroundScheduler
    from apscheduler.triggers.interval import IntervalTrigger

    from monitor.host import ShiftLauncher, default_lock_dir, require_operator_key, shift_env
    from monitor.outage import Outage
    from monitor.reconcile import monitor_pass
    from worker.config import cron_trigger, flag_duration
    from worker.logs import configure_logging

    r = rt(ctx)
    configure_logging()
    limit = flag_duration(duration, "--for") if duration is not None else None
    chosen = lanes or sorted(r.cfg.lanes)
    for name in chosen:
        r.cfg.lane(name)
    require_operator_key(r.cfg, os.environ, "fleet run")
    # calls fail within seconds while the database restarts: the monitor job waits it out
    store = r.store(call_budget=CALL_BUDGET)
    # a lane whose config is wrong on this host is paused with the reason (its shifts claim nothing);
    # a retired one gets no shifts
    for name, why in r.preflight(chosen).items():
        if why is not None:
            try:
                store.pause_lane(name, why)
            except LaneRetired:
                continue
            paused_warning(r.cfg, name, why)
    retired = {row["name"] for row in store.query("list_lanes") if row["retired_at"] is not None}
    chosen = [name for name in chosen if name not in retired]
    url = r.url if r.cfg.fleet.store == "postgres" else None
    # the lane's slots on this host: shared with other launchers here and the crontab's guards
    launcher = ShiftLauncher(r.cfg, shift_env(r.cfg, url, r.config_path),
                             log_dir=r.cfg.path(r.cfg.fleet.home) / "logs", lock_dir=default_lock_dir(r.cfg))
    scheduler = BackgroundScheduler(timezone="UTC")
    scheduled = []
    for name in chosen:
        lane = r.cfg.lanes[name]
        if lane.cron:
            scheduler.add_job(launcher.launch, cron_trigger(lane.cron), args=[name], id=f"shift-{name}",
                              max_instances=1, coalesce=True, misfire_grace_time=30)
            scheduled.append(name)
    # a restart of the database: said once, and the next pass tries again (monitor.outage)
    outage = Outage(r.database, lambda line: console.print(line, highlight=False, markup=False))

    findings = Findings()

    def monitor_job() -> None:
        log_actions(findings.new(monitor_pass(store, r.cfg)))

    scheduler.add_job(lambda: outage.attempt(monitor_job),
                      IntervalTrigger(seconds=r.cfg.fleet.monitor_every), id="monitor", max_instances=1, coalesce=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    scheduler.start()
    unscheduled = [name for name in chosen if name not in scheduled]
    console.print(f"fleet run: {next_shifts(scheduler, scheduled)}"
                  + (f"; no cron, not scheduled: {', '.join(unscheduled)}" if unscheduled else "")
                  + f"; monitor every {r.cfg.fleet.monitor_every:g}s", highlight=False)
    stop.wait(limit)
    # wait for a job under way: a launch finishing after stop_all() would leave its shift behind
    scheduler.shutdown(wait=True)
    launcher.stop_all()
    outage.attempt(monitor_job)
    # plain print: rich would wrap a long line at the console width and break the JSON
    print(json.dumps({"launched": launcher.launched, "max_concurrent": launcher.max_seen}), flush=True)


def next_shifts(scheduler: Any, lanes: list[str]) -> str:
    """When each scheduled lane's next shift starts (UTC), as `fleet run` says it at its start."""
    if not lanes:
        return "no shifts scheduled"
    due = []
    for name in lanes:
        when = scheduler.get_job(f"shift-{name}").next_run_time
        due.append(f"{name} at {when.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}")  # (no space: never wrapped apart)
    return "next shifts: " + ", ".join(due)


def crontab(ctx: typer.Context) -> None:
    """Print system crontab lines equivalent to fleet run (absolute paths, flock overlap guards)."""
    from monitor.host import crontab_lines, default_lock_dir
    from worker.config import env_settings

    r = rt(ctx)
    fleet_bin = shutil.which("fleet") or str(Path(sys.executable).with_name("fleet"))
    folder = default_lock_dir(r.cfg)  # (fleet run's and fleet up's too: they share the slots)
    # cron starts its jobs with an environment of its own: what this one sets, they would not see
    # (a DATABASE_URL only here, and the shifts would run on the embedded database instead)
    unseen = env_settings(os.environ, r.cfg)
    if unseen:
        names = ", ".join(unseen)
        err_console.print(f"warning: this config also comes from the environment ({names}), which cron does not "
                          "pass: put those settings in fleet.toml, or NAME=value lines at the top of the crontab",
                          soft_wrap=True)
        print(f"# warning: set by the environment of `fleet crontab`, not seen by these jobs: {names}")
        print("#   (put them in fleet.toml, or as NAME=value lines here; they are not printed)")
    for line in crontab_lines(r.cfg, fleet_bin=fleet_bin, workdir=r.cfg.base_dir, config=r.cfg.source,
                              lock_dir=folder):
        print(line)


def _invocation() -> str:
    """How the user runs fleet: ``uv run fleet`` when uv started this process (in a checkout, the
    only way on a fresh machine), else ``fleet`` (installed, or a venv activated)."""
    return "uv run fleet" if os.environ.get("UV_RUN_RECURSION_DEPTH") else "fleet"


def summary_table(rows: list[dict[str, Any]], title: str) -> FitTable:
    """fleet.lane_summary() as a table: the tasks of each lane by state (every state that has any,
    in the order a task goes through them), what they cost."""
    from worker.models import TASK_STATES

    table = FitTable([Col("lane", "key"), Col("tasks", min_width=14), Col("retries", "num", 2),
                      Col("hand-offs", "num", 1), Col("tokens", "num"), Col("cost", "num")],
                     title=title, table_box=box.SIMPLE_HEAD, hint=None,
                     caption="tasks in their lane now, tokens in the lane that spent them")
    for row in rows:
        states = ", ".join(f"{row[s]} {s}" for s in TASK_STATES if row[s]) or "none"
        table.add_row(escape(row["lane"]), states, str(row["retries"]), str(row["handoffs"]), fmt_num(row["tokens"]),
                      fmt_cost(row["cost_usd"]))
    return table


#: the most seconds one database call of `fleet up` or `fleet run` may take (retries included) before
#: its loop (its monitor job) reports the database restarting and tries again later
CALL_BUDGET = 5.0


def hold_up_lock(ctx: typer.Context, r: Runtime) -> None:
    """One `fleet up` per directory and database: hold ``<home>/up.lock`` until the command ends
    (:class:`~worker.db.uplock.UpRunning` when another holds it), and name this process's
    connections ``lanefleet up`` (``fleet db stop`` lists them)."""
    from worker.db.uplock import UpLock

    lock = UpLock(r.up_lock)
    lock.acquire(config=str(r.cfg.source) if r.cfg.source else None, database=r.database)
    ctx.call_on_close(lock.release)
    os.environ["PGAPPNAME"] = "lanefleet up"


def _held_by(launcher: ShiftLauncher, store: Any) -> list[int]:
    """The tasks the shifts this host launched hold now (what a stop hands off)."""
    pids = {p.pid for procs in launcher.running.values() for p in procs if p.poll() is None}
    if not pids:
        return []
    sessions = {r["id"] for r in store.query("active_sessions_on_host", host=socket.gethostname())
                if r["pid"] in pids}
    return [t.id for t in store.list_tasks(state="running", limit=10000) if t.session_id in sessions]


def up(
    ctx: typer.Context,
    demo: Annotated[bool, typer.Option("--demo", help="queue example tasks, run until all are done or dead, print a summary")] = False,
    shift_seconds: Annotated[float | None, typer.Option("--shift-seconds", help="length of each shift (default: the lane's; 10 with --demo)")] = None,
    timeout: Annotated[float, typer.Option(help="--demo: give up after this many seconds")] = 300.0,
) -> None:
    """The main job: start (or reuse) the database, migrate, sync lanes, run every lane's shifts and the monitor."""
    import logging

    from monitor.dev.demo import (
        check_demo_lanes,
        demo_ending,
        demo_finished,
        demo_states,
        demo_summary,
        queue_demo,
    )
    from monitor.host import ShiftLauncher, default_lock_dir, shift_env
    from monitor.outage import Outage
    from monitor.reconcile import monitor_pass
    from worker.logs import configure_logging

    # lanefleet's own warnings and errors only: the live table is the progress report
    configure_logging(own_level=logging.WARNING)
    if not os.environ.get("FLEET_LOG_LEVEL"):
        # a restart of the database is said once (monitor.outage), not by each failed pool connect
        logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    r: Runtime = rt(ctx)
    if demo:  # before anything starts: a config without the demo's lanes would run nothing
        check_demo_lanes(r.cfg.lanes, r.cfg.source)
    url = r.url  # starts or reuses the embedded server when no database is configured
    result = r.migrate()  # (a database that cannot be reached: one line, and nothing written here)
    hold_up_lock(ctx, r)  # before anything is synced or started: a second `fleet up` here starts nothing
    reasons = r.preflight()
    synced = r.sync_lanes(reasons)
    for name, why in reasons.items():
        if why is not None and synced.get(name) != "retired":
            paused_warning(r.cfg, name, why)
    # calls fail within seconds while the database restarts: the loop below waits it out
    store = r.store(call_budget=CALL_BUDGET)
    console.print(f"{r.database[:1].upper()}{r.database[1:]} is ready; {len(result.applied)} migration(s) applied; "
                  f"lanes: {', '.join(sorted(r.cfg.lanes))}", highlight=False)  # (wrapped at the width)
    prefix = None
    if demo:
        prefix = queue_demo(store, r.cfg.lanes)
        shift_seconds = shift_seconds or 10.0
    extra = ["--max-seconds", str(shift_seconds)] if shift_seconds else []
    launcher = ShiftLauncher(r.cfg, {**shift_env(r.cfg, url, r.config_path), "PGAPPNAME": "lanefleet shift"},
                             extra_args=["--poll", "0.2", *extra], log_dir=r.cfg.path(r.cfg.fleet.home) / "logs",
                             lock_dir=default_lock_dir(r.cfg))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    started = time.monotonic()
    monitor_every = 2.0 if demo else r.cfg.fleet.monitor_every
    next_monitor = 0.0
    finished = False
    rows: list[dict[str, Any]] = []
    held: list[int] = []

    def summary() -> list[dict[str, Any]]:
        # the demo's own tasks and runs: not the totals of earlier runs in the same database
        return demo_summary(store, prefix) if prefix is not None else store.query("lane_summary")

    # the shifts stop with `fleet up`, however it ends; transient: the live frame goes when it
    # ends, and the summary below is printed once
    with contextlib.ExitStack() as stopping, Live(console=console, refresh_per_second=4, transient=True) as live:
        stopping.callback(launcher.stop_all)
        outage = Outage(r.database, lambda line: live.console.print(line, highlight=False, markup=False))
        findings = Findings()  # a stall lasts passes: said when it begins
        while not stop.is_set():
            try:
                ready = {row["lane"]: row["ready"] for row in store.query("ready_by_lane")}
                for lane in sorted(r.cfg.lanes):
                    if ready.get(lane) and launcher.count(lane) == 0:
                        launcher.launch(lane, ["--once"] if demo else [])
                if time.monotonic() >= next_monitor:
                    for a in findings.new(monitor_pass(store, r.cfg)):
                        live.console.print(finding(a), highlight=False, markup=False)
                    next_monitor = time.monotonic() + monitor_every
                rows = summary()
                live.update(summary_table(rows, f"lanefleet — {time.monotonic() - started:.0f}s"))
                # what a Ctrl-C would hand off (read before it: the terminal signals the shifts too)
                held = _held_by(launcher, store)
                if prefix is not None:
                    if demo_finished(demo_states(store, prefix)):
                        finished = True
                        break
                    if time.monotonic() - started > timeout:
                        break
            except DatabaseUnavailable as exc:
                live.update(summary_table(rows, f"lanefleet — {time.monotonic() - started:.0f}s — reconnecting"))
                if prefix is not None and time.monotonic() - started > timeout:
                    break
                stop.wait(outage.failed(exc))
                continue
            outage.answered()
            stop.wait(0.5)
    interrupted = stop.is_set()
    if interrupted:
        console.print(f"stopping: the shifts hand off their {len(held)} running task(s) to the next shift …",
                      highlight=False)
    launcher.stop_all()
    try:
        if interrupted:
            states = [store.get_task(t).state for t in held]
            queued = sum(1 for s in states if s == "queued")
            rest = f"; {len(held) - queued} ended otherwise" if queued < len(held) else ""
            console.print(f"stopped: {queued} task(s) handed off, queued for the next `fleet up` or shift{rest}",
                          highlight=False)
        console.print(summary_table(summary(), "this demo's tasks" if prefix is not None else "summary"))
        if prefix is None:
            return
        took = f"{time.monotonic() - started:.0f}s"
        fleet = _invocation()
        ending = demo_ending(demo_states(store, prefix)).replace("`fleet ", f"`{fleet} ")
    except DatabaseUnavailable as exc:
        raise DatabaseUnavailable(f"{r.database} did not answer for the summary: {exc}") from None
    if interrupted and not finished:
        console.print(f"demo stopped after {took}: {ending}", highlight=False)
        raise typer.Exit(130)
    if not finished:
        raise InvalidInput(f"the demo did not finish within {timeout:.0f}s ({ending}); "
                           f"see {r.cfg.path(r.cfg.fleet.home) / 'logs'}")
    # the commands a line each: wrapped inside one, they would not paste
    console.print(f"demo finished in {took}: {ending}. Try:\n  {fleet} tasks\n  {fleet} show {prefix}7",
                  highlight=False)
