"""The ``fleet`` CLI, run for real as a subprocess against a real database.

Each call is a fresh ``python -m monitor.cli`` with FLEET_CONFIG pointing at a fleet.toml in a tmp
folder and DATABASE_URL at a test database. Bad inputs are many and each costs a process start,
so they run concurrently against one module-scoped database and are checked one by one after:
each exits 1 with ONE line on stderr, no traceback, and writes nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import create_database, drop_database
from fleetkit import one_line
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row

from worker.config import load_config
from worker.db.migrate import load_migrations
from worker.models import TASK_STATES
from worker.store.postgres import PostgresStore
from worker.store.sync import lane_settings

FLEET_TOML = """\
[lanes.docs]
command = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]
max_running = 2

[lanes.review]
command = "python -m worker.dev.example_agent {prompt_file}"
max_running = 1
accepts_from = ["docs"]
"""


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") and k != "DATABASE_URL"}
    env["COLUMNS"] = "200"  # rich tables: no truncated cells
    return env


def fleet(*args: str, url: str, config: Path | str, cwd: Path, env: dict[str, str] | None = None,
          ) -> subprocess.CompletedProcess[str]:
    full = {**base_env(), "DATABASE_URL": url, "FLEET_CONFIG": str(config), **(env or {})}
    return subprocess.run([sys.executable, "-m", "monitor.cli", *args], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=120)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"rc={result.returncode}\nstdout={result.stdout}\nstderr={result.stderr}"
    assert "Traceback" not in result.stderr
    return result.stdout


def one_value(url: str, query: str, params: Any = None) -> Any:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute(query, params).fetchone()
    return None if row is None else row[0]


def task_row(url: str, ref: int | str) -> dict[str, Any] | None:
    column = "id" if isinstance(ref, int) else "key"
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as c:
        return c.execute(f"select * from fleet.tasks where {column} = %s", (ref,)).fetchone()


def counts(url: str) -> tuple[int, int]:
    return (one_value(url, "select count(*) from fleet.tasks"),
            one_value(url, "select count(*) from fleet.journal"))


def synced_store(url: str, config: Path) -> PostgresStore:
    """A store on ``url`` whose lanes are the config's (what `fleet lanes sync` does)."""
    cfg = load_config(config, environ={})
    store = PostgresStore(url)
    for name, lane in cfg.lanes.items():
        store.sync_lane(name, lane_settings(lane))
    return store


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli")
    (path / "fleet.toml").write_text(FLEET_TOML)
    (path / "payload.json").write_text(json.dumps({"issue": 473, "repo": "acme/app"}))
    (path / "array.json").write_text("[1, 2]")
    (path / "big.json").write_text(json.dumps({"blob": "x" * (1 << 20)}))  # past the 1 MiB default cap
    (path / "bad-max-running.toml").write_text(FLEET_TOML.replace("max_running = 2", "max_running = -1"))
    (path / "bad-toml.toml").write_text("[lanes.docs\n")
    return path


@pytest.fixture
def config(home: Path) -> Path:
    return home / "fleet.toml"


# ------------------------------------------------------------------------------------------------
# migrate and lanes


