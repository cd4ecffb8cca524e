"""The CI loop of a lane fed by a GitHub source (issue #21): issue → task → agent → branch → pull
request → checks → done, or back to the agent with the failing checks' log tails, or blocked for a
person; a merge outside the fleet ends the task, and its revert within 7 days is a regression. On
both store back-ends, against the loopback GitHub (tests/github_api/) whose pull requests read the
task branches the shifts push to a real bare repository."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fleetkit import AGENT, Backend, lane_defaults
from github_api.stand_in import GitHubStandIn
from gitkit import bare_origin, git
from test_github_source import REPO, World

from worker.errors import InvalidInput
from worker.sources.github import GitHub
from worker.workspace.git import branch_name

FAILED_LOG = ("============ FAILURES ============\n"
              "FAILED tests/test_widget.py::test_empty - AssertionError: widget('') raised ValueError\n"
              "============ 1 failed, 41 passed in 2.31s ============\n")


def ci_lanes(origin: Path, **bugfix: Any) -> dict[str, dict[str, Any]]:
    script = "commit=fix.txt,steps=1,sleep=0.05"
    return {"bugfix": lane_defaults(command=[*AGENT, "--script", script], repo=str(origin), ci=True, **bugfix),
            "docs": lane_defaults()}


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    return bare_origin(tmp_path)


def head(origin: Path, branch: str) -> str:
    return git("--git-dir", str(origin), "rev-parse", branch)


def to_ci(w: World, number: int) -> dict[str, Any]:
    """The agent's attempt: its exit 0 leaves the task waiting in ci, its branch pushed."""
    summary = w.fleet.run_shift("bugfix", max_tasks=1)
    assert summary.claimed == 1, summary
    task = w.task_of(number)
    assert task["state"] == "ci", (task["state"], task["last_error"])
    assert w.fleet.sql("select count(*) as n from fleet.tasks where state = 'running'")[0]["n"] == 0
    return task


def test_issue_to_done_through_a_red_then_green_ci(backend: Backend, tmp_path: Path, origin: Path,
                                                   github: GitHubStandIn) -> None:
    w = World(backend, tmp_path, github, ci_lanes(origin), git_dir=origin)
    try:
        n = github.add_issue(REPO, "widget('') raises", "It should return ''.", ["fleet:bugfix"])
        w.sync()
        task = to_ci(w, n)
        branch = branch_name("bugfix", task["key"])
        first = head(origin, branch)

        report = w.sync()  # its pull request opened; no checks yet: it waits
        assert report.actions["pull requests opened"] == 1
        (pr,) = github.pulls_of(REPO).values()
        assert pr.head == branch and w.item(n)["pr_number"] == pr.number
        assert w.task_of(n)["state"] == "ci"

        github.set_checks(REPO, first, [{"name": "tests", "conclusion": "failure", "log": FAILED_LOG},
                                        {"name": "lint", "conclusion": "success", "log": "All checks passed!"}])
        assert w.sync().actions["ci failure"] == 1
        task = w.task_of(n)
        assert task["state"] == "queued"
        assert "tests" in task["ci_feedback"] and "AssertionError: widget('') raised ValueError" in task["ci_feedback"]
        assert "lint" not in task["ci_feedback"].split("\n")[0].split(": ", 1)[1]
        assert w.events(task["id"], "ci_failed")[-1]["fix"] == 1

        to_ci(w, n)  # the agent is told, and pushes a fix
        prompt = (w.fleet.workspace("bugfix", task["key"]) / ".fleet" / "prompt.md").read_text()
        assert "CI failed on your pull request" in prompt and "widget('') raised ValueError" in prompt
        second = head(origin, branch)
        assert second != first
        assert "fix what CI reported" in git("--git-dir", str(origin), "log", "-2", "--format=%s", branch)

        assert w.sync().actions.get("ci success", 0) == 0  # the new head has no checks yet
        github.set_checks(REPO, second, [{"name": "tests", "conclusion": "success", "log": "42 passed"},
                                         {"name": "lint", "conclusion": "success", "log": "ok"}])
        assert w.sync().actions["ci success"] == 1
        task = w.task_of(n)
        assert task["state"] == "done" and task["ci_feedback"] is None
        ci = w.item(n)["ci"]
        assert ci[first] == {"runs": 1, "verdict": "failure"} and ci[second] == {"runs": 1, "verdict": "success"}
        comments = github.comments_of(REPO, n)
        assert len(comments) == 1 and f"/pull/{pr.number}" in comments[0]

        # merged by a person; reverted two days later: the task's regression
        merge = github.merge_pull(REPO, pr.number)
        w.sync()
        assert w.item(n)["merged_sha"] == merge
        github.add_commit(REPO, "main", f"Revert \"widget('') raises\"\n\nThis reverts commit {merge}.")
        assert w.sync().actions["regressions"] == 1
        assert w.item(n)["reverted_at"] is not None
        assert w.events(task["id"], "regression")[-1]["merged_sha"] == merge
        w.sync()
        assert len(github.comments_of(REPO, n)) == 1

        # the cohort figures: one task with a PR, two CI executions over two cycles, one regression
        (cohort,) = w.fleet.sql("select * from fleet.cohort_metrics(now() - interval '1 hour', now() + interval '1 hour')")
        assert (cohort["ci_tasks"], cohort["ci_executions"], cohort["ci_cycles"], cohort["regressions"]) == (1, 2, 2, 1)
        assert cohort["ci_executions_per_task"] == 2
        if not backend.rest:  # (`fleet stats` reads the database itself)
            stats = w.fleet.cli("stats")
            assert stats.returncode == 0, stats.stderr
            assert "from sources" in stats.stdout and "regressions" in stats.stdout
    finally:
        w.fleet.close()


