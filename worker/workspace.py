"""A task's workspace: ``<workspaces>/<lane>/<task key>/`` with its hidden files and its prompt.

Hidden files (DESIGN §6) come from ``hidden_files/<set>/`` and land in ``<workspace>/.<set>/``;
``{{name}}`` in a template is replaced by the task's values. Rendering never overwrites a file
the task's own repository already has: only files lanefleet wrote itself (listed in
``.fleet/rendered.json``) are written again. Files holding task identity are mode 0600.

A workspace outlives its attempt (a retry or a hand-off on the same host finds it again); the shift
records its size in ``fleet.workspaces`` (:func:`disk_use`) and the monitor removes it once its
task has been finished for the lane's retention (:func:`remove_workspace`, which never leaves the
workspaces root).
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from worker.errors import FleetError
from worker.models import LaneHandoff, Task
from worker.resources import resource_dir

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_VAR = re.compile(r"\{\{(\w+)\}\}")
MANIFEST = "rendered.json"


def safe_name(key: str) -> str:
    """A file-system name for a task key (``issue:473`` → ``issue_473``)."""
    name = _UNSAFE.sub("_", key).strip("._") or "task"
    return name[:120]


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read, atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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

    def read_checkpoint(self) -> tuple[Any, float] | None:
        """The agent's checkpoint and the file's mtime, or None if absent or not valid JSON yet."""
        try:
            stat = self.checkpoint_file.stat()
            return json.loads(self.checkpoint_file.read_text()), stat.st_mtime
        except (OSError, ValueError):
            return None

    def read_route(self) -> dict[str, Any] | None:
        """``.fleet/route.json`` if the agent wrote one: ``{"lane": ..., "note": ...}``."""
        try:
            data = json.loads(self.route_file.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            return {"error": f".fleet/route.json is not valid JSON: {exc}"}
        if not isinstance(data, dict) or not isinstance(data.get("lane"), str):
            return {"error": '.fleet/route.json must be {"lane": "<lane>", "note": ...}'}
        return data


def workspace_for(workspaces: Path, lane: str, key: str) -> Workspace:
    return Workspace(workspaces / lane / safe_name(key))


def render_hidden_files(ws: Workspace, sets: list[str], values: Mapping[str, str]) -> list[Path]:
    """Render the hidden-file sets into the workspace; returns the files written."""
    ws.fleet.mkdir(parents=True, exist_ok=True)
    manifest_path = ws.fleet / MANIFEST
    try:
        ours = set(json.loads(manifest_path.read_text()))
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
            if dest.exists() and str(rel) not in ours:
                continue  # the task's repository has its own: never overwrite it
            dest.parent.mkdir(parents=True, exist_ok=True)
            text = _VAR.sub(lambda m: values.get(m.group(1), m.group(0)), src.read_text())
            write_atomic(dest, text)
            ours.add(str(rel))
            written.append(dest)
    write_atomic(manifest_path, json.dumps(sorted(ours), indent=1))
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
    write_private(ws.fleet / "task.json", json.dumps({
        "id": task.id, "key": task.key, "lane": task.lane, "title": task.title,
        "attempt": task.attempts, "payload": task.payload,
        "lease_expires_at": task.lease_expires_at, "shift_deadline": shift_deadline,
        "agent_session": task.agent_session,
    }, indent=2, default=str))
    write_atomic(ws.fleet / "handoff.md", handoff_markdown(task))
    # the database holds the truth: the workspace gets its checkpoint, or none
    if task.checkpoint is not None:
        write_atomic(ws.checkpoint_file, json.dumps(task.checkpoint, indent=2))
    else:
        ws.checkpoint_file.unlink(missing_ok=True)
    ws.route_file.unlink(missing_ok=True)
    write_atomic(ws.prompt_file, build_prompt(task, instructions, lane_handoff))


# -- disk use and removal (fleet.workspaces; the monitor's reaper)

#: names a shift keeps beside the task workspaces of a lane: never a workspace to remove
RESERVED_NAMES = frozenset({"logs", "handoffs"})
#: ``<root>/.reaping/``: where a reaped workspace is moved (atomically) before it is deleted
REAPING = ".reaping"


class UnsafePath(FleetError):
    """A path the remover will not touch: not a workspace under the workspaces root."""


@dataclass(frozen=True)
class DiskUse:
    bytes: int
    entries: int
    complete: bool  # False: the walk stopped at its bound, ``bytes`` is a lower bound


def _allocated(st: os.stat_result) -> int:
    """Bytes on disk, as du counts them (apparent size where blocks are not reported)."""
    blocks = getattr(st, "st_blocks", None)
    return int(blocks) * 512 if blocks is not None else int(st.st_size)


def disk_use(path: Path, *, max_entries: int = 200_000, max_seconds: float = 2.0) -> DiskUse:
    """The disk use of a directory tree, quickly and within a bound: an ``os.scandir`` walk that
    never follows a symbolic link (a link counts as itself), never crosses into another file system
    (a mount inside the workspace) and counts a hard-linked file once. It stops after
    ``max_entries`` entries or ``max_seconds`` (``complete`` is then False). A missing path is 0."""
    try:
        top = os.lstat(path)
    except OSError:
        return DiskUse(0, 0, True)
    total = _allocated(top)
    if not stat.S_ISDIR(top.st_mode):
        return DiskUse(total, 1, True)
    deadline = time.monotonic() + max_seconds
    seen: set[tuple[int, int]] = set()
    entries = 0
    stack = [os.fspath(path)]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue  # vanished or unreadable: count what can be read
        with it:
            for entry in it:
                entries += 1
                if entries > max_entries or (entries % 512 == 0 and time.monotonic() > deadline):
                    return DiskUse(total, entries - 1, False)
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    if st.st_dev != top.st_dev:
                        continue  # a mount point: not this workspace's disk use
                    stack.append(entry.path)
                elif st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += _allocated(st)
    return DiskUse(total, entries, True)


def workspace_path(root: Path, path: str | Path) -> tuple[Path, str, str]:
    """``path`` as a task workspace under ``root``: (the root's real path, lane, name), or
    :class:`UnsafePath`. A workspace is exactly ``<root>/<lane>/<name>``: never the root, a lane's
    folder, its ``logs`` or ``handoffs``, nor anything a symbolic link in ``path`` leads to
    outside the root (the parents are resolved; the last component is taken as it is)."""
    p = Path(path)
    if not p.is_absolute():
        raise UnsafePath(f"refusing {str(path)!r}: not an absolute path")
    if p.name in ("", ".", ".."):
        raise UnsafePath(f"refusing {str(path)!r}: not a workspace directory")
    real_root = Path(os.path.realpath(root))
    target = Path(os.path.realpath(p.parent)) / p.name
    try:
        rel = target.relative_to(real_root)
    except ValueError:
        raise UnsafePath(f"refusing {str(path)!r}: not under the workspaces root {str(real_root)!r}") from None
    if len(rel.parts) != 2 or rel.parts[0].startswith(".") or rel.parts[1] in RESERVED_NAMES:
        raise UnsafePath(f"refusing {str(path)!r}: a workspace is <root>/<lane>/<task key>, "
                         f"not {str(rel)!r} under {str(real_root)!r}")
    return real_root, rel.parts[0], rel.parts[1]


@dataclass(frozen=True)
class Removal:
    bytes_freed: int
    left: int  # entries that could not be removed (a mount point, a permission): left on disk
    existed: bool


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _entries(dfd: int) -> list[str]:
    with os.scandir(dfd) as it:
        return [e.name for e in it]


def _empty_dir(dfd: int, dev: int, depth: int = 0) -> tuple[int, int]:
    """Remove everything in the directory open as ``dfd``: (bytes freed, entries left). Every call
    is relative to a directory descriptor, a directory is opened with O_NOFOLLOW and checked to be
    the one just looked at, so no symbolic link (or one swapped in meanwhile) is ever followed;
    another file system's mount is left alone."""
    freed = left = 0
    try:
        mode = os.fstat(dfd).st_mode
        if mode & 0o700 != 0o700:
            os.fchmod(dfd, mode | 0o700)  # a read-only directory (a Go module cache) cannot be emptied
    except OSError:
        pass
    try:
        names = _entries(dfd)
    except OSError:
        return 0, 1
    for name in names:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError:
            left += 1
            continue
        if stat.S_ISDIR(st.st_mode):
            if st.st_dev != dev or depth > 400:
                left += 1  # a mount point (or absurd depth): never removed through
                continue
            try:
                cfd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            except OSError:
                left += 1
                continue
            try:
                if not os.path.samestat(st, os.fstat(cfd)):
                    left += 1  # swapped since the stat: leave it
                    continue
                f, n = _empty_dir(cfd, dev, depth + 1)
            finally:
                os.close(cfd)
            freed, left = freed + f, left + n
            if n:
                left += 1
                continue
            try:
                os.rmdir(name, dir_fd=dfd)
                freed += _allocated(st)
            except FileNotFoundError:
                pass
            except OSError:
                left += 1
        else:
            try:
                os.unlink(name, dir_fd=dfd)  # a symbolic link: the link, never what it points to
                if st.st_nlink <= 1:
                    freed += _allocated(st)  # another hard link keeps the data
            except FileNotFoundError:
                pass
            except OSError:
                left += 1
    return freed, left


def remove_workspace(root: Path, path: str | Path) -> Removal:
    """Remove the task workspace ``path``, which must be ``<root>/<lane>/<name>`` (else
    :class:`UnsafePath`, and nothing is touched). It is first moved to ``<root>/.reaping/`` (one
    atomic rename: the path is free at once, for a task that starts again there), then deleted
    without ever following a symbolic link out of it or crossing into another file system. A
    missing workspace frees 0 bytes; a symbolic link in its place is unlinked, its target kept."""
    real_root, lane, name = workspace_path(root, path)
    try:
        root_fd = os.open(real_root, _DIR_FLAGS)
    except FileNotFoundError:
        return Removal(0, 0, False)  # no root, no workspace in it
    try:
        try:
            lane_fd = os.open(lane, _DIR_FLAGS, dir_fd=root_fd)
        except FileNotFoundError:
            return Removal(0, 0, False)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a symbolic link (O_NOFOLLOW), or a file
                raise UnsafePath(f"refusing {str(path)!r}: {lane!r} is not a directory under the root") from None
            raise
        try:
            try:
                st = os.stat(name, dir_fd=lane_fd, follow_symlinks=False)
            except FileNotFoundError:
                return Removal(0, 0, False)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=lane_fd)  # a link or a file where the workspace was
                return Removal(0, 0, True)
            # move it out of the way, then delete it at leisure
            dir_fd, entry = lane_fd, name
            try:
                os.mkdir(REAPING, 0o700, dir_fd=root_fd)
            except FileExistsError:
                pass
            try:
                trash_fd = os.open(REAPING, _DIR_FLAGS, dir_fd=root_fd)
            except OSError:
                trash_fd = -1
            if trash_fd >= 0:
                moved = f"{lane}--{name}--{secrets.token_hex(4)}"
                try:
                    os.rename(name, moved, src_dir_fd=lane_fd, dst_dir_fd=trash_fd)
                    dir_fd, entry = trash_fd, moved
                except OSError:
                    pass  # another file system (EXDEV) or a race: delete it where it is
            try:
                freed, left = _remove_entry(dir_fd, entry, st.st_dev)
            finally:
                if trash_fd >= 0:
                    os.close(trash_fd)
            return Removal(freed, left, True)
        finally:
            os.close(lane_fd)
    finally:
        os.close(root_fd)


