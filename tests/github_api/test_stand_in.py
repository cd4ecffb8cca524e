"""The GitHub stand-in itself, through plain httpx: its answers keep to GitHub's OpenAPI description,
traffic that does not is caught, and it behaves as api.github.com does (ETags, rate limits,
pagination, authentication, pull requests in the issues list, branches read from git)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from gitkit import bare_origin, git

from github_api.fixture import github_stand_in
from github_api.openapi import VERSION, NpmUnavailable, description, ensure_description
from github_api.stand_in import GitHubStandIn

REPO = "acme/app"
MAIN, FEAT, OTHER = "a" * 40, "b" * 40, "c" * 40


@pytest.fixture
def gh() -> Iterator[GitHubStandIn]:
    with github_stand_in() as stand_in:
        stand_in.add_repo(REPO)
        stand_in.set_branch(REPO, "main", MAIN)
        stand_in.set_branch(REPO, "feat", FEAT)
        yield stand_in


@pytest.fixture
def raw() -> Iterator[GitHubStandIn]:
    """A stand-in whose problems the test looks at itself (no fixture check at exit)."""
    with GitHubStandIn() as stand_in:
        stand_in.add_repo(REPO)
        stand_in.set_branch(REPO, "main", MAIN)
        yield stand_in


def client(gh: GitHubStandIn, scheme: str = "Bearer") -> httpx.Client:
    return httpx.Client(base_url=gh.url, headers={
        "Authorization": f"{scheme} {gh.token}", "Accept": "application/vnd.github+json",
        "X-GitHub-Api-Version": "2022-11-28"}, timeout=10)


def test_the_description_is_octokits_pinned_version() -> None:
    path = ensure_description()
    assert path.name == "api.github.com.json" and path.is_file()
    assert description().version == VERSION == "23.0.2"
    assert description() is description()  # loaded once per process


def test_ensure_description_says_npm_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NpmUnavailable, match="npm is not on PATH"):
        ensure_description(tmp_path / "cache")


def test_every_endpoint_answers_bodies_valid_against_the_description(gh: GitHubStandIn) -> None:
    n = gh.add_issue(REPO, "Fix the parser", "It breaks.", labels=["fleet", "bug"], assignee="alice",
                     milestone="v1")
    with client(gh) as c:
        issues = c.get(f"/repos/{REPO}/issues", params={"labels": "fleet", "state": "open"})
        assert issues.status_code == 200
        assert issues.headers["content-type"] == "application/json; charset=utf-8"
        [issue] = issues.json()
        assert issue["number"] == n and [x["name"] for x in issue["labels"]] == ["fleet", "bug"]
        assert issue["assignee"]["login"] == "alice" and issue["milestone"]["title"] == "v1"
        assert c.get(f"/repos/{REPO}/issues/{n}").json()["title"] == "Fix the parser"

        posted = c.post(f"/repos/{REPO}/issues/{n}/comments", json={"body": "Done: PR #2"})
        assert posted.status_code == 201 and posted.headers["location"] == posted.json()["url"]
        comments = c.get(f"/repos/{REPO}/issues/{n}/comments", params={"per_page": 10})
        assert [x["body"] for x in comments.json()] == ["Done: PR #2"]
        assert c.get(f"/repos/{REPO}/issues/{n}").json()["comments"] == 1

        added = c.post(f"/repos/{REPO}/issues/{n}/labels", json={"labels": ["fleet:running"]})
        assert [x["name"] for x in added.json()] == ["fleet", "bug", "fleet:running"]
        removed = c.delete(f"/repos/{REPO}/issues/{n}/labels/fleet:running")
        assert removed.status_code == 200 and [x["name"] for x in removed.json()] == ["fleet", "bug"]
        assert c.delete(f"/repos/{REPO}/issues/{n}/labels/nope").json()["message"] == "Label does not exist"

        pr = c.post(f"/repos/{REPO}/pulls", json={"title": "Fix the parser", "head": "acme:feat",
                                                   "base": "main", "body": "Closes #1", "draft": False})
        assert pr.status_code == 201
        number = pr.json()["number"]
        assert number == n + 1  # one sequence for issues and pull requests
        listed = c.get(f"/repos/{REPO}/pulls", params={"head": "acme:feat", "state": "open"}).json()
        assert [p["number"] for p in listed] == [number]
        got = c.get(f"/repos/{REPO}/pulls/{number}").json()
        assert (got["head"]["sha"], got["head"]["ref"], got["base"]["ref"]) == (FEAT, "feat", "main")
        assert (got["merged"], got["merged_at"], got["merge_commit_sha"]) == (False, None, None)

        jobs = gh.set_checks(REPO, FEAT, [{"name": "tests", "conclusion": "failure", "log": "E  assert 1 == 2\n"},
                                          {"name": "lint", "conclusion": None}])
        runs = c.get(f"/repos/{REPO}/commits/{FEAT}/check-runs").json()
        assert runs["total_count"] == 2
        by_name = {r["name"]: r for r in runs["check_runs"]}
        assert by_name["tests"]["conclusion"] == "failure" and by_name["tests"]["id"] == jobs[0]
        assert by_name["lint"]["status"] == "in_progress" and by_name["lint"]["conclusion"] is None
        assert by_name["tests"]["pull_requests"][0]["number"] == number
        wf = c.get(f"/repos/{REPO}/actions/runs", params={"head_sha": FEAT, "per_page": 5}).json()
        assert wf["total_count"] == 1
        assert (wf["workflow_runs"][0]["event"], wf["workflow_runs"][0]["status"]) == ("pull_request", "in_progress")
        assert c.get(f"/repos/{REPO}/actions/runs", params={"branch": "feat", "event": "push"}).json()["total_count"] == 0
        logs = c.get(f"/repos/{REPO}/actions/jobs/{jobs[0]}/logs")
        assert logs.status_code == 302
        assert httpx.get(logs.headers["location"]).text == "E  assert 1 == 2\n"
        assert c.get(f"/repos/{REPO}/actions/jobs/{jobs[0]}/logs", follow_redirects=True).text == "E  assert 1 == 2\n"

        merge = gh.merge_pull(REPO, number)
        got = c.get(f"/repos/{REPO}/pulls/{number}").json()
        assert (got["merged"], got["state"], got["merge_commit_sha"]) == (True, "closed", merge)
        assert got["merged_at"] is not None
        revert = gh.add_commit(REPO, "main", f"Revert \"Fix the parser\"\n\nThis reverts commit {merge}.")
        commits = c.get(f"/repos/{REPO}/commits", params={"sha": "main", "per_page": 100}).json()
        assert [x["sha"] for x in commits] == [revert, merge, FEAT, MAIN]  # the merged one too
        assert commits[0]["commit"]["message"].endswith(f"This reverts commit {merge}.")
        assert commits[1]["parents"][1]["sha"] == FEAT
        assert c.get(f"/repos/{REPO}/commits", params={"sha": "nope"}).status_code == 404
        assert c.get(f"/repos/{REPO}/issues/99").json()["message"] == "Not Found"
    assert gh.problems == []


def test_a_pull_request_for_a_head_that_has_one_gets_githubs_422(gh: GitHubStandIn) -> None:
    with client(gh) as c:
        body = {"title": "t", "head": "acme:feat", "base": "main"}
        assert c.post(f"/repos/{REPO}/pulls", json=body).status_code == 201
        again = c.post(f"/repos/{REPO}/pulls", json=body)
        assert again.status_code == 422
        assert again.json()["message"] == "Validation Failed"
        assert again.json()["errors"] == [{"resource": "PullRequest", "code": "custom",
                                           "message": "A pull request already exists for acme:feat."}]
        assert c.post(f"/repos/{REPO}/pulls", json={**body, "head": "acme:gone"}).json()["errors"][0]["field"] == "head"
    assert gh.problems == []


def test_a_deleted_issue_is_gone_and_a_transferred_one_moved(gh: GitHubStandIn) -> None:
    gh.add_repo("acme/elsewhere")
    kept, moved, deleted = gh.add_issue(REPO, "k"), gh.add_issue(REPO, "m", labels=["bug"]), gh.add_issue(REPO, "d")
    gh.delete_issue(REPO, deleted)
    there = gh.transfer_issue(REPO, moved, "acme/elsewhere")
    with client(gh) as c:
        assert [i["number"] for i in c.get(f"/repos/{REPO}/issues").json()] == [kept]
        for method, path, body in [("GET", "", None), ("GET", "/comments", None),
                                   ("POST", "/comments", {"body": "hi"}), ("POST", "/labels", {"labels": ["x"]}),
                                   ("DELETE", "/labels/bug", None)]:
            gone = c.request(method, f"/repos/{REPO}/issues/{deleted}{path}", json=body)
            assert (gone.status_code, gone.json()["message"]) == (410, "This issue was deleted"), path
        issue = c.get(f"/repos/{REPO}/issues/{moved}")
        assert issue.status_code == 301
        assert issue.headers["location"] == issue.json()["url"] == f"{gh.url}/repos/acme/elsewhere/issues/{there}"
        labels = c.post(f"/repos/{REPO}/issues/{moved}/labels", json={"labels": ["x"]})
        assert labels.status_code == 301 and labels.headers["location"].endswith(f"/issues/{there}/labels")
        # the description declares no 301 for the comments: GitHub's 404, as for a repository the token cannot read
        assert c.get(f"/repos/{REPO}/issues/{moved}/comments").status_code == 404
        assert c.get(f"/repos/acme/elsewhere/issues/{there}").json()["labels"][0]["name"] == "bug"
    assert gh.add_issue(REPO, "next") == deleted + 1  # a number is never given twice
    assert gh.problems == []


def test_pull_requests_are_in_the_issues_list(gh: GitHubStandIn) -> None:
    n = gh.add_issue(REPO, "an issue")
    with client(gh) as c:
        pr = c.post(f"/repos/{REPO}/pulls", json={"title": "a PR", "head": "feat", "base": "main"}).json()
        listed = {i["number"]: i for i in c.get(f"/repos/{REPO}/issues").json()}
        assert set(listed) == {n, pr["number"]}
        assert "pull_request" not in listed[n]
        assert listed[pr["number"]]["pull_request"]["url"].endswith(f"/pulls/{pr['number']}")
        assert listed[pr["number"]]["pull_request"]["merged_at"] is None
        assert c.get(f"/repos/{REPO}/issues/{pr['number']}").json()["pull_request"]["html_url"].endswith(
            f"/pull/{pr['number']}")
    assert gh.problems == []


def test_issue_filters_and_changes(gh: GitHubStandIn) -> None:
    a = gh.add_issue(REPO, "a", labels=["fleet", "lane:fast"], assignee="alice", milestone="v1")
    b = gh.add_issue(REPO, "b", labels=["fleet"])
    c_ = gh.add_issue(REPO, "c", labels=["Lane:Fast"])
    with client(gh) as c:
        def numbers(**params: str) -> list[int]:
            resp = c.get(f"/repos/{REPO}/issues", params=params)
            assert resp.status_code == 200, resp.text
            return [i["number"] for i in resp.json()]

        assert numbers() == [c_, b, a]  # created, newest first
        assert numbers(direction="asc") == [a, b, c_]
        assert numbers(labels="fleet,lane:fast") == [a]  # every label must match
        assert numbers(labels="lane:fast") == [c_, a]  # label names ignore case
        assert numbers(assignee="alice") == [a]
        assert numbers(assignee="none") == [c_, b]
        assert numbers(assignee="*") == [a]
        milestone = c.get(f"/repos/{REPO}/issues/{a}").json()["milestone"]["number"]
        assert numbers(milestone=str(milestone)) == [a]
        assert numbers(milestone="*") == [a]
        assert numbers(milestone="none") == [c_, b]

        before = c.get(f"/repos/{REPO}/issues/{b}").json()["updated_at"]
        gh.close_issue(REPO, b, state_reason="not_planned")
        closed = c.get(f"/repos/{REPO}/issues/{b}").json()
        assert (closed["state"], closed["state_reason"]) == ("closed", "not_planned")
        assert closed["updated_at"] > before and closed["closed_at"] == closed["updated_at"]
        assert numbers() == [c_, a]
        assert numbers(state="closed") == [b]
        assert numbers(since=closed["updated_at"]) == []  # only open ones by default
        assert numbers(since=closed["updated_at"], state="all") == [b]
        gh.reopen_issue(REPO, b)
        gh.set_labels(REPO, b, ["fleet", "lane:slow"])
        again = c.get(f"/repos/{REPO}/issues/{b}").json()
        assert (again["state"], again["state_reason"], again["closed_at"]) == ("open", "reopened", None)
        assert [x["name"] for x in again["labels"]] == ["fleet", "lane:slow"]
        assert numbers(sort="updated") == [b, c_, a]
    assert gh.problems == []


def test_requests_the_description_lacks_are_problems(raw: GitHubStandIn) -> None:
    n = raw.add_issue(REPO, "x")
    with client(raw) as c:
        assert c.get(f"/repos/{REPO}/issuez").status_code == 404
        assert c.get(f"/repos/{REPO}/issues", params={"label": "fleet"}).status_code == 200
        assert c.post(f"/repos/{REPO}/issues/{n}/comments", json={"text": "hi"}).status_code == 422
        assert c.get(f"/repos/{REPO}/issues", params={"state": "opened"}).status_code == 200
        assert c.get(f"/repos/{REPO}/issues/one").status_code == 404
        # an operation of the description the stand-in does not answer
        assert c.patch(f"/repos/{REPO}/issues/{n}", json={"state": "closed"}).status_code == 404
    problems = "\n".join(raw.problems)
    assert "GET /repos/acme/app/issuez: no operation of the description has this method and path" in problems
    assert "unknown query parameter 'label'" in problems
    assert "(issues/create-comment): body (the whole body): 'body' is a required property" in problems
    assert "query parameter state='opened'" in problems
    assert "path parameter issue_number='one' is not of type integer" in problems
    assert "the stand-in does not answer issues/update" in problems
    assert len(raw.problems) == 6, problems


def test_the_fixture_fails_a_test_whose_traffic_breaks_the_description() -> None:
    with pytest.raises(AssertionError, match="unknown query parameter 'labels_any'"):
        with github_stand_in() as gh:
            gh.add_repo(REPO)
            with client(gh) as c:
                c.get(f"/repos/{REPO}/issues", params={"labels_any": "x"})
    with pytest.raises(ValueError) as info:
        with github_stand_in() as gh:
            gh.add_repo(REPO)
            with client(gh) as c:
                c.get(f"/repos/{REPO}/nothing")
            raise ValueError("the test's own failure")
    assert "no operation of the description" in "".join(getattr(info.value, "__notes__", []))


def test_a_wrong_response_fails_response_problems(gh: GitHubStandIn) -> None:
    spec = description()
    n = gh.add_issue(REPO, "x")
    with client(gh) as c:
        good = c.get(f"/repos/{REPO}/issues/{n}")
    op = spec.operation("GET", f"/repos/{REPO}/issues/{n}")
    assert op is not None and op.id == "issues/get"
    assert spec.response_problems(op, 200, good.headers, good.content) == []
    issue = good.json()
    del issue["number"]
    bad = spec.response_problems(op, 200, {"content-type": "application/json"}, httpx.Response(200, json=issue).content)
    assert any("'number' is a required property" in p for p in bad), bad
    issue = good.json() | {"labels": [{"id": "seven"}]}
    bad = spec.response_problems(op, 200, {"content-type": "application/json"}, httpx.Response(200, json=issue).content)
    assert any("labels" in p for p in bad), bad
    assert spec.response_problems(op, 418, {}, b"") != []  # an undeclared status
    list_op = spec.operation("GET", f"/repos/{REPO}/issues")
    assert list_op is not None
    assert spec.response_problems(list_op, 304, {}, b"", conditional=True) == []
    assert spec.response_problems(list_op, 304, {}, b"[]", conditional=True) != []  # a 304 has no body
    assert spec.response_problems(list_op, 304, {}, b"") != []  # nor comes unasked
    assert spec.response_problems(list_op, 403, {"content-type": "application/json"}, b'{"message": "no"}') != []


def test_an_etag_gets_a_304_that_costs_no_rate_limit(gh: GitHubStandIn) -> None:
    n = gh.add_issue(REPO, "x", labels=["fleet"])
    with client(gh) as c:
        first = c.get(f"/repos/{REPO}/issues", params={"labels": "fleet"})
        etag = first.headers["etag"]
        assert etag.startswith('W/"')
        remaining = int(first.headers["x-ratelimit-remaining"])
        again = c.get(f"/repos/{REPO}/issues", params={"labels": "fleet"}, headers={"If-None-Match": etag})
        assert again.status_code == 304 and again.content == b""
        assert again.headers["etag"] == etag
        assert int(again.headers["x-ratelimit-remaining"]) == remaining
        gh.set_labels(REPO, n, ["fleet", "bug"])
        changed = c.get(f"/repos/{REPO}/issues", params={"labels": "fleet"}, headers={"If-None-Match": etag})
        assert changed.status_code == 200 and changed.headers["etag"] != etag
        assert int(changed.headers["x-ratelimit-remaining"]) == remaining - 1
    assert [(r.status, r.conditional) for r in gh.requests] == [(200, False), (304, True), (200, True)]
    assert gh.requests[1].query == {"labels": "fleet"}
    assert gh.problems == []


def test_exhaustion_gives_403_until_the_reset_then_200(gh: GitHubStandIn) -> None:
    with client(gh) as c:
        ok = c.get(f"/repos/{REPO}/issues")
        assert ok.headers["x-ratelimit-limit"] == "5000" and ok.headers["x-ratelimit-resource"] == "core"
        assert ok.headers["x-ratelimit-used"] == "1" and ok.headers["x-ratelimit-remaining"] == "4999"
        gh.exhaust(reset_in=1.0)
        refused = c.get(f"/repos/{REPO}/issues", headers={"If-None-Match": ok.headers["etag"]})
        assert refused.status_code == 403
        assert refused.json()["message"].startswith("API rate limit exceeded for user ID ")
        assert refused.headers["x-ratelimit-remaining"] == "0"
        reset = int(refused.headers["x-ratelimit-reset"])
        assert time.time() < reset <= time.time() + 2
        assert c.get(f"/repos/{REPO}/issues").status_code == 403
        while time.time() < reset:
            time.sleep(0.05)
        back = c.get(f"/repos/{REPO}/issues")
        assert back.status_code == 200 and back.headers["x-ratelimit-remaining"] == "4999"
    assert gh.problems == []


@pytest.mark.parametrize("status", [403, 429])
def test_a_secondary_limit_answers_once_with_retry_after(gh: GitHubStandIn, status: int) -> None:
    gh.secondary_limit(retry_after=7, status=status)
    with client(gh) as c:
        hit = c.get(f"/repos/{REPO}/issues")
        assert hit.status_code == status and hit.headers["retry-after"] == "7"
        assert hit.json()["message"].startswith("You have exceeded a secondary rate limit")
        assert c.get(f"/repos/{REPO}/issues").status_code == 200
    assert gh.problems == []


def test_pagination_has_githubs_link_header(gh: GitHubStandIn) -> None:
    made = [gh.add_issue(REPO, f"issue {k}") for k in range(7)]
    with client(gh) as c:
        first = c.get(f"/repos/{REPO}/issues", params={"per_page": 3, "direction": "asc"})
        assert [i["number"] for i in first.json()] == made[:3]
        assert first.headers["link"] == (
            f'<{gh.url}/repos/{REPO}/issues?per_page=3&direction=asc&page=2>; rel="next", '
            f'<{gh.url}/repos/{REPO}/issues?per_page=3&direction=asc&page=3>; rel="last"')
        assert first.links["next"]["url"].endswith("page=2")
        second = c.get(first.links["next"]["url"])
        assert [i["number"] for i in second.json()] == made[3:6]
        assert set(second.links) == {"prev", "next", "last", "first"}
        last = c.get(second.links["last"]["url"])
        assert [i["number"] for i in last.json()] == made[6:]
        assert set(last.links) == {"prev", "first"}
        one = c.get(f"/repos/{REPO}/issues", params={"per_page": 100})
        assert "link" not in one.headers and len(one.json()) == 7
    assert gh.problems == []


def test_requests_without_the_token_get_githubs_401(gh: GitHubStandIn) -> None:
    bare = httpx.get(f"{gh.url}/repos/{REPO}/issues")
    assert bare.status_code == 401
    assert bare.json() == {"message": "Requires authentication", "documentation_url": "https://docs.github.com/rest",
                           "status": "401"}
    wrong = httpx.get(f"{gh.url}/repos/{REPO}/issues", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["message"] == "Bad credentials"
    with client(gh, scheme="token") as c:
        assert c.get(f"/repos/{REPO}/issues").status_code == 200
    assert gh.problems == []


def test_branches_and_merges_live_in_the_given_git_repository(tmp_path: Path) -> None:
    origin = bare_origin(tmp_path)
    work = tmp_path / "work"
    git("clone", "-q", str(origin), str(work))
    git("checkout", "-q", "-b", "fleet/task-1", cwd=work)
    (work / "fix.txt").write_text("fixed\n")
    git("add", "fix.txt", cwd=work)
    git("commit", "-q", "-m", "Fix it", cwd=work)
    git("push", "-q", "origin", "fleet/task-1", cwd=work)
    first = git("rev-parse", "HEAD", cwd=work)
    with github_stand_in() as gh:
        gh.add_repo(REPO, git_dir=origin)
        with client(gh) as c:
            pr = c.post(f"/repos/{REPO}/pulls", json={"title": "Fix it", "head": "acme:fleet/task-1", "base": "main"})
            assert pr.status_code == 201 and pr.json()["head"]["sha"] == first
            number = pr.json()["number"]
            (work / "fix.txt").write_text("fixed again\n")
            git("commit", "-q", "-am", "Fix it again", cwd=work)
            git("push", "-q", "origin", "fleet/task-1", cwd=work)
            second = git("rev-parse", "HEAD", cwd=work)
            assert c.get(f"/repos/{REPO}/pulls/{number}").json()["head"]["sha"] == second  # read when read
            gh.set_checks(REPO, second, [{"name": "tests", "conclusion": "success", "log": "ok"}])
            for ref in (second, "fleet%2Ftask-1"):  # a sha, or a branch (its / encoded)
                runs = c.get(f"/repos/{REPO}/commits/{ref}/check-runs").json()["check_runs"]
                assert [(r["name"], r["conclusion"]) for r in runs] == [("tests", "success")]
            merge = gh.merge_pull(REPO, number)
            assert git("--git-dir", str(origin), "rev-parse", "main") == merge
            assert git("--git-dir", str(origin), "show", f"{merge}:fix.txt") == "fixed again"
            revert = gh.add_commit(REPO, "main", f"Revert \"Fix it\"\n\nThis reverts commit {merge}.")
            listed = c.get(f"/repos/{REPO}/commits", params={"sha": "main", "per_page": 2}).json()
            assert [x["sha"] for x in listed] == [revert, merge]
            assert listed[1]["commit"]["message"].startswith(f"Merge pull request #{number} from acme/fleet/task-1")
            assert c.get(f"/repos/{REPO}/pulls/{number}").json()["head"]["sha"] == second  # frozen once merged
    assert gh.problems == []


def test_concurrent_writers_each_get_their_own_comment(gh: GitHubStandIn) -> None:
    n = gh.add_issue(REPO, "x")

    def post(k: int) -> int:
        with client(gh) as c:
            return c.post(f"/repos/{REPO}/issues/{n}/comments", json={"body": f"comment {k}"}).status_code

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(post, range(16))) == [201] * 16
    assert sorted(gh.comments_of(REPO, n)) == sorted(f"comment {k}" for k in range(16))
    with client(gh) as c:
        assert c.get(f"/repos/{REPO}/issues/{n}").json()["comments"] == 16
    assert gh.problems == []
