"""Terminal tables (worker/tables.py): columns are left out by priority instead of cutting keys, ids
and numbers; and every table command, run for real as a subprocess at 80 and 120 columns on a
history with long lane names, long keys and large numbers, prints no line wider than the terminal,
no ellipsis, and each key, id and number whole on one line."""

from __future__ import annotations

import io
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from rich.cells import cell_len
from rich.console import Console
from sqlkit import (
    build_batch_history,
    call,
    complete,
    enqueue,
    expire,
    fail,
    open_session,
    record_run,
    release,
    take,
)

from worker.tables import Col, FitTable, fmt_cost, fmt_num, print_table

BOOT = "from monitor.cli.app import main; main()"
WIDTHS = [80, 120]

# ------------------------------------------------------------------------------------------------
# the mechanism


def drawn(table: FitTable, width: int) -> list[str]:
    out = io.StringIO()
    print_table(Console(width=width, file=out), table, wide=table.wide)
    return out.getvalue().splitlines()


def fits(lines: list[str], width: int, whole: list[str]) -> None:
    """No line wider than ``width`` nor padded with blanks at its end, no ellipsis, each of
    ``whole`` on one line."""
    text = "\n".join(lines)
    assert max(cell_len(line) for line in lines) <= width, text
    assert [line for line in lines if line.endswith(" ")] == [], text
    assert "…" not in text, text
    cells = {c.strip() for line in lines for c in re.split(r"[│┃]", line)}
    for item in whole:
        assert any(item in line for line in lines), f"{item!r} is not whole on one line:\n{text}"
        # nor wrapped anywhere else: no cell holds only the start of it
        cut = [c for c in cells if len(c) >= 3 and c != item and item.startswith(c)]
        assert not cut, f"{item!r} is wrapped ({cut}):\n{text}"


def sample_table(wide: bool = False) -> FitTable:
    table = FitTable([Col("id", "num"), Col("lane", "key"), Col("key", "key"), Col("state", "key"),
                      Col("tokens", "num", 1), Col("cost", "num", 2), Col("attempts", "num", 3),
                      Col("title", drop=4)], wide=wide)
    table.add_row("1234567", "nightly-upgrades", "github.com/acme/widgets#4731", "running",
                  fmt_num(195_000), fmt_cost(0.55), "3", "upgrade every dependency of the widget factory")
    table.add_row("12", "docs", "issue:1", "cancelled", fmt_num(12), fmt_cost(0), "1", "short")
    return table


def headers(lines: list[str]) -> set[str]:
    return {h for h in ("tokens", "cost", "attempts", "title") if any(h in line for line in lines[:4])}


def test_columns_are_left_out_by_priority_and_keys_and_numbers_never_cut() -> None:
    whole = ["1234567", "nightly-upgrades", "github.com/acme/widgets#4731", "running", "cancelled"]
    seen: list[set[str]] = []
    for width in range(80, 181, 10):
        lines = drawn(sample_table(), width)
        fits(lines, width, whole)
        shown = headers(lines)
        for cell, header in (("195k", "tokens"), ("$0.55", "cost")):
            assert (header in shown) == any(cell in line for line in lines)
        seen.append(shown)
    # the lower a column's priority, the sooner it goes: what a width shows, every wider one shows
    assert all(a <= b for a, b in itertools.pairwise(seen))
    assert seen[0] < seen[-1] == {"tokens", "cost", "attempts", "title"}
    assert "4 more columns with --wide" in "\n".join(drawn(sample_table(), 80))


def test_wide_shows_every_column_however_wide() -> None:
    lines = drawn(sample_table(wide=True), 80)
    assert headers(lines) == {"tokens", "cost", "attempts", "title"}
    assert max(cell_len(line) for line in lines) > 80
    assert any("upgrade every dependency of the widget factory" in line for line in lines)
    assert [line for line in lines if line.endswith(" ")] == []


def test_a_table_without_edges_pads_no_line() -> None:
    """A title, a caption and the rows of a box without edges end where their text does."""
    from rich import box

    table = FitTable([Col("lane", "key"), Col("tasks", min_width=14)], title="a long title over a narrow table",
                     table_box=box.SIMPLE_HEAD, hint=None, caption="a caption")
    table.add_row("docs", "4 done, 1 dead")
    table.add_row("review", "1 done")
    lines = drawn(table, 80)
    assert [line for line in lines if line.endswith(" ")] == [], lines
    assert "a caption" in lines and any(line.split() == ["review", "1", "done"] for line in lines), lines


