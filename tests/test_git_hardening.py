"""No git the shift runs (outside the sandbox, with the fleet's credentials in its environment)
executes or trusts what an agent could write in the lane's mirror or its worktree
(worker/workspace/git.py, "Untrusted writers"), and the sandbox keeps the agent from writing the
mirror's control files while its commits still go there (worker/agent/sandbox.py, ``protect``).
Each case is one a security review reproduced: hooks and an fsmonitor planted in the mirror, its
config pointing the push (and its credentials) elsewhere, a worktree's ``.git`` or ``commondir``
rewritten to point the shift's git at a repository the agent made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gitkit import bare_origin, git, log_of

from worker.agent.sandbox import Sandbox, bwrap_problem, rules_for
from worker.config import ENV_SETTINGS, FLEET_OWN_ENV, load_config
from worker.workspace import git as gitws
from worker.workspace.git import (
    GitError,
    Mirror,
    agent_binds,
    commit_all,
    ensure_task_worktree,
    push,
)

BRANCH = "fleet/code/t1"
# every hook git 2.x knows that the shift's commands could run
HOOKS = ("post-commit", "reference-transaction", "pre-push", "post-index-change", "pre-commit", "commit-msg",
         "prepare-commit-msg", "post-checkout", "post-merge", "pre-auto-gc", "post-rewrite", "fsmonitor-watchman")

needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None and not os.environ.get("LANEFLEET_REQUIRE_BWRAP"),
                                 reason=f"no bwrap sandbox on this host: {bwrap_problem()}")


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    return bare_origin(tmp_path)


@pytest.fixture
def mirror(tmp_path: Path, origin: Path) -> Mirror:
    return Mirror(tmp_path / "git", str(origin))


@pytest.fixture
def ws(tmp_path: Path, mirror: Mirror) -> Path:
    path = tmp_path / "workspaces" / "code" / "t1"
    ensure_task_worktree(mirror, path, BRANCH, "main")
    return path


def script(path: Path, marker: Path, name: str) -> Path:
    """An executable that, if anything runs it, leaves ``marker/name`` (and what it saw of the env)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nmkdir -p '{marker}'\nenv > '{marker}/{name}'\nexit 0\n")
    path.chmod(0o755)
    return path


def plant_hooks(git_dir: Path, marker: Path) -> None:
    for name in HOOKS:
        script(git_dir / "hooks" / name, marker, name)


def ran(marker: Path) -> list[str]:
    return sorted(p.name for p in marker.iterdir()) if marker.exists() else []


def admin_of(ws: Path) -> Path:
    return Path((ws / ".git").read_text().removeprefix("gitdir: ").strip())


def attacker_repo(tmp_path: Path, marker: Path) -> Path:
    """A repository the agent made: hooks, an fsmonitor and a credential helper of its own."""
    evil = tmp_path / "evil.git"
    git("init", "-q", "--bare", str(evil))
    plant_hooks(evil, marker)
    fsmonitor = script(tmp_path / "evil-fsmonitor", marker, "evil-fsmonitor")
    with (evil / "config").open("a") as fh:
        fh.write(f"[core]\n\tfsmonitor = {fsmonitor}\n\thooksPath = {evil / 'hooks'}\n")
    return evil


# ------------------------------------------------------------------------------------------------
# the shift's git: no hook, no fsmonitor, no secret


def test_hooks_planted_in_the_mirror_never_run_when_the_shift_commits_and_pushes(
        tmp_path: Path, mirror: Mirror, ws: Path, origin: Path) -> None:
    marker = tmp_path / "ran"
    plant_hooks(mirror.path, marker)
    (ws / "work.txt").write_text("left uncommitted by the agent\n")

    sha = commit_all(mirror, ws, "wip: hand-off")
    assert sha is not None
    assert push(mirror, BRANCH) == sha

    assert ran(marker) == []
    assert log_of(origin, BRANCH)[0] == "wip: hand-off"


