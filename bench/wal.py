"""What one job writes: the WAL of lanefleet's claim → complete cycle, by record type, and the index
entries behind it (#7: what bounds the durable mode).

    uv run python -m bench.wal [--jobs 2000] [--url postgresql://...]

One client drains --jobs no-op tasks twice in a scratch database: in the durable mode (claims of
10, one fleet.complete per task, one commit each) and in bulk mode (claims of 100, one
fleet.complete_many per claim). Between the first and the last call it reads the server's WAL
with pg_walinspect (PostgreSQL 15+, in contrib; the scratch database gets the extension) and
prints bytes and records per job by resource manager / record type, full-page images apart, and
the index entries written per job (the WAL's Btree/INSERT_LEAF and INSERT_POST records). Needs a
role that may create the extension (a superuser, as on the machine's own server).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from bench.harness import log, scratch_db

LANE = "wal"


def drain(conn: psycopg.Connection[Any], session: Any, batch: int, many: bool) -> None:
    while True:
        rows = conn.execute("select id, lease_token from fleet.claim(%s, %s)", (session, batch)).fetchall()
        if not rows:
            return
        if many:
            conn.execute("select count(*) from fleet.complete_many(%s, %s)",
                         ([r[0] for r in rows], [r[1] for r in rows])).fetchall()
        else:
            for r in rows:
                conn.execute("select fleet.complete(%s, %s)", r).fetchall()


def measure(url: str, jobs: int, batch: int, many: bool) -> list[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("delete from fleet.events; delete from fleet.runs; delete from fleet.tasks;"
                     " delete from fleet.sessions")
        conn.execute("select count(*) from fleet.enqueue_many(%s, %s)",
                     (LANE, Jsonb([{"key": f"wal:{i}", "payload": {"i": i}} for i in range(jobs)])))
        conn.execute("vacuum analyze")
        session = conn.execute("select fleet.open_session(%s, 'bench-wal', 1, null, 3600)", (LANE,)).fetchone()
        assert session is not None
        # from a checkpoint, as the queue benchmark runs: each page's first change after it is
        # written whole (a full-page image), shown apart below
        conn.execute("checkpoint")
        start = conn.execute("select pg_current_wal_insert_lsn()").fetchone()[0]  # type: ignore[index]
        drain(conn, session[0], batch, many)
        end = conn.execute("select pg_current_wal_insert_lsn()").fetchone()[0]  # type: ignore[index]
        done = conn.execute("select count(*) from fleet.tasks where state = 'done'").fetchone()[0]  # type: ignore[index]
        assert done == jobs, f"{done} of {jobs} tasks done"
        total = float(conn.execute("select pg_wal_lsn_diff(%s, %s)", (end, start)).fetchone()[0])  # type: ignore[index]
        stats = conn.execute(
            'select "resource_manager/record_type", count, record_size, fpi_size, combined_size'
            "  from pg_get_wal_stats(%s, %s, true) where count > 0 order by combined_size desc",
            (start, end)).fetchall()
    lines = [f"WAL per job: {total / jobs:,.0f} B ({total / 1e6:.1f} MB for {jobs:,} jobs)", "",
             "| record type | records/job | bytes/job | of which full-page images |",
             "| --- | ---: | ---: | ---: |"]
    for kind, count, _rec, fpi, combined in stats[:12]:
        lines.append(f"| {kind} | {count / jobs:.2f} | {combined / jobs:,.0f} | {fpi / jobs:,.0f} |")
    entries = sum(c for k, c, *_ in stats if k in ("Btree/INSERT_LEAF", "Btree/INSERT_POST"))
    lines += ["", f"index entries per job (Btree/INSERT_LEAF + INSERT_POST): {entries / jobs:.1f}"]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--url", default=os.environ.get("TEST_DATABASE_URL",
                                                    "postgresql://postgres@127.0.0.1:5432/postgres"))
    args = ap.parse_args()
    with scratch_db(args.url, "wal") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("create extension if not exists pg_walinspect")
            conn.execute("select fleet.sync_lane(%s, '{}'::jsonb)", (LANE,))
        for title, batch, many in (("durable: claim 10, one complete per task", 10, False),
                                   ("bulk mode: claim 100, one complete_many per claim", 100, True)):
            log(f"## {title}")
            log("")
            for line in measure(url, args.jobs, batch, many):
                log(line)
            log("")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
