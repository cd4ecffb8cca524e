"""The executor contract (DESIGN §6): start a lane's agent command for one task, and read its end.

- The argv template takes ``{prompt_file}``, ``{workspace}``, ``{model}``, ``{task_id}`` and
  ``{agent_session}`` (empty when there is none yet). A leading ``python``/``python3`` means
  this interpreter, so an agent shipped in the package runs in lanefleet's own environment.
- cwd is the workspace; the environment gets FLEET_TASK_ID, FLEET_TASK_KEY, FLEET_LANE,
  FLEET_ATTEMPT, FLEET_WORKSPACE (plus FLEET_MODEL, FLEET_AGENT_SESSION) and loses the
  database credentials, which an agent never needs.
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
from collections.abc import Mapping
from pathlib import Path

EX_TEMPFAIL = 75

# never handed to an agent: it talks to its workspace, not to the queue's database
_SECRET_ENV = ("DATABASE_URL", "FLEET_DATABASE__URL", "FLEET_SUPABASE__KEY", "SUPABASE_SERVICE_ROLE_KEY",
               "SUPABASE_JWT_SECRET", "FLEET_SUPABASE_KEY", "PGPASSWORD")
_PLACEHOLDER = re.compile(r"\{(prompt_file|workspace|model|task_id|agent_session)\}")


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


def agent_env(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in _SECRET_ENV}
    env.update(extra)
    return env


def tail(path: Path, limit: int = 4000) -> str:
    """The last ``limit`` bytes of a log, as text."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


class AgentProcess:
    """One agent under its supervisor. Close the pipe (``kill``) and the agent's group dies."""

    def __init__(self, argv: list[str], *, cwd: Path, env: Mapping[str, str], log_path: Path,
                 stdin: Path | None = None) -> None:
        """``stdin``: a file the agent reads on its standard input (the prompt; else nothing)."""
        self.argv = argv
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        read_end, self._write_end = os.pipe()  # both ends close-on-exec; the child gets read_end only
        os.set_blocking(self._write_end, False)  # fence() from the fence's thread never waits
        try:
            with log_path.open("ab", buffering=0) as log, \
                    (stdin.open("rb") if stdin is not None else open(os.devnull, "rb")) as given:
                self.proc = subprocess.Popen(
                    # -P: the cwd is the task's workspace, whose own `worker/` must not shadow ours
                    [sys.executable, "-P", "-m", "worker.agent.supervisor", str(read_end), "--", *argv],
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
                pass  # a full pipe (a supervisor not reading): the next renewal tries again

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def release(self) -> None:
        """After the agent has exited: close what is left of the pipe."""
        self.kill()
