"""The migrator (worker/db/migrate.py) against a real PostgreSQL, and against the real Supabase CLI.

The record lives in the CLI's own table, supabase_migrations.schema_migrations, so a database
migrated by ``fleet migrate`` looks pushed to ``supabase db push`` and the other way round.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict
from supabase_cli import CliUnavailable, db_push, ensure_cli, tcp_url, write_project

from worker.db.migrate import (
    Migration,
    fingerprint,
    load_migrations,
    migrate,
    newer,
    pending,
    split_statements,
)
from worker.errors import MigrationError

FLEET_TABLES = {"lanes", "sessions", "tasks", "runs", "lane_handoffs", "events"}


# ------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture
def ours() -> list[Migration]:
    """lanefleet's own migrations, read once per test: every step of a test sees the same files."""
    return load_migrations()


def vers(migrations: list[Migration]) -> list[str]:
    return [m.version for m in migrations]


def rows(url: str) -> list[tuple[str, list[str], str]]:
    """(version, statements, name) of every recorded migration, in version order ([] if none)."""
    with psycopg.connect(url) as c:
        if (
            c.execute("select to_regclass('supabase_migrations.schema_migrations')").fetchone()[0]
            is None
        ):
            return []
        return [
            (v, list(s) if s is not None else None, n)
            for v, s, n in c.execute(
                "select version, statements, name from supabase_migrations.schema_migrations"
                " order by version"
            ).fetchall()
        ]


def versions(url: str) -> list[str]:
    return [r[0] for r in rows(url)]


def schemas(url: str) -> set[str]:
    with psycopg.connect(url) as c:
        return {r[0] for r in c.execute("select nspname from pg_namespace").fetchall()}


def tables(url: str, schema: str) -> set[str]:
    with psycopg.connect(url) as c:
        return {
            r[0]
            for r in c.execute(
                "select table_name from information_schema.tables where table_schema = %s",
                (schema,),
            ).fetchall()
        }


def relation_exists(url: str, name: str) -> bool:
    with psycopg.connect(url) as c:
        return c.execute("select to_regclass(%s) is not null", (name,)).fetchone()[0]


def fleet_works(url: str) -> None:
    """The schema is usable: a lane, and a task enqueued in it (idempotent on its key)."""
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("insert into fleet.lanes (name) values ('docs')")
        task = c.execute("select fleet.enqueue('docs', 'k')").fetchone()[0]
        again = c.execute("select fleet.enqueue('docs', 'k')").fetchone()[0]
        assert isinstance(task, int) and task == again
        row = c.execute(
            "select lane, key, state from fleet.tasks where id = %s", (task,)
        ).fetchone()
        assert row == ("docs", "k", "queued")


def write(folder: Path, files: dict[str, str]) -> list[Migration]:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return load_migrations(folder)


# Three small migrations; each appends its version to a log, so the order they ran in is visible.
LOGGED = {
    "20260101000003_third.sql": "insert into mig_log (version) values ('20260101000003');\n",
    "20260101000001_first.sql": (
        "create table mig_log (id serial primary key, version text not null);\n"
        "insert into mig_log (version) values ('20260101000001');\n"
    ),
    "20260101000002_second.sql": (
        "create table second_t (x int);\ninsert into mig_log (version) values ('20260101000002');\n"
    ),
}


@pytest.fixture
def logged(tmp_path: Path) -> list[Migration]:
    return write(tmp_path / "migrations", LOGGED)


# ------------------------------------------------------------------------------------------------
# 1. apply, re-run, dry run


def test_lanefleet_migrations_are_well_formed(ours: list[Migration]) -> None:
    assert len(ours) >= 2
    assert vers(ours) == sorted(vers(ours))
    assert all(m.statements for m in ours)


def test_migrate_applies_all_in_order(empty_db_url: str) -> None:
    ours = load_migrations()
    result = migrate(empty_db_url)  # the default: lanefleet's own files
    assert vers(result.applied) == vers(ours)
    assert result.already == [] and result.pending == []
    assert rows(empty_db_url) == [(m.version, m.statements, m.name) for m in ours]
    assert tables(empty_db_url, "fleet") >= FLEET_TABLES
    fleet_works(empty_db_url)