def test_migrate_an_empty_database(empty_db_url: str, tmp_path: Path, home: Path) -> None:
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(FLEET_TOML)

    out = ok(fleet("migrate", "--dry-run", url=empty_db_url, config=cfg, cwd=tmp_path))
    assert f"{len(load_migrations())} pending" in out
    for name in ("20261130100000_fleet_schema.sql", "20261130100100_fleet_api.sql",
                 "20261130100200_fleet_lanes_reconcile.sql"):
        assert name in out
    assert one_value(empty_db_url, "select to_regnamespace('fleet')") is None  # applied nothing
    assert one_value(empty_db_url, "select to_regclass('supabase_migrations.schema_migrations')") is None

    out = ok(fleet("migrate", url=empty_db_url, config=cfg, cwd=tmp_path))
    assert out.count("applied ") == len(load_migrations())
    assert "lane docs: created" in out and "lane review: created" in out
    assert one_value(empty_db_url, "select count(*) from supabase_migrations.schema_migrations") == len(
        load_migrations())
    assert one_value(empty_db_url, "select array_agg(name order by name) from fleet.lanes") == ["docs", "review"]

    out = ok(fleet("migrate", url=empty_db_url, config=cfg, cwd=tmp_path))
    assert "nothing to apply" in out
    assert f"{len(load_migrations())} already applied" in out
    assert "lane " not in out  # unchanged lanes are not reported

    # a changed lane is synced by the next migrate; --json is parseable
    cfg.write_text(FLEET_TOML.replace("max_running = 2", "max_running = 5"))
    data = json.loads(ok(fleet("migrate", "--json", url=empty_db_url, config=cfg, cwd=tmp_path)))
    assert data == {"applied": [], "pending": [], "already_applied": len(load_migrations()), "newer": [],
                    "lanes": {"docs": "updated", "review": "unchanged"}}

    lanes = json.loads(ok(fleet("lanes", "list", "--json", url=empty_db_url, config=cfg, cwd=tmp_path)))
    by_name = {row["name"]: row for row in lanes}
    assert set(by_name) == {"docs", "review"}
    assert by_name["docs"]["max_running"] == 5
    assert by_name["review"]["accepts_from"] == ["docs"]


# ------------------------------------------------------------------------------------------------
# enqueue


def test_enqueue_prints_the_id_and_is_idempotent_on_key(db_url: str, config: Path, home: Path) -> None:
    synced_store(db_url, config).close()
    first = fleet("enqueue", "docs", "--key", "issue:473", "--payload", f"@{home / 'payload.json'}",
                  "--title", "Fix the docs", "--priority", "7", "--max-attempts", "4",
                  "--run-at", "2030-01-02T03:04:05+02:00", url=db_url, config=config, cwd=home)
    task_id = int(ok(first).strip())  # the id, and only the id
    assert first.stderr == ""
    row = task_row(db_url, task_id)
    assert row is not None
    assert (row["key"], row["lane"], row["payload"], row["title"], row["priority"], row["max_attempts"],
            row["state"]) == ("issue:473", "docs", {"issue": 473, "repo": "acme/app"}, "Fix the docs", 7, 4,
                              "queued")
    assert row["run_at"] == datetime(2030, 1, 2, 1, 4, 5, tzinfo=UTC)
    before = counts(db_url)

    again = fleet("enqueue", "docs", "--key", "issue:473", "--payload", '{"other": true}', "--priority", "9",
                  url=db_url, config=config, cwd=home)
    assert ok(again).strip() == str(task_id)
    note = again.stderr.strip().splitlines()
    assert len(note) == 1 and "already existed" in note[0] and str(task_id) in note[0]
    assert counts(db_url) == before
    assert task_row(db_url, task_id) == row  # untouched


def test_enqueue_run_at(db_url: str, config: Path, home: Path) -> None:
    synced_store(db_url, config).close()
    before = one_value(db_url, "select now()")
    out = ok(fleet("enqueue", "docs", "--key", "later", "--run-at", "+10m", url=db_url, config=config, cwd=home))
    after = one_value(db_url, "select now()")
    run_at = task_row(db_url, int(out))["run_at"]  # type: ignore[index]
    # ten minutes after the database's now() at the time of the call
    assert before + timedelta(minutes=10) <= run_at <= after + timedelta(minutes=10)

    # an ISO time without a zone is UTC; --json says whether the key was new
    data = json.loads(ok(fleet("enqueue", "review", "--key", "at", "--run-at", "2030-01-02T03:04:05", "--json",
                               url=db_url, config=config, cwd=home)))
    assert data["created"] is True
    assert task_row(db_url, data["id"])["run_at"] == datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)  # type: ignore[index]


# ------------------------------------------------------------------------------------------------
# tasks, show, cancel, retry


