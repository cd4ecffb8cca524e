"""The worker-side commands of ``fleet``: migrate, lanes, enqueue, tasks, show, cancel, retry, db.

The monitor side (``monitor/cli.py``) composes these with its own into the one ``fleet`` app.
Every read command has ``--json``. A user mistake exits 1 with one line on stderr and writes
nothing (the SQL functions validate before they write).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import psycopg
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from worker.db.migrate import migrate as run_migrations
from worker.db.migrate import refuse_newer
from worker.errors import DatabaseUnavailable, FleetError, InvalidInput
from worker.runtime import Runtime

console = Console()
err_console = Console(stderr=True)

app = typer.Typer(no_args_is_help=True, add_completion=False, help="lanefleet: a multi-lane task queue.")
lanes_app = typer.Typer(no_args_is_help=True, help="Lanes: sync them from fleet.toml, list them.")
db_app = typer.Typer(no_args_is_help=True, help="The database: its URL, the embedded server.")

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", envvar="FLEET_CONFIG", help="fleet.toml to read [env: FLEET_CONFIG]"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]
TaskRef = Annotated[str, typer.Argument(help="task id or key")]


def root_callback(ctx: typer.Context, config: ConfigOpt = None) -> None:
    """lanefleet: a Postgres-backed, multi-lane task queue for fleets of agent workers."""
    ctx.obj = Runtime(config)
    ctx.call_on_close(ctx.obj.close)


def rt(ctx: typer.Context) -> Runtime:
    obj = ctx.find_root().obj
    assert isinstance(obj, Runtime)
    return obj


def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _jsonable(model: Any) -> Any:
    return model.model_dump(mode="json")


# -- migrate and lanes


@app.command()
def migrate(
    ctx: typer.Context,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="list pending migrations, apply none")] = False,
    sync: Annotated[bool, typer.Option(help="also sync lanes from the config")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Apply pending migrations (each in one transaction, safe to run concurrently)."""
    r = rt(ctx)
    try:
        result = run_migrations(r.url, dry_run=dry_run)
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot connect to the database: {exc}") from None
    # (after applying its own: this host's lane sync and shifts must not call what a newer one changed)
    refuse_newer(result.newer)
    lanes = r.sync_lanes() if sync and not dry_run else {}
    if as_json:
        emit_json({
            "applied": [m.path.name for m in result.applied],
            "pending": [m.path.name for m in result.pending],
            "already_applied": len(result.already),
            "newer": result.newer,
            "lanes": lanes,
        })
        return
    if dry_run:
        if result.pending:
            console.print(f"{len(result.pending)} pending:")
            for m in result.pending:
                console.print(f"  {m.path.name}")
        else:
            console.print("nothing pending")
        return
    for m in result.applied:
        console.print(f"applied {m.path.name}")
    if not result.applied:
        console.print(f"nothing to apply ({len(result.already)} already applied)")
    for name, what in lanes.items():
        if what != "unchanged":
            console.print(f"lane {name}: {what}")


@lanes_app.command("sync")
def lanes_sync(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Write the lanes of the config into fleet.lanes (create or update)."""
    result = rt(ctx).sync_lanes()
    if as_json:
        emit_json(result)
        return
    for name, what in result.items():
        console.print(f"lane {name}: {what}")


@lanes_app.command("list")
def lanes_list(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """The lanes in the database."""
    rows = rt(ctx).store().query("list_lanes")
    if as_json:
        emit_json(rows)
        return
    table = Table("lane", "max_running", "lease_s", "max_attempts", "max_handoffs", "paused", "accepts_from")
    for row in rows:
        table.add_row(row["name"], str(row["max_running"] if row["max_running"] is not None else "∞"),
                      str(row["lease_seconds"]), str(row["max_attempts"]), str(row["max_handoffs"]),
                      "yes" if row["paused"] else "", ", ".join(row["accepts_from"] or []))
    console.print(table)


# -- tasks

_RELATIVE = re.compile(r"^\+(\d+(?:\.\d+)?)(s|m|h|d)?$")


def parse_payload(value: str | None) -> dict[str, Any]:
    """``--payload``: inline JSON, or ``@path`` to a JSON file. Must be an object."""
    if value is None:
        return {}
    text = value
    if value.startswith("@"):
        path = Path(value[1:])
        try:
            text = path.read_text()
        except OSError as exc:
            raise InvalidInput(f"--payload: cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"--payload is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"--payload must be a JSON object, not a {type(data).__name__}")
    return data


def parse_run_at(value: str | None) -> tuple[datetime | None, float | None]:
    """``--run-at``: an ISO time (with a zone, or UTC) or ``+10m`` from the database's now()."""
    if value is None:
        return None, None
    m = _RELATIVE.match(value.strip())
    if m:
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}[m.group(2)]
        return None, float(m.group(1)) * unit
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidInput(f"--run-at {value!r} is neither an ISO time nor +<n>[s|m|h|d]") from None
    if when.tzinfo is None:
        from datetime import UTC

        when = when.replace(tzinfo=UTC)
    return when, None


