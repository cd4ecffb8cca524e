"""Agents run apart from the fleet's credentials (README "Running coding agents").

An agent is untrusted code: whatever the shift can read, a prompt-injected agent can leak. Two
halves keep the fleet's credentials out of its reach:

- **Its environment is an allow-list** (:func:`worker.agent.executor.agent_env`): the base set, the
  task's ``FLEET_*`` variables, and what its lane and profile name — ``agent_env`` (names passed
  through from the shift's environment) and ``agent_env_file`` (KEY=VALUE lines the shift reads
  with :func:`read_env_file`: mode 0600 and the shift's own, or the shift refuses to start).
- **Its files: under ``sandbox = "bwrap"``** it runs in bubblewrap (:class:`Sandbox` builds the argv
  prefix): the whole file system read-only, a fresh ``/dev``, ``/proc`` (its own PID namespace: it
  sees no other process, so no other process's environment) and ``/tmp``; the shift's HOME replaced
  by an empty per-task one (``<workspace>/.fleet/home``); the fleet's own files hidden — the config
  file, every ``agent_env_file``, ``.env`` beside the config, the fleet's home (``.fleet/``: the
  embedded database, the dev stack's keys, logs), the workspaces root (every other task), the git
  cache, ``PGPASSFILE``; its own workspace read-write; the shift's guard socket, so that ``fleet
  guard`` works; the lane's repository mirror read-write (commits go there) but for the file that
  holds origin's URL (it may carry a token; the shift fetches and pushes) and its git control
  files, read-only (worker.workspace.git.agent_binds: the shift's git trusts them); the shift's Python
  and lanefleet read-only where they were under something hidden. The network is kept: agents
  call their APIs.

The supervisor (worker/agent/supervisor.py) stays outside: bwrap is the agent's program, in the
agent's process group, and killing that group kills bwrap's PID namespace, everything in it
included, whatever sessions or groups its processes made inside. bwrap's outer process does not
pass signals on, so the supervisor sends a graceful stop to the group's other processes (``--sandboxed``).

Where bwrap is missing or cannot make its namespaces, an agent that asks for it does not run:
the shift refuses to start (:func:`bwrap_problem` at its start), or, for a profile only a task
named, the attempt fails with the reason. Never silently unsandboxed.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from worker.config import ENV_NAME, FleetConfig, LaneConfig, ProfileConfig
from worker.errors import ConfigError, one_line
from worker.files import own_folder, write_atomic

Mode = Literal["bwrap", "none"]
#: the agents whose CLIs run sandboxed unless their lane or profile says ``sandbox = "none"``:
#: every adapter but ``generic`` (a scripted agent, a gate-like command)
SANDBOXED_BY_DEFAULT = frozenset({"claude", "codex", "opencode", "gemini"})
#: where an agent's HOME lives under the sandbox: in its workspace, kept across its attempts on
#: the host (caches, a CLI's state), never committed (``.fleet/`` is excluded), reaped with it
TASK_HOME = Path(".fleet") / "home"
#: namespaces an agent gets of its own; not the network (agents call their APIs) nor users
UNSHARE = ("--unshare-pid", "--unshare-ipc", "--unshare-cgroup-try")
#: the host's sockets that open more than a file would: PostgreSQL's (the fleet's database, where
#: it trusts local connections), container engines' (root on the host), the user's session (its
#: bus, keyring, gpg and ssh agents). Hidden too; the network itself is kept.
HOST_SOCKETS = ("/run/postgresql", "/var/run/postgresql", "/run/docker.sock", "/var/run/docker.sock",
                "/run/containerd", "/run/podman", "/run/user/{uid}")


class CannotConfine(OSError):
    """An agent could not be given what its lane asks (no bwrap, a bad agent_env_file): it is not
    started. An OSError, which the paths that start an agent turn into a failed attempt (or a
    broken gate)."""


@dataclass(frozen=True)
class AgentRules:
    """What the agents of one dispatch (a lane, and the profile it runs) may see."""

    where: str  # "lanes.docs" or "lanes.docs + profiles.claude"
    sandbox: Mode
    sandbox_from: str  # why: "lanes.docs.sandbox", "profiles.claude.sandbox", or the default for its agent
    env: tuple[str, ...] = ()  # names passed through from the shift's environment
    env_files: tuple[tuple[str, Path], ...] = ()  # (the field, the file)
    ro: tuple[str, ...] = ()
    rw: tuple[str, ...] = ()
    hide: tuple[str, ...] = ()
    base_dir: Path = field(default_factory=Path.cwd)  # what relative paths are relative to (the config's folder)

    def paths(self, which: Iterable[str]) -> list[Path]:
        """Configured paths made absolute: ``~`` is the shift's HOME, a relative one the config's folder."""
        out = []
        for p in which:
            path = Path(os.path.expanduser(p))
            out.append(Path(os.path.abspath(path if path.is_absolute() else self.base_dir / path)))
        return out

    def describe(self) -> str:
        """One line for logs and ``fleet profiles``."""
        parts = [f"sandbox {self.sandbox} ({self.sandbox_from})"]
        if self.env:
            parts.append("env " + ",".join(self.env))
        if self.env_files:
            parts.append("env file " + ",".join(str(p) for _, p in self.env_files))
        for label, paths in (("ro", self.ro), ("rw", self.rw), ("hidden", self.hide)):
            if paths:
                parts.append(f"{label} " + ",".join(paths))
        return "; ".join(parts)


def rules_for(cfg: FleetConfig, lane_name: str, profile: str | None, agent: str) -> AgentRules:
    """The rules of a dispatch of ``lane_name`` with ``profile`` (its agent's adapter: ``agent``).

    A profile's settings add to its lane's: the names, files and paths of both; a sandbox either
    asks for is kept (``"bwrap"`` from one of them wins over ``"none"`` from the other); neither
    saying: bwrap for a real agent CLI (:data:`SANDBOXED_BY_DEFAULT`), none for ``generic``."""
    lane = cfg.lane(lane_name)
    parts: list[tuple[str, LaneConfig | ProfileConfig]] = [(f"lanes.{lane_name}", lane)]
    prof = cfg.profiles.get(profile) if profile else None
    if prof is not None:
        parts.append((f"profiles.{profile}", prof))
    said = [(f"{where}.sandbox", s.sandbox) for where, s in parts if s.sandbox is not None]
    asked = [w for w, m in said if m == "bwrap"]
    mode: Mode
    if asked:
        mode, origin = "bwrap", asked[0]
    elif said:
        mode, origin = "none", said[0][0]
    else:
        mode = "bwrap" if agent in SANDBOXED_BY_DEFAULT else "none"
        origin = f"the default for agent {agent}"
    return AgentRules(
        where=" + ".join(w for w, _ in parts), sandbox=mode, sandbox_from=origin,
        env=tuple(dict.fromkeys(n for _, s in parts for n in s.agent_env)),
        env_files=tuple((f"{w}.agent_env_file", cfg.path(Path(os.path.expanduser(s.agent_env_file))))
                        for w, s in parts if s.agent_env_file is not None),
        ro=tuple(p for _, s in parts for p in s.sandbox_ro), rw=tuple(p for _, s in parts for p in s.sandbox_rw),
        hide=tuple(p for _, s in parts for p in s.sandbox_hide), base_dir=cfg.base_dir,
    )


# ------------------------------------------------------------------------------------------------
# agent_env_file


def read_env_file(where: str, path: Path) -> dict[str, str]:
    """The KEY=VALUE lines of an ``agent_env_file`` (``where``: its field). Blank lines and lines
    starting with ``#`` are skipped, ``export`` before a name is allowed, one pair of quotes around
    a value is taken off; nothing is expanded. The file must be a regular file of the user running
    the shift, readable by its owner alone (mode 0600 or 0400): a ConfigError naming the field and
    the file otherwise (never its values)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{where}: {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{where}: {path} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{where}: {path} is not a file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ConfigError(f"{where}: {path} is mode {mode:04o}; it holds agents' secrets, so only its owner "
                          f"may read it", f"chmod 600 {path}")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{where}: {path} belongs to uid {st.st_uid}, not to the user running the shift "
                          f"(uid {os.geteuid()})", "chown it, or give the shift's user a file of its own")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: {path} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    values: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, eq, value = line.removeprefix("export ").partition("=")
        name = name.strip()
        if not eq or not ENV_NAME.match(name):
            raise ConfigError(f"{where}: {path} line {n} is not KEY=VALUE")
        if name.startswith("FLEET_") or name == "HOME":
            raise ConfigError(f"{where}: {path} line {n}: {name} is set by the shift, not by the file")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name] = value
    return values


