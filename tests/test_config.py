"""worker.config.load_config (DESIGN §9): the file, the defaults, environment overrides, and a
clear one-line ConfigError naming the field for every bad value."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from worker.config import FleetConfig, database_origin, load_config, parse_duration
from worker.errors import ConfigError, UnknownLane

DOCS = '[lanes.docs]\ncommand = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]\n'


def write(tmp_path: Path, text: str, name: str = "fleet.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def refused(path: Path | None, environ: dict[str, str] | None = None) -> str:
    """The ConfigError message load_config gives; it must be a single line."""
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={} if environ is None else environ)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# ------------------------------------------------------------------------------------------------
# defaults


def test_no_file_gives_the_example_lanes_and_the_embedded_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no ./fleet.toml here
    cfg = load_config(None, environ={})
    assert set(cfg.lanes) == {"docs", "bugfix", "review"}
    assert cfg.source is None
    assert cfg.database.url is None  # embedded Postgres
    assert cfg.fleet.store == "postgres"
    assert cfg.fleet.monitor_every == 30.0
    assert cfg.lanes["review"].accepts_from == ["bugfix"]
    for lane in cfg.lanes.values():
        assert "{prompt_file}" in lane.command
        assert lane.cron is not None
    assert cfg.base_dir == tmp_path


def test_fleet_toml_in_the_working_directory_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, DOCS + "max_running = 7\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, environ={})
    assert set(cfg.lanes) == {"docs"}  # the file's lanes replace the examples
    assert cfg.lanes["docs"].max_running == 7
    assert cfg.source == (tmp_path / "fleet.toml").resolve()


def test_fleet_config_env_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, DOCS + "max_running = 5\n", "other.toml")
    cfg = load_config(None, environ={"FLEET_CONFIG": str(path)})
    assert cfg.lanes["docs"].max_running == 5


def test_lane_defaults_and_the_documented_shape(tmp_path: Path) -> None:
    path = write(tmp_path, """
[database]
url = "postgresql://postgres@127.0.0.1:5432/fleet"

[fleet]
workspaces = "./.fleet/workspaces"
monitor_every = "30s"

[lanes.docs]
command = ["python", "-m", "worker.dev.example_agent", "{prompt_file}"]
instructions = "lane_instructions/docs.md"
max_running = 2
lease_seconds = 60
max_attempts = 3
max_handoffs = 10
cron = "*/10 * * * *"
shift_minutes = 9

[lanes.plain]
command = ["true"]
""")
    cfg = load_config(path, environ={})
    assert cfg.database.url == "postgresql://postgres@127.0.0.1:5432/fleet"
    docs = cfg.lanes["docs"]
    assert (docs.max_running, docs.lease_seconds, docs.max_attempts, docs.max_handoffs) == (2, 60, 3, 10)
    assert docs.shift_minutes == 9
    assert cfg.instructions_path("docs") == tmp_path / "lane_instructions" / "docs.md"
    # relative paths resolve against the config file's folder, not the working directory
    assert cfg.path(cfg.fleet.workspaces) == tmp_path / ".fleet" / "workspaces"
    plain = cfg.lanes["plain"]
    assert plain.max_running is None  # unlimited
    assert (plain.lease_seconds, plain.max_attempts, plain.max_handoffs) == (60, 3, 10)
    assert plain.cron is None
    assert plain.shift_slots() == 4
    assert docs.shift_slots() == 2
    with pytest.raises(UnknownLane):
        cfg.lane("nope")


def test_a_file_without_lanes_is_refused_not_given_the_example_lanes(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The example lanes run a scripted agent that fakes its work: a host whose file forgot its
    lanes would mark real tasks done. Only running without a file gets them."""
    path = write(tmp_path, '[fleet]\nmonitor_every = "1m"\n')
    with pytest.raises(ConfigError, match=r"fleet.toml: no lanes: add a \[lanes.NAME\] section"):
        load_config(path, environ={})
    # lanes from the environment alone are lanes
    cfg = load_config(path, environ={"FLEET_LANES__DOCS__COMMAND": '["my-agent"]'})
    assert set(cfg.lanes) == {"docs"} and cfg.fleet.monitor_every == 60.0
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # no ./fleet.toml, no FLEET_CONFIG: the example lanes
    assert set(load_config(environ={}).lanes) == {"docs", "bugfix", "review"}