def test_migrate_runs_files_in_version_order(empty_db_url: str, logged: list[Migration]) -> None:
    assert [m.version for m in logged] == ["20260101000001", "20260101000002", "20260101000003"]
    # the files were written third, first, second; they run in version order
    result = migrate(empty_db_url, migrations=logged)
    with psycopg.connect(empty_db_url) as c:
        ran = [r[0] for r in c.execute("select version from mig_log order by id").fetchall()]
    assert ran == ["20260101000001", "20260101000002", "20260101000003"]
    assert [m.version for m in result.applied] == ran
    assert versions(empty_db_url) == ran


def test_second_run_applies_nothing(empty_db_url: str, ours: list[Migration]) -> None:
    assert vers(migrate(empty_db_url, migrations=ours).applied) == vers(ours)
    before = rows(empty_db_url)
    again = migrate(empty_db_url, migrations=ours)
    assert again.applied == []
    assert again.already == vers(ours)
    assert rows(empty_db_url) == before
    fleet_works(empty_db_url)


def test_a_database_migrated_by_a_newer_lanefleet_is_seen(empty_db_url: str, ours: list[Migration]) -> None:
    """Code that lacks the last migration (an older checkout on another host) names it; the
    project's own migrations in the same table are not lanefleet's and do not count."""
    migrate(empty_db_url, migrations=ours)
    with psycopg.connect(empty_db_url, autocommit=True) as c:
        c.execute("insert into supabase_migrations.schema_migrations (version, statements, name)"
                  " values ('20991231000000', '{}', 'app_orders')")
        assert newer(c, ours) == []
        last = ours[-1]
        assert newer(c, ours[:-1]) == [f"{last.version}_{last.name}"]
    older = migrate(empty_db_url, migrations=ours[:-1])
    assert older.applied == [] and older.newer == [f"{last.version}_{last.name}"]


