"""Git workspaces through real shifts: a lane with a `repo` runs each task in a
worktree of the host's mirror on branch fleet/<lane>/<key>, cut from `base` at its first claim;
the scripted agent makes real commits; later attempts on the host reuse the worktree; hand-offs
and completions push the branch; the reaper prunes the worktree of a reaped workspace."""

from __future__ import annotations

from pathlib import Path

import pytest
from fleetkit import Backend, Fleet, lane_defaults
from gitkit import bare_origin, git, log_of, mirror_held

from monitor.reconcile import reap_workspaces
from worker.workspace import git as gitws


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    return bare_origin(tmp_path)


@pytest.fixture
def git_fleet(backend: Backend, tmp_path: Path, origin: Path):
    made: list[Fleet] = []

    def make(**lane: object) -> Fleet:
        f = Fleet(backend, tmp_path, {"code": lane_defaults(**{"repo": str(origin), "base": "main", **lane})})
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def test_a_task_works_in_a_worktree_on_its_branch_and_the_branch_is_pushed(git_fleet, origin: Path) -> None:
    fleet = git_fleet()
    task = fleet.enqueue("code", "issue-7", {"steps": 2, "sleep": 0.02, "commit": "notes.txt"})

    fleet.run_shift("code")

    assert fleet.task(task)["state"] == "done"
    ws = fleet.workspace("code", "issue-7")
    assert git("rev-parse", "--abbrev-ref", "HEAD", cwd=ws) == "fleet/code/issue-7"
    assert log_of(origin, "fleet/code/issue-7") == [
        "issue-7: step 2/2 (attempt 1)", "issue-7: step 1/2 (attempt 1)", "initial"]
    assert log_of(origin, "main") == ["initial"], "the base is never written"
    # the hidden files are not part of the work
    assert git("status", "--porcelain", cwd=ws) == ""
    assert (ws / ".fleet" / "task.json").exists()


def test_a_retried_task_finds_its_earlier_commits_and_a_hand_off_pushes_them(git_fleet, origin: Path) -> None:
    fleet = git_fleet()
    retried = fleet.enqueue("code", "retried", {"steps": 1, "sleep": 0.02, "commit": "a.txt", "fail_attempts": 1})
    handed = fleet.enqueue("code", "handed", {"steps": 2, "sleep": 0.02, "commit": "b.txt", "steps_per_shift": 1})

    fleet.run_shift("code", max_tasks=2)  # retried: commits step 1 and fails; handed: one step, exit 75
    assert fleet.task(retried)["state"] == "queued" and fleet.task(handed)["state"] == "queued"
    assert log_of(origin, "fleet/code/handed")[0] == "handed: step 1/2 (attempt 1)", "pushed at the hand-off"
    fleet.run_shift("code", max_tasks=2)

    assert [fleet.task(i)["state"] for i in (retried, handed)] == ["done", "done"]
    # attempt 2 resumed from its checkpoint in the same worktree, on top of attempt 1's commit
    history = git("log", "--format=%s", cwd=fleet.workspace("code", "retried")).splitlines()
    assert history == ["retried: step 1/1 (attempt 1)", "initial"]
    assert log_of(origin, "fleet/code/retried") == history, "pushed when done"
    assert [r["attempt"] for r in fleet.runs(retried)] == [1, 2]
    assert log_of(origin, "fleet/code/handed")[:2] == ["handed: step 2/2 (attempt 2)", "handed: step 1/2 (attempt 1)"]


def test_an_unreachable_repo_fails_the_attempt_with_the_git_error(git_fleet, tmp_path: Path) -> None:
    fleet = git_fleet(repo=str(tmp_path / "no-such-repo.git"))
    task = fleet.enqueue("code", "t", {"steps": 1})
    fleet.run_shift("code", max_tasks=1)
    row = fleet.task(task)
    assert row["state"] == "queued" and row["failures"] == 1
    assert "could not prepare the git worktree" in row["last_error"] and "no-such-repo" in row["last_error"]
    assert fleet.runs(task)[0]["outcome"] == "failed"