def _remove_entry(parent_fd: int, name: str, dev: int) -> tuple[int, int]:
    """Remove the directory ``name`` of ``parent_fd`` and all in it: (bytes freed, entries left)."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return 0, 0
    try:
        if not os.path.samestat(st, os.fstat(fd)):
            return 0, 1
        freed, left = _empty_dir(fd, dev)
    finally:
        os.close(fd)
    if left:
        return freed, left + 1
    try:
        os.rmdir(name, dir_fd=parent_fd)
        freed += _allocated(st)
    except FileNotFoundError:
        pass
    except OSError:
        left += 1
    return freed, left


def sweep_reaping(root: Path) -> int:
    """Delete what a reaper left in ``<root>/.reaping/`` (a monitor stopped between the move and
    the delete: every entry there was reaped already). Returns the bytes freed."""
    real_root = Path(os.path.realpath(root))
    try:
        root_fd = os.open(real_root, _DIR_FLAGS)
    except OSError:
        return 0
    try:
        try:
            trash_fd = os.open(REAPING, _DIR_FLAGS, dir_fd=root_fd)
        except OSError:
            return 0
        try:
            dev = os.fstat(trash_fd).st_dev
            freed = 0
            for name in _entries(trash_fd):
                try:
                    st = os.stat(name, dir_fd=trash_fd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    freed += _remove_entry(trash_fd, name, dev)[0]
                else:
                    try:
                        os.unlink(name, dir_fd=trash_fd)
                    except OSError:
                        pass
            return freed
        finally:
            os.close(trash_fd)
    finally:
        os.close(root_fd)
