"""How long `fleet` takes to start: `fleet --help`, and the two commands agents call inside their work.

    uv run python -m bench.startup [--runs 20]

Every `fleet` command, shift and monitor pass is a new Python process, and an agent pays the
start-up of `fleet guard` for every guarded command and of `fleet checkpoint` for every
checkpoint. Prints the median wall and CPU seconds of each (goals: `fleet guard` and `fleet
checkpoint` under 0.150 s, `fleet --help` under 0.400 s, on a quiet machine), with the bytecode
cache as installed, and, for `fleet --help`, without one: where PYTHONDONTWRITEBYTECODE is set and
nothing byte-compiled the code, every process compiles every module it imports again
(PYTHONPYCACHEPREFIX at an empty folder: nothing cached is found). `fleet guard -- true` runs
outside a task, so it is refused at once (exit 77) after its start-up: what is timed is the
start-up and the refusal, no shift. `fleet checkpoint` writes a real checkpoint into a scratch
workspace. A bare `python -c pass` is printed beside them.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def fleet_script() -> str:
    """The console script beside this interpreter (what a shift puts on an agent's PATH)."""
    script = Path(sys.executable).with_name("fleet")
    return str(script) if script.exists() else "fleet"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    fleet = fleet_script()
    agent_env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    with tempfile.TemporaryDirectory() as empty, tempfile.TemporaryDirectory() as ws:
        (Path(ws) / ".fleet").mkdir()
        cases = [
            ("python -c pass", [sys.executable, "-c", "pass"], dict(os.environ)),
            ("fleet guard -- true", [fleet, "guard", "--", "true"], agent_env),
            ("fleet checkpoint", [fleet, "checkpoint", "-d", '{"step": 3}', "--workspace", ws], agent_env),
            ("fleet --help", [fleet, "--help"], dict(os.environ)),
            ("fleet --help, no cache", [fleet, "--help"],
             {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": empty}),
        ]
        for name, argv, env in cases:
            run(argv, env)  # warm the page cache (and the bytecode cache where it is kept)
            walls, cpus = zip(*(run(argv, env) for _ in range(args.runs)), strict=True)
            print(f"{name:24} wall {statistics.median(walls):.3f} s  cpu {statistics.median(cpus):.3f} s"
                  f"  (median of {args.runs})")


if __name__ == "__main__":
    main()
