"""The workspaces group (migrations/sources/12_workspaces.sql): fleet.touch_workspace records a task's
workspace only under its lease, through the store on both back-ends (conftest ``backend``). (The
record and the reaper, fleet.workspaces_to_reap and fleet.workspace_reaped, through real shifts and
the monitor: tests/test_workspaces.py.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fleetkit import Backend, Fleet, lane_defaults

from worker.errors import LeaseLost

HOST = "ws-test-host"
QUICK = {"steps": 1, "sleep": 0.02}


def test_touch_workspace_is_fenced_by_the_lease(backend: Backend, tmp_path: Path) -> None:
    f = Fleet(backend, tmp_path, {"work": lane_defaults(lease_seconds=600)})
    try:
        task_id = f.enqueue("work", "fenced", QUICK)
        session = f.store.open_session("work", HOST, os.getpid(), None, 600)
        [task] = f.store.claim(session, 1)
        assert task.lease_token is not None
        wid = f.store.touch_workspace(task_id, task.lease_token, HOST, str(tmp_path / "ws" / "work" / "fenced"), 10)
        assert f.store.touch_workspace(task_id, task.lease_token, HOST, str(tmp_path / "ws" / "work" / "fenced"),
                                       None) == wid
        assert f.workspace_rows(task_id)[0]["bytes"] == 10  # None keeps the last size
        f.store.complete(task_id, task.lease_token, None)
        with pytest.raises(LeaseLost):
            f.store.touch_workspace(task_id, task.lease_token, HOST, "/elsewhere", 1)
        assert [r["path"] for r in f.workspace_rows(task_id)] == [str(tmp_path / "ws" / "work" / "fenced")]
    finally:
        f.close()


def test_task_workspace_names_the_recorded_directory_of_the_task_on_the_host(backend: Backend, tmp_path: Path) -> None:
    f = Fleet(backend, tmp_path, {"work": lane_defaults(lease_seconds=600)})
    try:
        task_id = f.enqueue("work", "where", QUICK)
        session = f.store.open_session("work", HOST, os.getpid(), None, 600)
        [task] = f.store.claim(session, 1)
        token = task.lease_token
        assert token is not None
        assert f.store.task_workspace(task_id, token, HOST) is None  # nothing recorded yet
        old, new = str(tmp_path / "ws" / "work" / "where"), str(tmp_path / "ws" / "work" / "where-1a2b3c4d")
        f.store.touch_workspace(task_id, token, HOST, old, 1)
        assert f.store.task_workspace(task_id, token, HOST) == old
        assert f.store.task_workspace(task_id, token, "another-host") is None  # another host's disk
        # the row used last wins; a reaped one and one of a lane the task left never count
        f.store.touch_workspace(task_id, token, HOST, new, 1)
        assert f.store.task_workspace(task_id, token, HOST) == new
        f.sql("update fleet.workspaces set state = 'reaped', reaped_at = now() where path = %s", (new,))
        assert f.store.task_workspace(task_id, token, HOST) == old
        f.sql("update fleet.workspaces set lane = 'elsewhere' where path = %s", (old,))
        assert f.store.task_workspace(task_id, token, HOST) is None
        f.store.complete(task_id, token, None)
        with pytest.raises(LeaseLost):
            f.store.task_workspace(task_id, token, HOST)
    finally:
        f.close()
