"""worker.dev.apt: an apt-get that another apt-get's lock makes wait, instead of fail.

The lock is the one ``apt-get update`` takes on its package lists, which DPkg::Lock::Timeout does
not cover; the lists, the cache and the sources are a tmp folder's (no sources: nothing is
fetched), so the machine's own apt is never touched or blocked.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker.dev.apt import apt_get

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o640)
fcntl.lockf(fd, fcntl.LOCK_EX)  # as apt locks it
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.fixture
def apt_dirs(tmp_path: Path) -> list[str]:
    assert shutil.which("apt-get"), "these machines are Debian's: apt-get is there"
    for sub in ("lists/partial", "cache/archives/partial", "sources.list.d"):
        (tmp_path / sub).mkdir(parents=True)
    (tmp_path / "sources.list").write_text("")
    return ["-o", f"Dir::State::Lists={tmp_path / 'lists'}", "-o", f"Dir::Cache={tmp_path / 'cache'}",
            "-o", f"Dir::Etc::SourceList={tmp_path / 'sources.list'}",
            "-o", f"Dir::Etc::SourceParts={tmp_path / 'sources.list.d'}"]


def hold_lock(lock: Path, seconds: float) -> subprocess.Popen[str]:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_update_waits_for_a_lists_lock_another_process_holds(apt_dirs: list[str], tmp_path: Path) -> None:
    holder = hold_lock(tmp_path / "lists" / "lock", 3)
    try:
        started = time.monotonic()
        done = apt_get(*apt_dirs, "update", "-qq", timeout=120, lock_wait=60)
        waited = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 0, done.stderr
    assert waited >= 1.5  # it did wait for the holder (about 3 s), and then ran


def test_past_its_wait_the_lock_error_is_returned(apt_dirs: list[str], tmp_path: Path) -> None:
    # what plain apt-get does at once, and what apt_get returns once its wait is spent
    holder = hold_lock(tmp_path / "lists" / "lock", 30)
    try:
        done = apt_get(*apt_dirs, "update", "-qq", timeout=60, lock_wait=1)
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode != 0
    assert "Could not get lock" in done.stderr
