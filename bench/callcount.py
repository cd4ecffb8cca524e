"""Run ``fleet`` counting every statement it sends: ``python -m bench.callcount OUT -- ARGS...``.

For bench/overheads.py: the counting is done in the client, at the lowest level every psycopg
statement goes through (``Cursor.execute`` / ``executemany``; ``Connection.execute`` and the
pool's connection check, an empty statement, use it), so it is exact and per process (= per
shift session). Every half second, and at exit, the cumulative counts go to the JSON file OUT:
``{"t": <time.time()>, "counts": {label: n}}``, a label being the ``fleet.*`` function a
statement calls, ``(pool check)`` for the pool's empty statement, or the statement's first words.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import runpy
import sys
import threading
import time
from collections import Counter
from typing import Any

_FLEET_CALL = re.compile(r"\bfleet\.(\w+)\s*\(")


def label(query: Any) -> str:
    if not isinstance(query, str | bytes):
        try:
            query = query.as_string(None)
        except Exception:
            return type(query).__name__
    text = query.decode() if isinstance(query, bytes) else query
    if not text.strip():
        return "(pool check)"
    m = _FLEET_CALL.search(text)
    return f"fleet.{m.group(1)}" if m else " ".join(text.split()[:4])[:60]


def install(out: str) -> None:
    import psycopg

    counts: Counter[str] = Counter()
    lock = threading.Lock()
    original, original_many = psycopg.Cursor.execute, psycopg.Cursor.executemany

    def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        with lock:
            counts[label(query)] += 1
        return original(self, query, *args, **kwargs)

    def executemany(self: Any, query: Any, params_seq: Any, *args: Any, **kwargs: Any) -> Any:
        params_seq = list(params_seq)
        with lock:
            counts[label(query)] += len(params_seq)
        return original_many(self, query, params_seq, *args, **kwargs)

    psycopg.Cursor.execute = execute  # type: ignore[method-assign]
    psycopg.Cursor.executemany = executemany  # type: ignore[method-assign]

    def dump() -> None:
        with lock:
            data = {"t": time.time(), "counts": dict(counts)}
        tmp = f"{out}.tmp"
        with open(tmp, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, out)

    def loop() -> None:
        while True:
            dump()
            time.sleep(0.5)

    threading.Thread(target=loop, daemon=True).start()
    atexit.register(dump)


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        sys.exit("usage: python -m bench.callcount OUT -- FLEET-ARGS...")
    install(sys.argv[1])
    sys.argv = ["fleet", *sys.argv[3:]]
    runpy.run_module("monitor.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
