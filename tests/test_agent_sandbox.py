"""Agents are untrusted code (README "Running coding agents"): what the agent of a real shift can
and cannot see. A scripted agent (tests/agents/probe.py) dumps its environment, tries to read the
fleet's secrets and to write outside its workspace, and runs ``fleet guard``; the shift is a real
``fleet shift`` process whose environment holds the fleet's credentials and whose HOME holds a
``.pgpass``.

The fleet lives under the checkout's git-ignored ``.fleet/`` rather than pytest's tmp folder: a
sandboxed agent gets a /tmp of its own, which would hide a fleet under /tmp whatever else the
sandbox did; there, only what the sandbox hides on purpose is hidden.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fleetkit import Backend, Fleet, lane_defaults, pids_using, wait_for

from worker.agent.executor import BASE_ENV, TASK_ENV
from worker.agent.sandbox import bwrap_problem

ROOT = Path(__file__).resolve().parents[1]
PROBE = ["python", str(ROOT / "tests" / "agents" / "probe.py")]
# the fleet's credentials, in the shift's environment: none may reach an agent (DATABASE_URL and
# FLEET_CONFIG, the real ones, are there too)
CREDENTIALS = {
    "FLEET_KEY": "cred-fleet-key", "FLEET_WORKER_KEY": "cred-worker-key", "FLEET_JWT_SECRET": "cred-jwt-secret",
    "SUPABASE_DB_URL": "postgresql://postgres:cred-db-password@127.0.0.1:1/postgres",
    "PGPASSWORD": "cred-pgpassword", "SUPABASE_SERVICE_ROLE_KEY": "cred-service-role",
    "AWS_SECRET_ACCESS_KEY": "cred-aws", "OTHER_VAR": "cred-other",
}

needs_bwrap = pytest.mark.skipif(
    bwrap_problem() is not None and not os.environ.get("LANEFLEET_REQUIRE_BWRAP"),
    reason=f"no bwrap sandbox on this host: {bwrap_problem()}")


@pytest.fixture
def place() -> Iterator[Path]:
    """A fleet's folder (config, HOME, workspaces, .fleet/) outside /tmp (see the module doc)."""
    folder = ROOT / ".fleet" / "sandbox-tests" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def private(path: Path, text: str, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def make_fleet(db_url: str, place: Path, lane: dict[str, Any], **tables: dict[str, dict[str, Any]]) -> Fleet:
    if lane.get("command") == PROBE:
        # the probe's own script, shown read-only: a checkout under /tmp (a CI clone) is hidden by
        # the sandbox's fresh /tmp like anything else there
        lane = {**lane, "sandbox_ro": [*lane.get("sandbox_ro", []), str(ROOT / "tests" / "agents")]}
    return Fleet(Backend("postgres", db_url), place, {"work": lane_defaults(**lane)}, tables=tables or None)


def shift_env(fleet: Fleet, place: Path, **more: str) -> dict[str, str]:
    """A shift's environment: the fleet's database and config, its credentials, a HOME of its own."""
    home = place / "home"
    home.mkdir(exist_ok=True)
    return {**fleet.env(), **CREDENTIALS, "HOME": str(home), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", **more}


def run_shift(fleet: Fleet, env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "monitor.cli", "shift", "--lane", "work", "--once", "--poll", "0.1",
                           "--json-logs", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=90)


def probed(fleet: Fleet, key: str) -> dict[str, Any]:
    return json.loads((fleet.workspace("work", key) / "probe.json").read_text())


# ------------------------------------------------------------------------------------------------
# the environment: an allow-list


def test_an_agent_gets_the_base_set_its_task_and_what_its_lane_and_profile_name_nothing_else(
        db_url: str, place: Path) -> None:
    lane_file = private(place / "lane.env", "# for the agents of lane work\nFROM_LANE_FILE=lane-file\n"
                                            "SHARED='from the lane'\n")
    profile_file = private(place / "profile.env", 'export FROM_PROFILE_FILE="profile file"\nSHARED=from the profile\n')
    lane = {"profile": "p", "agent_env": ["ANTHROPIC_API_KEY"], "agent_env_file": str(lane_file)}
    fleet = make_fleet(db_url, place, lane, profiles={"p": {
        "command": PROBE, "model": "m1", "agent_env": ["PROFILE_NAMED"], "agent_env_file": str(profile_file)}})
    del fleet.lanes["work"]["command"]
    try:
        task = fleet.enqueue("work", "env", {})
        env = shift_env(fleet, place, ANTHROPIC_API_KEY="sk-ant-named", PROFILE_NAMED="named-by-profile")
        done = run_shift(fleet, env, place)
        assert done.returncode == 0, done.stderr[-2000:]
        assert fleet.task(task)["state"] == "done"
        got = probed(fleet, "env")["env"]
        ws = fleet.workspace("work", "env")
        # nothing of the fleet's own
        for name in (*CREDENTIALS, "DATABASE_URL", "FLEET_CONFIG"):
            assert name not in got, name
        for value in (*CREDENTIALS.values(), fleet.db_url):
            assert not [k for k, v in got.items() if value in v], value
        # what the lane and its profile name
        assert got["ANTHROPIC_API_KEY"] == "sk-ant-named" and got["PROFILE_NAMED"] == "named-by-profile"
        assert got["FROM_LANE_FILE"] == "lane-file" and got["FROM_PROFILE_FILE"] == "profile file"
        assert got["SHARED"] == "from the profile"  # a profile's file over its lane's
        # the task's variables
        run = fleet.runs(task)[0]
        assert {k: got[k] for k in ("FLEET_TASK_ID", "FLEET_TASK_KEY", "FLEET_LANE", "FLEET_ATTEMPT",
                                    "FLEET_WORKSPACE", "FLEET_MODEL", "FLEET_PROFILE", "FLEET_TIER",
                                    "FLEET_AGENT_SESSION")} == {
            "FLEET_TASK_ID": str(task), "FLEET_TASK_KEY": "env", "FLEET_LANE": "work", "FLEET_ATTEMPT": "1",
            "FLEET_WORKSPACE": str(ws), "FLEET_MODEL": "m1", "FLEET_PROFILE": "p", "FLEET_TIER": "",
            "FLEET_AGENT_SESSION": ""}
        assert got["FLEET_LEASE_TOKEN"] == str(run["lease_token"])
        assert got["FLEET_GUARD_SOCKET"].endswith("guard.sock") and os.path.isabs(got["FLEET_BIN"])
        # the base set: PATH (with `fleet` first), HOME, locale
        assert got["PATH"].endswith(os.pathsep + env["PATH"]) and got["HOME"] == env["HOME"]
        assert (got["LANG"], got["LC_ALL"]) == ("C.UTF-8", "C.UTF-8")
        named = {"ANTHROPIC_API_KEY", "PROFILE_NAMED", "FROM_LANE_FILE", "FROM_PROFILE_FILE", "SHARED"}
        assert not {k for k in got if k not in BASE_ENV | TASK_ENV | named and not k.startswith("LC_")}
        # and the banner names what agents see (names and files, never a value)
        logged = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
        access = next(e["access"] for e in logged if e.get("event") == "what agents see")
        assert "env ANTHROPIC_API_KEY,PROFILE_NAMED" in access[0] and str(lane_file) in access[0]
        assert "sk-ant-named" not in done.stderr and "lane-file" not in done.stderr.replace(str(lane_file), "")
    finally:
        fleet.close()


def test_an_agent_env_file_others_can_read_stops_the_shift_before_it_claims_anything(
        db_url: str, place: Path) -> None:
    env_file = private(place / "agents.env", "ANTHROPIC_API_KEY=sk-ant-file\n", mode=0o644)
    fleet = make_fleet(db_url, place, {"command": PROBE, "agent_env_file": str(env_file)})
    try:
        task = fleet.enqueue("work", "refused", {})
        env = shift_env(fleet, place)
        done = run_shift(fleet, env, place)
        assert done.returncode == 1
        lines = done.stderr.strip().splitlines()
        assert lines == [f"error: lanes.work.agent_env_file: {env_file} is mode 0644; it holds agents' secrets, "
                         f"so only its owner may read it (chmod 600 {env_file})"], done.stderr
        # nothing half-done: no session, no claim, no workspace
        assert (fleet.task(task)["state"], fleet.task(task)["attempts"]) == ("queued", 0)
        assert fleet.sql("select count(*) as n from fleet.sessions")[0]["n"] == 0
        assert not fleet.workspace("work", "refused").exists()
        env_file.chmod(0o600)  # the mode alone was wrong
        done = run_shift(fleet, env, place)
        assert done.returncode == 0, done.stderr[-2000:]
        assert fleet.task(task)["state"] == "done"
        assert probed(fleet, "refused")["env"]["ANTHROPIC_API_KEY"] == "sk-ant-file"
    finally:
        fleet.close()


def test_agent_env_may_not_name_the_fleets_own_variables(tmp_path: Path) -> None:
    from worker.config import load_config
    from worker.errors import ConfigError

    for name in ("DATABASE_URL", "FLEET_KEY", "PGPASSWORD", "SUPABASE_JWT_SECRET"):
        toml = tmp_path / "fleet.toml"
        toml.write_text(f'[lanes.work]\ncommand = ["true"]\nagent_env = ["{name}"]\n')
        with pytest.raises(ConfigError) as err:
            load_config(toml, environ={})
        assert f"lanes.work.agent_env: {name} is lanefleet's own" in str(err.value)


# ------------------------------------------------------------------------------------------------
# the sandbox


@needs_bwrap
def test_a_sandboxed_agent_reads_none_of_the_fleets_secrets_and_writes_only_its_workspace(
        db_url: str, place: Path) -> None:
    marker = uuid.uuid4().hex[:10]
    env_file = private(place / "agents.env", "PROBE_TOKEN=given-to-the-agent\n")
    fleet = make_fleet(db_url, place, {"command": PROBE, "sandbox": "bwrap", "agent_env_file": str(env_file)})
    try:
        with fleet.toml.open("a") as fh:
            fh.write(f"# SECRET-{marker}-config\n")
        home = place / "home"
        secrets = {
            "config": fleet.toml,
            "dotenv": private(place / ".env", f"X=SECRET-{marker}-dotenv\n"),
            "pgpass": private(home / ".pgpass", f"127.0.0.1:5432:*:postgres:SECRET-{marker}-pgpass\n"),
            "pgpassfile": private(place / "other.pgpass", f"*:*:*:*:SECRET-{marker}-pgpassfile\n"),
            "other task": private(fleet.workspace("work", "other") / "notes.txt", f"SECRET-{marker}-workspace"),
            "other log": private(place / "ws" / "work" / "logs" / "1-other.log", f"SECRET-{marker}-log"),
            "stack.env": private(place / ".fleet" / "dev-stack" / "stack.env", f"K=SECRET-{marker}-stack-env"),
            "nginx.conf": private(place / ".fleet" / "dev-stack" / "nginx" / "nginx.conf",
                                  f"apikey SECRET-{marker}-nginx"),
            "embedded": private(place / ".fleet" / "pgdata" / "postmaster.opts", f"SECRET-{marker}-pgdata"),
            # the host's /tmp: other shifts' guard sockets, other tools' files
            "host tmp": private(Path("/tmp") / f"lanefleet-secret-{marker}", f"SECRET-{marker}-tmp"),
        }
        folders = [place / ".fleet", place / "ws", home, place]
        host_tmp = Path("/tmp") / f"lanefleet-probe-{marker}"
        outside = [host_tmp, ROOT / f".probe-{marker}", home / "written.txt", place / "written.txt",
                   fleet.workspace("work", "other") / "written.txt", fleet.toml.with_name("fleet.toml")]
        ws = fleet.workspace("work", "attack")
        task = fleet.enqueue("work", "attack", {
            "read": [str(p) for p in [*secrets.values(), env_file, *folders]],
            "write": [str(p) for p in [*outside, ws / "inside.txt"]], "guard": True, "procs": True})
        env = shift_env(fleet, place, PGPASSFILE=str(secrets["pgpassfile"]))
        before = fleet.toml.read_text()
        done = run_shift(fleet, env, place)
        assert done.returncode == 0, done.stderr[-3000:]
        assert fleet.task(task)["state"] == "done", fleet.task(task)["last_error"]
        out = probed(fleet, "attack")
        seen = json.dumps(out) + Path(fleet.runs(task)[0]["log_path"]).read_text()
        assert f"SECRET-{marker}" not in seen  # no secret file, no folder walk, no process's environment
        for value in (*CREDENTIALS.values(), fleet.db_url):
            assert value not in seen, value
        for what, path in secrets.items():
            assert not out["read"][str(path)].get("text"), what  # unreadable, or gone
        assert not out["read"][str(env_file)]["ok"]  # its values are in the agent's environment, not the file
        assert out["env"]["PROBE_TOKEN"] == "given-to-the-agent"
        # it sees no other process than its own (its PID namespace)
        assert len(out["procs"]) <= 3, sorted(out["procs"])
        # writes: its workspace only (its HOME is its own, in the workspace; its /tmp too, in memory)
        assert out["write"][str(ws / "inside.txt")] == {"ok": True} and (ws / "inside.txt").exists()
        assert out["write"][str(host_tmp)] == {"ok": True}
        for path in outside:
            assert not path.exists() or path == fleet.toml, path
        assert fleet.toml.read_text() == before
        if not ROOT.is_relative_to("/tmp"):  # a checkout under /tmp: these writes land in the
            # sandbox's own /tmp, in memory (nothing on the host: checked above)
            assert not out["write"][str(fleet.toml)]["ok"]
            assert not out["write"][str(ROOT / f'.probe-{marker}')]["ok"]
        assert out["write"][str(home / "written.txt")] == {"ok": True}
        assert (ws / ".fleet" / "home" / "written.txt").exists()
        # `fleet guard` works inside while the lease holds
        assert out["guard"] == {"rc": 0, "stderr": ""}
        # the agent's log is its owner's alone
        assert os.stat(fleet.runs(task)[0]["log_path"]).st_mode & 0o777 == 0o600
    finally:
        fleet.close()
        (Path("/tmp") / f"lanefleet-secret-{marker}").unlink(missing_ok=True)


@needs_bwrap
def test_a_sandboxed_agent_stops_gracefully_and_nothing_it_started_outlives_it(db_url: str, place: Path) -> None:
    fleet = make_fleet(db_url, place, {"command": PROBE, "sandbox": "bwrap", "grace_seconds": 5})
    try:
        task = fleet.enqueue("work", "linger", {"linger": True})
        ws = fleet.workspace("work", "linger")
        done = run_shift(fleet, shift_env(fleet, place), place, "--max-seconds", "3")
        assert done.returncode == 0, done.stderr[-3000:]
        # the shift's SIGTERM reached the agent inside the sandbox, which exited 75: a hand-off
        assert (ws / "stopped.txt").read_text() == "SIGTERM\n"
        assert [(r["outcome"], r["exit_code"]) for r in fleet.runs(task)] == [("handed_off", 75)]

        wait_for("the sandbox's daemon to end with its agent", lambda: not _lingering(ws), timeout=10)

        # SIGKILL the shift: the supervisor kills the sandbox, and its PID namespace ends with it
        (ws / "lingering.txt").unlink()
        shift = subprocess.Popen([sys.executable, "-m", "monitor.cli", "shift", "--lane", "work", "--poll", "0.1"],
                                 cwd=place, env=shift_env(fleet, place), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        try:
            wait_for("the agent's daemon", lambda: (ws / "lingering.txt").exists() and _lingering(ws), timeout=30)
            shift.send_signal(signal.SIGKILL)
            shift.wait(10)
            wait_for("nothing of the sandbox left", lambda: not _lingering(ws) and not pids_using(ws), timeout=10)
        finally:
            if shift.poll() is None:
                shift.kill()
    finally:
        fleet.close()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _lingering(ws: Path) -> list[int]:
    """The probe's daemons of workspace ``ws`` still alive (zombies are dead)."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and f"time.sleep(120) linger {ws}" in _cmdline(int(p.name)):
            found.append(int(p.name))
    return found


def test_a_lane_that_asks_for_a_sandbox_this_host_cannot_make_refuses_to_start(
        db_url: str, place: Path) -> None:
    fleet = make_fleet(db_url, place, {"command": PROBE, "sandbox": "bwrap"})
    try:
        task = fleet.enqueue("work", "nobwrap", {})
        # a PATH without bwrap on it (python is given by its absolute path)
        env = shift_env(fleet, place, PATH=str(place / "empty-bin"))
        done = run_shift(fleet, env, place)
        assert done.returncode == 1
        assert done.stderr.strip().splitlines() == [
            'error: lanes.work: its agents (lanes.work) run in a bwrap sandbox (lanes.work.sandbox = "bwrap"), '
            "but bwrap is not installed; they are not started unsandboxed (install bubblewrap, e.g. apt-get "
            'install bubblewrap, or set sandbox = "none" in [lanes.work])'], done.stderr
        assert (fleet.task(task)["state"], fleet.task(task)["attempts"]) == ("queued", 0)
        assert fleet.sql("select count(*) as n from fleet.sessions")[0]["n"] == 0
    finally:
        fleet.close()


@needs_bwrap
def test_a_sandboxed_agent_commits_in_its_git_worktree(db_url: str, place: Path) -> None:
    from gitkit import bare_origin, log_of

    origin = bare_origin(place / "origin")
    fleet = make_fleet(db_url, place, {"command": ["python", "-m", "worker.dev.example_agent", "{prompt_file}"],
                                       "sandbox": "bwrap", "repo": str(origin)})
    try:
        task = fleet.enqueue("work", "fix-1", {"steps": 2, "sleep": 0, "commit": "notes.txt"})
        done = run_shift(fleet, shift_env(fleet, place), place)
        assert done.returncode == 0, done.stderr[-3000:]
        assert fleet.task(task)["state"] == "done", fleet.task(task)["last_error"]
        # the commits went to the host's mirror (bound read-write), and the shift pushed them
        assert log_of(origin, "fleet/work/fix-1")[:2] == ["fix-1: step 2/2 (attempt 1)", "fix-1: step 1/2 (attempt 1)"]
    finally:
        fleet.close()


@needs_bwrap
def test_a_sandboxed_agent_works_in_its_mirror_but_cannot_read_origins_url(db_url: str, place: Path) -> None:
    """The mirror is bound read-write (commits go there); the file holding origin's URL, which may
    carry a token, is an empty file to the agent, and its git works all the same."""
    from gitkit import bare_origin

    marker = uuid.uuid4().hex[:10]
    origin = bare_origin(place / "origin")
    fleet = make_fleet(db_url, place, {"command": PROBE, "sandbox": "bwrap", "repo": str(origin)})
    try:
        fleet.enqueue("work", "first", {})  # makes the mirror
        assert run_shift(fleet, shift_env(fleet, place), place).returncode == 0
        (url_file,) = (place / "git").rglob("origin-url.config") if (place / "git").exists() else place.rglob(
            "origin-url.config")
        assert str(origin) in url_file.read_text() and url_file.stat().st_mode & 0o777 == 0o600
        with url_file.open("a") as fh:  # what a token in the URL would be
            fh.write(f"# SECRET-{marker}\n")
        config = url_file.with_name("config")
        task = fleet.enqueue("work", "attack", {
            "read": [str(url_file), str(config)],
            "run": [["git", "config", "--get", "remote.origin.url"], ["git", "status", "--short"],
                    ["git", "log", "--oneline", "-1"]]})
        done = run_shift(fleet, shift_env(fleet, place), place)
        assert done.returncode == 0, done.stderr[-3000:]
        assert fleet.task(task)["state"] == "done", fleet.task(task)["last_error"]
        out = probed(fleet, "attack")
        assert f"SECRET-{marker}" not in json.dumps(out) and str(origin) not in json.dumps(out["run"])
        assert out["read"][str(url_file)] == {"ok": True, "text": ""}
        assert "include" in out["read"][str(config)]["text"]  # the mirror's own config is there
        url, status, log = out["run"]
        assert (url["rc"], url["stdout"]) == (1, ""), url  # no URL to be had
        assert status["rc"] == 0 and log["rc"] == 0 and log["stdout"], (status, log)
        assert f"SECRET-{marker}" in url_file.read_text()  # the shift's own copy is untouched
    finally:
        fleet.close()


def test_a_real_agent_cli_runs_sandboxed_unless_its_lane_or_profile_says_none(tmp_path: Path) -> None:
    from worker.agent.sandbox import rules_for
    from worker.config import load_config

    toml = tmp_path / "fleet.toml"
    toml.write_text('[profiles.claude]\nagent = "claude"\nsandbox_rw = ["~/.claude"]\nagent_env = ["ANTHROPIC_API_KEY"]\n'
                    '[profiles.open]\nagent = "opencode"\nsandbox = "none"\n'
                    '[profiles.script]\ncommand = ["python", "agent.py"]\n'
                    '[lanes.a]\nprofile = "claude"\nagent_env = ["GH_TOKEN"]\nsandbox_ro = ["/opt/tools"]\n'
                    '[lanes.b]\nprofile = "open"\n'
                    '[lanes.c]\nprofile = "open"\nsandbox = "bwrap"\n'
                    '[lanes.d]\nprofile = "script"\n')
    cfg = load_config(toml, environ={})
    a = rules_for(cfg, "a", "claude", "claude")
    assert (a.sandbox, a.sandbox_from) == ("bwrap", "the default for agent claude")
    assert (a.env, a.ro, a.rw) == (("GH_TOKEN", "ANTHROPIC_API_KEY"), ("/opt/tools",), ("~/.claude",))
    assert (rules_for(cfg, "b", "open", "opencode").sandbox, rules_for(cfg, "d", "script", "generic").sandbox) \
        == ("none", "none")
    c = rules_for(cfg, "c", "open", "opencode")  # a sandbox either asks for is kept
    assert (c.sandbox, c.sandbox_from) == ("bwrap", "lanes.c.sandbox")


# ------------------------------------------------------------------------------------------------
# the fleet's secret files: their owner's alone


def test_every_file_the_fleet_writes_with_a_key_or_password_in_it_is_mode_0600(supabase_stack: Any, db_url: str,
                                                                                  place: Path, tmp_path: Path) -> None:
    from gitkit import bare_origin

    from worker.workspace.git import Mirror

    home = supabase_stack.home
    secret_files = {
        "the dev stack's state (its JWT secret, passwords, keys)": home / "stack.json",
        "the dev stack's environment (URL, keys, JWT secret, database URL)": home / "stack.env",
        "PostgREST's config (its database password, the JWT secret)": home / "postgrest.conf",
        "the gateway's config (the anon and service_role keys)": home / "nginx" / "nginx.conf",
    }
    mirror = Mirror(tmp_path / "git", str(bare_origin(tmp_path)))
    mirror.ensure()
    secret_files["a repository mirror's config"] = mirror.path / "config"
    secret_files["a repository mirror's origin URL (which may carry a token)"] = mirror.origin_url_file
    # a task's workspace and its run: the lease token (task.json), what the agent printed (its log)
    fleet = make_fleet(db_url, place, {"command": ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]})
    try:
        task = fleet.enqueue("work", "modes", {"steps": 1, "sleep": 0})
        fleet.run_shift("work", max_tasks=1)
        assert fleet.task(task)["state"] == "done"
        secret_files["a task's task.json (its lease token)"] = fleet.workspace("work", "modes") / ".fleet" / "task.json"
        secret_files["an agent's run log (what it printed)"] = Path(fleet.runs(task)[0]["log_path"])
    finally:
        fleet.close()
    modes = {what: f"{path.stat().st_mode & 0o777:04o}" for what, path in secret_files.items()}
    assert modes == dict.fromkeys(secret_files, "0600")
    # `fleet keys mint` prints its key and writes no file
    before = set(place.iterdir())
    minted = subprocess.run([sys.executable, "-m", "monitor.cli", "keys", "mint", "--role", "worker", "--lane", "work"],
                            cwd=place, env={**os.environ, "SUPABASE_JWT_SECRET": supabase_stack.jwt_secret,
                                            "HOME": str(place)}, capture_output=True, text=True, timeout=60)
    assert minted.returncode == 0, minted.stderr
    assert set(place.iterdir()) == before