# the fields of a line of `fleet enqueue --from` (those of fleet.enqueue_many, run_at as --run-at takes it)
TASK_LINE_FIELDS = ("key", "lane", "payload", "title", "priority", "run_at", "max_attempts", "tier", "profile",
                    "max_cost_usd", "max_tokens")


def parse_task_lines(text: str, source: str, default_lane: str | None) -> list[tuple[int, dict[str, Any]]]:
    """The tasks of a JSON Lines text, as (line number, task for ``enqueue_many``), each line checked
    before anything is queued: an error names ``source`` and the line. Blank lines are skipped."""
    out: list[tuple[int, dict[str, Any]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source} line {number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(data, dict):
            raise InvalidInput(f"{where}: a task must be a JSON object, not a {type(data).__name__}")
        unknown = sorted(set(data) - set(TASK_LINE_FIELDS))
        if unknown:
            raise InvalidInput(f"{where}: unknown field {unknown[0]!r}", f"known: {', '.join(TASK_LINE_FIELDS)}")
        key = data.get("key")
        if not isinstance(key, str) or not 1 <= len(key) <= 200:
            raise InvalidInput(f"{where}: a task needs a \"key\", a string of 1 to 200 characters")
        task: dict[str, Any] = {"key": key}
        lane = data.get("lane")
        if lane is not None and not isinstance(lane, str):
            raise InvalidInput(f"{where}: \"lane\" must be a string, not a {type(lane).__name__}")
        if lane is None and default_lane is None:
            raise InvalidInput(f"{where}: no lane: give --lane L (or LANE), or a \"lane\" on the line")
        if lane is not None:
            task["lane"] = lane
        payload = data.get("payload")
        if payload is not None and not isinstance(payload, dict):
            raise InvalidInput(f"{where}: \"payload\" must be a JSON object, not a {type(payload).__name__}")
        if payload is not None:
            task["payload"] = payload
        # the strings (whether the lane names the tier, whether the profile exists: the database says)
        for name in ("title", "tier", "profile"):
            value = data.get(name)
            if value is not None and not isinstance(value, str):
                raise InvalidInput(f"{where}: \"{name}\" must be a string, not a {type(value).__name__}")
            if value is not None:
                task[name] = value
        # the numbers: (field, types, lowest, highest, what the error says it must be)
        for name, types, low, high, must in (
            ("priority", (int,), 0, 1000, "an integer from 0 to 1000"),
            ("max_attempts", (int,), 1, 2**31 - 1, "an integer of at least 1"),
            ("max_cost_usd", (int, float), 1e-6, 1e8 - 1e-6, "a number from 0.000001 to 99,999,999.999999"),
            ("max_tokens", (int,), 1, 2**63 - 1, "an integer of at least 1"),
        ):
            value = data.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, types)
                                      or not low <= value <= high):
                raise InvalidInput(f"{where}: \"{name}\" must be {must}, not {value!r}")
            if value is not None:
                task[name] = value
        run_at = data.get("run_at")
        if run_at is not None:
            if not isinstance(run_at, str):
                raise InvalidInput(f"{where}: \"run_at\" must be a string (ISO time or +10m), not a "
                                   f"{type(run_at).__name__}")
            try:
                when, delay = parse_run_at(run_at)
            except InvalidInput:
                raise InvalidInput(f"{where}: \"run_at\" {run_at!r} is neither an ISO time nor +<n>[s|m|h|d]") from None
            if when is not None:
                task["run_at"] = when
            else:
                task["delay_seconds"] = delay
        out.append((number, task))
    return out


