"""``fleet guard -- CMD`` and ``fleet checkpoint`` as the app lists them (``fleet --help``). The
console script runs both from :mod:`worker.cli.agent_calls` before the app is imported; these
commands pass their arguments to the same parsers (one definition of each option), for a caller
that runs the app itself."""

from __future__ import annotations

import typer

from worker.cli.agent_calls import CHECKPOINT_HELP, GUARD_HELP, run

# options end at CMD (``fleet guard git push -f`` passes -f to git); --help is the parser's own
PASS_ON = {"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False,
           "help_option_names": []}


def guard(ctx: typer.Context) -> None:
    raise typer.Exit(run(["guard", *ctx.args]))


def checkpoint(ctx: typer.Context) -> None:
    raise typer.Exit(run(["checkpoint", *ctx.args]))


guard.__doc__, checkpoint.__doc__ = GUARD_HELP, CHECKPOINT_HELP
