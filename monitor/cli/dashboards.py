"""The dashboard commands: ``fleet status``, ``fleet stats``, ``fleet snapshot``, ``fleet report``
(DESIGN §10; every figure is read by :mod:`monitor.dashboards.reads`)."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.text import Text

from worker.cli.context import JsonOpt, WideOpt, console, rt
from worker.errors import FleetError, InvalidInput
from worker.tables import print_table

LaneOpt = Annotated[str | None, typer.Option("--lane", "-l", help="only this lane")]
SinceOpt = Annotated[str, typer.Option("--since", help="the window: 24h, 7d, ... (counted from the database's now())")]


def status(
    ctx: typer.Context,
    lane: LaneOpt = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="refresh in place until Ctrl-C")] = False,
    interval: Annotated[str, typer.Option("--interval", help="--watch: seconds between refreshes (2s, 10s, 1m)")] = "2s",
    wide: WideOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """The fleet at a glance: lanes, stuck tasks, active shifts, recent repairs."""
    from monitor.dashboards.reads import dump, reading, roll_up, status_data
    from monitor.dashboards.terminal import render_status
    from worker.config import flag_duration

    every = flag_duration(interval, "--interval")
    if watch and as_json:
        raise InvalidInput("--watch and --json exclude each other (use `fleet snapshot` in a loop)")
    store = rt(ctx).sql_store()
    store.check_lane(lane)

    def fetch() -> dict[str, Any]:
        roll_up(store)
        with reading(store) as r:
            return status_data(r, lane)

    if as_json:
        print(dump(fetch()))
        return
    if not watch:
        print_table(console, render_status(fetch(), wide), wide=wide)
        return
    last: RenderableType = render_status(fetch(), wide)
    # Ctrl-C ends the watch between refreshes: a KeyboardInterrupt inside a query or the pool could
    # leave the exit waiting on them. A second Ctrl-C interrupts at once. (The handler only flips a
    # flag: taking a lock in a signal handler can deadlock against the code it interrupted.)
    stopping: list[bool] = []

    def on_sigint(_signum: int, _frame: object) -> None:
        if stopping:
            raise KeyboardInterrupt
        stopping.append(True)

    def pause() -> bool:
        """Wait one interval; False once Ctrl-C was pressed."""
        end = time.monotonic() + every
        while not stopping and time.monotonic() < end:
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))
        return not stopping

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with Live(last, console=console, refresh_per_second=4, transient=False) as live:
            while pause():
                try:
                    last = render_status(fetch(), wide)
                    live.update(last)
                except FleetError as exc:  # keep watching through an outage
                    live.update(Group(last, Text(f"refresh failed: {exc}", style="red")))
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, previous)


def stats(
    ctx: typer.Context,
    since: SinceOpt = "7d",
    lane: LaneOpt = None,
    wide: WideOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Usage and cost per lane and day, and the cohort figures of the tasks queued in the window."""
    from monitor.dashboards.reads import (
        VIEW_DAYS,
        dump,
        reading,
        roll_up,
        stats_data,
    )
    from monitor.dashboards.terminal import render_stats
    from worker.config import flag_duration

    seconds = flag_duration(since, "--since")
    if seconds > VIEW_DAYS * 86400:
        raise InvalidInput(f"--since {since}: at most {VIEW_DAYS}d (usage_by_lane_day keeps the last "
                           f"{VIEW_DAYS} days; for older cohorts call fleet.cohort_metrics() in SQL)")
    store = rt(ctx).sql_store()
    store.check_lane(lane)
    roll_up(store)
    with reading(store) as r:
        data = stats_data(r, seconds, lane)
    if as_json:
        print(dump(data))
        return
    print_table(console, render_stats(data, wide), wide=wide)


def snapshot(
    ctx: typer.Context,
    since: SinceOpt = "24h",
    limit: Annotated[int, typer.Option(min=1, help="at most this many repairs and dead letters")] = 1000,
    pretty: Annotated[bool, typer.Option("--pretty", help="indent the JSON (default: one line, for a log)")] = False,
) -> None:
    """One JSON document of every dashboard (one line: append it to a log daily)."""
    from monitor.dashboards.reads import (
        VIEW_DAYS,
        dump,
        reading,
        roll_up,
        snapshot_data,
    )
    from worker.config import flag_duration

    seconds = flag_duration(since, "--since")
    if seconds > VIEW_DAYS * 86400:
        raise InvalidInput(f"--since {since}: at most {VIEW_DAYS}d (the views keep the last {VIEW_DAYS} days)")
    store = rt(ctx).sql_store()
    roll_up(store)
    with reading(store) as r:
        data = snapshot_data(r, seconds, limit)
    print(dump(data, pretty=pretty), flush=True)


def report(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", "-o", help="the HTML file to write")] = Path("report.html"),
    since: SinceOpt = "7d",
    lane: LaneOpt = None,
) -> None:
    """A self-contained HTML report with charts (no network needed to view it)."""
    from monitor.dashboards.reads import reading, report_data, roll_up
    from monitor.dashboards.report import check_out, render_report, write_report
    from worker.config import flag_duration

    seconds = flag_duration(since, "--since")
    check_out(out)  # before anything is read or rolled up
    store = rt(ctx).sql_store()
    store.check_lane(lane)
    roll_up(store)
    with reading(store) as r:
        data = report_data(r, seconds, lane)
    text = render_report(data)
    write_report(out, text)
    console.print(f"wrote {out} ({len(text) // 1024} KiB)", highlight=False)
