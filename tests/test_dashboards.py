"""The dashboard commands: `fleet status`, `fleet stats`, `fleet snapshot`, `fleet report`.

Each runs for real as a subprocess against a test database holding a known history built with the
SQL API; the JSON outputs are checked figure by figure. The HTML report is opened in a real
headless browser (Debian's chromium, installed by the ``chromium`` fixture when it is missing and
we may): it must render without a script error or a blocked load, and its charts must carry the
figures of the history.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections import defaultdict
from decimal import Decimal
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import psycopg
import pytest
from chromiumkit import chromium_path
from psycopg.types.json import Jsonb
from sqlkit import (
    build_batch_history,
    cancel,
    close_session,
    complete,
    enqueue,
    expire,
    fail,
    hand_off,
    one,
    open_session,
    record_run,
    release,
    retry,
    route,
    take,
)

ROOT = Path(__file__).resolve().parents[1]

FLEET_TOML = """\
[lanes.docs]
command = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]
max_running = 2

[lanes.review]
command = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]
max_running = 1
accepts_from = ["docs"]
"""

# The fleet command (monitor/cli/app.py composes it; test_the_fleet_command_has_the_dashboards
# checks that it has the dashboard commands).
BOOT = "from monitor.cli.app import main; main()"

TOKENS = {  # per run that reports: the modelUsage sums record_run is given
    "d1": {"input_tokens": 1000, "cache_creation_tokens": 200, "cache_read_tokens": 5000, "output_tokens": 300,
           "cost_usd": 0.25},
    "d2": {"input_tokens": 2000, "cache_creation_tokens": 0, "cache_read_tokens": 8000, "output_tokens": 700,
           "cost_usd": 0.5},
    "d3": {"input_tokens": 100, "cache_creation_tokens": 0, "cache_read_tokens": 0, "output_tokens": 10,
           "cost_usd": 0.01},
    "d7": {"input_tokens": 400, "cache_creation_tokens": 100, "cache_read_tokens": 1000, "output_tokens": 50,
           "cost_usd": 0.05},
    "review": {"input_tokens": 300, "cache_creation_tokens": 0, "cache_read_tokens": 3000, "output_tokens": 90,
               "cost_usd": 0.04},
}
KINDS = ["input_tokens", "cache_creation_tokens", "cache_read_tokens", "output_tokens"]


# ------------------------------------------------------------------------------------------------
# the history and the command


def build_history(url: str) -> dict[str, Any]:
    """docs: done, failed then done, dead, repaired, running, handed off, routed to review, stuck,
    dead then retried then cancelled, cancelled while running. Two shifts of docs are active: the
    one that did all that (its heartbeat a lease and 3 s old) and one running d5."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("select fleet.sync_lane('docs', %s)", (Jsonb({"max_running": 2, "backoff_base_seconds": 0}),))
        conn.execute("select fleet.sync_lane('review', %s)", (Jsonb({"max_running": 1, "accepts_from": ["docs"]}),))
        s1 = open_session(conn, "docs", host="shift-host", pid=4242)
        ids = {key: enqueue(conn, "docs", key, title=f"task {key}") for key in
               ("d1", "d2", "d3", "d4", "d5", "d6", "d7", "d8")}
        tok = take(conn, s1, ids["d1"])["lease_token"]
        record_run(conn, tok, TOKENS["d1"])
        complete(conn, ids["d1"], tok)
        fail(conn, ids["d2"], take(conn, s1, ids["d2"])["lease_token"], "flaky")
        tok = take(conn, s1, ids["d2"])["lease_token"]
        record_run(conn, tok, TOKENS["d2"])
        complete(conn, ids["d2"], tok)
        tok = take(conn, s1, ids["d3"])["lease_token"]
        record_run(conn, tok, TOKENS["d3"])
        fail(conn, ids["d3"], tok, "cannot parse the spec", retryable=False)
        take(conn, s1, ids["d4"])
        release(conn, ids["d4"], "lease-expired")
        hand_off(conn, ids["d6"], take(conn, s1, ids["d6"])["lease_token"], {})
        tok = take(conn, s1, ids["d7"])["lease_token"]
        record_run(conn, tok, TOKENS["d7"])
        route(conn, ids["d7"], tok, "review", {"note": "please review"})
        sr = open_session(conn, "review", host="review-host", pid=99)
        tok = take(conn, sr, ids["d7"])["lease_token"]
        record_run(conn, tok, TOKENS["review"])
        complete(conn, ids["d7"], tok)
        close_session(conn, sr, "deadline")
        ids["r1"] = enqueue(conn, "review", "r1")
        ids["d9"] = enqueue(conn, "docs", "d9")
        fail(conn, ids["d9"], take(conn, s1, ids["d9"])["lease_token"], "bad input", retryable=False)
        retry(conn, ids["d9"])
        cancel(conn, ids["d9"])
        ids["d10"] = enqueue(conn, "docs", "d10")
        take(conn, s1, ids["d10"])
        cancel(conn, ids["d10"])
        # d5 runs under a second shift that heartbeats; d8 under the first, silent since for its
        # lease and 3 s (a task's lease follows its session: the first shift's tasks are stuck)
        s2 = open_session(conn, "docs", host="other-host", pid=4343)
        take(conn, s2, ids["d5"])
        take(conn, s1, ids["d8"])
        expire(conn, ids["d8"], ago="3 seconds")
    return {"ids": ids, "session": s1, "other_session": s2}


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dashboards")
    (path / "fleet.toml").write_text(FLEET_TOML)
    return path


