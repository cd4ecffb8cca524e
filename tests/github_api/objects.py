"""GitHub's JSON objects as the stand-in (stand_in.py) answers them: users, repositories, labels,
milestones, issues, comments, pull requests, commits, check runs and workflow runs, each with every
field GitHub's OpenAPI description requires and the URLs api.github.com gives.

API URLs start at the stand-in's base (``api``); the web's (``html_url``) at https://github.com, as
on GitHub. Pure functions of the stand-in's records: no state here.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from typing import Any

WEB = "https://github.com"
ACTIONS_APP_ID = 15368  # GitHub Actions' app


def node_id(kind: str, n: int) -> str:
    return base64.b64encode(f"0:{kind}{n}".encode()).decode().rstrip("=")


def user_id(login: str) -> int:
    return int(hashlib.sha1(login.encode()).hexdigest()[:7], 16)


def user(api: str, login: str, kind: str = "User") -> dict[str, Any]:
    uid = user_id(login)
    u = f"{api}/users/{login}"
    return {
        "login": login, "id": uid, "node_id": node_id("U", uid),
        "avatar_url": f"https://avatars.githubusercontent.com/u/{uid}?v=4", "gravatar_id": "",
        "url": u, "html_url": f"{WEB}/{login}", "followers_url": f"{u}/followers",
        "following_url": f"{u}/following{{/other_user}}", "gists_url": f"{u}/gists{{/gist_id}}",
        "starred_url": f"{u}/starred{{/owner}}{{/repo}}", "subscriptions_url": f"{u}/subscriptions",
        "organizations_url": f"{u}/orgs", "repos_url": f"{u}/repos",
        "events_url": f"{u}/events{{/privacy}}", "received_events_url": f"{u}/received_events",
        "type": kind, "user_view_type": "public", "site_admin": False,
    }


@dataclass
class RepoInfo:
    owner: str
    name: str
    id: int
    default_branch: str
    created_at: str

    @property
    def full_name(self) -> str:
        return f"{self.owner}/{self.name}"


def minimal_repository(api: str, r: RepoInfo) -> dict[str, Any]:
    u = f"{api}/repos/{r.full_name}"
    return {
        "id": r.id, "node_id": node_id("R", r.id), "name": r.name, "full_name": r.full_name,
        "owner": user(api, r.owner), "private": False, "html_url": f"{WEB}/{r.full_name}",
        "description": None, "fork": False, "url": u,
        "archive_url": f"{u}/{{archive_format}}{{/ref}}", "assignees_url": f"{u}/assignees{{/user}}",
        "blobs_url": f"{u}/git/blobs{{/sha}}", "branches_url": f"{u}/branches{{/branch}}",
        "collaborators_url": f"{u}/collaborators{{/collaborator}}",
        "comments_url": f"{u}/comments{{/number}}", "commits_url": f"{u}/commits{{/sha}}",
        "compare_url": f"{u}/compare/{{base}}...{{head}}", "contents_url": f"{u}/contents/{{+path}}",
        "contributors_url": f"{u}/contributors", "deployments_url": f"{u}/deployments",
        "downloads_url": f"{u}/downloads", "events_url": f"{u}/events", "forks_url": f"{u}/forks",
        "git_commits_url": f"{u}/git/commits{{/sha}}", "git_refs_url": f"{u}/git/refs{{/sha}}",
        "git_tags_url": f"{u}/git/tags{{/sha}}", "hooks_url": f"{u}/hooks",
        "issue_comment_url": f"{u}/issues/comments{{/number}}",
        "issue_events_url": f"{u}/issues/events{{/number}}", "issues_url": f"{u}/issues{{/number}}",
        "keys_url": f"{u}/keys{{/key_id}}", "labels_url": f"{u}/labels{{/name}}",
        "languages_url": f"{u}/languages", "merges_url": f"{u}/merges",
        "milestones_url": f"{u}/milestones{{/number}}",
        "notifications_url": f"{u}/notifications{{?since,all,participating}}",
        "pulls_url": f"{u}/pulls{{/number}}", "releases_url": f"{u}/releases{{/id}}",
        "stargazers_url": f"{u}/stargazers", "statuses_url": f"{u}/statuses/{{sha}}",
        "subscribers_url": f"{u}/subscribers", "subscription_url": f"{u}/subscription",
        "tags_url": f"{u}/tags", "teams_url": f"{u}/teams", "trees_url": f"{u}/git/trees{{/sha}}",
    }


def repository(api: str, r: RepoInfo, open_issues: int, pushed_at: str) -> dict[str, Any]:
    return {
        **minimal_repository(api, r),
        "clone_url": f"{WEB}/{r.full_name}.git", "git_url": f"git://github.com/{r.full_name}.git",
        "ssh_url": f"git@github.com:{r.full_name}.git", "svn_url": f"{WEB}/{r.full_name}",
        "mirror_url": None, "homepage": None, "language": None, "size": 0,
        "forks": 0, "forks_count": 0, "stargazers_count": 0, "watchers": 0, "watchers_count": 0,
        "open_issues": open_issues, "open_issues_count": open_issues,
        "default_branch": r.default_branch, "has_issues": True, "has_projects": True,
        "has_wiki": True, "has_pages": False, "has_downloads": True, "has_discussions": False,
        "archived": False, "disabled": False, "visibility": "public", "license": None,
        "allow_forking": True, "is_template": False, "web_commit_signoff_required": False,
        "topics": [], "pushed_at": pushed_at, "created_at": r.created_at, "updated_at": pushed_at,
    }


def label(api: str, r: RepoInfo, name: str, lid: int, color: str) -> dict[str, Any]:
    return {"id": lid, "node_id": node_id("LA", lid), "url": f"{api}/repos/{r.full_name}/labels/{name}",
            "name": name, "color": color, "default": False, "description": None}


@dataclass
class MilestoneRec:
    number: int
    id: int
    title: str
    created_at: str


def milestone(api: str, r: RepoInfo, m: MilestoneRec, creator: str, open_issues: int,
              closed_issues: int) -> dict[str, Any]:
    u = f"{api}/repos/{r.full_name}/milestones/{m.number}"
    return {
        "url": u, "html_url": f"{WEB}/{r.full_name}/milestone/{m.number}", "labels_url": f"{u}/labels",
        "id": m.id, "node_id": node_id("MI", m.id), "number": m.number, "state": "open",
        "title": m.title, "description": None, "creator": user(api, creator),
        "open_issues": open_issues, "closed_issues": closed_issues, "created_at": m.created_at,
        "updated_at": m.created_at, "closed_at": None, "due_on": None,
    }


@dataclass
class IssueRec:
    number: int
    id: int
    title: str
    body: str | None
    author: str
    created_at: str
    updated_at: str
    labels: list[str] = field(default_factory=list)
    assignee: str | None = None
    milestone: int | None = None  # its number
    state: str = "open"
    state_reason: str | None = None
    closed_at: str | None = None
    comments: int = 0
    is_pull: bool = False
    merged_at: str | None = None


def reactions(url: str) -> dict[str, Any]:
    return {"url": f"{url}/reactions", "total_count": 0, "+1": 0, "-1": 0, "laugh": 0,
            "hooray": 0, "confused": 0, "heart": 0, "rocket": 0, "eyes": 0}


def issue(api: str, r: RepoInfo, i: IssueRec, labels: list[dict[str, Any]],
          milestone_obj: dict[str, Any] | None) -> dict[str, Any]:
    base = f"{api}/repos/{r.full_name}"
    u = f"{base}/issues/{i.number}"
    assignee = user(api, i.assignee) if i.assignee else None
    out: dict[str, Any] = {
        "url": u, "repository_url": base, "labels_url": f"{u}/labels{{/name}}",
        "comments_url": f"{u}/comments", "events_url": f"{u}/events",
        "html_url": f"{WEB}/{r.full_name}/{'pull' if i.is_pull else 'issues'}/{i.number}",
        "id": i.id, "node_id": node_id("PR" if i.is_pull else "I", i.id), "number": i.number,
        "title": i.title, "user": user(api, i.author), "labels": labels, "state": i.state,
        "locked": False, "assignee": assignee, "assignees": [assignee] if assignee else [],
        "milestone": milestone_obj, "comments": i.comments, "created_at": i.created_at,
        "updated_at": i.updated_at, "closed_at": i.closed_at, "author_association": "OWNER",
        "active_lock_reason": None, "body": i.body, "closed_by": None,
        "reactions": reactions(u), "timeline_url": f"{u}/timeline",
        "performed_via_github_app": None, "state_reason": i.state_reason,
    }
    if i.is_pull:
        out["draft"] = False
        out["pull_request"] = {
            "url": f"{base}/pulls/{i.number}", "html_url": f"{WEB}/{r.full_name}/pull/{i.number}",
            "diff_url": f"{WEB}/{r.full_name}/pull/{i.number}.diff",
            "patch_url": f"{WEB}/{r.full_name}/pull/{i.number}.patch", "merged_at": i.merged_at,
        }
    return out


def comment(api: str, r: RepoInfo, issue_number: int, cid: int, body: str, author: str,
            at: str) -> dict[str, Any]:
    u = f"{api}/repos/{r.full_name}/issues/comments/{cid}"
    return {
        "id": cid, "node_id": node_id("IC", cid), "url": u,
        "html_url": f"{WEB}/{r.full_name}/issues/{issue_number}#issuecomment-{cid}",
        "issue_url": f"{api}/repos/{r.full_name}/issues/{issue_number}", "body": body,
        "user": user(api, author), "created_at": at, "updated_at": at,
        "author_association": "OWNER", "performed_via_github_app": None, "reactions": reactions(u),
    }


@dataclass
class PullRec:
    number: int
    id: int
    head: str  # branch
    base: str  # branch
    draft: bool
    head_sha: str  # as of the last read (frozen once merged or closed)
    base_sha: str
    merged: bool = False
    merged_at: str | None = None
    merge_commit_sha: str | None = None


def _branch_side(api: str, r: RepoInfo, ref: str, sha: str, repo_obj: dict[str, Any]) -> dict[str, Any]:
    return {"label": f"{r.owner}:{ref}", "ref": ref, "sha": sha, "user": user(api, r.owner),
            "repo": repo_obj}


def pull(api: str, r: RepoInfo, i: IssueRec, p: PullRec, labels: list[dict[str, Any]],
         milestone_obj: dict[str, Any] | None, repo_obj: dict[str, Any], *,
         full: bool) -> dict[str, Any]:
    """A pull request: ``full`` as GET /pulls/{n} answers it, else as a list has it (simple)."""
    base = f"{api}/repos/{r.full_name}"
    u = f"{base}/pulls/{p.number}"
    html = f"{WEB}/{r.full_name}/pull/{p.number}"
    assignee = user(api, i.assignee) if i.assignee else None
    out: dict[str, Any] = {
        "url": u, "id": p.id, "node_id": node_id("PR_", p.id), "html_url": html,
        "diff_url": f"{html}.diff", "patch_url": f"{html}.patch", "issue_url": f"{base}/issues/{p.number}",
        "commits_url": f"{u}/commits", "review_comments_url": f"{u}/comments",
        "review_comment_url": f"{base}/pulls/comments{{/number}}",
        "comments_url": f"{base}/issues/{p.number}/comments",
        "statuses_url": f"{base}/statuses/{p.head_sha}", "number": p.number, "state": i.state,
        "locked": False, "title": i.title, "user": user(api, i.author), "body": i.body,
        "labels": labels, "milestone": milestone_obj, "active_lock_reason": None,
        "created_at": i.created_at, "updated_at": i.updated_at, "closed_at": i.closed_at,
        "merged_at": p.merged_at, "merge_commit_sha": p.merge_commit_sha, "assignee": assignee,
        "assignees": [assignee] if assignee else [], "requested_reviewers": [], "requested_teams": [],
        "head": _branch_side(api, r, p.head, p.head_sha, repo_obj),
        "base": _branch_side(api, r, p.base, p.base_sha, repo_obj),
        "_links": {k: {"href": v} for k, v in {
            "self": u, "html": html, "issue": f"{base}/issues/{p.number}",
            "comments": f"{base}/issues/{p.number}/comments", "review_comments": f"{u}/comments",
            "review_comment": f"{base}/pulls/comments{{/number}}", "commits": f"{u}/commits",
            "statuses": f"{base}/statuses/{p.head_sha}"}.items()},
        "author_association": "OWNER", "auto_merge": None, "draft": p.draft,
    }
    if full:
        out.update({
            "merged": p.merged, "mergeable": None if p.merged else True,
            "rebaseable": None if p.merged else True,
            "mergeable_state": "unknown" if p.merged else "clean",
            "merged_by": user(api, r.owner) if p.merged else None, "comments": i.comments,
            "review_comments": 0, "maintainer_can_modify": False, "commits": 1, "additions": 0,
            "deletions": 0, "changed_files": 0,
        })
    return out


@dataclass
class CommitRec:
    sha: str
    message: str
    parents: list[str]
    author: tuple[str, str]  # name, email
    authored_at: str
    committed_at: str
    tree: str


def commit(api: str, r: RepoInfo, c: CommitRec) -> dict[str, Any]:
    u = f"{api}/repos/{r.full_name}/commits/{c.sha}"
    person = {"name": c.author[0], "email": c.author[1]}
    return {
        "url": u, "sha": c.sha, "node_id": node_id("C_", int(c.sha[:7], 16)),
        "html_url": f"{WEB}/{r.full_name}/commit/{c.sha}", "comments_url": f"{u}/comments",
        "commit": {
            "url": f"{api}/repos/{r.full_name}/git/commits/{c.sha}",
            "author": {**person, "date": c.authored_at}, "committer": {**person, "date": c.committed_at},
            "message": c.message, "comment_count": 0,
            "tree": {"sha": c.tree, "url": f"{api}/repos/{r.full_name}/git/trees/{c.tree}"},
            "verification": {"verified": False, "reason": "unsigned", "signature": None,
                             "payload": None, "verified_at": None},
        },
        "author": None, "committer": None,
        "parents": [{"sha": p, "url": f"{api}/repos/{r.full_name}/commits/{p}",
                     "html_url": f"{WEB}/{r.full_name}/commit/{p}"} for p in c.parents],
    }


def actions_app(api: str) -> dict[str, Any]:
    return {
        "id": ACTIONS_APP_ID, "slug": "github-actions", "node_id": node_id("A_", ACTIONS_APP_ID),
        "owner": user(api, "github", "Organization"), "name": "GitHub Actions", "description": "",
        "external_url": "https://help.github.com/en/actions", "html_url": f"{WEB}/apps/github-actions",
        "created_at": "2018-07-30T09:30:17Z", "updated_at": "2024-04-10T20:33:16Z",
        "permissions": {"actions": "write", "checks": "write", "contents": "write",
                        "issues": "write", "metadata": "read", "pull_requests": "write"},
        "events": ["check_run", "check_suite", "pull_request", "push", "workflow_dispatch"],
    }


def pull_minimal(api: str, r: RepoInfo, p: PullRec) -> dict[str, Any]:
    repo = {"id": r.id, "url": f"{api}/repos/{r.full_name}", "name": r.name}
    return {"id": p.id, "number": p.number, "url": f"{api}/repos/{r.full_name}/pulls/{p.number}",
            "head": {"ref": p.head, "sha": p.head_sha, "repo": repo},
            "base": {"ref": p.base, "sha": p.base_sha, "repo": repo}}


@dataclass
class RunRec:
    id: int
    run_number: int
    check_suite_id: int
    head_sha: str
    head_branch: str | None
    event: str
    title: str
    created_at: str
    jobs: list[JobRec] = field(default_factory=list)

    @property
    def status(self) -> str:
        return "completed" if all(j.conclusion is not None for j in self.jobs) else "in_progress"

    @property
    def conclusion(self) -> str | None:
        if self.status != "completed":
            return None
        return "failure" if any(j.conclusion not in ("success", "skipped", "neutral")
                                for j in self.jobs) else "success"


@dataclass
class JobRec:
    id: int
    name: str
    conclusion: str | None
    log: str
    started_at: str
    run_id: int


WORKFLOW_ID = 1
WORKFLOW_PATH = ".github/workflows/ci.yml"


def check_run(api: str, r: RepoInfo, run: RunRec, j: JobRec, pulls: list[PullRec]) -> dict[str, Any]:
    u = f"{api}/repos/{r.full_name}/check-runs/{j.id}"
    return {
        "id": j.id, "head_sha": run.head_sha, "node_id": node_id("CR_", j.id), "external_id": "",
        "url": u, "html_url": f"{WEB}/{r.full_name}/actions/runs/{run.id}/job/{j.id}",
        "details_url": f"{WEB}/{r.full_name}/actions/runs/{run.id}/job/{j.id}",
        "status": "completed" if j.conclusion is not None else "in_progress",
        "conclusion": j.conclusion, "started_at": j.started_at,
        "completed_at": j.started_at if j.conclusion is not None else None,
        "output": {"title": None, "summary": None, "text": None, "annotations_count": 0,
                   "annotations_url": f"{u}/annotations"},
        "name": j.name, "check_suite": {"id": run.check_suite_id}, "app": actions_app(api),
        "pull_requests": [pull_minimal(api, r, p) for p in pulls],
    }


def workflow_run(api: str, r: RepoInfo, run: RunRec, head: CommitRec | None,
                 pulls: list[PullRec]) -> dict[str, Any]:
    base = f"{api}/repos/{r.full_name}"
    u = f"{base}/actions/runs/{run.id}"
    repo = minimal_repository(api, r)
    head_commit = None
    if head is not None:
        person = {"name": head.author[0], "email": head.author[1]}
        head_commit = {"id": head.sha, "tree_id": head.tree, "message": head.message,
                       "timestamp": head.committed_at, "author": person, "committer": person}
    return {
        "id": run.id, "name": "CI", "node_id": node_id("WFR_", run.id), "head_branch": run.head_branch,
        "head_sha": run.head_sha, "path": WORKFLOW_PATH, "display_title": run.title,
        "run_number": run.run_number, "run_attempt": 1, "event": run.event, "status": run.status,
        "conclusion": run.conclusion, "workflow_id": WORKFLOW_ID, "check_suite_id": run.check_suite_id,
        "check_suite_node_id": node_id("CS_", run.check_suite_id), "url": u,
        "html_url": f"{WEB}/{r.full_name}/actions/runs/{run.id}",
        "pull_requests": [pull_minimal(api, r, p) for p in pulls], "created_at": run.created_at,
        "updated_at": run.created_at, "run_started_at": run.created_at, "actor": user(api, r.owner),
        "triggering_actor": user(api, r.owner), "jobs_url": f"{u}/jobs", "logs_url": f"{u}/logs",
        "check_suite_url": f"{base}/check-suites/{run.check_suite_id}",
        "artifacts_url": f"{u}/artifacts", "cancel_url": f"{u}/cancel", "rerun_url": f"{u}/rerun",
        "previous_attempt_url": None, "workflow_url": f"{base}/actions/workflows/{WORKFLOW_ID}",
        "head_commit": head_commit, "repository": repo, "head_repository": repo,
    }


def error(message: str, doc: str, status: int, **extra: Any) -> dict[str, Any]:
    """GitHub's error body: ``{"message", "documentation_url", "status"}`` (and ``errors``)."""
    return {"message": message, **extra, "documentation_url": doc, "status": str(status)}
