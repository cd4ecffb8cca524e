"""A task's workspace: ``<workspaces>/<lane>/<slug>-<hash>/`` with its hidden files and its prompt.

The directory's name is a readable slug of the task's key and the first 8 hex digits of the
SHA-256 of the whole key (``coll a`` → ``coll_a-…``, ``coll_a`` → ``coll_a-…``, two directories):
keys that make the same slug never share a workspace. A workspace made under the older naming (the
slug alone) is found through the task's row in ``fleet.workspaces`` and used on
(:func:`resolve_workspace`), never recomputed from the key.

Hidden files (DESIGN §6) come from ``hidden_files/<set>/`` and land in ``<workspace>/.<set>/``;
``{{name}}`` in a template is replaced by the task's values. Rendering never overwrites a file
the task's own repository already has: only files lanefleet wrote itself (listed in
``.fleet/rendered.json``) are written again. Files holding task identity are mode 0600.

A workspace outlives its attempt (a retry or a hand-off on the same host finds it again); the shift
records its size in ``fleet.workspaces`` and the monitor removes it once its task has been finished
for the lane's retention (:mod:`worker.workspace.disk`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from worker import files
from worker.files import UnsafeFile, write_atomic, write_private
from worker.models import LaneHandoff, Task
from worker.resources import resource_dir

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_VAR = re.compile(r"\{\{(\w+)\}\}")
MANIFEST = "rendered.json"


def safe_name(key: str) -> str:
    """A file-system name for a task key (``issue:473`` → ``issue_473``). Not unique: ``issue 473``
    makes the same; a name that must be unique per key is :func:`workspace_name`."""
    name = _UNSAFE.sub("_", key).strip("._") or "task"
    return name[:120]


def workspace_name(key: str) -> str:
    """A task's directory name: ``<slug>-<8 hex digits of sha256(key)>`` (``issue:473`` →
    ``issue_473-…``). Unique per key by construction, up to a collision of the hash among keys
    of the same slug."""
    return f"{safe_name(key)[:100]}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class Workspace:
    root: Path

    @property
    def fleet(self) -> Path:
        return self.root / ".fleet"

    @property
    def prompt_file(self) -> Path:
        return self.fleet / "prompt.md"

    @property
    def checkpoint_file(self) -> Path:
        return self.fleet / "checkpoint.json"

    @property
    def route_file(self) -> Path:
        return self.fleet / "route.json"

    def read(self, path: Path) -> str:
        """A file the agent may have written, read without following a link
        (:func:`worker.files.read_text`: FileNotFoundError, UnsafeFile)."""
        return files.read_text(self.root, path)

    def mtime(self, path: Path) -> float | None:
        """When the agent last wrote ``path`` (a link's own time, never its target's), or None."""
        try:
            return files.lstat(self.root, path).st_mtime
        except OSError:
            return None

    def read_checkpoint(self) -> tuple[Any, float] | None:
        """The agent's checkpoint and the file's mtime, or None if absent or not valid JSON yet;
        :class:`UnsafeFile` (its ``strerror`` says why) when it is a link (never followed), not a
        regular file, or larger than :data:`worker.files.READ_LIMIT`."""
        try:
            mtime = files.lstat(self.root, self.checkpoint_file).st_mtime
            return json.loads(self.read(self.checkpoint_file)), mtime
        except UnsafeFile:
            raise
        except (OSError, ValueError):
            return None

    def read_route(self) -> dict[str, Any] | None:
        """``.fleet/route.json`` if the agent wrote one: ``{"lane": ..., "note": ...}``."""
        try:
            data = json.loads(self.read(self.route_file))
        except FileNotFoundError:
            return None
        except UnsafeFile as exc:
            return {"error": f".fleet/route.json cannot be read: {exc.strerror}"}
        except (OSError, ValueError) as exc:
            return {"error": f".fleet/route.json is not valid JSON: {exc}"}
        if not isinstance(data, dict) or not isinstance(data.get("lane"), str):
            return {"error": '.fleet/route.json must be {"lane": "<lane>", "note": ...}'}
        return data


def workspace_for(workspaces: Path, lane: str, key: str) -> Workspace:
    """The workspace a task of ``key`` gets in ``lane`` when it has none recorded on the host."""
    return Workspace(workspaces / lane / workspace_name(key))


def resolve_workspace(workspaces: Path, lane: str, key: str, recorded: str | None) -> Workspace:
    """The task's workspace: the directory its row in ``fleet.workspaces`` names (``recorded``,
    from ``fleet.task_workspace``) when that is one of the lane's under this workspaces root — a
    running task made under the older naming keeps its directory —, else :func:`workspace_for`.
    (A recorded path elsewhere, under a root the config no longer names, is left to be reaped.)"""
    if recorded:
        path = Path(recorded)
        if path.is_absolute() and path.parent == Path(os.path.abspath(workspaces / lane)) \
                and path.name not in ("", ".", ".."):
            return Workspace(path)
    return workspace_for(workspaces, lane, key)


def batch_workspace(workspaces: Path, lane: str, name: str) -> Workspace:
    """A batch's own worktree (``batch-<id>``, ``batch-<id>-m<n>-<key>``), named as before task
    directories carried a hash: the batch id and member number make it unique, and a task's
    directory has this name only if its key's hash happened to spell the name's end."""
    return Workspace(workspaces / lane / safe_name(name))


def render_hidden_files(ws: Workspace, sets: list[str], values: Mapping[str, str]) -> list[Path]:
    """Render the hidden-file sets into the workspace; returns the files written. A file whose
    path passes through a link of the workspace (a task's repository may have one) is left as it
    is, as one the repository has."""
    files.own_folder(ws.root, ws.fleet)
    manifest_path = ws.fleet / MANIFEST
    try:
        ours = set(json.loads(ws.read(manifest_path)))
    except (OSError, ValueError):
        ours = set()
    base = resource_dir("hidden_files")
    written: list[Path] = []
    for name in sets:
        src_root = base / name
        if not src_root.is_dir():
            raise FileNotFoundError(f"hidden file set {name!r} does not exist in {base}")
        for src in sorted(p for p in src_root.rglob("*") if p.is_file()):
            rel = Path("." + name) / src.relative_to(src_root)
            dest = ws.root / rel
            try:
                there = files.lstat(ws.root, dest)
            except FileNotFoundError:
                there = None
            except UnsafeFile:
                continue  # a folder on its way is a link: the repository's, never written through
            if there is not None and str(rel) not in ours:
                continue  # the task's repository has its own: never overwrite it
            text = _VAR.sub(lambda m: values.get(m.group(1), m.group(0)), src.read_text())
            write_atomic(ws.root, dest, text)
            ours.add(str(rel))
            written.append(dest)
    write_atomic(ws.root, manifest_path, json.dumps(sorted(ours), indent=1))
    return written


def _json_block(data: Any) -> str:
    return "```json\n" + json.dumps(data, indent=2, sort_keys=True, default=str) + "\n```"


def handoff_markdown(task: Task) -> str:
    """``.fleet/handoff.md``: what earlier shifts and stages left for this task."""
    parts = [f"# Hand-off for task {task.key}\n"]
    if task.handoff:
        h = task.handoff
        parts.append("## The previous shift\n")
        parts.append(f"- reason: {h.get('reason', 'shift ended')}")
        if h.get("ran_seconds") is not None:
            parts.append(f"- ran for {h['ran_seconds']:.0f} s in attempt {h.get('attempt')}")
        if h.get("agent_session"):
            parts.append(f"- agent session: `{h['agent_session']}` (resume it)")
        if h.get("log_path"):
            parts.append(f"- log: `{h['log_path']}`")
        if h.get("log_tail"):
            parts.append("\nThe end of its log:\n\n```\n" + str(h["log_tail"])[-1500:] + "\n```")
    if task.stages:
        parts.append("\n## Earlier stages\n")
        for i, st in enumerate(task.stages, 1):
            parts.append(f"{i}. lane **{st.get('lane')}** → {st.get('routed_to')} after "
                         f"{st.get('attempts')} attempt(s)")
            if st.get("note") is not None:
                note = st["note"]
                parts.append(f"   note: {note if isinstance(note, str) else json.dumps(note)}")
    if len(parts) == 1:
        parts.append("Nothing yet: this is the task's first shift.")
    return "\n".join(parts) + "\n"


def build_prompt(task: Task, instructions: str, lane_handoff: LaneHandoff | None) -> str:
    """The prompt of one attempt: lane instructions, the task, and everything left for it."""
    parts = [instructions.rstrip(), "", "---", "", f"# Your task: {task.title or task.key}", "",
             f"- key: `{task.key}`", f"- id: {task.id}", f"- attempt: {task.attempts}"]
    if task.payload:
        parts += ["", "## Payload", "", _json_block(task.payload)]
    if task.stages:
        last = task.stages[-1]
        parts += ["", "## This task comes from an earlier stage", "",
                  f"Lane **{last.get('lane')}** routed it here."]
        note = last.get("note")
        if note is not None:
            parts += ["Its note:", "", note if isinstance(note, str) else _json_block(note)]
        parts += ["", "Stage history:"]
        for i, st in enumerate(task.stages, 1):
            parts.append(f"{i}. {st.get('lane')} ({st.get('attempts')} attempt(s))")
    if task.checkpoint is not None:
        parts += ["", f"## Where you left off (checkpoint #{task.checkpoint_seq})", "",
                  _json_block(task.checkpoint)]
    if task.handoff:
        parts += ["", "## The previous shift handed this task off", "",
                  "Read `.fleet/handoff.md` for its snapshot and the end of its log."]
        if task.agent_session:
            parts.append(f"Your earlier agent session is `{task.agent_session}`.")
    if task.review_note:
        parts += ["", "## Review: your last result was sent back", "",
                  "A reviewer rejected the last attempt's result with this note. Address it:", "",
                  task.review_note.strip()[-4000:]]
    if task.ci_feedback:
        parts += ["", "## CI failed on your pull request", "",
                  "The checks of the branch you pushed failed. Fix what they report, commit, and finish "
                  "again: your next push runs them again.", "", task.ci_feedback.strip()[-6000:]]
    if task.last_error and task.failures:
        parts += ["", f"## The last attempt failed ({task.failures} failure(s) so far)", "",
                  "```", task.last_error[-1500:], "```"]
    if lane_handoff is not None:
        c = lane_handoff.counts
        parts += ["", "## The lane's last shift", "",
                  f"It ended at {lane_handoff.window_end:%Y-%m-%d %H:%M} UTC ({lane_handoff.end_reason}): "
                  f"{c.get('done', 0)} done, {c.get('failed', 0)} failed, "
                  f"{c.get('handed_off', 0)} handed off."]
        notes = lane_handoff.notes.get("notes") if lane_handoff.notes else None
        if notes:
            parts.append(f"Its notes: {notes}")
    parts += ["", "Read `.fleet/README.md` for how to checkpoint, hand off and finish.", ""]
    return "\n".join(parts)


def prepare(ws: Workspace, task: Task, *, instructions: str, lane_handoff: LaneHandoff | None,
            hidden_sets: list[str], shift_deadline: datetime) -> None:
    """Lay out the workspace for one attempt of ``task``."""
    ws.root.mkdir(parents=True, exist_ok=True)
    values = {
        "task_id": str(task.id), "task_key": task.key, "lane": task.lane,
        "attempt": str(task.attempts), "shift_deadline": shift_deadline.isoformat(timespec="seconds"),
    }
    render_hidden_files(ws, sorted(set(hidden_sets) | {"fleet"}), values)
    write_private(ws.root, ws.fleet / "task.json", json.dumps({
        "id": task.id, "key": task.key, "lane": task.lane, "title": task.title,
        "attempt": task.attempts, "payload": task.payload,
        "lease_expires_at": task.lease_expires_at, "shift_deadline": shift_deadline,
        "agent_session": task.agent_session,
    }, indent=2, default=str))
    write_atomic(ws.root, ws.fleet / "handoff.md", handoff_markdown(task))
    # the database holds the truth: the workspace gets its checkpoint, or none
    if task.checkpoint is not None:
        write_atomic(ws.root, ws.checkpoint_file, json.dumps(task.checkpoint, indent=2))
    else:
        files.unlink(ws.root, ws.checkpoint_file)
    files.unlink(ws.root, ws.route_file)
    write_atomic(ws.root, ws.prompt_file, build_prompt(task, instructions, lane_handoff))
