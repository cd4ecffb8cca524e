"""Process identity: a pid plus its start time, so a reused pid is not mistaken for the same process."""

from __future__ import annotations

import os
from datetime import UTC, datetime


def _boot_time() -> float:
    with open("/proc/stat") as fh:
        for line in fh:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def process_start_time(pid: int) -> datetime | None:
    """When process ``pid`` started (to the clock tick), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
        # the command name may contain spaces and parentheses: fields resume after the last ')'
        fields = stat[stat.rindex(")") + 2:].split()
        ticks = int(fields[19])  # field 22 of proc(5), counted from field 3
        return datetime.fromtimestamp(_boot_time() + ticks / os.sysconf("SC_CLK_TCK"), UTC)
    except (OSError, ValueError, IndexError):
        return None


def same_process(pid: int, started_at: datetime | None, tolerance: float = 1.0) -> bool:
    """True if ``pid`` is alive and (when ``started_at`` is known) started at that time."""
    now_start = process_start_time(pid)
    if now_start is None:
        return False
    if started_at is None:
        return True
    return abs((now_start - started_at).total_seconds()) <= tolerance
