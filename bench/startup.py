"""How long `fleet` takes to start, with and without a bytecode cache.

    uv run python -m bench.startup [--runs 5]

Every `fleet` command, shift and monitor pass is a new Python process. Where
PYTHONDONTWRITEBYTECODE is set (some machines set it) and nothing byte-compiled the code, each of
them compiles every module it imports again. "without a cache" points PYTHONPYCACHEPREFIX at an
empty folder, so nothing cached is found; "with the cache" is the installation as it is (Python
caches what it compiles unless PYTHONDONTWRITEBYTECODE is set; the test suite byte-compiles
lanefleet and its environment at its start either way). Prints the median wall and CPU seconds of
`fleet --help`.
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


def run(env: dict[str, str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "monitor.cli", "--help"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as empty:
        cases = {
            "without a cache": {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": empty},
            "with the cache": dict(os.environ),
        }
        for name, env in cases.items():
            run(env)  # warm the page cache
            walls, cpus = zip(*(run(env) for _ in range(args.runs)), strict=True)
            print(f"fleet --help {name:16} wall {statistics.median(walls):.2f} s  cpu {statistics.median(cpus):.2f} s"
                  f"  (median of {args.runs})")


if __name__ == "__main__":
    main()
