"""The named read queries of ``worker/store/queries.sql``, and the typed reads made of them."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from worker.errors import UnknownTask
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


class NamedReads:
    """The typed reads, on top of a store's ``query(name, **params)`` (the named queries of
    worker/store/queries.sql; the Supabase store answers the same names over REST)."""

    def query(self, name: str, **params: Any) -> list[dict[str, Any]]:
        raise NotImplementedError

    def get_task(self, ref: int | str) -> Task:
        """A task by id (an int, or a string of digits) or by key."""
        if isinstance(ref, int) or ref.isdigit():
            rows = self.query("task_by_id", id=int(ref))
            if not rows and isinstance(ref, str):
                rows = self.query("task_by_key", key=ref)
        else:
            rows = self.query("task_by_key", key=ref)
        if not rows:
            raise UnknownTask(f"no task with id or key {ref!r}")
        return Task.model_validate(rows[0])

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
