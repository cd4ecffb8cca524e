"""Fenced side effects: ``fleet guard -- CMD ARGS…`` runs CMD only while the task's lease holds.

An agent whose claim evaporated (its shift was declared lost, its lease expired and was repaired,
an operator cancelled the task) must not push a branch or open a pull request on work someone
else now owns. Agents have no database credentials (their environment is an allow-list,
worker/agent/executor.py; under bwrap they cannot read the fleet's files), so the shift answers for them:

- :class:`GuardServer`, started by each shift, serves a Unix socket (mode 0600, in a private
  directory): one JSON line per request, ``{"task": 12, "token": "<lease token>"}``, answered with
  ``{"held": bool, "state": "running", "valid_for": 17.9, "token_matches": bool, "error": null}``
  after asking the
  database at that moment (``fleet.lease_held``: running under exactly that token, its session
  active, its lease not run out by the database's clock, and for how many more seconds). A
  database error is an answer too: not confirmed, with the reason. The guard answers only for the
  leases its shift gave to its agents, each for the one task it was given for
  (:meth:`GuardServer.agent_env`): any other task or token is answered ``"state": "not_given"``
  without asking the database, so an agent learns nothing of another task from it.
- ``fleet guard`` (the CLI command, run by the agent: :mod:`worker.shift.guard_client`) reads ``FLEET_GUARD_SOCKET``,
  ``FLEET_TASK_ID`` and ``FLEET_LEASE_TOKEN`` (the shift puts them in every agent's
  environment), asks, and times its own round trip on a monotonic clock. The database's
  ``valid_for`` counts from a moment after the question was sent, so the lease certainly holds for
  ``valid_for - round trip`` more seconds: CMD runs (replacing the guard: stdin, stdout, stderr and
  the exit code are CMD's own) only if that is positive. An answer that took longer than the
  lease it vouches for is stale, and CMD is not run on it.

Exit codes when CMD is not run, one line on stderr naming the task and why:

- **77** (``EX_NOPERM``): the task is not yours any more — its lease is held by another token, the
  task is finished, cancelled, queued again or gone, or the shift that ran it is gone. Do not
  retry: stop working on the task.
- **75** (``EX_TEMPFAIL``): could not confirm now — the database or the shift did not answer in
  time, the answer came too late to be trusted, or the lease ran out and was not renewed yet (the
  shift stops its agents before that can happen, see :mod:`worker.shift.fence`). Retry after a few
  seconds; an agent that exits 75 itself hands its task off to the next shift.

The answer is a check at that moment, not a lock: a lease lost while CMD runs is noticed at the
shift's next heartbeat, which kills the agent's whole process group, CMD included; and a shift
that cannot renew its lease kills its agents before the lease could run out.

How an agent finds ``fleet``: the shift's ``fleet`` console script may not be on the agent's PATH
(cron's PATH is short, and the shift's virtualenv is not activated). The server's private
directory gets ``bin/fleet``, a symlink to the console script beside the shift's interpreter,
and that directory goes first on the agent's PATH — it holds nothing else, so it shadows no
``python`` or ``pip`` of the task's own project. ``FLEET_BIN`` names the console script itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import socketserver
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast
from uuid import UUID

import structlog

from worker.errors import one_line
from worker.store.protocol import Store

SOCKET_NAME = "guard.sock"
NOT_GIVEN = "not_given"  # the state of a task asked of with a lease this shift did not give for it
_PREFIX = "lanefleet-guard-"
# AF_UNIX paths are at most 107 bytes (108 with the NUL); keep a margin
_MAX_SOCKET_PATH = 100
_MAX_REQUEST = 4096


def fleet_executable() -> Path | None:
    """The ``fleet`` console script of this installation: beside the interpreter (a virtualenv's
    bin/), else the first on PATH; None if there is none (e.g. run from a source tree)."""
    beside = Path(sys.executable).parent / "fleet"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside.absolute()
    found = shutil.which("fleet")
    return Path(found).absolute() if found else None


def private_run_dir() -> Path:
    """A new directory only this user can enter, short enough for a socket path inside it: under
    the temporary directory, or /tmp when that one is too deep (pytest's, a TMPDIR in a home).
    What killed shifts left there before (their sockets answer no more) is removed first."""
    base = Path(tempfile.gettempdir())
    # mkdtemp adds 8 characters to the prefix
    if len(str(base / f"{_PREFIX}XXXXXXXX" / SOCKET_NAME)) > _MAX_SOCKET_PATH:
        base = Path("/tmp")
    sweep_stale(base)
    return Path(tempfile.mkdtemp(prefix=_PREFIX, dir=base))


def sweep_stale(base: Path, min_age: float = 60.0) -> list[Path]:
    """Remove the run directories of shifts that died without stopping their guard (SIGKILL, OOM):
    ours (this user's, holding nothing but the socket and ``bin/``), older than ``min_age``
    seconds (a shift that is just starting has not bound its socket yet), whose socket nobody
    listens on any more. Returns what was removed."""
    removed: list[Path] = []
    now = time.time()
    for d in base.glob(f"{_PREFIX}*"):
        try:
            st = d.lstat()
            if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or now - st.st_mtime < min_age
                    or not {p.name for p in d.iterdir()} <= {SOCKET_NAME, "bin"}):
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1)
                try:
                    s.connect(str(d / SOCKET_NAME))
                    continue  # a live shift's guard
                except (FileNotFoundError, ConnectionRefusedError):
                    pass
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def check(store: Store, request: Any, given: Mapping[UUID, int]) -> dict[str, Any]:
    """The answer to one request: ``{"held", "state", "valid_for", "error"}``. Never raises:
    whatever went wrong is "not confirmed", with the reason. ``given``: the leases the shift gave
    out, each token's task; a request for any other pair is ``not_given``, the database unasked."""
    try:
        task = int(request["task"])
        token = UUID(str(request["token"]))
    except (TypeError, KeyError, ValueError) as exc:
        return {"held": False, "state": None, "valid_for": 0.0,
                "error": f"bad request ({exc!r}): send {{\"task\": id, \"token\": uuid}}"}
    if given.get(token) != task:
        return {"held": False, "state": NOT_GIVEN, "valid_for": 0.0, "token_matches": False, "error": None}
    try:
        answer = store.lease_held(task, token)
    except Exception as exc:  # a database error, a refused key: either way, the lease is not confirmed
        return {"held": False, "state": None, "valid_for": 0.0,
                "error": one_line(str(exc))[:500] or type(exc).__name__}
    return {"held": answer.held, "state": answer.state, "valid_for": answer.valid_for,
            "token_matches": answer.token_matches, "error": None}


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    block_on_close = False  # stop() must not wait for a request stuck on the database
    guard: GuardServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.guard.log.warning("guard request failed", error=repr(sys.exc_info()[1]))


class _Handler(socketserver.StreamRequestHandler):
    timeout = 10  # a client that sends nothing does not keep a thread

    def handle(self) -> None:
        guard = cast(_Server, self.server).guard
        try:
            line = self.rfile.readline(_MAX_REQUEST)
        except OSError:
            return
        if not line:
            return  # a connection that asked nothing (sweep_stale checking that this guard lives)
        try:
            request = json.loads(line)
        except ValueError:
            request = None
        answer = check(guard.store, request, guard.given)
        guard.log.info("guard asked", task=request.get("task") if isinstance(request, dict) else None,
                       held=answer["held"], state=answer["state"], valid_for=answer["valid_for"],
                       error=answer["error"])
        with contextlib.suppress(OSError):  # the client gave up waiting
            self.wfile.write(json.dumps(answer).encode() + b"\n")


class GuardServer:
    """The shift's side of ``fleet guard``: a thread serving a Unix socket (see the module doc).

    ``socket_path``: where to listen (its folder is made if missing); None: ``guard.sock`` in a
    new private directory (:func:`private_run_dir`), removed again by :meth:`stop`. Starting never
    raises: a guard that could not start logs why, and its agents' ``fleet guard`` then refuses
    (no socket), which is the safe side.
    """

    def __init__(self, store: Store, socket_path: Path | None = None, *, log: Any = None) -> None:
        self.store = store
        self.socket_path = socket_path
        self.log = log if log is not None else structlog.get_logger("lanefleet.guard")
        self.bin_dir: Path | None = None
        self.fleet_bin: Path | None = None
        self._own_dir: Path | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.given: dict[UUID, int] = {}  # the leases given to agents: token -> its task

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        try:
            if self.socket_path is None:
                self._own_dir = private_run_dir()
                self.socket_path = self._own_dir / SOCKET_NAME
            folder = self.socket_path.parent
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(self.socket_path.lstat().st_mode):
                    self.socket_path.unlink()  # a socket a killed shift left behind
            server = _Server(str(self.socket_path), _Handler, bind_and_activate=False)
            server.guard = self
            try:
                server.server_bind()
                os.chmod(self.socket_path, 0o600)
                server.server_activate()
            except BaseException:
                server.server_close()
                raise
        except OSError as exc:
            self.log.error("fleet guard unavailable: its socket could not be made; guarded commands "
                           "will be refused", socket=str(self.socket_path), error=str(exc))
            self._remove_files()
            self.socket_path = None
            return
        self._server = server
        self._link_fleet()
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="fleet-guard", daemon=True)
        self._thread.start()
        self.log.info("fleet guard listening", socket=str(self.socket_path),
                      fleet=str(self.fleet_bin) if self.fleet_bin else None)

    def _link_fleet(self) -> None:
        """``bin/fleet`` beside the socket, for the agents' PATH (see the module doc)."""
        self.fleet_bin = fleet_executable()
        if self.fleet_bin is None or self.socket_path is None:
            self.log.warning("no `fleet` console script found: agents must find `fleet` on their own PATH")
            return
        bin_dir = self.socket_path.parent / "bin"
        try:
            bin_dir.mkdir(mode=0o700, exist_ok=True)
            link = bin_dir / "fleet"
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
            link.symlink_to(self.fleet_bin)
        except OSError as exc:
            self.log.warning("could not put `fleet` on the agents' PATH", error=str(exc))
            return
        self.bin_dir = bin_dir

    def agent_env(self, task: int | None, token: UUID | None, path: str | None) -> dict[str, str]:
        """What an agent's environment gets: FLEET_GUARD_SOCKET, FLEET_LEASE_TOKEN, and (when the
        console script was found) FLEET_BIN and PATH with ``bin_dir`` first. ``path``: the PATH the
        agent would get otherwise. From now on the guard answers for ``token`` when it is asked of
        ``task`` (the task whose lease it is), and only then."""
        if task is not None and token is not None:
            self.given[token] = task
        env = {"FLEET_GUARD_SOCKET": str(self.socket_path) if self.running else "",
               "FLEET_LEASE_TOKEN": str(token) if token is not None else ""}
        if self.fleet_bin is not None:
            env["FLEET_BIN"] = str(self.fleet_bin)
        if self.bin_dir is not None:
            # no PATH at all: what exec would have searched (os.defpath), after ours
            env["PATH"] = os.pathsep.join([str(self.bin_dir), path or os.defpath])
        return env

    def stop(self) -> None:
        """Stop serving and remove the socket (and the private directory). Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self._remove_files()

    def _remove_files(self) -> None:
        if self.bin_dir is not None:
            with contextlib.suppress(OSError):
                (self.bin_dir / "fleet").unlink()
                self.bin_dir.rmdir()
        if self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(self.socket_path.lstat().st_mode):
                    self.socket_path.unlink()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
