"""A workspace is the agent's: what it leaves there for the shift to touch next (a symbolic link
to a file of the fleet's, a FIFO) is never followed (worker/files.py). Each case is one an
attacker agent was seen to use against the shift (outside the sandbox, with the fleet's rights):
a link where the shift writes (it would overwrite the target with content the agent chose, and
chmod it), where it reads (it would store a credentials file as the task's checkpoint, or show
the fleet's config as the task's attention note), and where the sandbox binds the task's HOME
(it would bind the shift's own HOME read-write)."""

from __future__ import annotations

import json
import os
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from worker import files
from worker.agent.sandbox import Sandbox, rules_for
from worker.config import load_config
from worker.models import Task
from worker.shift.progress import progress_marks, waiting_for
from worker.workspace.folder import Workspace, prepare

SECRET = "SECRET-credentials-of-the-fleet"


def task(**kw: object) -> Task:
    now = datetime.now(UTC)
    return Task.model_validate({"id": 7, "lane": "docs", "key": "issue:7", "state": "running", "run_at": now,
                                "created_at": now, "updated_at": now, "attempts": 2, **kw})


def lay_out(ws: Workspace, **kw: object) -> None:
    prepare(ws, task(**kw), instructions="Do the work.", lane_handoff=None, hidden_sets=[],
            shift_deadline=datetime.now(UTC) + timedelta(hours=1))


@pytest.fixture
def place(tmp_path: Path) -> tuple[Workspace, Path]:
    """A workspace after its first attempt, and a file of the fleet's beside it (outside it)."""
    ws = Workspace(tmp_path / "workspaces" / "docs" / "issue_7-abc")
    lay_out(ws)
    victim = tmp_path / "fleet-secret.txt"
    victim.write_text(SECRET)
    victim.chmod(0o644)
    return ws, victim


def test_a_link_where_the_shift_writes_is_replaced_never_written_through(place: tuple[Workspace, Path]) -> None:
    ws, victim = place
    # the names the shift writes, and the temporary names it used to write them under
    for name in ("task.json", "prompt.md", "handoff.md", "checkpoint.json", "README.md",
                 ".task.json.tmp", ".prompt.md.tmp", ".checkpoint.json.tmp"):
        (ws.fleet / name).unlink(missing_ok=True)
        (ws.fleet / name).symlink_to(victim)
    lay_out(ws, checkpoint={"step": 3})
    assert victim.read_text() == SECRET and oct(victim.stat().st_mode & 0o777) == "0o644"
    for name in ("task.json", "prompt.md", "handoff.md", "checkpoint.json", "README.md"):
        assert not (ws.fleet / name).is_symlink() and (ws.fleet / name).is_file(), name
    assert json.loads((ws.fleet / "task.json").read_text())["id"] == 7
    assert oct((ws.fleet / "task.json").stat().st_mode & 0o777) == "0o600"


def test_a_fleet_folder_replaced_by_a_link_is_made_again(place: tuple[Workspace, Path], tmp_path: Path) -> None:
    ws, _ = place
    elsewhere = tmp_path / "ssh"
    elsewhere.mkdir()
    (ws.root / ".fleet").rename(ws.root / ".old-fleet")
    (ws.root / ".fleet").symlink_to(elsewhere)
    lay_out(ws)
    assert list(elsewhere.iterdir()) == []
    assert ws.fleet.is_dir() and not ws.fleet.is_symlink() and (ws.fleet / "task.json").is_file()


