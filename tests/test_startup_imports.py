"""`fleet --help` starts fast (bench/startup.py: under 0.4 s) because the app imports, at its start,
only what typer needs for the commands' signatures: each command imports what it does (the driver,
pydantic's config and models, structlog, the store, the runtime) when it runs. An import-set test,
not a timed one: it names the module that came back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# what `fleet --help` must not import (each costs tens of milliseconds, psycopg and pydantic ~100)
HEAVY = ("psycopg", "psycopg_pool", "pydantic", "pydantic_settings", "structlog", "httpx", "supabase",
         "apscheduler", "tenacity", "worker.config", "worker.models", "worker.runtime", "worker.store",
         "worker.shift", "worker.agent", "worker.dev", "monitor.dashboards.reads", "monitor.host",
         "monitor.reconcile")


def imported_by(argv: list[str]) -> tuple[str, str, list[str]]:
    """Run the app's main with ``argv`` in a fresh interpreter: its exit code, what it printed, and
    which of HEAVY (a module or any of its submodules) it left in sys.modules."""
    code = (f"import sys\nsys.argv = {argv!r}\n"
            "from monitor.cli.app import main\n"
            "code = 'none'\ntry:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
            f"heavy = [h for h in {HEAVY!r} if any(m == h or m.startswith(h + '.') for m in sys.modules)]\n"
            "print('RESULT', code, ' '.join(heavy))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**env, "COLUMNS": "120"}, check=False)
    lines = out.stdout.splitlines()
    assert lines and lines[-1].startswith("RESULT "), out
    _, exit_code, *heavy = lines[-1].split(" ")
    return exit_code, "\n".join(lines[:-1]), [m for m in heavy if m]


@pytest.mark.parametrize("argv", [["fleet", "--help"], ["fleet"]])
def test_fleet_help_imports_no_driver_config_or_logging(argv: list[str]) -> None:
    exit_code, helptext, heavy = imported_by(argv)
    assert (exit_code, heavy) == ("0", [])
    # the whole app was listed: a command of each side, and the agents' commands
    for command in ("enqueue", "shift", "lanes", "dev-stack", "guard", "status", "up", "workspaces"):
        assert f" {command} " in helptext, (command, helptext)


@pytest.mark.parametrize("argv", [["fleet", "tasks", "--help"], ["fleet", "lanes", "sync", "--help"],
                                  ["fleet", "up", "--help"]])
def test_a_commands_help_makes_no_runtime(argv: list[str]) -> None:
    """The root callback leaves the Runtime to the first command that asks (worker.cli.context.rt).
    (pydantic itself comes with typer here: typer/_adapters.py, when it builds a command's
    parameters; lanefleet's config, models and driver do not.)"""
    exit_code, helptext, heavy = imported_by(argv)
    assert (exit_code, [m for m in heavy if m != "pydantic"]) == ("0", [])
    assert "Usage:" in helptext and argv[-2] in helptext, helptext
