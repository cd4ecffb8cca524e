"""The preflight (worker/preflight.py) and what stops a lane before it burns attempts: a lane whose
config is wrong is paused with the reason by `fleet lanes sync` and a shift's start, and unpaused by
a sync of the fixed config; an agent program that cannot start at run time hands its task back
unspent and pauses the lane; `fleet lanes retire` and what a retired lane refuses. Real shifts of
the scripted agent against a real Postgres; the SQL itself: tests/sql/test_lanes.py,
tests/sql/test_finish.py."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fleetkit import Backend, Fleet, lane_defaults, write_fleet_toml

from worker.config import load_config
from worker.errors import ConfigError, LaneRetired
from worker.preflight import lane_problems

QUICK = {"steps": 1, "sleep": 0.01}
HOST = socket.gethostname()


@pytest.fixture
def fleet_with(db_url: str, tmp_path: Path) -> Iterator[Any]:
    made: list[Fleet] = []

    def make(**lanes: dict[str, Any]) -> Fleet:
        f = Fleet(Backend("postgres", db_url), tmp_path, {name: lane_defaults(**lane) for name, lane in lanes.items()})
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def lane_row(f: Fleet, name: str) -> dict[str, Any]:
    return f.sql("select * from fleet.lanes where name = %s", (name,))[0]


# ------------------------------------------------------------------------------------------------
# what the preflight checks


def test_the_preflight_names_each_field_that_is_wrong_and_passes_what_it_cannot_see(tmp_path: Path) -> None:
    not_executable = tmp_path / "agent.txt"
    not_executable.write_text("not a program")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "claude").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "claude").chmod(0o755)
    (tmp_path / "lane_instructions").mkdir()
    for lane in ("good", "fine"):
        (tmp_path / "lane_instructions" / f"{lane}.md").write_text("do it\n")
    toml = tmp_path / "fleet.toml"
    toml.write_text(f"""
[profiles.cc]
agent = "claude"

[lanes.bad]
command = ["no-such-agent-anywhere", "{{prompt_file}}"]
instructions = "docs/missing.md"
hidden_files = ["fleet", "clade"]

[lanes.abs]
command = ["{not_executable}"]
instructions = "lane_instructions/good.md"

[lanes.good]
command = ["python", "-m", "worker.dev.example_agent", "{{prompt_file}}"]

[lanes.fine]
command = ["./bin/agent-in-the-repo"]