def test_run_git_never_runs_a_hook_or_an_fsmonitor_a_repository_configures(tmp_path: Path) -> None:
    """The -c options of every git the shift runs, whatever repository it runs in."""
    marker = tmp_path / "ran"
    repo = tmp_path / "plain"
    git("init", "-q", "-b", "main", str(repo))
    plant_hooks(repo / ".git", marker)
    git("config", "core.fsmonitor", str(script(tmp_path / "fsmonitor", marker, "fsmonitor")), cwd=repo)
    (repo / "a.txt").write_text("a\n")

    gitws.run_git(["add", "-A"], cwd=repo)
    gitws.run_git(["commit", "-q", "-m", "a"], cwd=repo)  # (no --no-verify: pre-commit, commit-msg too)
    gitws.run_git(["status", "--porcelain"], cwd=repo)
    gitws.run_git(["checkout", "-q", "-b", "other"], cwd=repo)

    assert ran(marker) == []
    assert git("log", "--format=%s", cwd=repo) == "a"


def test_gits_environment_holds_none_of_the_fleets_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = {name: f"secret-{name}" for name in (
        *ENV_SETTINGS, *FLEET_OWN_ENV, "DATABASE_URL", "FLEET_KEY", "FLEET_WORKER_KEY", "FLEET_CONFIG",
        "FLEET_DATABASE__URL", "FLEET_SUPABASE__KEY", "FLEET_LEASE_TOKEN", "FLEET_JWT_SECRET",
        "SUPABASE_SERVICE_ROLE_KEY", "SUPABASE_JWT_SECRET", "SUPABASE_DB_URL", "PGPASSWORD", "PGPASSFILE",
        "FLEET_DEV_DATABASE_URL")}
    kept = {"SSH_AUTH_SOCK": "/run/ssh.sock", "GIT_SSH_COMMAND": "ssh -i /keys/deploy", "HOME": "/home/fleet",
            "PATH": os.environ["PATH"], "HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": "localhost",
            "GH_TOKEN": "for-gh-auth-git-credential", "GIT_ASKPASS": "/usr/bin/askpass"}
    for k, v in {**secrets, **kept}.items():
        monkeypatch.setenv(k, v)

    env = gitws.git_env()
    assert sorted(set(secrets) & set(env)) == []
    assert {k: env.get(k) for k in kept} == kept
    # and what git starts (a helper, a hook if one ever ran) sees the same
    _, out = gitws.run_git(["-c", "alias.showenv=!env", "showenv"])
    for value in secrets.values():
        assert value not in out
    assert "SSH_AUTH_SOCK=/run/ssh.sock" in out


# ------------------------------------------------------------------------------------------------
# the mirror's config: nothing that runs a program or sends the push elsewhere


@pytest.mark.parametrize("key, value", [
    ("core.fsmonitor", "{script}"),
    ("core.hooksPath", "{hooks}"),
    ("core.sshCommand", "{script}"),
    ("credential.helper", "!{script}"),
    ("remote.origin.pushurl", "{evil}"),
    ("url.{evil}.pushInsteadOf", "{origin}"),
    ("include.path", "{tmp}/more.config"),
    ("filter.x.clean", "{script}"),
    ("core.worktree", "{tmp}"),
    ("extensions.worktreeConfig", "true"),
])
def test_a_mirror_config_that_could_run_a_program_or_redirect_the_push_is_refused(
        tmp_path: Path, mirror: Mirror, ws: Path, origin: Path, key: str, value: str) -> None:
    marker = tmp_path / "ran"
    evil = attacker_repo(tmp_path, marker)
    fill = {"script": script(tmp_path / "planted", marker, "planted"), "hooks": evil / "hooks", "evil": evil,
            "origin": origin, "tmp": tmp_path}
    git("config", "--file", str(mirror.path / "config"), key.format(**fill), value.format(**fill))
    (ws / "work.txt").write_text("work\n")

    with pytest.raises(GitError, match=r"sets .*, which lanefleet never writes there") as err:
        commit_all(mirror, ws, "wip")
    assert key.format(**fill).split(".")[0] in str(err.value) and err.value.hint
    with pytest.raises(GitError, match="which lanefleet never writes there"):
        push(mirror, BRANCH)

    assert ran(marker) == []
    assert git("--git-dir", str(evil), "for-each-ref") == "", "nothing pushed to the attacker's repository"
    assert subprocess.run(["git", "--git-dir", str(origin), "rev-parse", "--verify", "-q", BRANCH],
                          capture_output=True, check=False).returncode != 0


