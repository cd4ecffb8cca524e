"""What one fleet.enqueue_many call costs: N new tasks in one call, against a plain INSERT of the
same rows (the floor: the table, its indexes and its triggers, no checks), that INSERT with
``ON CONFLICT (key, lane) DO NOTHING`` (the floor with the key's probe), and, with ``--parts``,
copies of enqueue_many with one part taken out.

```bash
uv run python -m bench.enqueue_many --tasks 1000 --tasks 10000 --reps 9
uv run python -m bench.enqueue_many --before /tmp/old-migrations   # + the same with older migrations
uv run python -m bench.enqueue_many --tasks 1000 --reps 15 --parts # + a copy less each part
```

Each figure is the median of ``--reps`` calls, each on emptied tables, one autocommit call timed
from the client (the JSON sent, the rows returned, the commit), and the CPU time its server
backend spent on it (/proc/<pid>/schedstat, when the server runs on this machine: on a busy
machine the steadier figure). ``--before DIR`` migrates a second scratch database with the
migrations of DIR (e.g. ``git archive HEAD~1 migrations | tar -x -C …``) and alternates its calls
with this tree's, so the two columns see the same machine.

``--parts``: the copies are made from the live definition (pg_get_functiondef) by replacing the
text of one part (``PARTS``), as bench/complete_parts.py does for fleet.complete; a part whose
text is no longer there stops the run (exit status 1). Each copy is wrong on purpose (no checks,
no answer…) and an upper bound of what its part costs; it runs only in its scratch database.
Times are printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.types.json import Jsonb

from bench.copies import DefinitionChanged, function_copies
from bench.harness import DEFAULT_URL, log

LANE = "bench"
PLAIN = ("insert into fleet.tasks (lane, key, payload)"
         " select %s, x ->> 'key', x -> 'payload' from jsonb_array_elements(%s) x")
PLAIN_CONFLICT = PLAIN + " on conflict (key, lane) do nothing"
ANSWER = """    return query
    select (r.ord - 1)::int, r.id, r.key, r.created
      from unnest(v_ids, v_keys, v_created) with ordinality r(id, key, created, ord)
     order by r.ord;
