"""GitHub issues as the fleet's source (issue #21): a source's pass against the loopback GitHub of
tests/github_api/ (every request and answer checked against GitHub's OpenAPI description), on a
real database, with real shifts running the scripted agent where a scenario needs one.

Scenarios: labelled issues become tasks of their lanes; a second host's pass creates nothing
twice; an unchanged pass costs only 304s; rate limits are waited out (or the pass stops and no host
asks before the reset); an issue closed, unlabelled or reopened outside the fleet is acted on in
one pass (a running agent stops within one heartbeat); write-backs are never posted twice across a
crash; the CI loop (PR opened, a failure back to the agent with its log tail, the fix green); a
merge outside the fleet ends the task, and a revert within 7 days counts as a regression.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fleetkit import AGENT, Backend, Fleet, lane_defaults, wait_for
from github_api.stand_in import GitHubStandIn

from worker.config import load_config
from worker.errors import ConfigError
from worker.sources.github import GitHub
from worker.sources.passes import PassReport, run_pass
from worker.sources.tracker import SourceError
from worker.store.postgres import PostgresStore

REPO = "acme/widgets"
TOKEN_ENV = "LANEFLEET_TEST_GITHUB_TOKEN"


def source_table(gh: GitHubStandIn, **overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"repository": REPO, "api_url": gh.url, "token_env": TOKEN_ENV,
                            "labels": {"fleet:bugfix": "bugfix", "fleet:docs": "docs"},
                            "priority": {"p0": 100, "p1": 50}, "max_rate_wait": "10s"}
    base.update(overrides)
    return base


class World:
    """A fleet whose lanes a GitHub source feeds, and the stand-in it reads."""

    def __init__(self, backend: Backend, tmp: Path, gh: GitHubStandIn, lanes: dict[str, dict[str, Any]],
                 **source: Any) -> None:
        self.gh = gh
        gh.add_repo(REPO, git_dir=source.pop("git_dir", None))
        self.fleet = Fleet(backend, tmp, lanes, tables={"sources": {"gh": source_table(gh, **source)}})
        self.environ = {TOKEN_ENV: gh.token}

    def sync(self, store: PostgresStore | None = None) -> PassReport:
        report = run_pass(store or self.fleet.monitor_store, self.fleet.cfg, "gh", environ=self.environ)
        assert report.error is None, report.error
        return report

    def task_of(self, number: int) -> dict[str, Any]:
        rows = self.fleet.sql("select t.* from fleet.tasks t join fleet.source_items i on i.task_id = t.id"
                              " where i.ref = %s", (f"{REPO}#{number}",))
        assert rows, f"no task for issue #{number}"
        return rows[0]

    def item(self, number: int) -> dict[str, Any]:
        return self.fleet.sql("select * from fleet.source_items where ref = %s", (f"{REPO}#{number}",))[0]

    def events(self, task_id: int, kind: str) -> list[dict[str, Any]]:
        return [r["detail"] for r in self.fleet.sql(
            "select detail from fleet.journal where task_id = %s and kind = %s order by id", (task_id, kind))]


@pytest.fixture
def world(db_url: str, tmp_path: Path, github: GitHubStandIn) -> Iterator[World]:
    w = World(Backend("postgres", db_url), tmp_path, github,
              {"bugfix": lane_defaults(), "docs": lane_defaults()})
    yield w
    w.fleet.close()


# ------------------------------------------------------------------------------------------------
# issues in


def test_labelled_open_issues_become_tasks_of_their_lanes_with_the_issue_in_payload_and_prompt(
        world: World) -> None:
    gh = world.gh
    bug = gh.add_issue(REPO, "Widget crashes on empty input", "Steps: call widget('').", ["fleet:bugfix", "p0"])
    doc = gh.add_issue(REPO, "Document the widget", "", ["fleet:docs"])
    gh.add_issue(REPO, "A question, not work", "", ["question"])
    closed = gh.add_issue(REPO, "Already fixed", "", ["fleet:bugfix"])
    gh.close_issue(REPO, closed)

    report = world.sync()
    assert report.actions["created"] == 2
    t = world.task_of(bug)
    assert (t["lane"], t["key"], t["title"], t["priority"]) == (
        "bugfix", f"github:{REPO}#{bug}", "Widget crashes on empty input", 100)
    assert t["payload"]["body"] == "Steps: call widget('')." and t["payload"]["labels"] == ["fleet:bugfix", "p0"]
    assert t["payload"]["url"].endswith(f"/issues/{bug}")
    assert world.task_of(doc)["lane"] == "docs"
    assert len(world.fleet.sql("select * from fleet.tasks")) == 2  # the question and the closed one: none

    from worker.workspace.folder import build_prompt

    prompt = build_prompt(world.fleet.direct.get_task(t["id"]), "instructions", None)
    assert "Widget crashes on empty input" in prompt and "Steps: call widget('')." in prompt


def test_assignee_and_milestone_filters_select_only_matching_issues(db_url: str, tmp_path: Path,
                                                                   github: GitHubStandIn) -> None:
    w = World(Backend("postgres", db_url), tmp_path, github, {"bugfix": lane_defaults(), "docs": lane_defaults()},
              assignee="octobot", milestone="v2")
    try:
        mine = github.add_issue(REPO, "mine", "", ["fleet:bugfix"], assignee="octobot", milestone="v2")
        github.add_issue(REPO, "someone else's", "", ["fleet:bugfix"], assignee="hubot", milestone="v2")
        github.add_issue(REPO, "another milestone", "", ["fleet:bugfix"], assignee="octobot", milestone="v3")
        assert w.sync().actions["created"] == 1
        assert [r["key"] for r in w.fleet.sql("select key from fleet.tasks")] == [f"github:{REPO}#{mine}"]
    finally:
        w.fleet.close()


def test_two_hosts_syncing_at_once_create_each_task_once(world: World) -> None:
    numbers = [world.gh.add_issue(REPO, f"bug {n}", "", ["fleet:bugfix"]) for n in range(12)]
    stores = [PostgresStore(world.fleet.db_url, max_size=2) for _ in range(2)]
    reports: list[PassReport] = []
    start = threading.Barrier(2)

    def host(store: PostgresStore) -> None:
        start.wait()
        reports.append(world.sync(store))

    threads = [threading.Thread(target=host, args=(s,)) for s in stores]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for s in stores:
        s.close()
    assert len(reports) == 2
    assert sum(r.actions["created"] for r in reports) == 12
    keys = [r["key"] for r in world.fleet.sql("select key from fleet.tasks order by key")]
    assert sorted(keys) == sorted(f"github:{REPO}#{n}" for n in numbers)


def test_an_unchanged_pass_costs_only_304s_and_a_change_is_read(world: World) -> None:
    gh = world.gh
    gh.add_issue(REPO, "one", "", ["fleet:bugfix"])
    gh.add_issue(REPO, "two", "", ["fleet:docs"])
    world.sync()
    world.sync()  # the first pass after the first: everything updated since the cursor (no label filter)
    before = len(gh.requests)
    report = world.sync()
    quiet = gh.requests[before:]
    assert quiet and all(r.status == 304 and r.conditional for r in quiet), quiet
    assert report.traffic.not_modified == len(quiet) and report.traffic.requests == len(quiet)
    assert not report.actions.get("created")
    remaining = gh.rate_remaining()
    world.sync()
    assert gh.rate_remaining() == remaining  # 304s cost no rate limit

    three = gh.add_issue(REPO, "three", "", ["fleet:bugfix"])
    assert world.sync().actions["created"] == 1
    assert world.task_of(three)["title"] == "three"


def test_the_cache_keeps_only_what_the_last_pass_asked_for(world: World) -> None:
    """Each pass asks for issues updated since a cursor that moves: an answer about a cursor passed
    (an issue's body in it) is never asked for again, and is not kept. A pass that stopped keeps
    what it did not get to."""
    gh = world.gh
    n = gh.add_issue(REPO, "big", "x" * 20_000, ["fleet:docs"])
    world.sync()
    for k in range(8):
        gh.set_labels(REPO, n, ["fleet:docs"] + (["p1"] if k % 2 else []))
        world.sync()
    world.sync()  # the first pass from the last change's cursor

    def cache() -> dict[str, Any]:
        return dict(world.fleet.sql("select cache from fleet.sources where name = 'gh'")[0]["cache"])

    kept = cache()
    assert len(kept) == 1 and "since=" in next(iter(kept)), list(kept)  # this cursor's listing alone
    before = len(gh.requests)
    world.sync()
    assert [r.status for r in gh.requests[before:]] == [304]  # and it still answers a quiet pass

    gh.exhaust(reset_in=600)  # a pass that stops at its first request: the cache stays whole
    assert run_pass(world.fleet.monitor_store, world.fleet.cfg, "gh", environ=world.environ).error
    assert cache() == kept


class EditsAfterTheFirstPage(GitHub):
    """A person edits the first issue listed while the pass reads the listing's first page."""

    def __init__(self, gh: GitHubStandIn, number: int) -> None:
        super().__init__(REPO, gh.token, api_url=gh.url)
        self.gh, self.number, self.pages = gh, number, 0

    def _get(self, url: str, keep: Any, what: str, **kw: Any) -> Any:
        got = super()._get(url, keep, what, **kw)
        self.pages += 1
        if self.pages == 1:
            self.gh.set_labels(REPO, self.number, ["fleet:bugfix", "p1"])
        return got


@pytest.mark.parametrize("first_pass", [False, True])
def test_an_issue_edited_while_the_pages_are_read_skips_none(github: GitHubStandIn, first_pass: bool) -> None:
    """Sorted by updated_at, an issue edited between two pages moves to the end: with GitHub's page
    numbers the issue that was first on page 2 would slide onto page 1, never read, and the cursor
    would pass it. Each next page is the listing since the last updated_at read (inclusive)."""
    github.add_repo(REPO)
    numbers = [github.add_issue(REPO, f"i{k}", "", ["fleet:bugfix"]) for k in range(150)]
    since = None if first_pass else datetime.now(UTC) - timedelta(days=1)
    items, cursor = EditsAfterTheFirstPage(github, numbers[0]).changed_items(since, ["fleet:bugfix"])
    assert sorted(i.number for i in items) == numbers
    edited = next(i for i in items if i.number == numbers[0])
    assert "p1" in edited.labels and cursor == edited.updated_at  # read as it is now, last

    quiet = GitHub(REPO, github.token, api_url=github.url)
    again, _ = quiet.changed_items(since, ["fleet:bugfix"])
    assert sorted(i.number for i in again) == numbers
    asked = len(github.requests)
    cached = GitHub(REPO, github.token, api_url=github.url, cache=quiet.cache)
    assert sorted(i.number for i in cached.changed_items(since, ["fleet:bugfix"])[0]) == numbers
    assert {r.status for r in github.requests[asked:]} == {304}  # each page's URL the same each pass


def test_a_spent_rate_limit_is_waited_for_until_its_reset(world: World) -> None:
    world.gh.add_issue(REPO, "one", "", ["fleet:bugfix"])
    world.gh.exhaust(reset_in=2)
    started = time.monotonic()
    report = world.sync()
    assert report.actions["created"] == 1
    assert report.traffic.waited_seconds > 0 and time.monotonic() - started >= 1


def test_a_reset_past_the_wait_stops_the_pass_and_no_host_asks_before_it(world: World) -> None:
    world.gh.add_issue(REPO, "one", "", ["fleet:bugfix"])
    world.gh.exhaust(reset_in=600)
    report = run_pass(world.fleet.monitor_store, world.fleet.cfg, "gh", environ=world.environ)
    assert report.error and "may be asked again" in report.error and report.resume_at is not None
    row = world.fleet.sql("select resume_at, last_error from fleet.sources where name = 'gh'")[0]
    assert row["resume_at"] is not None and "rate limit" in row["last_error"]
    before = len(world.gh.requests)
    again = run_pass(PostgresStore(world.fleet.db_url, max_size=1), world.fleet.cfg, "gh", environ=world.environ)
    assert again.skipped and "rate-limited" in again.skipped
    assert len(world.gh.requests) == before  # no request at all


def test_a_secondary_limit_waits_its_retry_after(world: World) -> None:
    world.gh.add_issue(REPO, "one", "", ["fleet:bugfix"])
    world.gh.secondary_limit(retry_after=1)
    report = world.sync()
    assert report.actions["created"] == 1 and report.traffic.waited_seconds >= 0.5


# ------------------------------------------------------------------------------------------------
# external advance


def test_closed_unlabelled_and_reopened_issues_advance_their_tasks_in_one_pass(world: World) -> None:
    gh = world.gh
    a = gh.add_issue(REPO, "a", "", ["fleet:bugfix"])
    b = gh.add_issue(REPO, "b", "", ["fleet:bugfix"])
    world.sync()
    gh.close_issue(REPO, a)
    gh.set_labels(REPO, b, ["wontfix"])
    assert world.sync().actions["cancelled"] == 2
    ta, tb = world.task_of(a), world.task_of(b)
    assert ta["state"] == tb["state"] == "cancelled"
    assert world.events(ta["id"], "external_advance")[-1]["reason"] == "closed"
    assert world.events(tb["id"], "external_advance")[-1]["reason"] == "unselected"

    gh.reopen_issue(REPO, a)
    assert world.sync().actions["requeued"] == 1
    ta = world.task_of(a)
    assert ta["state"] == "queued" and ta["id"] == world.task_of(a)["id"]
    assert [e["reason"] for e in world.events(ta["id"], "external_advance")] == ["closed", "reopened"]


def test_an_issue_closed_mid_run_frees_its_slot_at_once_and_stops_the_agent_within_one_heartbeat(
        backend: Backend, tmp_path: Path, github: GitHubStandIn) -> None:
    """The seed failure: an issue closed outside the scheduler whose slot stayed taken for hours."""
    world = World(backend, tmp_path, github, {"bugfix": lane_defaults(), "docs": lane_defaults()})
    try:
        _closed_mid_run(world)
    finally:
        world.fleet.close()


def _closed_mid_run(world: World) -> None:
    gh = world.gh
    n = gh.add_issue(REPO, "long work", "", ["fleet:bugfix"])
    world.sync()
    task = world.task_of(n)
    world.fleet.sql("update fleet.tasks set payload = payload || '{\"steps\": 200, \"sleep\": 0.1}' where id = %s",
                    (task["id"],))
    shift = world.fleet.shift("bugfix", max_seconds=60)
    summary: list[Any] = []
    thread = threading.Thread(target=lambda: summary.append(shift.run()))
    thread.start()
    wait_for("the agent running", lambda: world.fleet.task(task["id"])["state"] == "running"
             and world.fleet.sql("select 1 from fleet.journal where task_id = %s and kind = 'checkpoint'",
                                 (task["id"],)), timeout=20)
    gh.close_issue(REPO, n)
    world.sync()
    closed_at = time.monotonic()
    assert world.fleet.task(task["id"])["state"] == "cancelled"
    running = world.fleet.sql("select count(*) as n from fleet.tasks where lane = 'bugfix' and state = 'running'")
    assert running[0]["n"] == 0  # the slot is free now
    thread.join(30)
    assert not thread.is_alive()
    heartbeat = world.fleet.cfg.lanes["bugfix"].lease_seconds  # a shift heartbeats well within its lease
    assert time.monotonic() - closed_at < heartbeat + 2
    assert world.fleet.runs(task["id"])[-1]["outcome"] == "cancelled"
    assert summary and summary[0].outcomes.get("cancelled") == 1, summary


# ------------------------------------------------------------------------------------------------
# write-back


def finish(world: World, number: int) -> dict[str, Any]:
    summary = world.fleet.run_shift("bugfix", max_tasks=1)
    assert summary.claimed == 1
    return world.task_of(number)


def test_claim_label_then_done_comment_posted_once_with_tokens_and_cost(world: World) -> None:
    gh = world.gh
    n = gh.add_issue(REPO, "small fix", "", ["fleet:bugfix"])
    world.sync()
    task = world.task_of(n)
    token = world.fleet.store.claim(world.fleet.store.open_session("bugfix", "h", 1, None, 60), 1)
    assert token and token[0].id == task["id"]
    world.sync()
    assert "fleet:running" in gh.labels_of(REPO, n)
    world.fleet.store.complete(task["id"], token[0].lease_token, {"summary": "Guarded the empty input."})
    world.sync()
    world.sync()
    comments = gh.comments_of(REPO, n)
    assert len(comments) == 1 and "Guarded the empty input." in comments[0] and "cost" in comments[0]
    assert "fleet:running" not in gh.labels_of(REPO, n)


class CrashAfterPost(GitHub):
    """A pass that dies right after GitHub took its comment, before the database recorded it."""

    def post_comment(self, number: int, body: str) -> int:
        super().post_comment(number, body)
        raise KeyboardInterrupt("the host died")


def test_a_comment_is_never_posted_twice_across_a_crash_and_a_retry(world: World) -> None:
    gh = world.gh
    n = gh.add_issue(REPO, "fatal", "", ["fleet:bugfix"])
    world.sync()
    task = world.task_of(n)
    world.fleet.sql("update fleet.tasks set payload = payload || '{\"mode\": \"fail\"}', max_attempts = 1"
                    " where id = %s", (task["id"],))
    assert finish(world, n)["state"] == "dead"
    begun = world.fleet.monitor_store.source_call("source_begin", {"p_source": "gh", "p_kind": "github",
                                                                   "p_lanes": ["bugfix", "docs"]})
    crashing = CrashAfterPost(REPO, gh.token, api_url=gh.url, cache=begun["cache"])
    with pytest.raises(KeyboardInterrupt):
        run_pass(world.fleet.monitor_store, world.fleet.cfg, "gh", tracker=crashing)
    assert len(gh.comments_of(REPO, n)) == 1  # posted, not recorded
    report = world.sync()
    world.sync()
    comments = gh.comments_of(REPO, n)
    assert len(comments) == 1 and report.actions["comments found"] == 1
    assert "gave up" in comments[0] and "fleet:needs-attention" in gh.labels_of(REPO, n)
    posts = world.item(n)["posts"]
    assert any(k.startswith("dead:") for k in posts)


# ------------------------------------------------------------------------------------------------
# config


def test_the_sources_token_never_reaches_an_agent_and_a_ci_lane_needs_a_source(tmp_path: Path) -> None:
    toml = tmp_path / "fleet.toml"
    toml.write_text(f"""
[lanes.bugfix]
command = {AGENT!r}
agent_env = ["GITHUB_TOKEN"]
[sources.gh]
repository = "acme/widgets"
labels = {{ "fleet:bugfix" = "bugfix" }}
""".replace("'", '"'))
    with pytest.raises(ConfigError, match=r"lanes\.bugfix\.agent_env: GITHUB_TOKEN is source gh's token"):
        load_config(toml)
    toml.write_text(f"""
[lanes.bugfix]
command = {AGENT!r}
repo = "/tmp/nowhere"
ci = true
""".replace("'", '"'))
    with pytest.raises(ConfigError, match=r"lanes\.bugfix\.ci: no source feeds the lane"):
        load_config(toml)
    toml.write_text(f"""
[lanes.bugfix]
command = {AGENT!r}
[sources.gh]
repository = "acme/widgets"
labels = {{ "fleet:bugfix" = "bugfx" }}
""".replace("'", '"'))
    with pytest.raises(ConfigError, match=r"sources\.gh\.labels: label 'fleet:bugfix' names lane 'bugfx'"):
        load_config(toml)


def test_fleet_sources_sync_says_one_line_and_never_prints_the_token(world: World) -> None:
    world.gh.add_issue(REPO, "one", "", ["fleet:bugfix"])
    env = world.fleet.env("operator")
    missing = world.fleet.cli("sources", "sync", env=env)
    assert missing.returncode == 1
    assert f"no token: set {TOKEN_ENV}" in missing.stdout + missing.stderr
    env[TOKEN_ENV] = world.gh.token
    ok = world.fleet.cli("sources", "sync", env=env)
    assert ok.returncode == 0, ok.stderr
    assert "source gh: 1 item(s) read, 1 created" in ok.stdout
    assert world.gh.token not in ok.stdout + ok.stderr
    unknown = world.fleet.cli("sources", "sync", "nope", env=env)
    assert unknown.returncode == 1 and "unknown source 'nope'" in unknown.stderr


def test_the_monitor_pass_runs_the_sources(world: World) -> None:
    n = world.gh.add_issue(REPO, "one", "", ["fleet:bugfix"])
    env = world.fleet.env("operator") | {TOKEN_ENV: world.gh.token}
    out = world.fleet.cli("monitor", "--once", "--json", "--no-local", env=env)
    assert out.returncode == 0, out.stderr
    actions = json.loads(out.stdout)
    (synced,) = [a for a in actions if a["action"] == "source_synced"]
    assert synced["detail"]["source"] == "gh" and synced["detail"]["created"] == 1
    assert world.task_of(n)["state"] == "queued"
    quiet = world.fleet.cli("monitor", "--once", "--json", "--no-local", env=env)
    assert not [a for a in json.loads(quiet.stdout) if a["action"].startswith("source")]  # nothing new: no line
    world.gh.exhaust(reset_in=3600)
    world.gh.add_issue(REPO, "two", "", ["fleet:bugfix"])
    world.fleet.sql("update fleet.sources set cursor = cursor - interval '1 hour'")  # something to read
    stopped = world.fleet.cli("monitor", "--once", "--json", "--no-local", env=env)
    assert stopped.returncode == 0, stopped.stderr  # the repairs still ran; the source says why it stopped
    (failed,) = [a for a in json.loads(stopped.stdout) if a["action"] == "source_failed"]
    assert "rate limit" in failed["detail"]["summary"]


def test_an_issue_that_cannot_be_a_task_is_refused_and_the_others_go_on(db_url: str, tmp_path: Path,
                                                                       github: GitHubStandIn) -> None:
    w = World(Backend("postgres", db_url), tmp_path, github,
              {"bugfix": lane_defaults(max_payload_bytes=2000), "docs": lane_defaults()})
    try:
        huge = github.add_issue(REPO, "a log pasted whole", "x" * 5000, ["fleet:bugfix"])
        fine = github.add_issue(REPO, "a short one", "", ["fleet:bugfix"])
        report = run_pass(w.fleet.monitor_store, w.fleet.cfg, "gh", environ=w.environ)
        assert report.error is None and report.actions["created"] == 1 and report.actions["refused"] == 1
        assert f"{REPO}#{huge}: payload is" in report.line() and "max_payload_bytes" in report.line()
        assert w.task_of(fine)["state"] == "queued"
        assert w.item(huge)["task_id"] is None
        github.set_labels(REPO, huge, ["fleet:docs"])  # re-labelled: a lane that takes it
        assert run_pass(w.fleet.monitor_store, w.fleet.cfg, "gh", environ=w.environ).actions["created"] == 1
        assert w.task_of(huge)["lane"] == "docs" and w.item(huge)["lane"] == "docs"
    finally:
        w.fleet.close()


def test_a_token_never_crosses_the_network_in_clear_text(tmp_path: Path) -> None:
    toml = tmp_path / "fleet.toml"
    toml.write_text(f"""
[lanes.bugfix]
command = {AGENT!r}
[sources.gh]
repository = "acme/widgets"
api_url = "http://github.example.com/api/v3"
labels = {{ "fleet:bugfix" = "bugfix" }}
""".replace("'", '"'))
    with pytest.raises(ConfigError, match=r"sources\.gh\.api_url: .*clear text; use https"):
        load_config(toml)


# ------------------------------------------------------------------------------------------------
# one item's trouble is that item's


def test_issues_deleted_or_transferred_after_their_tasks_are_gone_and_the_others_written_back(
        world: World) -> None:
    gh = world.gh
    gh.add_repo("acme/elsewhere")
    deleted, moved, kept = (gh.add_issue(REPO, title, "", ["fleet:bugfix"]) for title in ("d", "m", "k"))
    world.sync()
    assert world.fleet.run_shift("bugfix", max_tasks=3).claimed == 3
    gh.delete_issue(REPO, deleted)  # by an admin: GitHub answers 410
    gh.transfer_issue(REPO, moved, "acme/elsewhere")  # to a repository of its own

    report = world.sync()
    assert not report.item_errors and report.actions["gone"] == 2, report.line()
    (comment,) = gh.comments_of(REPO, kept)
    assert "finished task" in comment
    assert world.item(deleted)["gone_reason"] == "410: deleted" and world.item(moved)["gone_at"] is not None
    for n in (deleted, moved):
        task = world.task_of(n)
        assert task["state"] == "done"  # finished: it stays so
        assert world.events(task["id"], "source_item_gone")[-1]["ref"] == f"{REPO}#{n}"
    assert world.fleet.sql("select last_error from fleet.sources")[0]["last_error"] is None

    before = len(gh.requests)
    world.sync()  # never asked about again
    asked = {r.path for r in gh.requests[before:]}
    assert not any(f"/issues/{n}/" in p or p.endswith(f"/issues/{n}") for n in (deleted, moved) for p in asked), asked


def test_an_issue_transferred_while_its_task_runs_cancels_it(world: World) -> None:
    gh = world.gh
    gh.add_repo("acme/elsewhere")
    n = gh.add_issue(REPO, "moving", "", ["fleet:bugfix"])
    world.sync()
    task = world.task_of(n)
    (claimed,) = world.fleet.store.claim(world.fleet.store.open_session("bugfix", "h", 1, None, 60), 1)
    assert claimed.id == task["id"]
    gh.transfer_issue(REPO, n, "acme/elsewhere")  # its claim label gets GitHub's 301
    report = world.sync()
    assert report.actions["gone"] == 1 and not report.item_errors, report.line()
    assert world.task_of(n)["state"] == "cancelled"
    gone = world.events(task["id"], "external_advance")[-1]
    assert gone["reason"] == "gone" and gone["why"].startswith("301: transferred to ") and gone["was"] == "running"
    assert world.item(n)["gone_reason"] == gone["why"]


class FailsFor(GitHub):
    """GitHub failing every request about one issue (a 502 of its own)."""

    failing = 0

    def comments(self, number: int) -> list[tuple[int, str]]:
        if number == self.failing:
            raise SourceError(f"{self.what}: list the comments of #{number}: GitHub answered 502 Bad Gateway")
        return super().comments(number)


def test_one_items_error_is_named_and_the_pass_goes_on_then_tries_it_again(world: World) -> None:
    gh = world.gh
    bad, good = gh.add_issue(REPO, "bad", "", ["fleet:bugfix"]), gh.add_issue(REPO, "good", "", ["fleet:bugfix"])
    world.sync()
    assert world.fleet.run_shift("bugfix", max_tasks=2).claimed == 2
    later = gh.add_issue(REPO, "later", "", ["fleet:docs"])
    begun = world.fleet.monitor_store.source_call("source_begin", {"p_source": "gh", "p_kind": "github",
                                                                   "p_lanes": ["bugfix", "docs"]})
    failing = FailsFor(REPO, gh.token, api_url=gh.url, cache=begun["cache"], what="source gh")
    failing.failing = bad
    report = run_pass(world.fleet.monitor_store, world.fleet.cfg, "gh", tracker=failing)
    assert report.error is None and report.actions["created"] == 1  # the sync step ran
    assert report.item_errors == [f"{REPO}#{bad}: source gh: list the comments of #{bad}: GitHub answered 502 Bad Gateway"]
    assert f"1 item(s) failed: {REPO}#{bad}: list the comments of #{bad}" in report.line()
    assert world.task_of(later)["state"] == "queued" and len(gh.comments_of(REPO, good)) == 1
    assert not gh.comments_of(REPO, bad)
    assert f"{REPO}#{bad}" in world.fleet.sql("select last_error from fleet.sources")[0]["last_error"]

    assert not world.sync().item_errors  # GitHub answers again: the next pass writes it back
    assert len(gh.comments_of(REPO, bad)) == 1 and len(gh.comments_of(REPO, good)) == 1
    assert world.fleet.sql("select last_error from fleet.sources")[0]["last_error"] is None
