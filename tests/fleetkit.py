"""Helpers for tests that run real shifts: a fleet.toml in a tmp folder, a synced store, polling.

``Fleet`` writes a config whose lanes run the scripted agent (``worker.dev.example_agent``), loads it
the way the CLI does (``load_config`` with DATABASE_URL from the environment), syncs its lanes and
hands out in-process shifts or ``fleet shift`` subprocesses against the same database.

A :class:`Backend` says where the state lives: ``postgres`` (a fresh database, the stores connect to
it) or ``supabase`` (the local stack of tests/supabase_stack.py: every store call goes through
supabase-py → nginx → PostgREST; shifts use a worker key scoped to the test's lanes, the monitor an
operator key). Either way the test reads and tampers with the database through a direct connection,
and lanes are synced through it (as `fleet migrate` would).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row

from worker.config import FleetConfig, load_config
from worker.dev.devstack import DevStack
from worker.shift.shift import Shift, ShiftSummary
from worker.store.keys import mint_key
from worker.store.postgres import PostgresStore
from worker.store.supabase import SupabaseStore
from worker.store.sync import sync_config

ROOT = Path(__file__).resolve().parents[1]
AGENT = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]

T = TypeVar("T")
# the DATABASE_URL of a subprocess on the supabase back-end: a call that slipped past the REST store fails
NOWHERE = "postgresql://nobody@127.0.0.1:9/nowhere?connect_timeout=1"


@dataclass
class Backend:
    """Where a test fleet's state lives: ``postgres`` or ``supabase`` (``stack`` set)."""

    name: str
    db_url: str  # a direct connection, for syncing lanes and for the test's own SQL
    stack: DevStack | None = None

    @property
    def rest(self) -> bool:
        return self.name == "supabase"

    def key(self, role: str, lanes: list[str] | None = None) -> str | None:
        """A fleet key (None on postgres, which has no keys)."""
        if self.stack is None:
            return None
        return mint_key(self.stack.jwt_secret, role, lanes, 3600)

    def store(self, key: str | None, **pool: Any) -> PostgresStore:
        if self.stack is None:
            return PostgresStore(self.db_url, **pool)
        assert key is not None
        return SupabaseStore(self.stack.url, self.stack.anon_key, key)  # type: ignore[return-value]

    def env(self, key: str | None) -> dict[str, str]:
        """What a `fleet` subprocess needs to reach the store with ``key``."""
        if self.stack is None:
            return {"DATABASE_URL": self.db_url}
        assert key is not None
        return {"DATABASE_URL": NOWHERE, "FLEET_FLEET__STORE": "supabase", "FLEET_SUPABASE__URL": self.stack.url,
                "FLEET_SUPABASE__KEY": key, "SUPABASE_ANON_KEY": self.stack.anon_key}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str | Path):
        return json.dumps(str(v))
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def lane_defaults(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "command": AGENT, "lease_seconds": 3, "max_attempts": 3, "max_handoffs": 10,
        "backoff_base_seconds": 0, "grace_seconds": 2, "max_running": 4,
    }
    base.update(overrides)
    return base