"""
# a copy's name -> the (text, replacement) pairs that make it from fleet.enqueue_many
PARTS: dict[str, list[tuple[str, str]]] = {
    "less the key's lookup": [("where t.key = e.key\n", "where false and t.key = e.key\n")],
    "less every check": [("when jsonb_typeof(e.t) <> 'object' then 'not_object'", "when true then null")],
    "less the unknown-field check": [("when e.t - v_fields <> '{}' then", "when false then")],
    "less the payload's size check": [("and octet_length(e.payload::text) > n.max_bytes", "and false")],
    "less the lock-order sort": [("order by f.key, f.lane, f.idx\n", "\n")],
    "less the answer": [(ANSWER, "    return;\n")],
}


def part_copies(conn: psycopg.Connection) -> dict[str, str]:
    """Create the copies of ``PARTS`` in the database: name -> the function to call."""
    return function_copies(conn, "fleet.enqueue_many(text,jsonb)", PARTS, "fleet._bench_enqueue_many_")


def _db(server: str, name: str, migrations: Path | None) -> str:
    from worker.db.migrate import load_migrations, migrate

    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'create database "{name}"')
    url = make_conninfo(server, dbname=name)
    migrate(url, migrations=load_migrations(migrations) if migrations else None)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("select fleet.sync_lane(%s, '{}')", (LANE,))
    return url


def _cpu_ns(pid: int) -> int | None:
    """The CPU time a local process has used (ns), or None (no such file: not this machine's)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _once(conn: psycopg.Connection, stmt: str, n: int, *, answers: bool = False) -> tuple[float, float | None]:
    """One call on emptied tables: (wall seconds, the backend's CPU seconds or None). ``answers``:
    the call returns (id, created) per task, all of them new (a copy of --parts need not)."""
    conn.execute("truncate fleet.events, fleet.runs, fleet.tasks restart identity cascade")
    conn.execute("vacuum analyze fleet.tasks")
    tasks = Jsonb([{"key": f"bench:{i}", "payload": {"n": i}} for i in range(n)])
    pid = conn.info.backend_pid
    cpu0 = _cpu_ns(pid)
    t0 = time.perf_counter()
    cur = conn.execute(stmt, (LANE, tasks))
    if cur.description is not None:
        got = cur.fetchall()
        assert not answers or (len(got) == n and all(c for _, c in got)), "every task new"
    secs = time.perf_counter() - t0
    cpu1 = _cpu_ns(pid)
    assert conn.execute("select count(*) from fleet.tasks").fetchone() == (n,)
    return secs, (cpu1 - cpu0) / 1e9 if cpu0 is not None and cpu1 is not None else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=DEFAULT_URL, help="the server (default %(default)s)")
    ap.add_argument("--tasks", type=int, action="append", help="tasks per call (repeatable; default 1000, 10000)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--before", type=Path, help="a migrations folder to compare with")
    ap.add_argument("--parts", action="store_true", help="also time copies of enqueue_many less one part each")
    args = ap.parse_args(argv)
    sizes = args.tasks or [1000, 10000]
    tag = f"{time.time_ns() % 10**8:08d}"
    dbs = {"this tree": f"lf_bench_enq_{tag}"} | ({"before": f"lf_bench_enqold_{tag}"} if args.before else {})
    urls: dict[str, str] = {}
    try:
        for label, name in dbs.items():
            urls[label] = _db(args.url, name, args.before if label == "before" else None)
        # label -> (database, statement, whether it answers (id, created) for every task)
        calls = {f"enqueue_many, {label}": (url, "select id, created from fleet.enqueue_many(%s, %s)", True)
                 for label, url in urls.items()}
        calls["plain INSERT"] = (urls["this tree"], PLAIN, False)
        calls["plain INSERT ON CONFLICT"] = (urls["this tree"], PLAIN_CONFLICT, False)
        if args.parts:
            with psycopg.connect(urls["this tree"], autocommit=True) as conn:
                try:
                    copies = part_copies(conn)
                except DefinitionChanged as exc:
                    log(f"error: {exc} (bench/enqueue_many.py, PARTS)")
                    return 1
            calls |= {name: (urls["this tree"], f"select id, created from {fn}(%s, %s)", False)
                      for name, fn in copies.items()}
        conns = {k: psycopg.connect(u, autocommit=True) for k, (u, _, _) in calls.items()}
        for n in sizes:
            wall: dict[str, list[float]] = {k: [] for k in calls}
            cpu: dict[str, list[float]] = {k: [] for k in calls}
            for k, (_, stmt, answers) in calls.items():  # one warm-up each
                _once(conns[k], stmt, n, answers=answers)
            for _ in range(args.reps):
                for k, (_, stmt, answers) in calls.items():
                    w, c = _once(conns[k], stmt, n, answers=answers)
                    wall[k].append(w)
                    if c is not None:
                        cpu[k].append(c)
            for k, xs in wall.items():
                ms = sorted(x * 1000 for x in xs)
                line = (f"{n:>6} tasks  {k:<30} wall median {statistics.median(ms):7.1f} ms"
                        f" (min {ms[0]:.1f}, max {ms[-1]:.1f}; {n / statistics.median(xs):,.0f} tasks/s)")
                if cpu[k]:
                    cs = sorted(x * 1000 for x in cpu[k])
                    line += f"  server CPU median {statistics.median(cs):7.1f} ms (min {cs[0]:.1f})"
                log(line)
        for conn in conns.values():
            conn.close()
    finally:
        with psycopg.connect(args.url, autocommit=True) as admin:
            for name in dbs.values():
                admin.execute(f'drop database if exists "{name}" with (force)')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