def test_tasks_filters_and_json(db_url: str, config: Path, home: Path) -> None:
    with synced_store(db_url, config) as store:
        d1, _ = store.enqueue("docs", "d1", title="first")
        d2, _ = store.enqueue("docs", "d2")
        d3, _ = store.enqueue("docs", "d3", title="third")
        d4, _ = store.enqueue("docs", "d4")
        store.enqueue("review", "r1")
        # user data that looks like rich markup is printed as is (it raised MarkupError)
        store.enqueue("review", "k[/x]", title="[/y] odd")
        # and what looks like an emoji code (rich made ":smile:" 😄 of it)
        store.enqueue("review", "a:smile:b", title="fix :bug: now")
        store.cancel(d2)
        store.cancel(d4)

    rows = json.loads(ok(fleet("tasks", "--lane", "docs", "--state", "queued", "--limit", "1", "--json",
                               url=db_url, config=config, cwd=home)))
    assert [r["id"] for r in rows] == [d3]  # newest first, docs only, queued only, one
    assert rows[0]["key"] == "d3" and rows[0]["title"] == "third" and rows[0]["state"] == "queued"

    table = ok(fleet("tasks", url=db_url, config=config, cwd=home))
    for text in ("d1", "d2", "d3", "r1", "k[/x]", "[/y] odd", "a:smile:b", "fix :bug: now", "cancelled", "first"):
        assert text in table
    assert table.index("k[/x]") < table.index("d3") < table.index("d1")
    assert d1


def test_tasks_filters_by_every_state(db_url: str, config: Path, home: Path) -> None:
    with synced_store(db_url, config) as store:
        ids = {state: store.enqueue("docs", f"s-{state}")[0] for state in TASK_STATES}
    with psycopg.connect(db_url, autocommit=True) as c:  # one task in each state, as the CHECKs allow
        for state, tid in ids.items():
            c.execute("""update fleet.tasks set state = %(s)s::text,
                                block_reason = case when %(s)s = 'blocked' then 'test' end,
                                finished_at = case when %(s)s in ('done', 'dead', 'cancelled') then now() end,
                                lease_token = case when %(s)s = 'running' then gen_random_uuid() end,
                                lease_expires_at = case when %(s)s = 'running' then now() + interval '1 minute' end,
                                session_id = case when %(s)s = 'running'
                                                  then fleet.open_session('docs', 'h', 1, now(), 60) end
                          where id = %(id)s""", {"s": state, "id": tid})
    for state, tid in ids.items():
        rows = json.loads(ok(fleet("tasks", "--state", state, "--json", url=db_url, config=config, cwd=home)))
        assert [r["id"] for r in rows] == [tid], state


def test_show_cancel_retry(db_url: str, config: Path, home: Path) -> None:
    with synced_store(db_url, config) as store:
        task_id, _ = store.enqueue("docs", "issue:9", {"tags": ["[bold]"]}, title="[/y] nine")

    data = json.loads(ok(fleet("show", "issue:9", "--json", url=db_url, config=config, cwd=home)))
    assert data["task"]["id"] == task_id and data["task"]["key"] == "issue:9"
    assert data["task"]["payload"] == {"tags": ["[bold]"]}
    assert [e["kind"] for e in data["events"]] == ["enqueued"]
    assert data["runs"] == []

    assert f"task {task_id}: cancelled" in ok(fleet("cancel", "issue:9", url=db_url, config=config, cwd=home))
    assert task_row(db_url, task_id)["state"] == "cancelled"  # type: ignore[index]
    again = ok(fleet("cancel", "issue:9", url=db_url, config=config, cwd=home))
    assert again.strip() == f"task {task_id}: already cancelled", again
    assert f"task {task_id}: queued" in ok(fleet("retry", str(task_id), url=db_url, config=config, cwd=home))
    assert task_row(db_url, task_id)["state"] == "queued"  # type: ignore[index]

    out = ok(fleet("show", str(task_id), url=db_url, config=config, cwd=home))
    assert f"task {task_id}" in out and "issue:9" in out
    assert "[/y] nine" in out and '"[bold]"' in out  # printed as is, not read as markup
    for kind in ("enqueued", "cancelled", "retried"):
        assert kind in out
    assert out.index("enqueued") < out.index("cancelled") < out.index("retried")


