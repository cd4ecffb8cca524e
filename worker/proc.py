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
    """When the live process ``pid`` started (to the clock tick), or None if there is none.

    A zombie (state Z or X) has exited already and only waits for its parent to reap it — which
    a parent such as ``fleet run`` may do later — so it counts as gone, not as the process.
    """
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
        # the command name may contain spaces and parentheses: fields resume after the last ')'
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] in ("Z", "X", "x"):
            return None
        ticks = int(fields[19])  # field 22 of proc(5), counted from field 3
        return datetime.fromtimestamp(_boot_time() + ticks / os.sysconf("SC_CLK_TCK"), UTC)
    except (OSError, ValueError, IndexError):
        return None
