"""The agent's side of ``fleet guard`` (the shift's side, and what the answers mean, are
:mod:`worker.shift.guard`): ask the shift's guard socket, judge the answer against the round trip,
run CMD in this process or exit 77/75.

Agents call ``fleet guard`` inside their work, once per guarded command: this module imports the
standard library only, so the command starts in tens of milliseconds (``bench/startup.py``).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

EX_NOPERM = 77  # sysexits.h: "permission denied" — the task is not yours any more
EX_TEMPFAIL = 75  # sysexits.h: "temporary failure" — the lease could not be confirmed now: retry


def ask(socket_path: str, task: int, token: str, timeout: float) -> dict[str, Any]:
    """One request to a shift's guard; its answer. Raises OSError (nothing answers, a timeout) or
    ValueError (an answer that is not ours)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        s.sendall(json.dumps({"task": task, "token": token}).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n") and len(data) < 65536:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    answer = json.loads(data)
    if not isinstance(answer, dict) or "held" not in answer:
        raise ValueError(f"not a guard answer: {data[:200]!r}")
    return answer


def verdict(answer: dict[str, Any], round_trip: float) -> tuple[int | None, str]:
    """What an answer allows, given the round trip (seconds, monotonic) it took: (None, "") to run
    CMD, else (exit code, why). The database measured ``valid_for`` from a moment after the
    question left, so the lease holds at least ``valid_for - round_trip`` seconds more."""
    if answer.get("error"):
        return EX_TEMPFAIL, f"the lease could not be confirmed now ({answer['error']}); retry"
    state = answer.get("state")
    if answer.get("held") is True:
        try:
            valid_for = float(answer.get("valid_for"))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return EX_TEMPFAIL, "the shift's answer says nothing of how long the lease holds; retry"
        if round_trip < valid_for:
            return None, ""
        return EX_TEMPFAIL, (f"the answer took {round_trip:.1f} s, longer than the {valid_for:.1f} s the lease "
                             "held for when it was given: it is stale; retry")
    if state == "not_given":  # (worker.shift.guard.NOT_GIVEN: this module imports no more than it must)
        return EX_NOPERM, ("this shift gave no lease of this task under that token: ask with the "
                           "FLEET_LEASE_TOKEN and the FLEET_GUARD_TASK (else FLEET_TASK_ID) the shift set")
    if state == "running" and answer.get("token_matches") is True:
        return EX_TEMPFAIL, ("the lease ran out and its shift has not renewed it yet (the shift stops its agents "
                             "before a repair can take the task); retry")
    if state == "running":
        return EX_NOPERM, "lease lost: its lease was repaired and another worker holds the task now"
    if state == "unknown":
        return EX_NOPERM, "lease lost: the task no longer exists"
    return EX_NOPERM, f"lease lost: the task is {state} now"


def run_guarded(cmd: list[str], *, task: str | None, token: str | None, socket_path: str | None,
                timeout: float, quiet: bool, clock: Callable[[], float] = time.monotonic) -> int:
    """``fleet guard``: run CMD in this process (it never returns then) if the shift's guard says
    the task's lease holds for longer than the question took; else the exit code to end with (77:
    not yours, 75: could not confirm now, see the module doc; one line on stderr unless ``quiet``;
    127 or 126 when CMD cannot be run)."""
    what = shlex.join(cmd)
    if len(what) > 200:
        what = what[:197] + "..."

    def refuse(why: str, code: int = EX_NOPERM) -> int:
        if not quiet:
            print(f"fleet guard: {why}; `{what}` not run (exit {code})", file=sys.stderr, flush=True)
        return code

    if not task or not token:
        return refuse("not inside a fleet task (FLEET_TASK_ID and FLEET_LEASE_TOKEN are not set)")
    key = os.environ.get("FLEET_TASK_KEY")
    name = f"task {task}" + (f" ({key})" if key else "")
    try:
        task_id = int(task)
    except ValueError:
        return refuse(f"not inside a fleet task (FLEET_TASK_ID is {task!r}, not a task id)")
    if not socket_path:
        return refuse(f"{name}: the shift is gone or runs no guard (FLEET_GUARD_SOCKET is not set)")
    asked = clock()
    try:
        answer = ask(socket_path, task_id, token, timeout)
    except TimeoutError:
        return refuse(f"{name}: the shift did not answer within {timeout:g} s; retry", EX_TEMPFAIL)
    except (FileNotFoundError, ConnectionRefusedError):
        return refuse(f"{name}: the shift is gone (nothing answers at {socket_path})")
    except (OSError, ValueError) as exc:
        return refuse(f"{name}: the shift's guard could not be asked ({exc}); retry", EX_TEMPFAIL)
    code, why = verdict(answer, clock() - asked)
    if code is not None:
        return refuse(f"{name}: {why}", code)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(cmd[0], cmd)  # CMD replaces this process: its streams, its exit code, its signals
    except FileNotFoundError:
        print(f"fleet guard: {cmd[0]}: command not found", file=sys.stderr)
        return 127
    except OSError as exc:
        print(f"fleet guard: {cmd[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 126
    raise AssertionError("unreachable")  # pragma: no cover - execvp returns only by raising