def test_work_on_a_newer_database_is_refused_unless_allowed(
    empty_db_url: str, ours: list[Migration], tmp_path: Path
) -> None:
    import os
    import subprocess
    import sys

    migrate(empty_db_url, migrations=ours)
    with psycopg.connect(empty_db_url, autocommit=True) as c:
        c.execute("insert into supabase_migrations.schema_migrations (version, statements, name)"
                  " values ('20991231000000', '{}', 'fleet_from_the_future')")
    (tmp_path / "fleet.toml").write_text(
        '[lanes.docs]\ncommand = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update({"DATABASE_URL": empty_db_url, "FLEET_CONFIG": str(tmp_path / "fleet.toml"), "COLUMNS": "200"})

    def fleet(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "monitor.cli", *args], cwd=tmp_path, env={**env, **extra},
                              capture_output=True, text=True, timeout=120)

    r = fleet("status")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert "migrated by a newer lanefleet" in r.stderr and "20991231000000_fleet_from_the_future" in r.stderr
    assert "upgrade lanefleet on this host" in r.stderr
    r = fleet("status", FLEET_ALLOW_NEWER_SCHEMA="1")
    assert r.returncode == 0, r.stderr
    r = fleet("migrate", "--json")
    assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert "migrated by a newer lanefleet" in r.stderr and "20991231000000_fleet_from_the_future" in r.stderr
    r = fleet("migrate", "--json", FLEET_ALLOW_NEWER_SCHEMA="1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["newer"] == ["20991231000000_fleet_from_the_future"]


def test_dry_run_lists_pending_and_applies_nothing(
    empty_db_url: str, ours: list[Migration]
) -> None:
    result = migrate(empty_db_url, dry_run=True, migrations=ours)
    assert vers(result.pending) == vers(ours)
    assert result.applied == [] and result.already == []
    assert "fleet" not in schemas(empty_db_url)
    assert "supabase_migrations" not in schemas(empty_db_url)


def test_dry_run_after_a_partial_migrate(empty_db_url: str, ours: list[Migration]) -> None:
    migrate(empty_db_url, migrations=ours[:1])
    result = migrate(empty_db_url, dry_run=True, migrations=ours)
    assert vers(result.pending) == vers(ours[1:])
    assert result.already == vers(ours[:1])
    assert versions(empty_db_url) == vers(ours[:1])
    with psycopg.connect(empty_db_url) as c:
        assert c.execute("select to_regproc('fleet.enqueue')").fetchone()[0] is None
        assert vers(pending(c, ours)) == vers(ours[1:])


# ------------------------------------------------------------------------------------------------
# 2. split_statements


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        pytest.param("select 1; select 2;", ["select 1", "select 2"], id="plain"),
        pytest.param("select 1", ["select 1"], id="no-final-semicolon"),
        pytest.param(" ;; select 1 ;\n;\t; ", ["select 1"], id="empty-statements-dropped"),
        pytest.param("", [], id="empty"),
        pytest.param("  \n\t ", [], id="white-space-only"),
        pytest.param(
            "create function f() returns int language plpgsql as $$ begin return 1; end $$;\n"
            "select 2;",
            [
                "create function f() returns int language plpgsql as $$ begin return 1; end $$",
                "select 2",
            ],
            id="dollar-quote",
        ),
        pytest.param(
            "do $body$ begin perform $$ ; $$; raise notice ';'; end $body$; select 2",
            ["do $body$ begin perform $$ ; $$; raise notice ';'; end $body$", "select 2"],
            id="tagged-dollar-quote-holds-other-dollar-quotes",
        ),
        pytest.param(
            "select $a$ $b$ ; $a$; select $b$ ; $b$;",
            ["select $a$ $b$ ; $a$", "select $b$ ; $b$"],
            id="tags-must-match",
        ),
        pytest.param(
            "select $_x1$;$_x1$; select 1",
            ["select $_x1$;$_x1$", "select 1"],
            id="tag-with-underscore-and-digit",
        ),
        pytest.param(
            'select $$ it\'s "quoted" -- not a comment /* nor this ; $$; select 2',
            ['select $$ it\'s "quoted" -- not a comment /* nor this ; $$', "select 2"],
            id="nothing-is-special-in-a-dollar-quote",
        ),
        pytest.param(
            "prepare p as select $1, $2; execute p(1, 2)",
            ["prepare p as select $1, $2", "execute p(1, 2)"],
            id="positional-parameters-are-not-dollar-quotes",
        ),
        pytest.param(
            "create table t$x$ (a int); create table u (b int)",
            ["create table t$x$ (a int)", "create table u (b int)"],
            id="dollar-inside-identifier-is-not-a-quote",
        ),
        pytest.param(
            "select '$$'; select 2",
            ["select '$$'", "select 2"],
            id="dollar-in-a-string",
        ),
        pytest.param(
            "/* outer /* inner; */ still comment; */ select 1; select 2",
            ["/* outer /* inner; */ still comment; */ select 1", "select 2"],
            id="nested-block-comments",
        ),
        pytest.param(
            "/* a /* b /* c; */ d; */ e; */ select 1;",
            ["/* a /* b /* c; */ d; */ e; */ select 1"],
            id="deeply-nested-block-comments",
        ),
        pytest.param(
            "select 1 /* it's; */ + 2; select 3",
            ["select 1 /* it's; */ + 2", "select 3"],
            id="quote-in-block-comment",
        ),
        pytest.param(
            "-- a comment; with it's quote\nselect 1; -- trailing; comment\nselect 2;",
            ["-- a comment; with it's quote\nselect 1", "-- trailing; comment\nselect 2"],
            id="line-comments-stay-with-the-next-statement",
        ),
        pytest.param(
            "-- /* not a block comment\nselect 1; select 2",
            ["-- /* not a block comment\nselect 1", "select 2"],
            id="block-opener-in-line-comment",
        ),
        pytest.param(
            "select 'a;b', 'c--d', '/*e'; select 2",
            ["select 'a;b', 'c--d', '/*e'", "select 2"],
            id="specials-in-single-quotes",
        ),
        pytest.param(
            'select 1 as "a;b", 2 as "c--"; select 2',
            ['select 1 as "a;b", 2 as "c--"', "select 2"],
            id="specials-in-double-quotes",
        ),
        pytest.param(
            "select 'it''s; ok', 'x'''; select 2",
            ["select 'it''s; ok', 'x'''", "select 2"],
            id="doubled-single-quotes",
        ),
        pytest.param(
            'select 1 as "a""b;c"; select 2',
            ['select 1 as "a""b;c"', "select 2"],
            id="doubled-double-quotes",
        ),
        pytest.param("select ''; select 2", ["select ''", "select 2"], id="empty-string"),
        pytest.param(
            "select 1;\n-- the end; really\n",
            ["select 1", "-- the end; really"],
            id="trailing-line-comment-is-kept-like-the-cli",
        ),
        pytest.param(
            "select 1;\n/* a /* b */ c */\n",
            ["select 1", "/* a /* b */ c */"],
            id="trailing-nested-block-comment-is-kept-like-the-cli",
        ),
        pytest.param(
            "select 1; -- one\n-- two\n\n",
            ["select 1", "-- one\n-- two"],
            id="trailing-comment-lines",
        ),
        pytest.param(
            "select 1; select $$ never closed; select 2",
            ["select 1", "select $$ never closed; select 2"],
            id="unterminated-dollar-quote-runs-to-the-end",
        ),
        pytest.param(
            "select 1; select 'never closed; select 2",
            ["select 1", "select 'never closed; select 2"],
            id="unterminated-quote-runs-to-the-end",
        ),
    ],
)
def test_split_statements(sql: str, expected: list[str]) -> None:
    assert split_statements(sql) == expected