def test_narrower_than_the_columns_that_stay_they_wrap_never_an_ellipsis() -> None:
    for width in (30, 45, 60):
        lines = drawn(sample_table(), width)
        text = "\n".join(lines)
        assert max(cell_len(line) for line in lines) <= width and "…" not in text
        # a key wraps: every character of it is still there, in order, in its column; numbers stay whole
        keys = "".join(line.split("│")[3].strip() for line in lines if line.startswith("│"))
        assert keys == "github.com/acme/widgets#4731issue:1", text
        assert any("1234567" in line for line in lines)


@pytest.mark.parametrize(("value", "text"), [
    (0, "0"), (950, "950"), (999.5, "1k"), (1234, "1.2k"), (12_500, "12.5k"), (195_000, "195k"),
    (999_950, "1M"), (3_400_000, "3.4M"), (12e9, "12G"), (None, "—"),
])
def test_counts_are_compact(value: float | None, text: str) -> None:
    assert fmt_num(value) == text


@pytest.mark.parametrize(("value", "text"), [
    (0, "$0"), (0.0037525, "$0.0038"), (0.55, "$0.55"), (0.8099, "$0.81"), (12.4, "$12.40"),
    (1234.5, "$1,234"), (None, "—"),
])
def test_costs_are_compact(value: float | None, text: str) -> None:
    assert fmt_cost(value) == text


# ------------------------------------------------------------------------------------------------
# every table command at 80 and 120 columns

UPGRADES, REVIEW = "nightly-dep-upgrades", "upgrade-review"
KEYS = ["acme/widget-factory#4731", "acme/widget-factory#4732",
        "acme/widget-factory#4733", "acme/widget-factory#4734",
        "acme/widget-factory#4735"]
AGENT = '["python", "-m", "worker.dev.example_agent", "{prompt_file}"]'
FLEET_TOML = f"""\
[pools.claude-max-team-account]
slots = 2

[profiles.claude-sonnet-nightly]
command = {AGENT}
agent = "generic"
pool = "claude-max-team-account"
models = {{ default = "claude-sonnet-4-5-20250929" }}

[lanes.{UPGRADES}]
profile = "claude-sonnet-nightly"
max_running = 3

[lanes.{REVIEW}]
command = {AGENT}
review = true
accepts_from = ["{UPGRADES}"]
"""


@pytest.fixture
def fleet_home(tmp_path: Path, db_url: str) -> dict[str, Any]:
    """A fleet.toml with long names, synced, and a history: done, failed, dead, running, stuck,
    repaired, blocked, in review, a throttled pool, workspaces on disk and a batch."""
    (tmp_path / "fleet.toml").write_text(FLEET_TOML)
    for lane in (UPGRADES, REVIEW):  # (the preflight of `lanes sync` pauses a lane without them)
        (tmp_path / "lane_instructions").mkdir(exist_ok=True)
        (tmp_path / "lane_instructions" / f"{lane}.md").write_text(f"# {lane}\n")
    world: dict[str, Any] = {"home": tmp_path, "url": db_url}
    ok(fleet(world, 120, "lanes", "sync"))
    big = {"input_tokens": 195_000, "cache_creation_tokens": 48_000, "cache_read_tokens": 1_250_000,
           "output_tokens": 23_500, "cost_usd": 0.55}
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("select fleet.sync_lane(%s, %s)", (UPGRADES, Jsonb({"max_running": 3, "backoff_base_seconds": 0})))
        s = open_session(conn, UPGRADES, host="build-host-eu-west-1", pid=4242171)
        ids = [enqueue(conn, UPGRADES, key, title=f"upgrade the dependencies of {key}") for key in KEYS]
        tok = take(conn, s, ids[0])["lease_token"]
        record_run(conn, tok, big)
        complete(conn, ids[0], tok)
        tok = take(conn, s, ids[1])["lease_token"]
        record_run(conn, tok, big)
        fail(conn, ids[1], tok, "exit code 1: the tests still fail", retryable=False)
        take(conn, s, ids[2])
        release(conn, ids[2], "lease-expired")
        tok = take(conn, s, ids[3])["lease_token"]
        call(conn, "block", ids[3], tok, "automation-broken", "the gate crashed: no such file tests/run.sh")
        take(conn, s, ids[4])
        expire(conn, ids[4], ago="3 seconds")
        r = open_session(conn, REVIEW, host="build-host-eu-west-1", pid=4242172)
        rid = enqueue(conn, REVIEW, "acme/widget-factory#4800")
        tok = take(conn, r, rid)["lease_token"]
        record_run(conn, tok, big)
        call(conn, "touch_workspace", rid, tok, "build-host-eu-west-1", "/srv/fleet/ws/review/4800",
             123_456_789)
        complete(conn, rid, tok, {"summary": "bumped 14 packages; two need a person's look"})
        world["batch"] = build_batch_history(conn)["batch"]
        conn.execute("update fleet.pools set throttled_until = now() + interval '3 hours', "
                     "throttle_note = 'You''ve hit your limit · resets 5pm (Europe/Berlin)' "
                     "where name = 'claude-max-team-account'")
    world["ids"] = [*ids, rid]
    return world


