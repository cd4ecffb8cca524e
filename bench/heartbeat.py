"""What a heartbeat round writes: rows per table and WAL when every shift heartbeats once (#18, item 3).

    uv run python -m bench.heartbeat [--scales 100x10,1000x10] [--rounds 3] [--conns 2] [--url ...]
    uv run python -m bench.heartbeat --quick          # 50x10, 2 rounds: a smoke run

For each scale S×T (S shifts holding T running tasks each) it builds a fresh scratch database: one
lane without a max_running limit, S*T tasks queued with fleet.enqueue_many, S sessions opened with
fleet.open_session, each claiming T tasks with fleet.claim (so S*T tasks run, T per session). Then
it runs --rounds heartbeat rounds. A round is every session calling
``fleet.heartbeat(session, <its T task ids>, '{}', null)`` once, each call its own transaction,
spread over --conns connections (it is the database's cost that is measured, not the client's).

For a round it prints:

* rows written per table: the deltas of pg_stat_user_tables (n_tup_ins, n_tup_upd — of which
  n_tup_hot_upd are HOT, a subset of n_tup_upd, not added again — and n_tup_del). PostgreSQL 15
  keeps a backend's counters pending for up to a second, so every connection that wrote calls
  pg_stat_force_next_flush() before each reading, and the reader clears its snapshot;
* WAL bytes: pg_wal_lsn_diff of pg_current_wal_insert_lsn() after and before the round (the whole
  server's WAL, as the LSN is). Where pg_walinspect can be created (a superuser, PostgreSQL 15+),
  also the records, the bytes of full-page images, and how much of the WAL in the window was not
  this database's (other databases on a shared server, background records): a warning when large;
* the wall time of the round, and per heartbeat: rows, WAL bytes, wall time (round / S).

Round 1 follows a VACUUM and a CHECKPOINT, so each page it changes is written whole once
(full_page_writes): the cost a round pays once per checkpoint interval. Later rounds are the steady
state between checkpoints. Autovacuum is switched off on the scratch database's fleet tables so
that no vacuum lands inside a round. Exits 1 if a round lost a task (a session's running tasks are
not T after it) or a call failed.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from bench.harness import DEFAULT_URL, git_state, log, machine, scratch_db

LANE = "hb"
SETTINGS = ("full_page_writes", "wal_level", "wal_compression", "wal_log_hints", "checkpoint_timeout",
            "max_wal_size", "autovacuum")


@dataclass
class Round:
    rows: dict[str, dict[str, int]]  # table -> {ins, upd, hot, del}
    wal: float
    wall: float
    statuses: dict[str, int]
    records: int | None = None
    fpi: int | None = None
    foreign: int | None = None  # WAL bytes in the window not attributable to this database
    commits: int | None = None
    kinds: dict[str, int] = field(default_factory=dict)  # WAL bytes by resource manager
    notes: list[str] = field(default_factory=list)

    def written(self, table: str | None = None) -> int:
        tables = [table] if table else list(self.rows)
        return sum(self.rows[t]["ins"] + self.rows[t]["upd"] + self.rows[t]["del"] for t in tables if t in self.rows)


def parse_scales(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        s, _, t = part.strip().lower().partition("x")
        out.append((int(s), int(t)))
    return out


def table_counts(conn: psycopg.Connection[Any]) -> dict[str, dict[str, int]]:
    conn.execute("select pg_stat_clear_snapshot()")
    rows = conn.execute("select schemaname || '.' || relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del"
                        "  from pg_stat_user_tables").fetchall()
    return {r[0]: {"ins": r[1], "upd": r[2], "hot": r[3], "del": r[4]} for r in rows}


def flush_stats(conns: list[psycopg.Connection[Any]], pg15: bool) -> None:
    """Every backend that wrote publishes its pending table counters (PostgreSQL 15+ keeps them
    in the backend for up to a second; before 15 the collector lags by up to half a second)."""
    if pg15:
        for c in conns:
            c.execute("select pg_stat_force_next_flush()")
    else:
        time.sleep(1.0)


def lsn(conn: psycopg.Connection[Any]) -> str:
    return str(conn.execute("select pg_current_wal_insert_lsn()").fetchone()[0])  # type: ignore[index]


def beat(conn: psycopg.Connection[Any], work: list[tuple[Any, list[int]]], statuses: dict[str, int],
         errors: list[BaseException], lock: threading.Lock) -> None:
    mine: dict[str, int] = {}
    try:
        for session, tasks in work:
            cur = conn.execute("select * from fleet.heartbeat(%s, %s, '{}'::bigint[], null)", (session, tasks))
            names = [d.name for d in cur.description or ()]
            rows = cur.fetchall()
            if "status" in names:
                i = names.index("status")
                for r in rows:
                    mine[r[i]] = mine.get(r[i], 0) + 1
            else:
                mine["(rows)"] = mine.get("(rows)", 0) + len(rows)
    except BaseException as exc:  # reported by the caller
        errors.append(exc)
    with lock:
        for k, v in mine.items():
            statuses[k] = statuses.get(k, 0) + v


def wal_detail(conn: psycopg.Connection[Any], start: str, end: str,
               dboid: int) -> tuple[int, int, int, int, dict[str, int]]:
    """(records, full-page-image bytes, bytes not of this database, commits of this database,
    bytes by resource manager)."""
    ours = rf"rel \d+/{dboid}/"
    row = conn.execute(
        "with r as (select xid, record_length, fpi_length, block_ref, resource_manager, record_type"
        "             from pg_get_wal_records_info(%s, %s)),"
        "     x as (select distinct xid from r where xid <> '0' and block_ref ~ %s)"
        " select count(*), coalesce(sum(fpi_length), 0),"
        "        coalesce(sum(record_length) filter (where not (coalesce(block_ref, '') ~ %s"
        "                                                       or xid in (select xid from x))), 0),"
        "        count(*) filter (where resource_manager = 'Transaction' and record_type like 'COMMIT%%'"
        "                           and xid in (select xid from x))"
        "   from r", (start, end, ours, ours)).fetchone()
    assert row is not None
    kinds = conn.execute('select "resource_manager/record_type", sum(combined_size) from pg_get_wal_stats(%s, %s)'
                         " where count > 0 group by 1 order by 2 desc", (start, end)).fetchall()
    return int(row[0]), int(row[1]), int(row[2]), int(row[3]), {k: int(v) for k, v in kinds}


def measure(server_url: str, shifts: int, per: int, rounds: int, nconns: int) -> list[Round]:
    with scratch_db(server_url, "heartbeat") as url, psycopg.connect(url, autocommit=True) as conn:
        pg15 = int(conn.execute("show server_version_num").fetchone()[0]) >= 150000  # type: ignore[index]
        dboid = int(conn.execute("select oid from pg_database where datname = current_database()").fetchone()[0])  # type: ignore[index]
        walinspect = False
        if pg15:
            try:
                conn.execute("create extension if not exists pg_walinspect")
                walinspect = True
            except psycopg.Error as exc:
                log(f"(no pg_walinspect: {exc.diag.message_primary}; WAL as the LSN difference only)")
        for (table,) in conn.execute("select format('%I.%I', schemaname, tablename) from pg_tables"
                                     " where schemaname = 'fleet'").fetchall():
            conn.execute(f"alter table {table} set (autovacuum_enabled = false)")

        t0 = time.perf_counter()
        conn.execute("select fleet.sync_lane(%s, %s)", (LANE, Jsonb({"lease_seconds": 600})))
        conn.execute("select count(*) from fleet.enqueue_many(%s, %s)",
                     (LANE, Jsonb([{"key": f"hb:{i}"} for i in range(shifts * per)])))
        work: list[tuple[Any, list[int]]] = []
        for i in range(shifts):
            session = conn.execute("select fleet.open_session(%s, 'bench-heartbeat', %s, null, 3600)",
                                   (LANE, i + 1)).fetchone()[0]  # type: ignore[index]
            ids = [r[0] for r in conn.execute("select id from fleet.claim(%s, %s)", (session, per)).fetchall()]
            assert len(ids) == per, f"session {i} claimed {len(ids)} tasks, not {per}"
            work.append((session, sorted(ids)))
        running = conn.execute("select count(*) from fleet.tasks where state = 'running'").fetchone()[0]  # type: ignore[index]
        assert running == shifts * per, f"{running} tasks running, not {shifts * per}"
        log(f"  set up {shifts:,} sessions × {per} running tasks ({running:,}) in {time.perf_counter() - t0:.1f} s")

        conns = [psycopg.connect(url, autocommit=True) for _ in range(nconns)]
        try:
            shares = [work[k::nconns] for k in range(nconns)]
            out: list[Round] = []
            for n in range(rounds):
                if n == 0:
                    conn.execute("vacuum (analyze) fleet.tasks")
                    conn.execute("vacuum (analyze) fleet.sessions")
                    try:
                        conn.execute("checkpoint")
                    except psycopg.Error as exc:
                        log(f"(no checkpoint before round 1: {exc.diag.message_primary})")
                flush_stats([conn, *conns], pg15)
                before = table_counts(conn)
                start = lsn(conn)
                statuses: dict[str, int] = {}
                errors: list[BaseException] = []
                lock = threading.Lock()
                threads = [threading.Thread(target=beat, args=(c, share, statuses, errors, lock))
                           for c, share in zip(conns, shares, strict=True)]
                t0 = time.perf_counter()
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                wall = time.perf_counter() - t0
                end = lsn(conn)
                if errors:
                    raise errors[0]
                flush_stats([conn, *conns], pg15)
                after = table_counts(conn)
                wal = float(conn.execute("select pg_wal_lsn_diff(%s, %s)", (end, start)).fetchone()[0])  # type: ignore[index]
                rows = {}
                for table, c in after.items():
                    b = before.get(table, {"ins": 0, "upd": 0, "hot": 0, "del": 0})
                    d = {k: c[k] - b[k] for k in c}
                    if any(d.values()):
                        rows[table] = d
                r = Round(rows=rows, wal=wal, wall=wall, statuses=statuses)
                if walinspect:
                    try:
                        r.records, r.fpi, r.foreign, r.commits, r.kinds = wal_detail(conn, start, end, dboid)
                    except psycopg.Error as exc:
                        r.notes.append(f"pg_walinspect: {exc.diag.message_primary}")
                held = conn.execute(
                    "select count(*) filter (where n = %s), count(*) from (select count(t.id) n"
                    "  from fleet.sessions s left join fleet.tasks t on t.session_id = s.id and t.state = 'running'"
                    " where s.state = 'active' group by s.id) x", (per,)).fetchone()
                assert held is not None
                if held[0] != shifts or held[1] != shifts:
                    raise AssertionError(f"after round {n + 1}: {held[0]} of {held[1]} active sessions hold {per} "
                                         f"running tasks (of {shifts} sessions)")
                out.append(r)
            return out
        finally:
            for other in conns:
                other.close()


def fmt_bytes(x: float) -> str:
    return f"{x / 1e6:,.2f} MB" if x >= 1e6 else f"{x / 1e3:,.1f} kB"


def report(shifts: int, per: int, rounds: list[Round], nconns: int) -> None:
    # the two tables a heartbeat is about always get a column, then whatever else was written
    tables = sorted({"fleet.sessions", "fleet.tasks"} | {t for r in rounds for t in r.rows})
    log("")
    log(f"### {shifts:,} shifts × {per} tasks = {shifts * per:,} running tasks; "
        f"{shifts:,} heartbeats a round over {nconns} connection(s)")
    log("")
    log("| round | " + " | ".join(f"{t} rows (ins/upd/HOT/del)" for t in tables)
        + " | rows written | WAL | of which full-page images | WAL records | wall |")
    log("| --- | " + " | ".join("---:" for _ in tables) + " | ---: | ---: | ---: | ---: | ---: |")
    for i, r in enumerate(rounds, 1):
        cells = []
        for t in tables:
            d = r.rows.get(t, {"ins": 0, "upd": 0, "hot": 0, "del": 0})
            cells.append(f"{d['ins'] + d['upd'] + d['del']:,} ({d['ins']}/{d['upd']}/{d['hot']}/{d['del']})")
        fpi = fmt_bytes(r.fpi) if r.fpi is not None else "n/a"
        recs = f"{r.records:,}" if r.records is not None else "n/a"
        label = f"{i}{' (after a checkpoint)' if i == 1 else ''}"
        log(f"| {label} | " + " | ".join(cells)
            + f" | {r.written():,} | {fmt_bytes(r.wal)} | {fpi} | {recs} | {r.wall:.2f} s |")
    log("")
    for i, r in enumerate(rounds, 1):
        other = [f"{k}={v:,}" for k, v in sorted(r.statuses.items())]
        extra = (f"; this database's commits {r.commits:,}; WAL not this database's {fmt_bytes(r.foreign or 0)}"
                 if r.commits is not None else "")
        log(f"round {i}: heartbeat statuses {', '.join(other) or '(none)'}{extra}")
        if r.kinds:
            log("  WAL by resource manager: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r.kinds.items()))
        if r.foreign is not None and r.foreign > 0.02 * r.wal:
            log(f"  warning: {fmt_bytes(r.foreign)} of the round's WAL was not this database's "
                "(other work on the server): the WAL figure is high by about that much")
        for note in r.notes:
            log(f"  {note}")
    steady = rounds[1:] or rounds
    label = (f"rounds 2–{len(rounds)}" if len(rounds) > 2 else "round 2") if len(rounds) > 1 else "round 1"
    med = statistics.median
    log("")
    log(f"per heartbeat (median of {label}; round 1 after a checkpoint in brackets):")
    for t in tables:
        log(f"  {t:22s} rows written {med(r.written(t) for r in steady) / shifts:8.2f}"
            f"   [{rounds[0].written(t) / shifts:.2f}]")
    log(f"  {'all tables':22s} rows written {med(r.written() for r in steady) / shifts:8.2f}"
        f"   [{rounds[0].written() / shifts:.2f}]")
    log(f"  {'WAL':22s} {med(r.wal for r in steady) / shifts:12,.0f} B   [{rounds[0].wal / shifts:,.0f} B]")
    fpis = [r.fpi for r in rounds if r.fpi is not None]
    if len(fpis) == len(rounds):
        log(f"  {'of which full pages':22s} {med(fpis[1:] or fpis) / shifts:12,.0f} B   [{fpis[0] / shifts:,.0f} B]")
    log(f"  {'wall (round / shifts)':22s} {med(r.wall for r in steady) / shifts * 1000:12.3f} ms"
        f"   [{rounds[0].wall / shifts * 1000:.3f} ms]")
    log(f"  per running task: {med(r.written() for r in steady) / (shifts * per):.2f} rows, "
        f"{med(r.wal for r in steady) / (shifts * per):,.0f} B of WAL")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="100x10,1000x10", help="SHIFTSxTASKS, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conns", type=int, default=2, help="connections the heartbeats of a round are spread over")
    ap.add_argument("--quick", action="store_true", help="50x10, 2 rounds (a smoke run)")
    ap.add_argument("--url", default=DEFAULT_URL)
    args = ap.parse_args()
    scales = [(50, 10)] if args.quick else parse_scales(args.scales)
    rounds = 2 if args.quick else args.rounds
    assert rounds >= 1 and args.conns >= 1
    t0 = time.perf_counter()
    with psycopg.connect(args.url, autocommit=True) as conn:
        log(f"machine: {machine(conn)}")
        values = conn.execute("select name, setting || coalesce(unit, '') from pg_settings where name = any(%s)",
                              (list(SETTINGS),)).fetchall()
        log("settings: " + ", ".join(f"{k}={v}" for k, v in sorted(values)))
    log(f"tree: {git_state()}")
    for shifts, per in scales:
        log("")
        log(f"scale {shifts}x{per}")
        report(shifts, per, measure(args.url, shifts, per, rounds, args.conns), args.conns)
    log("")
    log(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