def test_split_statements_of_lanefleet_files(ours: list[Migration]) -> None:
    for m in ours:
        stmts = split_statements(m.sql)
        assert stmts == m.statements
        assert all(s == s.strip() and s for s in stmts)
        # every function body stays whole
        assert all(s.count("$$") % 2 == 0 for s in stmts), m.path.name
    schema = next(m for m in ours if m.name == "fleet_schema")
    assert sum(s.count("create table fleet.") for s in schema.statements) == len(FLEET_TABLES)


# A tiny SQL grammar: statements made of tokens, where quotes, dollar quotes and comments may hold
# ';' and each other's delimiters. Joined with ';', split_statements must give them back.

_word = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
_param = st.integers(1, 99).map(lambda n: f"${n}")
_squote = st.text(max_size=12).map(lambda s: "'" + s.replace("'", "''") + "'")
_dquote = st.text(min_size=1, max_size=12).map(lambda s: '"' + s.replace('"', '""') + '"')
_tag = st.one_of(st.just(""), st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True)).map(
    lambda t: f"${t}$"
)


@st.composite
def _dollar(draw: st.DrawFn) -> str:
    tag = draw(_tag)
    body = draw(st.text(max_size=16).filter(lambda b: (b + tag).find(tag) == len(b)))
    return tag + body + tag


_line_comment = st.text(alphabet=st.characters(blacklist_characters="\n\r"), max_size=12).map(
    lambda s: f"--{s}\n"
)
_comment_text = st.text(alphabet=st.characters(blacklist_characters="/*"), max_size=8)
_block_comment = st.recursive(
    _comment_text.map(lambda s: f"/*{s}*/"),
    lambda inner: st.tuples(_comment_text, inner, _comment_text).map(
        lambda t: f"/*{t[0]}{t[1]}{t[2]}*/"
    ),
    max_leaves=4,
)
_token = st.one_of(_word, _param, _squote, _dquote, _dollar(), _line_comment, _block_comment)
_statement = st.lists(_token, min_size=1, max_size=6).map(" ".join).filter(lambda s: s.strip())
_gap = st.sampled_from(["", " ", "\n", "\n\n", "\t", " \n  "])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_statement, _gap), min_size=1, max_size=6), st.booleans())
def test_split_statements_round_trip(parts: list[tuple[str, str]], final_semicolon: bool) -> None:
    sql = ";".join(gap + stmt for stmt, gap in parts) + (";" if final_semicolon else "")
    assert split_statements(sql) == [stmt.strip() for stmt, _ in parts]