# ------------------------------------------------------------------------------------------------
# environment overrides


def test_database_url_from_the_environment_overrides_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[database]\nurl = "postgresql://file/db"\n' + DOCS)
    assert load_config(path, environ={}).database.url == "postgresql://file/db"
    assert load_config(path, environ={"DATABASE_URL": "postgresql://env/db"}).database.url == "postgresql://env/db"
    both = {"DATABASE_URL": "postgresql://env/db", "FLEET_DATABASE__URL": "postgresql://fleet/db"}
    assert load_config(path, environ=both).database.url == "postgresql://fleet/db"
    only = {"FLEET_DATABASE__URL": "postgresql://fleet/db"}
    assert load_config(path, environ=only).database.url == "postgresql://fleet/db"
    # an empty DATABASE_URL is no override
    assert load_config(path, environ={"DATABASE_URL": ""}).database.url == "postgresql://file/db"


def test_lane_field_from_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path, DOCS + "max_running = 2\n")
    cfg = load_config(path, environ={"FLEET_LANES__DOCS__MAX_RUNNING": "4",
                                     "FLEET_FLEET__WORKSPACES": "/srv/ws",
                                     "FLEET_LANES__DOCS__PAUSED": "true",
                                     "FLEET_LANES__DOCS__ACCEPTS_FROM": '["docs"]'})
    assert cfg.lanes["docs"].max_running == 4
    assert cfg.lanes["docs"].paused is True
    assert cfg.lanes["docs"].accepts_from == ["docs"]
    assert cfg.fleet.workspaces == Path("/srv/ws")


def test_environment_override_of_the_example_lanes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, environ={"FLEET_LANES__DOCS__MAX_RUNNING": "4"})
    assert cfg.lanes["docs"].max_running == 4
    assert cfg.lanes["bugfix"].max_running == 2


def test_a_bad_environment_value_names_the_field(tmp_path: Path) -> None:
    message = refused(write(tmp_path, DOCS), {"FLEET_LANES__DOCS__MAX_RUNNING": "lots"})
    assert "lanes.docs.max_running" in message


def test_a_bad_environment_value_is_blamed_on_its_variable_not_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, DOCS + "max_running = 2\n")
    message = refused(path, {"FLEET_LANES__DOCS__MAX_RUNNING": "-1"})
    assert message.startswith("environment variable FLEET_LANES__DOCS__MAX_RUNNING: lanes.docs.max_running: "
                              "Input should be greater than or equal to 0"), message
    assert str(path) not in message
    # the same value from the file is the file's
    in_file = write(tmp_path, DOCS + "max_running = -1\n", "in-file.toml")
    assert refused(in_file).startswith(f"{in_file}: lanes.docs.max_running: ")
    # a lane only the environment names is the environment's too
    message = refused(path, {"FLEET_LANES__DOC__MAX_RUNNING": "3"})
    assert message.startswith("environment variable FLEET_LANES__DOC__MAX_RUNNING: lanes.doc: a lane needs"), message
    # a bad value in the file beside a good override stays the file's
    bad_file = write(tmp_path, DOCS + "lease_seconds = 1\n", "other.toml")
    message = refused(bad_file, {"FLEET_LANES__DOCS__MAX_RUNNING": "3"})
    assert message.startswith(f"{bad_file}: lanes.docs.lease_seconds: "), message
    message = refused(path, {"DATABASE_URL": "x", "FLEET_DATABASE__POOL_MAX": "0"})
    assert message.startswith("environment variable FLEET_DATABASE__POOL_MAX: database.pool_max: "), message