def test_show_says_a_done_tasks_last_error_is_history(db_url: str, config: Path, home: Path) -> None:
    with synced_store(db_url, config) as store:
        task_id, _ = store.enqueue("docs", "flaky", {}, max_attempts=3)
        session = store.open_session("docs", "host-1", os.getpid(), None, 600)
        for end in ("fail", "complete"):
            (task,) = store.claim(session)
            assert task.lease_token is not None
            if end == "fail":
                store.fail(task_id, task.lease_token, "the network went away")
                with psycopg.connect(db_url, autocommit=True) as c:  # its backoff over
                    c.execute("update fleet.tasks set run_at = now() where id = %s", (task_id,))
            else:
                store.complete(task_id, task.lease_token)
    out = " ".join(ok(fleet("show", str(task_id), url=db_url, config=config, cwd=home)).split())
    assert "last error (an earlier attempt's; it is done): the network went away" in out, out


def test_show_says_when_a_task_deferred_may_run(db_url: str, config: Path, home: Path) -> None:
    synced_store(db_url, config).close()
    task_id = ok(fleet("enqueue", "docs", "--key", "later", "--run-at", "+10m", url=db_url, config=config,
                       cwd=home)).strip()
    out = ok(fleet("show", task_id, url=db_url, config=config, cwd=home))
    assert re.search(r"^not before \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(in (9m\d\ds|10m00s)\)$", out, re.M), out
    now = ok(fleet("enqueue", "docs", "--key", "now", url=db_url, config=config, cwd=home)).strip()
    assert "not before" not in ok(fleet("show", now, url=db_url, config=config, cwd=home))


def test_lanes_sync_names_pools_and_profiles_as_what_they_are(db_url: str, home: Path) -> None:
    config = home / "pools.toml"
    config.write_text('[pools.max]\nslots = 3\n\n[profiles.claude]\nagent = "claude"\npool = "max"\n\n'
                      '[lanes.docs]\nprofile = "claude"\n')
    lines = ok(fleet("lanes", "sync", url=db_url, config=config, cwd=home)).splitlines()
    assert lines[:3] == ["pool max: created", "profile claude: created", "lane docs: created"], lines


def test_keys_are_per_lane(db_url: str, config: Path, home: Path) -> None:
    synced_store(db_url, config).close()
    docs = int(ok(fleet("enqueue", "docs", "--key", "issue:5", url=db_url, config=config, cwd=home)).strip())
    review = int(ok(fleet("enqueue", "review", "--key", "issue:5", url=db_url, config=config, cwd=home)).strip())
    assert docs != review
    assert (task_row(db_url, docs)["lane"], task_row(db_url, review)["lane"]) == ("docs", "review")  # type: ignore[index]
    again = fleet("enqueue", "review", "--key", "issue:5", url=db_url, config=config, cwd=home)
    assert ok(again).strip() == str(review)
    assert "key 'issue:5' already existed in lane review: task" in again.stderr
    # a key of two lanes: the lane says which
    data = json.loads(ok(fleet("show", "issue:5", "--lane", "review", "--json", url=db_url, config=config, cwd=home)))
    assert data["task"]["id"] == review
    assert f"task {docs}: cancelled" in ok(fleet("cancel", "issue:5", "-l", "docs", url=db_url, config=config, cwd=home))
    assert (task_row(db_url, docs)["state"], task_row(db_url, review)["state"]) == ("cancelled", "queued")  # type: ignore[index]
    assert f"task {docs}: queued" in ok(fleet("retry", "issue:5", "--lane", "docs", url=db_url, config=config, cwd=home))
    # the same file of tasks in two lanes: per line, its lane
    (home / "two-lanes.jsonl").write_text('{"key": "f:1"}\n{"key": "f:1", "lane": "review"}\n')
    out = json.loads(ok(fleet("enqueue", "--from", str(home / "two-lanes.jsonl"), "--lane", "docs", "--json",
                              url=db_url, config=config, cwd=home)))
    assert [(t["lane"], t["created"]) for t in out["tasks"]] == [("docs", True), ("review", True)]


