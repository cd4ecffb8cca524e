"""``fleet guard -- CMD``: an agent runs CMD only while its task's lease holds (:mod:`worker.shift.guard`).

Options end at CMD: ``fleet guard git push -f`` passes ``-f`` to git (``--`` works as well); the
app registers it with ``allow_interspersed_args`` off.
"""

from __future__ import annotations

from typing import Annotated

import typer

from worker.shift.guard import run_guarded


def guard(
    cmd: Annotated[list[str], typer.Argument(metavar="CMD", show_default=False,
                                             help="the command and its arguments, after --")],
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no message when refused (still exit 77 or 75)")] = False,
    timeout: Annotated[float, typer.Option("--timeout", envvar="FLEET_GUARD_TIMEOUT", min=0.1,
                                           help="seconds to wait for the shift's answer")] = 20.0,
    # FLEET_GUARD_TASK first: in a batch member, the lease is the carrier's (worker.shift.batch)
    task: Annotated[str | None, typer.Option("--task", envvar=["FLEET_GUARD_TASK", "FLEET_TASK_ID"],
                                             help="the task (set by the shift)")] = None,
    token: Annotated[str | None, typer.Option("--token", envvar="FLEET_LEASE_TOKEN",
                                              help="its lease token (set by the shift)")] = None,
    socket_path: Annotated[str | None, typer.Option("--socket", envvar="FLEET_GUARD_SOCKET",
                                                    help="the shift's guard socket (set by the shift)")] = None,
) -> None:
    """For agents: run CMD only while this task's lease holds (asked of the database now).

    The lease is confirmed for longer than the question took. Else CMD does not run: exit 77 (the
    task is not yours any more: stop) or 75 (could not confirm now: retry). Wrap what cannot be
    undone: fleet guard -- git push."""
    raise typer.Exit(run_guarded(cmd, task=task, token=token, socket_path=socket_path, timeout=timeout,
                                 quiet=quiet))
