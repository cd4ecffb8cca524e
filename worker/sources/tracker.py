"""What a source's pass needs of an issue tracker: the :class:`Tracker` protocol and its shapes.

GitHub is the one built (:mod:`worker.sources.github`); Linear, GitLab or Jira would be one module
more implementing this protocol. A tracker reads and writes; it decides nothing: every decision is
a ``fleet.source_*`` function (:mod:`worker.sources.passes` carries the answers there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from worker.errors import FleetError


def as_time(value: Any) -> datetime | None:
    """An ISO 8601 time as trackers and the database's JSON write it (``Z`` or an offset), or None."""
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")) if value else None


class SourceError(FleetError):
    """A tracker refused or failed a request about one item (an answer that is not what its API
    describes, a server error): the pass says so, naming the item, and goes on with the others."""


class SourceDown(SourceError):
    """The tracker cannot be asked anything now, whatever the item (the token refused, the repository
    not found, the network down): the pass stops, and says so."""


class RateLimited(SourceDown):
    """The tracker said to wait longer than the pass may (``until``: when it may be asked again)."""

    def __init__(self, message: str, until: datetime) -> None:
        super().__init__(message)
        self.until = until


class ItemGone(SourceError):
    """The item is not in the tracker any more (GitHub: deleted, 410; transferred to another
    repository, 301; not found, 404, by a read while its repository answers): ``why`` says which."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


class PullRequestRefused(SourceError):
    """The tracker will not open the pull request of a branch: ``reason`` no-commits (nothing on the
    branch that its base lacks) or pr-refused (any other refusal: ``str()`` has the tracker's words)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Item:
    """An issue of the tracker."""

    number: int
    title: str
    body: str
    labels: tuple[str, ...]
    open: bool
    url: str
    updated_at: datetime
    assignees: tuple[str, ...] = ()
    milestone: str | None = None  # its title
    milestone_number: int | None = None
    is_pull: bool = False  # GitHub lists pull requests among issues


@dataclass(frozen=True)
class PullRequest:
    number: int
    url: str
    state: str  # open | closed
    head_sha: str
    merged_at: datetime | None = None
    merged_sha: str | None = None


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # queued | in_progress | completed | ...
    conclusion: str | None
    job_id: int | None = None  # a GitHub Actions job (its log can be read)
    summary: str = ""


@dataclass(frozen=True)
class Checks:
    """A head SHA's checks and how many CI executions (workflow runs) it had."""

    sha: str
    checks: tuple[Check, ...]
    runs: int

    @property
    def verdict(self) -> str:
        """pending (none yet, or not all complete), success or failure."""
        if not self.checks or any(c.status != "completed" for c in self.checks):
            return "pending"
        return "failure" if self.failing else "success"

    @property
    def failing(self) -> list[Check]:
        return [c for c in self.checks if c.status == "completed" and c.conclusion not in PASSING]


#: the conclusions of a completed check that let a change through
PASSING = frozenset({"success", "neutral", "skipped"})


@dataclass(frozen=True)
class Commit:
    sha: str
    message: str
    date: datetime


@dataclass
class Traffic:
    """What a pass asked of the tracker: requests sent, answered 304 (from the cache), waits."""

    requests: int = 0
    not_modified: int = 0
    waited_seconds: float = 0.0
    by_status: dict[int, int] = field(default_factory=dict)


class Tracker(Protocol):
    """One repository (or project) of an issue tracker, as a source's pass sees it."""

    traffic: Traffic
    #: cache entries this tracker read anew (what the pass stores back: URL → entry, None to drop)
    cache_changes: dict[str, Any]

    def prune_cache(self) -> None:
        """Drop (in ``cache_changes``) the cached answers this pass did not ask for: after a complete
        pass, what it did not ask for is never asked for again (a listing from a cursor passed)."""
        ...

    def changed_items(self, since: datetime | None, labels: list[str]) -> tuple[list[Item], datetime | None]:
        """Items changed since ``since`` (inclusive; None: the first pass, every open item with one of
        ``labels``), and the cursor the next pass starts from."""
        ...

    def comments(self, number: int) -> list[tuple[int, str]]:
        """An item's comments: (id, body), oldest first."""
        ...

    def post_comment(self, number: int, body: str) -> int: ...
    def add_label(self, number: int, label: str) -> None: ...
    def remove_label(self, number: int, label: str) -> None: ...

    def pull_request_for(self, branch: str) -> PullRequest | None:
        """The open pull request whose head is ``branch``, if any (a closed or merged one was an
        earlier attempt's)."""
        ...

    def open_pull_request(self, branch: str, base: str, title: str, body: str) -> PullRequest: ...
    def pull_request(self, number: int) -> PullRequest: ...
    def checks(self, sha: str) -> Checks: ...
    def check_log_tail(self, check: Check, *, chars: int = 3000) -> str: ...
    def commits_since(self, branch: str, since: datetime) -> list[Commit]: ...
    def close(self) -> None: ...