def test_ci_that_keeps_failing_blocks_the_task_for_a_person(db_url: str, tmp_path: Path, origin: Path,
                                                            github: GitHubStandIn) -> None:
    w = World(Backend("postgres", db_url), tmp_path, github, ci_lanes(origin, max_ci_fixes=0), git_dir=origin)
    try:
        n = github.add_issue(REPO, "flaky widget", "", ["fleet:bugfix"])
        w.sync()
        task = to_ci(w, n)
        w.sync()
        github.set_checks(REPO, head(origin, branch_name("bugfix", task["key"])),
                          [{"name": "tests", "conclusion": "failure", "log": FAILED_LOG}])
        w.sync()
        task = w.task_of(n)
        assert (task["state"], task["block_reason"]) == ("blocked", "ci-failed")
        w.sync()
        (comment,) = github.comments_of(REPO, n)
        assert "needs a person" in comment and "widget('') raised ValueError" in comment
        assert "fleet:needs-attention" in github.labels_of(REPO, n)
    finally:
        w.fleet.close()


def test_a_pull_request_merged_outside_the_fleet_ends_its_task(db_url: str, tmp_path: Path, origin: Path,
                                                               github: GitHubStandIn) -> None:
    w = World(Backend("postgres", db_url), tmp_path, github, ci_lanes(origin), git_dir=origin)
    try:
        n = github.add_issue(REPO, "merge me", "", ["fleet:bugfix"])
        w.sync()
        task = to_ci(w, n)
        w.sync()
        (pr,) = github.pulls_of(REPO).values()
        merge = github.merge_pull(REPO, pr.number)  # no checks waited for: a person merged it
        w.sync()
        task = w.task_of(n)
        assert task["state"] == "done" and task["result"]["merged_sha"] == merge
        assert w.events(task["id"], "external_advance")[-1]["reason"] == "merged"
        # the merge closed the issue too: read after the merge, it cancels nothing
        assert not w.events(task["id"], "cancelled")
    finally:
        w.fleet.close()


