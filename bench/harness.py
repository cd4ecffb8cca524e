"""What the benchmark scripts share: a scratch database, a fleet.toml, percentiles, the machine.

Not a benchmark itself. Scratch databases are named ``lf_bench_<what>_<hex>`` and dropped
``WITH (FORCE)`` when the block ends, however it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import make_conninfo

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_URL = os.environ.get("TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
AGENT = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]

T = TypeVar("T")


def log(msg: str = "") -> None:
    print(msg, flush=True)


@contextlib.contextmanager
def scratch_db(server_url: str, what: str, *, keep: bool = False, migrations: Path | None = None) -> Iterator[str]:
    """A new, migrated database ``lf_bench_<what>_<hex>`` on the server (the migrations of the
    directory ``migrations`` instead of the package's when given); its URL. Dropped after."""
    from uuid import uuid4

    from worker.db.migrate import load_migrations, migrate

    name = f"lf_bench_{what}_{uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'create database "{name}"')
    url = make_conninfo(server_url, dbname=name)
    try:
        migrate(url, migrations=load_migrations(migrations) if migrations else None)
        yield url
    finally:
        if keep:
            log(f"kept database {name}")
        else:
            with psycopg.connect(server_url, autocommit=True) as admin:
                admin.execute(f'drop database if exists "{name}" with (force)')


def pct(xs: Sequence[float], p: float) -> float:
    """The p-th percentile (nearest rank on the sorted values)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def stats_ms(xs: Sequence[float]) -> dict[str, float]:
    return {"n": len(xs), "p50": statistics.median(xs), "p90": pct(xs, 90), "p99": pct(xs, 99),
            "mean": statistics.fmean(xs), "max": max(xs)}


def wait_for(what: str, fn: Callable[[], T], timeout: float = 30.0, every: float = 0.02) -> T:
    """Poll ``fn`` until it returns something truthy; AssertionError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {value!r})")
        time.sleep(every)


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str | Path):
        return json.dumps(str(v))
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


def write_fleet_toml(path: Path, url: str, home: Path, lanes: dict[str, dict[str, Any]],
                     fleet: dict[str, Any] | None = None) -> Path:
    """A fleet.toml: the database, ``home`` (workspaces under it) and the lanes."""
    lines = ["[database]", f"url = {_toml(url)}", "", "[fleet]", f"home = {_toml(home)}",
             f"workspaces = {_toml(home / 'workspaces')}"]
    lines += [f"{k} = {_toml(v)}" for k, v in (fleet or {}).items()]
    for name, settings in lanes.items():
        lines += ["", f"[lanes.{name}]"] + [f"{k} = {_toml(v)}" for k, v in settings.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def fleet_cmd(*args: str) -> list[str]:
    """The ``fleet`` command as cron runs it: a fresh interpreter on the console script's module."""
    return [sys.executable, "-m", "monitor.cli", *args]


# -- processes ----------------------------------------------------------------------------------


def children(pid: int) -> set[int]:
    out: set[int] = set()
    for f in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            out.update(int(x) for x in f.read_text().split())
    return out


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS, and from smaps_rollup Rss, Pss (shared pages divided among their users) and the
    private pages (Private_Clean + Private_Dirty: what the process alone costs), in KiB."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            out["rss"] = int(line.split()[1])
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Pss", "Private_Clean", "Private_Dirty"):
            out[key.lower()] = int(rest.split()[0])
    out["private"] = out.pop("private_clean", 0) + out.pop("private_dirty", 0)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


# -- the machine --------------------------------------------------------------------------------


def machine(conn: psycopg.Connection[Any] | None = None) -> str:
    """One line: cores, memory, load, Python, and the server's version and durability settings."""
    mem = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) // (1024 * 1024)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    out = f"{os.cpu_count()} cores, {mem} GB RAM, load {load}; Python {platform.python_version()}"
    if conn is not None:
        row = conn.execute("select split_part(version(), ' ', 2), current_setting('fsync'),"
                           " current_setting('synchronous_commit'), current_setting('shared_buffers'),"
                           " current_setting('work_mem')").fetchone()
        assert row is not None
        out += (f"; PostgreSQL {row[0]} (fsync={row[1]}, synchronous_commit={row[2]}, "
                f"shared_buffers={row[3]}, work_mem={row[4]})")
    return out


# -- a fleet of real `fleet shift` processes ----------------------------------------------------