def fleet(world: dict[str, Any], width: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") and k != "DATABASE_URL"}
    env.update({"DATABASE_URL": world["url"], "FLEET_CONFIG": str(world["home"] / "fleet.toml"),
                "COLUMNS": str(width)})
    return subprocess.run([sys.executable, "-c", BOOT, *args], cwd=world["home"], env=env, capture_output=True,
                          text=True, timeout=120)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"rc={result.returncode}\nstdout={result.stdout}\nstderr={result.stderr}"
    return result.stdout


COMMANDS: list[tuple[list[str], list[str]]] = [
    # (the command, what it must show whole besides the ids and keys)
    (["status"], [UPGRADES, REVIEW, "build-host-eu-west-1:4242171", "lease-expired",
                  "automation-broken", "claude-max-team-account"]),
    (["stats"], [UPGRADES, REVIEW, "all lanes", "$1.10", "$0.55"]),
    (["tasks"], [UPGRADES, REVIEW, "running", "blocked", "review"]),
    (["workspaces"], [REVIEW, "build-host-eu-west-1", "117.7 MiB"]),
    (["pools", "list"], ["claude-max-team-account"]),
    (["profiles"], [UPGRADES, "claude-sonnet-nightly", "claude-sonnet-4-5-20250929"]),
    (["review", "list"], [REVIEW, "acme/widget-factory#4800"]),
    (["monitor", "--once", "--no-local"], [UPGRADES]),
    (["lanes", "list"], [UPGRADES, REVIEW]),
]


@pytest.mark.parametrize("width", WIDTHS)
def test_every_table_command_fits_the_terminal(fleet_home: dict[str, Any], width: int) -> None:
    ids = [str(i) for i in fleet_home["ids"]]
    for command, whole in COMMANDS:
        out = ok(fleet(fleet_home, width, *command))
        lines = out.splitlines()
        assert lines, command
        shown = whole + (KEYS + ids if command[0] in ("tasks",) else [])
        fits(lines, width, shown)
        if "with --wide" in out:  # what a table says it left out, --wide shows
            wide = ok(fleet(fleet_home, width, *command, "--wide"))
            assert "more column" not in wide, (command, wide)
    out = ok(fleet(fleet_home, width, "batch", "show", str(fleet_home["batch"])))
    fits(out.splitlines(), width, ["b1", "b2", "b3", "landed"])


def test_stuck_and_blocked_tasks_show_their_keys_whole_at_80(fleet_home: dict[str, Any]) -> None:
    out = ok(fleet(fleet_home, 80, "status"))
    fits(out.splitlines(), 80, [KEYS[3], KEYS[4], str(fleet_home["ids"][4])])
    assert "more column" in out  # what is left out is said, and --wide shows it
    wide = ok(fleet(fleet_home, 80, "status", "--wide"))
    assert max(cell_len(line) for line in wide.splitlines()) > 80
    for header in ("cancelled", "last hand-off", "lane p95"):
        assert header in wide and header not in out


def test_stats_totals_are_real_totals(fleet_home: dict[str, Any]) -> None:
    out = ok(fleet(fleet_home, 120, "stats", "--lane", UPGRADES))
    # one lane on one day: its row is its total, and no "total" row repeats it
    assert "total" not in out
    out = ok(fleet(fleet_home, 120, "stats"))
    totals = [line for line in out.splitlines() if "total" in line]
    # three lanes (code, review, upgrades) on one day: one total of them all, no per-lane repeats
    assert len(totals) == 1 and "all lanes" in totals[0], out
    assert "$1.10" in next(line for line in out.splitlines() if UPGRADES in line and "20" in line)


def test_tasks_refuses_an_unknown_lane(fleet_home: dict[str, Any]) -> None:
    result = fleet(fleet_home, 80, "tasks", "--lane", "nosuch")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"error: unknown lane 'nosuch' (known lanes: code, {UPGRADES}, {REVIEW})"]
