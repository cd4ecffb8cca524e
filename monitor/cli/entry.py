"""The ``fleet`` console script. ``fleet guard`` and ``fleet checkpoint``, which agents call inside
their work, run from :mod:`worker.cli.agent_calls` without importing the rest of the app (typer and
rich alone take a few tenths of a second to start; they, tens of milliseconds: ``bench/startup.py``);
every other command is :mod:`monitor.cli.app`."""

from __future__ import annotations

import sys


def main() -> None:
    argv = sys.argv[1:]
    if argv and argv[0] in ("guard", "checkpoint"):
        from worker.cli.agent_calls import run

        sys.exit(run(argv))
    from monitor.cli.app import main as app_main

    app_main()
