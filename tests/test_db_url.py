"""worker.db.url: a database URL as messages show it (no password), and one libpq cannot read."""

from __future__ import annotations

import pytest

from worker.db.url import check_url, redact
from worker.errors import ConfigError


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://postgres@127.0.0.1:5432/fleet", "postgresql://postgres@127.0.0.1:5432/fleet"),
    ("postgresql://postgres:s3cr%40t@127.0.0.1:5432/fleet", "postgresql://postgres@127.0.0.1:5432/fleet"),
    ("postgres://u:p@db.example/fleet?sslmode=require", "postgres://u@db.example/fleet?sslmode=require"),
    ("postgresql://u@h/d?sslmode=require&password=p", "postgresql://u@h/d?sslmode=require&password=***"),
    ("postgresql://:p@h/d", "postgresql://@h/d"),
    ("host=127.0.0.1 password=p dbname=fleet", "host=127.0.0.1 password=*** dbname=fleet"),
    ("host=127.0.0.1 password='p q' dbname=fleet", "host=127.0.0.1 password=*** dbname=fleet"),
    ("host=127.0.0.1 PASSWORD = p", "host=127.0.0.1 PASSWORD = ***"),
    ("user=postgres dbname=fleet host=127.0.0.1", "user=postgres dbname=fleet host=127.0.0.1"),
])
def test_redact_takes_the_password_out(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_a_url_libpq_cannot_read_names_where_it_came_from() -> None:
    with pytest.raises(ConfigError) as info:
        check_url("notaurl", "DATABASE_URL")
    assert str(info.value).startswith("DATABASE_URL: 'notaurl' is not a database URL: missing \"=\" after")
    with pytest.raises(ConfigError) as info:
        check_url("postgresql://u:hunter2@h/d?bogus=1", "/x/fleet.toml: database.url")
    assert str(info.value).startswith("/x/fleet.toml: database.url: 'postgresql://u@h/d?bogus=1' is not a database URL")
    assert "hunter2" not in str(info.value)
    assert check_url("postgresql://u@h/d", "DATABASE_URL") == "postgresql://u@h/d"