def test_the_reaper_removes_a_finished_tasks_worktree_and_prunes_it(git_fleet, origin: Path) -> None:
    fleet = git_fleet(workspace_retention="1s")
    fleet.enqueue("code", "old", {"steps": 1, "sleep": 0.02, "commit": "c.txt"})
    fleet.run_shift("code")
    ws = fleet.workspace("code", "old")
    fleet.sql("update fleet.tasks set finished_at = now() - interval '1 hour' where key = 'old'")
    fleet.sql("update fleet.workspaces set last_used_at = now() - interval '1 hour'")

    actions = reap_workspaces(fleet.monitor_store, fleet.cfg)

    assert [a.action for a in actions] == ["workspace_reaped"]
    assert not ws.exists()
    mirror = gitws.Mirror(fleet.cfg.path(fleet.cfg.fleet.git_cache), str(origin))
    listed = git("--git-dir", str(mirror.path), "worktree", "list", "--porcelain")
    assert str(ws) not in listed, "the worktree is pruned from the mirror"
    assert log_of(origin, "fleet/code/old")[0] == "old: step 1/1 (attempt 1)", "the branch keeps the work"


def test_a_branch_that_diverged_from_origin_blocks_the_task_for_a_person(git_fleet, origin: Path,
                                                                         tmp_path: Path) -> None:
    """This host holds commits of the task it never pushed (its attempt failed), and meanwhile another
    host pushed other commits to the same branch: neither is thrown away; the task is blocked
    (branch-diverged, no attempt spent) with git's evidence, until a person reconciles and resumes."""
    fleet = git_fleet()
    task = fleet.enqueue("code", "t", {"steps": 1, "sleep": 0.02, "commit": "a.txt", "fail_attempts": 1})
    fleet.run_shift("code", max_tasks=1)  # commits step 1 on this host, fails, pushes nothing
    assert fleet.task(task)["state"] == "queued"
    other = tmp_path / "other-host"
    git("clone", "-q", str(origin), str(other))
    git("checkout", "-q", "-b", "fleet/code/t", cwd=other)
    (other / "theirs.txt").write_text("theirs\n")
    git("add", "theirs.txt", cwd=other)
    git("commit", "-q", "-m", "pushed by another host", cwd=other)
    git("push", "-q", "origin", "fleet/code/t", cwd=other)

    fleet.run_shift("code", max_tasks=1)

    row = fleet.task(task)
    assert (row["state"], row["block_reason"], row["failures"]) == ("blocked", "branch-diverged", 1)
    assert "diverged" in row["last_error"] and "reconcile by hand" in row["last_error"]
    assert log_of(origin, "fleet/code/t") == ["pushed by another host", "initial"], "origin's work is kept"
    mine = git("log", "--format=%s", cwd=fleet.workspace("code", "t")).splitlines()
    assert mine == ["t: step 1/1 (attempt 1)", "initial"], "and so is this host's"
    assert fleet.runs(task)[-1]["outcome"] == "blocked"


def test_a_long_wait_on_the_mirror_keeps_every_lease_the_shift_holds(git_fleet) -> None:
    """Another shift on the host holds the mirror (a long fetch) for two leases while this shift
    prepares a task's worktree: a thread heartbeats meanwhile, so the running agent is not fenced
    and the claimed task is not released (the main loop, parked in git, heartbeat neither)."""
    import threading
    import time

    from fleetkit import wait_for

    fleet = git_fleet(lease_seconds=3, max_running=2)  # a heartbeat every second
    running = fleet.enqueue("code", "running", {"steps": 120, "sleep": 0.1})
    shift = fleet.shift("code", slots=2, max_tasks=2, max_seconds=60)
    thread = threading.Thread(target=shift.run, daemon=True)
    thread.start()
    wait_for("the first agent to run", lambda: running in shift.jobs, timeout=30)
    with mirror_held(shift.mirror()):
        waiting = fleet.enqueue("code", "waiting", {"steps": 1, "sleep": 0.02})
        wait_for("the second task to be claimed", lambda: fleet.task(waiting)["state"] == "running", timeout=30)
        time.sleep(7)  # two leases and more, the main loop waiting on the lock
        assert fleet.task(waiting)["state"] == "running" and running in shift.jobs
    thread.join(60)
    assert not thread.is_alive()
    for task in (running, waiting):
        t = fleet.task(task)
        assert (t["state"], t["attempts"], t["handoffs"], t["evaporations"]) == ("done", 1, 0, 0), t["key"]
