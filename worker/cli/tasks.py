"""The commands on tasks: ``fleet enqueue``, ``tasks``, ``show``, ``cancel``, ``retry`` and ``resume``."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from worker.cli.context import (
    TASK_REF_HELP,
    JsonOpt,
    KeyLaneOpt,
    TaskRef,
    WideOpt,
    console,
    emit_json,
    err_console,
    rt,
)
from worker.errors import InvalidInput
from worker.tables import Col, FitTable, fmt_secs, print_table

if TYPE_CHECKING:
    from worker.models import Run


def _jsonable(model: Any) -> Any:
    return model.model_dump(mode="json")


def enqueue(
    ctx: typer.Context,
    lane: Annotated[str | None, typer.Argument(help="the lane to queue the task in (with --from: the default lane)")] = None,
    key: Annotated[str | None, typer.Option("--key", "-k", help="idempotency key in the lane, e.g. issue:473")] = None,
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
    """Queue a task (prints its id), or with --from the tasks of a file.

    When the key already names a task in the lane, prints that task's id and says so; with --from,
    prints how many were created and how many already existed. Keys are per lane: the same key in
    another lane is another task."""
    from worker.store.reads import KEY_PREFIX
    from worker.store.task_input import enqueue_lines, parse_payload, parse_run_at, read_task_lines

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
        name, lines = read_task_lines(from_file, lane)
        results = enqueue_lines(rt(ctx).store(), name, lane, lines)
        created = sum(1 for _, c in results if c)
        existing = len(results) - created
        if as_json:
            emit_json({"created": created, "existing": existing,
                       "tasks": [{"line": number, "key": task["key"], "lane": task.get("lane") or lane,
                                  "id": task_id, "created": c}
                                 for (number, task), (task_id, c) in zip(lines, results, strict=True)]})
            return
        print(f"{created} created, {existing} already existed")
        return
    if lane is None:
        raise InvalidInput("which lane? `fleet enqueue LANE --key K`, or `fleet enqueue --from FILE`")
    if key is None:
        raise InvalidInput("a task needs --key K, its idempotency key (or use --from FILE)")
    data = parse_payload(payload)
    when, delay = parse_run_at(run_at)
    store = rt(ctx).store()
    task_id, created = store.enqueue(lane, key, data, priority if priority is not None else 0, when,
                                     max_attempts, title, delay_seconds=delay, tier=tier,
                                     profile=profile, max_cost_usd=max_cost, max_tokens=max_tokens)
    if as_json:
        emit_json({"id": task_id, "created": created})
    elif created:
        print(task_id)
    else:
        print(task_id)
        now_in = store.get_task(task_id).lane
        moved = f", now in lane {now_in}" if now_in != lane else ""
        err_console.print(f"key {escape(repr(key))} already existed in lane {lane}: task {task_id}{moved}"
                          " (nothing new queued)")
    if key.isdigit() or key.startswith(KEY_PREFIX):
        # `fleet show 17` is task 17: such a key is named as key:17
        err_console.print(f"note: commands name this task by its key as {escape(KEY_PREFIX + key)}", highlight=False)


def tasks(
    ctx: typer.Context,
    lane: Annotated[str | None, typer.Option(help="only this lane")] = None,
    state: Annotated[str | None, typer.Option(help="queued, running, done, dead or cancelled")] = None,
    limit: Annotated[int, typer.Option(min=1, max=10000)] = 50,
    wide: WideOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """List tasks, newest first."""
    from worker.store.task_input import check_state

    check_state(state)
    store = rt(ctx).store()
    store.check_lane(lane)
    rows = store.list_tasks(lane, state, limit)
    if as_json:
        emit_json([_jsonable(t) for t in rows])
        return
    table = FitTable([Col("id", "num"), Col("lane", "key"), Col("key", "key"), Col("state", "key"),
                      Col("prio", "num", 4), Col("attempts", "num", 2), Col("fail", "num", 3), Col("evap", "num", 5),
                      Col("handoffs", "num", 4), Col("title", drop=1)], wide=wide)
    for t in rows:
        table.add_row(str(t.id), escape(t.lane), escape(t.key), t.state, str(t.priority), str(t.attempts),
                      str(t.failures), str(t.evaporations), str(t.handoffs), escape(t.title or ""))
    print_table(console, table, wide=wide)


def show(ctx: typer.Context, ref: TaskRef, lane: KeyLaneOpt = None, as_json: JsonOpt = False) -> None:
    """One task: its fields, stage history, runs and events."""
    store = rt(ctx).store()
    task = store.get_task(ref, lane)
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
    waits = (task.run_at - datetime.now(UTC)).total_seconds()
    if task.state == "queued" and waits > 0:  # --run-at, --delay, a retry's backoff, a deferral
        console.print(f"not before {task.run_at.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ} (in {fmt_secs(waits)})")
    if task.dead_reason:
        console.print(f"dead: {escape(task.dead_reason)}")
    if task.last_error:
        # kept after the task went on (the runs below say when): said as history once it is done
        past = " (an earlier attempt's; it is done)" if task.state == "done" else ""
        console.print(f"last error{past}: {escape(task.last_error)}")
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
        console.print("runs:")
        for r in runs:
            for line in run_lines(r, width=console.width):
                console.print(escape(line))
    events_table = FitTable([Col("event", "num"), Col("time", "key"), Col("kind", "key"), Col("detail")])
    for e in events:
        events_table.add_row(str(e.id), e.ts.strftime("%H:%M:%S"), e.kind, escape(json.dumps(e.detail)[:300]))
    console.print(events_table)


_COST_SOURCE = {"reported": "reported by the agent", "computed": "computed from the price table",
                None: "no price for this model"}


def packed(parts: list[str], width: int, indent: str = "    ", sep: str = " · ") -> list[str]:
    """``parts`` joined by ``sep`` in lines of at most ``width`` columns, the first after
    ``indent``, the next two columns further in; broken between parts only (a part too long for
    a line gets one of its own)."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
        else:
            lines.append((indent + "  " if lines else indent) + part)
    return lines


