"""Process identity: a pid plus its start, so a reused pid is not mistaken for the same process.

Two forms. :func:`process_identity` — the host's boot id and the process's start in clock ticks
since boot — is what the monitor compares: nothing but a reboot or another process changes it.
:func:`process_start_time` is the same start as wall-clock time, for people to read: it moves with
every step of the host's clock (``btime`` in /proc/stat is the wall clock less the uptime).
"""

from __future__ import annotations

import os
from datetime import UTC, datetime


def _boot_time() -> float:
    with open("/proc/stat") as fh:
        for line in fh:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def _start_ticks(pid: int) -> int | None:
    """The live process ``pid``'s start in clock ticks since boot, or None if there is none.

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
        return int(fields[19])  # field 22 of proc(5), counted from field 3
    except (OSError, ValueError, IndexError):
        return None


def process_start_time(pid: int) -> datetime | None:
    """When the live process ``pid`` started (to the clock tick, by the host's clock now), or None."""
    ticks = _start_ticks(pid)
    if ticks is None:
        return None
    try:
        return datetime.fromtimestamp(_boot_time() + ticks / os.sysconf("SC_CLK_TCK"), UTC)
    except (OSError, ValueError):
        return None


def process_identity(pid: int) -> str | None:
    """``<boot id>:<start ticks>`` of the live process ``pid``, or None if there is none (or the
    host has no boot id to read: then there is nothing to compare but the start time)."""
    ticks = _start_ticks(pid)
    if ticks is None:
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        return None
    return f"{boot}:{ticks}" if boot else None
