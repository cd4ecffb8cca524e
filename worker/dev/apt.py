"""apt-get for what the tests and the dev stack install when it is missing (nginx, chromium): it
waits for the package manager's locks instead of failing because another apt-get holds them.

``-o DPkg::Lock::Timeout`` makes an install wait for dpkg's frontend lock, but ``apt-get update``
does not wait for the lock of the package lists (apt 2.6 gives up at once: "Could not get lock
/var/lib/apt/lists/lock"), so a run that failed on a lock is tried again until the same deadline.
``.ci/run`` does the same in shell (its ``apt_get``).
"""

from __future__ import annotations

import os
import re
import subprocess
import time

LOCK_WAIT_SECONDS = 600
_LOCKED = re.compile(r"Could not get lock|Unable to acquire the dpkg frontend lock|Unable to lock")


def apt_get(*args: str, timeout: float = 1800.0, lock_wait: float = LOCK_WAIT_SECONDS,
            ) -> subprocess.CompletedProcess[str]:
    """``apt-get ARGS`` (non-interactive), waiting up to ``lock_wait`` seconds for a lock another
    process holds; its completed process (the caller checks the return code)."""
    cmd = ["apt-get", "-o", f"DPkg::Lock::Timeout={int(lock_wait)}", *args]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    deadline = time.monotonic() + lock_wait
    while True:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode == 0 or not _LOCKED.search(proc.stderr) or time.monotonic() >= deadline:
            return proc
        time.sleep(1.0)


def apt_install(*packages: str, recommends: bool = True) -> subprocess.CompletedProcess[str]:
    """``apt-get update`` then ``apt-get install -y PACKAGES``: the install's completed process
    (an update that failed may leave lists that still have the packages)."""
    apt_get("update", "-qq", timeout=900.0)
    extra = [] if recommends else ["--no-install-recommends"]
    return apt_get("install", "-y", "-qq", *extra, *packages)
