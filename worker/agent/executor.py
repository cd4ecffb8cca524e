"""The executor contract (DESIGN §6): start a lane's agent command for one task, and read its end.

- The argv template takes ``{prompt_file}``, ``{workspace}``, ``{model}``, ``{task_id}`` and
  ``{agent_session}`` (empty when there is none yet). A leading ``python``/``python3`` means
  this interpreter, so an agent shipped in the package runs in lanefleet's own environment.
- cwd is the workspace; the environment is an allow-list (:func:`agent_env`): the base set
  (:data:`BASE_ENV`: PATH, HOME, the user, locale and terminal), the task's variables the shift
  sets (:data:`TASK_ENV`: FLEET_TASK_ID, FLEET_TASK_KEY, FLEET_LANE, FLEET_ATTEMPT, FLEET_WORKSPACE,
  FLEET_MODEL, …), and what the lane or profile names (``agent_env``, ``agent_env_file``). Nothing
  else of the shift's environment: not its database URL, keys or config (worker/agent/sandbox.py).
- Under ``sandbox = "bwrap"`` the argv is prefixed with bubblewrap's (:mod:`worker.agent.sandbox`).
- stdin is the task's prompt file; stdout and stderr go straight to the run's log file (the file
  is the child's stdout: nothing is buffered in the shift, so a killed run still leaves its log),
  which the agent's adapter (worker.agent.adapters) reads as it grows.
- The agent runs under :mod:`worker.agent.supervisor`, which kills it when the shift dies.
- Exit 75 (EX_TEMPFAIL) = hand off; what any other exit means is worker.shift.limits's to judge.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

EX_TEMPFAIL = 75

#: what every agent gets of the shift's environment (and LC_*): where programs are, who and where
#: it is, its locale and terminal, and how long its `fleet guard` waits for the shift's answer.
#: Anything else only when its lane or profile names it.
BASE_ENV = frozenset({"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "COLORTERM",
                      "NO_COLOR", "FORCE_COLOR", "CLICOLOR", "CLICOLOR_FORCE", "FLEET_GUARD_TIMEOUT"})
BASE_PREFIXES = ("LC_",)
#: the variables the shift sets for an agent, a gate or a batch step (never taken from its own
#: environment): the task, its dispatch, and ``fleet guard``'s
TASK_ENV = frozenset({
    "FLEET_TASK_ID", "FLEET_TASK_KEY", "FLEET_LANE", "FLEET_ATTEMPT", "FLEET_WORKSPACE", "FLEET_MODEL",
    "FLEET_TIER", "FLEET_PROFILE", "FLEET_AGENT_SESSION", "FLEET_GATE",
    "FLEET_GUARD_SOCKET", "FLEET_LEASE_TOKEN", "FLEET_BIN", "FLEET_GUARD_TASK",
    "FLEET_BATCH_ID", "FLEET_BATCH_CARRIER", "FLEET_BATCH_BRANCH", "FLEET_BATCH_MEMBERS", "FLEET_BATCH_SHIP_RERUN",
    "PATH",  # the guard's: its folder holding `fleet` first (worker/shift/guard.py)
})
_PLACEHOLDER = re.compile(r"\{(prompt_file|workspace|model|task_id|agent_session)\}")


class ProgramNotFound(FileNotFoundError):
    """The program of an argv is not found on the PATH it would run with (checked before a sandbox
    is made around it): it never ran."""


def render_argv(template: list[str], values: Mapping[str, str]) -> list[str]:
    """Fill the placeholders of an argv template (other braces are left alone).

    An argument that is exactly ``{agent_session}`` or ``{model}`` is dropped while it has no
    value, together with an option right before it: ``--resume {agent_session}`` means "resume if
    there is something to resume", ``--model {model}`` "the agent's own default, unless a model
    is configured".
    """
    argv: list[str] = []
    for arg in template:
        if arg in ("{agent_session}", "{model}") and not values.get(arg[1:-1]):
            if argv and argv[-1].startswith("-") and len(argv) > 1:
                argv.pop()
            continue
        argv.append(_PLACEHOLDER.sub(lambda m: values.get(m.group(1), ""), arg))
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def base_env(base: Mapping[str, str], names: Iterable[str] = (), values: Mapping[str, str] | None = None
             ) -> dict[str, str]:
    """What an agent gets before its task's variables: of ``base`` (the shift's environment) the
    :data:`BASE_ENV` variables, ``LC_*`` and ``names`` (a lane's ``agent_env``), then ``values``
    (its ``agent_env_file``)."""
    allowed = set(names)
    env = {k: v for k, v in base.items() if k in BASE_ENV or k.startswith(BASE_PREFIXES) or k in allowed}
    env.update(values or {})
    return env


def agent_env(base: Mapping[str, str], task: Mapping[str, str], *, names: Iterable[str] = (),
              values: Mapping[str, str] | None = None) -> dict[str, str]:
    """An agent's whole environment: :func:`base_env`, then the task's variables (``task``: only
    :data:`TASK_ENV` names, which nothing else overrides)."""
    unknown = sorted(set(task) - TASK_ENV)
    if unknown:
        raise ValueError(f"not a task variable of the executor contract: {', '.join(unknown)}")
    return {**base_env(base, names, values), **task}


def tail(path: Path, limit: int = 4000, *, whole_lines: bool = False) -> str:
    """The last ``limit`` bytes of a log, as text; ``whole_lines``: without the line the cut fell
    in (a fragment of a JSON record reads as text that is not one)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            data = fh.read()
    except OSError:
        return ""
    if whole_lines and size > limit:
        data = data[data.find(b"\n") + 1:] if b"\n" in data else b""
    return data.decode("utf-8", "replace")


class AgentProcess:
    """One agent under its supervisor. Close the pipe (``kill``) and the agent's group dies."""

    def __init__(self, argv: list[str], *, cwd: Path, env: Mapping[str, str], log_path: Path,
                 stdin: Path | None = None, sandbox: Sequence[str] = (), label: str = "the agent") -> None:
        """``stdin``: a file the agent reads on its standard input (the prompt; else nothing).
        ``sandbox``: the argv prefix that runs it in a sandbox (worker.agent.sandbox), if any.
        ``label``: what it is, as the line saying it cannot start names it ("verify gate")."""
        self.argv = argv
        self.log_path = log_path
        self.sandboxed = bool(sandbox)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.fenced_from: float | None = None  # the last SIGTERM moment its supervisor was told of
        read_end, self._write_end = os.pipe()  # both ends close-on-exec; the child gets read_end only
        os.set_blocking(self._write_end, False)  # fence() from the fence's thread never waits
        marker = [*(["--sandboxed"] if sandbox else []), f"--label={label}"]
        try:
            # the log is the agent's output: its owner's alone, as what an agent prints may be a secret
            log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            with os.fdopen(log_fd, "ab", buffering=0) as log, \
                    (stdin.open("rb") if stdin is not None else open(os.devnull, "rb")) as given:
                self.proc = subprocess.Popen(
                    # -P: the cwd is the task's workspace, whose own `worker/` must not shadow ours
                    [sys.executable, "-P", "-m", "worker.agent.supervisor", str(read_end), *marker, "--",
                     *sandbox, *argv],
                    cwd=cwd, env=dict(env), stdin=given, stdout=log,
                    stderr=subprocess.STDOUT, pass_fds=(read_end,), start_new_session=True,
                )
        except BaseException:
            os.close(self._write_end)
            raise
        finally:
            os.close(read_end)
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        """Ask the agent to stop (SIGTERM to its group, through the supervisor)."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:  # pragma: no cover
                pass

    def kill(self) -> None:
        """Kill the agent's whole group now: closing the pipe makes the supervisor SIGKILL it.
        Safe from any thread (the shift's fence kills from its own), any number of times."""
        with self._lock:
            if self._write_end >= 0:
                os.close(self._write_end)
                self._write_end = -1

    def fence(self, term_at: float, kill_at: float) -> None:
        """Tell the supervisor when to stop the agent unless told a later moment (monotonic
        seconds; see worker/agent/supervisor.py). Never blocks; a supervisor that is gone is ignored."""
        with self._lock:
            if self._write_end < 0:
                return
            try:
                os.write(self._write_end, f"fence {term_at:.3f} {kill_at:.3f}\n".encode())
            except (BlockingIOError, BrokenPipeError):
                return  # a full pipe (a supervisor not reading), or one that is gone: not told
            self.fenced_from = term_at

    def fence_passed(self) -> bool:
        """Its supervisor was told to stop it by now (and no later moment reached it): an exit now
        may be the supervisor's doing, not the agent's."""
        return self.fenced_from is not None and time.monotonic() >= self.fenced_from

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def release(self) -> None:
        """After the agent has exited: close what is left of the pipe."""
        self.kill()
