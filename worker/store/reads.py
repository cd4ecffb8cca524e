"""The named read queries of ``worker/store/queries.sql``, and the typed reads made of them."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from worker.errors import InvalidInput, UnknownLane, UnknownTask
from worker.models import Event, LaneHandoff, Run, Task


def load_queries(path: Path) -> dict[str, str]:
    """Named queries of a ``.sql`` file: ``-- name: <name>`` and a description, then the statement."""
    out: dict[str, str] = {}
    name: str | None = None
    body: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("-- name:"):
            if name:
                out[name] = "\n".join(body).strip()
            name, body = line.split(":", 1)[1].strip(), []
        elif name and not line.startswith("--"):
            body.append(line)
    if name:
        out[name] = "\n".join(body).strip()
    return out


@functools.cache
def queries() -> dict[str, str]:
    """The named queries of ``worker/store/queries.sql``, loaded once."""
    return load_queries(Path(__file__).parent / "queries.sql")


#: before a task reference, it makes the rest a key: ``key:17`` (a key of only digits), ``key:key:x``
KEY_PREFIX = "key:"


class NamedReads:
    """The typed reads, on top of a store's ``query(name, **params)`` (the named queries of
    worker/store/queries.sql; the Supabase store answers the same names over REST)."""

    def query(self, name: str, **params: Any) -> list[dict[str, Any]]:
        raise NotImplementedError

    def get_task(self, ref: int | str, lane: str | None = None) -> Task:
        """A task by id (an int, or a string of digits) or by key. A string of digits is a key only
        when no task has that id; ``key:K`` is always the key K (``key:17``: the task of key
        ``17``, never task 17). Keys are per lane: ``lane`` names the lane of the key (the task in
        it, or the one that was in it and moved on: a routed task keeps its key in the lanes it
        left), and must be given when the key names tasks in several lanes. With ``lane``, an id of
        a task elsewhere is no match."""
        rows: list[dict[str, Any]] = []
        if isinstance(ref, str) and ref.startswith(KEY_PREFIX):
            key = ref[len(KEY_PREFIX):]
            return _one_task(self._by_key(key, lane), key, lane, what="key")
        if isinstance(ref, int) or ref.isdigit():
            rows = [r for r in self.query("task_by_id", id=int(ref)) if lane is None or r["lane"] == lane]
            if rows or isinstance(ref, int):
                return _one_task(rows, ref, lane)
        return _one_task(self._by_key(ref, lane), ref, lane)

    def _by_key(self, key: str, lane: str | None) -> list[dict[str, Any]]:
        """The task of ``key`` (in ``lane``, or in any lane while the key names one task)."""
        found = self.query("task_by_key", key=key)
        if lane is not None:
            return ([r for r in found if r["lane"] == lane]
                    or [r for r in found if any(isinstance(s, dict) and s.get("lane") == lane
                                                for s in r.get("stages") or [])])
        if len(found) > 1:
            lanes = ", ".join(sorted(str(r["lane"]) for r in found))
            raise InvalidInput(f"key {key!r} names {len(found)} tasks, in lanes {lanes}",
                               "keys are per lane: give the lane (--lane), or the task's id")
        return found

    def list_tasks(self, lane: str | None = None, state: str | None = None, limit: int = 50) -> list[Task]:
        return [Task.model_validate(r) for r in self.query("list_tasks", lane=lane, state=state, limit=limit)]

    def task_events(self, task: int) -> list[Event]:
        return [Event.model_validate(r) for r in self.query("task_events", id=task)]

    def task_runs(self, task: int) -> list[Run]:
        return [Run.model_validate(r) for r in self.query("task_runs", id=task)]

    def last_lane_handoff(self, lane: str) -> LaneHandoff | None:
        rows = self.query("last_lane_handoff", lane=lane)
        return LaneHandoff.model_validate(rows[0]) if rows else None

    def lane_names(self) -> list[str]:
        return [str(r["name"]) for r in self.query("list_lanes")]

    def check_lane(self, lane: str | None) -> None:
        """UnknownLane for a lane that fleet.lanes lacks (a filter on it would just show nothing)."""
        if lane is None:
            return
        names = self.lane_names()
        if lane not in names:
            raise UnknownLane(f"unknown lane {lane!r}", "known lanes: " + (", ".join(names) or "none"))

    def pools(self) -> list[dict[str, Any]]:
        """Every capacity pool: name, slots, throttled_until, throttle_note, throttled_by."""
        return self.query("list_pools")


def _one_task(rows: list[dict[str, Any]], ref: int | str, lane: str | None, what: str = "id or key") -> Task:
    if not rows:
        raise UnknownTask(f"no task with {what} {ref!r}" + (f" in lane {lane}" if lane is not None else ""))
    return Task.model_validate(rows[0])