@settings(max_examples=500, deadline=None)
@given(
    st.text(
        alphabet=st.sampled_from(list("ab ;\n\r\t'\"$_-/*x1"))
        | st.characters(blacklist_categories=("Cs",)),  # a file read from disk holds no surrogates
        max_size=60,
    )
)
def test_recorded_statements_fingerprint_as_their_file(sql: str) -> None:
    # What the edit check relies on: the statements recorded for a file have the file's fingerprint
    # (else an untouched file would look edited on the next run).
    assert fingerprint("".join(split_statements(sql))) == fingerprint(sql)
    assert all(s and s == s.strip() for s in split_statements(sql))


# ------------------------------------------------------------------------------------------------
# 3. an applied file edited afterwards

EDITABLE = {
    "20260101000001_first.sql": (
        "create table first_t (\n    x int,\n    y text default 'a b'\n);\n"
    ),
    "20260101000002_second.sql": "create table second_t (x int);\n",
    "20260101000003_third.sql": "create table third_t (x int);\n",
}


@pytest.mark.parametrize(
    "edited",
    [
        pytest.param(
            "create table first_t (\n    x bigint,\n    y text default 'a b'\n);\n", id="type"
        ),
        pytest.param(
            "create table first_t (\n    x int,\n    y text default 'a c'\n);\n", id="literal"
        ),
        pytest.param(
            "create table first_t (\n    x int,\n    z text default 'a b'\n);\n", id="column"
        ),
        pytest.param(
            "create table first_t (\n    x int,\n    y text default 'a b'\n);\n"
            "create index on first_t (x);\n",
            id="added-statement",
        ),
        pytest.param("create table first_t (\n    x int\n);\n", id="removed-column"),
    ],
)
def test_edited_applied_file_stops_the_run(empty_db_url: str, tmp_path: Path, edited: str) -> None:
    folder = tmp_path / "migrations"
    ms = write(folder, EDITABLE)
    migrate(empty_db_url, migrations=ms[:1])
    (folder / "20260101000001_first.sql").write_text(edited)
    ms = load_migrations(folder)
    with pytest.raises(MigrationError, match=r"20260101000001_first\.sql.*edited"):
        migrate(empty_db_url, migrations=ms)
    with pytest.raises(MigrationError, match=r"20260101000001_first\.sql"):
        migrate(empty_db_url, migrations=ms, dry_run=True)
    with psycopg.connect(empty_db_url) as c, pytest.raises(MigrationError, match="first"):
        pending(c, ms)
    # nothing else was applied
    assert versions(empty_db_url) == ["20260101000001"]
    assert not relation_exists(empty_db_url, "second_t")
    assert not relation_exists(empty_db_url, "third_t")
    # restoring the file lets the run go on
    (folder / "20260101000001_first.sql").write_text(EDITABLE["20260101000001_first.sql"])
    result = migrate(empty_db_url, migrations=load_migrations(folder))
    assert [m.version for m in result.applied] == ["20260101000002", "20260101000003"]


def test_edit_of_a_later_applied_file_also_stops_before_pending_ones(
    empty_db_url: str, tmp_path: Path
) -> None:
    folder = tmp_path / "migrations"
    ms = write(folder, EDITABLE)
    migrate(empty_db_url, migrations=ms[:2])
    (folder / "20260101000002_second.sql").write_text("create table second_t (x text);\n")
    with pytest.raises(MigrationError, match=r"20260101000002_second\.sql"):
        migrate(empty_db_url, migrations=load_migrations(folder))
    assert versions(empty_db_url) == ["20260101000001", "20260101000002"]
    assert not relation_exists(empty_db_url, "third_t")


