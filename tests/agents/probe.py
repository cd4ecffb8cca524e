"""A scripted "attacker" agent for tests/test_agent_sandbox.py: it records what it can see.

Run by a shift in a task workspace (``python tests/agents/probe.py``). Its task's payload says what
to try; everything it found goes to ``probe.json`` in the workspace:

- ``env``: its whole environment;
- ``read``: paths to read — a file's text, or a folder's files (walked, each one read);
- ``write``: paths to write a line to (``ok`` or the error);
- ``guard``: run ``fleet guard -- true`` (its exit code and stderr);
- ``run``: commands to run in the workspace (each an argv: its exit code, stdout and stderr);
- ``procs``: read the environment of every process it can see in /proc;
- ``linger``: start a process that leaves the agent's session and process group (a daemon
  sleeping with the marker ``linger`` in its command line), then wait for SIGTERM: write
  ``stopped.txt`` and exit 75 (a graceful hand-off).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def read(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        if p.is_dir():
            found: dict[str, Any] = {}
            for folder, _dirs, files in os.walk(p):
                for name in files:
                    found[os.path.join(folder, name)] = read(os.path.join(folder, name))
            return {"ok": True, "folder": found}
        return {"ok": True, "text": p.read_bytes().decode("utf-8", "replace")[:4000]}
    except OSError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc.strerror}"}


def write(path: str) -> dict[str, Any]:
    try:
        Path(path).write_text("written by the probe agent\n")
        return {"ok": True}
    except OSError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc.strerror}"}


def main() -> int:
    payload = json.loads(Path(".fleet/task.json").read_text())["payload"]
    out: dict[str, Any] = {"env": dict(os.environ), "cwd": os.getcwd()}
    out["read"] = {p: read(p) for p in payload.get("read", [])}
    out["write"] = {p: write(p) for p in payload.get("write", [])}
    out["run"] = []
    for argv in payload.get("run", []):
        try:
            ran = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            out["run"].append({"rc": ran.returncode, "stdout": ran.stdout, "stderr": ran.stderr})
        except OSError as exc:
            out["run"].append({"rc": None, "stdout": "", "stderr": repr(exc)})
    if payload.get("procs"):
        out["procs"] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                out["procs"][entry.name] = read(str(entry / "environ"))
    if payload.get("guard"):
        try:
            done = subprocess.run(["fleet", "guard", "--", "true"], capture_output=True, text=True, timeout=60)
            out["guard"] = {"rc": done.returncode, "stderr": done.stderr}
        except OSError as exc:
            out["guard"] = {"rc": None, "stderr": repr(exc)}
    Path("probe.json").write_text(json.dumps(out, indent=1))
    if not payload.get("linger"):
        return 0

    def stop(_signum: int, _frame: object) -> None:
        Path("stopped.txt").write_text("SIGTERM\n")
        sys.exit(75)

    signal.signal(signal.SIGTERM, stop)
    # a daemon: its own session (so its own process group), which the shift never signals itself
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "linger", os.getcwd()], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    Path("lingering.txt").write_text("started\n")
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
