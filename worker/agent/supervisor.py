"""The agent's supervisor: a small process beside each agent that kills it when the shift dies.

``python -m worker.agent.supervisor FD -- ARGV...``. The shift creates a pipe, keeps the write end, and
passes the read end as FD; it starts the supervisor in a session of its own, so a terminal's
Ctrl-C or a kill of the shift's process group does not reach it. The supervisor starts the agent
in yet another session (the agent's process group: the agent and everything it spawns) and
blocks on FD. EOF on FD means the shift closed its end or died — however it died, SIGKILL and
OOM included, the kernel closes the write end — and the supervisor then SIGKILLs the agent's
group. ``prctl(PR_SET_PDEATHSIG)`` is not used: on these machines it is accepted but not
delivered (DESIGN §6).

SIGTERM, SIGINT and SIGHUP sent to the supervisor are forwarded to the agent's group, so the
shift can ask for a graceful stop. When the agent exits, whatever it left running in its group
is killed too. The supervisor exits with the agent's exit code (128+N when it died of signal N).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _watch(fd: int, pgid: int) -> None:
    while True:
        try:
            chunk = os.read(fd, 1024)
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            continue
        except OSError:
            chunk = b""
        if not chunk:
            break
    # the shift is gone or asked for the kill: nothing of the agent's group may outlive it
    _kill_group(pgid, signal.SIGKILL)
    os._exit(128 + signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m worker.agent.supervisor FD -- ARGV...", file=sys.stderr)
        return 2
    fd = int(argv[0])
    command = argv[2:]
    agent_pid: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if agent_pid:
            _kill_group(agent_pid[0], signum)

    # handlers before the agent exists: a signal in between must not kill the supervisor alone
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    try:
        agent = subprocess.Popen(command, start_new_session=True)
    except OSError as exc:
        print(f"lanefleet: cannot start the agent {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    agent_pid.append(agent.pid)
    threading.Thread(target=_watch, args=(fd, agent.pid), daemon=True).start()
    code = agent.wait()
    _kill_group(agent.pid, signal.SIGKILL)  # what the agent left behind in its group
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
