"""`fleet guard` and `fleet checkpoint` as agents call them: the console script runs them from their
own parsers (worker/cli/agent_calls.py) before the rest of the app is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.cli import agent_calls

FLEET = str(Path(sys.executable).with_name("fleet"))


def fleet(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    return subprocess.run([FLEET, *args], env={**base, **(env or {})}, cwd=cwd, capture_output=True, text=True,
                          timeout=60, check=False)


def test_guard_and_checkpoint_import_none_of_the_app() -> None:
    """What makes them start fast: no typer, rich, pydantic or driver in the process."""
    code = ("import sys; sys.argv = ['fleet', 'guard', '-q', '--', 'true']\n"
            "from monitor.cli.entry import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n"
            "    heavy = sorted(m for m in ('typer', 'rich', 'pydantic', 'psycopg', 'structlog', 'httpx')"
            " if m in sys.modules)\n    print(e.code, heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("FLEET_")})
    assert out.stdout.split("\n")[0] == "77 []", out


@pytest.mark.parametrize("argv", [["-q", "--", "sh", "-c", "exit 3"], ["-q", "sh", "-c", "exit 3"]])
def test_options_end_at_cmd_and_dashdash_is_optional(argv: list[str]) -> None:
    ns = agent_calls._guard_parser().parse_args(argv)
    assert ns.quiet is True and ns.cmd[-3:] == ["sh", "-c", "exit 3"]
    # CMD's own options are CMD's: -q after CMD is not the guard's
    ns = agent_calls._guard_parser().parse_args(["git", "push", "-q", "--timeout", "3"])
    assert (ns.quiet, ns.timeout, ns.cmd) == (False, None, ["git", "push", "-q", "--timeout", "3"])


def test_guard_outside_a_task_refuses_with_77_and_one_line() -> None:
    out = fleet("guard", "--", "true")
    assert out.returncode == 77
    assert out.stderr.splitlines() == [
        "fleet guard: not inside a fleet task (FLEET_TASK_ID and FLEET_LEASE_TOKEN are not set); `true` not run (exit 77)"]
    assert fleet("guard", "-q", "--", "true").stderr == ""


@pytest.mark.parametrize(("args", "env", "says"), [
    (["guard"], {}, "error: fleet guard: no CMD: give the command to run"),
    (["guard", "--timeout", "0.01", "true"], {}, "error: fleet guard: --timeout must be at least 0.1 seconds, not 0.01"),
    (["guard", "--timeout", "soon", "true"], {}, "error: fleet guard: argument --timeout: invalid float value: 'soon'"),
    (["guard", "true"], {"FLEET_GUARD_TIMEOUT": "soon"}, "error: FLEET_GUARD_TIMEOUT='soon' is not a number of seconds"),
    (["checkpoint"], {}, "error: fleet checkpoint: the following arguments are required: -d/--data"),
    (["checkpoint", "-d", "{"], {"FLEET_WORKSPACE": "/nonexistent"}, "error: --data is not valid JSON"),
    (["checkpoint", "-d", "1"], {}, "error: no workspace: run this inside a task (FLEET_WORKSPACE) or pass --workspace"),
    (["checkpoint", "-d", "@/nonexistent/cp.json", "--workspace", "/tmp"], {},
     "error: fleet checkpoint: /nonexistent/cp.json: No such file or directory"),
])
def test_a_wrong_argument_is_one_line_and_exit_1(args: list[str], env: dict[str, str], says: str) -> None:
    out = fleet(*args, env=env)
    assert out.returncode == 1, out
    assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith(says), out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_checkpoint_writes_into_the_workspace_it_is_given(tmp_path: Path) -> None:
    (tmp_path / ".fleet").mkdir()
    out = fleet("checkpoint", "-d", '{"step": 3}', env={"FLEET_WORKSPACE": str(tmp_path)})
    assert out.returncode == 0 and out.stdout == "checkpoint saved; stored at the next heartbeat\n", out
    assert json.loads((tmp_path / ".fleet" / "checkpoint.json").read_text()) == {"step": 3}
    (tmp_path / "cp.json").write_text("[1, 2]")
    assert fleet("checkpoint", "--data", "@cp.json", "--workspace", str(tmp_path), cwd=tmp_path).returncode == 0
    assert json.loads((tmp_path / ".fleet" / "checkpoint.json").read_text()) == [1, 2]


def test_their_help_is_their_parsers_and_fleet_help_lists_them() -> None:
    guard_help = fleet("guard", "--help")
    assert guard_help.returncode == 0 and guard_help.stdout.startswith("usage: fleet guard [OPTIONS] [--] CMD")
    assert "--timeout" in guard_help.stdout and "`" not in guard_help.stdout
    listing = fleet("--help")
    assert listing.returncode == 0 and "guard" in listing.stdout and "checkpoint" in listing.stdout
