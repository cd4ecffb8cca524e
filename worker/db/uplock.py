"""One ``fleet up`` per directory and database: the lock file ``<fleet home>/up.lock``.

``fleet up`` holds ``fcntl.flock`` on the file for as long as it runs and writes into it who it is
(pid, the process's start time, when it took the lock, the config and the database it runs). The
kernel releases a flock when its holder dies however it dies, so a lock left by a killed ``fleet
up`` is free again at once: only a live holder stops a second one. ``fleet db stop`` reads it to
refuse stopping a server that ``fleet up`` uses.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from worker.errors import FleetError

LOCK_NAME = "up.lock"


class UpRunning(FleetError):
    """Another ``fleet up`` holds the lock of this directory and database."""


@dataclass(frozen=True)
class Holder:
    """Who holds the lock, as it wrote itself into the file (fields it had not written yet: None)."""

    pid: int | None
    started_at: str | None
    config: str | None
    database: str | None

    def describe(self) -> str:
        """``pid 123, since 2026-12-01 10:02:03 UTC`` (one line, for a message)."""
        pid = f"pid {self.pid}" if self.pid is not None else "pid unknown"
        return f"{pid}, since {self.started_at}" if self.started_at else pid


def _read(fd: int) -> Holder:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data: Any = json.loads(os.read(fd, 65536) or b"{}")
    except (OSError, ValueError):
        data = {}
    if not isinstance(data, dict):
        data = {}
    pid = data.get("pid")
    return Holder(pid=pid if isinstance(pid, int) else None, started_at=data.get("started_at"),
                  config=data.get("config"), database=data.get("database"))


def _open(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


def holder(path: Path) -> Holder | None:
    """Who holds the lock at ``path`` now, or None when nobody does (no file, or a dead holder's)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)  # free: it was only a look
        return None
    finally:
        os.close(fd)


class UpLock:
    """The lock of one ``fleet up``: :meth:`acquire` or :class:`UpRunning`; :meth:`release` (or
    the process's end) frees it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self, *, config: str | None, database: str) -> None:
        fd = _open(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = _read(fd)
            os.close(fd)
            raise UpRunning(f"another `fleet up` runs for this directory and database: {other.describe()}, "
                            f"lock {self.path}", "stop it first: Ctrl-C in its terminal, or kill that pid") from None
        now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "started_at": now, "host": socket.gethostname(),
                                  "config": config, "database": database}).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # a later reader finds no stale holder's name in it
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None

    def __enter__(self) -> UpLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
