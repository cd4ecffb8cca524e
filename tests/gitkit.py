"""Git helpers of the tests that need a real repository: git as a tester, a bare origin, reading
its branches. (worker/workspace/git.py is what is tested; this only sets the scene and looks at it.)"""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from worker.workspace import git as gitws

TESTER = ("tester", "tester@example.com")


def git(*args: str, cwd: Path | None = None) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, env=gitws.git_env(TESTER), capture_output=True, text=True,
                          timeout=30, check=False)
    assert proc.returncode == 0, f"git {' '.join(args)}: {proc.stderr}"
    return proc.stdout.strip()


def bare_origin(tmp_path: Path) -> Path:
    """A bare repository `origin.git` whose `main` has one commit ("initial", a README.md)."""
    seed = tmp_path / "seed"
    git("init", "-q", "-b", "main", str(seed))
    (seed / "README.md").write_text("hello\n")
    git("add", "README.md", cwd=seed)
    git("commit", "-q", "-m", "initial", cwd=seed)
    bare = tmp_path / "origin.git"
    git("clone", "-q", "--bare", str(seed), str(bare))
    return bare


def log_of(origin: Path, branch: str) -> list[str]:
    """The subjects of a branch of a bare repository, newest first."""
    return git("--git-dir", str(origin), "log", "--format=%s", branch).splitlines()


@contextmanager
def mirror_held(mirror: gitws.Mirror) -> Iterator[None]:
    """Hold the host lock of ``mirror`` as another process fetching it would, until the block ends."""
    mirror.lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(mirror.lock_path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
