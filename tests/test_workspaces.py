"""Task workspaces: the ``fleet.workspaces`` record a shift keeps per task and
host, reuse on the same host, the monitor's reaper (finished tasks past the lane's retention, never
a live one, never outside the workspaces root) and ``fleet workspaces`` — through real shifts
running the scripted agent, on both back-ends (conftest ``backend``). (The fence of
fleet.touch_workspace: tests/sql/test_workspaces.py.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from fleetkit import Backend, Fleet, lane_defaults

from monitor.reconcile import monitor_pass, reap_workspaces
from worker.workspace.disk import REAPING, UnsafePath, disk_use, remove_workspace, workspace_path

HOST = "ws-test-host"
QUICK = {"steps": 1, "sleep": 0.02}


@pytest.fixture
def fleet_of(backend: Backend, tmp_path: Path):
    made: list[Fleet] = []

    def make(**lane: Any) -> Fleet:
        f = Fleet(backend, tmp_path, {"work": lane_defaults(**lane)})
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def age(f: Fleet, task_id: int, seconds: float) -> None:
    """Move a task's finish and its workspaces' last use ``seconds`` into the past."""
    f.sql("update fleet.tasks set finished_at = finished_at - make_interval(secs => %s) "
          "where id = %s and finished_at is not null", (seconds, task_id))
    f.sql("update fleet.workspaces set last_used_at = last_used_at - make_interval(secs => %s), "
          "created_at = created_at - make_interval(secs => %s) where task_id = %s", (seconds, seconds, task_id))


def reaped(actions: list[Any]) -> dict[int | None, dict[str, Any]]:
    return {a.task_id: a.detail for a in actions if a.action == "workspace_reaped"}


# ------------------------------------------------------------------------------------------------
# the record


def test_a_shift_records_its_workspace_with_its_size_and_a_finished_one_is_reaped_after_retention(
        fleet_of) -> None:
    f = fleet_of(workspace_retention="1h")
    task_id = f.enqueue("work", "issue:1", QUICK)
    assert f.run_shift("work", host=HOST).outcomes == {"done": 1}
    ws = f.workspace("work", "issue:1")
    (ws / "build.bin").write_bytes(os.urandom(64 * 1024))  # what an agent leaves behind

    [row] = f.workspace_rows(task_id)
    assert (row["host"], row["path"], row["lane"], row["state"]) == (HOST, str(ws), "work", "active")
    assert row["bytes"] > 0 and row["reaped_at"] is None
    assert f.sql("select (config ->> 'workspace_retention_seconds')::float as s from fleet.lanes "
                 "where name = 'work'")[0]["s"] == 3600

    # finished, but not for the lane's retention yet: kept
    age(f, task_id, 1800)
    assert reaped(monitor_pass(f.monitor_store, f.cfg, host=HOST)) == {}
    assert ws.is_dir()
    # past the retention: another host's monitor leaves it alone (it is not on that host's disk)
    age(f, task_id, 3600)
    assert reaped(monitor_pass(f.monitor_store, f.cfg, host="some-other-host")) == {}
    assert ws.is_dir()
    # this host's monitor removes it, and says how much it freed
    usage = disk_use(ws)
    detail = reaped(monitor_pass(f.monitor_store, f.cfg, host=HOST))[task_id]
    assert not ws.exists()
    assert detail["path"] == str(ws) and detail["bytes_freed"] >= 64 * 1024
    assert detail["bytes_freed"] == usage.bytes and detail["left"] == 0
    assert list((f.workspaces / REAPING).iterdir()) == []  # nothing parked half-deleted
    [row] = f.workspace_rows(task_id)
    assert row["state"] == "reaped" and row["reaped_at"] is not None and row["bytes_freed"] == usage.bytes
    assert f.event_kinds(task_id).count("workspace_reaped") == 1
    # reaped once: a later pass has nothing to do
    assert reaped(monitor_pass(f.monitor_store, f.cfg, host=HOST)) == {}


def test_a_handed_off_task_reuses_its_workspace_on_the_same_host(fleet_of) -> None:
    f = fleet_of()
    task_id = f.enqueue("work", "long", {"steps": 2, "steps_per_shift": 1, "sleep": 0.05})
    assert f.run_shift("work", host=HOST, max_tasks=1).outcomes == {"handed_off": 1}
    [first] = f.workspace_rows(task_id)
    ws = f.workspace("work", "long")
    (ws / "notes.txt").write_text("work in progress")  # the agent's work, kept for the next shift

    assert f.run_shift("work", host=HOST).outcomes == {"done": 1}
    [second] = f.workspace_rows(task_id)  # the same row: one workspace per task, host and path
    assert second["id"] == first["id"] and second["path"] == first["path"] == str(ws)
    assert second["created_at"] == first["created_at"]
    assert second["last_used_at"] > first["last_used_at"]
    assert (ws / "notes.txt").read_text() == "work in progress"
    assert f.task(task_id)["attempts"] == 2

    # a run of the same task on another host is another workspace (that host's disk)
    f.sql("update fleet.tasks set state = 'dead', finished_at = now(), dead_reason = 'test' where id = %s",
          (task_id,))
    f.monitor_store.retry(task_id)
    assert f.run_shift("work", host="another-host").outcomes == {"done": 1}
    assert [(r["host"], r["id"] == first["id"]) for r in f.workspace_rows(task_id)] == [
        (HOST, True), ("another-host", False)]


def test_a_failed_attempt_retried_on_the_same_host_reuses_the_row(fleet_of) -> None:
    f = fleet_of()
    task_id = f.enqueue("work", "flaky", {**QUICK, "fail_attempts": 1})
    summary = f.run_shift("work", host=HOST)
    assert summary.outcomes == {"failed": 1, "done": 1}
    [row] = f.workspace_rows(task_id)
    runs = f.runs(task_id)
    # made by the first attempt (after its claim), used last by the second
    assert len(runs) == 2 and runs[0]["started_at"] <= row["created_at"] <= runs[1]["started_at"]
    assert row["last_used_at"] >= runs[1]["started_at"]


# ------------------------------------------------------------------------------------------------
# one directory per task


def test_keys_that_make_the_same_slug_get_a_directory_each(fleet_of) -> None:
    f = fleet_of()
    spaced = f.enqueue("work", "coll a", QUICK)
    underscored = f.enqueue("work", "coll_a", QUICK)
    assert f.run_shift("work", host=HOST).outcomes == {"done": 2}
    [a], [b] = f.workspace_rows(spaced), f.workspace_rows(underscored)
    assert a["path"] != b["path"]
    for row, key in ((a, "coll a"), (b, "coll_a")):
        path = Path(row["path"])
        assert path == f.workspace("work", key) and path.parent == f.workspaces / "work"
        assert path.name.startswith("coll_a-") and len(path.name) == len("coll_a-") + 8  # slug-<8 hex>
        assert json.loads((path / ".fleet" / "task.json").read_text())["key"] == key


def _claim_with_legacy_workspace(f: Any, session: Any, key: str) -> tuple[int, Any, Path]:
    """Claim the task of ``key`` and record its workspace as an older lanefleet named it
    (``<lane>/<key made safe>``, no hash), with a file of the agent's in it."""
    from worker.workspace.folder import safe_name

    [task] = f.store.claim(session, 1)
    assert task.key == key and task.lease_token is not None
    legacy = f.workspaces / "work" / safe_name(key)
    (legacy / ".fleet").mkdir(parents=True, exist_ok=True)
    (legacy / f"work-of-{task.id}.txt").write_text("work in progress")
    f.store.touch_workspace(task.id, task.lease_token, HOST, str(legacy), disk_use(legacy).bytes)
    return task.id, task.lease_token, legacy