# ------------------------------------------------------------------------------------------------
# bwrap


_PROBED: dict[str, str | None] = {}


def bwrap_binary() -> str | None:
    return shutil.which("bwrap")


def bwrap_problem() -> str | None:
    """Why bwrap cannot sandbox an agent on this host (not installed, cannot make its namespaces);
    None when it can. Asked once per process: a sandbox of the same flags as an agent's runs ``true``."""
    binary = bwrap_binary()
    if binary is None:
        return "bwrap is not installed"
    if binary not in _PROBED:
        argv = [binary, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
                *UNSHARE, *_caps(), "--", "true"]
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30,
                                  check=False)
            why = None if done.returncode == 0 else (
                f"bwrap cannot make its sandbox here (exit {done.returncode}: "
                f"{one_line(done.stderr or done.stdout)[:300] or 'no message'})")
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = f"bwrap cannot make its sandbox here ({exc})"
        _PROBED[binary] = why
    return _PROBED[binary]


def _caps() -> tuple[str, ...]:
    # as root bwrap keeps the caller's capabilities, with which an agent could unmount what hides
    # the fleet's files: it drops them all (unprivileged, its user namespace gives none to keep)
    return ("--cap-drop", "ALL") if os.geteuid() == 0 else ()


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


@dataclass
class _Mount:
    kind: Literal["bind", "tmpfs", "special"]
    dest: Path
    src: Path | None = None  # a bind's source (None: not a bind)


