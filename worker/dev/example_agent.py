"""A scripted agent that behaves like a coding agent, for ``fleet up --demo`` and the tests.

``python -m worker.dev.example_agent PROMPT_FILE``, run by a shift in a task workspace. It reads its
prompt, works in steps (sleeping), checkpoints after each step to ``.fleet/checkpoint.json`` and
resumes from it, prints Claude-Code style stream-json (an init record, assistant turns and a
final ``result`` record with ``modelUsage`` for a main model and a sub-agent), and exits.

The task payload steers it (all optional):

- ``steps`` (3), ``sleep`` (0.2 s per step);
- ``mode``: ``ok`` | ``fail`` (exit 1) | ``hang`` (never ends) | ``crash`` (SIGKILLs itself,
  no result) | ``handoff`` (exit 75) | ``garbage`` (prints noise, exit 0, no result record) |
  ``is_error`` (exit 0 with ``is_error: true``);
- ``fail_attempts``: fail attempts 1..N, then behave; ``crash_attempts``: crash in attempts 1..N;
- ``steps_per_shift``: do at most this many steps per attempt, then checkpoint and exit 75 (a
  task that needs several shifts);
- ``route``: a lane to route the task to when done (writes ``.fleet/route.json``), with
  ``route_note``;
- ``tokens``: scale of the token counts (1000; each step's assistant record carries the usage of
  its turn, 5 × scale tokens);
- ``commit``: in a git workspace, append a line per step to this file and commit it (and one more,
  a fix, when its prompt says its pull request's CI failed);
- ``attention``: write it to ``.fleet/attention.json`` as a permission prompt would, then wait;
- ``limit_attempts``: in attempts 1..N, hit a usage limit the way Claude Code reports one (a result
  record with ``is_error`` and "Claude AI usage limit reached|<epoch>", exit 1), the reset
  ``limit_reset_in`` seconds (3600) from now; ``limit_message`` replaces the text;
- ``window_warning_at_step``: after that step, report a usage window near its end the way Claude
  Code does (a ``rate_limit_event`` with status ``allowed_warning``, the shape of
  tests/agents/corpus/claude/stream-json-multi-turn-cumulative-allowed-warning-2.1.285.jsonl):
  window ``window_warning_type`` (five_hour), ``window_warning_utilization`` (0.91), its reset
  ``window_warning_reset_in`` seconds (3600) from now.

Between steps it honours ``.fleet/window_closing.json`` (the shift's word that a usage window is
about to close): it checkpoints and exits 75, and the next attempt resumes from the checkpoint.

``--model M`` after the prompt file: the model it was dispatched with, named in its init record.
``--script K=V,K=V``: steering for every task of the lane (what a task from an issue tracker, whose
payload is the issue, cannot carry), each value JSON or else text; the payload's own keys win.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def result_record(session: str, *, is_error: bool, steps: int, scale: int, text: str) -> dict[str, Any]:
    main_in, sub_in = 3 * scale * steps, scale * steps
    return {
        "type": "result",
        "subtype": "error_during_execution" if is_error else "success",
        "is_error": is_error,
        "duration_ms": 1000 * steps,
        "num_turns": steps + 1,
        "result": text,
        "session_id": session,
        "total_cost_usd": round(0.000015 * main_in + 0.000001 * sub_in, 6),
        # the top-level usage covers the main model only: sub-agents are missing from it
        "usage": {"input_tokens": main_in, "cache_creation_input_tokens": scale,
                  "cache_read_input_tokens": 10 * scale, "output_tokens": scale * steps},
        "modelUsage": {
            "claude-sonnet-4-5": {"inputTokens": main_in, "outputTokens": scale * steps,
                                  "cacheReadInputTokens": 10 * scale, "cacheCreationInputTokens": scale,
                                  "costUSD": round(0.000015 * main_in, 6)},
            "claude-haiku-4-5": {"inputTokens": sub_in, "outputTokens": scale // 2 * steps,
                                 "cacheReadInputTokens": 2 * scale, "cacheCreationInputTokens": 0,
                                 "costUSD": round(0.000001 * sub_in, 6)},
        },
    }


def rate_limit_event(session: str, window: str, utilization: float, reset_in: float) -> dict[str, Any]:
    """A Claude Code ``rate_limit_event`` saying ``window`` is near its end (allowed_warning)."""
    reset = int(time.time() + reset_in)
    other = "seven_day" if window == "five_hour" else "five_hour"
    return {"type": "rate_limit_event",
            "rate_limit_info": {"status": "allowed_warning", "resetsAt": reset, "rateLimitType": window,
                                "utilization": utilization, "isUsingOverage": False,
                                "surpassedThreshold": round(utilization - 0.01, 2),
                                "unifiedWindows": {window: {"utilization": utilization, "resetsAt": reset},
                                                   other: {"utilization": 0.5, "resetsAt": reset + 3600}}},
            "uuid": str(uuid.uuid4()), "session_id": session}


def commit_step(name: str, message: str) -> None:
    """A real commit in the workspace (a git worktree): append a line to ``name``, commit it."""
    import subprocess

    with open(name, "a") as fh:
        fh.write(message + "\n")
    git = ["git", "-c", "user.name=example-agent", "-c", "user.email=agent@example.invalid"]
    subprocess.run([*git, "add", name], check=True)
    subprocess.run([*git, "commit", "-q", "--no-verify", "-m", message], check=True)


def _setting(pair: str) -> tuple[str, Any]:
    name, _, text = pair.partition("=")
    try:
        return name, json.loads(text)
    except ValueError:
        return name, text


def main(argv: list[str]) -> int:
    model = "claude-sonnet-4-5"
    script: dict[str, Any] = {}
    args = argv[1:]
    while len(args) >= 2 and args[0] in ("--model", "--script"):
        if args[0] == "--model":
            model = args[1] or model
        else:
            script = dict(_setting(pair) for pair in args[1].split(",") if pair)
        args = args[2:]
    if not argv or args:
        print("usage: python -m worker.dev.example_agent PROMPT_FILE [--model M] [--script K=V,...]",
              file=sys.stderr)
        return 2
    prompt = Path(argv[0]).read_text()
    fleet = Path(".fleet")
    task = json.loads((fleet / "task.json").read_text())
    payload: dict[str, Any] = script | (task.get("payload") or {})
    attempt = int(os.environ.get("FLEET_ATTEMPT", "1"))
    session = task.get("agent_session") or str(uuid.uuid4())
    scale = int(payload.get("tokens", 1000))
    mode = payload.get("mode", "ok")
    if attempt <= int(payload.get("fail_attempts", 0)):
        mode = "fail"
    elif attempt <= int(payload.get("crash_attempts", 0)):
        mode = "crash"

    emit({"type": "system", "subtype": "init", "session_id": session, "cwd": os.getcwd(),
          "model": model, "prompt_chars": len(prompt)})
    if attempt <= int(payload.get("limit_attempts", 0)):
        reset = int(time.time() + float(payload.get("limit_reset_in", 3600)))
        text = payload.get("limit_message") or f"Claude AI usage limit reached|{reset}"
        record = result_record(session, is_error=True, steps=1, scale=scale, text=text)
        emit(record)
        print(text, file=sys.stderr)
        return 1
    if payload.get("attention"):
        # waiting on a permission prompt, as Claude Code's Notification hook reports it; then silent
        write_json(fleet / "attention.json", {"hook_event_name": "Notification", "message": payload["attention"]})
        time.sleep(3600)
    if mode == "garbage":
        print("Traceback (most recent call last):\n  ???\n{not json at all")
        return 0

    try:
        done = int(json.loads((fleet / "checkpoint.json").read_text()).get("step", 0))
    except (OSError, ValueError, AttributeError):
        done = 0
    if payload.get("commit") and "## CI failed on your pull request" in prompt:
        # the checks of its pull request failed: a fix, whatever its checkpoint says was done
        commit_step(str(payload["commit"]), f"{task['key']}: fix what CI reported (attempt {attempt})")
    steps = int(payload.get("steps", 3))
    per_shift = int(payload.get("steps_per_shift", steps))
    this_attempt = 0
    warn_at = int(payload.get("window_warning_at_step", 0))
    while done < steps:
        if (fleet / "window_closing.json").exists():
            # a safe point between steps: checkpoint, hand off, go on after the window's reset
            write_json(fleet / "checkpoint.json", {"step": done, "of": steps, "attempt": attempt,
                                                   "handed_off": "window-closing"})
            emit(result_record(session, is_error=False, steps=max(this_attempt, 1), scale=scale,
                               text=f"usage window closing: stopped at step {done}/{steps}; handing off"))
            return 75
        if mode == "hang":
            time.sleep(3600)
        time.sleep(float(payload.get("sleep", 0.2)))
        done += 1
        this_attempt += 1
        write_json(fleet / "checkpoint.json", {"step": done, "of": steps, "attempt": attempt})
        if payload.get("commit"):
            commit_step(str(payload["commit"]), f"{task['key']}: step {done}/{steps} (attempt {attempt})")
        # each turn's usage as it arrives, as stream-json carries it (what a budget counts mid-run)
        emit({"type": "assistant", "session_id": session,
              "message": {"id": f"msg-{attempt}-{done}", "role": "assistant",
                          "content": [{"type": "text", "text": f"step {done}/{steps}"}],
                          "usage": {"input_tokens": 4 * scale, "cache_creation_input_tokens": 0,
                                    "cache_read_input_tokens": 0, "output_tokens": scale}}})
        if done == warn_at:
            emit(rate_limit_event(session, str(payload.get("window_warning_type", "five_hour")),
                                  float(payload.get("window_warning_utilization", 0.91)),
                                  float(payload.get("window_warning_reset_in", 3600))))
        if mode == "crash" and done >= 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if this_attempt >= per_shift and done < steps:
            emit(result_record(session, is_error=False, steps=this_attempt, scale=scale,
                               text=f"stopped at step {done}/{steps}; handing off"))
            return 75

    if mode == "fail":
        emit(result_record(session, is_error=True, steps=max(this_attempt, 1), scale=scale,
                           text="the tests still fail"))
        print("error: the tests still fail", file=sys.stderr)
        return 1
    if mode == "handoff":
        emit(result_record(session, is_error=False, steps=max(this_attempt, 1), scale=scale,
                           text="waiting for something; handing off"))
        return 75
    if payload.get("route") and payload["route"] != task["lane"]:
        write_json(fleet / "route.json", {"lane": payload["route"],
                                          "note": payload.get("route_note", f"done in {task['lane']}")})
    emit(result_record(session, is_error=(mode == "is_error"), steps=max(this_attempt, 1), scale=scale,
                       text=f"finished {task['key']} in {steps} steps"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