def test_a_second_url_in_the_origin_url_file_is_refused(tmp_path: Path, mirror: Mirror, ws: Path) -> None:
    evil = attacker_repo(tmp_path, tmp_path / "ran")
    git("config", "--file", str(mirror.origin_url_file), "remote.origin.pushurl", str(evil))
    with pytest.raises(GitError, match=r"remote\.origin\.pushurl"):
        push(mirror, BRANCH)
    assert git("--git-dir", str(evil), "for-each-ref") == ""


def test_a_commondir_or_alternates_planted_in_the_mirror_is_refused(tmp_path: Path, mirror: Mirror,
                                                                    ws: Path) -> None:
    marker = tmp_path / "ran"
    evil = attacker_repo(tmp_path, marker)
    (mirror.path / "commondir").write_text(f"{evil}\n")
    with pytest.raises(GitError, match="has a commondir file"):
        push(mirror, BRANCH)
    (mirror.path / "commondir").unlink()
    (mirror.path / "objects" / "info" / "alternates").write_text(f"{evil / 'objects'}\n")
    with pytest.raises(GitError, match="alternates"):
        commit_all(mirror, ws, "wip")
    assert ran(marker) == []


# ------------------------------------------------------------------------------------------------
# the worktree: its repository is named, never found through what the agent may rewrite


def test_a_rewritten_dot_git_file_is_never_followed(tmp_path: Path, mirror: Mirror, ws: Path) -> None:
    marker = tmp_path / "ran"
    evil = attacker_repo(tmp_path, marker)
    (ws / ".git").write_text(f"gitdir: {evil}\n")
    (ws / "work.txt").write_text("work\n")

    with pytest.raises(GitError, match=r"\.git is not what git wrote for a worktree") as err:
        commit_all(mirror, ws, "wip")
    assert str(evil) in str(err.value) and "remove the workspace" in (err.value.hint or "")
    with pytest.raises(GitError, match="is not what git wrote"):
        gitws.dirty_files(mirror, ws)
    assert ran(marker) == []


def test_a_dot_git_pointing_at_another_registration_or_a_link_is_refused(tmp_path: Path, mirror: Mirror,
                                                                         ws: Path) -> None:
    other = tmp_path / "workspaces" / "code" / "t2"
    ensure_task_worktree(mirror, other, "fleet/code/t2", "main")
    text = (ws / ".git").read_text()
    (ws / ".git").write_text((other / ".git").read_text())  # another task's registration
    with pytest.raises(GitError, match=r"its registration .* is that of"):
        commit_all(mirror, ws, "wip")
    (ws / ".git").unlink()
    (tmp_path / "dot-git").write_text(text)
    (ws / ".git").symlink_to(tmp_path / "dot-git")
    with pytest.raises(GitError, match="cannot be opened"):
        commit_all(mirror, ws, "wip")


