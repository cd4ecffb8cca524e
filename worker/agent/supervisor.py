"""The agent's supervisor: a small process beside each agent that kills it when the shift dies.

``python -m worker.agent.supervisor FD [--label=WHAT] -- ARGV...``. The shift creates a pipe, keeps the write end, and
passes the read end as FD; it starts the supervisor in a session of its own, so a terminal's
Ctrl-C or a kill of the shift's process group does not reach it. The supervisor starts the agent
in yet another session (the agent's process group: the agent and everything it spawns) and
blocks on FD. EOF on FD means the shift closed its end or died — however it died, SIGKILL and
OOM included, the kernel closes the write end — and the supervisor then SIGKILLs the agent's
group. ``prctl(PR_SET_PDEATHSIG)`` is not used: on these machines it is accepted but not
delivered (DESIGN §6).

The shift also writes its lease's fence on the pipe (``fence <term_at> <kill_at>``, monotonic
seconds, each renewal moving them on): if the shift does not move them in time — it is frozen
(SIGSTOP) or stalled, and cannot stop the agent itself — the supervisor sends the agent's group
SIGTERM at the first and SIGKILL at the second (worker/shift/fence.py).

SIGTERM, SIGINT and SIGHUP sent to the supervisor are forwarded to the agent's group, so the
shift can ask for a graceful stop. ``FD --sandboxed -- bwrap … -- ARGV``: the agent runs in a
sandbox (worker/agent/sandbox.py) whose launcher, the supervisor's child, does not pass signals on
and would die of them at once, leaving the supervisor to SIGKILL the group before the agent could
stop: a graceful stop then goes to the group's other processes (the agent and its own), and the
launcher ends when the agent does, with its exit code. SIGKILL still goes to the whole group, and
killing the launcher tears down the sandbox's PID namespace, whatever is in it. When the agent exits, whatever it left running in its group
is killed too. The supervisor exits with the agent's exit code (128+N when it died of signal N), or 127 with one
line ``lanefleet: <WHAT> '<program>' cannot start: <why>`` when the program could not be started
(WHAT: ``--label``, default "the agent"; a verify gate's says "verify gate").
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

#: the exit of a supervisor whose program could not be started (a shell's "command not found")
CANNOT_START = 127


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


_stop_forwarded = threading.Event()  # the shift asked the agent to stop (SIGTERM forwarded) already


def _group(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (from /proc)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found


def _ask_stop(pgid: int, sig: int, sandboxed: bool) -> None:
    """A graceful stop for the agent's group: all of it, or in a sandbox all but its launcher
    (the group leader, ``pgid`` itself; see the module doc)."""
    if not sandboxed:
        _kill_group(pgid, sig)
        return
    for pid in _group(pgid):
        if pid != pgid:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _deadlines(line: bytes) -> tuple[float, float] | None:
    """``fence <term_at> <kill_at>`` (monotonic seconds) → (term_at, kill_at); None if not that."""
    parts = line.split()
    if len(parts) != 3 or parts[0] != b"fence":
        return None
    try:
        return float(parts[1]), float(parts[2])
    except ValueError:
        return None


def _watch(fd: int, pgid: int, clock: Callable[[], float] = time.monotonic, sandboxed: bool = False) -> None:
    """Block on the shift's pipe. EOF: the shift died or asked for the kill. A line ``fence T K``:
    the shift's lease certainly holds until a moment it computed; unless a later line moves them,
    SIGTERM the agent's group at T and SIGKILL it at K (CLOCK_MONOTONIC, the same clock in every
    process of the machine). So a shift that is frozen (SIGSTOP, a stalled machine) and cannot
    stop its agents itself still has them stopped before its lease could run out."""
    term_at: float | None = None
    kill_at: float | None = None
    termed = False
    buf = b""
    while True:
        timeout = None
        if kill_at is not None:
            now = clock()
            if now >= kill_at:
                break
            if term_at is not None and not termed and now >= term_at:
                if not _stop_forwarded.is_set():  # the shift's own fence did not get to it
                    _ask_stop(pgid, signal.SIGTERM, sandboxed)
                termed = True
            timeout = (kill_at if termed or term_at is None else term_at) - now
        try:
            ready, _, _ = select.select([fd], [], [], timeout)
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            continue
        if not ready:
            continue
        try:
            chunk = os.read(fd, 1024)
        except InterruptedError:  # pragma: no cover
            continue
        except OSError:
            chunk = b""
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            got = _deadlines(line)
            if got is not None:
                term_at, kill_at = got
    # the shift is gone, asked for the kill, or its lease is about to run out: nothing of the
    # agent's group may outlive it
    _kill_group(pgid, signal.SIGKILL)
    os._exit(128 + signal.SIGKILL)


def main(argv: list[str]) -> int:
    sandboxed = False
    label = "the agent"  # what it runs, as its "cannot start" line names it (e.g. "verify gate")
    while len(argv) > 1 and argv[1] != "--":
        if argv[1] == "--sandboxed":
            sandboxed = True
        elif argv[1].startswith("--label="):
            label = argv[1].split("=", 1)[1]
        else:
            break
        argv = [argv[0], *argv[2:]]
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m worker.agent.supervisor FD [--sandboxed] [--label=WHAT] -- ARGV...", file=sys.stderr)
        return 2
    fd = int(argv[0])
    command = argv[2:]
    agent_pid: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if agent_pid:
            _ask_stop(agent_pid[0], signum, sandboxed)
            _stop_forwarded.set()

    # handlers before the agent exists: a signal in between must not kill the supervisor alone
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    try:
        agent = subprocess.Popen(command, start_new_session=True)
    except OSError as exc:
        print(f"lanefleet: {label} {command[0]!r} cannot start: {exc.strerror}", file=sys.stderr)
        return CANNOT_START
    agent_pid.append(agent.pid)
    threading.Thread(target=_watch, args=(fd, agent.pid), kwargs={"sandboxed": sandboxed}, daemon=True).start()
    code = agent.wait()
    _kill_group(agent.pid, signal.SIGKILL)  # what the agent left behind in its group
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