def test_an_issue_reopened_after_its_merge_is_judged_on_a_new_pull_request(db_url: str, tmp_path: Path,
                                                                            origin: Path,
                                                                            github: GitHubStandIn) -> None:
    """The merge that closed it does not end the reopened task again: its pull request is let go
    (named in the reopen's event), the next attempt opens its own, and nothing is posted twice."""
    w = World(Backend("postgres", db_url), tmp_path, github, ci_lanes(origin), git_dir=origin)
    try:
        n = github.add_issue(REPO, "merge me", "", ["fleet:bugfix"])
        w.sync()
        task = to_ci(w, n)
        w.sync()
        (old,) = github.pulls_of(REPO).values()
        merge = github.merge_pull(REPO, old.number)
        github.close_issue(REPO, n)  # by its "Fixes #n"
        w.sync()
        assert w.task_of(n)["state"] == "done"
        assert len(github.comments_of(REPO, n)) == 1

        github.reopen_issue(REPO, n)  # the fix was not enough
        assert w.sync().actions["requeued"] == 1
        w.sync()  # the old pull request's merge is not read as this attempt's
        task = w.task_of(n)
        assert task["state"] == "queued"
        item = w.item(n)
        assert (item["pr_number"], item["merged_at"], item["merged_sha"], item["pr_state"]) == (None,) * 4
        reopened = w.events(task["id"], "external_advance")[-1]
        assert (reopened["reason"], reopened["pr"], reopened["merged_sha"]) == ("reopened", old.number, merge)

        to_ci(w, n)  # the next attempt: a pull request of its own, judged by its checks
        assert w.sync().actions["pull requests opened"] == 1
        new = max(github.pulls_of(REPO))
        assert new != old.number and w.item(n)["pr_number"] == new
        assert w.task_of(n)["state"] == "ci"
        assert len(github.comments_of(REPO, n)) == 1
    finally:
        w.fleet.close()


def test_a_branch_with_no_commits_blocks_its_task_and_the_pass_goes_on(db_url: str, tmp_path: Path,
                                                                      origin: Path, github: GitHubStandIn) -> None:
    """GitHub will not open a pull request of a branch with nothing over its base (422 "No commits
    between"): the task is blocked for a person with GitHub's words, once; the pass still mirrors
    the issues that came meanwhile."""
    lanes = {"bugfix": lane_defaults(command=[*AGENT, "--script", "steps=1,sleep=0.05"], repo=str(origin), ci=True),
             "docs": lane_defaults()}
    w = World(Backend("postgres", db_url), tmp_path, github, lanes, git_dir=origin)
    try:
        n = github.add_issue(REPO, "nothing to change", "", ["fleet:bugfix"])
        w.sync()
        to_ci(w, n)  # its agent changed nothing: the branch is its base
        later = github.add_issue(REPO, "a later issue", "", ["fleet:docs"])
        report = w.sync()
        assert report.error is None and not report.item_errors, report.line()
        assert report.actions["blocked (no-commits)"] == 1 and report.actions["created"] == 1
        task = w.task_of(n)
        assert (task["state"], task["block_reason"]) == ("blocked", "no-commits")
        assert "No commits between main and fleet/bugfix/" in task["last_error"]
        assert w.task_of(later)["state"] == "queued"
        (comment,) = github.comments_of(REPO, n)  # said once, for a person
        assert "needs a person" in comment and "no-commits" in comment and "No commits between" in comment
        assert "fleet:needs-attention" in github.labels_of(REPO, n)

        ref = f"{REPO}#{n}"
        with pytest.raises(InvalidInput, match="'nope' is not a reason a pull request was refused"):
            w.fleet.monitor_store.source_call("source_pr_refused", {"p_source": "gh", "p_ref": ref,
                                                                    "p_reason": "nope", "p_evidence": "x"})
        with pytest.raises(InvalidInput, match=f"item {ref}: say why it is gone"):
            w.fleet.monitor_store.source_call("source_gone", {"p_source": "gh", "p_ref": ref, "p_why": " "})
        assert w.task_of(n)["state"] == "blocked" and w.item(n)["gone_at"] is None

        w.sync()  # not asked again
        opened = [r for r in github.requests if r.method == "POST" and r.path == f"/repos/{REPO}/pulls"]
        assert len(opened) == 1 and not github.pulls_of(REPO)
        assert len(github.comments_of(REPO, n)) == 1
    finally:
        w.fleet.close()


def test_the_ci_verdict_reads_every_page_of_check_runs(github: GitHubStandIn) -> None:
    """A head with more check runs than a page holds (a matrix): a failure on the second page is
    the verdict, not the first page's greens."""
    github.add_repo(REPO)
    sha = "d" * 40
    github.set_branch(REPO, "main", sha)
    github.set_checks(REPO, sha, [{"name": "lint", "conclusion": "failure", "log": "E501 line too long"}]
                      + [{"name": f"tests ({k})", "conclusion": "success", "log": "ok"} for k in range(120)])
    checks = GitHub(REPO, github.token, api_url=github.url).checks(sha)
    assert len(checks.checks) == 121 and checks.runs == 1
    assert checks.verdict == "failure" and [c.name for c in checks.failing] == ["lint"]