def test_a_rewritten_commondir_is_never_followed(tmp_path: Path, mirror: Mirror, ws: Path, origin: Path) -> None:
    marker = tmp_path / "ran"
    evil = attacker_repo(tmp_path, marker)
    commondir = admin_of(ws) / "commondir"
    commondir.write_text(f"{evil}\n")
    (ws / "work.txt").write_text("work\n")

    with pytest.raises(GitError, match=r"names .*evil\.git.* as its repository"):
        commit_all(mirror, ws, "wip: hand-off")
    assert ran(marker) == []
    assert git("--git-dir", str(evil), "for-each-ref") == ""

    # even past the check (an agent rewriting it between the check and git's start), git takes
    # the config and hooks of the repository it is given (GIT_COMMON_DIR), not the agent's
    admin = admin_of(ws)
    gitws.run_git(["add", "-A"], git_dir=admin, common_dir=mirror.path, work_tree=ws, cwd=ws)
    gitws.run_git(["status", "--porcelain"], git_dir=admin, common_dir=mirror.path, work_tree=ws, cwd=ws)
    assert ran(marker) == []
    commondir.write_text("../..\n")
    assert commit_all(mirror, ws, "wip: hand-off") is not None
    push(mirror, BRANCH)
    assert log_of(origin, BRANCH)[0] == "wip: hand-off"


# ------------------------------------------------------------------------------------------------
# the sandbox: the control files read-only, the agent's commits still made


def sandbox_argv(tmp_path: Path, mirror: Mirror, ws: Path) -> list[str]:
    toml = tmp_path / "fleet.toml"
    toml.write_text(f'[fleet]\nworkspaces = "{tmp_path / "workspaces"}"\ngit_cache = "{tmp_path / "git"}"\n'
                    f'home = "{tmp_path / ".fleet"}"\n\n[lanes.code]\ncommand = ["true"]\n')
    cfg = load_config(toml, environ={})
    writable, protect = agent_binds(mirror, ws)
    return Sandbox(cfg, {}, guard_dir=None).argv(rules_for(cfg, "code", None, "generic"), ws, writable=writable,
                                                 secret=[mirror.origin_url_file], protect=protect)