@pytest.fixture
def world(db_url: str) -> dict[str, Any]:
    return build_history(db_url)


def run_fleet(*args: str, url: str, home: Path, timeout: float = 120,
              columns: int = 220) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") and k != "DATABASE_URL"}
    env.update({"DATABASE_URL": url, "FLEET_CONFIG": str(home / "fleet.toml"), "COLUMNS": str(columns)})
    return subprocess.run([sys.executable, "-c", BOOT, *args], cwd=home, env=env, capture_output=True,
                          text=True, timeout=timeout)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"rc={result.returncode}\nstdout={result.stdout}\nstderr={result.stderr}"
    assert "Traceback" not in result.stderr
    return result.stdout


def refused(result: subprocess.CompletedProcess[str], *words: str) -> str:
    assert result.returncode == 1, f"rc={result.returncode}\nstdout={result.stdout}\nstderr={result.stderr}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for word in words:
        assert word in lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------------------
# the commands are part of `fleet`


def test_the_fleet_command_has_the_dashboards(home: Path) -> None:
    """The console script's app (monitor/cli/app.py) registers the dashboard commands."""
    out = subprocess.run([sys.executable, "-m", "monitor.cli", "--help"], cwd=home, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    for command in ("status", "stats", "snapshot", "report"):
        assert re.search(rf"│ {command}\s", out.stdout), f"`fleet {command}` is not registered:\n{out.stdout}"


# ------------------------------------------------------------------------------------------------
# fleet status


def test_status_json(db_url: str, home: Path, world: dict[str, Any]) -> None:
    data = json.loads(ok(run_fleet("status", "--json", url=db_url, home=home)))
    assert set(data) == {"as_of", "lanes", "stuck", "blocked", "attention", "pools", "windows", "sessions", "repairs"}
    lanes = {row["lane"]: row for row in data["lanes"]}
    keys = ["queued", "ready", "running", "slots", "idle_slots", "done_24h", "failed_24h", "dead_24h",
            "cancelled_24h", "retries_24h", "handoffs_24h", "repairs_24h", "operator_retries_24h",
            "active_sessions"]
    assert {k: lanes["docs"][k] for k in keys} == {
        "queued": 2, "ready": 2, "running": 2, "slots": 2, "idle_slots": 0, "done_24h": 2, "failed_24h": 3,
        "dead_24h": 2, "cancelled_24h": 2, "retries_24h": 2, "handoffs_24h": 1, "repairs_24h": 1,
        "operator_retries_24h": 1, "active_sessions": 2}
    assert {k: lanes["review"][k] for k in keys} == {
        "queued": 1, "ready": 1, "running": 0, "slots": 1, "idle_slots": 1, "done_24h": 1, "failed_24h": 0,
        "dead_24h": 0, "cancelled_24h": 0, "retries_24h": 0, "handoffs_24h": 0, "repairs_24h": 0,
        "operator_retries_24h": 0, "active_sessions": 0}
    assert lanes["review"]["last_handoff_at"] is not None
    ids = world["ids"]
    assert [(s["task_id"], s["reasons"], s["host"], s["pid"]) for s in data["stuck"]] == [
        (ids["d8"], ["lease-expired", "session-silent"], "shift-host", 4242)]
    # expired 3 s before the world was made: that, plus however long `fleet status` took to start
    assert -60 < data["stuck"][0]["lease_remaining_seconds"] <= -3
    shift_tokens = sum(TOKENS[t][k] for t in ("d1", "d2", "d3", "d7") for k in KINDS)
    assert [(s["session_id"], s["tasks_held"], s["runs"], s["done"], s["failed"], s["lost"], s["tokens"])
            for s in data["sessions"]] == [(str(world["other_session"]), 1, 1, 0, 0, 0, 0),
                                           (str(world["session"]), 1, 10, 3, 3, 1, shift_tokens)]
    assert isinstance(data["sessions"][0]["cost_usd"], float)   # numbers stay numbers in JSON
    assert [(r["task_id"], r["reason"], r["state"]) for r in data["repairs"]] == [
        (ids["d4"], "lease-expired", "queued")]

    one_lane = json.loads(ok(run_fleet("status", "--json", "--lane", "review", url=db_url, home=home)))
    assert [row["lane"] for row in one_lane["lanes"]] == ["review"]
    assert one_lane["stuck"] == [] and one_lane["sessions"] == [] and one_lane["repairs"] == []


def test_status_table(db_url: str, home: Path, world: dict[str, Any]) -> None:
    out = ok(run_fleet("status", url=db_url, home=home))
    for text in ("lanes", "docs", "review", "stuck tasks", "lease-expired", "active shifts", "shift-host:4242",
                 "recent repairs", "d4", "as of"):
        assert text in out, f"{text!r} missing from:\n{out}"


def test_status_refuses_bad_input(db_url: str, home: Path) -> None:
    build_history(db_url)
    refused(run_fleet("status", "--lane", "nope", url=db_url, home=home), "unknown lane 'nope'", "docs")
    refused(run_fleet("status", "--watch", "--json", url=db_url, home=home), "--watch", "--json")
    refused(run_fleet("status", "--watch", "--interval", "soon", url=db_url, home=home), "--interval")


def test_status_watch_refreshes_in_place_until_ctrl_c(db_url: str, home: Path) -> None:
    build_history(db_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") and k != "DATABASE_URL"}
    env.update({"DATABASE_URL": db_url, "FLEET_CONFIG": str(home / "fleet.toml"), "TERM": "xterm-256color"})
    env.pop("COLUMNS", None)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 220, 0, 0))
    proc = subprocess.Popen([sys.executable, "-c", BOOT, "status", "--watch", "--interval", "0.3"],
                            cwd=home, env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    screen = b""

    def read_for(seconds: float) -> None:
        nonlocal screen
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    screen += os.read(master, 65536)
                except OSError:
                    return

    def queued_seen() -> set[str]:
        text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", screen.decode(errors="replace"))
        return {cells[2].strip() for line in text.splitlines()
                if (cells := line.split("│")) and len(cells) > 3 and cells[1].strip() == "review"}

    try:
        deadline = time.monotonic() + 60
        while "1" not in queued_seen() and time.monotonic() < deadline:
            read_for(0.3)
        assert queued_seen() == {"1"}, screen.decode(errors="replace")[-3000:]
        with psycopg.connect(db_url) as conn:             # one transaction: no refresh sees 2, 3 or 4
            for i in range(4):
                enqueue(conn, "review", f"more-{i}")
        deadline = time.monotonic() + 60
        while "5" not in queued_seen() and time.monotonic() < deadline:
            read_for(0.3)
        assert queued_seen() == {"1", "5"}                        # the same screen, refreshed
        proc.send_signal(signal.SIGINT)
        # keep reading while it exits: a refresh written into a full pty would block it forever
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            read_for(0.2)
        assert proc.wait(timeout=1) == 0
        read_for(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    text = screen.decode(errors="replace")
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert "\x1b[" in text                                        # drawn with cursor moves (rich Live)


# ------------------------------------------------------------------------------------------------
# fleet stats


def test_stats_json(db_url: str, home: Path, world: dict[str, Any]) -> None:
    data = json.loads(ok(run_fleet("stats", "--json", url=db_url, home=home)))
    assert set(data) == {"as_of", "since", "usage", "usage_totals", "usage_total", "cohort", "cohort_by_lane",
                         "cohort_split", "triage"}
    assert data["cohort_split"] == []  # no batch in the window: no split table
    assert data["triage"] == []  # docs routed d7 to review, but docs is no triage lane
    totals = {row["lane"]: row for row in data["usage_totals"]}
    docs_tokens = {k: sum(TOKENS[t][k] for t in ("d1", "d2", "d3", "d7")) for k in KINDS}
    assert {k: totals["docs"][k] for k in ["runs", "completed", *KINDS]} == {
        "runs": 9, "completed": 3, **docs_tokens}
    assert totals["docs"]["cost_usd"] == pytest.approx(0.81)
    assert totals["docs"]["cost_per_completed"] == pytest.approx(0.27)
    prompt = sum(docs_tokens[k] for k in KINDS[:3])
    assert totals["docs"]["cache_read_share"] == pytest.approx(round(docs_tokens["cache_read_tokens"] / prompt, 4))
    assert {k: totals["review"][k] for k in ["runs", "completed", *KINDS]} == {
        "runs": 1, "completed": 1, **{k: TOKENS["review"][k] for k in KINDS}}
    # the fleet's total is every lane's: the runs and tokens of docs and review together
    total = data["usage_total"]
    assert (total["lane"], total["runs"], total["completed"]) == (None, 10, 4)
    assert {k: total[k] for k in KINDS} == {k: docs_tokens[k] + TOKENS["review"][k] for k in KINDS}
    assert total["cost_usd"] == pytest.approx(0.85)
    # the per-day rows add up to the totals (a UTC midnight may fall inside the test)
    for lane in ("docs", "review"):
        assert sum(r["runs"] for r in data["usage"] if r["lane"] == lane) == totals[lane]["runs"]

    cohort = data["cohort"]
    assert {k: cohort[k] for k in ("lane", "tasks", "completed", "dead", "cancelled", "open", "runs", "failures",
                                   "handoffs", "repairs", "interventions")} == {
        "lane": None, "tasks": 11, "completed": 3, "dead": 1, "cancelled": 2, "open": 5, "runs": 12,
        "failures": 3, "handoffs": 1, "repairs": 1, "interventions": 3}
    assert (cohort["operator_cancels"], cohort["operator_retries"]) == (2, 1)
    all_tokens = sum(TOKENS[t][k] for t in TOKENS for k in KINDS)
    assert cohort["total_tokens"] == all_tokens
    assert cohort["tokens_per_completed"] == round(all_tokens / 3, 1)    # d1, d2 and d7 are done
    by_lane = {row["lane"]: row for row in data["cohort_by_lane"]}
    assert {lane: row["tasks"] for lane, row in by_lane.items()} == {"docs": 10, "review": 1}

    one_lane = json.loads(ok(run_fleet("stats", "--json", "--lane", "review", "--since", "1d", url=db_url,
                                       home=home)))
    assert {row["lane"] for row in one_lane["usage"]} == {"review"}
    assert one_lane["cohort"]["lane"] == "review" and one_lane["cohort"]["tasks"] == 1
    assert one_lane["cohort_by_lane"] == []


def test_stats_table_and_refusals(db_url: str, home: Path, world: dict[str, Any]) -> None:
    out = ok(run_fleet("stats", url=db_url, home=home))
    # each table says which lane a routed task counts in (they differ)
    for text in ("usage since", "docs", "review", "cache-read share", "cohort: tasks queued since", "all lanes",
                 "done: tasks or stages finished in the lane", "each task in the lane it entered by"):
        assert text in out, f"{text!r} missing from:\n{out}"
    refused(run_fleet("stats", "--since", "45d", url=db_url, home=home), "at most 30d")
    refused(run_fleet("stats", "--since", "a while", url=db_url, home=home), "--since")
    refused(run_fleet("stats", "--lane", "nope", url=db_url, home=home), "unknown lane")


def test_fleet_stats_shows_the_split_when_the_window_saw_a_batch(conn: psycopg.Connection, db_url: str,
                                                                 tmp_path: Path) -> None:
    build_batch_history(conn)
    home = tmp_path / "home"
    home.mkdir()
    (home / "fleet.toml").write_text(FLEET_TOML)
    data = json.loads(ok(run_fleet("stats", "--json", "--lane", "code", url=db_url, home=home)))
    assert [(r["cohort"], r["tasks"], r["batch_members"], r["ship_runs"]) for r in data["cohort_split"]] == [
        ("batched", 3, 3, 1), ("unbatched", 2, 0, 0)]
    out = ok(run_fleet("stats", "--lane", "code", url=db_url, home=home))
    assert "batched vs unbatched" in out
    batched = next(line for line in out.splitlines() if line.strip().strip("│┃ ").startswith("batched"))
    assert "66.7%" in batched  # 2 of 3 members evicted


def test_fleet_stats_shows_the_misclassification_rate_of_a_triage_lane(conn: psycopg.Connection, db_url: str,
                                                                       tmp_path: Path) -> None:
    """triage (triage = true in fleet.toml) sends three tasks to fix (one done, one failed there, one
    open) and one to docs, which routes it on; plain, no triage lane, sends one to fix: no verdict."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "lane.md").write_text("Do the task.\n")
    agent = f'command = ["python", "-m", "worker.dev.example_agent", "{{prompt_file}}"]\ninstructions = "{home}/lane.md"'
    (home / "fleet.toml").write_text(f"[lanes.triage]\n{agent}\ntriage = true\n\n[lanes.plain]\n{agent}\n\n"
                                     f"[lanes.fix]\n{agent}\nbackoff_base_seconds = 0\n\n[lanes.docs]\n{agent}\n")
    synced = json.loads(ok(run_fleet("lanes", "sync", "--json", url=db_url, home=home)))
    assert synced["synced"] == {lane: "created" for lane in ("triage", "plain", "fix", "docs")}
    assert synced["paused"] == {}
    sessions = {lane: open_session(conn, lane) for lane in ("triage", "plain", "fix", "docs")}

    def lease(task_id: int) -> Any:
        lane = one(conn, "select lane from fleet.tasks where id = %s", (task_id,))
        return take(conn, sessions[lane], task_id)["lease_token"]

    def triaged(key: str, to: str, source: str = "triage") -> int:
        task_id = enqueue(conn, source, key)
        route(conn, task_id, lease(task_id), to)
        return task_id

    done = triaged("t1", "fix")
    complete(conn, done, lease(done))
    failed = triaged("t2", "fix")
    fail(conn, failed, lease(failed), "not a fix after all")
    triaged("t3", "fix")
    onward = triaged("t4", "docs")
    route(conn, onward, lease(onward), "fix")
    triaged("p1", "fix", source="plain")

    data = json.loads(ok(run_fleet("stats", "--json", url=db_url, home=home)))
    figures = ("triage_lane", "verdict_lane", "verdicts", "misclassified", "routed_again", "failed", "correct",
               "undecided", "misclassification_rate")
    assert [tuple(r[k] for k in figures) for r in data["triage"]] == [
        ("triage", None, 4, 2, 1, 1, 1, 1, pytest.approx(0.6667)),
        ("triage", "docs", 1, 1, 1, 0, 0, 0, 1),
        ("triage", "fix", 3, 1, 0, 1, 1, 1, 0.5)]
    # --lane: the verdicts from that lane or to it
    assert [r["verdict_lane"] for r in json.loads(ok(run_fleet("stats", "--json", "--lane", "docs", url=db_url,
                                                               home=home)))["triage"]] == [None, "docs"]
    assert json.loads(ok(run_fleet("stats", "--json", "--lane", "plain", url=db_url, home=home)))["triage"] == []

    # the table fits 80 columns, the rate shown
    out = ok(run_fleet("stats", url=db_url, home=home, columns=80))
    assert "triage: verdicts since" in out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "triage: verdicts since" in line)
    table = lines[start:]
    assert max(len(line) for line in table) <= 80, "\n".join(table)
    header = next(line for line in table if "misclassified" in line)
    assert "rate" in header and "undecided" in header
    rows = {tuple(cell.strip() for cell in line.strip("│┃ ").split("│")[:2]): line for line in table
            if line.startswith("│")}
    assert "66.7%" in rows[("triage", "all")] and "50.0%" in rows[("triage", "fix")]
    assert "100.0%" in rows[("triage", "docs")]


# ------------------------------------------------------------------------------------------------
# fleet snapshot


def test_snapshot_is_one_json_line_of_everything(db_url: str, home: Path, world: dict[str, Any]) -> None:
    out = ok(run_fleet("snapshot", url=db_url, home=home))
    assert out.count("\n") == 1                                  # one line: append it to a log
    data = json.loads(out)
    assert data["snapshot"] == "lanefleet" and data["version"] == 1
    assert set(data) == {"snapshot", "version", "taken_at", "since", "lanes", "stuck", "sessions", "repairs",
                         "dead_letters", "throughput", "usage", "usage_totals", "usage_total", "cohort", "cohort_by_lane",
                         "cohort_split", "windows", "window_outcomes"}
    status = json.loads(ok(run_fleet("status", "--json", url=db_url, home=home)))
    strip = ("oldest_ready_seconds",)
    assert [{k: v for k, v in r.items() if k not in strip} for r in data["lanes"]] == [
        {k: v for k, v in r.items() if k not in strip} for r in status["lanes"]]
    ids = world["ids"]
    assert [(d["task_id"], d["dead_reason"], d["last_error"]) for d in data["dead_letters"]] == [
        (ids["d3"], "fatal", "cannot parse the spec")]
    assert {s["state"] for s in data["sessions"]} == {"active", "ended"}
    through = defaultdict(int)
    for row in data["throughput"]:
        through[row["lane"]] += row["done"] + row["routed"]
    assert dict(through) == {"docs": 3, "review": 1}
    assert data["cohort"]["tasks"] == 11
    pretty = ok(run_fleet("snapshot", "--pretty", "--since", "2h", url=db_url, home=home))
    assert pretty.count("\n") > 50 and json.loads(pretty)["cohort"]["tasks"] == 11


# ------------------------------------------------------------------------------------------------
# fleet report, in a real browser


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium; installed with apt-get when it is missing and we are root (as in CI)."""
    return chromium_path("the report test")


def browse(chromium: str, page: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={profile}",
             "--enable-logging=stderr", "--v=0", *extra, page.as_uri()],
            capture_output=True, text=True, timeout=120)


class Charts(HTMLParser):
    """The elements of each SVG chart that carry a data-v, and the root's attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.root: dict[str, str] = {}
        self.chart: str | None = None
        self.marks: dict[str, list[dict[str, str]]] = defaultdict(list)
        self.legends: dict[str, list[str]] = defaultdict(list)
        self.figure: str | None = None
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "html":
            self.root = a
        if tag == "figure":
            self.figure = a.get("data-chart")
        if tag == "svg" and "data-chart" in a:
            self.chart = a["data-chart"]
        elif self.chart and "data-v" in a:
            self.marks[self.chart].append({"tag": tag, **a})
        if tag == "span" and "legend-item" in a.get("class", "") and self.figure:
            self.legends[self.figure].append(a["data-series"])

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self.chart = None
        if tag == "figure":
            self.figure = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_report_renders_in_a_browser_with_the_data(db_url: str, home: Path, world: dict[str, Any],
                                                   chromium: str, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "report.html"
    printed = ok(run_fleet("report", "--out", str(out), "--since", "7d", url=db_url, home=home))
    assert f"wrote {out}" in " ".join(printed.split())
    html = out.read_text()
    # self-contained: nothing to fetch
    assert not re.search(r"<(link|img|iframe)\b", html) and "src=" not in html
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) <= {"http://www.w3.org/2000/svg"}

    shown = browse(chromium, out, "--dump-dom")
    assert shown.returncode == 0, shown.stderr[-3000:]
    console = [line for line in shown.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console                                 # no error, no blocked load
    page = Charts()
    page.feed(shown.stdout)
    assert page.root.get("data-rendered") == "ok"                 # the script ran to its end
    assert json.loads(page.root["data-points"]) == {k: len(v) for k, v in page.marks.items()}
    assert set(page.marks) >= {"queue", "throughput", "wallclock", "usage"}

    # queue depth and running: empty before the history, the live counts at its end
    series: dict[tuple[str, str], list[int]] = defaultdict(list)
    for m in page.marks["queue"]:
        series[(m["data-series"], m["data-kind"])].append(int(m["data-v"]))
    assert set(series) == {(lane, kind) for lane in ("docs", "review") for kind in ("queued", "running")}
    assert all(values[0] == 0 for values in series.values()), series
    assert all(min(values) >= 0 for values in series.values())
    assert {key: values[-1] for key, values in series.items()} == {
        ("docs", "queued"): 2, ("docs", "running"): 2, ("review", "queued"): 1, ("review", "running"): 0}
    assert max(series[("docs", "running")]) <= 2                 # never past max_running

    # throughput: tasks (or stages) completed per lane
    done: dict[str, int] = defaultdict(int)
    for m in page.marks["throughput"]:
        done[m["data-series"]] += int(m["data-v"])
    assert dict(done) == {"docs": 3, "review": 1}
    # wall-clock: one count per completed stage, and its p50/p95 markers
    assert sum(int(m["data-v"]) for m in page.marks["wallclock"] if m["tag"] == "rect") == 4
    assert {m["data-marker"] for m in page.marks["wallclock"] if m["tag"] == "line"} == {"p50", "p95"}
    # tokens by kind, and cost per day
    kinds: dict[str, int] = defaultdict(int)
    cost = 0.0
    for m in page.marks["usage"]:
        if m["data-series"] == "cost":
            cost += float(m["data-v"])
        else:
            kinds[m["data-series"]] += int(m["data-v"])
    assert dict(kinds) == {k: sum(t[k] for t in TOKENS.values()) for k in KINDS}
    assert cost == pytest.approx(float(sum(Decimal(str(t["cost_usd"])) for t in TOKENS.values())))
    # repairs over time
    assert [(m["data-series"], m["data-v"]) for m in page.marks["repairs"]] == [("lease-expired", "1")]
    assert page.legends["repairs"] == ["lease-expired"]
    text = " ".join(page.text)
    assert "cannot parse the spec" in text                         # the dead letter
    assert "3 (2 + 1)" in text                                       # interventions

    # and it looks like a report: a full-height screenshot of real size
    shot = tmp_path / "report.png"
    taken = browse(chromium, out, f"--screenshot={shot}", "--window-size=1100,3200", "--hide-scrollbars")
    assert taken.returncode == 0, taken.stderr[-3000:]
    assert shot.stat().st_size > 50_000
    with open(shot, "rb") as fh:
        head = fh.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == (1100, 3200)


def test_report_of_one_lane_and_of_an_empty_fleet(db_url: str, home: Path, chromium: str, tmp_path: Path) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("select fleet.sync_lane('docs', '{}'); select fleet.sync_lane('review', '{}')")
    out = tmp_path / "empty.html"
    ok(run_fleet("report", "--out", str(out), url=db_url, home=home))
    shown = browse(chromium, out, "--dump-dom")
    assert [line for line in shown.stderr.splitlines() if ":CONSOLE" in line] == []
    page = Charts()
    page.feed(shown.stdout)
    assert page.root.get("data-rendered") == "ok"
    assert "no repairs in this window" in " ".join(page.text)

    build_history(db_url)
    out = tmp_path / "review.html"
    ok(run_fleet("report", "--out", str(out), "--lane", "review", url=db_url, home=home))
    page = Charts()
    page.feed(browse(chromium, out, "--dump-dom").stdout)
    assert page.root.get("data-rendered") == "ok"
    assert {m["data-series"] for m in page.marks["queue"]} == {"review"}
    assert {m["data-series"]: int(m["data-v"]) for m in page.marks["throughput"]} == {"review": 1}
    refused(run_fleet("report", "--out", str(tmp_path / "x.html"), "--lane", "nope", url=db_url, home=home),
            "unknown lane")
    # a folder that is not there is a mistake in the path: refused, and nothing made
    missing = tmp_path / "no" / "such" / "dir" / "r.html"
    refused(run_fleet("report", "--out", str(missing), url=db_url, home=home), f"there is no directory {missing.parent}")
    assert not (tmp_path / "no").exists()
    refused(run_fleet("report", "--out", str(tmp_path), url=db_url, home=home), "that is a directory")


def test_dashboards_read_one_moment(db_url: str) -> None:
    """Every section of a refresh sees the same snapshot and the same now()."""
    from monitor.dashboards.reads import reading, status_data
    from worker.store.postgres import PostgresStore

    build_history(db_url)
    with PostgresStore(db_url) as store, reading(store) as r:
        first = status_data(r)
        with psycopg.connect(db_url, autocommit=True) as conn:
            enqueue(conn, "review", "meanwhile")
            assert one(conn, "select count(*) from fleet.tasks where lane = 'review' and state = 'queued'") == 2
        again = status_data(r)
    assert first["as_of"] == again["as_of"]
    assert [row["queued"] for row in again["lanes"]] == [row["queued"] for row in first["lanes"]] == [2, 1]


def test_dashboards_read_without_jit_and_leave_the_connection_as_it_was(db_url: str) -> None:
    """JIT is off for the reads' transaction only: the pool's connection serves API calls after."""
    from monitor.dashboards.reads import reading
    from worker.store.postgres import PostgresStore

    with PostgresStore(db_url, max_size=1) as store:
        store._run("set jit = on")  # (the session's, whatever the server's default)
        before = store._one("select current_setting('jit')")
        with reading(store) as r:
            assert r.one("clock")["now"] is not None
            assert r.conn.execute("select current_setting('jit')").fetchone()["current_setting"] == "off"
        assert store._one("select current_setting('jit')") == before == "on"


def test_the_queries_file_is_well_formed() -> None:
    from monitor.dashboards.reads import queries

    named = queries()
    text = (ROOT / "monitor" / "dashboards" / "queries.sql").read_text()
    declared = [line for line in text.splitlines() if line.startswith("-- name:")]
    assert len(named) == len(declared) >= 15
    for name, sql in named.items():
        assert sql.rstrip().endswith(";") and "-- name" not in sql, name



def test_stats_of_an_empty_window_says_so(db_url: str, home: Path) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("select fleet.sync_lane('docs', '{}')")
    out = ok(run_fleet("stats", url=db_url, home=home))
    assert "no run ended in this window" in out, out
    assert "done: tasks or stages" not in out, out
