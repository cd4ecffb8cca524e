"""Git workspaces: a per-host mirror of a lane's repository, a worktree per task on its
own branch, and the fast-forward-only landing of batch members on an integration branch.

Layout. ``<cache_dir>/<name>-<hash>.git`` is a *bare* repository whose one remote, ``origin``, is
the lane's ``repo``, fetched with ``+refs/heads/*:refs/remotes/origin/*`` (and tags). Its local
branches — ``fleet/<lane>/<key>``, ``batch/<id>`` and ``batch/<id>-m<n>-<key>`` — belong to this
host's worktrees alone: a fetch writes only ``refs/remotes/origin/*`` and ``refs/tags/*``, so it
never moves a worktree branch, least of all one holding commits not pushed yet. (A ``clone
--mirror`` fetches ``+refs/*:refs/*`` and would reset such a branch to origin's copy at every
fetch.) A local branch moves only by an agent's commits or by this module, and this module only
ever fast-forwards one (to origin's copy, when another host pushed more of it, or to a landed
member); it refuses a branch that diverged from origin (:class:`BranchDiverged`) rather than
choose which history to lose. The mirror is created in a temporary directory and renamed into
place, so an existing mirror is always a complete one.

Concurrency. Every operation that fetches or changes the mirror's refs or its worktree registry
holds the mirror's host lock: ``fcntl.flock`` on ``<cache_dir>/<name>-<hash>.lock`` (other
processes on the host) behind an in-process re-entrant lock (other threads; the operations nest).
Agents committing in their worktrees take no lock: they move only their own branch, which nothing
here moves while their task runs. Across hosts, origin is the arbiter: landing pushes first
(a plain push, which origin refuses unless it fast-forwards), then moves the local branch.

Every failure is a :class:`GitError` naming the git command and the end of its stderr. git runs
without a shell, with a timeout (its process group killed when it expires), no terminal prompts,
``-c`` options instead of any configuration of the user's, and none of the ``GIT_DIR``-style
variables a parent git (a hook) may have left in the environment. Commits this module makes
(:func:`commit_all`) carry the lanefleet identity through ``GIT_AUTHOR_*``/``GIT_COMMITTER_*``.

Untrusted writers. Agents commit into the mirror (the sandbox binds it read-write, its control
files read-only: worker/agent/sandbox.py), so no git this module runs — with the fleet's own
rights, outside any sandbox — executes or trusts what an agent could have written there:

- hooks never run (``core.hooksPath=/dev/null``), nor an fsmonitor, an ``ext::`` transport, a
  signature program (:data:`_HARDENING`); git gets none of the fleet's secrets in its environment
  (:func:`git_env`), but what a push authenticates with (ssh agent, HOME, proxies, helpers);
- the repository is named, never discovered: ``--git-dir`` and ``GIT_COMMON_DIR`` (so that no
  ``commondir`` file planted in it is followed) for the mirror, plus the worktree's admin folder
  and ``--work-tree`` in a worktree, whose ``.git`` file is checked to point at its registration
  in this mirror (and back) first; a rewritten one is a :class:`GitError`;
- the mirror's config may hold only what lanefleet and git write there (:data:`_MIRROR_KEYS`:
  no helper, command, URL rewrite, include or hook setting), and no ``objects/info/alternates``
  nor ``commondir``: anything else is a :class:`GitError` naming it, and nothing runs.

A worktree is created before anything else is written at its path (``git worktree add`` wants an
empty or missing directory); ``/.fleet/`` is in the mirror's ``info/exclude`` (shared by all
its worktrees), so the hidden files lanefleet renders there are never committed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from worker.errors import FleetError

#: seconds one git command may run (a first clone of a large repository is the slow one)
GIT_TIMEOUT = 600.0
#: seconds to wait for another process's fetch or clone of the same mirror
LOCK_TIMEOUT = 900.0
#: beside the mirror's config, which includes it: origin's URL (see :attr:`Mirror.origin_url_file`)
ORIGIN_URL_FILE = "origin-url.config"
FETCH_REFSPECS = ("+refs/heads/*:refs/remotes/origin/*", "+refs/tags/*:refs/tags/*")
#: written into the mirror's info/exclude: what lanefleet renders into a worktree is never committed
DEFAULT_EXCLUDES = ("/.fleet/",)
IDENTITY = ("lanefleet", "lanefleet@localhost")

# options for every git command; never the user's global configuration
_GIT_OPTIONS = (
    "-c", "advice.detachedHead=false",
    "-c", "init.defaultBranch=main",
    "-c", "commit.gpgSign=false",
    "-c", "core.quotePath=false",
)
#: what every git the shift runs is kept from executing, whatever a config (the mirror's, which an
#: agent commits into) says: hooks (all of them, post-index-change and reference-transaction
#: included: /dev/null is no folder, so no hook is ever found), an fsmonitor daemon or command,
#: ``ext::`` URLs (a shell command as a transport), signing or verifying with a gpg program, and
#: origin's upload-pack/receive-pack programs (git's own, the defaults). (What -c cannot unset —
#: credential helpers, ssh commands, URL rewrites — :meth:`Mirror.check_controls` refuses.)
_HARDENING = (
    "-c", "core.hooksPath=/dev/null",
    "-c", "core.fsmonitor=false",
    "-c", "protocol.ext.allow=never",
    "-c", "push.gpgSign=false",
    "-c", "merge.verifySignatures=false",
    "-c", "remote.origin.uploadpack=git-upload-pack",
    "-c", "remote.origin.receivepack=git-receive-pack",
)
# variables that would point git at another repository (a hook's environment) or inject config
_SCRUB = frozenset({
    "GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE", "GIT_PREFIX", "GIT_CONFIG_PARAMETERS",
    "GIT_CONFIG_COUNT", "GIT_QUARANTINE_PATH",
})
# the fleet's own secrets and settings, which git never needs (a hook, a helper an agent planted,
# would read them from its environment): worker.config's ENV_SETTINGS and FLEET_OWN_ENV (the
# database, the keys, libpq's variables), every FLEET_* (FLEET_DATABASE__URL, FLEET_CONFIG, a
# lease token) and SUPABASE_* variable. Kept: what a push authenticates with (SSH_AUTH_SOCK,
# GIT_SSH*, HOME, PATH, proxies, a credential helper's own variables such as GH_TOKEN).
_SECRET_NAMES = frozenset({"DATABASE_URL", "FLEET_KEY", "FLEET_WORKER_KEY", "FLEET_CONFIG"})
_SECRET_PREFIXES = ("FLEET_", "SUPABASE_", "PG")
_SECRET_SUFFIXES = ("DATABASE_URL", "DB_URL")
_STDERR_LINES = 6
_STDERR_CHARS = 600


# ------------------------------------------------------------------------------------------------
# errors


class GitError(FleetError):
    """A git command failed, or a git state this module will not act on. ``cmd`` is the command
    as a user would type it, ``stderr`` the end of what git said."""

    def __init__(self, message: str, hint: str | None = None, *, cmd: str = "",
                 returncode: int | None = None, stderr: str = "") -> None:
        super().__init__(message, hint)
        self.cmd = cmd
        self.returncode = returncode
        self.stderr = stderr


class LandingFailed(GitError):
    """A member could not be landed: it does not fast-forward the integration branch, has
    uncommitted changes, or origin refused the push. The integration branch is unchanged."""


class BranchDiverged(GitError):
    """A local branch and origin's copy both have commits the other lacks (a host that died
    before pushing, and another that went on from the older push): nothing is moved."""


class PushRejected(GitError):
    """origin refused a push: the branch moved there since this host last fetched it."""


class MirrorBusy(GitError):
    """Another process held the mirror's lock for longer than the lock timeout."""