def write_fleet_toml(path: Path, workspaces: Path, lanes: dict[str, dict[str, Any]],
                     tables: dict[str, dict[str, dict[str, Any]]] | None = None) -> Path:
    """``tables``: other named tables, e.g. {"pools": {"max": {"slots": 1}}, "profiles": {...}}."""
    lines = ["[fleet]", f"workspaces = {_toml_value(workspaces)}", ""]
    for section, named in (tables or {}).items():
        for name, settings in named.items():
            lines.append(f"[{section}.{name}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in settings.items()]
            lines.append("")
    for name, settings in lanes.items():
        lines.append(f"[lanes.{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in settings.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def wait_for(what: str, fn: Callable[[], T], timeout: float = 10.0, every: float = 0.05) -> T:
    """Poll ``fn`` until it returns something truthy; fail the test naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {value!r})")
        time.sleep(every)


@dataclass
class Fleet:
    """``store``: the shifts' (a worker key for ``key_lanes``, default the fleet's lanes, on
    supabase); ``monitor_store``: an operator's; ``direct``: the database itself. On postgres all
    three are one store."""

    backend: Backend
    tmp: Path
    lanes: dict[str, dict[str, Any]]
    key_lanes: list[str] | None = None
    tables: dict[str, dict[str, dict[str, Any]]] | None = None  # pools, profiles
    cfg: FleetConfig = field(init=False)
    store: PostgresStore = field(init=False)
    toml: Path = field(init=False)

    def __post_init__(self) -> None:
        self.workspaces = self.tmp / "ws"
        self.toml = write_fleet_toml(self.tmp / "fleet.toml", self.workspaces, self.lanes, self.tables)
        # lane_instructions/<lane>.md beside the config: found before the packaged ones
        (self.tmp / "lane_instructions").mkdir(exist_ok=True)
        for name in self.lanes:
            (self.tmp / "lane_instructions" / f"{name}.md").write_text(
                f"# Lane: {name}\n\n{self.instructions_marker(name)}: do the task.\n")
        self.cfg = load_config(self.toml, environ={"DATABASE_URL": self.db_url})
        self.direct = PostgresStore(self.db_url, max_size=4)
        sync_config(self.direct, self.cfg)
        self.worker_key = self.backend.key("worker", self.key_lanes or list(self.lanes))
        self.operator_key = self.backend.key("operator")
        self.store = self.backend.store(self.worker_key) if self.backend.rest else self.direct
        self.monitor_store = self.backend.store(self.operator_key) if self.backend.rest else self.direct

    @property
    def db_url(self) -> str:
        return self.backend.db_url

    def close(self) -> None:
        for store in {id(s): s for s in (self.store, self.monitor_store, self.direct)}.values():
            store.close()

    @staticmethod
    def instructions_marker(lane: str) -> str:
        return f"LANE-INSTRUCTIONS-{lane.upper()}"

    def workspace(self, lane: str, key: str) -> Path:
        from worker.workspace.folder import workspace_for

        return workspace_for(self.workspaces, lane, key).root

    # -- shifts

    def shift(self, lane: str, *, max_seconds: float = 30, **kwargs: Any) -> Shift:
        kwargs.setdefault("once", True)
        kwargs.setdefault("poll_seconds", 0.1)
        return Shift(self.store, self.cfg, lane, max_seconds=max_seconds, **kwargs)

    def run_shift(self, lane: str, **kwargs: Any) -> ShiftSummary:
        return self.shift(lane, **kwargs).run()

    def env(self, role: str = "worker") -> dict[str, str]:
        """A `fleet` subprocess's environment: a shift's (``worker``) or an operator's."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
        env.update(self.backend.env(self.operator_key if role == "operator" else self.worker_key))
        env["FLEET_CONFIG"] = str(self.toml)
        return env

    def cli(self, *args: str, timeout: float = 60, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """A `fleet` command as an operator (unless ``env`` says otherwise)."""
        return subprocess.run([sys.executable, "-m", "monitor.cli", *args], cwd=cwd or ROOT,
                              env=env or self.env("operator"), capture_output=True, text=True, timeout=timeout)

    def spawn_shift(self, lane: str, *args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
        """``fleet shift --lane L`` as a subprocess (its stderr, the JSON log, goes to ``log``)."""
        out = (log or self.tmp / f"shift-{lane}-{time.monotonic_ns()}.log").open("wb")
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "monitor.cli", "shift", "--lane", lane, "--poll", "0.1",
                 "--json-logs", *args],
                cwd=ROOT, env=self.env(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        finally:
            out.close()

    # -- the database

    def enqueue(self, lane: str, key: str, payload: dict[str, Any] | None = None, **kw: Any) -> int:
        task_id, created = self.store.enqueue(lane, key, payload or {}, **kw)
        assert created
        return task_id

    def sql(self, query: str, params: Any = ()) -> list[dict[str, Any]]:
        with psycopg.connect(self.db_url, autocommit=True, row_factory=dict_row) as c:
            cur = c.execute(query, params)  # type: ignore[arg-type]
            return cur.fetchall() if cur.description else []

    def task(self, task_id: int) -> dict[str, Any]:
        rows = self.sql("select * from fleet.tasks where id = %s", (task_id,))
        assert rows, f"no task {task_id}"
        return rows[0]

    def runs(self, task_id: int) -> list[dict[str, Any]]:
        return self.sql("select * from fleet.runs where task_id = %s order by id", (task_id,))

    def workspace_rows(self, task_id: int) -> list[dict[str, Any]]:
        """The task's rows of fleet.workspaces (one per host and path), oldest first."""
        return self.sql("select * from fleet.workspaces where task_id = %s order by id", (task_id,))

    def event_kinds(self, task_id: int) -> list[str]:
        return [r["kind"] for r in self.sql("select kind from fleet.journal where task_id = %s order by id",
                                            (task_id,))]


# -- processes


def proc_children(pid: int) -> set[int]:
    """Direct children of ``pid`` (from /proc/<pid>/task/*/children)."""
    out: set[int] = set()
    for f in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out.update(int(x) for x in f.read_text().split())
        except OSError:
            pass
    return out


def pids_using(path: Path) -> set[int]:
    """Live processes whose command line or cwd mentions ``path`` (this process excluded)."""
    needle = str(path)
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            try:
                cwd = os.readlink(entry / "cwd")
            except OSError:
                cwd = ""
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state == "Z":  # a zombie has exited already; it only waits for its parent to reap it
            continue
        if needle in cmdline or cwd.startswith(needle):
            found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a failed command (asserting exit 1, no traceback, nothing on stdout):
    what every user or environment mistake must come to."""
    report = f"rc={result.returncode}\nstdout={result.stdout!r}\nstderr={result.stderr!r}"
    assert result.returncode == 1, report
    assert "Traceback" not in result.stderr, report
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, report
    assert lines[0].startswith("error: "), report
    assert result.stdout == "", report
    return lines[0]
