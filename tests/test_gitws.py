"""Git workspaces and the landing of batch members (worker/workspace/git.py), against real
git: each test has its own bare ``origin`` with two commits on ``main``, a host's mirror in a
cache directory, and a second cache directory where another host is needed."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from gitkit import git
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.errors import FleetError
from worker.workspace import git as gitws
from worker.workspace.git import (
    BranchDiverged,
    GitError,
    LandingFailed,
    Mirror,
    MirrorBusy,
    PushRejected,
    branch_name,
    commits_between,
    cut_member_branch,
    ensure_integration_branch,
    ensure_task_worktree,
    land_ff_only,
    member_branch,
    merge_base,
    push,
    remove_worktree,
)


def commit(wt: Path, name: str, text: str | None = None) -> str:
    """A commit in a worktree, as an agent makes it."""
    (wt / name).write_text(text if text is not None else f"{name}\n")
    git("add", name, cwd=wt)
    git("commit", "-q", "-m", f"add {name}", cwd=wt)
    return git("rev-parse", "HEAD", cwd=wt)


def rev(repo: Path, ref: str) -> str:
    """A ref of a bare repository (origin)."""
    return git("--git-dir", str(repo), "rev-parse", "--verify", "--quiet", ref)


def has_ref(repo: Path, ref: str) -> bool:
    return subprocess.run(["git", "--git-dir", str(repo), "rev-parse", "--verify", "--quiet", ref],
                          capture_output=True, check=False).returncode == 0


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    seed = tmp_path / "seed"
    git("init", "-q", "-b", "main", str(seed))
    commit(seed, "README.md", "hello\n")
    commit(seed, "app.py", "print('hi')\n")
    bare = tmp_path / "origin.git"
    git("clone", "-q", "--bare", str(seed), str(bare))
    return bare


@pytest.fixture
def mirror(tmp_path: Path, origin: Path) -> Mirror:
    return Mirror(tmp_path / "cache", str(origin))


def other_host(tmp_path: Path, origin: Path) -> Mirror:
    return Mirror(tmp_path / "other-host-cache", str(origin))


def local_ref(m: Mirror, ref: str) -> str | None:
    return m.rev(ref)


# ------------------------------------------------------------------------------------------------
# names


def test_branch_names_are_valid_refs_and_distinct() -> None:
    assert branch_name("docs", "issue-473") == "fleet/docs/issue-473"
    b = branch_name("docs", "issue:473")
    assert b.startswith("fleet/docs/issue-473-") and b != branch_name("docs", "issue/473")
    assert member_branch(12, 2, "issue-9") == "batch/12-m2-issue-9"
    assert gitws.integration_branch(12) == "batch/12"
    nasty = ["../x", "a..b", "x.lock", "-rf", "@", "a b~^:?*[\\", "héllo", "", ".hidden/", "@{u}"]
    names = [branch_name("l", k) for k in nasty]
    assert len(set(names)) == len(nasty)
    for name in names:
        assert subprocess.run(["git", "check-ref-format", "--branch", name], capture_output=True,
                              check=False).returncode == 0, name
    with pytest.raises(GitError, match="not a valid git branch name"):
        gitws.check_branch("fleet/a..b")


@settings(max_examples=40, deadline=None)
@given(st.text(min_size=0, max_size=60))
def test_any_task_key_makes_a_valid_branch(key: str) -> None:
    name = branch_name("lane", key)
    assert subprocess.run(["git", "check-ref-format", "--branch", name], capture_output=True,
                          check=False).returncode == 0


def test_mirror_names_keep_repos_apart(tmp_path: Path) -> None:
    a = Mirror(tmp_path, "/srv/a/app.git")
    b = Mirror(tmp_path, "/srv/b/app.git")
    c = Mirror(tmp_path, "https://user:secret@example.com/team/app.git")
    assert a.path != b.path and a.path.name.startswith("app-") and a.path.parent == tmp_path
    assert "secret" not in str(c.path) and "secret" not in repr(c)
    assert Mirror(tmp_path, "git@example.com:team/app.git").repo == "git@example.com:team/app.git"


# ------------------------------------------------------------------------------------------------
# task worktrees


def test_origins_url_lives_apart_from_the_mirrors_config_also_in_a_mirror_made_before(
        mirror: Mirror, origin: Path) -> None:
    """The URL may carry a token: its own 0600 file, included by the config (which the sandbox
    leaves an agent), never in the config itself. A mirror made when the URL was in its config
    moves it out at its next fetch."""
    mirror.ensure()
    config = (mirror.path / "config").read_text()
    assert str(origin) not in config and "origin-url.config" in config
    assert str(origin) in mirror.origin_url_file.read_text()
    assert mirror.origin_url_file.stat().st_mode & 0o777 == 0o600
    assert mirror.git("config", "--get", "remote.origin.url").strip() == str(origin)
    # as an older lanefleet made it
    mirror.origin_url_file.unlink()
    git("--git-dir", str(mirror.path), "config", "--unset-all", "include.path")
    git("--git-dir", str(mirror.path), "config", "remote.origin.url", str(origin))
    mirror.fetch()
    assert str(origin) not in (mirror.path / "config").read_text()
    assert mirror.git("config", "--get-all", "remote.origin.url").split() == [str(origin)]
    assert mirror.git("config", "--get-all", "include.path").split() == ["origin-url.config"]


def test_worktree_is_created_on_its_branch_from_base_in_a_mirror_that_fetches_to_remotes(
        mirror: Mirror, origin: Path, tmp_path: Path) -> None:
    path = tmp_path / "ws" / "docs" / "issue-1"
    head = ensure_task_worktree(mirror, path, "fleet/docs/issue-1", "main")
    assert head == rev(origin, "refs/heads/main")
    assert git("symbolic-ref", "HEAD", cwd=path) == "refs/heads/fleet/docs/issue-1"
    assert (path / "app.py").read_text() == "print('hi')\n"
    # the layout: a bare mirror whose fetch writes origin's branches under refs/remotes/origin/
    assert mirror.path.is_dir() and git("--git-dir", str(mirror.path), "config", "core.bare") == "true"
    assert git("--git-dir", str(mirror.path), "config", "--get-all", "remote.origin.fetch").splitlines() == \
        list(gitws.FETCH_REFSPECS)
    assert local_ref(mirror, "refs/heads/main") is None
    assert local_ref(mirror, "refs/remotes/origin/main") == head
    # what lanefleet renders into the worktree is never committed
    (path / ".fleet").mkdir()
    (path / ".fleet" / "task.json").write_text("{}")
    assert git("status", "--porcelain", cwd=path) == ""


def test_a_retried_task_finds_its_earlier_commits_and_files(mirror: Mirror, tmp_path: Path) -> None:
    path = tmp_path / "ws" / "issue-2"
    base = ensure_task_worktree(mirror, path, "fleet/docs/issue-2", "main")
    first = commit(path, "one.txt")
    second = commit(path, "two.txt")
    (path / "notes.txt").write_text("uncommitted work")
    # the attempt "crashes"; the next attempt on this host ensures the same worktree again
    again = ensure_task_worktree(mirror, path, "fleet/docs/issue-2", "main")
    assert again == second != base
    assert commits_between(mirror, base, again) == [first, second]
    assert (path / "notes.txt").read_text() == "uncommitted work"


def test_a_worktree_whose_path_is_gone_is_made_again_from_its_local_branch(
        mirror: Mirror, tmp_path: Path) -> None:
    import shutil

    path = tmp_path / "ws" / "issue-3"
    ensure_task_worktree(mirror, path, "fleet/docs/issue-3", "main")
    head = commit(path, "work.txt")
    shutil.rmtree(path)  # reaped, or a wiped disk: the registration is stale, the branch is kept
    assert ensure_task_worktree(mirror, path, "fleet/docs/issue-3", "main") == head
    assert (path / "work.txt").exists()


def test_another_host_continues_from_the_branch_pushed_at_hand_off(
        mirror: Mirror, origin: Path, tmp_path: Path) -> None:
    branch = "fleet/docs/issue-4"
    ensure_task_worktree(mirror, tmp_path / "a" / "issue-4", branch, "main")
    head = commit(tmp_path / "a" / "issue-4", "from-host-a.txt")
    assert push(mirror, branch) == head == rev(origin, f"refs/heads/{branch}")

    b = other_host(tmp_path, origin)
    path_b = tmp_path / "b" / "issue-4"
    assert ensure_task_worktree(b, path_b, branch, "main") == head
    assert (path_b / "from-host-a.txt").exists()
    later = commit(path_b, "from-host-b.txt")
    push(b, branch)

    # the task comes back to host A, whose worktree is still there: it catches up with origin
    assert ensure_task_worktree(mirror, tmp_path / "a" / "issue-4", branch, "main") == later
    assert (tmp_path / "a" / "issue-4" / "from-host-b.txt").exists()


def test_a_branch_that_diverged_from_origin_is_refused_not_overwritten(
        mirror: Mirror, origin: Path, tmp_path: Path) -> None:
    branch = "fleet/docs/issue-5"
    path_a = tmp_path / "a" / "issue-5"
    ensure_task_worktree(mirror, path_a, branch, "main")
    push(mirror, branch)
    mine = commit(path_a, "unpushed.txt")  # host A dies before pushing this
    b = other_host(tmp_path, origin)
    ensure_task_worktree(b, tmp_path / "b" / "issue-5", branch, "main")
    theirs = commit(tmp_path / "b" / "issue-5", "other.txt")
    push(b, branch)
    with pytest.raises(BranchDiverged, match="diverged"):
        ensure_task_worktree(mirror, path_a, branch, "main")
    assert local_ref(mirror, f"refs/heads/{branch}") == mine
    assert rev(origin, f"refs/heads/{branch}") == theirs
    # and a stale push from A never overwrites B's work on origin
    with pytest.raises(PushRejected):
        push(mirror, branch)
    assert rev(origin, f"refs/heads/{branch}") == theirs


def test_an_agent_that_rewrote_its_pushed_branch_can_push_it_again(
        mirror: Mirror, origin: Path, tmp_path: Path) -> None:
    branch, path = "fleet/docs/amend", tmp_path / "ws" / "amend"
    ensure_task_worktree(mirror, path, branch, "main")
    commit(path, "draft.txt")
    push(mirror, branch)
    git("commit", "-q", "--amend", "-m", "reworded", cwd=path)
    amended = git("rev-parse", "HEAD", cwd=path)
    with pytest.raises(PushRejected):
        push(mirror, branch, rewrite=False)  # not a fast-forward
    assert push(mirror, branch) == amended == rev(origin, f"refs/heads/{branch}")


def test_a_fetch_never_clobbers_a_worktree_branch_with_local_commits(
        mirror: Mirror, origin: Path, tmp_path: Path) -> None:
    live, parked = "fleet/docs/live", "fleet/docs/parked"
    ensure_task_worktree(mirror, tmp_path / "live", live, "main")
    ensure_task_worktree(mirror, tmp_path / "parked", parked, "main")
    push(mirror, live)
    push(mirror, parked)
    live_head = commit(tmp_path / "live", "local-live.txt")
    parked_head = commit(tmp_path / "parked", "local-parked.txt")
    remove_worktree(mirror, tmp_path / "parked")  # a branch with local commits and no worktree
    # origin moves: main and both branches get commits from elsewhere
    other = tmp_path / "elsewhere"
    git("clone", "-q", str(origin), str(other))
    commit(other, "upstream.txt")
    git("push", "-q", "origin", "HEAD:main", cwd=other)
    for branch in (live, parked):
        git("checkout", "-q", "-B", "x", f"origin/{branch}", cwd=other)
        commit(other, f"{branch.rsplit('/', 1)[1]}-upstream.txt")
        git("push", "-q", "-f", "origin", f"HEAD:{branch}", cwd=other)

    mirror.fetch()
    assert local_ref(mirror, f"refs/heads/{live}") == live_head
    assert local_ref(mirror, f"refs/heads/{parked}") == parked_head
    assert local_ref(mirror, f"refs/remotes/origin/{live}") == rev(origin, f"refs/heads/{live}")
    assert local_ref(mirror, "refs/remotes/origin/main") == rev(origin, "refs/heads/main")
    assert git("rev-parse", "HEAD", cwd=tmp_path / "live") == live_head


def test_a_path_holding_something_else_is_never_taken_over(mirror: Mirror, tmp_path: Path) -> None:
    path = tmp_path / "ws" / "issue-6"
    path.mkdir(parents=True)
    (path / "precious.txt").write_text("keep me")
    with pytest.raises(GitError, match="exists and is not a worktree"):
        ensure_task_worktree(mirror, path, "fleet/docs/issue-6", "main")
    assert (path / "precious.txt").read_text() == "keep me"
    wt = tmp_path / "ws" / "issue-7"
    ensure_task_worktree(mirror, wt, "fleet/docs/issue-7", "main")
    with pytest.raises(GitError, match="is on fleet/docs/issue-7, not on fleet/docs/issue-8"):
        ensure_task_worktree(mirror, wt, "fleet/docs/issue-8", "main")
    with pytest.raises(GitError, match="'nope' on origin does not exist"):
        ensure_task_worktree(mirror, tmp_path / "ws" / "x", "fleet/docs/x", "nope")


def test_remove_worktree_keeps_the_branch_and_prune_forgets_a_deleted_one(
        mirror: Mirror, tmp_path: Path) -> None:
    import shutil

    a, b = tmp_path / "ws" / "a", tmp_path / "ws" / "b"
    ensure_task_worktree(mirror, a, "fleet/docs/a", "main")
    head = commit(a, "a.txt")
    ensure_task_worktree(mirror, b, "fleet/docs/b", "main")
    (a / "junk.txt").write_text("uncommitted")
    assert remove_worktree(mirror, a) is True
    assert not a.exists() and local_ref(mirror, "refs/heads/fleet/docs/a") == head
    assert remove_worktree(mirror, a) is False
    shutil.rmtree(b)  # the reaper deleted it its own way
    assert [w.path.name for w in gitws.worktrees(mirror)] == ["b"]
    gitws.prune(mirror)
    assert gitws.worktrees(mirror) == []


def test_commit_all_snapshots_what_the_agent_left_as_lanefleet(mirror: Mirror, tmp_path: Path) -> None:
    path = tmp_path / "ws" / "snap"
    base = ensure_task_worktree(mirror, path, "fleet/docs/snap", "main")
    assert gitws.commit_all(mirror, path, "nothing") is None
    (path / "README.md").write_text("changed\n")
    (path / "new.txt").write_text("new\n")
    (path / ".fleet").mkdir()
    (path / ".fleet" / "checkpoint.json").write_text("{}")
    assert gitws.dirty_files(mirror, path) == ["README.md"]
    assert sorted(gitws.dirty_files(mirror, path, untracked=True)) == ["README.md", "new.txt"]
    sha = gitws.commit_all(mirror, path, "wip: hand-off")
    assert sha is not None and commits_between(mirror, base, sha) == [sha]
    assert git("log", "-1", "--format=%an <%ae>|%s", cwd=path) == "lanefleet <lanefleet@localhost>|wip: hand-off"
    assert git("show", "--name-only", "--format=", sha, cwd=path).split() == ["README.md", "new.txt"]


# ------------------------------------------------------------------------------------------------
# batches


def test_three_members_land_in_order_fast_forward_only_and_are_pushed(
        mirror: Mirror, origin: Path, tmp_path: Path) -> None:
    main = rev(origin, "refs/heads/main")
    integ = "batch/7"
    assert ensure_integration_branch(mirror, integ, "main") == main
    assert rev(origin, f"refs/heads/{integ}") == main
    expected: list[str] = []
    for n in (1, 2, 3):
        mb = member_branch(7, n, f"issue-{n}")
        wt = tmp_path / "members" / f"m{n}"
        cut = cut_member_branch(mirror, wt, mb, integ)
        assert cut == (expected[-1] if expected else main)
        assert rev(origin, f"refs/heads/{mb}") == cut  # pushed before the agent starts
        mine = [commit(wt, f"m{n}-a.txt"), commit(wt, f"m{n}-b.txt")]
        assert merge_base(mirror, mb, integ) == cut
        result = land_ff_only(mirror, mb, integ)
        assert (result.landed, result.already) == (True, False)
        assert (result.old_head, result.new_head, result.commits) == (cut, mine[-1], mine)
        assert rev(origin, f"refs/heads/{integ}") == mine[-1]
        remove_worktree(mirror, wt)
        expected += mine
    head = rev(origin, f"refs/heads/{integ}")
    assert commits_between(mirror, main, head) == expected
    assert local_ref(mirror, f"refs/heads/{integ}") == head
    # a linear history: exactly the landed commits, nothing merged in
    assert git("--git-dir", str(origin), "rev-list", "--merges", f"{main}..{head}") == ""
    # ensuring the integration branch again changes nothing
    assert ensure_integration_branch(mirror, integ, "main") == head


def test_landing_the_same_member_twice_changes_nothing(mirror: Mirror, origin: Path, tmp_path: Path) -> None:
    integ, mb = "batch/8", member_branch(8, 1, "issue-1")
    ensure_integration_branch(mirror, integ, "main")
    cut = cut_member_branch(mirror, tmp_path / "m1", mb, integ)
    work = commit(tmp_path / "m1", "m1.txt")
    first = land_ff_only(mirror, mb, integ)
    again = land_ff_only(mirror, mb, integ, cut=cut)
    assert (again.landed, again.already) == (True, True)
    assert again.old_head == again.new_head == first.new_head == work
    assert again.commits == [work]  # the landed range, from the cut point the caller kept
    assert land_ff_only(mirror, mb, integ).commits == []
    assert rev(origin, f"refs/heads/{integ}") == work
    assert commits_between(mirror, cut, work) == [work]


def test_a_landing_interrupted_before_the_local_update_is_finished_from_origin(
        mirror: Mirror, origin: Path, tmp_path: Path) -> None:
    """Another host landed the member (origin moved); this host's branch is behind: already."""
    integ, mb = "batch/9", member_branch(9, 1, "k")
    ensure_integration_branch(mirror, integ, "main")
    cut_member_branch(mirror, tmp_path / "m1", mb, integ)
    work = commit(tmp_path / "m1", "m1.txt")
    push(mirror, mb)
    b = other_host(tmp_path, origin)
    assert land_ff_only(b, mb, integ).already is False
    result = land_ff_only(mirror, mb, integ)
    assert (result.already, result.new_head) == (True, work)
    assert local_ref(mirror, f"refs/heads/{integ}") == work


