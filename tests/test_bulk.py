"""The bulk calls through the stores: ``enqueue_many`` and ``complete_many`` on both
back-ends (supabase: a real PostgREST, a worker key for lane docs), who may call them over REST,
prepared statements and poolers, and `fleet enqueue --from`. (fleet.enqueue_many and
fleet.complete_many themselves: tests/sql/test_enqueue.py, tests/sql/test_finish.py; their lane
checks and grants: tests/sql/test_security.py; the hot tables' settings: tests/sql/test_tables.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fleetkit import Backend, wait_for
from supabase_stack import client, key, snapshot, sql

from worker.config import LaneConfig
from worker.dev.devstack import DevStack
from worker.errors import FleetError, InvalidInput, LaneForbidden, UnknownLane
from worker.models import Task
from worker.store.postgres import PostgresStore
from worker.store.supabase import SupabaseStore

# ------------------------------------------------------------------------------------------------
# the store, on both back-ends (supabase: a real PostgREST, a worker key for lane docs)


def test_store_bulk_calls(backend: Backend) -> None:
    direct = PostgresStore(backend.db_url)
    try:
        direct.sync_lane("docs", {})
        direct.sync_lane("bugfix", {})
        store = backend.store(backend.key("worker", ["docs"]))
        try:
            first = store.enqueue_many("docs", [{"key": "s:1", "payload": {"a": 1}}, {"key": "s:2", "title": "two"},
                                                {"key": "s:1"}])
            assert [c for _, c in first] == [True, True, False] and first[0][0] == first[2][0]
            assert store.enqueue_many("docs", [{"key": "s:2"}]) == [(first[1][0], False)]
            assert store.enqueue_many("docs", []) == []
            with pytest.raises(InvalidInput, match=r"^p_tasks\[1\] \(key 's:4'\): priority"):
                store.enqueue_many("docs", [{"key": "s:3"}, {"key": "s:4", "priority": 5000}])
            with pytest.raises(LaneForbidden if backend.rest else UnknownLane):
                store.enqueue_many("docs", [{"key": "s:5", "lane": "nope"}])
            assert direct.query("task_by_key", key="s:3") == []

            session = store.open_session("docs", "host-1", 4242, None, 600)
            a, b = store.claim(session, 2)
            assert a.lease_token and b.lease_token
            got = store.complete_many([(a.id, uuid.uuid4()), (b.id, b.lease_token, {"out": [1, "two"]})])
            assert got == {a.id: "lost", b.id: "done"}
            assert direct.get_task(b.id).result == {"out": [1, "two"]}
            assert direct.get_task(a.id).state == "running"
            assert store.complete_many([(a.id, a.lease_token)]) == {a.id: "done"}
            assert direct.get_task(a.id).result is None
            with pytest.raises(InvalidInput, match="named twice"):
                store.complete_many([(a.id, a.lease_token), (a.id, a.lease_token)])
        finally:
            store.close()
    finally:
        direct.close()


def test_store_complete_many_knows_no_task_of_another_lane(stack: DevStack) -> None:
    """Over REST with a worker key for lane docs (a direct connection works every lane)."""
    backend = Backend("supabase", stack.db_url, stack)
    direct = PostgresStore(backend.db_url)
    try:
        for lane in ("docs", "bugfix"):
            direct.sync_lane(lane, {})
        direct.enqueue("bugfix", "bug:1")
        s = direct.open_session("bugfix", "host-1", 1, None, 600)
        [bug] = direct.claim(s, 1)
        assert bug.lease_token is not None
        docs = backend.store(backend.key("worker", ["docs"]))
        try:
            # another lane's task, its real token given: unknown, as a missing one, and untouched
            assert docs.complete_many([(bug.id, bug.lease_token)]) == {bug.id: "unknown"}
            with pytest.raises(LaneForbidden):
                docs.enqueue_many("bugfix", [{"key": "x:1"}])
        finally:
            docs.close()
        assert direct.get_task(bug.id).state == "running"
        assert direct.query("task_by_key", key="x:1") == []
    finally:
        direct.close()


def test_anon_and_operators_over_rest(stack: DevStack) -> None:
    """anon cannot call either; an operator key may enqueue_many (as enqueue) but not complete_many."""
    sql(stack, "select fleet.sync_lane('docs', '{}')")
    sql(stack, "select fleet.enqueue('docs', 'r:1')")
    s = sql(stack, "select fleet.open_session('docs', 'h', 1, null, 600) as s")[0]["s"]
    t = sql(stack, "select id, lease_token from fleet.claim(%s, 1)", (s,))[0]
    before = snapshot(stack)
    calls = {"enqueue_many": {"p_lane": "docs", "p_tasks": [{"key": "anon:1"}]},
             "complete_many": {"p_tasks": [t["id"]], "p_tokens": [str(t["lease_token"])], "p_results": None}}
    anon = client(stack)
    for fn, params in calls.items():
        with pytest.raises(Exception) as err:
            anon.rpc(fn, params).execute()
        assert getattr(err.value, "code", None) == "42501", err.value
    operator = client(stack, key(stack, "operator"))
    with pytest.raises(Exception) as err:
        operator.rpc("complete_many", calls["complete_many"]).execute()
    assert getattr(err.value, "code", None) == "42501", err.value
    assert snapshot(stack) == before
    assert operator.rpc("enqueue_many", {"p_lane": "docs", "p_tasks": [{"key": "op:1"}]}).execute().data[0]["created"]


def test_prepared_statements_stay_on_unless_a_pooler(db_url: str) -> None:
    """psycopg prepares a statement server-side after prepare_threshold runs on a connection; a
    transaction-mode pooler cannot keep them, so only `[database] pooler = true` turns them off."""
    for pooler, expected in ((False, 5), (True, None)):
        store = PostgresStore(db_url, pooler=pooler)
        try:
            with store.pool.connection() as c:
                assert c.prepare_threshold == expected
        finally:
            store.close()


# ------------------------------------------------------------------------------------------------
# fleet enqueue --from


FLEET_TOML = """\
[lanes.docs]
command = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]