[lanes.viaprofile]
profile = "cc"
instructions = "lane_instructions/good.md"
""")
    cfg = load_config(toml, environ={})
    path = str(tmp_path / "empty")
    problems = {lane: [str(p) for p in lane_problems(cfg, lane, path=lambda _: path, host="h1")] for lane in cfg.lanes}
    assert problems["bad"] == [
        f"lanes.bad.instructions: {tmp_path / 'docs' / 'missing.md'} does not exist (a relative path is "
        f"relative to the config's folder, {tmp_path})",
        "lanes.bad.hidden_files: no hidden-file set 'clade' in "
        f"{Path(__file__).resolve().parents[1] / 'hidden_files'} (sets: claude, fleet)",
        "lanes.bad.command: the agent program 'no-such-agent-anywhere' is not on PATH on host h1",
    ]
    assert problems["abs"] == [f"lanes.abs.command: the agent program {not_executable} is not an executable file on host h1"]
    assert problems["good"] == []  # python: this interpreter
    assert problems["fine"] == []  # a path in the task's workspace: not known before the task's
    assert problems["viaprofile"] == ["profiles.cc.agent: the agent program 'claude' is not on PATH on host h1"]
    # the PATH the agents get decides: with bin/ on it, the profile's claude is found
    found = lane_problems(cfg, "viaprofile", path=lambda _: str(tmp_path / "bin"), host="h1")
    assert found == []
    # a lane without instructions of its own and no file at the default place
    cfg2 = load_config(write_fleet_toml(tmp_path / "two.toml", tmp_path / "ws", {"nodoc": lane_defaults()}),
                       environ={})
    [missing] = lane_problems(cfg2, "nodoc", host="h1")
    # (both places it looked: beside the config, and lanefleet's own)
    assert missing.field == "lanes.nodoc.instructions" and missing.what == (
        f"no {tmp_path / 'lane_instructions' / 'nodoc.md'} and no instructions of lanefleet's own for a lane "
        "'nodoc' (give `instructions`, or write that file)")


# ------------------------------------------------------------------------------------------------
# paused by `fleet lanes sync` and a shift's start, unpaused by a sync of the fixed config


def test_lanes_sync_pauses_a_lane_whose_agent_is_not_on_path_and_a_fixed_config_unpauses_it(fleet_with) -> None:
    f = fleet_with(work={}, bad={"command": ["no-such-agent-anywhere", "{prompt_file}"], "max_attempts": 1})
    task = f.enqueue("bad", "t1", QUICK)
    done = f.cli("lanes", "sync")
    assert done.returncode == 0, done.stderr
    why = f"lanes.bad.command: the agent program 'no-such-agent-anywhere' is not on PATH on host {HOST}"
    # (the file the config came from, by its path: a fleet may be run with --config elsewhere)
    toml = f.toml.resolve()
    assert f"lane bad: paused: {why} (fix {toml}, then `fleet --config {toml} lanes sync` again)" in done.stderr
    assert "lane work: unchanged" in done.stdout
    assert (lane_row(f, "bad")["paused"], lane_row(f, "bad")["paused_reason"]) == (False, why)
    assert lane_row(f, "work")["paused_reason"] is None
    listed = f.cli("lanes", "list", env={**f.env("operator"), "COLUMNS": "400"})
    assert f"paused: {why}" in listed.stdout
    status = f.cli("status", env={**f.env("operator"), "COLUMNS": "400"})
    assert f"lane bad paused: {why}" in status.stdout
    assert json.loads(f.cli("lanes", "sync", "--json").stdout)["paused"] == {"bad": why}

    # its shifts claim nothing (their own preflight refuses): the task keeps every attempt
    # (max_attempts 1: one spent would kill it)
    with pytest.raises(ConfigError):
        f.run_shift("bad")
    assert (f.task(task)["state"], f.task(task)["attempts"]) == ("queued", 0)

    # the config fixed: the sync unpauses the lane and its task runs
    f.toml.write_text(f.toml.read_text().replace('"no-such-agent-anywhere"', '"python", "-m", "worker.dev.example_agent"'))
    done = f.cli("lanes", "sync")
    assert done.returncode == 0 and "paused" not in done.stderr, done.stderr
    assert lane_row(f, "bad")["paused_reason"] is None
    f.cfg = load_config(f.toml, environ={"DATABASE_URL": f.db_url})
    assert f.run_shift("bad").outcomes == {"done": 1}
    assert [e["kind"] for e in f.sql("select kind from fleet.journal where lane = 'bad' and kind like 'lane_%%paused' "
                                     "order by id")] == ["lane_paused", "lane_unpaused"]


def test_a_shift_whose_lane_config_is_wrong_pauses_the_lane_before_it_claims_anything(fleet_with, tmp_path) -> None:
    f = fleet_with(bad={"command": ["no-such-agent-anywhere"], "hidden_files": ["fleet", "clade"]})
    task = f.enqueue("bad", "t1", QUICK)
    with pytest.raises(ConfigError) as err:
        f.run_shift("bad")
    assert str(err.value).startswith("lane bad paused: lanes.bad.hidden_files: no hidden-file set 'clade'")
    assert "lanes.bad.command: the agent program 'no-such-agent-anywhere' is not on PATH" in str(err.value)
    assert str(err.value).endswith(f"(fix {f.toml.resolve()}, then `fleet --config {f.toml.resolve()} lanes sync`)")
    assert lane_row(f, "bad")["paused_reason"] == err.value.message.removeprefix("lane bad paused: ")
    assert (f.task(task)["state"], f.task(task)["attempts"]) == ("queued", 0)
    assert f.sql("select count(*) as n from fleet.sessions")[0]["n"] == 0
    # as `fleet shift` (what cron runs): one line, exit 1
    done = f.cli("shift", "--lane", "bad", "--once", env=f.env())
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("error: lane bad paused: lanes.bad.hidden_files")


# ------------------------------------------------------------------------------------------------
# an agent program that cannot start at run time


@pytest.mark.parametrize("how", ["missing", "exit-127"])
def test_an_agent_that_cannot_start_hands_its_tasks_back_unspent_and_pauses_the_lane(
        fleet_with, tmp_path: Path, how: str) -> None:
    if how == "missing":  # a path in the workspace (the preflight cannot see it), not there
        command = ["./bin/agent", "{prompt_file}"]
    else:  # a wrapper whose own program is not found: a shell's "command not found"
        wrapper = tmp_path / "wrapper.sh"
        wrapper.write_text("#!/bin/sh\nexec no-such-agent-anywhere \"$@\"\n")
        wrapper.chmod(0o755)
        command = [str(wrapper), "{prompt_file}"]
    f = fleet_with(work={"command": command, "max_attempts": 1})
    tasks = [f.enqueue("work", f"t{i}", QUICK) for i in range(3)]
    summary = f.run_shift("work", slots=1)
    # the first claim ran into it; the lane paused, nothing more was claimed
    assert (summary.claimed, summary.outcomes) == (1, {"not_started": 1})
    rows = [f.task(t) for t in tasks]
    assert [(r["state"], r["failures"], r["handoffs"]) for r in rows] == [("queued", 0, 0)] * 3
    assert [r["attempts"] for r in rows] == [1, 0, 0]
    [run] = f.runs(tasks[0])
    assert (run["outcome"], run["exit_code"]) == ("not_started", 127)
    why = lane_row(f, "work")["paused_reason"]
    if how == "missing":
        assert why == ("lanes.work: the agent './bin/agent' cannot start: No such file or directory (exit 127) "
                       f"on host {HOST}")
    else:
        assert why == f"lanes.work: the agent {str(command[0])!r} exited 127 (command not found) on host {HOST}"
    assert rows[0]["last_error"] == why
    # (what the preflight cannot see, a sync does not hold against the lane: it clears the pause)
    assert f.cli("lanes", "sync").returncode == 0
    assert lane_row(f, "work")["paused_reason"] is None


# ------------------------------------------------------------------------------------------------
# retired lanes


def test_fleet_lanes_retire_refuses_live_tasks_and_a_retired_lane_refuses_enqueue(fleet_with) -> None:
    f = fleet_with(work={}, old={})
    task = f.enqueue("old", "left", QUICK)
    done = f.cli("lanes", "retire", "old")
    assert done.returncode == 1
    assert done.stderr.strip() == ("error: lane old has 1 live task (1 queued): it is retired only when none is "
                                   "left (let them finish, or `fleet cancel` them (`fleet tasks --lane old` lists them))")
    assert f.cli("cancel", str(task)).returncode == 0
    done = f.cli("lanes", "retire", "old")
    assert (done.returncode, done.stdout.strip()) == (0, "lane old: retired; `fleet lanes unretire old` brings it back")

    done = f.cli("enqueue", "old", "--key", "late")
    assert done.returncode == 1 and done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: lane old is retired (since ") and line.endswith(
        "it takes no tasks (`fleet lanes unretire old` brings it back)")
    assert f.sql("select count(*) as n from fleet.tasks where key = 'late'")[0]["n"] == 0
    # a sync of a config that still has it keeps it retired, and says how to bring it back
    synced = f.cli("lanes", "sync")
    assert "lane old: retired (it stays so: `fleet lanes unretire old`, or retired = false in [lanes.old]" in synced.stdout
    assert "retired" in f.cli("lanes", "list", env={**f.env("operator"), "COLUMNS": "300"}).stdout
    with pytest.raises(LaneRetired):  # a shift of it opens no session
        f.run_shift("old")
    # a lane the config no longer has is named by the sync
    f.sql("insert into fleet.lanes (name) values ('gone')")
    assert "lane gone: in the database, not in the config (`fleet lanes retire gone` retires it)" in \
        f.cli("lanes", "sync").stdout
    # back
    assert f.cli("lanes", "unretire", "old").stdout.strip() == "lane old: back"
    assert f.cli("enqueue", "old", "--key", "late").returncode == 0
