"""Migrating a fresh cluster's databases at once: the roles of the security layer
(migrations/*_fleet_roles_rls.sql) belong to the cluster, so concurrent migrations (as the test
workers of a new CI machine run them) must each succeed and make each role once. (The security
layer itself, on the plain test PostgreSQL: tests/sql/test_security.py.)
"""

from __future__ import annotations

import threading

import psycopg
from supabase_stack import stack_home

from worker.db.migrate import migrate
from worker.dev import devstack


def test_concurrent_migrations_on_a_fresh_cluster(worker_id: str) -> None:
    """Roles are cluster-wide: six databases migrated at once on a new cluster (as the test
    workers of a fresh CI machine do) must all succeed, each role made once."""
    home = stack_home(worker_id, "-race").resolve()
    devstack.down(home, purge=True)
    home.mkdir(parents=True)
    stack = devstack._new_stack(home, None)
    stack.logs.mkdir(parents=True)
    try:
        devstack._start_postgres(stack)
        stack.save()
        base = stack.db_url.rsplit("/", 1)[0]
        with psycopg.connect(stack.db_url, autocommit=True) as c:
            for i in range(6):
                c.execute(f"create database race{i}")
        errors: list[BaseException] = []
        barrier = threading.Barrier(6)

        def run(i: int) -> None:
            try:
                barrier.wait(30)
                migrate(f"{base}/race{i}")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        with psycopg.connect(stack.db_url) as c:
            members = c.execute("select count(*) from pg_auth_members m join pg_roles r on r.oid = m.member"
                                " where r.rolname = 'authenticator'").fetchone()[0]
            roles = c.execute("select count(*) from pg_roles where rolname in ('anon', 'authenticated',"
                              " 'service_role', 'authenticator', 'fleet_worker', 'fleet_operator')").fetchone()[0]
        assert (members, roles) == (5, 6)
    finally:
        devstack.down(home, purge=True)