[lanes.review]
command = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]
"""


@pytest.fixture
def cli(db_url: str, tmp_path: Path):  # -> a function running `fleet …` against the test database
    import os

    (tmp_path / "fleet.toml").write_text(FLEET_TOML)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update({"DATABASE_URL": db_url, "FLEET_CONFIG": str(tmp_path / "fleet.toml"), "COLUMNS": "200"})
    store = PostgresStore(db_url)
    for lane in ("docs", "review"):
        store.sync_lane(lane, {})
    store.close()

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "monitor.cli", *args], cwd=tmp_path, env=env, input=stdin,
                              capture_output=True, text=True, timeout=120)
    return run


def tasks_of(db_url: str) -> list[tuple[str, str, str | None, int, dict[str, Any]]]:
    with psycopg.connect(db_url) as c:
        return c.execute("select key, lane, title, priority, payload from fleet.tasks order by id").fetchall()


def test_enqueue_from_a_file(cli: Any, db_url: str, tmp_path: Path) -> None:
    (tmp_path / "tasks.jsonl").write_text(
        '{"key": "t:1", "title": "one", "payload": {"n": 1}}\n'
        "\n"
        '{"key": "t:2", "lane": "review", "priority": 5}\n'
        '   \n'
        '{"key": "t:1"}\n')
    r = cli("enqueue", "--from", "tasks.jsonl", "--lane", "docs")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "2 created, 1 already existed"
    assert tasks_of(db_url) == [("t:1", "docs", "one", 0, {"n": 1}), ("t:2", "review", None, 5, {})]
    r = cli("enqueue", "docs", "--from", "tasks.jsonl", "--json")
    data = json.loads(r.stdout)
    assert (data["created"], data["existing"]) == (0, 3)
    assert [(t["line"], t["key"], t["created"]) for t in data["tasks"]] == [
        (1, "t:1", False), (3, "t:2", False), (5, "t:1", False)]
    # the single-task form still works
    r = cli("enqueue", "docs", "--key", "t:3", "--priority", "2")
    assert r.returncode == 0 and r.stdout.strip().isdigit(), r.stderr
    assert tasks_of(db_url)[-1][:4] == ("t:3", "docs", None, 2)


def test_enqueue_from_a_file_with_tiers_profiles_and_budgets(cli: Any, db_url: str, tmp_path: Path) -> None:
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("""update fleet.lanes set config = '{"tiers": ["small", "large"]}' where name = 'docs'""")
        c.execute("insert into fleet.profiles (name) values ('opus')")
    (tmp_path / "tasks.jsonl").write_text(
        '{"key": "b:1", "tier": "large", "profile": "opus", "max_cost_usd": 1.25, "max_tokens": 5000}\n'
        '{"key": "b:2", "max_cost_usd": 3}\n')
    r = cli("enqueue", "--from", "tasks.jsonl", "--lane", "docs")
    assert r.returncode == 0, r.stderr
    with psycopg.connect(db_url) as c:
        got = c.execute("select key, tier, profile, max_cost_usd::float8, max_tokens from fleet.tasks order by id").fetchall()
    # (no tier named: the lane's default, its lowest here, as `fleet enqueue` of one task stores it)
    assert got == [("b:1", "large", "opus", 1.25, 5000), ("b:2", "small", None, 3.0, None)]
    # a tier the lane does not name is found by the database and named by the line
    (tmp_path / "more.jsonl").write_text('{"key": "b:3"}\n{"key": "b:4", "tier": "huge"}\n')
    r = cli("enqueue", "--from", "more.jsonl", "--lane", "docs")
    assert r.returncode == 1 and "more.jsonl line 2 (key 'b:4'): lane docs has no tier 'huge'" in r.stderr, r.stderr
    assert len(tasks_of(db_url)) == 2


def test_enqueue_from_stdin(cli: Any, db_url: str) -> None:
    r = cli("enqueue", "--from", "-", "-l", "review", stdin='{"key": "in:1", "run_at": "+10m"}\n{"key": "in:2"}\n')
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "2 created, 0 already existed"
    with psycopg.connect(db_url) as c:
        later = c.execute("select key, run_at > now() + interval '9 minutes' from fleet.tasks order by id").fetchall()
    assert later == [("in:1", True), ("in:2", False)]


@pytest.mark.parametrize(("content", "lane", "message"), [
    ('{"key": "b:1"}\n{"key": "b:2",\n', "docs", "tasks.jsonl line 2: not valid JSON"),
    ('{"key": "b:1"}\n\n{"title": "no key"}\n', "docs", "tasks.jsonl line 3: a task needs a \"key\""),
    ('{"key": "b:1"}\n["b:2"]\n', "docs", "tasks.jsonl line 2: a task must be a JSON object"),
    ('{"key": "b:1"}\n{"key": "b:2", "priority": "high"}\n', "docs", "tasks.jsonl line 2: \"priority\" must be an integer"),
    ('{"key": "b:1"}\n{"key": "b:2", "priority": true}\n', "docs", "tasks.jsonl line 2: \"priority\""),
    ('{"key": "b:1"}\n{"key": "b:2", "payload": [1]}\n', "docs", "tasks.jsonl line 2: \"payload\" must be a JSON object"),
    ('{"key": "b:1"}\n{"key": "b:2", "run_at": "tomorrow"}\n', "docs", "tasks.jsonl line 2: \"run_at\" 'tomorrow'"),
    ('{"key": "b:1"}\n{"key": "b:2", "colour": "red"}\n', "docs", "tasks.jsonl line 2: unknown field 'colour'"),
    ('{"key": "b:1", "lane": "docs"}\n{"key": "b:2"}\n', None, "tasks.jsonl line 2: no lane"),
    ('{"key": "b:1"}\n{"key": "b:2", "tier": 2}\n', "docs", "tasks.jsonl line 2: \"tier\" must be a string"),
    ('{"key": "b:1"}\n{"key": "b:2", "max_cost_usd": -1}\n', "docs", "tasks.jsonl line 2: \"max_cost_usd\" must be"),
    ('{"key": "b:1"}\n{"key": "b:2", "max_tokens": true}\n', "docs", "tasks.jsonl line 2: \"max_tokens\" must be"),
    # found by the database, named by the line: an unknown lane (one line checked only there)
    ('{"key": "b:1"}\n\n{"key": "b:2", "lane": "nope"}\n', "docs", "tasks.jsonl line 3 (key 'b:2'): unknown lane 'nope'"),
], ids=["json", "key", "array", "priority-type", "priority-bool", "payload", "run-at", "field", "no-lane",
        "tier-type", "cost", "tokens", "unknown-lane"])
def test_a_bad_line_queues_nothing(cli: Any, db_url: str, tmp_path: Path, content: str, lane: str | None,
                                   message: str) -> None:
    (tmp_path / "tasks.jsonl").write_text(content)
    r = cli("enqueue", "--from", "tasks.jsonl", *(["--lane", lane] if lane else []))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert message in r.stderr, r.stderr
    assert tasks_of(db_url) == []


def test_enqueue_from_refuses_single_task_options(cli: Any, db_url: str, tmp_path: Path) -> None:
    (tmp_path / "tasks.jsonl").write_text('{"key": "x:1"}\n')
    r = cli("enqueue", "docs", "--from", "tasks.jsonl", "--key", "x:2", "--priority", "3")
    assert r.returncode == 1 and "drop --key, --priority" in r.stderr, r.stderr
    r = cli("enqueue", "docs", "--from", "missing.jsonl")
    assert r.returncode == 1 and "cannot read missing.jsonl" in r.stderr, r.stderr
    r = cli("enqueue", "docs")
    assert r.returncode == 1 and "--key" in r.stderr, r.stderr
    assert tasks_of(db_url) == []


# ------------------------------------------------------------------------------------------------
# answers longer than PostgREST's db-max-rows (1,000 in the stack, as on Supabase): whole, on both


PAST_MAX_ROWS = 1500


def test_answers_past_the_apis_max_rows_are_whole_on_both_back_ends(backend: Backend) -> None:
    """PostgREST cuts a set of rows at db-max-rows without a word: enqueue_many of 1,500 answered
    1,000 (all 1,500 queued), list_tasks stopped at 1,000. Each call here answers as the psycopg
    store does: the writing ones in one call (complete_many, reconcile too), the reads page by page."""
    from sqlkit import expire

    from worker.store.sync import lane_settings

    n = PAST_MAX_ROWS
    direct = PostgresStore(backend.db_url)
    worker = backend.store(backend.key("worker", ["docs"]))
    operator = backend.store(backend.key("operator"))
    try:
        direct.sync_lane("docs", lane_settings(LaneConfig(command=["true"], stall_seconds=1, lease_seconds=3)))
        tasks = [{"key": f"m:{i}"} for i in range(n)]
        got = worker.enqueue_many("docs", tasks)
        assert len(got) == n and all(created for _, created in got)
        ids = [task_id for task_id, _ in got]
        assert ids == sorted(ids) and len(set(ids)) == n
        assert worker.enqueue_many("docs", tasks) == [(task_id, False) for task_id in ids]  # idempotent, in order
        assert [t.id for t in operator.list_tasks("docs", limit=1200)] == ids[::-1][:1200]
        assert len(operator.list_tasks("docs", limit=n + 10)) == n
        assert operator.query("states_with_prefix", prefix="m:") == [{"state": "queued", "n": n}]

        session = worker.open_session("docs", "h", 4242, None, 600)
        claimed: list[Task] = []
        while len(claimed) < n:  # a claim answers up to its limit (over the API: at most db-max-rows at once)
            batch = worker.claim(session, n - len(claimed))
            assert batch, f"nothing more to claim after {len(claimed)}"
            claimed += batch
        assert sorted(t.id for t in claimed) == ids
        if backend.rest:  # a writing function's answer cut all the same (one shift of 1,500 agents): said
            with pytest.raises(FleetError, match=r"fleet.heartbeat answered 15\d\d rows .* passed on only 1000"):
                worker.heartbeat(session)
        else:
            assert len(worker.heartbeat(session)) == n
        with psycopg.connect(backend.db_url, autocommit=True) as conn:
            conn.execute("update fleet.tasks set last_progress_at = now() - interval '1 minute'")
            stalled = operator.stalled_tasks()  # a read-only function: read on, page by page
            assert [r["task_id"] for r in stalled] == ids
            if backend.rest:  # a project whose Max rows is lower than the default: shorter pages
                assert backend.stack is not None
                with SupabaseStore(backend.stack.url, backend.stack.anon_key, backend.key("operator") or "",
                                   max_rows=400) as small:
                    assert [t.id for t in small.list_tasks("docs", limit=n)] == ids[::-1]
                    assert [r["task_id"] for r in small.stalled_tasks()] == ids

            finished = claimed[:1100]
            assert worker.complete_many([(t.id, t.lease_token) for t in finished]) == {  # type: ignore[misc]
                t.id: "done" for t in finished}
            left = sorted(t.id for t in claimed[1100:])
            # another session's 1,100 tasks go silent with it: one pass repairs them all
            other = worker.open_session("docs", "h2", 4243, None, 600)
            worker.enqueue_many("docs", [{"key": f"r:{i}"} for i in range(1100)])
            again: list[Task] = []
            while len(again) < 1100:
                again += worker.claim(other, 1100 - len(again))
            expire(conn, *left, *(t.id for t in again))
            # a lease counts as expired only once the server has been up that long (the stack's
            # server may have been restarted by the test before: then this pass repaired nothing)
            wait_for("the server to be up a lease", lambda: conn.execute(
                "select pg_postmaster_start_time() < now() - interval '3 s'").fetchone()[0])  # type: ignore[index]
        actions = operator.reconcile()
        repaired = sorted(a.task_id for a in actions if a.task_id is not None)
        assert repaired == sorted([*left, *(t.id for t in again)]), (len(repaired), len(left) + len(again))
    finally:
        for s in {id(s): s for s in (worker, operator, direct)}.values():
            s.close()


def test_enqueue_from_a_file_past_the_apis_max_rows_on_both_back_ends(backend: Backend, tmp_path: Path) -> None:
    """`fleet enqueue --from` of 1,500 lines said "1000 created", and with --json failed on its zip()
    after it had queued them all."""
    import os

    with PostgresStore(backend.db_url) as direct:
        direct.sync_lane("docs", {})
    (tmp_path / "fleet.toml").write_text(FLEET_TOML)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"key": f"f:{i}"}) + "\n" for i in range(PAST_MAX_ROWS)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") and k != "DATABASE_URL"}
    env.update(backend.env(backend.key("operator")), FLEET_CONFIG=str(tmp_path / "fleet.toml"), COLUMNS="200")

    def fleet(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "monitor.cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    first = fleet("enqueue", "docs", "--from", str(tasks))
    assert (first.returncode, first.stdout.strip()) == (0, f"{PAST_MAX_ROWS} created, 0 already existed"), first
    again = fleet("enqueue", "docs", "--from", str(tasks), "--json")
    assert again.returncode == 0, again.stderr
    answer = json.loads(again.stdout)
    assert (answer["created"], answer["existing"], len(answer["tasks"])) == (0, PAST_MAX_ROWS, PAST_MAX_ROWS)
    assert [t["line"] for t in answer["tasks"]] == list(range(1, PAST_MAX_ROWS + 1))
    assert len({t["id"] for t in answer["tasks"]}) == PAST_MAX_ROWS


def test_every_set_returning_function_is_read_whole_over_rest(conn: psycopg.Connection) -> None:
    """The Supabase store reads on, page by page, only functions that just read (a cut answer of one
    that writes cannot be had by calling it again); every set-returning function a key may call that
    writes answers one row, has a twin answering one value, or has an answer bounded by its caller."""
    from worker.store.supabase import PAGED_READS

    sets = {name: volatility for name, volatility in conn.execute("""
        select p.proname, p.provolatile from pg_proc p
         where p.pronamespace = 'fleet'::regnamespace and p.proretset and p.proname !~ '^_'
           and (has_function_privilege('fleet_worker', p.oid, 'execute')
                or has_function_privilege('fleet_operator', p.oid, 'execute'))""").fetchall()}
    assert PAGED_READS <= {name for name, volatility in sets.items() if volatility in ("s", "i")}, sets
    writes = {name for name, volatility in sets.items() if volatility == "v"}
    twins = {name.removesuffix("_json") for name, in conn.execute(
        "select proname from pg_proc where pronamespace = 'fleet'::regnamespace and proname like '%\\_json'")}
    one_row = {"enqueue_task", "enqueue_after"}
    # a claim asks for at most max_rows; a heartbeat, a session declared lost and the tasks a lost
    # claim answer left unseen (claimed) answer per task of one shift (its slots), source_sync per
    # item of one page (worker.sources.passes.SYNC_PAGE)
    bounded = {"claim", "claimed", "heartbeat", "declare_session_lost", "source_sync"}
    assert writes - twins - one_row - bounded == set(), "a writing set-returning function the store would cut"