def test_pools_list_and_clear(db_url: str, config: Path, home: Path) -> None:
    synced_store(db_url, config).close()
    none = ok(fleet("pools", "list", url=db_url, config=config, cwd=home))
    assert "fleet.toml's [pools] by" in none, none  # (not taken for a style by the terminal library)
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("select fleet.sync_pool('max', 3)")
        c.execute("select fleet.sync_pool('idle', null)")
        c.execute("update fleet.pools set throttled_until = now() + interval '2 hours', throttle_note = 'weekly limit',"
                  " throttled_by = '{\"task\": 12, \"lane\": \"docs\", \"host\": \"host-1\", \"role\": \"fleet_worker\"}'"
                  " where name = 'max'")
    out = ok(fleet("pools", "list", url=db_url, config=config, cwd=home))
    assert "max" in out and "weekly limit" in out and "task 12 (lane docs) on host-1, fleet_worker" in out
    rows = json.loads(ok(fleet("pools", "list", "--json", url=db_url, config=config, cwd=home)))
    assert [(r["name"], r["slots"], r["throttled_until"] is not None) for r in rows] == [
        ("idle", None, False), ("max", 3, True)]
    out = ok(fleet("pools", "clear", "max", url=db_url, config=config, cwd=home))
    assert "pool max: throttle lifted" in out and "set by task 12 (lane docs) on host-1, fleet_worker" in out
    assert one_value(db_url, "select throttled_until from fleet.pools where name = 'max'") is None
    assert one_value(db_url, "select count(*) from fleet.journal where kind = 'throttle_cleared'") == 1
    got = json.loads(ok(fleet("pools", "clear", "max", "--json", url=db_url, config=config, cwd=home)))
    assert (got["was_until"], got["tasks"]) == (None, 0)
    assert "pool idle was not throttled" in ok(fleet("pools", "clear", "idle", url=db_url, config=config, cwd=home))


# ------------------------------------------------------------------------------------------------
# bad inputs: exit 1, one line on stderr, no traceback, nothing written


@dataclass
class Bad:
    id: str
    args: list[str]
    expect: str  # a substring of the one-line message
    config: str = "fleet.toml"  # a file in `home`, or an absolute path
    db: str = "module"  # "module": the shared migrated database; "empty": an unmigrated one
    key: str | None = None  # an enqueue key that must not exist afterwards
    unexpected: list[str] = field(default_factory=list)