def test_the_sandbox_binds_the_control_files_read_only_after_the_mirror_and_the_workspace(
        tmp_path: Path, mirror: Mirror, ws: Path) -> None:
    other = tmp_path / "workspaces" / "code" / "t2"
    ensure_task_worktree(mirror, other, "fleet/code/t2", "main")
    argv = sandbox_argv(tmp_path, mirror, ws)
    binds = [(argv[i], argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a in ("--bind", "--ro-bind")]
    order = {dest: n for n, (_, _, dest) in enumerate(binds)}
    last = {dest: (flag, src) for flag, src, dest in binds}
    m = mirror.path
    ro = [m / "config", m / "hooks", m / "info", ws / ".git"]
    for admin in (admin_of(ws), admin_of(other)):
        ro += [admin / "commondir", admin / "gitdir"]
        assert last[str(admin)] == ("--bind", str(admin)), "a mount point: it cannot be renamed away"
    for p in ro:
        assert last[str(p)] == ("--ro-bind", str(p)), p
        assert order[str(p)] > order[str(ws)] and order[str(p)] > order[str(m)]
    assert last[str(m / "worktrees")] == ("--bind", str(m / "worktrees"))
    # the origin URL file stays an empty file: never bound again as itself
    assert last[str(mirror.origin_url_file)] == ("--ro-bind", str(ws / ".fleet" / "empty"))


AGENT = r"""
import json, os, subprocess, sys
mirror, ws, admin = sys.argv[1:4]
out = {"tamper": {}, "git": {}}

def tamper(name, fn):
    try:
        fn()
        out["tamper"][name] = "done"
    except OSError as exc:
        out["tamper"][name] = exc.strerror

def append(path, text):
    with open(path, "a") as fh:
        fh.write(text)

def overwrite(path, text):
    with open(path, "w") as fh:
        fh.write(text)

hook = "#!/bin/sh\ntouch /tmp/owned\n"
tamper("config", lambda: append(f"{mirror}/config", "[core]\n\tfsmonitor = /bin/true\n"))
tamper("config renamed over", lambda: (overwrite(f"{mirror}/config.new", "[core]\n"),
                                       os.rename(f"{mirror}/config.new", f"{mirror}/config")))
tamper("config removed", lambda: os.unlink(f"{mirror}/config"))
tamper("hooks/post-commit", lambda: overwrite(f"{mirror}/hooks/post-commit", hook))
tamper("hooks/reference-transaction", lambda: overwrite(f"{mirror}/hooks/reference-transaction", hook))
tamper("hooks renamed", lambda: os.rename(f"{mirror}/hooks", f"{mirror}/hooks.old"))
tamper("info/attributes", lambda: overwrite(f"{mirror}/info/attributes", "* filter=x\n"))
tamper("included config", lambda: append(f"{mirror}/origin-url.config", "[core]\n\tsshCommand = x\n"))
tamper(".git", lambda: overwrite(f"{ws}/.git", "gitdir: /tmp/evil\n"))
tamper(".git renamed", lambda: os.rename(f"{ws}/.git", f"{ws}/.git.old"))
tamper(".git removed", lambda: os.unlink(f"{ws}/.git"))
tamper("commondir", lambda: overwrite(f"{admin}/commondir", "/tmp/evil\n"))
tamper("gitdir", lambda: overwrite(f"{admin}/gitdir", "/tmp/evil/.git\n"))
tamper("admin renamed", lambda: os.rename(admin, admin + ".old"))
tamper("worktrees renamed", lambda: os.rename(f"{mirror}/worktrees", f"{mirror}/worktrees.old"))

def run(name, *args):
    done = subprocess.run(["git", *args], cwd=ws, capture_output=True, text=True)
    out["git"][name] = [done.returncode, done.stdout + done.stderr]

run("config core.fsmonitor", "config", "core.fsmonitor", "/bin/true")
open(os.path.join(ws, "agent.txt"), "w").write("the agent's work\n")
run("status", "status", "--short")
run("add", "add", "agent.txt")
run("commit", "commit", "-q", "-m", "the agent's commit")
run("log", "log", "--oneline", "-2")
run("branch", "branch", "--list")
run("checkout -b", "checkout", "-q", "-b", "fleet/code/t1-experiment")
open(os.path.join(ws, "more.txt"), "w").write("more\n")
run("add 2", "add", "-A")
run("commit 2", "commit", "-q", "-m", "on the experiment")
run("checkout back", "checkout", "-q", "fleet/code/t1")
print(json.dumps(out))
"""


@needs_bwrap
def test_a_sandboxed_agent_cannot_write_the_git_control_files_and_still_commits(
        tmp_path: Path, mirror: Mirror, ws: Path, origin: Path) -> None:
    admin = admin_of(ws)
    before = {p: p.read_bytes() for p in (mirror.path / "config", mirror.origin_url_file, ws / ".git",
                                          admin / "commondir", admin / "gitdir")}
    hooks_before = sorted(p.name for p in (mirror.path / "hooks").iterdir())
    env = {"PATH": os.environ["PATH"], "HOME": os.path.expanduser("~"), "LC_ALL": "C",
           "GIT_AUTHOR_NAME": "agent", "GIT_AUTHOR_EMAIL": "agent@example.com",
           "GIT_COMMITTER_NAME": "agent", "GIT_COMMITTER_EMAIL": "agent@example.com"}
    argv = [*sandbox_argv(tmp_path, mirror, ws), sys.executable, "-c", AGENT, str(mirror.path), str(ws), str(admin)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)

    assert {k: v for k, v in out["tamper"].items() if v == "done"} == {}, out["tamper"]
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in (mirror.path / "hooks").iterdir()) == hooks_before
    assert not (mirror.path / "info" / "attributes").exists() and admin.is_dir()
    assert out["git"].pop("config core.fsmonitor")[0] != 0
    assert {k: rc for k, (rc, _) in out["git"].items() if rc != 0} == {}, out["git"]
    # the agent's commits are in the mirror, and the shift's git goes on as before
    assert git("--git-dir", str(mirror.path), "log", "--format=%s", "-1", BRANCH) == "the agent's commit"
    assert git("--git-dir", str(mirror.path), "log", "--format=%s", "-1", "fleet/code/t1-experiment") \
        == "on the experiment"
    push(mirror, BRANCH)
    assert log_of(origin, BRANCH)[0] == "the agent's commit"
