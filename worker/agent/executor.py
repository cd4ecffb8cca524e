"""The executor contract (DESIGN §6): start a lane's agent command for one task, and read its end.

- The argv template takes ``{prompt_file}``, ``{workspace}``, ``{model}``, ``{task_id}`` and
  ``{agent_session}`` (empty when there is none yet). A leading ``python``/``python3`` means
  this interpreter, so an agent shipped in the package runs in lanefleet's own environment.
- cwd is the workspace; the environment gets FLEET_TASK_ID, FLEET_TASK_KEY, FLEET_LANE,
  FLEET_ATTEMPT, FLEET_WORKSPACE (plus FLEET_MODEL, FLEET_AGENT_SESSION) and loses the
  database credentials, which an agent never needs.
- stdout and stderr go straight to the run's log file (the file is the child's stdout: nothing
  is buffered in the shift, so a killed run still leaves its log).
- The agent runs under :mod:`worker.agent.supervisor`, which kills it when the shift dies.
- Exit 0 = done, 75 (EX_TEMPFAIL) = hand off, other = failed attempt. A Claude-Code style
  stream-json ``{"type": "result"}`` record on stdout gives the agent's session id, ``is_error``,
  ``total_cost_usd`` and the tokens, summed over ``modelUsage`` — never the top-level ``usage``
  block, which leaves out sub-agents. An agent stopped before its result record (the shift
  ended, a lease was lost) still named its session in its earlier records (``init``, every
  turn): that one is kept, so the next shift can resume the session.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EX_TEMPFAIL = 75

# never handed to an agent: it talks to its workspace, not to the queue's database
_SECRET_ENV = ("DATABASE_URL", "FLEET_DATABASE__URL", "FLEET_SUPABASE__KEY", "SUPABASE_SERVICE_ROLE_KEY",
               "SUPABASE_JWT_SECRET", "FLEET_SUPABASE_KEY", "PGPASSWORD")
_PLACEHOLDER = re.compile(r"\{(prompt_file|workspace|model|task_id|agent_session)\}")


def render_argv(template: list[str], values: Mapping[str, str]) -> list[str]:
    """Fill the placeholders of an argv template (other braces are left alone).

    An argument that is exactly ``{agent_session}`` is dropped while there is no session yet,
    together with an option right before it: ``--resume {agent_session}`` means "resume if
    there is something to resume".
    """
    argv: list[str] = []
    for arg in template:
        if arg == "{agent_session}" and not values.get("agent_session"):
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


@dataclass
class AgentResult:
    """What the final stream-json result record said."""

    found: bool = False
    session_id: str | None = None
    is_error: bool = False
    subtype: str | None = None
    cost_usd: float = 0.0
    input_tokens: int = 0
    cache_creation_tokens: int = 0
    cache_read_tokens: int = 0
    output_tokens: int = 0
    models: list[str] = field(default_factory=list)
    summary: str | None = None

    def report(self) -> dict[str, Any]:
        """The token and cost fields of ``fleet.record_run``."""
        out: dict[str, Any] = {
            "input_tokens": self.input_tokens,
            "cache_creation_tokens": self.cache_creation_tokens,
            "cache_read_tokens": self.cache_read_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": self.cost_usd,
        }
        if self.session_id:
            out["agent_session"] = self.session_id
        if self.models:
            out["model"] = ",".join(self.models)
        return out


@dataclass
class StreamUsage:
    """Usage as a run streams it: read the log from where the last read stopped, sum the usage of
    each assistant message (once per message id: Claude Code repeats a message's usage on each of
    its content blocks), and keep the largest cost a record names. Lets a shift enforce a budget
    while the agent runs, and count the tokens of a run that never wrote its result record."""

    offset: int = 0
    input_tokens: int = 0
    cache_creation_tokens: int = 0
    cache_read_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    _seen: set[str] = field(default_factory=set)
    _partial: bytes = b""

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.cache_creation_tokens + self.cache_read_tokens + self.output_tokens

    def read(self, path: Path, limit: int = 4 << 20) -> bool:
        """Read what the log gained; True if it grew."""
        try:
            with path.open("rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read(limit)
        except OSError:
            return False
        if not chunk:
            return False
        self.offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()[-65536:]
        for raw in lines:
            self._line(raw.decode("utf-8", "replace").strip())
        return True

    def _line(self, line: str) -> None:
        if not line.startswith("{"):
            return
        try:
            obj = json.loads(line)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        for key in ("total_cost_usd", "cost_usd"):
            cost = obj.get(key)
            if isinstance(cost, int | float) and cost > self.cost_usd:
                self.cost_usd = float(cost)
        message = obj.get("message")
        if obj.get("type") != "assistant" or not isinstance(message, dict):
            return
        usage = message.get("usage")
        mid = message.get("id")
        if not isinstance(usage, dict) or (isinstance(mid, str) and mid in self._seen):
            return
        if isinstance(mid, str):
            self._seen.add(mid)
        self.input_tokens += _int(usage.get("input_tokens"))
        self.cache_creation_tokens += _int(usage.get("cache_creation_input_tokens"))
        self.cache_read_tokens += _int(usage.get("cache_read_input_tokens"))
        self.output_tokens += _int(usage.get("output_tokens"))

    def report(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "cache_creation_tokens": self.cache_creation_tokens,
                "cache_read_tokens": self.cache_read_tokens, "output_tokens": self.output_tokens,
                "cost_usd": self.cost_usd}


def _int(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def parse_result(lines: Iterable[str]) -> AgentResult:
    """The last ``{"type": "result"}`` record among ``lines``; lines that are not JSON are skipped.

    Without a result record (or without a session id in it), ``session_id`` is the last one any
    record named: an interrupted agent's session can still be resumed.
    """
    record: dict[str, Any] | None = None
    last_session: str | None = None
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        sid = obj.get("session_id")
        if isinstance(sid, str) and sid:
            last_session = sid
        if obj.get("type") == "result":
            record = obj
    if record is None:
        return AgentResult(session_id=last_session)
    res = AgentResult(found=True)
    sid = record.get("session_id")
    res.session_id = sid if isinstance(sid, str) and sid else last_session
    res.is_error = bool(record.get("is_error"))
    res.subtype = record.get("subtype") if isinstance(record.get("subtype"), str) else None
    cost = record.get("total_cost_usd")
    res.cost_usd = float(cost) if isinstance(cost, int | float) and cost >= 0 else 0.0
    summary = record.get("result")
    res.summary = summary[:2000] if isinstance(summary, str) else None
    usage = record.get("modelUsage")
    if isinstance(usage, dict):
        for model, u in usage.items():
            if not isinstance(u, dict):
                continue
            res.models.append(str(model))
            res.input_tokens += _int(u.get("inputTokens"))
            res.cache_creation_tokens += _int(u.get("cacheCreationInputTokens"))
            res.cache_read_tokens += _int(u.get("cacheReadInputTokens"))
            res.output_tokens += _int(u.get("outputTokens"))
    return res


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


def read_lines(path: Path) -> Iterable[str]:
    try:
        with path.open("r", encoding="utf-8", errors="replace") as fh:
            yield from fh
    except OSError:
        return


class AgentProcess:
    """One agent under its supervisor. Close the pipe (``kill``) and the agent's group dies."""

    def __init__(self, argv: list[str], *, cwd: Path, env: Mapping[str, str], log_path: Path) -> None:
        self.argv = argv
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        read_end, self._write_end = os.pipe()  # both ends close-on-exec; the child gets read_end only
        try:
            with log_path.open("ab", buffering=0) as log:
                self.proc = subprocess.Popen(
                    # -P: the cwd is the task's workspace, whose own `worker/` must not shadow ours
                    [sys.executable, "-P", "-m", "worker.agent.supervisor", str(read_end), "--", *argv],
                    cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL, stdout=log,
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
        """Kill the agent's whole group now: closing the pipe makes the supervisor SIGKILL it."""
        if self._write_end >= 0:
            os.close(self._write_end)
            self._write_end = -1

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def release(self) -> None:
        """After the agent has exited: close what is left of the pipe."""
        self.kill()