_TASK_INDEX = re.compile(r"^p_tasks\[(\d+)\]")


def _enqueue_from(r: Runtime, source: str, lane: str | None, as_json: bool) -> None:
    """``fleet enqueue --from``: every line checked, then one enqueue_many for all of them (one
    transaction, every lane): a bad line queues nothing."""
    import sys

    name = "stdin" if source == "-" else source
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"--from: cannot read {name}: {getattr(exc, 'strerror', None) or exc}") from None
    lines = parse_task_lines(text, name, lane)
    try:
        results = r.store().enqueue_many(lane, [task for _, task in lines]) if lines else []
    except FleetError as exc:
        # the database names the task by its index in the batch: name the line instead
        m = _TASK_INDEX.match(exc.message)
        if m is None or int(m.group(1)) >= len(lines):
            raise
        raise type(exc)(f"{name} line {lines[int(m.group(1))][0]}{exc.message[m.end():]}", exc.hint) from None
    created = sum(1 for _, c in results if c)
    existing = len(results) - created
    if as_json:
        emit_json({"created": created, "existing": existing,
                   "tasks": [{"line": number, "key": task["key"], "id": task_id, "created": c}
                             for (number, task), (task_id, c) in zip(lines, results, strict=True)]})
        return
    print(f"{created} created, {existing} already existed")