def test_a_member_that_cannot_fast_forward_fails_and_leaves_the_integration_branch(
        mirror: Mirror, origin: Path, tmp_path: Path) -> None:
    integ = "batch/10"
    ensure_integration_branch(mirror, integ, "main")
    m1, m2 = member_branch(10, 1, "a"), member_branch(10, 2, "b")
    cut_member_branch(mirror, tmp_path / "m1", m1, integ)
    cut_member_branch(mirror, tmp_path / "m2", m2, integ)  # cut from the same, older head
    landed = commit(tmp_path / "m1", "a.txt")
    commit(tmp_path / "m2", "b.txt")
    land_ff_only(mirror, m1, integ)
    with pytest.raises(LandingFailed, match="does not fast-forward"):
        land_ff_only(mirror, m2, integ)
    assert local_ref(mirror, f"refs/heads/{integ}") == landed == rev(origin, f"refs/heads/{integ}")
    assert isinstance(LandingFailed("x"), GitError)


def test_a_member_with_uncommitted_changes_does_not_land(mirror: Mirror, origin: Path, tmp_path: Path) -> None:
    integ, mb = "batch/11", member_branch(11, 1, "a")
    head = ensure_integration_branch(mirror, integ, "main")
    cut_member_branch(mirror, tmp_path / "m1", mb, integ)
    commit(tmp_path / "m1", "a.txt")
    (tmp_path / "m1" / "a.txt").write_text("changed after the commit\n")
    with pytest.raises(LandingFailed, match=r"uncommitted changes .*a\.txt"):
        land_ff_only(mirror, mb, integ)
    assert rev(origin, f"refs/heads/{integ}") == head
    assert land_ff_only(mirror, mb, integ, require_clean=False).already is False


