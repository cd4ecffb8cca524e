"""Disk use and removal of task workspaces (``fleet.workspaces``; the monitor's reaper).

The shift records a workspace's size (:func:`disk_use`) at the start and the end of every attempt;
the monitor removes a workspace once its task has been finished for the lane's retention
(:func:`remove_workspace`, which never leaves the workspaces root).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from worker.errors import FleetError

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