def test_an_override_through_a_value_that_is_not_a_table_names_the_variable(tmp_path: Path) -> None:
    message = refused(write(tmp_path, DOCS), {"FLEET_LANES__DOCS__COMMAND__X": "1"})
    assert message == ("environment variable FLEET_LANES__DOCS__COMMAND__X: sets lanes.docs.command.x, "
                       "but command is not a table")


def test_where_the_database_url_came_from(tmp_path: Path) -> None:
    path = write(tmp_path, '[database]\nurl = "postgresql://a@h/d"\n' + DOCS)
    assert database_origin(load_config(path, environ={}), {}) == f"{path}: database.url"
    env = {"DATABASE_URL": "postgresql://b@h/d"}
    assert database_origin(load_config(path, environ=env), env) == "DATABASE_URL"
    env = {"DATABASE_URL": "postgresql://b@h/d", "FLEET_DATABASE__URL": "postgresql://c@h/d"}
    cfg = load_config(path, environ=env)
    assert (cfg.database.url, database_origin(cfg, env)) == ("postgresql://c@h/d", "FLEET_DATABASE__URL")
    assert database_origin(load_config(write(tmp_path, DOCS), environ={}), {}) is None  # embedded


def test_unrelated_fleet_variables_are_ignored(tmp_path: Path) -> None:
    # what a shift sets for its agents must not be read as config
    cfg = load_config(write(tmp_path, DOCS), environ={"FLEET_TASK_ID": "3", "FLEET_LANE": "docs"})
    assert set(cfg.lanes) == {"docs"}


# ------------------------------------------------------------------------------------------------
# refusals: one line, naming the field


def test_unknown_field_is_refused_by_name(tmp_path: Path) -> None:
    message = refused(write(tmp_path, DOCS + "max_runing = 2\n"))
    assert "lanes.docs.max_runing" in message
    assert str(tmp_path / "fleet.toml") in message
    message = refused(write(tmp_path, "[fleeet]\nworkspaces = 'x'\n" + DOCS))
    assert "fleeet" in message


@pytest.mark.parametrize(("text", "environ", "expect"), [
    (DOCS + "max_runing = 2\n", {}, "lanes.docs.max_runing: unknown field 'max_runing' (did you mean 'max_running'?)"),
    ("[fleeet]\nworkspaces = 'x'\n" + DOCS, {}, "fleeet: unknown field 'fleeet' (did you mean 'fleet'?)"),
    ("[fleet]\nworkspace = 'x'\n" + DOCS, {}, "fleet.workspace: unknown field 'workspace' (did you mean 'workspaces'?)"),
    ("[profiles.p]\nagent = 'claude'\nmodles = {}\n" + DOCS, {},
     "profiles.p.modles: unknown field 'modles' (did you mean 'models'?)"),
    ("[database]\npool_mx = 3\n" + DOCS, {}, "database.pool_mx: unknown field 'pool_mx' (did you mean 'pool_max'?)"),
    (DOCS, {"FLEET_LANES__DOCS__LEASE_SECOND": "30"},
     "environment variable FLEET_LANES__DOCS__LEASE_SECOND: lanes.docs.lease_second: unknown field 'lease_second' "
     "(did you mean 'lease_seconds'?)"),
    (DOCS + "zzzz = 1\n", {}, "lanes.docs.zzzz: unknown field 'zzzz'"),
])
def test_a_typo_says_which_field_was_meant(tmp_path: Path, text: str, environ: dict[str, str], expect: str) -> None:
    message = refused(write(tmp_path, text), environ)
    assert message.endswith(expect), message
    if "did you mean" not in expect:
        assert "did you mean" not in message


@pytest.mark.parametrize(("field", "value"), [
    ("max_running", "-1"),
    ("lease_seconds", "1"),
    ("max_attempts", "0"),
    ("max_handoffs", "-1"),
    ("shift_minutes", "0"),
    ("slots", "0"),
    ("max_running", '"two"'),
])
def test_out_of_range_lane_values_name_the_field(tmp_path: Path, field: str, value: str) -> None:
    message = refused(write(tmp_path, DOCS + f"{field} = {value}\n"))
    assert f"lanes.docs.{field}" in message