def test_a_task_whose_workspace_has_the_older_name_goes_on_working_in_it(fleet_of) -> None:
    f = fleet_of(lease_seconds=600)
    task_id = f.enqueue("work", "issue:7", QUICK)
    session = f.store.open_session("work", HOST, os.getpid(), None, 600)
    _, token, legacy = _claim_with_legacy_workspace(f, session, "issue:7")
    assert f.store.hand_off(task_id, token, {"reason": "the shift of an older lanefleet ended"}) == "queued"
    f.store.close_session(session, "test", {})

    # the next shift (this lanefleet) resolves the directory from the row, not from the key
    assert f.run_shift("work", host=HOST).outcomes == {"done": 1}
    [row] = f.workspace_rows(task_id)
    assert row["path"] == str(legacy) and row["last_used_at"] > row["created_at"]
    assert (legacy / f"work-of-{task_id}.txt").read_text() == "work in progress"
    assert (legacy / ".fleet" / "prompt.md").exists()  # the attempt ran there
    assert not f.workspace("work", "issue:7").exists()  # and made no second directory


def test_the_reaper_never_removes_a_directory_another_kept_workspace_names(fleet_of) -> None:
    f = fleet_of(workspace_retention="1s", lease_seconds=600)
    # two tasks that the older naming put in one directory (`coll a` and `coll_a` → coll_a)
    finished = f.enqueue("work", "coll a", QUICK, priority=10)
    running = f.enqueue("work", "coll_a", QUICK)
    session = f.store.open_session("work", HOST, os.getpid(), None, 600)
    _, finished_token, shared = _claim_with_legacy_workspace(f, session, "coll a")
    _, running_token, shared_too = _claim_with_legacy_workspace(f, session, "coll_a")
    assert shared == shared_too
    f.store.complete(finished, finished_token, None)
    age(f, finished, 3600)  # long past the lane's retention
    [finished_row] = f.workspace_rows(finished)

    # the running task's row names the directory too: not listed, refused, and left on disk
    assert f.monitor_store.workspaces_to_reap(HOST) == []
    assert f.monitor_store.workspace_reaped(finished_row["id"], 1) is False
    assert reaped(monitor_pass(f.monitor_store, f.cfg, host=HOST)) == {}
    assert (shared / f"work-of-{running}.txt").exists()
    assert [r["state"] for r in f.workspace_rows(finished)] == ["active"]
    [usage] = [u for u in f.monitor_store.workspace_usage() if u["host"] == HOST]
    assert (usage["workspaces"], usage["live"], usage["reapable"]) == (2, 1, 0)

    # once neither task keeps it, it goes (once: the second row finds it gone)
    f.store.complete(running, running_token, None)
    age(f, running, 3600)
    assert set(reaped(monitor_pass(f.monitor_store, f.cfg, host=HOST))) == {finished, running}
    assert not shared.exists()
    assert [r["state"] for t in (finished, running) for r in f.workspace_rows(t)] == ["reaped", "reaped"]


