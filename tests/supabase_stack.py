"""The local Supabase-compatible stack for tests: PostgreSQL + PostgREST 12 + the nginx gateway
(``worker.dev.devstack``), started once per test session and per xdist worker, on free loopback ports,
and stopped (by pid) at the end.

Helpers make supabase-py clients the way a fleet host does (project anon key as ``apikey``, the
fleet key as ``Authorization: Bearer``), mint keys, and snapshot the fleet tables through a direct
connection so a test can show that a refused call changed nothing.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import psycopg
import pytest
from psycopg.rows import dict_row
from supabase import Client, ClientOptions, create_client

from worker.dev import devstack
from worker.store.keys import mint_key
from worker.store.supabase import SupabaseStore

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".fleet" / "cache"
# under the repo's .fleet/ (git-ignored): as root, the server runs as another user, and pytest's own
# tmp folders are private to root
STACKS = ROOT / ".fleet" / "test-stacks"
TABLES = ["lanes", "sessions", "tasks", "runs", "lane_handoffs", "events"]


def stack_home(worker_id: str, what: str = "") -> Path:
    """A folder of this test process: two test runs in one checkout never share a stack."""
    return STACKS / f"{worker_id}{what}-{os.getpid()}"


def _sweep() -> None:
    """Stop and delete the stacks of test processes that are gone (a run that was killed)."""
    for home in STACKS.glob("*-*"):
        try:
            pid = int(home.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            devstack.down(home, purge=True)


@pytest.fixture(scope="session")
def supabase_stack(worker_id: str) -> Iterator[devstack.DevStack]:
    """One stack per test session (per xdist worker), fresh, stopped and deleted afterwards."""
    _sweep()
    home = stack_home(worker_id)
    stack = devstack.up(home, cache=CACHE, fresh=True)
    mutation = os.environ.get("LANEFLEET_STACK_MUTATION")
    if mutation:  # SQL run after the migrations, to check that the tests catch a lost refusal
        with psycopg.connect(stack.db_url, autocommit=True) as conn:
            conn.execute(mutation.encode())
            conn.execute("notify pgrst, 'reload schema'")
    try:
        yield stack
    finally:
        devstack.down(home, purge=True)


@pytest.fixture
def stack(supabase_stack: devstack.DevStack) -> devstack.DevStack:
    """The session's stack with empty fleet tables (tests of one worker run one after another)."""
    with psycopg.connect(supabase_stack.db_url, autocommit=True) as conn:
        tables = [r[0] for r in conn.execute("select format('%I.%I', schemaname, tablename) from pg_tables"
                                             " where schemaname = 'fleet'").fetchall()]
        conn.execute("truncate " + ", ".join(tables) + " restart identity cascade")
    return supabase_stack


def key(stack: devstack.DevStack, role: str = "worker", lanes: list[str] | None = None,
        ttl: float = 3600) -> str:
    return mint_key(stack.jwt_secret, role, lanes, ttl)


def raw_jwt(claims: dict[str, Any], secret: str, ttl: int = 3600) -> str:
    now = int(time.time())
    return jwt.encode({"iat": now, "exp": now + ttl, "sub": str(uuid.uuid4()), **claims}, secret,
                      algorithm="HS256")


def client(stack: devstack.DevStack, bearer: str | None = None, *, apikey: str | None = None) -> Client:
    """A supabase-py client: ``apikey`` the project key (anon by default), ``bearer`` the JWT."""
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    return create_client(stack.url, apikey or stack.anon_key,
                         ClientOptions(schema="fleet", headers=headers, postgrest_client_retry=False,
                                       httpx_client=httpx.Client(timeout=30)))


def store(stack: devstack.DevStack, fleet_key: str, **kwargs: Any) -> SupabaseStore:
    return SupabaseStore(stack.url, stack.anon_key, fleet_key, **kwargs)


def sql(stack: devstack.DevStack, query: str, params: Any = ()) -> list[dict[str, Any]]:
    with psycopg.connect(stack.db_url, autocommit=True, row_factory=dict_row) as c:
        cur = c.execute(query, params)
        return cur.fetchall() if cur.description else []


def snapshot(stack: devstack.DevStack) -> dict[str, list[dict[str, Any]]]:
    """Every row of every fleet table, in a stable order (compare before and after a refusal)."""
    out = {}
    for table in TABLES:
        order = "name" if table == "lanes" else "id"
        out[table] = sql(stack, f"select * from fleet.{table} order by {order}")
    return out
