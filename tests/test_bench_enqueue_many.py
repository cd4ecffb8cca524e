"""bench/enqueue_many.py times fleet.enqueue_many against plain inserts of the same rows and, with
--parts, against copies of itself with one part taken out: each copy is the live definition less
exactly that part, a definition that no longer holds a part stops the run by name, and the run
prints every call it timed. Times are never asserted (bench/README.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from sqlkit import one

from bench import copies, enqueue_many

ROOT = Path(__file__).resolve().parent.parent


def definition(conn: psycopg.Connection, fn: str) -> str:
    return str(one(conn, "select prosrc from pg_proc where oid = %s::regproc", (fn,)))


def test_each_copy_is_the_function_less_its_part(conn: psycopg.Connection) -> None:
    fns = enqueue_many.part_copies(conn)
    assert list(fns) == list(enqueue_many.PARTS)
    whole = definition(conn, "fleet.enqueue_many")
    for name, edits in enqueue_many.PARTS.items():
        expected = whole
        for old, new in edits:
            assert expected.count(old) == 1, name  # the part is there, once
            expected = expected.replace(old, new)
        assert definition(conn, fns[name]) == expected != whole, name


def test_a_definition_without_a_part_stops_the_copies_by_name(conn: psycopg.Connection) -> None:
    conn.execute(copies.definition(conn, "fleet.enqueue_many(text,jsonb)").replace("and octet_length(e.payload::text) > n.max_bytes",
                                     "and octet_length(e.payload::text) >= n.max_bytes + 1"))
    with pytest.raises(enqueue_many.DefinitionChanged,
                       match=re.escape("less the payload's size check: fleet.enqueue_many no longer holds")):
        enqueue_many.part_copies(conn)


def test_enqueue_many_prints_every_call_it_timed(pg_server: str) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.enqueue_many", "--tasks", "20", "--reps", "1", "--parts",
                           "--url", pg_server], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    timed = re.findall(r"^\s*20 tasks  (\S.*?)\s+wall median\s+[\d.]+ ms", done.stdout, re.M)
    assert timed == ["enqueue_many, this tree", "plain INSERT", "plain INSERT ON CONFLICT",
                     *enqueue_many.PARTS], done.stdout