# ------------------------------------------------------------------------------------------------
# never a live task's workspace


def test_a_live_tasks_workspace_is_never_reaped_even_past_retention(fleet_of) -> None:
    f = fleet_of(workspace_retention="1s", lease_seconds=600)
    # queued again after a failed attempt (a real shift)
    queued = f.enqueue("work", "fails-once", {**QUICK, "fail_attempts": 1})
    assert f.run_shift("work", host=HOST, max_tasks=1).outcomes == {"failed": 1}
    assert f.task(queued)["state"] == "queued"
    # running, and blocked: claimed by a session of this host, the workspace made as a shift makes it
    session = f.store.open_session("work", HOST, os.getpid(), None, 600)
    running = f.enqueue("work", "running", QUICK, priority=10)
    blocked = f.enqueue("work", "blocked", QUICK, priority=10)
    claimed = {t.id: t for t in f.store.claim(session, 2)}
    assert set(claimed) == {running, blocked}
    for tid, key in ((running, "running"), (blocked, "blocked")):
        ws = f.workspace("work", key)
        (ws / ".fleet").mkdir(parents=True)
        (ws / "work.txt").write_text(key)
        token = claimed[tid].lease_token
        assert token is not None
        f.store.touch_workspace(tid, token, HOST, str(ws), disk_use(ws).bytes)
    blocked_token = claimed[blocked].lease_token
    assert blocked_token is not None
    assert f.store.block(blocked, blocked_token, "budget", "spent") == "blocked"
    # and a finished one beside them, which the same pass must reap
    done = f.enqueue("work", "done", QUICK)
    f.sql("update fleet.tasks set priority = 1000 where id = %s", (done,))
    claimed_done = f.store.claim(session, 1)
    assert [t.id for t in claimed_done] == [done]
    done_ws = f.workspace("work", "done")
    done_ws.mkdir(parents=True)
    done_token = claimed_done[0].lease_token
    assert done_token is not None
    f.store.touch_workspace(done, done_token, HOST, str(done_ws), 1)
    f.store.complete(done, done_token, None)

    live = {queued: "fails-once", running: "running", blocked: "blocked"}
    for tid in [*live, done]:
        age(f, tid, 30 * 86400)  # old, long past the 1 s retention
    assert {f.task(t)["state"] for t in live} == {"queued", "running", "blocked"}
    assert [r["task_id"] for r in f.monitor_store.workspaces_to_reap(HOST)] == [done]

    actions = monitor_pass(f.monitor_store, f.cfg, host=HOST)
    assert set(reaped(actions)) == {done} and not done_ws.exists()
    for tid, key in live.items():
        assert f.workspace("work", key).is_dir(), key
        assert [r["state"] for r in f.workspace_rows(tid)] == ["active"], key
    if f.backend.rest:  # a worker key records workspaces; reaping them is the monitor's (an operator's)
        from worker.store.supabase import AccessDenied

        with pytest.raises(AccessDenied):
            f.store.workspaces_to_reap(HOST)