def _redact(text: str) -> str:
    """Hide credentials in URLs (``https://user:token@host/...``)."""
    return re.sub(r"(\w+://)[^/\s@]+@", r"\1***@", text)


def _tail(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    text = " | ".join(lines[-_STDERR_LINES:])
    return _redact(text[-_STDERR_CHARS:])


# ------------------------------------------------------------------------------------------------
# running git


def _fleet_secret(name: str) -> bool:
    return name in _SECRET_NAMES or name.startswith(_SECRET_PREFIXES) or name.endswith(_SECRET_SUFFIXES)


def git_env(identity: tuple[str, str] = IDENTITY, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """git's environment: the shift's, less the fleet's secrets (:func:`_fleet_secret`) and the
    variables that would point git elsewhere, plus the lanefleet identity and ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in _SCRUB and not re.fullmatch(r"GIT_CONFIG_(KEY|VALUE)_\d+", k) and not _fleet_secret(k)}
    name, email = identity
    env.update({
        "GIT_TERMINAL_PROMPT": "0",  # never wait for a password nobody will type
        "GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email,
        "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email,
        "LC_ALL": "C",  # messages in English: they end up in errors users read
    })
    if extra:
        env.update(extra)
    return env


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # git and what it started (ssh, index-pack, a hook)
    except ProcessLookupError:
        pass


def run_git(args: Sequence[str], *, git_dir: Path | None = None, cwd: Path | None = None,
            timeout: float = GIT_TIMEOUT, identity: tuple[str, str] = IDENTITY,
            ok: Sequence[int] = (0,), where: str = "", work_tree: Path | None = None,
            common_dir: Path | None = None) -> tuple[int, str]:
    """Run ``git [--git-dir D [--work-tree W]] ARGS`` (never through a shell, never running a hook
    or anything else :data:`_HARDENING` names): (exit status, stdout). A status not in ``ok``, a
    timeout or a missing git raises :class:`GitError`. With ``git_dir``, ``GIT_COMMON_DIR`` is
    ``common_dir`` (default: ``git_dir`` itself), so that no ``commondir`` file in it is followed.
    With ``cwd`` (a worktree), git is kept from looking above it for a repository
    (GIT_CEILING_DIRECTORIES)."""
    argv = ["git", *_GIT_OPTIONS, *_HARDENING]
    extra: dict[str, str] = {}
    if git_dir is not None:
        argv += ["--git-dir", str(git_dir)]
        extra["GIT_COMMON_DIR"] = str(common_dir or git_dir)
        if work_tree is not None:
            argv += ["--work-tree", str(work_tree)]
    argv += list(args)
    shown = _redact("git " + " ".join(args))
    place = f" ({where})" if where else ""
    if cwd is not None:
        extra["GIT_CEILING_DIRECTORIES"] = str(cwd.parent)
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=git_env(identity, extra), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        raise GitError(f"{shown}{place} could not start: {exc}", "is git installed and on PATH?",
                       cmd=shown) from exc
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:
            _, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            err = b""
        raise GitError(f"{shown}{place} timed out after {timeout:g} s", cmd=shown,
                       stderr=_tail(err.decode(errors="replace"))) from None
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    if proc.returncode not in ok:
        tail = _tail(err.decode(errors="replace"))
        raise GitError(f"{shown}{place} failed (exit {proc.returncode}): {tail or 'no message'}",
                       cmd=shown, returncode=proc.returncode, stderr=tail)
    return proc.returncode, out.decode(errors="replace")


# ------------------------------------------------------------------------------------------------
# what a mirror's config may hold (Mirror.check_controls)

#: the keys lanefleet (Mirror._create) and ``git init`` write in a mirror's config, and inert ones
#: an operator may tune; a branch's upstream (``branch.<b>.remote``/``merge``). Nothing that runs
#: a program, names a helper, a URL or another file.
_MIRROR_KEYS = frozenset({
    "core.repositoryformatversion", "core.filemode", "core.bare", "core.logallrefupdates",
    "core.ignorecase", "core.precomposeunicode", "core.symlinks", "core.compression",
    "core.bigfilethreshold", "remote.origin.fetch", "remote.origin.url", "user.name", "user.email",
    # (what git init writes under a global init.defaultObjectFormat / init.defaultRefFormat)
    "extensions.objectformat", "extensions.refstorage",
})
_MIRROR_SECTIONS = ("gc.", "pack.")


def _mirror_key(key: str, value: str) -> bool:
    if key == "include.path":
        return value == ORIGIN_URL_FILE
    if key.startswith("branch.") and key.rsplit(".", 1)[-1] in ("remote", "merge"):
        return True
    return key in _MIRROR_KEYS or key.startswith(_MIRROR_SECTIONS)


def _url_key(key: str, value: str) -> bool:
    return key == "remote.origin.url"


# ------------------------------------------------------------------------------------------------
# names


_REF_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def ref_component(text: str, *, limit: int = 80) -> str:
    """``text`` as one component of a branch name: ``[A-Za-z0-9._-]``, no ``..``, no leading
    ``-``/``.``, no ``.lock`` ending. A text that had to change gets a short hash of itself
    appended, so two keys that clean up alike (``issue:473``, ``issue/473``) never share a branch."""
    s = _REF_UNSAFE.sub("_", text.replace(":", "-"))
    s = re.sub(r"\.{2,}", ".", s).strip("._-")
    if s.endswith(".lock"):
        s = s[: -len(".lock")] + "_lock"
    s = s[:limit].strip("._-")
    if s != text or not s:
        s = f"{s or 'x'}-{hashlib.sha1(text.encode()).hexdigest()[:6]}"
    return s


@lru_cache(maxsize=4096)
def _valid_branch(name: str) -> bool:
    if not name or name.startswith("-"):
        return False
    rc, _ = run_git(["check-ref-format", "--branch", name], ok=(0, 1, 128), timeout=30)
    return rc == 0


def check_branch(name: str) -> str:
    """``name`` if it is a valid branch name (``git check-ref-format --branch``), else GitError."""
    if not _valid_branch(name):
        raise GitError(f"{name!r} is not a valid git branch name")
    return name


def branch_name(lane: str, key: str) -> str:
    """A task's branch: ``fleet/<lane>/<key made safe for a ref>``."""
    return check_branch(f"fleet/{ref_component(lane)}/{ref_component(key)}")


def integration_branch(batch_id: int | str) -> str:
    """A batch's integration branch: ``batch/<id>``."""
    return check_branch(f"batch/{ref_component(str(batch_id))}")


def member_branch(batch_id: int | str, n: int, key: str) -> str:
    """Member ``n`` of a batch: ``batch/<id>-m<n>-<safe key>``."""
    return check_branch(f"batch/{ref_component(str(batch_id))}-m{int(n)}-{ref_component(key)}")


def normalize_repo(repo: str) -> str:
    """A URL or scp-style address (``host:path``) as it is; a local path made absolute."""
    repo = repo.strip()
    if not repo or repo.startswith("-"):
        raise GitError(f"{repo!r} is not a repository path or URL")
    if "://" in repo:
        return repo
    first = repo.split("/", 1)[0]
    if ":" in first and not repo.startswith((".", "~")):
        return repo  # scp-like: [user@]host:path
    return os.path.abspath(os.path.expanduser(repo))


def mirror_name(repo: str) -> str:
    """The mirror's file name for a (normalized) repo: its last path part plus a hash of all of it."""
    tail = re.sub(r"\.git$", "", repo.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1])
    tail = _REF_UNSAFE.sub("_", tail).strip("._-")[:40] or "repo"
    return f"{tail}-{hashlib.sha256(repo.encode()).hexdigest()[:10]}"


# ------------------------------------------------------------------------------------------------
# the host lock


class _HostLock:
    def __init__(self) -> None:
        self.rlock = threading.RLock()
        self.depth = 0
        self.fd: int | None = None


_LOCKS: dict[str, _HostLock] = {}
_LOCKS_GUARD = threading.Lock()


@contextmanager
def _host_lock(path: Path, timeout: float, what: str) -> Iterator[None]:
    """Exclusive use of a mirror on this host, re-entrant within a thread."""
    with _LOCKS_GUARD:
        lk = _LOCKS.setdefault(str(path), _HostLock())
    deadline = time.monotonic() + timeout
    busy = MirrorBusy(f"the mirror {what} is busy: its lock {path} was held for more than {timeout:g} s",
                      "another shift is cloning or fetching it; try again later")
    if not lk.rlock.acquire(timeout=max(timeout, 0.0)):
        raise busy
    try:
        if lk.depth == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise busy from None
                        time.sleep(0.05)
            except BaseException:
                os.close(fd)
                raise
            lk.fd = fd
        lk.depth += 1
        try:
            yield
        finally:
            lk.depth -= 1
            if lk.depth == 0 and lk.fd is not None:
                fcntl.flock(lk.fd, fcntl.LOCK_UN)
                os.close(lk.fd)
                lk.fd = None
    finally:
        lk.rlock.release()


# ------------------------------------------------------------------------------------------------
# the mirror


class Mirror:
    """This host's bare mirror of ``repo`` at ``<cache_dir>/<safe name>.git`` (see the module
    docstring for its layout). Created on first use; cheap to construct."""

    def __init__(self, cache_dir: Path, repo: str, *, timeout: float = GIT_TIMEOUT,
                 lock_timeout: float = LOCK_TIMEOUT, excludes: Sequence[str] = DEFAULT_EXCLUDES,
                 identity: tuple[str, str] = IDENTITY) -> None:
        self.repo = normalize_repo(repo)
        self.cache_dir = Path(os.path.abspath(cache_dir))
        name = mirror_name(self.repo)
        self.path = self.cache_dir / f"{name}.git"
        self.lock_path = self.cache_dir / f"{name}.lock"
        self.timeout = timeout
        self.lock_timeout = lock_timeout
        self.excludes = tuple(excludes)
        self.identity = identity
        self._checked: list[tuple[int, ...] | None] | None = None  # the config files checked last

    def __repr__(self) -> str:
        return f"Mirror({_redact(self.repo)!r} at {str(self.path)!r})"

    @property
    def where(self) -> str:
        return f"mirror of {_redact(self.repo)}"

    def locked(self) -> AbstractContextManager[None]:
        """Hold the mirror's host lock (re-entrant in a thread)."""
        return _host_lock(self.lock_path, self.lock_timeout, _redact(self.repo))

    def run(self, *args: str, ok: Sequence[int] = (0,), timeout: float | None = None,
            git_dir: Path | None = None) -> tuple[int, str]:
        """git against the mirror (or ``git_dir``: the one being made), after
        :meth:`check_controls` for the mirror itself."""
        if git_dir is None or git_dir == self.path:
            self.check_controls()
        return run_git(args, git_dir=git_dir or self.path, timeout=timeout or self.timeout,
                       identity=self.identity, ok=ok, where=self.where)

    def git(self, *args: str) -> str:
        """Run a git command against the mirror; its stdout."""
        return self.run(*args)[1]

    def in_worktree(self, path: Path, *args: str, ok: Sequence[int] = (0,)) -> tuple[int, str]:
        """git in this mirror's worktree at ``path``, its repository named (:meth:`admin_dir`),
        never found through the ``.git`` file."""
        path = Path(os.path.abspath(path))
        admin = self.admin_dir(path)
        self.check_controls()
        return run_git(args, git_dir=admin, common_dir=self.path, work_tree=path, cwd=path,
                       timeout=self.timeout, identity=self.identity, ok=ok, where=f"worktree {path}")

    def admin_dir(self, path: Path) -> Path:
        """The folder ``<mirror>/worktrees/<id>`` of the worktree at ``path``, once it is sure that
        its ``.git`` file points there and that it points back at that ``.git`` (git wrote both;
        an agent works beside them): a :class:`GitError` otherwise, and no git runs."""
        dot_git = Path(os.path.abspath(path)) / ".git"
        if not dot_git.exists() and not dot_git.is_symlink():
            raise GitError(f"{path} is not a git worktree (no .git in it)")
        refuse = (f"{dot_git} is not what git wrote for a worktree of the {self.where}",
                  "something rewrote it (or moved the worktree): not running git on what it points at; "
                  "remove the workspace, and its worktree is made again from its branch")
        try:
            text = _read_control(dot_git)
        except OSError as exc:
            raise GitError(f"{refuse[0]}: it cannot be opened ({exc.strerror})", refuse[1]) from None
        target = text.removeprefix("gitdir: ").strip() if text.startswith("gitdir: ") else ""
        home = Path(os.path.realpath(self.path / "worktrees"))
        admin = Path(target)
        if (not target or "\n" in target or not admin.is_absolute() or admin.name in ("", ".", "..")
                or Path(os.path.realpath(admin.parent)) != home):
            raise GitError(f"{refuse[0]}: it points at {target[:200]!r}, not into {home}", refuse[1])
        admin = home / admin.name
        try:
            if not stat.S_ISDIR(os.lstat(admin).st_mode):
                raise GitError(f"{refuse[0]}: {admin} is not a folder", refuse[1])
            back = _read_control(admin / "gitdir").strip()
            common = _read_control(admin / "commondir").strip()
        except OSError as exc:
            raise GitError(f"{refuse[0]}: its registration {admin} cannot be read ({exc.strerror})",
                           refuse[1]) from None
        if not back or not _same(Path(back), dot_git):
            raise GitError(f"{refuse[0]}: its registration {admin} is that of {back[:200]!r}", refuse[1])
        # (git reads its refs where commondir says, whatever GIT_COMMON_DIR says)
        if not common or not _same(admin / common, self.path):
            raise GitError(f"{refuse[0]}: its registration {admin} names {common[:200]!r} as its repository",
                           refuse[1])
        return admin

    def check_controls(self) -> None:
        """Refuse (:class:`GitError`) a mirror whose config holds a setting lanefleet and git never
        write there (:data:`_MIRROR_KEYS`): a command, a helper, a URL rewrite, an include — what
        an agent committing in it could have planted for the shift's git to run with the fleet's
        rights — or that has an ``objects/info/alternates`` or ``commondir`` file. The config is
        read again whenever its files change (their size, times or inode)."""
        if not self.exists():
            return
        hint = "lanefleet does not use it, and a git the shift runs must not: remove it"
        for extra in ("commondir", "objects/info/alternates", "objects/info/http-alternates"):
            if os.path.lexists(self.path / extra):
                raise GitError(f"the {self.where} at {self.path} has a {extra} file, which lanefleet never "
                               f"writes: not running git on it", f"{hint} ({self.path / extra})")
        files = [self.path / "config", self.path / ORIGIN_URL_FILE]
        stamp: list[tuple[int, ...] | None] = []
        for f in files:
            try:
                st = os.lstat(f)
                stamp.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode))
            except FileNotFoundError:
                stamp.append(None)
        if stamp == self._checked:
            return
        for f, allowed in zip(files, (_mirror_key, _url_key), strict=True):
            if f.is_symlink() or (f.exists() and not f.is_file()):
                raise GitError(f"{f} (the {self.where}'s config) is not a plain file: not running git on it",
                               "remove the mirror; it is made again at the next fetch")
            if not f.exists():
                continue
            _, out = run_git(["config", "--file", str(f), "--no-includes", "--list", "-z"],
                             timeout=self.timeout, where=self.where)
            for entry in out.split("\0"):
                key, _, value = entry.partition("\n")
                if key and not allowed(key.lower(), value):
                    raise GitError(
                        f"{f} (the {self.where}'s config) sets {key}, which lanefleet never writes there: "
                        f"not running git on it (an agent working in the mirror may have planted it)",
                        f"check it and remove it (git config --file {f} --unset-all {key}); settings "
                        f"of your own (an ssh command, a credential helper) belong in your global config")
        self._checked = stamp

    def exists(self) -> bool:
        return (self.path / "HEAD").is_file()

    def ensure(self) -> None:
        """Create the mirror if this host has none (a clone: the first fetch)."""
        if self.exists():
            return
        with self.locked():
            if not self.exists():
                self._create()

    def fetch(self) -> None:
        """Bring ``refs/remotes/origin/*`` and tags up to date (creating the mirror if needed).
        Local branches are never touched."""
        with self.locked():
            if not self.exists():
                self._create()
                return
            self._write_excludes(self.path)
            if not (self.path / ORIGIN_URL_FILE).is_file():  # a mirror made before the URL moved out
                self._write_origin_url(self.path)
            self.run("fetch", "--prune", "--quiet", "origin")

    def _create(self) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.cache_dir.glob(f".{self.path.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)  # a creation that died (we hold the lock)
        tmp = self.cache_dir / f".{self.path.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            run_git(["init", "--bare", "--quiet", str(tmp)], timeout=self.timeout, where=self.where)
            self._write_origin_url(tmp)
            self.run("config", "remote.origin.fetch", FETCH_REFSPECS[0], git_dir=tmp)
            for spec in FETCH_REFSPECS[1:]:
                self.run("config", "--add", "remote.origin.fetch", spec, git_dir=tmp)
            # reflogs for the worktree branches: how an operator finds a lost commit again
            self.run("config", "core.logAllRefUpdates", "true", git_dir=tmp)
            os.chmod(tmp / "config", 0o600)
            self._write_excludes(tmp)
            self.run("fetch", "--prune", "--quiet", "origin", git_dir=tmp)
            os.rename(tmp, self.path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @property
    def origin_url_file(self) -> Path:
        """The file that holds origin's URL, which may carry a token (``https://user:token@host/…``):
        apart from the mirror's ``config`` (which includes it), so that the sandbox can hide it from
        an agent that works in the mirror; mode 0600."""
        return self.path / ORIGIN_URL_FILE

    def _write_origin_url(self, git_dir: Path) -> None:
        url_file = git_dir / ORIGIN_URL_FILE
        os.close(os.open(url_file, os.O_WRONLY | os.O_CREAT, 0o600))
        self.run("config", "--file", str(url_file), "remote.origin.url", self.repo, git_dir=git_dir)
        os.chmod(url_file, 0o600)  # (git writes a file anew: keep it the owner's alone)
        self.run("config", "--unset-all", "remote.origin.url", ok=(0, 5), git_dir=git_dir)
        if ORIGIN_URL_FILE not in self.run("config", "--get-all", "include.path", ok=(0, 1), git_dir=git_dir)[1].split():
            self.run("config", "--add", "include.path", ORIGIN_URL_FILE, git_dir=git_dir)

    def _write_excludes(self, git_dir: Path) -> None:
        if not self.excludes:
            return
        f = git_dir / "info" / "exclude"
        try:
            text = f.read_text()
        except FileNotFoundError:
            text = ""
        have = set(text.splitlines())
        missing = [p for p in self.excludes if p not in have]
        if missing:
            f.parent.mkdir(parents=True, exist_ok=True)
            sep = "" if not text or text.endswith("\n") else "\n"
            f.write_text(text + sep + "".join(p + "\n" for p in missing))

    # -- refs

    def rev(self, ref: str) -> str | None:
        """The commit ``ref`` names, or None if it does not exist."""
        _no_option(ref)
        rc, out = self.run("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", ok=(0, 1))
        return out.strip() if rc == 0 else None

    def is_ancestor(self, a: str, b: str) -> bool:
        """Whether commit ``a`` is ``b`` or an ancestor of it."""
        _no_option(a)
        _no_option(b)
        rc, _ = self.run("merge-base", "--is-ancestor", a, b, ok=(0, 1))
        return rc == 0


def _read_control(path: Path) -> str:
    """A small git control file an agent may have replaced: never through a link, never a FIFO
    (which would hold the shift), at most 4 KiB. OSError (ELOOP, or EINVAL: not a file) else."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(22, "not a file")
        return os.read(fd, 4096).decode(errors="replace")
    finally:
        os.close(fd)


def _no_option(rev: str) -> None:
    if not rev or rev.startswith("-"):
        raise GitError(f"{rev!r} is not a revision")


def _local(branch: str) -> str:
    return f"refs/heads/{branch}"


def _remote(branch: str) -> str:
    return f"refs/remotes/origin/{branch}"


def branch_head(mirror: Mirror, branch: str, *, remote: bool = False) -> str | None:
    """The head of this host's ``branch`` (or of origin's copy as last fetched), or None."""
    return mirror.rev(_remote(check_branch(branch)) if remote else _local(check_branch(branch)))


def merge_base(mirror: Mirror, a: str, b: str) -> str | None:
    """The best common ancestor of two revisions (for a member not landed yet: where it was cut)."""
    _no_option(a)
    _no_option(b)
    rc, out = mirror.run("merge-base", a, b, ok=(0, 1))
    return out.strip() if rc == 0 and out.strip() else None


def commits_between(mirror: Mirror, a: str, b: str) -> list[str]:
    """The commits reachable from ``b`` but not from ``a``, oldest first (``git rev-list a..b``).
    Give commits or full refs (``refs/heads/...``): in the mirror a short name like ``main``
    names no local branch."""
    _no_option(a)
    _no_option(b)
    out = mirror.git("rev-list", "--reverse", "--topo-order", f"{a}..{b}", "--")
    return out.split()


# ------------------------------------------------------------------------------------------------
# worktrees


@dataclass(frozen=True)
class WorktreeInfo:
    path: Path
    head: str | None
    branch: str | None  # the short branch name; None when detached
    prunable: bool


def worktrees(mirror: Mirror) -> list[WorktreeInfo]:
    """The worktrees registered in the mirror (the mirror itself left out)."""
    if not mirror.exists():
        return []
    found: list[WorktreeInfo] = []
    for record in mirror.git("worktree", "list", "--porcelain", "-z").split("\0\0"):
        attrs: dict[str, str] = {}
        for item in record.split("\0"):
            if item:
                k, _, v = item.partition(" ")
                attrs[k] = v
        if "worktree" not in attrs or "bare" in attrs:
            continue
        ref = attrs.get("branch")
        found.append(WorktreeInfo(
            path=Path(attrs["worktree"]), head=attrs.get("HEAD"),
            branch=ref.removeprefix("refs/heads/") if ref else None, prunable="prunable" in attrs))
    return found


def _same(a: Path, b: Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _holder(mirror: Mirror, branch: str) -> WorktreeInfo | None:
    """The live worktree that has ``branch`` checked out, if any."""
    for w in worktrees(mirror):
        if w.branch == branch and not w.prunable:
            return w
    return None


def _move_branch(mirror: Mirror, branch: str, new: str, old: str, why: str) -> None:
    """Fast-forward ``branch`` from ``old`` to ``new``: in the worktree holding it (its files
    follow), else with a compare-and-swap ``update-ref``."""
    holder = _holder(mirror, branch)
    if holder is not None:
        mirror.in_worktree(holder.path, "merge", "--ff-only", "--quiet", new)
    else:
        mirror.git("update-ref", "-m", f"lanefleet: {why}", _local(branch), new, old)


def _catch_up(mirror: Mirror, branch: str) -> str | None:
    """Bring the local ``branch`` up to origin's copy when origin is ahead (another host pushed
    more of it); keep it when it is ahead (commits not pushed yet); raise when they diverged.
    Returns the local head (None: no local branch)."""
    local, remote = mirror.rev(_local(branch)), mirror.rev(_remote(branch))
    if local is None or remote is None or local == remote:
        return local
    if mirror.is_ancestor(local, remote):
        _move_branch(mirror, branch, remote, local, "fast-forward to origin")
        return remote
    if mirror.is_ancestor(remote, local):
        return local
    raise BranchDiverged(
        f"branch {branch} diverged: this host has {local[:12]}, origin has {remote[:12]}",
        f"each has commits the other lacks; reconcile by hand in {mirror.path} "
        f"(git log {_local(branch)}...{_remote(branch)})")


def _ensure_worktree(mirror: Mirror, path: Path, branch: str, start_ref: str, start_label: str) -> str:
    registered = worktrees(mirror)
    here = next((w for w in registered if _same(w.path, path)), None)
    if here is not None and (path / ".git").exists():
        if here.branch != branch:
            raise GitError(
                f"the worktree {path} is on {here.branch or 'a detached HEAD'}, not on {branch}",
                "something switched branches in it; switch it back, or remove the worktree")
        _catch_up(mirror, branch)
        return mirror.in_worktree(path, "rev-parse", "HEAD")[1].strip()
    if (path / ".git").exists():
        raise GitError(f"{path} holds a git checkout that is not a worktree of the {mirror.where}",
                       "move it away or remove it")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise GitError(f"{path} exists and is not a worktree of the {mirror.where}",
                       "a task worktree is created at that path: move the directory away or remove it")
    if any(w.prunable or _same(w.path, path) for w in registered):
        mirror.git("worktree", "prune")  # registrations whose directory is gone (a reaped workspace)
    holder = _holder(mirror, branch)
    if holder is not None:
        raise GitError(f"branch {branch} is checked out in another worktree, {holder.path}",
                       f"remove that worktree first (it is not {path})")
    path.parent.mkdir(parents=True, exist_ok=True)
    if mirror.rev(_local(branch)) is not None:
        _catch_up(mirror, branch)
        mirror.git("worktree", "add", "--quiet", str(path), branch)
    elif mirror.rev(_remote(branch)) is not None:  # pushed by another host (a hand-off)
        mirror.git("worktree", "add", "--quiet", "--no-track", "-b", branch, str(path), _remote(branch))
    elif mirror.rev(start_ref) is not None:
        mirror.git("worktree", "add", "--quiet", "--no-track", "-b", branch, str(path), start_ref)
    else:
        raise GitError(f"{start_label} does not exist in {_redact(mirror.repo)}",
                       "check the lane's base branch")
    return mirror.in_worktree(path, "rev-parse", "HEAD")[1].strip()


#: a worktree's registration files git trusts (where the repository is, where the worktree is,
#: its own config): read-only to an agent, beside the HEAD, index and logs it writes
_ADMIN_FILES = ("commondir", "gitdir", "config.worktree")


def agent_binds(mirror: Mirror, workspace: Path) -> tuple[list[Path], list[Path]]:
    """What the sandbox of an agent working in ``workspace`` (a worktree of ``mirror``, or not) binds
    of the mirror (worker.agent.sandbox.Sandbox.argv): ``(writable, protect)``.

    ``writable``, bound read-write in this order: the mirror (its objects, refs, logs: where the
    agent's commits go), its ``worktrees/`` folder and each worktree's own folder there — each a
    mount point of its own, so that none can be renamed away with the read-only files in it and
    made again. ``protect``, bound read-only over themselves after everything else: the mirror's
    ``config`` and the files it may include (``*.config``), ``hooks/`` and ``info/`` (attributes,
    excludes), every worktree's :data:`_ADMIN_FILES` and the workspace's own ``.git`` file. A
    symbolic link is never bound (it would show what it points to)."""
    ws = Path(os.path.abspath(workspace))
    root = mirror.path
    writable = [root]
    protect: list[Path] = []

    def real(p: Path, kind: str) -> bool:
        try:
            mode = os.lstat(p).st_mode
        except OSError:
            return False
        return stat.S_ISDIR(mode) if kind == "dir" else stat.S_ISREG(mode)

    for name in ("config", "hooks", "info"):
        if real(root / name, "file" if name == "config" else "dir"):
            protect.append(root / name)
    protect += sorted(p for p in root.glob("*.config") if real(p, "file"))
    if real(root / "worktrees", "dir"):
        writable.append(root / "worktrees")
        for admin in sorted((root / "worktrees").iterdir()):
            if real(admin, "dir"):
                writable.append(admin)
                protect += [admin / f for f in _ADMIN_FILES if real(admin / f, "file")]
    if real(ws / ".git", "file"):
        protect.append(ws / ".git")
    return writable, protect


def ensure_task_worktree(mirror: Mirror, path: Path, branch: str, base: str) -> str:
    """A task's worktree at ``path`` on ``branch``; returns its head commit.

    Fetches first. At first use the branch is cut from ``origin/<base>``. An existing worktree is
    reused as it is (commits and uncommitted files kept: a retried attempt finds its work), fast-
    forwarded when origin holds more of the branch. When the path is gone but the branch exists —
    on this host, or on origin because another host pushed it at a hand-off — the worktree is
    made again from that branch. A branch that diverged from origin raises
    :class:`BranchDiverged`; a path holding something else raises :class:`GitError`."""
    check_branch(branch)
    check_branch(base)
    path = Path(os.path.abspath(path))
    with mirror.locked():
        mirror.fetch()
        return _ensure_worktree(mirror, path, branch, _remote(base), f"base branch {base!r} on origin")


def _push(mirror: Mirror, *args: str) -> None:
    try:
        mirror.run("push", "--quiet", *args)
    except GitError as exc:
        if any(s in exc.stderr for s in ("rejected", "stale info", "non-fast-forward", "fetch first")):
            raise PushRejected(exc.message, "fetch and look at what moved on origin", cmd=exc.cmd,
                               returncode=exc.returncode, stderr=exc.stderr) from None
        raise


def _reflog(mirror: Mirror, branch: str) -> set[str]:
    """Every commit this host's ``branch`` has pointed at (its reflog, kept by the mirror)."""
    rc, out = mirror.run("rev-list", "--walk-reflogs", "--format=%H", "--no-commit-header",
                         _local(branch), "--", ok=(0, 128))
    return set(out.split()) if rc == 0 else set()


def push(mirror: Mirror, branch: str, *, rewrite: bool = True) -> str:
    """Push this host's ``branch`` to origin; returns the pushed commit.

    Always a compare-and-swap against origin's branch as this host last fetched it
    (``--force-with-lease=<ref>:<that commit>``, or "absent"): if it moved since, origin refuses
    and :class:`PushRejected` is raised. Beyond that, the push must fast-forward origin's branch,
    except — with ``rewrite`` (the default, for a task's or a member's own branch) — when origin's
    tip is a commit this host's branch once held (in its reflog): then the agent rewrote history
    this host pushed (an amend, a rebase) and the push replaces it. A tip this host never had is
    another host's work: refused, never overwritten (a lease alone would not say so, since a
    fetch makes the lease match whatever is on origin)."""
    check_branch(branch)
    with mirror.locked():
        sha = mirror.rev(_local(branch))
        if sha is None:
            raise GitError(f"no local branch {branch} in the {mirror.where} to push")
        expected = mirror.rev(_remote(branch))
        if expected is not None and expected != sha and not mirror.is_ancestor(expected, sha):
            if not (rewrite and expected in _reflog(mirror, branch)):
                raise PushRejected(
                    f"origin's {branch} ({expected[:12]}) has commits this host's branch "
                    f"({sha[:12]}) never had: not pushing over them",
                    "another host went on with this branch; reconcile by hand")
        _push(mirror, f"--force-with-lease={_local(branch)}:{expected or ''}", "origin",
              f"{_local(branch)}:{_local(branch)}")
        return sha


def remove_worktree(mirror: Mirror, path: Path) -> bool:
    """Remove the worktree at ``path`` (its files, even uncommitted ones; its branch is kept) and
    prune the registrations of worktrees whose directory is gone. True if one was removed.

    ``git worktree remove`` deletes the directory itself; a reaper that deletes workspaces its own
    careful way (worker.workspace.disk.remove_workspace) calls :func:`prune` after it instead."""
    path = Path(os.path.abspath(path))
    if not mirror.exists():
        return False
    with mirror.locked():
        here = next((w for w in worktrees(mirror) if _same(w.path, path)), None)
        removed = False
        if here is not None and not here.prunable and path.exists():
            mirror.git("worktree", "remove", "--force", "--force", str(path))
            removed = True
        mirror.git("worktree", "prune")
        return removed


def prune(mirror: Mirror) -> None:
    """Forget worktrees whose directory is gone (``git worktree prune``)."""
    if not mirror.exists():
        return
    with mirror.locked():
        mirror.git("worktree", "prune")


def delete_branch(mirror: Mirror, branch: str, *, remote: bool = False) -> None:
    """Delete this host's ``branch`` (and origin's with ``remote``); absent ones are fine.
    A branch still checked out in a worktree raises :class:`GitError`: remove that first."""
    check_branch(branch)
    with mirror.locked():
        local = mirror.rev(_local(branch))
        if local is not None:
            holder = _holder(mirror, branch)
            if holder is not None:
                raise GitError(f"branch {branch} is checked out in {holder.path}", "remove the worktree first")
            mirror.git("update-ref", "-d", _local(branch), local)
        if remote and mirror.rev(_remote(branch)) is not None:
            _push(mirror, f"--force-with-lease={_local(branch)}:{mirror.rev(_remote(branch))}",
                  "origin", f":{_local(branch)}")


def dirty_files(mirror: Mirror, path: Path, *, untracked: bool = False) -> list[str]:
    """Files of the worktree at ``path`` changed but not committed (with ``untracked``, new
    files not ignored too). ``/.fleet/`` is excluded in every worktree of the mirror."""
    args = ["status", "--porcelain", "-z", f"--untracked-files={'all' if untracked else 'no'}"]
    out = mirror.in_worktree(Path(path), *args)[1]
    entries = out.split("\0")
    files: list[str] = []
    skip = False
    for e in entries:
        if skip:  # the source path of a rename
            skip = False
            continue
        if len(e) > 3:
            files.append(e[3:])
            skip = e[0] in "RC"
    return files


def commit_all(mirror: Mirror, path: Path, message: str) -> str | None:
    """Commit everything the agent left uncommitted in the worktree (``git add -A``, hooks not
    run), as lanefleet; returns the new head, or None when there was nothing to commit. For a
    hand-off: what is not committed is not pushed, and another host would not see it."""
    path = Path(path)
    mirror.in_worktree(path, "add", "-A")
    rc, _ = mirror.in_worktree(path, "diff", "--cached", "--quiet", ok=(0, 1))
    if rc == 0:
        return None
    mirror.in_worktree(path, "commit", "--quiet", "--no-verify", "-m", message)
    return mirror.in_worktree(path, "rev-parse", "HEAD")[1].strip()


# ------------------------------------------------------------------------------------------------
# batches: the integration branch, member branches, landing


@dataclass(frozen=True)
class LandResult:
    landed: bool  # the member's head is on the integration branch now (always True on return)
    already: bool  # it was before this call: nothing moved (but a push origin lacked was made)
    old_head: str  # the integration branch before
    new_head: str  # and after
    commits: list[str] = field(default_factory=list)  # what this landing brought, oldest first


def _sync_integration(mirror: Mirror, branch: str) -> str:
    """This host's integration branch, created from origin's when missing and caught up with it;
    its head. It must exist somewhere (:func:`ensure_integration_branch` made it)."""
    local, remote = mirror.rev(_local(branch)), mirror.rev(_remote(branch))
    if local is None:
        if remote is None:
            raise GitError(f"the integration branch {branch} does not exist in the {mirror.where}",
                           "create it with ensure_integration_branch first")
        mirror.git("update-ref", "-m", "lanefleet: integration branch from origin", _local(branch), remote, "")
        return remote
    head = _catch_up(mirror, branch)
    assert head is not None
    return head


def ensure_integration_branch(mirror: Mirror, branch: str, base: str) -> str:
    """The batch's integration branch ``branch``, cut from ``origin/<base>`` if neither this host
    nor origin has it, and pushed (fast-forward only); returns its head. Idempotent: a branch
    that exists is caught up with origin (or pushed, if this host is ahead)."""
    check_branch(branch)
    check_branch(base)
    with mirror.locked():
        mirror.fetch()
        if mirror.rev(_local(branch)) is None and mirror.rev(_remote(branch)) is None:
            start = mirror.rev(_remote(base))
            if start is None:
                raise GitError(f"base branch {base!r} does not exist on origin ({_redact(mirror.repo)})",
                               "check the lane's base branch")
            mirror.git("update-ref", "-m", f"lanefleet: integration branch from {base}",
                       _local(branch), start, "")
        head = _sync_integration(mirror, branch)
        if mirror.rev(_remote(branch)) != head:
            _push(mirror, "origin", f"{_local(branch)}:{_local(branch)}")
        return head


def cut_member_branch(mirror: Mirror, path: Path, member_branch: str, integration_branch: str,
                      *, push_branch: bool = True) -> str:
    """Member ``member_branch``'s own worktree at ``path``, the branch cut from the integration
    branch's current head at first use (then pushed, with ``push_branch``, so another host can
    take the member over); later calls reuse it like :func:`ensure_task_worktree`. Returns the
    worktree's head — at the first call, the cut point. Before the member lands,
    ``merge_base(mirror, member, integration)`` gives the cut point again."""
    check_branch(member_branch)
    check_branch(integration_branch)
    path = Path(os.path.abspath(path))
    with mirror.locked():
        mirror.fetch()
        _sync_integration(mirror, integration_branch)
        head = _ensure_worktree(mirror, path, member_branch, _local(integration_branch),
                                f"integration branch {integration_branch!r}")
        if push_branch and mirror.rev(_remote(member_branch)) is None:
            push(mirror, member_branch)
        return head


def land_ff_only(mirror: Mirror, member_branch: str, integration_branch: str, *,
                 cut: str | None = None, require_clean: bool = True) -> LandResult:
    """Land a member on the integration branch, fast-forward only, and push it.

    Idempotent: when the integration branch already contains the member's head, nothing moves
    and ``already`` is True (``commits`` is then ``cut..head`` when the member's cut point is
    given, else empty) — the call after a crash between the push and the caller's record. Else
    the integration head must be an ancestor of the member's head: origin's branch is pushed
    first (a plain push, which origin accepts only as a fast-forward, so two hosts can never both
    land on the same head), then this host's branch follows. Raises :class:`LandingFailed` — the
    integration branch unchanged — when it cannot fast-forward, when origin refuses, or (with
    ``require_clean``) when the member's worktree has uncommitted changes to tracked files
    (those would not land, though the gate saw them)."""
    check_branch(member_branch)
    check_branch(integration_branch)
    with mirror.locked():
        mirror.fetch()
        member = mirror.rev(_local(member_branch)) or mirror.rev(_remote(member_branch))
        if member is None:
            raise GitError(f"no member branch {member_branch} in the {mirror.where}")
        try:
            old = _sync_integration(mirror, integration_branch)
        except BranchDiverged as exc:
            raise LandingFailed(exc.message, exc.hint) from exc
        if mirror.rev(_remote(integration_branch)) != old:
            _push(mirror, "origin", f"{_local(integration_branch)}:{_local(integration_branch)}")
        if mirror.is_ancestor(member, old):
            done = commits_between(mirror, cut, member) if cut else []
            return LandResult(landed=True, already=True, old_head=old, new_head=old, commits=done)
        if not mirror.is_ancestor(old, member):
            raise LandingFailed(
                f"{member_branch} ({member[:12]}) does not fast-forward {integration_branch} "
                f"({old[:12]}): it was not cut from the integration branch's head",
                "evict the member, or rebase it on the integration branch and land it again")
        holder = _holder(mirror, member_branch)
        if require_clean and holder is not None:
            dirty = dirty_files(mirror, holder.path)
            if dirty:
                raise LandingFailed(
                    f"{member_branch} has uncommitted changes in {holder.path}: "
                    f"{', '.join(dirty[:5])}{' …' if len(dirty) > 5 else ''}",
                    "commit them (or discard them) before landing: only commits land")
        commits = commits_between(mirror, old, member)
        try:
            _push(mirror, "origin", f"{member}:{_local(integration_branch)}")
        except GitError as exc:
            raise LandingFailed(f"landing {member_branch} on {integration_branch}: {exc.message}",
                                exc.hint, cmd=exc.cmd, returncode=exc.returncode,
                                stderr=exc.stderr) from exc
        _move_branch(mirror, integration_branch, member, old, f"landed {member_branch}")
        return LandResult(landed=True, already=False, old_head=old, new_head=member, commits=commits)
