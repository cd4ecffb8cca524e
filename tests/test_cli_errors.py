"""The operator's terminal: every user or environment mistake is one line on stderr naming what is
wrong and where it came from (the flag, the file, the environment variable, the database), exit 1,
no traceback, nothing written — `fleet up` and argument errors included. Each case is a real
``python -m monitor.cli`` process in a folder of its own (tests/test_cli.py has the cases of
bad task input); they run concurrently and are checked one by one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psycopg
import pytest
import typer
from conftest import create_database, drop_database
from fleetkit import one_line
from psycopg.conninfo import make_conninfo
from rich.text import Text
from typer.testing import CliRunner

from monitor.cli.app import app
from worker.db.migrate import load_migrations
from worker.db.url import redact
from worker.errors import one_line as message_line

ROOT = Path(__file__).resolve().parents[1]
DOCS = '[lanes.docs]\ncommand = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]\nmax_running = 2\n'
UNREACHABLE = "postgresql://postgres@127.0.0.1:1/fleet"


def env_without_fleet(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLEET_", "UV_RUN")) and k not in ("DATABASE_URL", "VIRTUAL_ENV")}
    return {**env, "COLUMNS": "200", "PYTHONPATH": str(ROOT), **extra}


def fleet(*args: str, cwd: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "monitor.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------------
# mistakes: one line, exit 1, nothing written


@dataclass
class Mistake:
    id: str
    args: list[str]
    expect: list[str]  # substrings of the one line ({db}, {empty}, {home}: filled in)
    env: dict[str, str] = field(default_factory=dict)  # {db}, {empty}, {nodb}: filled in
    config: str | None = "fleet.toml"  # FLEET_CONFIG (a file of the case's folder), None: unset
    unexpected: list[str] = field(default_factory=list)


MIGRATIONS = len(load_migrations())

MISTAKES = [
    # the database cannot be reached, does not exist, or is not a URL: `fleet up` as every command
    Mistake("up-unreachable", ["up"], [f"cannot connect to the database {UNREACHABLE} (DATABASE_URL)",
                                       "Connection refused. Is the server running"],  # libpq's two lines, as one
            env={"DATABASE_URL": UNREACHABLE}),
    Mistake("up-demo-unreachable", ["up", "--demo"], [f"cannot connect to the database {UNREACHABLE} (DATABASE_URL)"],
            env={"DATABASE_URL": UNREACHABLE}, config="demo.toml"),
    Mistake("up-no-such-database", ["up"], ["cannot connect to the database {nodb} (DATABASE_URL)",
                                            "does not exist"], env={"DATABASE_URL": "{nodb}"}),
    Mistake("up-demo-no-such-database", ["up", "--demo"], ["{nodb} (DATABASE_URL)", "does not exist"],
            env={"DATABASE_URL": "{nodb}"}, config="demo.toml"),
    Mistake("migrate-no-such-database", ["migrate"], ["{nodb} (DATABASE_URL)", "does not exist"],
            env={"DATABASE_URL": "{nodb}"}),
    Mistake("tasks-not-a-url", ["tasks"], ["DATABASE_URL: 'notaurl' is not a database URL"],
            env={"DATABASE_URL": "notaurl"}),
    Mistake("up-not-a-url", ["up"], ["DATABASE_URL: 'notaurl' is not a database URL"], env={"DATABASE_URL": "notaurl"}),
    Mistake("db-url-not-a-url", ["db", "url"], ["DATABASE_URL: 'notaurl' is not a database URL"],
            env={"DATABASE_URL": "notaurl"}),
    Mistake("url-from-fleet-database-url", ["tasks"], [f"the database {UNREACHABLE} (FLEET_DATABASE__URL)"],
            env={"FLEET_DATABASE__URL": UNREACHABLE}),
    Mistake("url-from-the-file", ["tasks"], [f"the database {UNREACHABLE} ({{home}}/with-url.toml: database.url)"],
            config="with-url.toml"),
    Mistake("password-not-shown", ["tasks"], ["the database postgresql://postgres@127.0.0.1:1/fleet (DATABASE_URL)"],
            env={"DATABASE_URL": "postgresql://postgres:hunter2@127.0.0.1:1/fleet"}, unexpected=["hunter2"]),
    Mistake("not-a-url-password-not-shown", ["tasks"], ["DATABASE_URL: 'postgresql://postgres@127.0.0.1:1/fleet?bogus=1'"
                                                       " is not a database URL", "bogus"],
            env={"DATABASE_URL": "postgresql://postgres:hunter2@127.0.0.1:1/fleet?bogus=1"}, unexpected=["hunter2"]),
    Mistake("key-value-password-not-shown", ["tasks"], ["cannot connect to the database host=127.0.0.1 port=1 "
                                                        "password=*** (DATABASE_URL)"],
            env={"DATABASE_URL": "host=127.0.0.1 port=1 password=hunter2"}, unexpected=["hunter2"]),
    # a config outside the checkout that names an unmigrated database: which one lacks what
    Mistake("unmigrated-named", ["tasks"], [f"the database {{empty}} ({{home}}/elsewhere/fleet.toml: database.url) "
                                            f"lacks {MIGRATIONS} migration(s)", "fleet migrate"],
            config="elsewhere/fleet.toml"),
    # argument errors: one line naming the option, exit 1 (not click's box and exit 2)
    Mistake("priority-not-a-number", ["enqueue", "docs", "--key", "k:1", "--priority", "abc"],
            ["'--priority'", "valid integer", "enqueue --help)"], env={"DATABASE_URL": "{db}"}),
    Mistake("limit-negative", ["tasks", "--limit", "-1"], ["'--limit'", "greater than or equal to 1"],
            env={"DATABASE_URL": "{db}"}),
    Mistake("shift-without-lane", ["shift", "--once"], ["Missing option '--lane'"], env={"DATABASE_URL": "{db}"}),
    Mistake("show-without-a-task", ["show"], ["Missing argument 'ID|KEY'"], env={"DATABASE_URL": "{db}"}),
    Mistake("unknown-command", ["enqeue", "docs"], ["No such command 'enqeue'"], env={"DATABASE_URL": "{db}"}),
    Mistake("unknown-option", ["tasks", "--lanes", "docs"], ["No such option: --lanes"], env={"DATABASE_URL": "{db}"}),
    Mistake("option-without-value", ["tasks", "--limit"], ["'--limit' requires an argument"],
            env={"DATABASE_URL": "{db}"}),
    Mistake("resume-task-and-batch", ["resume", "7", "--batch", "3"], ["give a task or --batch, not both"],
            env={"DATABASE_URL": UNREACHABLE}),  # checked before the database is asked
    # the environment's overrides are blamed on the environment variable, not on fleet.toml
    Mistake("env-override-out-of-range", ["tasks"],
            ["environment variable FLEET_LANES__DOCS__MAX_RUNNING: lanes.docs.max_running: "
             "Input should be greater than or equal to 0"],
            env={"DATABASE_URL": "{db}", "FLEET_LANES__DOCS__MAX_RUNNING": "-1"}, unexpected=["fleet.toml"]),
    Mistake("env-override-typo", ["tasks"],
            ["environment variable FLEET_LANES__DOCS__MAX_RUNING: lanes.docs.max_runing: unknown field "
             "'max_runing' (did you mean 'max_running'?)"],
            env={"DATABASE_URL": "{db}", "FLEET_LANES__DOCS__MAX_RUNING": "3"}),
    Mistake("env-override-makes-a-lane", ["tasks"],
            ["environment variable FLEET_LANES__DOC__MAX_RUNNING: lanes.doc: a lane needs a command"],
            env={"DATABASE_URL": "{db}", "FLEET_LANES__DOC__MAX_RUNNING": "3"}),
    Mistake("file-typo", ["tasks"], ["{home}/typo.toml: lanes.docs.max_runing: unknown field 'max_runing' "
                                     "(did you mean 'max_running'?)"],
            env={"DATABASE_URL": "{db}"}, config="typo.toml"),
    Mistake("file-section-typo", ["tasks"], ["unknown field 'fleeet' (did you mean 'fleet'?)"],
            env={"DATABASE_URL": "{db}"}, config="section-typo.toml"),
    # a key minted for a lane the fleet.toml here does not name would claim nothing
    Mistake("mint-unknown-lane", ["keys", "mint", "--role", "worker", "--lane", "doc"],
            ["--lane 'doc' is not a lane of {home}/fleet.toml", "its lanes: docs"],
            env={"SUPABASE_JWT_SECRET": "s" * 40}, unexpected=["eyJ"]),
    # a key of only digits is named key:17; an unknown one says it looked for a key
    Mistake("show-key-prefix-unknown", ["show", "key:424242"], ["no task with key '424242'"],
            env={"DATABASE_URL": "{db}"}),
]


@dataclass
class Runs:
    results: dict[str, subprocess.CompletedProcess[str]]
    folders: dict[str, Path]
    counts_before: tuple[int, int]
    counts_after: tuple[int, int]
    empty_url: str
    values: dict[str, str]  # the URLs of the cases (no password: as the messages show them)
    written: dict[str, set[str]]  # per case, the files it made in its folder


def counts(url: str) -> tuple[int, int]:
    with psycopg.connect(url, autocommit=True) as c:
        tasks = c.execute("select count(*) from fleet.tasks").fetchone()
        events = c.execute("select count(*) from fleet.journal").fetchone()
    assert tasks is not None and events is not None
    return int(tasks[0]), int(events[0])


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def runs(pg_server: str, template_db: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """Every MISTAKE in a folder of its own, run concurrently: a migrated database with the
    config's lanes, an empty one, and the name of one that does not exist."""
    migrated = create_database(pg_server, template=template_db)
    empty = create_database(pg_server)
    db, empty_url = make_conninfo(pg_server, dbname=migrated), make_conninfo(pg_server, dbname=empty)
    nodb = make_conninfo(pg_server, dbname="lanefleet_no_such_database")
    values = {"db": db, "empty": empty_url, "nodb": nodb}
    folders: dict[str, Path] = {}
    try:
        with psycopg.connect(db, autocommit=True) as c:
            c.execute("select fleet.sync_lane('docs', '{}'::jsonb)")
        for case in MISTAKES:
            home = tmp_path_factory.mktemp(case.id)
            (home / "fleet.toml").write_text(DOCS)
            # the demo's lanes (else `up --demo` refuses the config before it looks for the database)
            (home / "demo.toml").write_text(DOCS + "".join(DOCS.replace("docs", lane).split("\n", 1)[0] + "\n"
                                                           + DOCS.split("\n", 1)[1] for lane in ("bugfix", "review")))
            (home / "with-url.toml").write_text(f'[database]\nurl = "{UNREACHABLE}"\n' + DOCS)
            (home / "typo.toml").write_text(DOCS + "max_runing = 2\n")
            (home / "section-typo.toml").write_text("[fleeet]\nworkspaces = 'x'\n" + DOCS)
            (home / "elsewhere").mkdir()
            (home / "elsewhere" / "fleet.toml").write_text(f'[database]\nurl = "{empty_url}"\n' + DOCS)
            folders[case.id] = home

        def run(case: Mistake) -> subprocess.CompletedProcess[str]:
            home = folders[case.id]
            env = env_without_fleet(**{k: v.format(**values) for k, v in case.env.items()})
            if case.config is not None:
                env["FLEET_CONFIG"] = str(home / case.config)
            return fleet(*case.args, cwd=home, env=env)

        before = counts(db)
        listing = {case.id: files_under(folders[case.id]) for case in MISTAKES}
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = dict(zip([c.id for c in MISTAKES], pool.map(run, MISTAKES), strict=True))
        written = {case.id: files_under(folders[case.id]) - listing[case.id] for case in MISTAKES}
        shown = {name: redact(url) for name, url in values.items()}  # as messages show a URL
        yield Runs(results, folders, before, counts(db), empty_url, shown, written)
    finally:
        drop_database(pg_server, migrated)
        drop_database(pg_server, empty)