class RetriedAfterListing:
    """A store whose listing of workspaces to reap is followed at once by an operator's retry of
    the task: the race between ``workspaces_to_reap`` and ``workspace_reaped``."""

    def __init__(self, store: Any, task_id: int) -> None:
        self.store, self.task_id = store, task_id

    def workspaces_to_reap(self, host: str, limit: int = 100) -> list[dict[str, Any]]:
        rows = self.store.workspaces_to_reap(host, limit)
        assert [r["task_id"] for r in rows] == [self.task_id]
        assert self.store.retry(self.task_id) == "queued"
        return rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_task_retried_between_listing_and_reaping_keeps_its_workspace(fleet_of) -> None:
    f = fleet_of(max_attempts=1, workspace_retention="1m")
    task_id = f.enqueue("work", "dead-letter", {**QUICK, "mode": "fail"})
    assert f.run_shift("work", host=HOST).outcomes == {"failed": 1}
    assert f.task(task_id)["state"] == "dead"
    ws = f.workspace("work", "dead-letter")
    age(f, task_id, 3600)

    actions = reap_workspaces(RetriedAfterListing(f.monitor_store, task_id), f.cfg, HOST)  # type: ignore[arg-type]
    assert reaped(actions) == {}
    assert ws.is_dir() and (ws / ".fleet" / "prompt.md").exists()
    assert [r["state"] for r in f.workspace_rows(task_id)] == ["active"]
    assert "workspace_reaped" not in f.event_kinds(task_id)
    # the database said no under the task's lock, so asking again says no too
    [row] = f.workspace_rows(task_id)
    assert f.monitor_store.workspace_reaped(row["id"], 1) is False
    # the retried task runs in the workspace it had
    assert f.run_shift("work", host=HOST).outcomes == {"failed": 1}
    assert [r["id"] for r in f.workspace_rows(task_id)] == [row["id"]]


# ------------------------------------------------------------------------------------------------
# never outside the workspaces root


def test_the_reaper_refuses_a_recorded_path_outside_the_workspaces_root(fleet_of, tmp_path: Path) -> None:
    f = fleet_of(workspace_retention="1s")
    task_id = f.enqueue("work", "moved", QUICK)
    assert f.run_shift("work", host=HOST).outcomes == {"done": 1}
    outside = tmp_path / "precious" / "work" / "moved"
    outside.mkdir(parents=True)
    (outside / "data.txt").write_text("keep me")
    f.sql("update fleet.workspaces set path = %s where task_id = %s", (str(outside), task_id))
    age(f, task_id, 3600)

    actions = monitor_pass(f.monitor_store, f.cfg, host=HOST)
    refused = [a for a in actions if a.action == "workspace_refused"]
    assert [a.task_id for a in refused] == [task_id] and "not under the workspaces root" in refused[0].detail["error"]
    assert (outside / "data.txt").read_text() == "keep me"
    assert [r["state"] for r in f.workspace_rows(task_id)] == ["active"]


def _tree(root: Path) -> Path:
    ws = root / "docs" / "issue_1"
    (ws / "src" / "deep").mkdir(parents=True)
    (ws / "src" / "deep" / "a.py").write_text("x" * 5000)
    (ws / "README.md").write_text("hello")
    return ws


