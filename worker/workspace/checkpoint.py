"""``fleet checkpoint``, an agent's call inside its work: write a checkpoint into the task's
workspace; the shift stores it at its next heartbeat. Imports little (no pydantic, no driver), so
the command starts fast (``bench/startup.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from worker.errors import InvalidInput
from worker.files import write_atomic


def save_checkpoint(workspace: Path | None, data: str) -> None:
    """``fleet checkpoint``, an agent's call: write ``data`` (a JSON value, or ``@file``) as the
    checkpoint of the task ``workspace``; the shift stores it at its next heartbeat."""
    if workspace is None:
        raise InvalidInput("no workspace: run this inside a task (FLEET_WORKSPACE) or pass --workspace")
    text = Path(data[1:]).read_text() if data.startswith("@") else data
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"--data is not valid JSON: {exc.msg}") from None
    folder = workspace / ".fleet"
    if not folder.is_dir():
        raise InvalidInput(f"{workspace} is not a task workspace (no .fleet/ folder)")
    write_atomic(workspace, folder / "checkpoint.json", json.dumps(value))
