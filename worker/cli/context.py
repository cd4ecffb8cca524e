"""What every ``fleet`` command shares: the Runtime on the typer context, the consoles, the common
options, JSON output.

A user mistake exits 1 with one line on stderr and writes nothing (the SQL functions validate
before they write); see :func:`monitor.cli.app.main`.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

if TYPE_CHECKING:
    from worker.runtime import Runtime

# no emoji codes: a key, a title or an error naming "a:smile:b" is printed as it is (rich's default
# would print a😄b, and `key:key:x` as key🔑x)
console = Console(emoji=False)
err_console = Console(stderr=True, emoji=False)

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", envvar="FLEET_CONFIG", help="fleet.toml to read"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]
JsonTablesOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]
TASK_REF_HELP = "a task's id, or its key (key:K for a key of only digits, which reads as an id)"
TaskRef = Annotated[str, typer.Argument(metavar="ID|KEY", help=TASK_REF_HELP)]
# a table shows the columns that fit the terminal; --wide every one, lines as long as they get
WideOpt = Annotated[bool, typer.Option("--wide", help="every column, however wide (default: those that fit)")]
# keys are per lane: the lane of a key that names tasks in several lanes
KeyLaneOpt = Annotated[str | None, typer.Option("--lane", "-l", help="the lane of the key (keys are per lane)")]


def _print_version(wanted: bool) -> None:
    if wanted:
        try:
            print(f"lanefleet {version('lanefleet')}")
        except PackageNotFoundError:  # run from a copy of the source that was never installed
            print("lanefleet (version unknown: not installed)")
        raise typer.Exit()


VersionOpt = Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="print lanefleet's version and exit")]


class _Unmade:
    """The root's ``obj`` until a command asks for its Runtime (:func:`rt`): the config path."""

    def __init__(self, config: Path | None) -> None:
        self.config = config


def root_callback(ctx: typer.Context, config: ConfigOpt = None, show_version: VersionOpt = False) -> None:
    """lanefleet: a Postgres-backed, multi-lane task queue for fleets of agent workers."""
    # the Runtime is made (and worker.runtime imported) by the first call of rt(): `fleet --help`
    # and `fleet CMD --help` run no command and import none of it (psycopg, pydantic, ...:
    # bench/startup.py)
    ctx.obj = _Unmade(config)


def config_path(ctx: typer.Context) -> Path | None:
    """The fleet.toml the command was given (--config, FLEET_CONFIG), None for the default."""
    root = ctx.find_root()
    if isinstance(root.obj, _Unmade):
        return root.obj.config
    return root.obj.config_path if root.obj is not None else None


def rt(ctx: typer.Context) -> Runtime:
    """The command's Runtime, made at the first call (and closed when the command ends)."""
    from worker.runtime import Runtime

    root = ctx.find_root()
    if not isinstance(root.obj, Runtime):
        root.obj = Runtime(config_path(ctx))
        root.call_on_close(root.obj.close)
    return root.obj


def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))