@pytest.mark.parametrize(
    "reformatted",
    [
        pytest.param("create table first_t (\n\tx int,\n\ty text default 'a b'\n);\n", id="tabs"),
        pytest.param("create table first_t (x int, y text default 'a b');", id="one-line"),
        pytest.param(
            "\n\ncreate   table first_t (\r\n    x int,\r\n    y text default 'a b'\r\n);\r\n\r\n",
            id="crlf-and-blank-lines",
        ),
        pytest.param(
            "create table first_t (\n    x int,\n    y text default 'a b'\n)\n", id="no-semicolon"
        ),
        pytest.param(
            "create table first_t (\n    x int,\n    y text default 'a b'\n);;\n",
            id="extra-semicolon",
        ),
    ],
)
def test_white_space_only_edit_is_not_an_edit(
    empty_db_url: str, tmp_path: Path, reformatted: str
) -> None:
    folder = tmp_path / "migrations"
    ms = write(folder, EDITABLE)
    migrate(empty_db_url, migrations=ms[:1])
    (folder / "20260101000001_first.sql").write_text(reformatted)
    result = migrate(empty_db_url, migrations=load_migrations(folder))
    assert result.already == ["20260101000001"]
    assert [m.version for m in result.applied] == ["20260101000002", "20260101000003"]


def test_file_ending_in_a_comment_is_not_edited_on_the_next_run(
    empty_db_url: str, tmp_path: Path
) -> None:
    ms = write(
        tmp_path / "migrations",
        {
            "20260101000001_a.sql": "create table a_t (x int);\n-- the end; of the file\n",
            "20260101000002_b.sql": "create table b_t (x int);\n/* outer /* inner */ end */\n",
        },
    )
    assert [m.version for m in migrate(empty_db_url, migrations=ms).applied] == [
        m.version for m in ms
    ]
    again = migrate(empty_db_url, migrations=ms)
    assert again.applied == [] and again.already == [m.version for m in ms]


# ------------------------------------------------------------------------------------------------
# 4. bad names, failing migrations


@pytest.mark.parametrize(
    "name",
    [
        "2026010100000_short.sql",
        "202601010000001_long.sql",
        "20260101000002-dash.sql",
        "20260101000002_has-dash.sql",
        "20260101000002_.sql",
        "20260101000002.sql",
        "v20260101000002_x.sql",
        "fix_things.sql",
        "20260101000002_a b.sql",
    ],
)
def test_badly_named_file_is_an_error_naming_it(tmp_path: Path, name: str) -> None:
    (tmp_path / "20260101000001_fine.sql").write_text("select 1;")
    (tmp_path / name).write_text("select 2;")
    with pytest.raises(MigrationError) as err:
        load_migrations(tmp_path)
    assert name in str(err.value)


def test_non_sql_files_are_ignored(tmp_path: Path) -> None:
    (tmp_path / "20260101000001_fine.sql").write_text("select 1;")
    (tmp_path / "README.md").write_text("notes")
    (tmp_path / "20260101000002_draft.sql.bak").write_text("select 2;")
    assert [m.path.name for m in load_migrations(tmp_path)] == ["20260101000001_fine.sql"]


def test_two_files_with_one_version_are_an_error(tmp_path: Path) -> None:
    (tmp_path / "20260101000001_a.sql").write_text("select 1;")
    (tmp_path / "20260101000001_b.sql").write_text("select 2;")
    with pytest.raises(MigrationError, match="share a version"):
        load_migrations(tmp_path)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(
            "create table bad_a (x int);\ninsert into bad_a values (1);\n"
            "select * from no_such_table;\n",
            id="runtime-error-after-ddl",
        ),
        pytest.param(
            "create table bad_a (x int);\ncreate tabel bad_b (y int);\n", id="syntax-error"
        ),
        pytest.param(
            "create table bad_a (x int);\n"
            "create function bad_f() returns int language sql as $$ select 1 $$;\n"
            "alter table no_such_table add column z int;\n",
            id="function-then-error",
        ),
    ],
)
def test_failing_migration_records_nothing_and_leaves_nothing(
    empty_db_url: str, tmp_path: Path, bad: str
) -> None:
    folder = tmp_path / "migrations"
    ms = write(
        folder,
        {
            "20260101000001_good.sql": "create table good_t (x int);\n",
            "20260101000002_bad.sql": bad,
            "20260101000003_after.sql": "create table after_t (x int);\n",
        },
    )
    with pytest.raises(MigrationError, match=r"20260101000002_bad\.sql.*failed") as err:
        migrate(empty_db_url, migrations=ms)
    assert isinstance(err.value.__cause__, psycopg.Error)
    assert versions(empty_db_url) == ["20260101000001"]
    assert relation_exists(empty_db_url, "good_t")
    assert not relation_exists(empty_db_url, "bad_a")
    assert not relation_exists(empty_db_url, "after_t")
    with psycopg.connect(empty_db_url) as c:
        assert c.execute("select to_regproc('bad_f')").fetchone()[0] is None
    # fixed, the run goes on from where it stopped
    (folder / "20260101000002_bad.sql").write_text("create table bad_a (x int);\n")
    result = migrate(empty_db_url, migrations=load_migrations(folder))
    assert [m.version for m in result.applied] == ["20260101000002", "20260101000003"]
    assert versions(empty_db_url) == ["20260101000001", "20260101000002", "20260101000003"]