@app.command()
def enqueue(
    ctx: typer.Context,
    lane: Annotated[str | None, typer.Argument(help="the lane to queue the task in (with --from: the default lane)")] = None,
    key: Annotated[str | None, typer.Option("--key", "-k", help="idempotency key, e.g. issue:473")] = None,
    payload: Annotated[str | None, typer.Option(help="JSON object, or @file.json")] = None,
    title: Annotated[str | None, typer.Option(help="a short title")] = None,
    priority: Annotated[int | None, typer.Option(help="0..1000, higher runs first (default 0)")] = None,
    run_at: Annotated[str | None, typer.Option("--run-at", help="ISO time or +10m")] = None,
    max_attempts: Annotated[int | None, typer.Option("--max-attempts", help="override the lane's cap")] = None,
    from_file: Annotated[str | None, typer.Option(
        "--from", help="queue the tasks of a JSON Lines file ('-': stdin), one object per line: key, and "
                       "optionally lane, payload, title, priority, run_at, max_attempts, tier, profile, "
                       "max_cost_usd, max_tokens. All or nothing")] = None,
    lane_option: Annotated[str | None, typer.Option("--lane", "-l", help="the lane (the same as LANE)")] = None,
    tier: Annotated[str | None, typer.Option("--tier", help="the tier the first attempt runs at (default: the lane's)")] = None,
    profile: Annotated[str | None, typer.Option("--profile", help="a dispatch profile (default: the lane's pools)")] = None,
    max_cost: Annotated[float | None, typer.Option("--max-cost", help="the task's budget in USD, over all attempts")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="the task's budget in tokens, over all attempts")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Queue a task (prints its id; says so when the key already existed), or with --from the
    tasks of a file (prints how many were created and how many already existed)."""
    if lane is not None and lane_option is not None and lane != lane_option:
        raise InvalidInput(f"two lanes given: {lane!r} and --lane {lane_option!r}")
    lane = lane if lane is not None else lane_option
    if from_file is not None:
        given = [flag for flag, value in (("--key", key), ("--payload", payload), ("--title", title),
                                          ("--priority", priority), ("--run-at", run_at),
                                          ("--max-attempts", max_attempts), ("--tier", tier),
                                          ("--profile", profile), ("--max-cost", max_cost),
                                          ("--max-tokens", max_tokens)) if value is not None]
        if given:
            raise InvalidInput(f"--from takes each task's fields from its line; drop {', '.join(given)}")
        _enqueue_from(rt(ctx), from_file, lane, as_json)
        return
    if lane is None:
        raise InvalidInput("which lane? `fleet enqueue LANE --key K`, or `fleet enqueue --from FILE`")
    if key is None:
        raise InvalidInput("a task needs --key K, its idempotency key (or use --from FILE)")
    data = parse_payload(payload)
    when, delay = parse_run_at(run_at)
    task_id, created = rt(ctx).store().enqueue(lane, key, data, priority if priority is not None else 0, when,
                                               max_attempts, title, delay_seconds=delay, tier=tier,
                                               profile=profile, max_cost_usd=max_cost, max_tokens=max_tokens)
    if as_json:
        emit_json({"id": task_id, "created": created})
    elif created:
        print(task_id)
    else:
        print(task_id)
        err_console.print(f"key {escape(repr(key))} already existed: task {task_id} (nothing new queued)")


@app.command()
def tasks(
    ctx: typer.Context,
    lane: Annotated[str | None, typer.Option(help="only this lane")] = None,
    state: Annotated[str | None, typer.Option(help="queued, running, done, dead or cancelled")] = None,
    limit: Annotated[int, typer.Option(min=1, max=10000)] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List tasks, newest first."""
    states = {"queued", "running", "done", "dead", "cancelled"}
    if state is not None and state not in states:
        raise InvalidInput(f"--state {state!r} is not a task state ({', '.join(sorted(states))})")
    rows = rt(ctx).store().list_tasks(lane, state, limit)
    if as_json:
        emit_json([_jsonable(t) for t in rows])
        return
    table = Table("id", "lane", "key", "state", "prio", "attempts", "fail", "evap", "handoffs", "title")
    for t in rows:
        table.add_row(str(t.id), t.lane, escape(t.key), t.state, str(t.priority), str(t.attempts),
                      str(t.failures), str(t.evaporations), str(t.handoffs), escape(t.title or ""))
    console.print(table)


@app.command()
def show(ctx: typer.Context, ref: TaskRef, as_json: JsonOpt = False) -> None:
    """One task: its fields, stage history, runs and events."""
    store = rt(ctx).store()
    task = store.get_task(ref)
    runs = store.task_runs(task.id)
    events = store.task_events(task.id)
    if as_json:
        emit_json({"task": _jsonable(task), "runs": [_jsonable(r) for r in runs],
                   "events": [_jsonable(e) for e in events]})
        return
    console.print(f"[bold]task {task.id}[/] {escape(task.key)}  lane [bold]{task.lane}[/]  state [bold]{task.state}[/]")
    if task.title:
        console.print(f"title: {escape(task.title)}")
    console.print(f"attempts {task.attempts}  failures {task.failures}  evaporations {task.evaporations}"
                  f"  handoffs {task.handoffs}  priority {task.priority}")
    if task.dead_reason:
        console.print(f"dead: {escape(task.dead_reason)}")
    if task.last_error:
        console.print(f"last error: {escape(task.last_error)}")
    if task.agent_session:
        console.print(f"agent session: {escape(task.agent_session)}")
    console.print(f"payload: {escape(json.dumps(task.payload))}")
    if task.checkpoint is not None:
        console.print(f"checkpoint #{task.checkpoint_seq}: {escape(json.dumps(task.checkpoint))}")
    if task.stages:
        console.print("stages:")
        for i, st in enumerate([*task.stages, {"lane": task.lane, "current": True}], 1):
            if st.get("current"):
                console.print(f"  {i}. {st['lane']} (current, {task.state})")
            else:
                console.print(f"  {i}. {st['lane']} → {st.get('routed_to')}  attempts {st.get('attempts')}"
                              f"  note {escape(json.dumps(st.get('note')))}")
    if runs:
        table = Table("run", "lane", "attempt", "outcome", "exit", "tokens in/cache/out", "cost $", "started")
        for r in runs:
            table.add_row(str(r.id), r.lane, str(r.attempt), r.outcome or "running",
                          "" if r.exit_code is None else str(r.exit_code),
                          f"{r.input_tokens}/{r.cache_creation_tokens + r.cache_read_tokens}/{r.output_tokens}",
                          f"{r.cost_usd:.4f}", r.started_at.strftime("%Y-%m-%d %H:%M:%S"))
        console.print(table)
    table = Table("event", "time", "kind", "detail")
    for e in events:
        table.add_row(str(e.id), e.ts.strftime("%H:%M:%S"), e.kind, escape(json.dumps(e.detail)[:100]))
    console.print(table)


@app.command()
def cancel(ctx: typer.Context, ref: TaskRef) -> None:
    """Cancel a queued or running task (a running agent stops at its next heartbeat)."""
    store = rt(ctx).store()
    task = store.get_task(ref)
    console.print(f"task {task.id}: {store.cancel(task.id)}")


@app.command()
def retry(ctx: typer.Context, ref: TaskRef) -> None:
    """Queue a dead, cancelled or blocked task again, with a fresh attempt cap (the agent runs again)."""
    store = rt(ctx).store()
    task = store.get_task(ref)
    console.print(f"task {task.id}: {store.retry(task.id)}")


# -- shifts and agents


@app.command()
def shift(
    ctx: typer.Context,
    lane: Annotated[str, typer.Option("--lane", "-l", help="the lane to work")],
    max_seconds: Annotated[float | None, typer.Option("--max-seconds", help="shift length (default: the lane's shift_minutes)")] = None,
    max_tasks: Annotated[int | None, typer.Option("--max-tasks", min=1, help="claim at most this many tasks")] = None,
    slots: Annotated[int | None, typer.Option("--slots", min=1, help="agents at once (default: the lane's slots)")] = None,
    once: Annotated[bool, typer.Option("--once", help="exit as soon as nothing is ready and nothing runs")] = False,
    poll: Annotated[float, typer.Option("--poll", min=0.05, help="seconds between claims when idle")] = 0.5,
    json_logs: Annotated[bool | None, typer.Option("--json-logs/--text-logs", help="log format (default: JSON unless a terminal)")] = None,
) -> None:
    """Run one shift of a lane (what cron starts): claim, run agents, hand off at exit."""
    from worker.shift.shift import Shift, configure_logging

    r = rt(ctx)
    r.cfg.lane(lane)  # an unknown lane is an error before anything starts
    configure_logging(json_logs)
    # a call may not outlast a third of the lease: the shift must keep heartbeating its agents
    store = r.store(call_budget=max(1.0, r.cfg.lane(lane).lease_seconds / 3))
    s = Shift(store, r.cfg, lane, max_seconds=max_seconds, max_tasks=max_tasks, slots=slots,
              once=once, poll_seconds=poll)
    s.install_signal_handlers()
    summary = s.run()
    raise typer.Exit(summary.exit_code)


@app.command()
def checkpoint(
    data: Annotated[str, typer.Option("--data", "-d", help="the checkpoint, a JSON value (or @file)")],
    workspace: Annotated[Path | None, typer.Option(envvar="FLEET_WORKSPACE", help="the task workspace [env: FLEET_WORKSPACE]")] = None,
) -> None:
    """For agents: save a checkpoint; the shift stores it at its next heartbeat."""
    from worker.workspace.folder import write_atomic

    if workspace is None:
        raise InvalidInput("no workspace: run this inside a task (FLEET_WORKSPACE) or pass --workspace")
    text = Path(data[1:]).read_text() if data.startswith("@") else data
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"--data is not valid JSON: {exc.msg}") from None
    folder = workspace / ".fleet"
    if not folder.is_dir():
        raise InvalidInput(f"{workspace} is not a task workspace (no .fleet/ folder)")
    write_atomic(folder / "checkpoint.json", json.dumps(value))
    console.print("checkpoint saved; stored at the next heartbeat")


# -- the database


@db_app.command("url")
def db_url(ctx: typer.Context) -> None:
    """Print the database URL (starting the embedded server if it is the one in use)."""
    print(rt(ctx).url)


@db_app.command("stop")
def db_stop(ctx: typer.Context) -> None:
    """Stop the embedded Postgres (if it runs)."""
    r = rt(ctx)
    if not r.embedded:
        raise InvalidInput("the database is not the embedded one; nothing to stop")
    from worker.db.embedded import stop_embedded

    stopped = stop_embedded(r.cfg.path(r.cfg.fleet.home))
    console.print("stopped" if stopped else "not running")


def register(root: typer.Typer) -> None:
    """Add the worker-side commands to the composed ``fleet`` app."""
    root.registered_commands.extend(app.registered_commands)
    root.add_typer(lanes_app, name="lanes")
    root.add_typer(db_app, name="db")
    from worker import dispatch_cli
    from worker.dev import devstack
    from worker.shift import guard
    from worker.store import keys

    keys.register(root)
    devstack.register(root)
    dispatch_cli.register(root)
    guard.register(root)