class _View:
    """The mounts so far, in order, to tell what a path shows inside (the last mount over it decides)."""

    def __init__(self) -> None:
        self.args: list[str] = []
        self.mounts: list[_Mount] = []

    def shows_host(self, path: Path) -> bool:
        """Whether ``path`` inside is the host's own ``path`` (not hidden, not replaced)."""
        for m in reversed(self.mounts):
            if _under(path, m.dest):
                return m.kind == "bind" and m.src == m.dest
        return False

    def bind(self, src: Path, dest: Path, *, rw: bool, try_: bool = False) -> None:
        flag = ("--bind" if rw else "--ro-bind") + ("-try" if try_ else "")
        self.args += [flag, str(src), str(dest)]
        self.mounts.append(_Mount("bind", dest, src))

    def tmpfs(self, dest: Path) -> None:
        self.args += ["--tmpfs", str(dest)]
        self.mounts.append(_Mount("tmpfs", dest))

    def hide_file(self, dest: Path) -> None:
        # a device node on a bind mount, which bwrap makes nodev: opening it fails (EACCES)
        self.args += ["--ro-bind", "/dev/null", str(dest)]
        self.mounts.append(_Mount("special", dest))


def _home() -> Path:
    return Path(os.path.abspath(os.path.expanduser("~")))


def _passwd_home() -> Path | None:
    try:
        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:  # pragma: no cover - a uid without a passwd entry
        return None


def fleet_secrets(cfg: FleetConfig, environ: Mapping[str, str]) -> tuple[list[Path], list[Path]]:
    """What the sandbox hides of the fleet's own, whatever a lane binds: (folders, files)."""
    folders = [cfg.path(cfg.fleet.home), cfg.path(cfg.fleet.workspaces), cfg.path(cfg.fleet.git_cache)]
    files = [cfg.base_dir / ".env", Path.cwd() / ".env", Path.cwd() / "fleet.toml"]
    if cfg.source is not None:
        files.append(cfg.source)
    for settings in [*cfg.lanes.values(), *cfg.profiles.values()]:
        if settings.agent_env_file is not None:
            files.append(cfg.path(Path(os.path.expanduser(settings.agent_env_file))))
    for name in ("PGPASSFILE", "PGSERVICEFILE", "FLEET_CONFIG"):
        if environ.get(name):
            files.append(Path(environ[name]))
    files.append(_home() / ".pgpass")  # (under HOME, hidden with it unless a lane binds HOME)
    sockets = [Path(p.format(uid=os.getuid())) for p in HOST_SOCKETS]
    # a symbolic link is followed: what is hidden is what it points to (/var/run is /run)
    return ([Path(os.path.realpath(p)) for p in (*folders, *sockets)], [Path(os.path.realpath(p)) for p in files])


def runtime_paths() -> list[Path]:
    """What ``fleet guard`` (and an agent run by ``python``) needs of the shift's Python and of
    lanefleet: shown read-only again where they lie under something the sandbox hides (HOME)."""
    import worker

    package = Path(worker.__file__).resolve().parent
    found = {Path(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix)}
    found |= {Path(os.path.realpath(sys.executable)).parent, package, package.parent / "monitor"}
    return sorted(p for p in found if p.exists())