def test_the_remover_refuses_any_path_that_is_not_a_workspace_under_the_root(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    ws = _tree(root)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("keep")
    (root / "docs" / "logs").mkdir()
    for bad in [precious, tmp_path / "precious" / "x", root, root / "docs", root / "docs" / "logs",
                root / "docs" / "issue_1" / "src", root / ".reaping" / "x", root / "docs" / ".." / ".." / "precious",
                Path("docs/issue_1")]:
        with pytest.raises(UnsafePath):
            remove_workspace(root, bad)
    # a lane folder that is a symbolic link out of the root leads nowhere
    (root / "evil").symlink_to(precious.parent)
    with pytest.raises(UnsafePath):
        remove_workspace(root, root / "evil" / "precious")
    assert (precious / "keep.txt").read_text() == "keep" and ws.is_dir() and (root / "docs" / "logs").is_dir()
    assert workspace_path(root, ws)[1:] == ("docs", "issue_1")


def test_the_remover_never_follows_a_symbolic_link_out_of_the_workspace(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    ws = _tree(root)
    precious = tmp_path / "precious"
    (precious / "sub").mkdir(parents=True)
    (precious / "keep.txt").write_text("keep")
    (precious / "sub" / "keep2.txt").write_text("keep")
    (ws / "link-to-dir").symlink_to(precious)
    (ws / "src" / "link-to-file").symlink_to(precious / "keep.txt")
    ro = ws / "readonly"
    ro.mkdir()
    (ro / "f").write_text("f")
    ro.chmod(0o500)  # a Go module cache: read-only directories
    expected = disk_use(ws)
    assert expected.complete and expected.bytes > 5000

    removal = remove_workspace(root, ws)
    assert removal.existed and removal.left == 0 and removal.bytes_freed == expected.bytes
    assert not ws.exists() and (root / "docs").is_dir()
    assert (precious / "keep.txt").read_text() == "keep" and (precious / "sub" / "keep2.txt").exists()
    assert list((root / REAPING).iterdir()) == []
    # gone already: nothing to free
    assert remove_workspace(root, ws) == type(removal)(0, 0, False)
    # a symbolic link where the workspace was: the link goes, its target stays
    ws.symlink_to(precious)
    assert remove_workspace(root, ws).bytes_freed == 0
    assert not ws.is_symlink() and (precious / "keep.txt").exists()


def test_disk_use_is_bounded_and_skips_links(tmp_path: Path) -> None:
    ws = _tree(tmp_path / "ws")
    big = tmp_path / "big"
    big.mkdir()
    (big / "blob").write_bytes(os.urandom(1 << 20))
    (ws / "link").symlink_to(big)
    use = disk_use(ws)
    assert use.complete and 5000 <= use.bytes < (1 << 20)  # the linked megabyte is not counted
    (ws / "hard").hardlink_to(ws / "README.md")
    assert disk_use(ws).bytes == use.bytes  # a hard link counts once
    partial = disk_use(ws, max_entries=2)
    assert not partial.complete and partial.bytes < use.bytes
    assert disk_use(tmp_path / "missing") == type(use)(0, 0, True)


# ------------------------------------------------------------------------------------------------
# `fleet workspaces`


def test_fleet_workspaces_reports_disk_use_per_lane_and_host(fleet_of) -> None:
    f = fleet_of(workspace_retention="1h")
    done = f.enqueue("work", "a", QUICK)
    f.enqueue("work", "b", QUICK)
    assert f.run_shift("work", host=HOST).outcomes == {"done": 2}
    age(f, done, 7200)
    out = f.cli("workspaces", "--json")
    assert out.returncode == 0, out.stderr
    [row] = json.loads(out.stdout)
    expected = sum(r["bytes"] for r in f.sql("select bytes from fleet.workspaces"))
    assert (row["lane"], row["host"], row["workspaces"], row["live"], row["reapable"]) == ("work", HOST, 2, 0, 1)
    assert row["bytes"] == expected > 0 and 0 < row["reapable_bytes"] < expected
    table = f.cli("workspaces", "--lane", "work", env={**f.env("operator"), "COLUMNS": "200"})
    assert table.returncode == 0 and HOST in table.stdout and "2 workspace(s)" in table.stdout
    assert json.loads(f.cli("workspaces", "--json", "--host", "nowhere").stdout) == []