def test_every_mistake_is_one_line_that_names_it_and_writes_nothing(runs: Runs) -> None:
    # one test for all of them: a parametrized one would run the fixture's processes again on
    # every xdist worker that gets a case
    failures = []
    for case in MISTAKES:
        try:
            line = one_line(runs.results[case.id])
            values = {**runs.values, "home": str(runs.folders[case.id])}
            for want in case.expect:
                assert want.format(**values) in line, f"{want.format(**values)!r} not in {line!r}"
            for word in case.unexpected:
                assert word not in line, f"{word!r} in {line!r}"
            assert not runs.written[case.id], f"it wrote {sorted(runs.written[case.id])}"
        except AssertionError as exc:
            failures.append(f"{case.id}: {exc}")
    assert not failures, "\n".join(failures)
    assert runs.counts_after == runs.counts_before
    with psycopg.connect(runs.empty_url, autocommit=True) as c:  # the unmigrated one stays empty
        row = c.execute("select to_regnamespace('fleet')").fetchone()
    assert row is not None and row[0] is None


def test_the_embedded_database_of_a_config_elsewhere_is_named(tmp_path: Path) -> None:
    """FLEET_CONFIG=../elsewhere/fleet.toml without [database]: the embedded server of that folder
    answers, unmigrated, and the message says which one it is and why it is the one in use."""
    checkout, elsewhere = tmp_path / "checkout", tmp_path / "elsewhere"
    checkout.mkdir()
    elsewhere.mkdir()
    (elsewhere / "fleet.toml").write_text(DOCS)
    env = env_without_fleet(FLEET_CONFIG="../elsewhere/fleet.toml")
    pgdata = (elsewhere / ".fleet" / "pgdata").resolve()
    try:
        done = fleet("tasks", cwd=checkout, env=env)
        # first the notice that a new embedded database was made (naming it), then the one error line
        notice, line = done.stderr.splitlines()
        assert done.returncode == 1 and "Traceback" not in done.stderr, done
        assert notice.startswith(f"created a new embedded database in {pgdata}"), notice
        assert f"the embedded database in {pgdata} lacks {MIGRATIONS} migration(s)" in line, line
        assert f"neither DATABASE_URL nor {elsewhere.resolve() / 'fleet.toml'} names a database" in line, line
    finally:
        # the server this test started (its pid is in postmaster.pid): fleet db stop stops that one
        if (pgdata / "postmaster.pid").exists():
            pid = int((pgdata / "postmaster.pid").read_text().split()[0])
            fleet("db", "stop", cwd=checkout, env=env)
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