def test_backoff_max_below_base_is_refused(tmp_path: Path) -> None:
    message = refused(write(tmp_path, DOCS + "backoff_base_seconds = 100\nbackoff_max_seconds = 10\n"))
    assert "backoff_max_seconds" in message


def test_command_is_required_and_not_empty(tmp_path: Path) -> None:
    missing = refused(write(tmp_path, "[lanes.docs]\nmax_running = 1\n"))
    assert "lanes.docs" in missing and "needs a command, a profile or an agent" in missing
    assert "lanes.docs.command" in refused(write(tmp_path, "[lanes.docs]\ncommand = []\n"))


@pytest.mark.parametrize("cron", ["*/10 * * *", "61 * * * *", "* * * * * * *", "every minute", "* * 32 * *"])
def test_bad_cron_is_refused(tmp_path: Path, cron: str) -> None:
    message = refused(write(tmp_path, DOCS + f'cron = "{cron}"\n'))
    assert "lanes.docs.cron" in message
    assert cron in message


@pytest.mark.parametrize("cron", ["*/10 * * * *", "0 9 * * mon-fri", "30 */5 * * * *"])
def test_good_cron_is_accepted(tmp_path: Path, cron: str) -> None:
    assert load_config(write(tmp_path, DOCS + f'cron = "{cron}"\n'), environ={}).lanes["docs"].cron == cron


def test_unknown_placeholder_in_command(tmp_path: Path) -> None:
    message = refused(write(tmp_path, '[lanes.docs]\ncommand = ["agent", "--prompt", "{prompt}"]\n'))
    assert "lanes.docs.command" in message
    assert "{prompt}" in message


def test_known_placeholders_are_accepted(tmp_path: Path) -> None:
    cmd = '["agent", "{prompt_file}", "--cwd={workspace}", "{model}", "{task_id}", "{agent_session}"]'
    cfg = load_config(write(tmp_path, f"[lanes.docs]\ncommand = {cmd}\n"), environ={})
    assert cfg.lanes["docs"].command[1] == "{prompt_file}"


def test_string_command_is_split_with_shlex(tmp_path: Path) -> None:
    path = write(tmp_path, """[lanes.docs]\ncommand = "claude -p --model {model} 'read {prompt_file}' --x=\\"a b\\""\n""")
    cfg = load_config(path, environ={})
    assert cfg.lanes["docs"].command == ["claude", "-p", "--model", "{model}", "read {prompt_file}", "--x=a b"]
    # and a placeholder check applies to the split words too
    assert "lanes.docs.command" in refused(write(tmp_path, '[lanes.docs]\ncommand = "agent {nope}"\n'))


def test_durations(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, '[fleet]\nmonitor_every = "30s"\nidle_alert_seconds = "5m"\n' + DOCS),
                      environ={})
    assert cfg.fleet.monitor_every == 30.0
    assert cfg.fleet.idle_alert_seconds == 300.0
    cfg = load_config(write(tmp_path, "[fleet]\nmonitor_every = 45\n" + DOCS), environ={})
    assert cfg.fleet.monitor_every == 45.0
    assert "fleet.monitor_every" in refused(write(tmp_path, '[fleet]\nmonitor_every = "5 minutes"\n' + DOCS))
    assert "fleet.monitor_every" in refused(write(tmp_path, '[fleet]\nmonitor_every = "0s"\n' + DOCS))
    assert "fleet.monitor_every" in refused(write(tmp_path, "[fleet]\nmonitor_every = -3\n" + DOCS))


@pytest.mark.parametrize(("text", "seconds"), [
    ("30s", 30.0), ("5m", 300.0), ("1.5h", 5400.0), ("250ms", 0.25), ("2d", 172800.0), ("12", 12.0),
    (" 7 s ", 7.0), (3, 3.0), (0.5, 0.5),
])
def test_parse_duration(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "s", "5x", "-5s", "0", "1e3s", "5 m s", 0, -1])
def test_parse_duration_refuses(text: str | float) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_accepts_from_must_name_a_configured_lane(tmp_path: Path) -> None:
    message = refused(write(tmp_path, DOCS + 'accepts_from = ["triage"]\n'))
    assert "lanes.docs.accepts_from" in message
    assert "triage" in message
    assert "lanes.docs.accepts_from" in refused(write(tmp_path, DOCS + 'accepts_from = ["Not A Lane"]\n'))