class Sandbox:
    """The bwrap argv prefix for the agents of one shift. What is the same for all of them is worked
    out once (the fleet's secrets, the shift's runtime, the guard's socket folder); :meth:`argv`
    adds one agent's own (its workspace, its lane's paths, its program)."""

    def __init__(self, cfg: FleetConfig, environ: Mapping[str, str], *, guard_dir: Path | None,
                 binary: str | None = None) -> None:
        self.binary = binary or bwrap_binary() or "bwrap"
        self.home = _home()
        passwd = _passwd_home()
        self.passwd_home = passwd if passwd is not None and passwd != self.home else None
        self.secret_dirs, self.secret_files = fleet_secrets(cfg, environ)
        self.runtime = runtime_paths()
        self.guard_dir = guard_dir

    def task_home(self, workspace: Path) -> Path:
        return workspace / TASK_HOME

    def argv(self, rules: AgentRules, workspace: Path, *, program: str | None = None,
             writable: Iterable[Path] = (), secret: Iterable[Path] = (),
             protect: Iterable[Path] = ()) -> list[str]:
        """``bwrap … --`` for an agent working in ``workspace`` (made first: its HOME folder).
        ``program``: the agent's executable as found on its PATH, shown again if it lies under
        something hidden; ``writable``: more folders it works in (the lane's git mirror), bound
        in their order; ``secret``: files in them it must not read (the mirror's origin URL, which
        may hold a token); ``protect``: files and folders it may read but not change, bound
        read-only over themselves after everything else, its workspace included (the git control
        files of the mirror and of its worktree, which the shift's git would trust: see
        worker.workspace.git.agent_binds). A protected path that is missing, a symbolic link, a
        secret or not shown is skipped."""
        ws = Path(os.path.abspath(workspace))
        v = _View()
        v.bind(Path("/"), Path("/"), rw=False)
        v.args += ["--dev", "/dev", "--proc", "/proc"]
        v.mounts += [_Mount("special", Path("/dev")), _Mount("special", Path("/proc"))]
        v.tmpfs(Path("/tmp"))
        ro, rw = rules.paths(rules.ro), rules.paths(rules.rw)
        home_bound = self.home in ro or self.home in rw
        if not home_bound and self.home != Path("/"):
            # a link the agent left in its place (to the shift's HOME) is removed, never bound
            home = own_folder(ws, self.task_home(ws))
            v.bind(home, self.home, rw=True)
        if self.passwd_home is not None and self.passwd_home != Path("/") and v.shows_host(self.passwd_home):
            v.tmpfs(self.passwd_home)
        for p in ro:
            v.bind(p, p, rw=False, try_=True)
        for p in rw:
            v.bind(p, p, rw=True, try_=True)
        hidden = [*self.secret_dirs, *self.secret_files, *rules.paths(rules.hide)]
        for p in hidden:
            if not v.shows_host(p):
                continue  # under something hidden or replaced already
            if p.is_dir():
                v.tmpfs(p)
            elif p.exists():
                v.hide_file(p)
        for p in self.runtime:
            if not v.shows_host(p):
                v.bind(p, p, rw=False)
        if program:
            for p in dict.fromkeys((Path(os.path.abspath(program)), Path(os.path.realpath(program)))):
                if p.exists() and not v.shows_host(p):
                    v.bind(p, p, rw=False)
        for p in writable:
            v.bind(p, p, rw=True)
        secret = [Path(os.path.abspath(p)) for p in secret if p.exists()]
        if secret:
            # an empty file, not /dev/null: git reads these (the mirror's config includes its URL
            # file), and a file it cannot open is a fatal "bad config" to it; an empty one is not
            empty = ws / ".fleet" / "empty"
            write_atomic(ws, empty, b"")  # (never truncating what a link there points to)
            for p in secret:
                v.bind(empty, p, rw=False)
        if self.guard_dir is not None:
            v.bind(self.guard_dir, self.guard_dir, rw=False)
        v.bind(ws, ws, rw=True)
        for p in dict.fromkeys(Path(os.path.abspath(p)) for p in protect):
            # after the workspace (its .git file) and the mirror: a read-only mount point, which
            # the agent can neither write, nor rename or delete to put another file in its place
            if p not in secret and not p.is_symlink() and p.exists() and v.shows_host(p):
                v.bind(p, p, rw=False)
        if self.home == Path("/"):
            v.args += ["--setenv", "HOME", str(self.task_home(ws))]
        return [self.binary, *v.args, "--chdir", str(ws), *UNSHARE, *_caps(), "--"]
