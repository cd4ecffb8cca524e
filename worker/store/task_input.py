"""Task input from the command line and from files: ``--payload``, ``--run-at``, ``--state``, and
the JSON Lines task files of ``fleet enqueue --from``, each checked before anything is queued."""

from __future__ import annotations

import json
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from worker.errors import FleetError, InvalidInput
from worker.models import TASK_STATES
from worker.store.protocol import Store


def check_state(state: str | None) -> None:
    """``--state``: a task state, or None for every state."""
    if state is not None and state not in TASK_STATES:
        raise InvalidInput(f"--state {state!r} is not a task state ({', '.join(TASK_STATES)})")


_RELATIVE = re.compile(r"^\+(\d+(?:\.\d+)?)(s|m|h|d)?$")


def parse_payload(value: str | None) -> dict[str, Any]:
    """``--payload``: inline JSON, or ``@path`` to a JSON file. Must be an object."""
    if value is None:
        return {}
    text = value
    if value.startswith("@"):
        path = Path(value[1:])
        try:
            text = path.read_text()
        except OSError as exc:
            raise InvalidInput(f"--payload: cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"--payload is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"--payload must be a JSON object, not a {type(data).__name__}")
    return data


def parse_run_at(value: str | None) -> tuple[datetime | None, float | None]:
    """``--run-at``: an ISO time (with a zone, or UTC) or ``+10m`` from the database's now()."""
    if value is None:
        return None, None
    m = _RELATIVE.match(value.strip())
    if m:
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}[m.group(2)]
        return None, float(m.group(1)) * unit
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidInput(f"--run-at {value!r} is neither an ISO time nor +<n>[s|m|h|d]") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when, None


# the fields of a line of `fleet enqueue --from` (those of fleet.enqueue_many, run_at as --run-at takes it)
TASK_LINE_FIELDS = ("key", "lane", "payload", "title", "priority", "run_at", "max_attempts", "tier", "profile",
                    "max_cost_usd", "max_tokens")


def parse_task_lines(text: str, source: str, default_lane: str | None) -> list[tuple[int, dict[str, Any]]]:
    """The tasks of a JSON Lines text, as (line number, task for ``enqueue_many``), each line checked
    before anything is queued: an error names ``source`` and the line. Blank lines are skipped."""
    out: list[tuple[int, dict[str, Any]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source} line {number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(data, dict):
            raise InvalidInput(f"{where}: a task must be a JSON object, not a {type(data).__name__}")
        unknown = sorted(set(data) - set(TASK_LINE_FIELDS))
        if unknown:
            raise InvalidInput(f"{where}: unknown field {unknown[0]!r}", f"known: {', '.join(TASK_LINE_FIELDS)}")
        key = data.get("key")
        if not isinstance(key, str) or not 1 <= len(key) <= 200:
            raise InvalidInput(f"{where}: a task needs a \"key\", a string of 1 to 200 characters")
        task: dict[str, Any] = {"key": key}
        lane = data.get("lane")
        if lane is not None and not isinstance(lane, str):
            raise InvalidInput(f"{where}: \"lane\" must be a string, not a {type(lane).__name__}")
        if lane is None and default_lane is None:
            raise InvalidInput(f"{where}: no lane: give --lane L (or LANE), or a \"lane\" on the line")
        if lane is not None:
            task["lane"] = lane
        payload = data.get("payload")
        if payload is not None and not isinstance(payload, dict):
            raise InvalidInput(f"{where}: \"payload\" must be a JSON object, not a {type(payload).__name__}")
        if payload is not None:
            task["payload"] = payload
        # the strings (whether the lane names the tier, whether the profile exists: the database says)
        for name in ("title", "tier", "profile"):
            value = data.get(name)
            if value is not None and not isinstance(value, str):
                raise InvalidInput(f"{where}: \"{name}\" must be a string, not a {type(value).__name__}")
            if value is not None:
                task[name] = value
        # the numbers: (field, types, lowest, highest, what the error says it must be)
        for name, types, low, high, must in (
            ("priority", (int,), 0, 1000, "an integer from 0 to 1000"),
            ("max_attempts", (int,), 1, 2**31 - 1, "an integer of at least 1"),
            ("max_cost_usd", (int, float), 1e-6, 1e8 - 1e-6, "a number from 0.000001 to 99,999,999.999999"),
            ("max_tokens", (int,), 1, 2**63 - 1, "an integer of at least 1"),
        ):
            value = data.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, types)
                                      or not low <= value <= high):
                raise InvalidInput(f"{where}: \"{name}\" must be {must}, not {value!r}")
            if value is not None:
                task[name] = value
        run_at = data.get("run_at")
        if run_at is not None:
            if not isinstance(run_at, str):
                raise InvalidInput(f"{where}: \"run_at\" must be a string (ISO time or +10m), not a "
                                   f"{type(run_at).__name__}")
            try:
                when, delay = parse_run_at(run_at)
            except InvalidInput:
                raise InvalidInput(f"{where}: \"run_at\" {run_at!r} is neither an ISO time nor +<n>[s|m|h|d]") from None
            if when is not None:
                task["run_at"] = when
            else:
                task["delay_seconds"] = delay
        out.append((number, task))
    return out


_TASK_INDEX = re.compile(r"^p_tasks\[(\d+)\]")


def read_task_lines(source: str, lane: str | None) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
    """``fleet enqueue --from``: the tasks of ``source`` (a path, or ``-`` for stdin), every line
    checked (:func:`parse_task_lines`); (the name errors give the source, its tasks)."""
    name = "stdin" if source == "-" else source
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"--from: cannot read {name}: {getattr(exc, 'strerror', None) or exc}") from None
    return name, parse_task_lines(text, name, lane)


def enqueue_lines(store: Store, name: str, lane: str | None, lines: list[tuple[int, dict[str, Any]]]
                  ) -> list[tuple[int, bool]]:
    """One enqueue_many for the tasks of :func:`read_task_lines` (one transaction, every lane): a bad
    line queues nothing, and an error names its line of ``name``. (task id, created) per line."""
    try:
        return store.enqueue_many(lane, [task for _, task in lines]) if lines else []
    except FleetError as exc:
        # the database names the task by its index in the array: name the line instead
        m = _TASK_INDEX.match(exc.message)
        if m is None or int(m.group(1)) >= len(lines):
            raise
        raise type(exc)(f"{name} line {lines[int(m.group(1))][0]}{exc.message[m.end():]}", exc.hint) from None