BAD = [
    Bad("unknown-lane", ["enqueue", "nope", "--key", "bad:1"], "unknown lane 'nope'", key="bad:1"),
    Bad("malformed-json", ["enqueue", "docs", "--key", "bad:2", "--payload", '{"a":'], "not valid JSON", key="bad:2"),
    Bad("payload-array", ["enqueue", "docs", "--key", "bad:3", "--payload", "[1, 2]"], "must be a JSON object",
        key="bad:3"),
    Bad("payload-file-missing", ["enqueue", "docs", "--key", "bad:5", "--payload", "@/nonexistent/p.json"],
        "/nonexistent/p.json", key="bad:5"),
    Bad("payload-file-array", ["enqueue", "docs", "--key", "bad:6", "--payload", "@array.json"],
        "must be a JSON object", key="bad:6"),
    Bad("priority-negative", ["enqueue", "docs", "--key", "bad:7", "--priority", "-1"],
        "priority must be between 0 and 1000", key="bad:7"),
    Bad("priority-too-high", ["enqueue", "docs", "--key", "bad:8", "--priority", "1001"],
        "priority must be between 0 and 1000", key="bad:8"),
    Bad("priority-past-int4", ["enqueue", "docs", "--key", "bad:9", "--priority", "99999999999"],
        "out of range", key="bad:9", unexpected=["migrate"]),
    Bad("max-attempts-zero", ["enqueue", "docs", "--key", "bad:10", "--max-attempts", "0"],
        "max_attempts must be at least 1", key="bad:10"),
    Bad("run-at-word", ["enqueue", "docs", "--key", "bad:11", "--run-at", "tomorrow"],
        "+<n>[s|m|h|d]", key="bad:11"),
    Bad("empty-key", ["enqueue", "docs", "--key", ""], "task key must be 1 to 200 characters"),
    Bad("existing-key-bad-priority", ["enqueue", "docs", "--key", "{queued_key}", "--priority", "5000"],
        "priority must be between 0 and 1000"),
    Bad("payload-too-large", ["enqueue", "docs", "--key", "bad:23", "--payload", "@big.json"],
        "payload is 1048588 bytes, more than lane docs's max_payload_bytes of 1048576", key="bad:23"),
    Bad("show-unknown-id", ["show", "99999999"], "no task with id or key '99999999'"),
    Bad("show-ambiguous-key", ["show", "existing:shared"], "key 'existing:shared' names 2 tasks, in lanes docs, review"),
    Bad("cancel-ambiguous-key", ["cancel", "existing:shared"], "give the lane (--lane)"),
    Bad("show-key-in-another-lane", ["show", "existing:queued", "--lane", "review"],
        "no task with id or key 'existing:queued' in lane review"),
    Bad("pools-clear-unknown", ["pools", "clear", "nope"], "unknown pool 'nope'"),
    Bad("show-unknown-key", ["show", "no:such:key", "--json"], "no task with id or key 'no:such:key'"),
    Bad("show-markup-key", ["show", "[/bogus]"], "'[/bogus]'"),
    Bad("cancel-unknown", ["cancel", "no:such:key"], "no task with id or key"),
    Bad("retry-unknown", ["retry", "99999999"], "no task with id or key"),
    Bad("retry-queued", ["retry", "{queued}"], "only dead, cancelled or blocked tasks can be retried"),
    Bad("cancel-done", ["cancel", "{done_key}"], "only queued, running, blocked or ci tasks can be cancelled"),
    Bad("state-unknown", ["tasks", "--state", "bogus"], "--state 'bogus' is not a task state"),
    Bad("config-max-running-enqueue", ["enqueue", "docs", "--key", "bad:20"], "lanes.docs.max_running",
        config="bad-max-running.toml", key="bad:20"),
    Bad("config-missing", ["enqueue", "docs", "--key", "bad:21"], "does not exist",
        config="/nonexistent/fleet.toml", key="bad:21"),
    Bad("config-not-toml", ["tasks"], "not valid TOML", config="bad-toml.toml"),
    Bad("config-is-a-directory", ["tasks"], "cannot be read", config="/tmp"),
    Bad("not-migrated", ["enqueue", "docs", "--key", "bad:22"], "fleet migrate", db="empty"),
    Bad("unreachable", ["tasks"], "cannot connect to the database", db="unreachable"),
    Bad("unreachable-migrate", ["migrate"], "cannot connect to the database", db="unreachable"),
]


@dataclass
class BadRuns:
    results: dict[str, subprocess.CompletedProcess[str]]
    before: tuple[int, int]
    after: tuple[int, int]
    tasks_before: list[dict[str, Any]]
    tasks_after: list[dict[str, Any]]
    url: str
    empty_url: str


def _tasks(url: str) -> list[dict[str, Any]]:
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as c:
        return c.execute("select * from fleet.tasks order by id").fetchall()


