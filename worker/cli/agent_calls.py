"""``fleet guard`` and ``fleet checkpoint``: the commands agents call inside their work.

An agent pays their start-up for every guarded command and every checkpoint, so they are parsed
here with :mod:`argparse` and run without typer, rich, pydantic or a database driver: tens of
milliseconds instead of the app's few tenths of a second (``bench/startup.py``).
``monitor.cli.entry`` sends them here before it imports the rest of the app; the app's ``guard``
and ``checkpoint`` commands (which ``fleet --help`` lists) pass their arguments on to the same
parsers, so each option has one definition. A wrong argument is one line on stderr and exit 1, as for every command.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

GUARD_HELP = ("For agents: run CMD only while this task's lease holds (asked of the database now).\n\n"
              "The lease is confirmed for longer than the question took. Else CMD does not run: exit 77 "
              "(the task is not yours any more: stop) or 75 (could not confirm now: retry). Wrap what "
              "cannot be undone: fleet guard -- git push.")
CHECKPOINT_HELP = "For agents: save a checkpoint; the shift stores it at its next heartbeat."


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"error: {self.prog}: {message} (see {self.prog} --help)\n")
        sys.exit(1)


def _env_float(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        return float(text)
    except ValueError:
        sys.stderr.write(f"error: {name}={text!r} is not a number of seconds\n")
        sys.exit(1)


def _guard_parser() -> _Parser:
    p = _Parser(prog="fleet guard", description=GUARD_HELP,
                usage="fleet guard [OPTIONS] [--] CMD [ARGS...]",
                epilog="Options end at CMD: fleet guard git push -f passes -f to git.")
    p.add_argument("-q", "--quiet", action="store_true", help="no message when refused (still exit 77 or 75)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="seconds to wait for the shift's answer (env FLEET_GUARD_TIMEOUT; default 20)")
    # FLEET_GUARD_TASK first: in a batch member, the lease is the carrier's (worker.shift.batch)
    p.add_argument("--task", help="the task (set by the shift: FLEET_GUARD_TASK, else FLEET_TASK_ID)")
    p.add_argument("--token", help="its lease token (set by the shift: FLEET_LEASE_TOKEN)")
    p.add_argument("--socket", dest="socket_path", help="the shift's guard socket (set by the shift: FLEET_GUARD_SOCKET)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD", help="the command and its arguments")
    return p


def guard(args: Sequence[str]) -> int:
    from worker.shift.guard_client import run_guarded

    p = _guard_parser()
    ns = p.parse_args(list(args))
    cmd = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
    if not cmd:
        p.error("no CMD: give the command to run, e.g. fleet guard -- git push")
    timeout = ns.timeout if ns.timeout is not None else _env_float("FLEET_GUARD_TIMEOUT", 20.0)
    if timeout < 0.1:
        p.error(f"--timeout must be at least 0.1 seconds, not {timeout:g}")
    task = ns.task or os.environ.get("FLEET_GUARD_TASK") or os.environ.get("FLEET_TASK_ID")
    return run_guarded(cmd, task=task, token=ns.token or os.environ.get("FLEET_LEASE_TOKEN"),
                       socket_path=ns.socket_path or os.environ.get("FLEET_GUARD_SOCKET"),
                       timeout=timeout, quiet=ns.quiet)


def checkpoint(args: Sequence[str]) -> int:
    from worker.errors import FleetError, one_line
    from worker.workspace.checkpoint import save_checkpoint

    p = _Parser(prog="fleet checkpoint", description=CHECKPOINT_HELP)
    p.add_argument("-d", "--data", required=True, help="the checkpoint, a JSON value (or @file)")
    p.add_argument("--workspace", type=Path, default=None,
                   help="the task workspace (set by the shift: FLEET_WORKSPACE)")
    ns = p.parse_args(list(args))
    workspace = ns.workspace or (Path(os.environ["FLEET_WORKSPACE"]) if os.environ.get("FLEET_WORKSPACE") else None)
    try:
        save_checkpoint(workspace, ns.data)
    except FleetError as exc:
        sys.stderr.write(f"error: {one_line(str(exc))}\n")
        return 1
    except OSError as exc:  # --data @file that cannot be read
        sys.stderr.write(f"error: fleet checkpoint: {exc.filename}: {exc.strerror}\n")
        return 1
    print("checkpoint saved; stored at the next heartbeat")
    return 0


COMMANDS = {"guard": guard, "checkpoint": checkpoint}


def run(argv: Sequence[str]) -> int:
    """``argv`` without the program: ``["guard", …]`` or ``["checkpoint", …]``."""
    return COMMANDS[argv[0]](argv[1:])
