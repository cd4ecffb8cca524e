"""Reading and writing a workspace's files without following a link the agent planted.

An agent owns its workspace: any folder or file in it may be a symbolic link (to ``~/.bashrc``, the
fleet's config, a credentials file) or a FIFO by the time the shift touches it. Every call here
takes ``root``, a folder the agent cannot replace (the workspace itself: the sandbox's mount point,
and outside it a folder of the shift's), and walks from it one name at a time, relative to a
directory descriptor, with ``O_NOFOLLOW``: a link on the way is never followed (ELOOP, an
:class:`UnsafeFile`), a file read is a regular one, and a write lands in a fresh temporary file
(``O_EXCL``) renamed over the name (which replaces a link rather than writing through it).

Standard library only: ``fleet checkpoint`` (:mod:`worker.workspace.checkpoint`) uses it.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: the most a file read back from a workspace may hold (a checkpoint, a route, an attention note)
READ_LIMIT = 1 << 20


class UnsafeFile(OSError):
    """A workspace path that passes through a symbolic link, or is not a regular file or folder."""


def _parts(root: Path, path: Path) -> list[str]:
    try:
        rel = Path(os.path.abspath(path)).relative_to(Path(os.path.abspath(root)))
    except ValueError:
        raise UnsafeFile(errno.EINVAL, f"{path} is not under {root}") from None
    if not rel.parts or ".." in rel.parts:
        raise UnsafeFile(errno.EINVAL, f"{path} is not a file under {root}")
    return list(rel.parts)


@contextmanager
def _folder(root: Path, names: list[str], *, create: bool) -> Iterator[int]:
    """A descriptor of ``root/names…``, each folder opened without following a link (made when
    ``create``, mode 0700)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in names:
            try:
                nxt = os.open(name, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
                nxt = os.open(name, _DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeFile(exc.errno, f"{name} in {root} is a symbolic link or not a folder") from None
                raise
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def _write(root: Path, path: Path, data: bytes, mode: int) -> None:
    *folders, name = _parts(root, path)
    with _folder(root, folders, create=True) as d:
        tmp = f".{name}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=d)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                os.fchmod(fh.fileno(), mode)
            os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=d)
            except OSError:
                pass
            raise


def write_private(root: Path, path: Path, text: str) -> None:
    """Write ``path`` (under ``root``) atomically, readable by its owner alone."""
    _write(root, path, text.encode(), 0o600)


def write_atomic(root: Path, path: Path, text: str | bytes) -> None:
    """Write ``path`` (under ``root``) atomically (mode 0644)."""
    _write(root, path, text if isinstance(text, bytes) else text.encode(), 0o644)


@contextmanager
def _regular(name: str | Path, shown: Path, *, dir_fd: int | None = None) -> Iterator[BinaryIO]:
    """``name`` (relative to ``dir_fd`` when given) open for reading: never through a link at its
    name, never waiting on a FIFO, a regular file (else :class:`UnsafeFile`, naming ``shown``)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(exc.errno, f"{shown} is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeFile(errno.EINVAL, f"{shown} is not a regular file")
        yield fh


def read_text(root: Path, path: Path, limit: int = READ_LIMIT) -> str:
    """``path`` (under ``root``) as text: FileNotFoundError when absent, :class:`UnsafeFile` when a
    link is on the way, it is not a regular file (a FIFO is never waited on) or it holds more than
    ``limit`` bytes."""
    *folders, name = _parts(root, path)
    with _folder(root, folders, create=False) as d, _regular(name, path, dir_fd=d) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise UnsafeFile(errno.EFBIG, f"{path} holds more than {limit} bytes")
    return data.decode(errors="replace")


def read_tail(path: Path, limit: int) -> tuple[bytes, int]:
    """The last ``limit`` bytes of a regular file and its size, opened as :func:`read_text` opens
    its file (never through a link at its name, never waiting on a FIFO): for a file an agent's CLI
    kept in the task's HOME (Codex's rollout)."""
    with _regular(path, path) as fh:
        size = os.fstat(fh.fileno()).st_size
        fh.seek(max(0, size - limit))
        return fh.read(limit), size


def lstat(root: Path, path: Path) -> os.stat_result:
    """``path``'s own status (a link's, not its target's), reached without following a link."""
    *folders, name = _parts(root, path)
    with _folder(root, folders, create=False) as d:
        return os.stat(name, dir_fd=d, follow_symlinks=False)


def unlink(root: Path, path: Path) -> None:
    """Remove ``path`` (a link itself, not its target) if it is there."""
    *folders, name = _parts(root, path)
    try:
        with _folder(root, folders, create=False) as d:
            os.unlink(name, dir_fd=d)
    except FileNotFoundError:
        pass


def own_folder(root: Path, path: Path) -> Path:
    """Make ``path`` under ``root`` a real folder of the shift's (mode 0700): a link or a file the
    agent left in its place is removed first. For the folders the shift owns in a workspace
    (``.fleet/``, the task's HOME), before the agent runs."""
    *folders, name = _parts(root, path)
    with _folder(root, folders, create=True) as d:
        try:
            st = os.stat(name, dir_fd=d, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=d)  # a link (never followed) or a file
            st = None
        if st is None:
            os.mkdir(name, 0o700, dir_fd=d)
    return path