@pytest.fixture(scope="module")
def bad_runs(pg_server: str, template_db: str, home: Path) -> Iterator[BadRuns]:
    """Every BAD case, run concurrently against one migrated database (and one empty one)."""
    name = create_database(pg_server, template=template_db)
    empty = create_database(pg_server)
    url, empty_url = make_conninfo(pg_server, dbname=name), make_conninfo(pg_server, dbname=empty)
    try:
        with synced_store(url, home / "fleet.toml") as store:
            queued, _ = store.enqueue("docs", "existing:queued")
            store.enqueue("docs", "existing:shared")
            store.enqueue("review", "existing:shared")
            store.enqueue("docs", "existing:done", priority=10)
            session = store.open_session("docs", "host-1", 4242, None, 600)
            [done] = store.claim(session, 1)
            assert done.key == "existing:done"
            assert store.complete(done.id, done.lease_token) == "done"  # type: ignore[arg-type]
        values = {"queued": str(queued), "queued_key": "existing:queued", "done_key": "existing:done"}
        dbs = {"module": url, "empty": empty_url, "unreachable": "postgresql://postgres@127.0.0.1:1/nowhere"}

        def run(case: Bad) -> subprocess.CompletedProcess[str]:
            args = list(case.args)
            for k, v in values.items():
                args = [a.replace("{" + k + "}", v) for a in args]
            return fleet(*args, url=dbs[case.db], config=home / case.config, cwd=home)

        before, tasks_before = counts(url), _tasks(url)
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = dict(zip([c.id for c in BAD], pool.map(run, BAD), strict=True))
        yield BadRuns(results, before, counts(url), tasks_before, _tasks(url), url, empty_url)
    finally:
        drop_database(pg_server, name)
        drop_database(pg_server, empty)


@pytest.mark.parametrize("case", BAD, ids=[c.id for c in BAD])
def test_bad_input_is_one_line_and_writes_nothing(case: Bad, bad_runs: BadRuns) -> None:
    result = bad_runs.results[case.id]
    line = one_line(result)
    assert case.expect in line, result
    for word in case.unexpected:
        assert word not in line, result
    # nothing written
    assert bad_runs.after == bad_runs.before
    assert bad_runs.tasks_after == bad_runs.tasks_before
    if case.key is not None:
        assert task_row(bad_runs.url, case.key) is None
    if case.db == "empty":
        assert one_value(bad_runs.empty_url, "select to_regnamespace('fleet')") is None
        assert one_value(bad_runs.empty_url, "select to_regclass('supabase_migrations.schema_migrations')") is None


def test_a_runs_lines_fit_the_width_and_break_between_fields() -> None:
    """`fleet show` at 80 columns: a field (a model list, a token count) is never cut in two."""
    from datetime import UTC, datetime
    from decimal import Decimal

    from worker.cli.tasks import run_lines
    from worker.models import Run

    run = Run(id=4, task_id=7, session_id=None, lane="bugfix", attempt=1,
              started_at=datetime(2026, 12, 4, 18, 20, 23, tzinfo=UTC), ended_at=None, outcome="routed",
              exit_code=0, tier=None, model="claude-sonnet-4-5,claude-haiku-4-5", agent_session=None,
              input_tokens=12_345_678, cache_creation_tokens=1_000, cache_read_tokens=98_765_432,
              output_tokens=3_000, reasoning_tokens=2_500, cost_usd=Decimal("0.092"), log_path=None,
              error_tail=None, agent="generic", cost_source="reported")
    for width in (80, 50):
        lines = run_lines(run, width=width)
        assert max(len(line) for line in lines) <= width, (width, lines)
        text = "\n".join(lines)
        for part in ("model claude-sonnet-4-5,claude-haiku-4-5", "tokens 12,345,678 in", "98,765,432 cache read",
                     "3,000 out (2,500 reasoning)", "profile (lane command)", "cost $0.0920 (reported by the agent)"):
            assert any(part in line for line in lines), (part, text)
    assert run_lines(run, width=80)[1:4] == [
        "    generic · tier - · profile (lane command) · pool -",
        "      model claude-sonnet-4-5,claude-haiku-4-5",
        "    tokens 12,345,678 in · 1,000 cache write · 98,765,432 cache read",
    ]
