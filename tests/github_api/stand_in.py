"""GitHubStandIn: a local server on loopback that speaks the part of GitHub's REST API lanefleet's
GitHub source uses (issues, comments, labels, pull requests, check runs, workflow runs and job logs,
commits), with GitHub's conditional requests, rate limits and pagination.

Every request and every response is checked against GitHub's OpenAPI description (openapi.py,
``@octokit/openapi`` 23.0.2): what it does not allow is appended to ``.problems``, so a client or a
stand-in that drifts from the real API makes its test fail (fixture.py). Requests are routed by the
description's own operation ids; one the stand-in does not answer gets GitHub's 404 and a problem.

State is held in memory and changed by the helpers (``add_repo``, ``add_issue``, ``close_issue``,
``set_checks``, ``merge_pull``, …), thread-safe with the server's threads. Where GitHub's behaviour is
not in the description, the stand-in does what api.github.com does:

- issue and pull-request numbers share one sequence; pull requests are in the issues list, with a
  ``pull_request`` key; ``updated_at`` moves on every change (timestamps are whole seconds, as on
  GitHub: the stand-in's clock moves a second on when two changes fall in the same one);
- ``GET /pulls?head=`` filters only in the form ``owner:branch``; a bare branch name is ignored;
- every GET answers with a weak ETag of its body; a matching If-None-Match gets a 304 without a
  body that does not count against the rate limit; a 304 still comes at 0 remaining (a 403);
- the ``Link`` header has ``prev``, ``next``, ``last`` and ``first`` as GitHub writes them, with the
  ``/repos/{owner}/{repo}/...`` form of the URL (GitHub sometimes writes ``/repositories/{id}/...``,
  which the description does not list);
- ``GET .../actions/jobs/{job_id}/logs`` redirects (302) to a plain-text log served outside the API
  at ``/_logs/{job_id}``, without authentication, like GitHub's signed log URLs;
- an issue deleted (``delete_issue``) leaves every list and its number is never given again; a
  request about it answers 410 Gone; one transferred (``transfer_issue``) leaves its repository's
  lists and answers 301 Moved Permanently (``Location``: where it went) where the description
  declares a 301 (the issue, its labels), else 404, as GitHub answers for an issue moved to a
  repository the token cannot read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

from . import objects as o
from .openapi import Description, Operation, description

BOT = "lanefleet-bot"  # the login the token belongs to: it writes the comments and the PRs
RATE_LIMIT = 5000
UNAUTHENTICATED_LIMIT = 60
WINDOW = 3600
MAX_PER_PAGE = 100
REST_DOCS = "https://docs.github.com/rest"
RATE_DOCS = "https://docs.github.com/rest/overview/rate-limits-for-the-rest-api"
JSON = "application/json; charset=utf-8"


@dataclass(frozen=True)
class Request:
    """One request the stand-in answered, as ``.requests`` logs it."""

    method: str
    path: str
    query: dict[str, str]
    status: int
    conditional: bool  # it carried If-None-Match


@dataclass
class Reply:
    status: int
    body: Any = None  # JSON, or None for no body
    headers: dict[str, str] = field(default_factory=dict)
    text: str | None = None  # a plain-text body (the logs), instead of JSON


class _Refused(Exception):
    def __init__(self, reply: Reply) -> None:
        self.reply = reply


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass
class _Repo:
    info: o.RepoInfo
    git_dir: Path | None
    branches: dict[str, str] = field(default_factory=dict)  # without git_dir
    commits: dict[str, o.CommitRec] = field(default_factory=dict)  # without git_dir
    issues: dict[int, o.IssueRec] = field(default_factory=dict)
    pulls: dict[int, o.PullRec] = field(default_factory=dict)
    comments: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    labels: dict[str, tuple[int, str, str]] = field(default_factory=dict)  # lower name -> id, name, color
    milestones: dict[str, o.MilestoneRec] = field(default_factory=dict)
    runs: list[o.RunRec] = field(default_factory=list)
    pushed_at: str = ""
    # issues no longer here: deleted (None) or transferred (the API URL of the issue where it went)
    gone: dict[int, str | None] = field(default_factory=dict)


def _git(git_dir: Path, *args: str, env: Mapping[str, str] | None = None) -> tuple[int, str]:
    proc = subprocess.run(["git", "--git-dir", str(git_dir), *args], capture_output=True, text=True,
                          timeout=30, check=False, env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout


GITHUB_IDENTITY = {"GIT_AUTHOR_NAME": "GitHub", "GIT_AUTHOR_EMAIL": "noreply@github.com",
                   "GIT_COMMITTER_NAME": "GitHub", "GIT_COMMITTER_EMAIL": "noreply@github.com"}


class GitHubStandIn:
    """The stand-in server; see the module docstring. ``url`` is the API base, ``token`` its token."""

    def __init__(self, token: str | None = None, *, rate_limit: int = RATE_LIMIT,
                 spec: Description | None = None) -> None:
        self.token = token or f"ghp_{secrets.token_hex(18)}"
        self.problems: list[str] = []
        self.requests: list[Request] = []
        self._spec = spec or description()
        self._lock = threading.RLock()
        self._repos: dict[str, _Repo] = {}
        self._ids = 1000  # one sequence for every object id
        self._job_ids = 30_000_000_000
        self._clock = 0.0
        self._limit = rate_limit
        self._used = 0
        self._unauth_used = 0
        self._reset = time.time() + WINDOW
        self._exhausted_until = 0.0
        self._secondary: tuple[int, int] | None = None  # (status, retry_after) for the next request
        self._logs: dict[int, str] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # ------------------------------------------------------------------------------------------
    # the server

    def start(self) -> GitHubStandIn:
        if self._server is not None:
            return self
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        server.daemon_threads = True
        self._server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        self._thread = threading.Thread(target=server.serve_forever, name="github-stand-in",
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None

    def __enter__(self) -> GitHubStandIn:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------
    # test helpers: the scene

    def add_repo(self, full_name: str, default_branch: str = "main",
                 git_dir: Path | None = None) -> None:
        owner, _, name = full_name.partition("/")
        if not owner or not name or "/" in name:
            raise ValueError(f"repository {full_name!r} is not of the form owner/name")
        with self._lock:
            at = self._stamp()
            info = o.RepoInfo(owner, name, self._next_id(), default_branch, at)
            self._repos[full_name.lower()] = _Repo(info, Path(git_dir) if git_dir else None, pushed_at=at)

    def set_branch(self, repo: str, branch: str, sha: str) -> None:
        """Point ``branch`` at ``sha`` (a repository without git_dir; a new sha becomes a commit)."""
        with self._lock:
            r = self._repo_or_raise(repo)
            if r.git_dir is not None:
                raise ValueError(f"{repo} reads its branches from {r.git_dir}: push there instead")
            if sha not in r.commits:
                parent = r.branches.get(branch)
                at = self._stamp()
                r.commits[sha] = o.CommitRec(sha, f"commit {sha[:7]}", [parent] if parent else [],
                                             ("tester", "tester@example.com"), at, at,
                                             hashlib.sha1(f"tree{sha}".encode()).hexdigest())
            r.branches[branch] = sha
            r.pushed_at = self._stamp()

    def add_commit(self, repo: str, branch: str, message: str) -> str:
        """A new commit on ``branch`` (no change to the files), e.g. a revert; its sha."""
        with self._lock:
            r = self._repo_or_raise(repo)
            head = self._branch_sha(r, branch)
            return self._commit(r, branch, message, [head] if head else [])

    def add_issue(self, repo: str, title: str, body: str = "", labels: Iterable[str] = (),
                  assignee: str | None = None, milestone: str | None = None) -> int:
        """A new open issue (``milestone``: its title, made on first use); its number."""
        with self._lock:
            r = self._repo_or_raise(repo)
            at = self._stamp()
            number = self._next_number(r)
            names = [self._label(r, n)[1] for n in labels]
            ms = self._milestone(r, milestone).number if milestone else None
            r.issues[number] = o.IssueRec(number, self._next_id(), title, body, BOT, at, at, names,
                                          assignee, ms)
            return number

    def close_issue(self, repo: str, number: int, state_reason: str = "completed") -> None:
        with self._lock:
            i = self._issue_or_raise(repo, number)
            i.state, i.state_reason = "closed", state_reason
            i.closed_at = i.updated_at = self._stamp()

    def reopen_issue(self, repo: str, number: int) -> None:
        with self._lock:
            i = self._issue_or_raise(repo, number)
            i.state, i.state_reason, i.closed_at = "open", "reopened", None
            i.updated_at = self._stamp()

    def delete_issue(self, repo: str, number: int) -> None:
        """An admin deletes the issue: it and its comments are gone; asked about, GitHub answers 410."""
        with self._lock:
            r = self._repo_or_raise(repo)
            i = self._issue_or_raise(repo, number)
            if i.is_pull:
                raise ValueError(f"{repo}#{number} is a pull request: GitHub does not delete those")
            del r.issues[number]
            r.comments.pop(number, None)
            r.gone[number] = None

    def transfer_issue(self, repo: str, number: int, to: str) -> int:
        """Move the issue to repository ``to`` (its labels and comments with it); its number there."""
        with self._lock:
            r, dest = self._repo_or_raise(repo), self._repo_or_raise(to)
            i = self._issue_or_raise(repo, number)
            if i.is_pull:
                raise ValueError(f"{repo}#{number} is a pull request: only issues are transferred")
            new = self._next_number(dest)
            del r.issues[number]
            i.number, i.milestone, i.updated_at = new, None, self._stamp()
            i.labels = [self._label(dest, n)[1] for n in i.labels]
            dest.issues[new] = i
            dest.comments[new] = r.comments.pop(number, [])
            r.gone[number] = f"{self.url}/repos/{dest.info.full_name}/issues/{new}"
            return new

    def set_labels(self, repo: str, number: int, labels: Iterable[str]) -> None:
        with self._lock:
            r = self._repo_or_raise(repo)
            i = self._issue_or_raise(repo, number)
            i.labels = [self._label(r, n)[1] for n in labels]
            i.updated_at = self._stamp()

    def set_checks(self, repo: str, sha: str, checks: Iterable[Mapping[str, Any]]) -> list[int]:
        """One workflow run for ``sha`` with a job (a check run) per check: ``name``, ``conclusion``
        ("success", "failure", … or None: in progress) and ``log``; the job ids."""
        with self._lock:
            r = self._repo_or_raise(repo)
            pulls = self._pulls_for_sha(r, sha)
            branch = pulls[0].head if pulls else next(
                (b for b in self._branch_names(r) if self._branch_sha(r, b) == sha), None)
            head = self._commit_rec(r, sha)
            title = (r.issues[pulls[0].number].title if pulls else
                     head.message.splitlines()[0] if head and head.message else sha[:7])
            at = self._stamp()
            run = o.RunRec(self._next_id(), len(r.runs) + 1, self._next_id(), sha, branch,
                           "pull_request" if pulls else "push", title, at)
            for check in checks:
                self._job_ids += 1
                job = o.JobRec(self._job_ids, str(check["name"]), check.get("conclusion"),
                               str(check.get("log", "")), at, run.id)
                run.jobs.append(job)
                self._logs[job.id] = job.log
            r.runs.append(run)
            return [j.id for j in run.jobs]

    def merge_pull(self, repo: str, number: int) -> str:
        """Merge an open pull request: a merge commit on its base branch; its sha."""
        with self._lock:
            r = self._repo_or_raise(repo)
            p = r.pulls.get(number)
            if p is None:
                raise KeyError(f"{repo} has no pull request #{number}")
            i = r.issues[number]
            if i.state != "open":
                raise ValueError(f"{repo}#{number} is {i.state}, not open")
            self._refresh(r, p)
            sha = self._commit(r, p.base, f"Merge pull request #{number} from {r.info.owner}/{p.head}"
                               f"\n\n{i.title}", [p.base_sha, p.head_sha], merge_head=p.head_sha)
            at = self._stamp()
            p.merged, p.merged_at, p.merge_commit_sha = True, at, sha
            i.state, i.closed_at, i.updated_at, i.merged_at = "closed", at, at, at
            return sha

    def exhaust(self, reset_in: float) -> None:
        """The primary rate limit is used up until ``reset_in`` seconds from now: 403s till then."""
        with self._lock:
            self._exhausted_until = time.time() + reset_in
            self._used = self._limit

    def secondary_limit(self, retry_after: int, status: int = 403) -> None:
        """The next API request gets a secondary rate limit (403 or 429) with ``Retry-After``."""
        if status not in (403, 429):
            raise ValueError(f"a secondary rate limit answers 403 or 429, not {status}")
        with self._lock:
            self._secondary = (status, retry_after)

    # reads for the tests

    def comments_of(self, repo: str, number: int) -> list[str]:
        with self._lock:
            return [c["body"] for c in self._repo_or_raise(repo).comments.get(number, [])]

    def labels_of(self, repo: str, number: int) -> list[str]:
        with self._lock:
            return list(self._issue_or_raise(repo, number).labels)

    def pulls_of(self, repo: str) -> dict[int, o.PullRec]:
        with self._lock:
            return dict(self._repo_or_raise(repo).pulls)

    def rate_remaining(self) -> int:
        with self._lock:
            self._roll_window()
            return max(0, self._limit - self._used)

    # ------------------------------------------------------------------------------------------
    # records

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def _next_number(self, r: _Repo) -> int:
        return max([*r.issues, *r.gone], default=0) + 1

    def _stamp(self) -> str:
        """Now, in whole seconds; a second after the last stamp if that is not earlier."""
        self._clock = max(float(int(time.time())), self._clock + 1)
        return _iso(self._clock)

    def _repo(self, full_name: str) -> _Repo | None:
        return self._repos.get(full_name.lower())

    def _repo_or_raise(self, full_name: str) -> _Repo:
        r = self._repo(full_name)
        if r is None:
            raise KeyError(f"no repository {full_name!r} (add_repo first)")
        return r

    def _issue_or_raise(self, repo: str, number: int) -> o.IssueRec:
        i = self._repo_or_raise(repo).issues.get(number)
        if i is None:
            raise KeyError(f"{repo} has no issue #{number}")
        return i

    def _label(self, r: _Repo, name: str) -> tuple[int, str, str]:
        key = name.lower()
        if key not in r.labels:
            color = hashlib.sha1(key.encode()).hexdigest()[:6]
            r.labels[key] = (self._next_id(), name, color)
        return r.labels[key]

    def _milestone(self, r: _Repo, title: str) -> o.MilestoneRec:
        if title not in r.milestones:
            r.milestones[title] = o.MilestoneRec(len(r.milestones) + 1, self._next_id(), title,
                                                 self._stamp())
        return r.milestones[title]

    # git: the branches and commits, from git_dir or from memory

    def _branch_names(self, r: _Repo) -> list[str]:
        if r.git_dir is None:
            return list(r.branches)
        _, out = _git(r.git_dir, "for-each-ref", "--format=%(refname:short)", "refs/heads")
        return out.split()

    def _branch_sha(self, r: _Repo, branch: str) -> str | None:
        if r.git_dir is None:
            return r.branches.get(branch)
        code, out = _git(r.git_dir, "rev-parse", "--verify", "-q", f"refs/heads/{branch}^{{commit}}")
        return out.strip() if code == 0 else None

    def _resolve(self, r: _Repo, ref: str) -> str | None:
        """The sha a branch name or a (full) sha names."""
        sha = self._branch_sha(r, ref)
        if sha is not None:
            return sha
        return ref if self._commit_rec(r, ref) is not None else None

    def _commit_rec(self, r: _Repo, sha: str) -> o.CommitRec | None:
        if r.git_dir is None:
            return r.commits.get(sha)
        recs = self._git_log(r.git_dir, sha, ["-1"])
        return recs[0] if recs and recs[0].sha == sha else None

    @staticmethod
    def _git_log(git_dir: Path, rev: str, extra: list[str]) -> list[o.CommitRec]:
        code, out = _git(git_dir, "log", *extra,
                         "--format=%H%x1f%P%x1f%an%x1f%ae%x1f%at%x1f%ct%x1f%T%x1f%B%x1e", rev, "--")
        if code != 0:
            return []
        recs = []
        for entry in out.split("\x1e"):
            entry = entry.strip("\n")
            if not entry:
                continue
            sha, parents, name, email, at, ct, tree, msg = entry.split("\x1f")
            recs.append(o.CommitRec(sha, msg.rstrip("\n"), parents.split(), (name, email),
                                    _iso(int(at)), _iso(int(ct)), tree))
        return recs

    def _history(self, r: _Repo, sha: str) -> list[o.CommitRec]:
        """The commits reachable from ``sha``, newest first (as GET /commits lists them)."""
        if r.git_dir is not None:
            return self._git_log(r.git_dir, sha, [])
        seen: list[o.CommitRec] = []
        queue, known = [sha], set()
        while queue:
            c = r.commits.get(queue.pop(0))
            if c is None or c.sha in known:
                continue
            known.add(c.sha)
            seen.append(c)
            queue.extend(c.parents)
        return sorted(seen, key=lambda c: c.committed_at, reverse=True)

    def _commit(self, r: _Repo, branch: str, message: str, parents: list[str],
                merge_head: str | None = None) -> str:
        at = self._stamp()
        if r.git_dir is None:
            sha = hashlib.sha1(f"{branch}\0{message}\0{parents}\0{self._next_id()}".encode()).hexdigest()
            tree = r.commits[merge_head or parents[0]].tree if parents else hashlib.sha1(b"").hexdigest()
            r.commits[sha] = o.CommitRec(sha, message, parents, ("GitHub", "noreply@github.com"),
                                         at, at, tree)
            r.branches[branch] = sha
        else:
            tree = ""
            if merge_head is not None and len(parents) == 2:
                code, out = _git(r.git_dir, "merge-tree", "--write-tree", parents[0], merge_head)
                tree = out.split()[0] if code == 0 and out else ""
            if not tree:
                source = merge_head or (parents[0] if parents else None)
                if source is None:
                    _, out = _git(r.git_dir, "hash-object", "-t", "tree", "-w", "--stdin")
                    tree = out.strip()
                else:
                    _, out = _git(r.git_dir, "rev-parse", f"{source}^{{tree}}")
                    tree = out.strip()
            args = ["commit-tree", tree, "-m", message]
            for p in parents:
                args += ["-p", p]
            code, out = _git(r.git_dir, *args, env=GITHUB_IDENTITY)
            if code != 0:
                raise RuntimeError(f"git commit-tree in {r.git_dir} failed")
            sha = out.strip()
            old = parents[0] if parents else ""
            code, _ = _git(r.git_dir, "update-ref", f"refs/heads/{branch}", sha, old)
            if code != 0:
                raise RuntimeError(f"git update-ref refs/heads/{branch} in {r.git_dir} failed")
        r.pushed_at = at
        return sha

    def _refresh(self, r: _Repo, p: o.PullRec) -> None:
        """An open pull request's head and base SHAs, read again from its branches."""
        if r.issues[p.number].state != "open":
            return
        p.head_sha = self._branch_sha(r, p.head) or p.head_sha
        p.base_sha = self._branch_sha(r, p.base) or p.base_sha

    def _pulls_for_sha(self, r: _Repo, sha: str) -> list[o.PullRec]:
        found = []
        for p in r.pulls.values():
            self._refresh(r, p)
            if p.head_sha == sha:
                found.append(p)
        return found

    # JSON objects

    def _label_objs(self, r: _Repo, names: list[str]) -> list[dict[str, Any]]:
        return [o.label(self.url, r.info, lname, lid, color)
                for lid, lname, color in (self._label(r, n) for n in names)]

    def _milestone_obj(self, r: _Repo, number: int | None) -> dict[str, Any] | None:
        m = next((m for m in r.milestones.values() if m.number == number), None)
        if m is None:
            return None
        of = [i for i in r.issues.values() if i.milestone == number]
        return o.milestone(self.url, r.info, m, BOT, sum(i.state == "open" for i in of),
                           sum(i.state == "closed" for i in of))

    def _issue_obj(self, r: _Repo, i: o.IssueRec) -> dict[str, Any]:
        return o.issue(self.url, r.info, i, self._label_objs(r, i.labels),
                       self._milestone_obj(r, i.milestone))

    def _pull_obj(self, r: _Repo, p: o.PullRec, full: bool) -> dict[str, Any]:
        self._refresh(r, p)
        i = r.issues[p.number]
        open_issues = sum(x.state == "open" for x in r.issues.values())
        repo = o.repository(self.url, r.info, open_issues, r.pushed_at)
        return o.pull(self.url, r.info, i, p, self._label_objs(r, i.labels),
                      self._milestone_obj(r, i.milestone), repo, full=full)

    # ------------------------------------------------------------------------------------------
    # answering a request

    def _rate_headers(self, authenticated: bool) -> dict[str, str]:
        if not authenticated:
            limit, used = UNAUTHENTICATED_LIMIT, min(self._unauth_used, UNAUTHENTICATED_LIMIT)
        else:
            limit, used = self._limit, min(self._used, self._limit)
        reset = math.ceil(self._exhausted_until or self._reset)
        return {"x-ratelimit-limit": str(limit), "x-ratelimit-remaining": str(limit - used),
                "x-ratelimit-used": str(used), "x-ratelimit-reset": str(reset),
                "x-ratelimit-resource": "core"}

    def _roll_window(self) -> None:
        now = time.time()
        if self._exhausted_until and now >= self._exhausted_until:
            self._exhausted_until, self._used, self._reset = 0.0, 0, now + WINDOW
        elif not self._exhausted_until and now >= self._reset:
            self._used, self._reset = 0, now + WINDOW

    def handle(self, method: str, target: str, headers: Mapping[str, str],
               body: bytes) -> tuple[int, dict[str, str], bytes]:
        """Answer one request (what the HTTP handler calls): status, headers, body."""
        parts = urlsplit(target)
        path = parts.path
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        h = {k.lower(): v for k, v in headers.items()}
        conditional = "if-none-match" in h
        if path.startswith("/_logs/"):
            status, out_headers, out = self._serve_log(method, path)
        else:
            status, out_headers, out = self._api(method, target, path, query, h, body, conditional)
        with self._lock:
            self.requests.append(Request(method, path, query, status, conditional))
        return status, out_headers, out

    def _serve_log(self, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        with self._lock:
            text = self._logs.get(int(path.rsplit("/", 1)[1])) if path.rsplit("/", 1)[1].isdigit() else None
        if method != "GET" or text is None:
            return 404, {"content-type": "text/plain; charset=utf-8"}, b"Not Found"
        return 200, {"content-type": "text/plain; charset=utf-8"}, text.encode()

    def _api(self, method: str, target: str, path: str, query: dict[str, str], h: dict[str, str],
             body: bytes, conditional: bool) -> tuple[int, dict[str, str], bytes]:
        problems = self._spec.request_problems(method, target, h, body)
        op = self._spec.operation(method, path)
        with self._lock:
            self._roll_window()
            auth = h.get("authorization", "")
            scheme, _, given = auth.partition(" ")
            authenticated = scheme.lower() in ("bearer", "token") and given.strip() == self.token
            reply = self._gate(auth, authenticated, op)
            if reply is None:
                assert op is not None
                reply = self._dispatch(op, path, query, body, problems)
            out = b""
            headers = {
                "x-github-api-version-selected": "2022-11-28",
                "x-github-media-type": "github.v3; format=json",
                "x-github-request-id": secrets.token_hex(8).upper(),
                "vary": "Accept, Authorization, Cookie, X-GitHub-OTP",
                **reply.headers,
            }
            if reply.body is not None:
                out = json.dumps(reply.body, separators=(",", ":")).encode()
                headers["content-type"] = JSON
            status = reply.status
            if method == "GET" and status == 200:
                etag = f'W/"{hashlib.sha256(out).hexdigest()}"'
                headers["etag"] = etag
                headers["cache-control"] = "private, max-age=60, s-maxage=60"
                if _matches(h.get("if-none-match", ""), etag):
                    status, out = 304, b""
                    headers.pop("content-type", None)
                    headers.pop("link", None)
            if authenticated and status != 304:
                self._used += 1
            elif not authenticated:
                self._unauth_used += 1
            headers.update(self._rate_headers(authenticated))
        if op is not None:
            problems += self._spec.response_problems(op, status, headers, out, conditional=conditional)
        if problems:
            with self._lock:
                self.problems.extend(problems)
        return status, headers, out

    def _gate(self, auth: str, authenticated: bool, op: Operation | None) -> Reply | None:
        """Refusals before the operation: unknown path, credentials, rate limits."""
        if op is None:
            return Reply(404, o.error("Not Found", REST_DOCS, 404))
        if not authenticated:
            message = "Requires authentication" if not auth else "Bad credentials"
            return Reply(401, o.error(message, REST_DOCS, 401))
        if self._secondary is not None:
            status, retry_after = self._secondary
            self._secondary = None
            return Reply(status, o.error(
                "You have exceeded a secondary rate limit. Please wait a few minutes before you try "
                f"again. If you reach out to GitHub Support for help, please include the request ID "
                f"{secrets.token_hex(8).upper()}.", f"{RATE_DOCS}#about-secondary-rate-limits", status),
                {"retry-after": str(retry_after)})
        if self._exhausted_until:
            self._used = self._limit - 1  # counted to the limit below
            return Reply(403, o.error(
                f"API rate limit exceeded for user ID {o.user_id(BOT)}. If you reach out to GitHub "
                f"Support for help, please include the request ID {secrets.token_hex(8).upper()}.",
                RATE_DOCS, 403))
        return None

    def _dispatch(self, op: Operation, path: str, query: dict[str, str], body: bytes,
                  problems: list[str]) -> Reply:
        doc = str(op.spec.get("externalDocs", {}).get("url", REST_DOCS))
        answer = ROUTES.get(op.id)
        if answer is None:
            problems.append(f"{op.method} {path}: the stand-in does not answer {op.id}")
            return Reply(404, o.error("Not Found", doc, 404))
        segments = op.template.strip("/").split("/")
        values = [unquote(v) for v in path.strip("/").split("/")]
        params = {s[1:-1]: v for s, v in zip(segments, values, strict=True) if s.startswith("{")}
        r = self._repo(f"{params.get('owner')}/{params.get('repo')}")
        if r is None:
            return Reply(404, o.error("Not Found", doc, 404))
        try:
            data = json.loads(body) if body else None
        except ValueError:
            return Reply(400, o.error("Problems parsing JSON", doc, 400))
        try:
            return answer(self, _Call(r, params, query, data, doc, path,
                                      frozenset(str(k) for k in op.spec.get("responses") or {})))
        except _Refused as refused:
            return refused.reply

    # pagination

    def _page(self, items: list[Any], call: _Call) -> tuple[list[Any], dict[str, str]]:
        per_page = min(MAX_PER_PAGE, max(1, _int(call.query.get("per_page"), 30)))
        page = max(1, _int(call.query.get("page"), 1))
        last = max(1, math.ceil(len(items) / per_page))
        chunk = items[(page - 1) * per_page: page * per_page]

        def link(n: int) -> str:
            q = {**call.query, "page": str(n)}
            return f"<{self.url}{quote(call.path)}?{urlencode(q)}>"

        rels = []
        if page > 1:
            rels.append(f'{link(min(page - 1, last))}; rel="prev"')
        if page < last:
            rels += [f'{link(page + 1)}; rel="next"', f'{link(last)}; rel="last"']
        if page > 1:
            rels.append(f'{link(1)}; rel="first"')
        return chunk, ({"link": ", ".join(rels)} if rels else {})


def _matches(if_none_match: str, etag: str) -> bool:
    if not if_none_match:
        return False
    strip = etag.removeprefix("W/")
    return any(t.strip() == "*" or t.strip().removeprefix("W/") == strip
               for t in if_none_match.split(","))


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


@dataclass
class _Call:
    repo: _Repo
    params: dict[str, str]
    query: dict[str, str]
    data: Any
    doc: str  # the operation's documentation_url
    path: str
    statuses: frozenset[str] = frozenset()  # what the description says the operation may answer

    def number(self, name: str) -> int:
        return _int(self.params.get(name), -1)

    def not_found(self, message: str = "Not Found") -> _Refused:
        return _Refused(Reply(404, o.error(message, self.doc, 404)))

    def gone(self, number: int) -> _Refused:
        """The answer about an issue deleted or transferred (the module docstring)."""
        moved = self.repo.gone[number]
        if moved is None:
            return _Refused(Reply(410, o.error("This issue was deleted", self.doc, 410)))
        if "301" not in self.statuses:
            return self.not_found()
        where = moved + self.path.split(f"/issues/{number}", 1)[1]
        return _Refused(Reply(301, o.error("Moved Permanently", self.doc, 301, url=where), {"location": where}))

    def invalid(self, *errors: dict[str, Any]) -> _Refused:
        return _Refused(Reply(422, o.error("Validation Failed", self.doc, 422, errors=list(errors))))


# ------------------------------------------------------------------------------------------------
# the operations, by the description's operation id


def _sorted_issues(items: list[o.IssueRec], sort: str, direction: str) -> list[o.IssueRec]:
    key: Callable[[o.IssueRec], Any] = {
        "updated": lambda i: (i.updated_at, i.number),
        "comments": lambda i: (i.comments, i.number),
    }.get(sort, lambda i: (i.created_at, i.number))
    return sorted(items, key=key, reverse=direction != "asc")


def list_issues(gh: GitHubStandIn, c: _Call) -> Reply:
    q = c.query
    state = q.get("state", "open")
    items = [i for i in c.repo.issues.values() if state == "all" or i.state == state]
    if q.get("labels"):
        wanted = {n.strip().lower() for n in q["labels"].split(",") if n.strip()}
        items = [i for i in items if wanted <= {n.lower() for n in i.labels}]
    if "assignee" in q:
        a = q["assignee"]
        items = [i for i in items if (i.assignee is None if a == "none" else i.assignee is not None
                                      if a == "*" else (i.assignee or "").lower() == a.lower())]
    if "creator" in q:
        items = [i for i in items if i.author.lower() == q["creator"].lower()]
    if "milestone" in q:
        m = q["milestone"]
        if m == "none":
            items = [i for i in items if i.milestone is None]
        elif m == "*":
            items = [i for i in items if i.milestone is not None]
        else:
            items = [i for i in items if i.milestone == _int(m, -1)]
    if "since" in q:
        since = _parse_time(q["since"])
        if since is None:
            raise c.invalid({"resource": "Issue", "field": "since", "code": "invalid"})
        items = [i for i in items if (_parse_time(i.updated_at) or 0) >= since]
    items = _sorted_issues(items, q.get("sort", "created"), q.get("direction", "desc"))
    chunk, headers = gh._page(items, c)
    return Reply(200, [gh._issue_obj(c.repo, i) for i in chunk], headers)


def get_issue(gh: GitHubStandIn, c: _Call) -> Reply:
    return Reply(200, gh._issue_obj(c.repo, _issue(c)))


def _issue(c: _Call) -> o.IssueRec:
    number = c.number("issue_number")
    i = c.repo.issues.get(number)
    if i is None:
        raise c.gone(number) if number in c.repo.gone else c.not_found()
    return i


def list_comments(gh: GitHubStandIn, c: _Call) -> Reply:
    i = _issue(c)
    items = c.repo.comments.get(i.number, [])
    if "since" in c.query:
        since = _parse_time(c.query["since"]) or 0
        items = [x for x in items if (_parse_time(x["updated_at"]) or 0) >= since]
    chunk, headers = gh._page(items, c)
    return Reply(200, chunk, headers)


def create_comment(gh: GitHubStandIn, c: _Call) -> Reply:
    i = _issue(c)
    text = c.data.get("body") if isinstance(c.data, dict) else None
    if not isinstance(text, str) or not text:
        raise c.invalid({"resource": "IssueComment", "field": "body", "code": "missing_field"})
    at = gh._stamp()
    obj = o.comment(gh.url, c.repo.info, i.number, gh._next_id(), text, BOT, at)
    c.repo.comments.setdefault(i.number, []).append(obj)
    i.comments += 1
    i.updated_at = at
    return Reply(201, obj, {"location": obj["url"]})


def add_labels(gh: GitHubStandIn, c: _Call) -> Reply:
    i = _issue(c)
    given = c.data.get("labels") if isinstance(c.data, dict) else c.data
    if not isinstance(given, list):
        raise c.invalid({"resource": "Label", "field": "labels", "code": "missing_field"})
    names: list[str] = []
    for x in given:
        n = x.get("name") if isinstance(x, dict) else x
        if not isinstance(n, str) or not n:
            raise c.invalid({"resource": "Label", "field": "name", "code": "invalid"})
        names.append(n)
    for n in names:
        canonical = gh._label(c.repo, n)[1]
        if canonical.lower() not in {x.lower() for x in i.labels}:
            i.labels.append(canonical)
    i.updated_at = gh._stamp()
    return Reply(200, gh._label_objs(c.repo, i.labels))


def remove_label(gh: GitHubStandIn, c: _Call) -> Reply:
    i = _issue(c)
    name = c.params["name"].lower()
    if name not in {x.lower() for x in i.labels}:
        raise c.not_found("Label does not exist")
    i.labels = [x for x in i.labels if x.lower() != name]
    i.updated_at = gh._stamp()
    return Reply(200, gh._label_objs(c.repo, i.labels))


def list_pulls(gh: GitHubStandIn, c: _Call) -> Reply:
    q = c.query
    state = q.get("state", "open")
    items = [p for p in c.repo.pulls.values()
             if state == "all" or c.repo.issues[p.number].state == state]
    head = q.get("head", "")
    if ":" in head:  # GitHub filters by head only in the form owner:branch
        owner, _, branch = head.partition(":")
        items = [p for p in items if owner.lower() == c.repo.info.owner.lower() and p.head == branch]
    if q.get("base"):
        items = [p for p in items if p.base == q["base"]]
    sort = q.get("sort", "created")
    direction = q.get("direction", "desc" if sort == "created" else "asc")
    recs = _sorted_issues([c.repo.issues[p.number] for p in items],
                          "updated" if sort in ("updated", "long-running") else "created", direction)
    chunk, headers = gh._page([c.repo.pulls[i.number] for i in recs], c)
    return Reply(200, [gh._pull_obj(c.repo, p, full=False) for p in chunk], headers)


def create_pull(gh: GitHubStandIn, c: _Call) -> Reply:
    d = c.data if isinstance(c.data, dict) else {}
    r = c.repo
    for f in ("head", "base", "title"):
        if not isinstance(d.get(f), str) or not d[f]:
            raise c.invalid({"resource": "PullRequest", "field": f, "code": "missing_field"})
    owner, _, branch = d["head"].rpartition(":")
    if owner and owner.lower() != r.info.owner.lower():
        raise c.invalid({"resource": "PullRequest", "field": "head", "code": "invalid"})
    head_sha = gh._branch_sha(r, branch)
    base_sha = gh._branch_sha(r, d["base"])
    if head_sha is None:
        raise c.invalid({"resource": "PullRequest", "field": "head", "code": "invalid"})
    if base_sha is None:
        raise c.invalid({"resource": "PullRequest", "field": "base", "code": "invalid"})
    for p in r.pulls.values():
        if p.head == branch and r.issues[p.number].state == "open":
            raise c.invalid({"resource": "PullRequest", "code": "custom",
                             "message": f"A pull request already exists for {r.info.owner}:{branch}."})
    if head_sha == base_sha:
        raise c.invalid({"resource": "PullRequest", "code": "custom",
                         "message": f"No commits between {d['base']} and {branch}"})
    at = gh._stamp()
    number = gh._next_number(r)
    body = d.get("body") if isinstance(d.get("body"), str) else None
    r.issues[number] = o.IssueRec(number, gh._next_id(), d["title"], body, BOT, at, at, is_pull=True)
    p = o.PullRec(number, gh._next_id(), branch, d["base"], bool(d.get("draft", False)), head_sha,
                  base_sha)
    r.pulls[number] = p
    obj = gh._pull_obj(r, p, full=True)
    return Reply(201, obj, {"location": obj["url"]})


def get_pull(gh: GitHubStandIn, c: _Call) -> Reply:
    p = c.repo.pulls.get(c.number("pull_number"))
    if p is None:
        raise c.not_found()
    return Reply(200, gh._pull_obj(c.repo, p, full=True))


def list_check_runs(gh: GitHubStandIn, c: _Call) -> Reply:
    q = c.query
    sha = gh._resolve(c.repo, c.params["ref"]) or c.params["ref"]
    runs = [run for run in c.repo.runs if run.head_sha == sha]
    jobs = [(run, j) for run in runs for j in run.jobs]
    if q.get("filter", "latest") == "latest":
        newest: dict[str, tuple[o.RunRec, o.JobRec]] = {}
        for run, j in jobs:
            newest[j.name] = (run, j)
        jobs = list(newest.values())
    if q.get("check_name"):
        jobs = [(run, j) for run, j in jobs if j.name == q["check_name"]]
    if q.get("status"):
        want = q["status"]
        jobs = [(run, j) for run, j in jobs
                if ("completed" if j.conclusion is not None else "in_progress") == want]
    if q.get("app_id") and _int(q["app_id"], -1) != o.ACTIONS_APP_ID:
        jobs = []
    jobs.sort(key=lambda rj: -rj[1].id)
    pulls = gh._pulls_for_sha(c.repo, sha)
    chunk, headers = gh._page(jobs, c)
    return Reply(200, {"total_count": len(jobs),
                       "check_runs": [o.check_run(gh.url, c.repo.info, run, j, pulls)
                                      for run, j in chunk]}, headers)


def list_workflow_runs(gh: GitHubStandIn, c: _Call) -> Reply:
    q = c.query
    runs = list(reversed(c.repo.runs))
    if q.get("head_sha"):
        runs = [x for x in runs if x.head_sha == q["head_sha"]]
    if q.get("branch"):
        runs = [x for x in runs if x.head_branch == q["branch"]]
    if q.get("event"):
        runs = [x for x in runs if x.event == q["event"]]
    if q.get("status"):
        runs = [x for x in runs if q["status"] in (x.status, x.conclusion)]
    if q.get("check_suite_id"):
        runs = [x for x in runs if x.check_suite_id == _int(q["check_suite_id"], -1)]
    chunk, headers = gh._page(runs, c)
    exclude = q.get("exclude_pull_requests") == "true"
    return Reply(200, {"total_count": len(runs), "workflow_runs": [
        o.workflow_run(gh.url, c.repo.info, x, gh._commit_rec(c.repo, x.head_sha),
                       [] if exclude else gh._pulls_for_sha(c.repo, x.head_sha)) for x in chunk]},
        headers)


def job_logs(gh: GitHubStandIn, c: _Call) -> Reply:
    job_id = c.number("job_id")
    if not any(j.id == job_id for run in c.repo.runs for j in run.jobs):
        raise c.not_found()
    return Reply(302, None, {"location": f"{gh.url}/_logs/{job_id}", "content-length": "0"})


def list_commits(gh: GitHubStandIn, c: _Call) -> Reply:
    q = c.query
    ref = q.get("sha") or c.repo.info.default_branch
    sha = gh._resolve(c.repo, ref)
    if sha is None:
        if not gh._branch_names(c.repo):
            raise _Refused(Reply(409, o.error("Git Repository is empty.", c.doc, 409)))
        raise c.not_found(f"No commit found for SHA: {ref}")
    history = gh._history(c.repo, sha)
    if q.get("since"):
        since = _parse_time(q["since"]) or 0
        history = [x for x in history if (_parse_time(x.committed_at) or 0) >= since]
    if q.get("until"):
        until = _parse_time(q["until"]) or math.inf
        history = [x for x in history if (_parse_time(x.committed_at) or 0) <= until]
    chunk, headers = gh._page(history, c)
    return Reply(200, [o.commit(gh.url, c.repo.info, x) for x in chunk], headers)


ROUTES: dict[str, Callable[[GitHubStandIn, _Call], Reply]] = {
    "issues/list-for-repo": list_issues,
    "issues/get": get_issue,
    "issues/list-comments": list_comments,
    "issues/create-comment": create_comment,
    "issues/add-labels": add_labels,
    "issues/remove-label": remove_label,
    "pulls/list": list_pulls,
    "pulls/create": create_pull,
    "pulls/get": get_pull,
    "checks/list-for-ref": list_check_runs,
    "actions/list-workflow-runs-for-repo": list_workflow_runs,
    "actions/download-job-logs-for-workflow-run": job_logs,
    "repos/list-commits": list_commits,
}


def _handler(gh: GitHubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: clients reuse their connections

        def setup(self) -> None:
            super().setup()
            # headers and body go out in two writes: without this, Nagle and the client's delayed
            # ACK hold every response ~40 ms
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _serve(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            try:
                status, headers, out = gh.handle(self.command, self.path, dict(self.headers.items()), body)
            except Exception as exc:  # a bug of the stand-in: a 500 and a problem, not a hang
                with gh._lock:
                    gh.problems.append(f"{self.command} {self.path}: the stand-in failed: {exc!r}")
                status, headers, out = 500, {"content-type": JSON}, b'{"message":"Server Error"}'
            self.send_response(status)
            for k, v in headers.items():
                if k != "content-length":
                    self.send_header(k, v)
            if status not in (204, 304):
                self.send_header("content-length", str(len(out)))
            self.end_headers()
            if out and status not in (204, 304):
                self.wfile.write(out)

        do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:  # quiet: .requests has them
            pass

    return Handler