def test_a_hidden_file_under_a_linked_folder_is_left_alone(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    elsewhere = tmp_path / "config-dir"
    elsewhere.mkdir()
    ws.root.mkdir(parents=True)
    (ws.root / ".claude").symlink_to(elsewhere)
    prepare(ws, task(), instructions="x", lane_handoff=None, hidden_sets=["claude"],
            shift_deadline=datetime.now(UTC))
    assert list(elsewhere.iterdir()) == []  # nothing written through the link
    assert (ws.fleet / "prompt.md").is_file()


def test_what_the_shift_reads_back_is_never_a_link_to_another_file(place: tuple[Workspace, Path]) -> None:
    ws, victim = place
    victim.write_text(json.dumps({"token": SECRET}))
    for name in ("checkpoint.json", "route.json", "attention.json"):
        (ws.fleet / name).unlink(missing_ok=True)
        (ws.fleet / name).symlink_to(victim)
    with pytest.raises(files.UnsafeFile, match="symbolic link"):
        ws.read_checkpoint()
    route = ws.read_route()
    assert route is not None and SECRET not in json.dumps(route) and "cannot be read" in route["error"], route
    note = waiting_for(ws)
    assert note is not None and SECRET not in note and "cannot be read" in note, note
    # a link's own time, never its target's (the target's would say the agent made progress)
    os.utime(victim, (1, 1))
    marks = progress_marks(ws.fleet / "no-log", ws)
    assert marks[2] is not None and marks[2] > 1


def test_a_fifo_is_never_waited_on(place: tuple[Workspace, Path]) -> None:
    ws, _ = place
    for name in ("checkpoint.json", "attention.json", "route.json"):
        (ws.fleet / name).unlink(missing_ok=True)
        os.mkfifo(ws.fleet / name)
    answers: list[object] = []

    def read() -> None:
        try:
            ws.read_checkpoint()
        except files.UnsafeFile as exc:
            answers.append(exc.strerror)
        answers.extend([waiting_for(ws), ws.read_route()])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the shift waits on a FIFO the agent made"
    assert "not a regular file" in str(answers[0]) and "not a regular file" in str(answers[1]), answers
    assert "error" in answers[2], answers  # type: ignore[operator]


def test_a_file_too_large_is_not_read(place: tuple[Workspace, Path]) -> None:
    ws, _ = place
    (ws.fleet / "checkpoint.json").write_text(json.dumps({"x": "y" * (files.READ_LIMIT + 10)}))
    with pytest.raises(files.UnsafeFile, match="more than"):
        ws.read_checkpoint()


def test_the_sandbox_never_binds_a_link_as_the_task_home(place: tuple[Workspace, Path], tmp_path: Path) -> None:
    ws, victim = place
    toml = tmp_path / "fleet.toml"
    toml.write_text(f'[fleet]\nworkspaces = "{tmp_path / "workspaces"}"\n\n[lanes.docs]\ncommand = ["true"]\n')
    cfg = load_config(toml, environ={})
    home = ws.root / ".fleet" / "home"
    home.mkdir(exist_ok=True)
    home.rename(ws.root / ".fleet" / "oldhome")
    real_home = Path(os.path.expanduser("~"))
    home.symlink_to(real_home)
    empty = ws.fleet / "empty"
    empty.unlink(missing_ok=True)
    empty.symlink_to(victim)
    origin = tmp_path / "origin-url.config"
    origin.write_text("x")
    sandbox = Sandbox(cfg, {}, guard_dir=None, binary="bwrap")
    argv = sandbox.argv(rules_for(cfg, "docs", None, "generic"), ws.root, secret=[origin])
    binds = [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a in ("--bind", "--ro-bind")]
    (home_src,) = [src for src, dest in binds if dest == str(real_home)]
    assert Path(home_src) == home and home.is_dir() and not home.is_symlink()
    assert victim.read_text() == SECRET  # .fleet/empty made anew, not truncated through the link
    assert empty.is_file() and not empty.is_symlink() and empty.read_bytes() == b""


def test_a_rollout_in_the_task_home_is_never_a_link_or_a_fifo(tmp_path: Path) -> None:
    """Codex's rollout, which the shift reads from the task's HOME after a run: a FIFO there would
    hold the shift forever, a link would have it read another file."""
    from worker.agent.adapters import Reading
    from worker.shift.shift import session_windows

    thread = "019a2d7a-41c4-78b1-b7cc-a45d62a89cd5"
    day = tmp_path / "ws" / ".fleet" / "home" / ".codex" / "sessions" / "2025" / "10" / "29"
    day.mkdir(parents=True)
    rollout = day / f"rollout-2025-10-29T00-59-38-{thread}.jsonl"
    sample = Path(__file__).parent / "agents" / "corpus" / "codex" / "rollout-token-count-resets-in-seconds-0.46.jsonl"
    elsewhere = tmp_path / "not-the-agents.jsonl"
    elsewhere.write_text(sample.read_text())
    rollout.symlink_to(elsewhere)
    run = Reading(agent="codex", session_id=thread)
    assert session_windows("codex", run, tmp_path / "ws", environ={"HOME": str(tmp_path)}) == []
    rollout.unlink()
    os.mkfifo(rollout)
    found: list[object] = []
    reader = threading.Thread(target=lambda: found.append(session_windows("codex", run, tmp_path / "ws", environ={})),
                              daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive() and found == [[]], "the shift waits on a FIFO in the task's HOME"
    rollout.unlink()
    rollout.write_text(sample.read_text())  # a real one is read
    assert len(session_windows("codex", run, tmp_path / "ws", environ={})) == 2