def test_invalid_toml(tmp_path: Path) -> None:
    message = refused(write(tmp_path, "[lanes.docs\ncommand = 1\n"))
    assert "not valid TOML" in message
    assert str(tmp_path / "fleet.toml") in message


@pytest.mark.parametrize("name", ["Docs", "-docs", "docs lane", "dócs", "a" * 64, "docs\n", "docs.x", ""])
def test_invalid_lane_name(tmp_path: Path, name: str) -> None:
    message = refused(write(tmp_path, f'[lanes.{json.dumps(name)}]\ncommand = ["true"]\n'))
    assert "not a lane name" in message


def test_longest_lane_name_is_accepted(tmp_path: Path) -> None:
    name = "a" * 63
    assert name in load_config(write(tmp_path, f'[lanes.{name}]\ncommand = ["true"]\n'), environ={}).lanes


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    assert "does not exist" in refused(missing)
    assert "does not exist" in refused(None, {"FLEET_CONFIG": str(missing)})


def test_unreadable_config_is_an_error_not_a_crash(tmp_path: Path) -> None:
    assert "cannot be read" in refused(tmp_path)  # a directory
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert str(binary) in refused(binary)


def test_lane_config_is_validated_on_assignment_too() -> None:
    cfg = FleetConfig.model_validate({"lanes": {"docs": {"command": ["true"]}}})
    with pytest.raises(ValueError):
        cfg.lanes["docs"].max_running = -1


# ------------------------------------------------------------------------------------------------
# the README's examples


def _readme_tomls() -> list[tuple[int, str]]:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(r"```toml\n(.*?)```", text, re.S)]


@pytest.mark.parametrize(("line", "text"), _readme_tomls(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_every_fleet_toml_of_the_readme_loads(tmp_path: Path, line: int, text: str) -> None:
    """Each ```toml block of README.md, tried word for word: a setting renamed or a lane it names
    missing fails here. A block that adds settings to a lane shown elsewhere (no command, profile
    or agent in it) gets the agent the README's first example gives it."""
    lanes = tomllib.loads(text).get("lanes", {})
    if not lanes:  # a fragment of settings beside the lanes (prices, …): a lane for it to load with
        text += '\n[lanes.docs]\nagent = "claude"\n'
    for name, lane in lanes.items():
        if not {"command", "profile", "agent"} & lane.keys():
            text = re.sub(rf"^\[lanes\.{name}\][^\n]*$", lambda m: m.group(0) + '\nagent = "claude"', text, flags=re.M)
    (tmp_path / "fleet.toml").write_text(text)
    cfg = load_config(tmp_path / "fleet.toml", environ={})
    assert set(cfg.lanes) >= set(lanes), f"README.md:{line}"


def test_env_settings_leaves_out_a_fallback_the_file_already_sets(tmp_path: Path) -> None:
    """`fleet crontab` warns of the settings cron would not see: SUPABASE_URL is one only while
    the file leaves [supabase] url out (else it is never read)."""
    from worker.config import env_settings

    environ = {"SUPABASE_URL": "http://env", "FLEET_KEY": "k", "DATABASE_URL": "postgresql://x/y"}
    bare = load_config(write(tmp_path, DOCS), environ={})
    assert env_settings(environ, bare) == ["DATABASE_URL", "FLEET_KEY", "SUPABASE_URL"]
    (tmp_path / "set").mkdir()
    sets = load_config(write(tmp_path / "set", '[supabase]\nurl = "http://file"\n' + DOCS), environ={})
    assert env_settings(environ, sets) == ["DATABASE_URL", "FLEET_KEY"]