class FleetBench:
    """A fleet.toml in ``folder`` for ``lanes`` (synced into the database), and real ``fleet``
    subprocesses run with it, each logging to its own file under ``folder``."""

    def __init__(self, url: str, folder: Path, lanes: dict[str, dict[str, Any]]) -> None:
        from worker.config import load_config
        from worker.store.sync import lane_settings

        self.url = url
        self.folder = folder
        self.conn = psycopg.connect(url, autocommit=True)
        self.config = write_fleet_toml(folder / "fleet.toml", url, folder / "home", lanes)
        for name, lane in load_config(self.config).lanes.items():
            self.conn.execute("select fleet.sync_lane(%s, %s)", (name, json.dumps(lane_settings(lane))))
        self.env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "FLEET_CONFIG")}
        self.env["FLEET_CONFIG"] = str(self.config)
        self.logs: dict[int, Path] = {}
        self._batch = 0

    def enqueue(self, lane: str, count: int, payload: dict[str, Any]) -> list[int]:
        self._batch += 1
        rows = self.conn.execute(
            "select fleet.enqueue(%s, 'b' || %s || ':' || g, %s::jsonb) from generate_series(1, %s) g",
            (lane, f"{self._batch}:{time.time_ns()}", json.dumps(payload), count)).fetchall()
        return [r[0] for r in rows]

    def spawn(self, *args: str, env: dict[str, str] | None = None, python: Sequence[str] = (),
              count_to: Path | None = None) -> subprocess.Popen[bytes]:
        """``fleet <args>`` in a fresh interpreter (``python``: interpreter options); stderr and
        stdout to a log file (a pipe nobody reads would stall a long-lived process once it filled
        up). ``count_to``: run it under bench/callcount.py, which counts its statements there."""
        cmd = fleet_cmd(*args)
        if count_to is not None:
            cmd[1:3] = ["-m", "bench.callcount", str(count_to), "--"]
        cmd[1:1] = list(python)
        path = self.folder / f"{args[0]}-{len(self.logs)}.log"
        with open(path, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=out)
        self.logs[proc.pid] = path
        return proc

    def wait(self, proc: subprocess.Popen[bytes], timeout: float) -> str:
        """Wait for ``proc`` to exit (killed after ``timeout``); its log."""
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return self.log_of(proc)

    def log_of(self, proc: subprocess.Popen[bytes]) -> str:
        return self.logs[proc.pid].read_text(errors="replace")

    def expect(self, proc: subprocess.Popen[bytes], what: str, fn: Callable[[], T], timeout: float = 60) -> T:
        """wait_for, naming the process's exit and the tail of its log when it times out."""
        try:
            return wait_for(what, fn, timeout=timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the process {'exited ' + str(proc.returncode) if proc.poll() is not None else 'runs'}"
                                 f", its log ends:\n{self.log_of(proc)[-3000:]}") from None

    def count(self, lane: str, state: str = "running") -> int:
        row = self.conn.execute("select count(*) from fleet.tasks where lane = %s and state = %s",
                                (lane, state)).fetchone()
        return int(row[0]) if row else 0

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 60) -> str:
        """SIGTERM (a shift hands off, a monitor loop ends), wait; its log. Fails unless exit 0."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out = self.wait(proc, timeout)
        assert proc.returncode == 0, f"exit {proc.returncode}: {out[-2000:]}"
        return out

    def close(self) -> None:
        self.conn.close()


def agent_tree(shift_pid: int) -> dict[int, list[int]]:
    """The shift's agents: supervisor pid -> the pids of its children (the agent)."""
    return {p: sorted(children(p)) for p in children(shift_pid) if "worker.agent.supervisor" in cmdline(p)}


def wait_agents(shift_pid: int, n: int, timeout: float = 60) -> dict[int, list[int]]:
    """Wait until the shift runs ``n`` supervisors, each with its agent started."""
    def ready() -> dict[int, list[int]]:
        tree = agent_tree(shift_pid)
        return tree if len(tree) == n and all(tree.values()) else {}
    return wait_for(f"{n} agents under shift {shift_pid}", ready, timeout=timeout)


def stamp(conn: psycopg.Connection[Any] | None = None) -> str:
    """A run's first line: when, on what machine and server (:func:`machine`), at which tree."""
    return f"{time.strftime('%Y-%m-%d %H:%M')}; {machine(conn)}; tree {git_state()}"


def git_state() -> str:
    """The commit the tree is at, and whether it has changes (what a figure was measured on)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head or 'unknown'}{' + uncommitted changes' if dirty else ''}"
