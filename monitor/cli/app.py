"""The ``fleet`` command: the monitor side composes the whole app (it may import the worker), and
this module alone registers the command modules of ``worker/cli/`` and ``monitor/cli/``, in the
order ``fleet --help`` lists them. The command modules import what their commands do inside the
commands (the rule is in :mod:`worker.cli`): ``fleet --help`` loads typer and rich, no driver.

Errors lanefleet raises on purpose (:class:`FleetError`) and usage errors (a bad option value, a
missing argument, an unknown command) end the command with one line on stderr and exit code 1,
never a stack trace or a box.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import typer
import typer.core
from rich.markup import escape

from monitor.cli import dashboards, run, web, workspaces
from worker.cli import (
    batch,
    db,
    devstack,
    dispatch,
    guard,
    keys,
    migrate,
    review,
    shift,
    sources,
    tasks,
)
from worker.cli.context import err_console, root_callback
from worker.errors import FleetError, one_line


def _flag_type_shown(self: typer.core.TyperOption, ctx: Any) -> str | None:
    """An option's type in the help, none for a flag: typer's rich help (0.29) shows ``<bool>``
    beside ``--wide``, as if it took a value; its plain help already leaves a flag's type out."""
    return None if self.is_flag else _option_type_shown(self, ctx)


_option_type_shown = typer.core.TyperOption.display_type_rich
typer.core.TyperOption.display_type_rich = _flag_type_shown  # type: ignore[method-assign]

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="lanefleet: a Postgres-backed, multi-lane task queue for fleets of agent workers.")
app.callback()(root_callback)

command: Callable[..., None]

# the worker side
for command in (migrate.migrate, tasks.enqueue, tasks.tasks, tasks.show, tasks.cancel, tasks.retry,
                shift.shift):
    app.command()(command)
app.add_typer(migrate.lanes_app, name="lanes")
app.add_typer(db.db_app, name="db")
app.add_typer(keys.app, name="keys")
app.add_typer(devstack.app, name="dev-stack")
app.command("profiles")(dispatch.profiles)
app.add_typer(dispatch.pools_app, name="pools")
app.command("resume")(tasks.resume)
app.add_typer(review.review_app, name="review")
app.add_typer(batch.batch_app, name="batch")
app.add_typer(sources.sources_app, name="sources")
# agents' commands: their own parsers (worker.cli.agent_calls); options end at CMD
app.command("checkpoint", context_settings=guard.PASS_ON, add_help_option=False)(guard.checkpoint)
app.command("guard", context_settings=guard.PASS_ON, add_help_option=False)(guard.guard)

# the monitor side
for command in (run.monitor, run.run, run.crontab, run.up, dashboards.status, dashboards.stats,
                dashboards.snapshot, dashboards.report, web.web, workspaces.workspaces):
    app.command()(command)


def _fail(message: str) -> None:
    # one line (a driver message can span several); it may quote user input ("[/x]"):
    # escape it, or rich reads it as markup
    err_console.print(f"[red]error:[/] {escape(one_line(message))}", highlight=False, soft_wrap=True)
    sys.exit(1)


def main() -> None:
    try:
        # not standalone: click's usage errors come here, to be one line like every other error
        code = app(standalone_mode=False)
    except typer.TyperException as exc:  # typer's click: a usage error, a file error
        if type(exc).__name__ == "NoArgsIsHelpError":  # as typer tells it (the class is not public)
            sys.exit(0)  # `fleet`, `fleet db`: the help was printed
        message = getattr(exc, "format_message", exc.__str__)().rstrip(".")
        ctx = getattr(exc, "ctx", None)  # a usage error's: where to read how the command goes
        _fail(message + (f" (see {ctx.command_path} --help)" if ctx is not None else ""))
    except typer.Abort:
        _fail("aborted")
    except FleetError as exc:
        _fail(str(exc))
    # an exit code (typer.Exit, --help), or what a command returned (None)
    sys.exit(code if isinstance(code, int) else 0)