def test_landing_on_a_checked_out_integration_branch_moves_its_files(
        mirror: Mirror, tmp_path: Path) -> None:
    integ, mb = "batch/12", member_branch(12, 1, "a")
    ensure_integration_branch(mirror, integ, "main")
    tail = tmp_path / "tail"
    ensure_task_worktree(mirror, tail, integ, "main")  # the batch's tail works in it
    cut_member_branch(mirror, tmp_path / "m1", mb, integ)
    work = commit(tmp_path / "m1", "landed.txt")
    land_ff_only(mirror, mb, integ)
    assert git("rev-parse", "HEAD", cwd=tail) == work
    assert (tail / "landed.txt").exists() and git("status", "--porcelain", cwd=tail) == ""


def test_a_torn_down_member_branch_is_deleted_here_and_on_origin(
        mirror: Mirror, origin: Path, tmp_path: Path) -> None:
    integ, mb = "batch/13", member_branch(13, 1, "a")
    ensure_integration_branch(mirror, integ, "main")
    cut_member_branch(mirror, tmp_path / "m1", mb, integ)
    commit(tmp_path / "m1", "a.txt")
    land_ff_only(mirror, mb, integ)
    with pytest.raises(GitError, match="checked out in"):
        gitws.delete_branch(mirror, mb, remote=True)
    remove_worktree(mirror, tmp_path / "m1")
    gitws.delete_branch(mirror, mb, remote=True)
    assert gitws.branch_head(mirror, mb) is None and gitws.branch_head(mirror, mb, remote=True) is None
    assert not has_ref(origin, f"refs/heads/{mb}") and has_ref(origin, f"refs/heads/{integ}")
    gitws.delete_branch(mirror, mb, remote=True)  # gone already: fine
    with pytest.raises(GitError, match="base branch 'nope' does not exist on origin"):
        ensure_integration_branch(mirror, "batch/14", "nope")


