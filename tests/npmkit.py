"""An npm package installed once into a cache folder under the repo's git-ignored ``.fleet/``
(the Supabase CLI, GitHub's OpenAPI description): parallel test workers (pytest-xdist) serialise
the install with a file lock; later runs reuse it."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

INSTALL_TIMEOUT = 600


def npm_install(folder: Path, package: str, version: str, installed: Callable[[], str | None],
                missing: Callable[[str], Exception]) -> None:
    """Make ``installed()`` answer ``version`` by installing ``package@version`` into ``folder``.
    Raises ``missing(message)`` if npm is not on PATH; any other failure is a RuntimeError."""
    if installed() == version:
        return
    npm = shutil.which("npm")
    if npm is None:
        raise missing(f"npm is not on PATH, so {package}@{version} cannot be installed")
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another xdist worker may be installing it right now
        if installed() == version:
            return
        (folder / "package.json").write_text('{"private": true}\n')
        proc = subprocess.run([npm, "install", "--no-audit", "--no-fund", f"{package}@{version}"], cwd=folder,
                              capture_output=True, text=True, timeout=INSTALL_TIMEOUT, check=False)
        got = installed()
        if proc.returncode != 0 or got != version:
            raise RuntimeError(f"npm install {package}@{version} in {folder} failed (exit {proc.returncode}, "
                               f"installed version {got!r}):\n{proc.stdout}\n{proc.stderr}")
