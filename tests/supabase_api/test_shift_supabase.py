"""The shift and the monitor on the supabase back-end: what only a fleet key can show.

tests/test_shift.py and tests/test_monitor.py run every scenario on both back-ends (the ``backend``
fixture of tests/conftest.py, the fleet of tests/fleetkit.py: shifts with a worker key scoped to the
test's lanes, the monitor with an operator key). Here: what a key for other lanes, a worker key's
monitor pass and the CLI with an operator key do, through supabase-py → nginx → PostgREST.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
from fleetkit import Backend, Fleet, alive, lane_defaults, pids_using

from monitor.reconcile import host_checks
from worker.dev.devstack import DevStack
from worker.errors import LaneForbidden
from worker.store.supabase import AccessDenied

QUICK = {"steps": 2, "sleep": 0.05}


@pytest.fixture
def fleet_of(stack: DevStack, tmp_path: Path):
    made: list[Fleet] = []

    def make(lanes: dict[str, dict[str, Any]] | None = None, key_lanes: list[str] | None = None) -> Fleet:
        f = Fleet(Backend("supabase", stack.db_url, stack), tmp_path, lanes or {"work": lane_defaults()},
                  key_lanes=key_lanes)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()
        for pid in pids_using(tmp_path):  # an agent a failed test left behind, found by its folder
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# -- routes: a key's lanes


def test_a_key_for_one_lane_cannot_route_out_of_it(fleet_of) -> None:
    """A bugfix key (no review) finishes the stage but cannot route it: the route is a failed attempt."""
    f = fleet_of({"bugfix": lane_defaults(), "review": lane_defaults(accepts_from=["bugfix"])},
                 key_lanes=["bugfix"])
    task_id = f.enqueue("bugfix", "issue:8", {"steps": 1, "sleep": 0.01, "route": "review"}, max_attempts=1)
    assert f.run_shift("bugfix").outcomes == {"failed": 1}
    t = f.task(task_id)
    assert (t["lane"], t["state"]) == ("bugfix", "dead")
    assert "not allowed for this key" in t["last_error"]


# -- a shift with a key for another lane


def test_fleet_shift_with_a_key_for_another_lane_refuses_to_start(fleet_of) -> None:
    f = fleet_of({"work": lane_defaults(), "other": lane_defaults()}, key_lanes=["other"])
    f.direct.enqueue("work", "w:1", dict(QUICK))
    before = f.sql("select count(*) as n from fleet.sessions")[0]["n"]
    done = f.cli("shift", "--lane", "work", "--once", "--max-seconds", "10", env=f.env("worker"))
    assert done.returncode == 1, done.stderr
    assert "lane 'work' is not allowed for this key" in done.stderr
    assert f.sql("select count(*) as n from fleet.sessions")[0]["n"] == before == 0
    with pytest.raises(LaneForbidden):
        f.store.open_session("work", "h", 1, None, 60)


# -- the monitor with a worker key: its lanes on this host only


def test_a_worker_key_monitor_repairs_its_lanes_on_this_host_but_not_the_fleet(fleet_of) -> None:
    f = fleet_of({"work": lane_defaults(lease_seconds=60)})
    (task_id,) = [f.enqueue("work", "t:1", {})]
    gone = f.direct.open_session("work", socket.gethostname(), 999_999, None, 600)  # no such pid
    f.direct.claim(gone, 1)
    actions = host_checks(f.store)
    assert [(a.action, a.task_id) for a in actions] == [("session_lost", None), ("released", task_id)]
    with pytest.raises(AccessDenied):  # a fleet-wide pass is an operator's
        f.store.reconcile()


# -- the CLI


def test_fleet_commands_over_rest(fleet_of) -> None:
    """The CLI with store = "supabase": enqueue and show with an operator key, no database URL."""
    f = fleet_of()
    out = f.cli("enqueue", "work", "--key", "cli:1", "--payload", '{"a": 1}', "--run-at", "+1h", "--json")
    assert out.returncode == 0, out.stderr
    task_id = json.loads(out.stdout)["id"]
    t = f.task(task_id)
    assert t["payload"] == {"a": 1} and t["run_at"] > t["created_at"]
    shown = f.cli("show", "cli:1", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["task"]["id"] == task_id
    listed = f.cli("tasks", "--json")
    assert [t["key"] for t in json.loads(listed.stdout)] == ["cli:1"]
