"""bench/complete_parts.py times fleet.complete against copies of itself with one part taken out:
the copies are the live definition less exactly that part, the run prints every copy and part,
and a definition that no longer holds a part stops the run by name. Times are never asserted
(bench/README.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from sqlkit import one

from bench import complete_parts

ROOT = Path(__file__).resolve().parent.parent


def definition(conn: psycopg.Connection, fn: str) -> str:
    return str(one(conn, "select prosrc from pg_proc where oid = %s::regproc", (fn,)))


def test_each_copy_is_the_function_less_its_part(conn: psycopg.Connection) -> None:
    fns = complete_parts.copies(conn)
    assert list(fns) == list(complete_parts.COPIES)
    whole = definition(conn, "fleet.complete")
    for name, edits in complete_parts.COPIES.items():
        if edits is None:
            assert fns[name] == "fleet.complete"
            continue
        expected = whole
        for old, new in edits:
            assert old in expected, name
            expected = expected.replace(old, new)
        assert definition(conn, fns[name]) == expected != whole, name


def test_a_definition_without_a_part_stops_the_copies_by_name(conn: psycopg.Connection) -> None:
    conn.execute(complete_parts.definition(conn).replace(complete_parts.LANE_CHECK, ""))
    with pytest.raises(complete_parts.DefinitionChanged, match=re.escape("without the lane check: fleet.complete no longer")):
        complete_parts.copies(conn)


def test_the_parts_are_the_whole_less_each_copy() -> None:
    med = {"fleet.complete": 100.0, "without the lane check": 95.0, "done state a constant": 85.0,
           "neither of the two": 78.0, "without the run's close": 70.0}
    assert dict(complete_parts.parts(med)) == {
        "the lane check (fleet._lane_allowed)": 5.0, "the done state (fleet._done_state)": 15.0,
        "the two together (the whole less neither)": 22.0, "the run's close (fleet._end_run)": 30.0,
        "the rest: the task's update, the call": 48.0}
    # timed in transactions of their own: the call and commit of a function doing nothing are not a part
    assert dict(complete_parts.parts({**med, complete_parts.NOTHING: 40.0}))[
        "the rest: the task's update, the call"] == 8.0


@pytest.mark.parametrize("own", [False, True])
def test_complete_parts_prints_every_copy_and_part(pg_server: str, own: bool) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.complete_parts", "--calls", "20", "--reps", "2",
                           *(["--own-transactions"] if own else []), "--url", pg_server],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = {m.group(1): float(m.group(2))
               for m in re.finditer(r"^(\S.*?)\s{2,}(-?[\d.]+)(?:\s+(-?[\d.]+%?))?$", done.stdout, re.M)}
    copies = [*complete_parts.COPIES, *([complete_parts.NOTHING] if own else [])]
    assert set(copies) <= set(figures), done.stdout
    labels = [label for label, _ in complete_parts.parts(dict.fromkeys(complete_parts.COPIES, 1.0))]
    assert set(labels) <= set(figures), done.stdout
    assert all(figures[name] > 0 for name in copies), done.stdout
    assert ("each call its own transaction" in done.stdout) is own
    assert all(len(line) <= 80 for line in done.stdout.splitlines()), done.stdout
