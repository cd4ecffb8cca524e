"""The ``fleet`` command: the monitor side composes the whole app (it may import the worker).

Errors lanefleet raises on purpose (:class:`FleetError`) end the command with one line on
stderr and exit code 1, never a stack trace.
"""

from __future__ import annotations

import sys

import typer
from rich.markup import escape

from monitor import commands as monitor_commands
from monitor import dashboards, workspaces_cli
from worker import cli as worker_cli
from worker.errors import FleetError

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="lanefleet: a Postgres-backed, multi-lane task queue for fleets of agent workers.")
app.callback()(worker_cli.root_callback)
worker_cli.register(app)
monitor_commands.register(app)
dashboards.register(app)
workspaces_cli.register(app)


def main() -> None:
    try:
        app()  # standalone: usage errors and --help exit here with click's codes
    except FleetError as exc:
        # one line (a driver message can span several); it may quote user input ("[/x]"):
        # escape it, or rich reads it as markup
        message = " ".join(str(exc).split())
        worker_cli.err_console.print(f"[red]error:[/] {escape(message)}", highlight=False,
                                     soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
