"""Debian's chromium driven by Playwright (``executable_path``: Playwright's own browser download is
not available here), installed with apt-get when it is missing and we are root, as in CI."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, sync_playwright

from worker.dev.apt import apt_install


def chromium_path() -> str:
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
        pytest.fail("the console's browser tests need Debian's chromium: apt-get install -y chromium")
    return path


def launch() -> Iterator[Browser]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-quic"])
        try:
            yield browser
        finally:
            browser.close()