def test_failing_first_migration_leaves_no_history_table(empty_db_url: str, tmp_path: Path) -> None:
    ms = write(tmp_path / "m", {"20260101000001_bad.sql": "create table t (x int); select 1/0;"})
    with pytest.raises(MigrationError, match=r"20260101000001_bad\.sql.*division by zero"):
        migrate(empty_db_url, migrations=ms)
    assert rows(empty_db_url) == []
    assert not relation_exists(empty_db_url, "t")


# ------------------------------------------------------------------------------------------------
# 5. concurrent migrators


@pytest.mark.parametrize("round_", range(3))
def test_concurrent_migrators(empty_db_url: str, ours: list[Migration], round_: int) -> None:
    n = 4
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = migrate(empty_db_url, migrations=ours)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == []
    applied = sorted(m.version for r in results for m in r.applied)  # type: ignore[union-attr]
    assert applied == vers(ours)  # each file applied by exactly one migrator
    for r in results:  # and every other one found it applied
        assert sorted([m.version for m in r.applied] + r.already) == vers(ours)  # type: ignore[union-attr]
    with psycopg.connect(empty_db_url) as c:
        counts = c.execute(
            "select version, count(*) from supabase_migrations.schema_migrations group by version"
            " order by version"
        ).fetchall()
    assert counts == [(v, 1) for v in vers(ours)]
    assert tables(empty_db_url, "fleet") >= FLEET_TABLES
    fleet_works(empty_db_url)


# ------------------------------------------------------------------------------------------------
# 6. the real Supabase CLI


@pytest.fixture(scope="session")
def supabase_cli() -> Path:
    """The Supabase CLI, installed once into .fleet/cache/supabase-cli; skips only without npm."""
    try:
        return ensure_cli()
    except CliUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def cli_db(pg_server: str, empty_db_url: str) -> str:
    """The --db-url of the test's empty database, for the CLI (skips if the server has no TCP)."""
    url = tcp_url(pg_server, str(conninfo_to_dict(empty_db_url)["dbname"]))
    if url is None:
        pytest.skip(
            "the test server is reachable only through a Unix socket; the Supabase CLI needs a TCP"
            " host and port (set TEST_DATABASE_URL to a TCP server)"
        )
    return url


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "project"
    folder.mkdir()
    yield folder


def push(cli: Path, project: Path, url: str, migrations: list[Migration]) -> str:
    """Push exactly ``migrations`` (as loaded, not as the files read now) with the CLI."""
    write_project(project, migrations)
    res = db_push(cli, project, url)
    assert res.returncode == 0, res.output
    return res.output


def test_cli_push_then_migrate_applies_nothing(
    supabase_cli: Path, cli_db: str, empty_db_url: str, project: Path, ours: list[Migration]
) -> None:
    out = push(supabase_cli, project, cli_db, ours)
    for m in ours:
        assert f"Applying migration {m.path.name}" in out
    assert versions(empty_db_url) == vers(ours)
    result = migrate(empty_db_url, migrations=ours)
    assert result.applied == []
    assert result.already == vers(ours)
    assert migrate(empty_db_url, dry_run=True, migrations=ours).pending == []
    assert versions(empty_db_url) == vers(ours)
    assert tables(empty_db_url, "fleet") >= FLEET_TABLES
    fleet_works(empty_db_url)