def run_lines(r: Run, width: int = 80) -> list[str]:
    """A run in a few lines that fit ``width`` columns (broken between its fields): what ran it,
    what it spent, how it ended."""
    ended = r.outcome or "running"
    if r.exit_code is not None:
        ended += f" (exit {r.exit_code})"
    head = [f"run {r.id}", f"attempt {r.attempt}", r.lane, ended, r.started_at.strftime("%Y-%m-%d %H:%M:%S")]
    who = [r.agent or "agent ?", f"tier {r.tier or '-'}", f"profile {r.profile or '(lane command)'}",
           f"pool {r.pool or '-'}", f"model {r.model or '-'}"]
    tokens = [f"tokens {r.input_tokens:,} in", f"{r.cache_creation_tokens:,} cache write",
              f"{r.cache_read_tokens:,} cache read", f"{r.output_tokens:,} out"]
    if r.reasoning_tokens:
        tokens[-1] += f" ({r.reasoning_tokens:,} reasoning)"
    spent = f"${r.cost_usd:.4f}"
    if r.cost_usd or r.cost_source:
        spent += f" ({_COST_SOURCE.get(r.cost_source, r.cost_source)})"
    lines = [*packed(head, width, indent="  ", sep="  "), *packed(who, width), *packed(tokens, width),
             f"    cost {spent}"]
    if r.reason or r.gate:
        lines.append("    " + "  ".join(x for x in (f"reason {r.reason}" if r.reason else "",
                                                     f"gate {r.gate}" if r.gate else "") if x))
    return lines


def cancel(ctx: typer.Context, ref: TaskRef, lane: KeyLaneOpt = None) -> None:
    """Cancel a queued, running, blocked or ci task (a running agent stops at its next heartbeat)."""
    store = rt(ctx).store()
    task = store.get_task(ref, lane)
    state = store.cancel(task.id)
    # (cancelling a cancelled task changes nothing: said, not shown as if it had just happened)
    console.print(f"task {task.id}: {'already cancelled' if task.state == state == 'cancelled' else state}")


def retry(ctx: typer.Context, ref: TaskRef, lane: KeyLaneOpt = None) -> None:
    """Queue a dead, cancelled or blocked task again, with a fresh attempt cap (the agent runs again)."""
    store = rt(ctx).store()
    task = store.get_task(ref, lane)
    console.print(f"task {task.id}: {store.retry(task.id)}")


def resume(
    ctx: typer.Context,
    ref: Annotated[str | None, typer.Argument(metavar="ID|KEY", help=TASK_REF_HELP)] = None,
    max_cost: Annotated[float | None, typer.Option("--max-cost", help="a new cost budget in USD (0: none)")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="a new token budget (0: none)")] = None,
    batch: Annotated[int | None, typer.Option("--batch", help="resume a blocked batch: the next shift "
                                              "continues its member (re-runs the gate, or the landing)")] = None,
    lane: KeyLaneOpt = None,
) -> None:
    """Queue a blocked task again (or with --batch ID, a blocked batch).

    Blocked by its verify gate: only the gate runs again. Blocked by its budget: give it a new one
    (--max-cost / --max-tokens), or it blocks again at once. With --batch ID, the blocked batch's
    carrier goes back to the queue."""
    if batch is not None and ref is not None:
        raise InvalidInput("give a task or --batch, not both")
    if batch is None and ref is None:
        raise InvalidInput("name a task (ID or KEY), or --batch ID")
    store = rt(ctx).store()
    if batch is not None:
        state = store.batch_call("batch_resume", {"p_batch": batch})
        console.print(f"batch {batch}: {state} (the next shift continues its member)")
        return
    assert ref is not None
    task = store.get_task(ref, lane)
    state = store.resume(task.id, max_cost, max_tokens)  # a new budget with it, or neither
    gate = task.block_reason in ("automation-broken", "capability-unavailable")
    console.print(f"task {task.id}: {state}" + (" (its verify gate runs again)" if gate else ""))