# ------------------------------------------------------------------------------------------------
# failures and concurrency


def test_a_bad_repo_is_a_git_error_naming_the_command(tmp_path: Path) -> None:
    m = Mirror(tmp_path / "cache", str(tmp_path / "no-such-repo"))
    with pytest.raises(GitError) as err:
        ensure_task_worktree(m, tmp_path / "ws", "fleet/docs/x", "main")
    assert isinstance(err.value, FleetError)
    text = str(err.value)
    assert "git fetch" in text and "no-such-repo" in text and "exit 128" in text
    assert err.value.cmd.startswith("git fetch")
    assert not m.exists() and list((tmp_path / "cache").glob("*.git*")) == []  # no half mirror


def test_a_git_command_that_hangs_is_killed_at_its_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(GitError, match=r"git .* timed out after 0\.3 s"):
        gitws.run_git(["-c", "alias.hang=!sleep 20", "hang"], timeout=0.3)
    assert time.monotonic() - started < 3  # the sleep under it was killed too (its group)


def test_two_threads_ensuring_worktrees_of_one_new_mirror_both_succeed(
        tmp_path: Path, origin: Path) -> None:
    main = rev(origin, "refs/heads/main")
    cache = tmp_path / "cache"
    results: dict[int, str | BaseException] = {}
    barrier = threading.Barrier(2, timeout=20)

    def shift(i: int) -> None:
        try:
            m = Mirror(cache, str(origin))  # each shift its own object, as separate shifts would
            barrier.wait()
            results[i] = ensure_task_worktree(m, tmp_path / "ws" / f"t{i}", f"fleet/docs/t{i}", "main")
            barrier.wait()
            results[i] = ensure_task_worktree(m, tmp_path / "ws" / f"u{i}", f"fleet/docs/u{i}", "main")
        except BaseException as exc:
            results[i] = exc
            barrier.abort()  # the other thread fails fast instead of waiting for this one

    threads = [threading.Thread(target=shift, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {0: main, 1: main}
    m = Mirror(cache, str(origin))
    assert sorted(w.branch or "" for w in gitws.worktrees(m)) == [
        "fleet/docs/t0", "fleet/docs/t1", "fleet/docs/u0", "fleet/docs/u1"]


def test_a_mirror_locked_by_another_process_waits_then_says_busy(
        mirror: Mirror, tmp_path: Path) -> None:
    mirror.ensure()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, sys, time\n"
         "f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
         "print('locked', flush=True); time.sleep(30)\n", str(mirror.lock_path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        busy = Mirror(mirror.cache_dir, mirror.repo, lock_timeout=0.3)
        started = time.monotonic()
        with pytest.raises(MirrorBusy, match="busy"):
            busy.fetch()
        assert time.monotonic() - started >= 0.3
    finally:
        holder.kill()
        holder.wait()
    Mirror(mirror.cache_dir, mirror.repo, lock_timeout=5).fetch()  # free again


def test_the_lock_is_reentrant_in_a_thread_and_exclusive_across_threads(mirror: Mirror) -> None:
    mirror.ensure()
    other = Mirror(mirror.cache_dir, mirror.repo, lock_timeout=0.2)
    seen: list[BaseException] = []
    with mirror.locked(), mirror.locked():
        mirror.fetch()  # nests
        t = threading.Thread(target=lambda: _catch(seen, other.fetch))
        t.start()
        t.join(10)
    assert len(seen) == 1 and isinstance(seen[0], MirrorBusy)
    other.fetch()


def _catch(into: list[BaseException], fn: object) -> None:
    try:
        fn()  # type: ignore[operator]
    except BaseException as exc:
        into.append(exc)
