"""A source's pass: read what changed in the tracker, carry it to the ``fleet.source_*`` functions,
write back what they decided. Run by the monitor on its interval and by ``fleet sources sync``.

One pass, in order:

1. ``fleet.source_begin``: the source's row, its cache of answers (ETags), its cursor, and until
   when the tracker must not be asked (a rate limit another host met): before then, no request.
2. The work of the tasks it feeds (``fleet.source_work``): the pull request of each task in ``ci``
   (opened if its branch has none), whose checks are judged at its head (``fleet.source_ci``); the
   pull request of every live task with one, a merge of which ends the task (``fleet.source_pr``).
   Merges first, so that an issue its merge closed is not read as closed outside the fleet.
3. The items changed since the cursor (``fleet.source_sync``): new tasks, external advances.
4. Write-backs (the work again): the claim label, the outcome's comment and label, each once
   (:mod:`worker.sources.writeback`); reverts of recent merges (``fleet.source_reverted``).
5. ``fleet.source_end``: the answers read anew (and, after a complete pass, those it did not ask for
   dropped: the cache holds one pass's answers), the cursor reached, a rate limit's reset, an error.

An error about one item (GitHub refusing one request, a server error) is that item's: the pass
names it (``PassReport.item_errors``, ``fleet.sources.last_error``) and goes on with the others,
and the next pass tries it again. Two are acted on instead: a pull request the tracker will not
open blocks its task for a person (``fleet.source_pr_refused``: no-commits, pr-refused), and an
issue deleted or transferred is marked gone (``fleet.source_gone``: no pass asks about it again).
An error that is not about one item (:class:`~worker.sources.tracker.SourceDown`: the token, the
repository, the network, a rate limit past ``max_rate_wait``) or a failed listing stops the pass
with one line (recorded in ``fleet.sources.last_error``); what it carried to the database before
stands, and the next pass goes on from there.
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import structlog

from worker.config import FleetConfig, SourceConfig
from worker.errors import ConfigError
from worker.sources.items import ref_number, sync_entry
from worker.sources.tracker import (
    Checks,
    ItemGone,
    PullRequest,
    PullRequestRefused,
    RateLimited,
    SourceDown,
    SourceError,
    Tracker,
    Traffic,
    as_time,
)
from worker.sources.writeback import done_comment, failure_comment, marker, pull_request_body
from worker.store.protocol import Store

log = structlog.get_logger("lanefleet.sources")

SYNC_PAGE = 100
LIVE = ("queued", "running", "blocked", "ci", "review")


@dataclass
class PassReport:
    source: str
    skipped: str | None = None  # why the pass asked the tracker nothing
    error: str | None = None
    items: int = 0
    actions: Counter[str] = field(default_factory=Counter)
    traffic: Traffic = field(default_factory=Traffic)
    resume_at: datetime | None = None
    refused: list[str] = field(default_factory=list)  # items that cannot be tasks: "<ref>: why"
    item_errors: list[str] = field(default_factory=list)  # items the tracker failed: "<ref>: what it said"

    def line(self) -> str:
        """One line for a person."""
        own = f"source {self.source}: "
        if self.skipped:
            return own + self.skipped.removeprefix(own)
        done = ", ".join(f"{n} {a}" for a, n in sorted(self.actions.items()) if a != "unchanged") or "nothing changed"
        t = self.traffic
        line = (f"source {self.source}: {self.items} item(s) read, {done}; {t.requests} request(s), "
                f"{t.not_modified} answered from the cache (304)")
        if t.waited_seconds:
            line += f", {t.waited_seconds:.0f} s waited for the rate limit"
        if self.refused:
            line += "; refused: " + "; ".join(self.refused[:3]) + (" …" if len(self.refused) > 3 else "")
        if self.item_errors:
            line += (f"; {len(self.item_errors)} item(s) failed: " + "; ".join(
                e.replace(own, "", 1) for e in self.item_errors[:3]) + (" …" if len(self.item_errors) > 3 else ""))
        return line + (f"; stopped: {self.error.removeprefix(own)}" if self.error else "")


def source_token(name: str, source: SourceConfig, cfg: FleetConfig, environ: Mapping[str, str]) -> str:
    """The source's token: its ``token_file`` (one line, readable by its owner alone), else the
    environment variable ``token_env``. A ConfigError naming where it was looked for, never its value."""
    if source.token_file is not None:
        path = cfg.path(source.token_file)
        where = f"sources.{name}.token_file"
        try:
            st = os.stat(path)
        except OSError as exc:
            raise ConfigError(f"{where}: {path} cannot be read: {exc.strerror}") from None
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ConfigError(f"{where}: {path} is mode {stat.S_IMODE(st.st_mode):04o}; it holds a token, so only "
                              "its owner may read it", f"chmod 600 {path}")
        token = Path(path).read_text().strip()
        if not token:
            raise ConfigError(f"{where}: {path} is empty")
        return token
    token = environ.get(source.token_env, "").strip()
    if not token:
        raise ConfigError(f"source {name}: no token: set {source.token_env} (sources.{name}.token_env) or give "
                          f"sources.{name}.token_file")
    return token


def make_tracker(name: str, source: SourceConfig, cfg: FleetConfig, cache: dict[str, Any],
                 environ: Mapping[str, str]) -> Tracker:
    from worker.sources.github import GitHub

    return GitHub(source.repository, source_token(name, source, cfg, environ), api_url=source.api_url,
                  cache=cache, max_wait=source.max_rate_wait, timeout=source.timeout, what=f"source {name}")


class SourcePass:
    def __init__(self, store: Store, cfg: FleetConfig, name: str, tracker: Tracker) -> None:
        self.store, self.cfg, self.name, self.tracker = store, cfg, name, tracker
        self.source = cfg.sources[name]
        self.report = PassReport(name)

    def call(self, fn: str, **params: Any) -> Any:
        return self.store.source_call(fn, {"p_source": self.name, **params})

    def work(self) -> list[dict[str, Any]]:
        return [dict(r["item"]) for r in self.call("source_work")]

    def each(self, step: Callable[[dict[str, Any]], None]) -> None:
        """``step`` for each item the pass has work for; what the tracker says of one item is that
        item's (the module's docstring), what stops every request stops the pass (SourceDown)."""
        for row in self.work():
            try:
                step(row)
            except SourceDown:
                raise
            except ItemGone as exc:
                state = self.call("source_gone", p_ref=row["ref"], p_why=exc.why)
                log.warning("source item gone", source=self.name, ref=row["ref"], why=exc.why, task=row.get("task_id"),
                            task_state=state)
                self.report.actions["gone"] += 1
            except SourceError as exc:
                log.warning("source item failed", source=self.name, ref=row["ref"], task=row.get("task_id"),
                            error=str(exc))
                self.report.item_errors.append(f"{row['ref']}: {exc}")

    # -- 2. pull requests and CI

    def pull_requests(self) -> None:
        self.each(self.pull_request_of)

    def pull_request_of(self, row: dict[str, Any]) -> None:
        if row["state"] == "ci":
            self.judge_ci(row)
        elif row.get("pr_number") and (row["state"] in LIVE or not row.get("merged_at")):
            pr = self.tracker.pull_request(int(row["pr_number"]))
            self.record_pr(row, pr)

    def record_pr(self, row: dict[str, Any], pr: PullRequest) -> str:
        state = str(self.call("source_pr", p_ref=row["ref"], p_pr={
            "number": pr.number, "url": pr.url, "head_sha": pr.head_sha, "state": pr.state,
            "merged_sha": pr.merged_sha, "merged_at": pr.merged_at.isoformat() if pr.merged_at else None}))
        if pr.merged_at is not None and row["state"] in LIVE and state == "done":
            self.report.actions["merged"] += 1
        return state

    def judge_ci(self, row: dict[str, Any]) -> None:
        from worker.workspace.git import branch_name

        lane = self.cfg.lanes.get(row["task_lane"])
        if lane is None:
            return
        branch = branch_name(row["task_lane"], row["key"])
        pr: PullRequest | None
        if row.get("pr_number"):
            pr = self.tracker.pull_request(int(row["pr_number"]))
        else:
            pr = self.tracker.pull_request_for(branch)
            if pr is None:
                try:
                    pr = self.tracker.open_pull_request(
                        branch, lane.base, str(row.get("title") or row["key"])[:250],
                        pull_request_body(row, ref_number(row["ref"])))
                except PullRequestRefused as exc:
                    if self.call("source_pr_refused", p_ref=row["ref"], p_reason=exc.reason,
                                 p_evidence=str(exc)) == "blocked":
                        log.warning("pull request refused: task blocked", source=self.name, ref=row["ref"],
                                    task=row.get("task_id"), reason=exc.reason, error=str(exc))
                        self.report.actions[f"blocked ({exc.reason})"] += 1
                    return
                self.report.actions["pull requests opened"] += 1
        if self.record_pr(row, pr) != "ci":
            return
        checks = self.tracker.checks(pr.head_sha)
        verdict = checks.verdict
        evidence = self.evidence(checks) if verdict == "failure" else None
        state = self.call("source_ci", p_ref=row["ref"], p_sha=pr.head_sha, p_runs=checks.runs,
                          p_verdict=verdict, p_evidence=evidence)
        if verdict != "pending" and state != "stale":
            self.report.actions[f"ci {verdict}"] += 1

    def evidence(self, checks: Checks) -> str:
        parts = [f"CI failed at {checks.sha[:12]}: {', '.join(c.name for c in checks.failing)}"]
        for check in checks.failing[:5]:
            parts += ["", f"### {check.name} ({check.conclusion})", "", "```",
                      self.tracker.check_log_tail(check).rstrip(), "```"]
        return "\n".join(parts)

    # -- 3. items

    def sync(self, cursor: datetime | None) -> datetime | None:
        items, new_cursor = self.tracker.changed_items(cursor, list(self.source.labels))
        self.report.items = len(items)
        entries = [sync_entry(self.name, self.source, item) for item in items]
        for start in range(0, len(entries), SYNC_PAGE):
            for row in self.call("source_sync", p_items=entries[start:start + SYNC_PAGE]):
                self.report.actions[str(row["action"])] += 1
                if row["action"] == "refused":
                    self.report.refused.append(f"{row['ref']}: {row['note']}")
        return new_cursor

    # -- 4. write-backs and reverts

    def write_back(self) -> None:
        self.each(self.write_back_of)

    def write_back_of(self, row: dict[str, Any]) -> None:
        outcome = row.get("outcome") or {}
        key = outcome.get("key")
        posts = row.get("posts") or {}
        number = ref_number(row["ref"])
        if row["state"] == "running" and outcome.get("kind") == "claimed" and key and key not in posts:
            if self.source.on_claim == "label":
                self.tracker.add_label(number, self.source.running_label)
                self.report.actions["labelled running"] += 1
            self.call("source_posted", p_ref=row["ref"], p_key=key, p_value=self.source.on_claim)
        elif row["state"] in ("done", "dead", "blocked") and key and key not in posts:
            self.post_outcome(row, number, key, posts)
        if row.get("merged_at") and row.get("merged_sha"):
            self.watch_revert(row)

    def post_outcome(self, row: dict[str, Any], number: int, key: str, posts: dict[str, Any]) -> None:
        failed = row["state"] != "done"
        wanted = self.source.on_failure if failed else self.source.on_done
        value: Any = "none"
        if wanted == "comment":
            mark = marker(self.name, row["ref"], key)
            body = (failure_comment(row) if failed else done_comment(row)) + "\n\n" + mark
            # posted by a pass that stopped before recording it: that comment, not a second one
            found = next((cid for cid, text in self.tracker.comments(number) if mark in text), None)
            value = found if found is not None else self.tracker.post_comment(number, body)
            self.report.actions["comments posted" if found is None else "comments found"] += 1
            if failed:
                self.tracker.add_label(number, self.source.attention_label)
        if any(k.startswith("running:") and v == "label" for k, v in posts.items()):
            self.tracker.remove_label(number, self.source.running_label)
        self.call("source_posted", p_ref=row["ref"], p_key=key, p_value=value)

    def watch_revert(self, row: dict[str, Any]) -> None:
        lane = self.cfg.lanes.get(row["task_lane"]) or self.cfg.lanes.get(row["lane"])
        merged_at = as_time(row["merged_at"])
        if lane is None or merged_at is None:
            return
        needle = f"This reverts commit {row['merged_sha']}"
        # committer dates come from the committer's clock: a day's slack before the merge
        for commit in self.tracker.commits_since(lane.base, merged_at - timedelta(days=1)):
            if needle in commit.message:
                if self.call("source_reverted", p_ref=row["ref"], p_revert_sha=commit.sha,
                             p_reverted_at=commit.date.isoformat()) == "recorded":
                    self.report.actions["regressions"] += 1
                return


def run_pass(store: Store, cfg: FleetConfig, name: str, *, environ: Mapping[str, str] | None = None,
             tracker: Tracker | None = None) -> PassReport:
    """One pass of source ``name`` (see the module's docstring). Tracker errors end the pass with
    its report's ``error`` set; a database error or a config error (no token) is raised."""
    source = cfg.sources[name]
    lanes = list(dict.fromkeys(source.labels.values()))
    begun = store.source_call("source_begin", {"p_source": name, "p_kind": source.kind, "p_lanes": lanes})
    resume_at = as_time(begun.get("resume_at"))
    if resume_at is not None and resume_at > datetime.now(UTC):
        return PassReport(name, skipped=f"rate-limited: no request before {resume_at:%H:%M:%S} UTC", resume_at=resume_at)
    tracker = tracker or make_tracker(name, source, cfg, dict(begun.get("cache") or {}),
                                      os.environ if environ is None else environ)
    work = SourcePass(store, cfg, name, tracker)
    cursor = as_time(begun.get("cursor"))
    reached: datetime | None = None
    try:
        work.pull_requests()
        reached = work.sync(cursor)
        work.write_back()
        tracker.prune_cache()  # the pass asked for all it needs: what it did not is kept no more
    except RateLimited as exc:
        work.report.error, work.report.resume_at = str(exc), exc.until
    except SourceError as exc:
        work.report.error = str(exc)
    finally:
        work.report.traffic = tracker.traffic
        errors = [work.report.error] if work.report.error else []
        errors += work.report.item_errors
        try:
            store.source_call("source_end", {
                "p_source": name, "p_cache": tracker.cache_changes,
                "p_cursor": reached.isoformat() if reached else None,
                "p_resume_at": work.report.resume_at.isoformat() if work.report.resume_at else None,
                "p_error": "; ".join(errors) or None})
        finally:
            tracker.close()
    return work.report


def run_passes(store: Store, cfg: FleetConfig, names: list[str] | None = None,
               environ: Mapping[str, str] | None = None) -> list[PassReport]:
    """A pass of each source (or of ``names``); a source whose pass cannot start (no token) is
    reported, and the others still run."""
    reports = []
    for name in names or list(cfg.sources):
        try:
            reports.append(run_pass(store, cfg, name, environ=environ))
        except ConfigError as exc:
            reports.append(PassReport(name, error=str(exc),
                                      skipped=f"cannot start: {str(exc).removeprefix(f'source {name}: ')}"))
    return reports
