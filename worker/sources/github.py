"""GitHub's REST API as a :class:`~worker.sources.tracker.Tracker`, over httpx.

Why httpx and a small typed layer rather than a GitHub library: a pass must send conditional
requests from a cache kept in the database (shared by every host, so one host's 304 is another's
too), wait out GitHub's rate limits by its own headers within a bound, and never log its token;
PyGithub and githubkit each keep their own in-process cache and retry policy, and the pass uses a
dozen endpoints. What it sends and reads is checked against GitHub's published OpenAPI description
by the test suite (tests/github_api/).

Conditional requests: every GET carries the ETag of the cached answer (``If-None-Match``); a 304
costs no rate limit and is read from the cache. Only what the pass uses of a body is kept, and only
for the URLs the last complete pass asked for (:meth:`GitHub.prune_cache`): what a pass asks again
and again (the issues since the cursor, a live task's pull request, the checks at a head) it asks
every pass, and the rest (a listing from a cursor passed, the first pass's, a SHA no longer a head)
is never asked for again.
Rate limits: a 403/429 with ``x-ratelimit-remaining: 0`` waits for ``x-ratelimit-reset``, one with
``Retry-After`` for that long (a secondary limit without it: a minute), a spent limit on a 2xx holds
the next request until the reset; a wait longer than the pass's ``max_wait`` raises
:class:`~worker.sources.tracker.RateLimited` with the moment to ask again.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import structlog

from worker.sources.tracker import (
    Check,
    Checks,
    Commit,
    Item,
    ItemGone,
    PullRequest,
    PullRequestRefused,
    RateLimited,
    SourceDown,
    SourceError,
    Traffic,
    as_time,
)

log = structlog.get_logger("lanefleet.sources")

API_VERSION = "2022-11-28"
PER_PAGE = 100
_NEXT = re.compile(r'<([^>]+)>;\s*rel="next"')
_EPOCH = datetime.fromtimestamp(0, UTC)


def _issue(raw: dict[str, Any]) -> dict[str, Any]:
    """What a pass keeps of an issue (JSON, for the cache)."""
    milestone = raw.get("milestone") or {}
    return {
        "number": raw["number"], "title": raw.get("title") or "", "body": raw.get("body") or "",
        "labels": [lb["name"] if isinstance(lb, dict) else str(lb) for lb in raw.get("labels") or []],
        "open": raw.get("state") == "open", "url": raw.get("html_url") or "", "updated_at": raw["updated_at"],
        "assignees": [a["login"] for a in raw.get("assignees") or [] if a],
        "milestone": milestone.get("title"), "milestone_number": milestone.get("number"),
        "is_pull": "pull_request" in raw,
    }


def _item(kept: dict[str, Any]) -> Item:
    return Item(number=kept["number"], title=kept["title"], body=kept["body"], labels=tuple(kept["labels"]),
                open=kept["open"], url=kept["url"], updated_at=as_time(kept["updated_at"]) or datetime.now(UTC),
                assignees=tuple(kept["assignees"]), milestone=kept["milestone"],
                milestone_number=kept["milestone_number"], is_pull=kept["is_pull"])


def _pull(raw: dict[str, Any]) -> dict[str, Any]:
    return {"number": raw["number"], "url": raw.get("html_url") or "", "state": raw.get("state") or "open",
            "head_sha": (raw.get("head") or {}).get("sha") or "", "merged_at": raw.get("merged_at"),
            "merged_sha": raw.get("merge_commit_sha") if raw.get("merged_at") else None}


def _pull_request(kept: dict[str, Any]) -> PullRequest:
    return PullRequest(number=kept["number"], url=kept["url"], state=kept["state"], head_sha=kept["head_sha"],
                       merged_at=as_time(kept["merged_at"]), merged_sha=kept["merged_sha"])


class GitHub:
    """One repository of GitHub (or of a server speaking its REST API at ``api_url``)."""

    def __init__(self, repository: str, token: str, *, api_url: str = "https://api.github.com",
                 cache: dict[str, Any] | None = None, max_wait: float = 60.0, timeout: float = 20.0,
                 sleep: Callable[[float], None] = time.sleep, what: str = "GitHub") -> None:
        self.repository = repository
        self.owner = repository.split("/", 1)[0]
        self.what = what
        self.max_wait = max_wait
        self.sleep = sleep
        self.cache: dict[str, Any] = dict(cache or {})
        self.cache_changes: dict[str, Any] = {}
        self._asked: set[str] = set()  # the URLs this pass asked for (GET)
        self.traffic = Traffic()
        self._hold_until = 0.0  # a spent rate limit: no request before then (epoch seconds)
        self._base = api_url.rstrip("/")
        self.http = httpx.Client(
            base_url=self._base, timeout=timeout, follow_redirects=False,
            headers={"Accept": "application/vnd.github+json", "X-GitHub-Api-Version": API_VERSION,
                     "Authorization": f"Bearer {token}", "User-Agent": "lanefleet"})

    def close(self) -> None:
        self.http.close()

    def prune_cache(self) -> None:
        """Drop every cached answer this pass did not ask for (a None in ``cache_changes``): call it
        at the end of a complete pass only (one that stopped did not get to ask for all it needs)."""
        for url in list(self.cache):
            if url not in self._asked:
                del self.cache[url]
                self.cache_changes[url] = None

    # -- requests

    def _repo(self, path: str = "") -> str:
        return f"/repos/{self.repository}{path}"

    def _wait(self, until: float, why: str) -> None:
        wait = until - time.time()
        if wait <= 0:
            return
        if wait > self.max_wait:
            raise RateLimited(f"{self.what}: {why}; it may be asked again at "
                              f"{datetime.fromtimestamp(until, UTC):%H:%M:%S} UTC (in {wait:.0f} s)",
                              datetime.fromtimestamp(until, UTC))
        log.info("waiting for GitHub's rate limit", source=self.what, seconds=round(wait, 1), why=why)
        self.traffic.waited_seconds += wait
        self.sleep(wait)

    def _send(self, method: str, url: str, *, json: Any = None, etag: str | None = None) -> httpx.Response:
        for _ in range(4):
            self._wait(self._hold_until, "its rate limit is spent")
            headers = {"If-None-Match": etag} if etag else {}
            try:
                response = self.http.request(method, url, json=json, headers=headers)
            except httpx.HTTPError as exc:
                raise SourceDown(f"{self.what}: {method} {url.split('?')[0]} failed: {exc!r}") from None
            self.traffic.requests += 1
            self.traffic.by_status[response.status_code] = self.traffic.by_status.get(response.status_code, 0) + 1
            h = response.headers
            remaining, reset = h.get("x-ratelimit-remaining"), h.get("x-ratelimit-reset")
            if response.status_code in (403, 429):
                message = _message(response)
                if h.get("retry-after", "").isdigit():
                    self._hold_until = time.time() + int(h["retry-after"])
                elif remaining == "0" and (reset or "").isdigit():
                    self._hold_until = float(int(reset or 0))
                elif "rate limit" in message.lower():  # a secondary limit without Retry-After: a minute
                    self._hold_until = time.time() + 60
                else:
                    return response  # a plain refusal: the caller says what it was
                continue
            if remaining == "0" and (reset or "").isdigit():
                self._hold_until = float(int(reset or 0))
            return response
        raise SourceDown(f"{self.what}: {method} {url.split('?')[0]} still rate-limited after waiting 4 times")

    def _check(self, response: httpx.Response, what: str, *, issue: int | None = None) -> None:
        """Raise for an answer that is not a success: SourceDown for what stops every request (the
        token, the repository), ItemGone for a request about ``issue`` that says it is not there
        any more, else SourceError with GitHub's words."""
        if response.is_success or response.status_code == 304:
            return
        status, message = response.status_code, _message(response)
        if status == 401:
            raise SourceDown(f"{self.what}: GitHub refused the token (401 {message})",
                             "give the source a valid token (its token_env or token_file)")
        if status == 404 and what.startswith("list issues"):
            raise SourceDown(f"{self.what}: repository {self.repository} not found, or the token cannot see it")
        if status == 301 and what.startswith("list issues"):
            raise SourceDown(f"{self.what}: repository {self.repository} moved (301 to "
                             f"{response.headers.get('location') or 'an address GitHub did not give'})",
                             "give the source its repository's new name")
        if issue is not None:
            # GitHub: 410 for an issue deleted, 301 for one transferred (or 404, to a repository the
            # token cannot read). A 404 to a write may be a token without write access: only a read's
            # 404 says the issue is not there (the pass reads after listing the repository's issues)
            where = f" to {response.headers['location']}" if status == 301 and response.headers.get("location") else ""
            why = {410: "deleted", 301: f"transferred{where}"}.get(status)
            if why is None and status == 404 and response.request.method == "GET":
                why = "not found"
            if why is not None:
                raise ItemGone(f"{self.what}: {what}: GitHub answered {status} {message}: issue #{issue} is {why}",
                               f"{status}: {why}")
        raise SourceError(f"{self.what}: {what}: GitHub answered {status} {message}")

    def _get(self, url: str, keep: Callable[[Any], Any], what: str, *,
             issue: int | None = None) -> tuple[Any, str | None, bool]:
        """GET ``url`` conditionally: (what ``keep`` made of its body, its next page's URL, whether it
        changed since the cached answer). ``issue``: the request is about that issue (_check)."""
        cached = self.cache.get(url)
        self._asked.add(url)
        response = self._send("GET", url, etag=cached.get("etag") if cached else None)
        if response.status_code == 304 and cached is not None:
            self.traffic.not_modified += 1
            return cached.get("value"), cached.get("next"), False
        self._check(response, what, issue=issue)
        value = keep(response.json())
        match = _NEXT.search(response.headers.get("link", ""))
        nxt = match.group(1).removeprefix(self._base) if match else None
        entry = {"etag": response.headers.get("etag"), "value": value, "next": nxt}
        if entry["etag"]:
            self.cache[url] = entry
            self.cache_changes[url] = entry
        self._date = response.headers.get("date")
        return value, nxt, True

    def _pages(self, url: str, keep: Callable[[Any], Any], what: str, *,
               issue: int | None = None) -> tuple[list[Any], bool]:
        out: list[Any] = []
        changed = False
        next_url: str | None = url
        while next_url:
            value, next_url, page_changed = self._get(next_url, keep, what, issue=issue)
            out.extend(value or [])
            changed |= page_changed
        return out, changed

    def _write(self, method: str, url: str, body: Any, what: str, *, ok: tuple[int, ...] = (),
               issue: int | None = None) -> httpx.Response:
        response = self._send(method, url, json=body)
        if response.status_code not in ok:
            self._check(response, what, issue=issue)
        return response

    # -- the Tracker

    def _issues(self, params: dict[str, str]) -> list[dict[str, Any]]:
        """Every issue of a listing sorted by ``updated`` ascending, each page after the first asked as
        the listing ``since`` the last ``updated_at`` read (GitHub's since is inclusive), not by its
        page number: an issue updated while the pages are read moves to the end of the listing, and
        by page numbers the one that was first on the next page would slide onto the page read, never
        to be read (and the cursor would pass it). Read since, it is on a page still to come; what a
        page and the next both hold is read twice, the later one kept. A full page all of one second
        cannot move the since: then the next page of that listing, by its number. The URLs are the
        same each pass over the same issues, so a quiet pass gets its 304s."""
        keep = lambda body: [_issue(raw) for raw in body]  # noqa: E731
        out: list[dict[str, Any]] = []
        since, page = params.get("since"), 1
        while True:
            query = {**params, **({"since": since} if since else {}), **({"page": str(page)} if page > 1 else {})}
            value, nxt, _ = self._get(self._repo(f"/issues?{urlencode(query)}"), keep, "list issues")
            value = value or []
            out += value
            if not nxt or not value:
                return out
            last = value[-1]["updated_at"]
            moved = since is None or (as_time(last) or _EPOCH) > (as_time(since) or _EPOCH)
            since, page = (last, 1) if moved else (since, page + 1)

    def changed_items(self, since: datetime | None, labels: list[str]) -> tuple[list[Item], datetime | None]:
        self._date = None
        kept: list[dict[str, Any]] = []
        if since is None:  # the first pass: the open issues of each label (GitHub ANDs its labels filter)
            for label in labels:
                kept += self._issues({"state": "open", "labels": label, "sort": "updated", "direction": "asc",
                                      "per_page": str(PER_PAGE)})
        else:  # then everything updated since: closes, reopens and label changes included
            kept = self._issues({"state": "all", "since": since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                                 "sort": "updated", "direction": "asc", "per_page": str(PER_PAGE)})
        items = list({k["number"]: _item(k) for k in kept}.values())
        cursor = max((i.updated_at for i in items), default=None)
        if cursor is None:
            cursor = since or (parsedate_to_datetime(self._date) if self._date else None)
        return items, cursor

    def comments(self, number: int) -> list[tuple[int, str]]:
        keep = lambda body: [[c["id"], c.get("body") or ""] for c in body]  # noqa: E731
        rows, _ = self._pages(self._repo(f"/issues/{number}/comments?per_page={PER_PAGE}"), keep,
                              f"list the comments of #{number}", issue=number)
        return [(int(i), str(b)) for i, b in rows]

    def post_comment(self, number: int, body: str) -> int:
        response = self._write("POST", self._repo(f"/issues/{number}/comments"), {"body": body},
                               f"comment on #{number}", issue=number)
        return int(response.json()["id"])

    def add_label(self, number: int, label: str) -> None:
        self._write("POST", self._repo(f"/issues/{number}/labels"), {"labels": [label]},
                    f"label #{number} {label!r}", issue=number)

    def remove_label(self, number: int, label: str) -> None:
        self._write("DELETE", self._repo(f"/issues/{number}/labels/{quote(label, safe='')}"), None,
                    f"take label {label!r} off #{number}", ok=(404,),  # not there: as good as removed
                    issue=number)

    def pull_request_for(self, branch: str) -> PullRequest | None:
        # open ones only: a closed or merged one of the branch was an earlier attempt's (an issue
        # reopened after its merge), and the attempt now in ci is judged on a pull request of its own
        query = urlencode({"state": "open", "head": f"{self.owner}:{branch}", "per_page": PER_PAGE})
        pulls, _ = self._pages(self._repo(f"/pulls?{query}"), lambda body: [_pull(p) for p in body],
                               f"find the pull request of {branch}")
        return _pull_request(pulls[0]) if pulls else None

    def open_pull_request(self, branch: str, base: str, title: str, body: str) -> PullRequest:
        response = self._write("POST", self._repo("/pulls"), {"title": title, "head": branch, "base": base,
                                                              "body": body}, f"open a pull request for {branch}",
                               ok=(422,))
        if response.status_code == 422:  # one exists already (another pass, a person): that one
            found = self.pull_request_for(branch)
            if found is not None:
                return found
            # else GitHub will not open it: nothing on the branch over its base (the agent changed
            # nothing), no such branch (its push failed), …: its words, for a person
            errors = _errors(response)
            reason = "no-commits" if any(e.startswith("No commits between") for e in errors) else "pr-refused"
            raise PullRequestRefused(f"{self.what}: open a pull request for {branch} into {base}: GitHub answered "
                                     f"422 {_message(response)}" + (f": {'; '.join(errors)}" if errors else ""),
                                     reason)
        return _pull_request(_pull(response.json()))

    def pull_request(self, number: int) -> PullRequest:
        kept, _, _ = self._get(self._repo(f"/pulls/{number}"), _pull, f"read pull request #{number}")
        return _pull_request(kept)

    def checks(self, sha: str) -> Checks:
        def keep_checks(body: dict[str, Any]) -> list[dict[str, Any]]:
            return [{"name": c["name"], "status": c["status"], "conclusion": c.get("conclusion"),
                     "job_id": c["id"] if ((c.get("app") or {}).get("slug") == "github-actions") else None,
                     "summary": ((c.get("output") or {}).get("summary") or "")[-2000:]}
                    for c in body.get("check_runs") or []]

        # every page: a verdict from the first hundred would miss a failure on the next (a matrix)
        checks, _ = self._pages(self._repo(f"/commits/{sha}/check-runs?per_page={PER_PAGE}"), keep_checks,
                                f"read the checks of {sha[:12]}")
        runs, _, _ = self._get(self._repo(f"/actions/runs?{urlencode({'head_sha': sha, 'per_page': 1})}"),
                               lambda body: int(body.get("total_count") or 0), f"count the workflow runs of {sha[:12]}")
        return Checks(sha=sha, checks=tuple(Check(**c) for c in checks), runs=int(runs or 0))

    def check_log_tail(self, check: Check, *, chars: int = 3000) -> str:
        if check.job_id is None:
            return check.summary[-chars:]
        response = self._send("GET", self._repo(f"/actions/jobs/{check.job_id}/logs"))
        if response.status_code == 302 and response.headers.get("location"):
            # a short-lived signed URL elsewhere: fetched without the token
            try:
                log_response = httpx.get(response.headers["location"], timeout=self.http.timeout, follow_redirects=True)
            except httpx.HTTPError as exc:
                return f"(its log could not be read: {exc!r})"
            self.traffic.requests += 1
            if log_response.is_success:
                return log_response.text[-chars:]
            return f"(its log could not be read: {log_response.status_code})"
        return check.summary[-chars:] or f"(its log could not be read: {response.status_code})"

    def commits_since(self, branch: str, since: datetime) -> list[Commit]:
        query = urlencode({"sha": branch, "since": since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                           "per_page": PER_PAGE})
        keep = lambda body: [{"sha": c["sha"], "message": (c.get("commit") or {}).get("message") or "",  # noqa: E731
                              "date": ((c.get("commit") or {}).get("committer") or {}).get("date")} for c in body]
        rows, _ = self._pages(self._repo(f"/commits?{query}"), keep, f"list the commits of {branch}")
        return [Commit(sha=r["sha"], message=r["message"], date=as_time(r["date"]) or datetime.now(UTC)) for r in rows]


def _errors(response: httpx.Response) -> list[str]:
    """The ``errors`` of GitHub's 422 (its Validation Failed), each as a phrase."""
    try:
        body = response.json()
    except ValueError:
        return []
    out = []
    for e in (body.get("errors") if isinstance(body, dict) else None) or []:
        if isinstance(e, dict):
            out.append(str(e.get("message") or " ".join(str(e[k]) for k in ("resource", "field", "code") if e.get(k))))
        else:
            out.append(str(e))
    return out


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.reason_phrase
    return str(body.get("message") or response.reason_phrase) if isinstance(body, dict) else response.reason_phrase