# ------------------------------------------------------------------------------------------------
# what works: keys of only digits, --version, help


def test_a_key_of_only_digits_is_reached_as_key_prefix(db_url: str, tmp_path: Path) -> None:
    (tmp_path / "fleet.toml").write_text(DOCS)
    env = env_without_fleet(DATABASE_URL=db_url, FLEET_CONFIG=str(tmp_path / "fleet.toml"))
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select fleet.sync_lane('docs', '{}'::jsonb)")

    def ok(*args: str) -> subprocess.CompletedProcess[str]:
        result = fleet(*args, cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stderr
        return result

    first = int(ok("enqueue", "docs", "--key", "issue:1").stdout)
    # a task whose key is the first task's id: `fleet show N` is task N, `key:N` is the other one
    queued = ok("enqueue", "docs", "--key", str(first), "--title", "digits")
    second = int(queued.stdout)
    assert second != first
    assert f"key:{first}" in queued.stderr  # enqueue says how to name it
    assert f"task {first} issue:1" in ok("show", str(first)).stdout
    assert f"task {second} {first}" in ok("show", f"key:{first}").stdout
    assert f"task {second} {first}" in ok("show", f"key:{first}", "--lane", "docs").stdout
    assert f"task {second}: cancelled" in ok("cancel", f"key:{first}").stdout
    assert f"task {second}: queued" in ok("retry", f"key:{first}").stdout
    # `key:` before a key that itself starts with key:
    third_queued = ok("enqueue", "docs", "--key", "key:x")
    third = int(third_queued.stdout)
    assert "key:key:x" in third_queued.stderr  # as typed: no ":key:" emoji (🔑) of rich's
    assert f"task {third} key:x" in ok("show", "key:key:x").stdout
    # nor in an error: the key is named as given
    missing = fleet("show", "x:smile:y", cwd=tmp_path, env=env)
    assert missing.returncode == 1 and "'x:smile:y'" in missing.stderr
    with psycopg.connect(db_url, autocommit=True) as c:
        row = c.execute("select state from fleet.tasks where id = %s", (first,)).fetchone()
    assert row == ("queued",)  # the task of id N was never touched


def test_version(tmp_path: Path) -> None:
    result = fleet("--version", cwd=tmp_path, env=env_without_fleet(DATABASE_URL=UNREACHABLE))
    assert (result.returncode, result.stdout, result.stderr) == (0, f"lanefleet {version('lanefleet')}\n", "")


@pytest.mark.parametrize("args", [[], ["--help"], ["db"], ["tasks", "--help"]], ids=["bare", "help", "group", "command"])
def test_help_still_prints_and_exits_0(args: list[str], tmp_path: Path) -> None:
    result = fleet(*args, cwd=tmp_path, env=env_without_fleet(DATABASE_URL=UNREACHABLE))
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout and result.stderr == ""


def _commands() -> list[tuple[list[str], Any]]:
    """Every command and group of the app with its path (the root's is [])."""
    found: list[tuple[list[str], Any]] = []

    def walk(cmd: Any, path: list[str]) -> None:
        found.append((path, cmd))
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return found


def test_every_help_text_renders_as_written() -> None:
    """No backquote or ``double backquote`` shown literally, no [text] that rich reads as markup
    (and drops), no first paragraph whose line breaks the command list keeps."""
    runner = CliRunner()
    commands = _commands()
    assert len(commands) > 30
    for path, cmd in commands:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "100"})
        assert result.exit_code == 0, (path, result.output)
        assert "`" not in result.output, (path, [line for line in result.output.splitlines() if "`" in line])
        # a flag takes no value: no "<bool>" beside it (typer's rich help shows one)
        assert "<bool>" not in result.output, (path, [line for line in result.output.splitlines() if "<bool>" in line])
        if not path:
            continue
        texts = [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
        for text in texts:
            assert Text.from_markup(text).plain == text, (path, text)
        first = re.split(r"\n\s*\n", (cmd.help or "").strip())[0]
        assert "\n" not in first, (path, first)


@pytest.mark.parametrize(("text", "line"), [
    # libpq's message of a refused connection, as psycopg 3 gives it
    ('connection failed: connection to server at "127.0.0.1", port 5999 failed: Connection refused\n'
     '\tIs the server running on that host and accepting TCP/IP connections?',
     'connection failed: connection to server at "127.0.0.1", port 5999 failed: Connection refused. '
     'Is the server running on that host and accepting TCP/IP connections?'),
    ("one line  with  runs of blanks", "one line with runs of blanks"),
    ("ends with a colon:\n\nthe rest\n", "ends with a colon: the rest"),
    ("", ""),
])
def test_a_message_of_several_lines_is_one_line_of_sentences(text: str, line: str) -> None:
    assert message_line(text) == line
