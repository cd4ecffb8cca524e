"""``fleet dev-stack`` (worker/dev/devstack.py): loopback only, reuse, stop by pid, restart on its data."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import psycopg
import typer
from supabase_stack import CACHE, client, key, stack_home
from typer.testing import CliRunner

from worker.cli import devstack as devstack_cli
from worker.dev import devstack
from worker.dev.devstack import DevStack


def listening(port: int) -> set[str]:
    """The local addresses of sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, hexport = fields[1].rsplit(":", 1)
            if int(hexport, 16) == port and fields[3] == "0A":  # LISTEN
                found.add(addr)
    return found


def test_the_stack_listens_on_loopback_only(supabase_stack: DevStack) -> None:
    s = supabase_stack
    for port in (s.api_port, s.db_port, s.rest_port, s.admin_port):
        assert listening(port) == {"0100007F"}, (port, listening(port))  # 127.0.0.1, nothing else
    with psycopg.connect(s.db_url) as conn:
        assert conn.execute("show listen_addresses").fetchone()[0] == "127.0.0.1"


def test_env_file_and_reuse(supabase_stack: DevStack) -> None:
    s = supabase_stack
    assert stat.S_IMODE(s.env_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(s.state_file.stat().st_mode) == 0o600
    env = dict(line.split("=", 1) for line in s.env_file.read_text().splitlines() if not line.startswith("#"))
    assert set(env) >= {"SUPABASE_URL", "SUPABASE_ANON_KEY", "SUPABASE_SERVICE_ROLE_KEY", "SUPABASE_JWT_SECRET",
                        "SUPABASE_DB_URL"}
    assert env["SUPABASE_URL"] == s.url and env["SUPABASE_URL"].startswith("http://127.0.0.1:")
    again = devstack.up(s.home, cache=CACHE)  # finds it running: same processes, same ports
    assert (again.pids, again.api_port, again.db_port, again.pg_pid()) == (s.pids, s.api_port, s.db_port, s.pg_pid())

    root = typer.Typer()
    root.callback()(lambda: None)
    root.add_typer(devstack_cli.app, name="dev-stack")
    out = CliRunner().invoke(root, ["dev-stack", "env", "--home", str(s.home), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == {**s.env(), "running": True}
    out = CliRunner().invoke(root, ["dev-stack", "env", "--home", str(s.home)])
    assert f"export SUPABASE_URL={s.url}" in out.stdout

    # `up` finds it running and says where everything is, a line each that fits 80 columns (a
    # path that does not fit aside), with a line to paste that loads the environment
    out = CliRunner().invoke(root, ["dev-stack", "up", "--home", str(s.home), "--no-sync"])
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert lines[0] == f"dev stack up: API {s.url}/rest/v1/ (schema fleet)", lines
    assert [line for line in lines if len(line) > 80 and str(s.env_file) not in line] == [], lines
    load = next(line for line in lines if line.startswith("load it:")).split(":", 1)[1].strip()
    shown = subprocess.run(["bash", "-c", f"{load}; echo $SUPABASE_URL"], capture_output=True, text=True,
                           env={"PATH": os.environ["PATH"]}, timeout=30)
    assert shown.stdout.strip() == s.url, (load, shown)


def test_down_stops_by_pid_and_up_restarts_on_the_same_data(worker_id: str) -> None:
    home = stack_home(worker_id, "-lifecycle")
    stack = devstack.up(home, cache=CACHE, fresh=True)
    try:
        with psycopg.connect(stack.db_url, autocommit=True) as conn:
            conn.execute("select fleet.sync_lane('kept', '{}')")
        pids = {**stack.pids, "postgres": stack.pg_pid()}
        assert all(isinstance(p, int) and devstack._alive(p) for p in pids.values())
        assert devstack.down(home) is True
        assert not any(devstack._alive(p) for p in pids.values() if p is not None)
        assert not DevStack.load(home.resolve()).running()  # type: ignore[union-attr]
        root = typer.Typer()
        root.callback()(lambda: None)
        root.add_typer(devstack_cli.app, name="dev-stack")
        out = CliRunner().invoke(root, ["dev-stack", "env", "--home", str(home)])
        assert out.exit_code == 0 and "export SUPABASE_URL=" in out.stdout  # (kept until --purge)
        assert "is not running: `fleet dev-stack up` starts it again" in " ".join(out.stderr.split()), out.stderr

        again = devstack.up(home, cache=CACHE)
        assert again.jwt_secret == stack.jwt_secret and again.anon_key == stack.anon_key
        c = client(again, key(again, "worker", ["kept"]))
        assert [r["name"] for r in c.table("lanes").select("name").execute().data] == ["kept"]
    finally:
        devstack.down(home, purge=True)
    assert not home.exists()
    assert devstack.down(home) is False


def test_a_pid_reused_by_another_program_is_left_alone(worker_id: str) -> None:
    """down() signals a recorded pid only while it still runs what the stack started."""
    import sys

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    home = stack_home(worker_id, "-stale")
    home.mkdir(parents=True, exist_ok=True)
    try:
        stale = DevStack(home=home.resolve(), api_port=1, db_port=2, rest_port=3, admin_port=4, jwt_secret="x" * 40,
                         db_password="p", authenticator_password="a", pids={"nginx": other.pid, "postgrest": other.pid})
        stale.save()
        assert devstack.down(home) is True
        assert other.poll() is None, "down() killed a process it did not start"
    finally:
        other.kill()
        other.wait()
        devstack.down(home, purge=True)
    assert os.path.exists(home) is False
