"""Debian's chromium for the tests that look at a page in a real browser (the HTML report, the
console): installed with apt-get when it is missing and we are root (as in CI), by one pytest-xdist
worker while the others wait."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from worker.dev.apt import apt_install


def chromium_path(what: str) -> str:
    """The chromium binary; the test fails naming ``what`` needs it when there is none to be had."""
    path = shutil.which("chromium")
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        lock = Path(tempfile.gettempdir()) / "lanefleet-chromium.lock"
        with open(lock, "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # one xdist worker installs, the others wait
            if shutil.which("chromium") is None:
                done = apt_install("chromium")  # waits for another apt-get's locks
                assert done.returncode == 0, done.stderr[-2000:]
        path = shutil.which("chromium")
    if path is None:
        pytest.fail(f"{what} needs Debian's chromium: apt-get install -y chromium")
    return path