def test_migrate_then_cli_push_is_up_to_date(
    supabase_cli: Path, cli_db: str, empty_db_url: str, project: Path, ours: list[Migration]
) -> None:
    assert vers(migrate(empty_db_url, migrations=ours).applied) == vers(ours)
    before = rows(empty_db_url)
    out = push(supabase_cli, project, cli_db, ours)
    assert "up to date" in out.lower()
    assert "Applying migration" not in out
    assert rows(empty_db_url) == before
    fleet_works(empty_db_url)


def test_cli_pushes_first_then_migrate_applies_the_rest(
    supabase_cli: Path, cli_db: str, empty_db_url: str, tmp_path: Path, ours: list[Migration]
) -> None:
    out = push(supabase_cli, tmp_path / "first", cli_db, ours[:1])
    assert f"Applying migration {ours[0].path.name}" in out
    assert versions(empty_db_url) == vers(ours[:1])
    with psycopg.connect(empty_db_url) as c:
        assert c.execute("select to_regproc('fleet.enqueue')").fetchone()[0] is None
    result = migrate(empty_db_url, migrations=ours)
    assert result.already == vers(ours[:1])
    assert vers(result.applied) == vers(ours[1:])
    assert rows(empty_db_url) == [(m.version, m.statements, m.name) for m in ours]
    fleet_works(empty_db_url)
    # and the CLI, given all the files, finds nothing to push
    assert "up to date" in push(supabase_cli, tmp_path / "all", cli_db, ours).lower()
    assert versions(empty_db_url) == vers(ours)


def test_cli_records_the_statements_split_statements_gives(
    supabase_cli: Path, cli_db: str, empty_db_url: str, project: Path, ours: list[Migration]
) -> None:
    push(supabase_cli, project, cli_db, ours)
    assert rows(empty_db_url) == [(m.version, m.statements, m.name) for m in ours]


# Files with the constructs where a splitter can go wrong. Left out on purpose: BEGIN ATOMIC ... END
# function bodies and ';' inside bare parentheses, which the CLI keeps in one statement and
# split_statements splits (harmless: the edit check ignores where statements are split).
TRICKY = {
    "20260101000001_quotes.sql": (
        "-- leading comment; with it's quote\n"
        "create table q_t (a text default 'x;y', \"b;c\" text default 'it''s', \"d\"\"e\" int);\n"
        "insert into q_t (a) values ('--not a comment'), ('/* nor this */');\n"
        "-- trailing comment; at the end\n"
    ),
    "20260101000002_dollars.sql": (
        "create function dq_f() returns text language plpgsql as $body$\n"
        "begin\n    perform $$ ; $$;\n    return $q$it's;$q$;\nend\n$body$;\n"
        "create function dq_g(int) returns int language sql as $$ select $1 + 1; $$;\n"
        "/* outer /* nested; */ still; */ select dq_f(), dq_g(1);\n"
        "/* a trailing /* nested */ comment */\n"
    ),
    "20260101000003_plain.sql": "create table p_t (x int)",
}


def test_cli_and_split_statements_agree_on_tricky_files(
    supabase_cli: Path, cli_db: str, empty_db_url: str, project: Path, tmp_path: Path
) -> None:
    ms = write(tmp_path / "tricky", TRICKY)
    push(supabase_cli, project, cli_db, ms)
    assert rows(empty_db_url) == [(m.version, m.statements, m.name) for m in ms]
    assert migrate(empty_db_url, migrations=ms).already == [m.version for m in ms]


def test_cli_pushed_file_edited_afterwards_stops_migrate(
    supabase_cli: Path, cli_db: str, empty_db_url: str, project: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "migrations"
    ms = write(folder, EDITABLE)
    push(supabase_cli, project, cli_db, ms[:1])
    (folder / "20260101000001_first.sql").write_text("create table first_t (x int);\n")
    with pytest.raises(MigrationError, match=r"20260101000001_first\.sql"):
        migrate(empty_db_url, migrations=load_migrations(folder))
    assert versions(empty_db_url) == ["20260101000001"]
    assert not relation_exists(empty_db_url, "second_t")
