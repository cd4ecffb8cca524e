"""Every database call of a shift has a deadline shorter than its lease (worker.store.postgres.deadlines);
the same calls under a real partition: tests/partition/test_partition.py."""

from __future__ import annotations

from worker.store.postgres import PostgresStore, deadlines


def test_a_shift_store_sets_deadlines_on_every_connection() -> None:
    got = deadlines("postgresql://u@h/db?options=-c%20search_path%3Dx", 2.0, pooler=False)
    assert got == {"connect_timeout": 2, "tcp_user_timeout": 2000, "keepalives": 1, "keepalives_idle": 1,
                   "keepalives_interval": 1, "keepalives_count": 2,
                   "options": "-c search_path=x -c statement_timeout=2000"}
    assert deadlines("postgresql://u@h/db", 20.0, pooler=False)["options"] == "-c statement_timeout=20000"
    assert deadlines("postgresql://u@h/db", 20.0, pooler=False)["keepalives_idle"] == 10
    # through a pooler in transaction mode a session setting would leak to other clients: TCP only
    assert "options" not in deadlines("postgresql://u@h/db", 20.0, pooler=True)


def test_a_shift_store_connection_carries_its_statement_timeout(db_url: str) -> None:
    with PostgresStore(db_url, call_budget=4.0) as store:
        assert store._run("select current_setting('statement_timeout') as st", ()) == [{"st": "4s"}]
    with PostgresStore(db_url) as store:  # an operator's store: no deadline of a shift's
        assert store._run("select current_setting('statement_timeout') as st", ()) == [{"st": "0"}]
