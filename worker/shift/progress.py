"""What a running agent shows its shift: progress for the stall detector, what it waits for, and
its spend against its task's budget (for a task's agent and a batch member's alike)."""

from __future__ import annotations

import json
from pathlib import Path

from worker.workspace.folder import Workspace

#: (the log's size, the mtime of ``.fleet/progress``, the mtime of the checkpoint)
Marks = tuple[int, float | None, float | None]


def progress_marks(log_path: Path, ws: Workspace) -> Marks:
    """What changes while an agent makes progress: its log grows, a hook touches
    ``.fleet/progress``, its checkpoint is written."""
    return _size(log_path), ws.mtime(ws.fleet / "progress"), ws.mtime(ws.checkpoint_file)


def waiting_for(ws: Workspace) -> str | None:
    """What an agent waits for, from ``.fleet/attention.json`` (a Notification hook's JSON, whose
    ``message`` says it, or plain text); None when there is no such file."""
    try:
        text = ws.read(ws.fleet / "attention.json").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:  # a link (to the fleet's config, say) or a FIFO: never read, but said
        return f".fleet/attention.json cannot be read: {exc.strerror}"
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500] or "waiting for input"
    if isinstance(data, dict):
        return str(data.get("message") or data.get("title") or "waiting for input")[:500]
    return str(data)[:500]


def over_budget(budget: tuple[float | None, int | None], cost: float, tokens: int) -> str | None:
    """Why ``cost`` and ``tokens`` spend the ``budget`` (max cost, max tokens), or None."""
    max_cost, max_tokens = budget
    if max_cost is not None and cost >= max_cost:
        return f"spent ${cost:.4f} of the task's ${max_cost:.4f} budget ({tokens:,} tokens)"
    if max_tokens is not None and tokens >= max_tokens:
        # an agent that reports tokens but no price (Codex, a scripted agent) spent no known cost
        priced = f" (${cost:.4f})" if cost > 0 else ""
        return f"spent {tokens:,} tokens of the task's {max_tokens:,} budget{priced}"
    return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0

