"""``fleet keys mint`` and ``fleet keys inspect`` (worker/cli/keys.py, worker/store/keys.py), and the keys against the stack."""

from __future__ import annotations

import json
import time

import jwt
import pytest
import typer
from supabase_stack import client, sql
from typer.testing import CliRunner

from worker.cli import keys as keys_cli
from worker.dev.devstack import DevStack
from worker.errors import ConfigError, InvalidInput
from worker.store import keys

SECRET = "s" * 40


@pytest.fixture
def app() -> typer.Typer:
    root = typer.Typer()
    root.callback()(lambda: None)
    root.add_typer(keys_cli.app, name="keys")
    return root


def invoke(app: typer.Typer, args: list[str], env: dict[str, str] | None = None, stdin: str | None = None):
    env = {"SUPABASE_JWT_SECRET": "", "FLEET_JWT_SECRET": "", **(env or {})}
    return CliRunner().invoke(app, args, env=env, input=stdin)


def test_mint_a_worker_key(app: typer.Typer) -> None:
    res = invoke(app, ["keys", "mint", "--role", "worker", "--lane", "docs", "--lane", "bugfix", "--ttl", "30d"],
                 {"SUPABASE_JWT_SECRET": SECRET})
    assert res.exit_code == 0, res.output
    token = res.stdout.strip().splitlines()[0]
    claims = jwt.decode(token, SECRET, algorithms=["HS256"], audience="authenticated")
    assert claims["role"] == "fleet_worker" and claims["fleet_lanes"] == ["docs", "bugfix"]
    assert claims["exp"] - claims["iat"] == 30 * 86400 and abs(claims["iat"] - time.time()) < 60
    assert claims["sub"].startswith("lanefleet:worker:") and claims["aud"] == "authenticated"
    assert jwt.get_unverified_header(token)["alg"] == "HS256"
    assert res.stderr.startswith("fleet_worker key for lanes docs, bugfix, valid until "), res.stderr
    for args, said in ((["--role", "operator"], "fleet_operator key for every lane,"),
                       (["--role", "worker", "--lane", "*"], "fleet_worker key for every lane,"),
                       (["--role", "operator", "--lane", "docs"], "fleet_operator key for lane docs,")):
        res = invoke(app, ["keys", "mint", *args], {"SUPABASE_JWT_SECRET": SECRET})
        assert res.exit_code == 0 and res.stderr.startswith(said), (args, res.stderr)


def test_mint_takes_the_secret_from_the_environment_only(app: typer.Typer) -> None:
    res = invoke(app, ["keys", "mint", "--role", "worker", "--lane", "docs"])
    assert res.exit_code != 0 and isinstance(res.exception, ConfigError)
    assert "SUPABASE_JWT_SECRET" in str(res.exception)
    res = invoke(app, ["keys", "mint", "--role", "worker", "--lane", "docs", "--secret", SECRET])
    assert res.exit_code == 2 and "No such option" in res.output  # no flag to leak it into shell history
    res = invoke(app, ["keys", "mint", "--role", "operator"], {"FLEET_JWT_SECRET": SECRET})
    assert res.exit_code == 0
    claims = jwt.decode(res.stdout.split()[0], SECRET, algorithms=["HS256"], audience="authenticated")
    assert claims["role"] == "fleet_operator" and "fleet_lanes" not in claims
    with pytest.raises(ConfigError, match="at least 32"):
        keys.jwt_secret({"SUPABASE_JWT_SECRET": "short"})


@pytest.mark.parametrize(("args", "message"), [
    (["--role", "worker"], "needs at least one --lane"),
    (["--role", "admin", "--lane", "docs"], "not a key role"),
    (["--role", "worker", "--lane", "Docs; drop"], "not a lane name"),
    (["--role", "worker", "--lane", "docs", "--ttl", "soon"], "--ttl"),
])
def test_mint_refusals(app: typer.Typer, args: list[str], message: str) -> None:
    res = invoke(app, ["keys", "mint", *args], {"SUPABASE_JWT_SECRET": SECRET})
    assert res.exit_code != 0 and isinstance(res.exception, InvalidInput), res.output
    assert message in str(res.exception)


def test_inspect(app: typer.Typer) -> None:
    token = keys.mint_key(SECRET, "worker", ["docs"], 3600)
    res = invoke(app, ["keys", "inspect", "--json"], stdin=token + "\n")
    info = json.loads(res.stdout)
    assert (info["role"], info["lanes"], info["expired"], info["signature"]) == (
        "fleet_worker", ["docs"], False, "not checked")
    assert 3500 < info["seconds_left"] <= 3600
    assert res.exit_code == 0
    res = invoke(app, ["keys", "inspect", token, "--json"], {"SUPABASE_JWT_SECRET": SECRET})
    assert json.loads(res.stdout)["signature"] == "valid" and res.exit_code == 0
    # a key that would be refused: said, and exit 1 (a script may ask first)
    res = invoke(app, ["keys", "inspect", token, "--json"], {"SUPABASE_JWT_SECRET": "x" * 40})
    assert json.loads(res.stdout)["signature"] == "invalid" and res.exit_code == 1
    old = keys.mint_key(SECRET, "operator", None, 1, now=time.time() - 100)
    res = invoke(app, ["keys", "inspect", old, "--json"])
    info = json.loads(res.stdout)
    assert info["expired"] is True and info["lanes"] == "every lane" and res.exit_code == 1
    plain = invoke(app, ["keys", "inspect", token])
    assert "fleet_worker" in plain.stdout and plain.exit_code == 0
    assert "lanes         docs\n" in plain.stdout, plain.stdout  # a list as words, not a Python list
    assert "expired       no\n" in plain.stdout, plain.stdout  # not a Python bool
    bad = invoke(app, ["keys", "inspect", "not.a.jwt"])
    assert isinstance(bad.exception, InvalidInput)


def test_minted_keys_work_against_the_stack(stack: DevStack) -> None:
    sql(stack, "select fleet.sync_lane('docs', '{}'), fleet.sync_lane('bugfix', '{}')")
    sql(stack, "select fleet.enqueue('docs', 'd'), fleet.enqueue('bugfix', 'b')")
    for lanes, seen in ((["docs"], {"docs"}), (["*"], {"docs", "bugfix"}), (["nothing"], set())):
        token = keys.mint_key(stack.jwt_secret, "worker", lanes, 600)
        rows = client(stack, token).table("tasks").select("lane").execute().data
        assert {r["lane"] for r in rows} == seen, lanes
    expired = keys.mint_key(stack.jwt_secret, "worker", ["docs"], 1, now=time.time() - 3600)
    with pytest.raises(Exception, match=r"expired|JWT"):
        client(stack, expired).table("tasks").select("lane").execute()
