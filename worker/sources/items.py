"""What a tracker's item becomes: its task's lane, key, title, payload, priority, tier and profile
(the selector of fleet.toml's ``[sources.<name>]``), as ``fleet.source_sync`` takes it."""

from __future__ import annotations

from typing import Any

from worker.config import SourceConfig
from worker.sources.tracker import Item

#: the most of an issue's body a task's payload carries (the rest stays in the tracker: its URL)
MAX_BODY = 60_000


def item_ref(source: SourceConfig, number: int) -> str:
    return f"{source.repository}#{number}"


def task_key(source: SourceConfig, number: int) -> str:
    """A task's key: ``github:<owner>/<repo>#<number>``."""
    return f"{source.kind}:{item_ref(source, number)}"


def ref_number(ref: str) -> int:
    return int(ref.rsplit("#", 1)[1])


def lane_of(source: SourceConfig, item: Item) -> str | None:
    """The lane the item's labels select (the first of the source's labels, in the config's order,
    that the item has), or None."""
    return next((lane for label, lane in source.labels.items() if label in item.labels), None)


def selected(source: SourceConfig, item: Item) -> bool:
    """Whether the item is work of the source: an issue (not a pull request) with one of its labels,
    of its assignee and milestone when it names them."""
    if item.is_pull or lane_of(source, item) is None:
        return False
    if source.assignee is not None:
        if source.assignee == "none" and item.assignees:
            return False
        if source.assignee != "none" and source.assignee not in item.assignees:
            return False
    if source.milestone is not None and source.milestone not in (item.milestone, str(item.milestone_number)):
        return False
    return True


def sync_entry(name: str, source: SourceConfig, item: Item) -> dict[str, Any]:
    """The item as ``fleet.source_sync`` takes it."""
    lane = lane_of(source, item)
    entry: dict[str, Any] = {
        "ref": item_ref(source, item.number), "key": task_key(source, item.number),
        "open": item.open, "selected": selected(source, item), "url": item.url,
        "updated_at": item.updated_at.isoformat(), "title": item.title[:500],
        "payload": {"source": name, "repository": source.repository, "number": item.number, "url": item.url,
                    "title": item.title, "body": item.body[:MAX_BODY], "labels": list(item.labels)},
        "priority": max((source.priority[lb] for lb in item.labels if lb in source.priority), default=0),
        "tier": next((source.tier[lb] for lb in item.labels if lb in source.tier), None),
        "profile": next((source.profile[lb] for lb in item.labels if lb in source.profile), None),
    }
    if lane is not None:
        entry["lane"] = lane
    return entry
