"""Dispatch and guard-rail commands of ``fleet``: ``fleet profiles`` (every profile and every lane's
dispatch, resolved exactly as a spawn resolves it), ``fleet resume TASK`` (a blocked task goes back
to the queue; blocked by its verify gate, the next claim re-runs only the gate) and ``fleet review
list|approve|reject``."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from worker.config import FleetConfig
from worker.dispatch import lane_dispatch
from worker.executor import render_argv

console = Console()
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]
TaskRef = Annotated[str, typer.Argument(help="task id or key")]

# what a spawn fills in; the prompt file and workspace are per task, the session per attempt
_SAMPLE = {"prompt_file": "<prompt_file>", "workspace": "<workspace>", "task_id": "<task_id>",
           "agent_session": "<agent_session>"}


def resolved(cfg: FleetConfig) -> dict[str, Any]:
    """Profiles with each tier's argv, and per lane the dispatch of each pool and tier in order."""
    profiles = []
    for name, p in cfg.profiles.items():
        tiers = sorted({*p.models, *(t for lane in cfg.lanes.values() for t in lane.tiers)})
        profiles.append({
            "name": name, "pool": p.pool, "slots": cfg.pools[p.pool].slots if p.pool else None,
            "command": p.command, "models": p.models, "default_model": p.model,
            "limit_patterns": p.limit_patterns, "limit_exit_codes": p.limit_exit_codes,
            "throttle_backoff_seconds": p.throttle_backoff,
            "tiers": {t: {"model": p.model_for(t), "argv": render_argv(p.command, {**_SAMPLE, "model": p.model_for(t) or ""})}
                      for t in tiers if p.model_for(t)},
        })
    lanes = {}
    for name in cfg.lanes:
        lanes[name] = [{"pool": d.pool, "profile": d.profile, "tier": d.tier, "model": d.model,
                        "argv": render_argv(d.command, {**_SAMPLE, "model": d.model or ""})}
                       for d in lane_dispatch(cfg, name)]
    return {"profiles": profiles, "lanes": lanes}


def profiles(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Every dispatch profile and each lane's dispatch (pool → profile → tier → model → argv)."""
    from worker.cli import emit_json, rt

    data = resolved(rt(ctx).cfg)
    if as_json:
        emit_json(data)
        return
    if not data["profiles"]:
        console.print("no profiles in the config: lanes run their own `command` with their `model`")
    for p in data["profiles"]:
        pool = f"pool {p['pool']} ({'unlimited' if p['slots'] is None else p['slots']} slots)" if p["pool"] else "no pool"
        table = Table(title=f"profile {p['name']} — {pool}", title_justify="left")
        table.add_column("tier")
        table.add_column("model")
        table.add_column("argv")
        for tier, t in p["tiers"].items():
            table.add_row(tier, escape(t["model"] or ""), escape(" ".join(t["argv"])))
        if not p["tiers"]:
            table.add_row("-", escape(p["default_model"] or ""), escape(" ".join(render_argv(p["command"], _SAMPLE))))
        console.print(table)
    table = Table(title="lanes: what a spawn runs (pools in preference order)", title_justify="left")
    for col in ("lane", "pool", "profile", "tier", "model", "argv"):
        table.add_column(col)
    for lane, rows in data["lanes"].items():
        for d in rows:
            table.add_row(lane, d["pool"] or "-", d["profile"] or "(lane command)", d["tier"] or "-",
                          escape(d["model"] or "-"), escape(" ".join(d["argv"])))
    console.print(table)


def resume(
    ctx: typer.Context,
    ref: TaskRef,
    max_cost: Annotated[float | None, typer.Option("--max-cost", help="a new cost budget in USD (0: none)")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="a new token budget (0: none)")] = None,
) -> None:
    """Queue a blocked task again: blocked by its verify gate, only the gate runs again; blocked by
    its budget, give it a new one (--max-cost / --max-tokens) or it blocks again at once."""
    from worker.cli import rt

    store = rt(ctx).store()
    task = store.get_task(ref)
    if max_cost is not None or max_tokens is not None:
        store.set_task_budget(task.id, max_cost, max_tokens)
    state = store.resume(task.id)
    gate = task.block_reason in ("automation-broken", "capability-unavailable")
    console.print(f"task {task.id}: {state}" + (" (its verify gate runs again)" if gate else ""))


review_app = typer.Typer(no_args_is_help=True, help="Review: completed tasks of lanes with `review = true`.")


@review_app.command("list")
def review_list(ctx: typer.Context, lane: Annotated[str | None, typer.Option("--lane")] = None,
                as_json: JsonOpt = False) -> None:
    """Tasks waiting for review, oldest first."""
    from worker.cli import emit_json, rt

    tasks = [t for t in rt(ctx).store().list_tasks(lane=lane, state="review", limit=1000)]
    if as_json:
        emit_json([{"id": t.id, "lane": t.lane, "key": t.key, "title": t.title, "tier": t.tier,
                    "profile": t.run_profile, "since": t.updated_at.isoformat(),
                    "summary": (t.result or {}).get("summary") if isinstance(t.result, dict) else None}
                   for t in tasks])
        return
    if not tasks:
        console.print("nothing waits for review")
        return
    table = Table("id", "lane", "key", "tier", "profile", "since", "summary", title="waiting for review",
                  title_justify="left")
    for t in tasks:
        summary = (t.result or {}).get("summary") if isinstance(t.result, dict) else None
        table.add_row(str(t.id), t.lane, escape(t.key), t.tier or "", t.run_profile or "",
                      f"{t.updated_at:%Y-%m-%d %H:%M}", escape(str(summary or ""))[:80])
    console.print(table)


@review_app.command("approve")
def review_approve(ctx: typer.Context, ref: TaskRef,
                   note: Annotated[str | None, typer.Option("--note", help="kept in the journal")] = None) -> None:
    """Accept a task's result: it is done."""
    from worker.cli import rt

    store = rt(ctx).store()
    task = store.get_task(ref)
    console.print(f"task {task.id}: {store.review_approve(task.id, note)}")


@review_app.command("reject")
def review_reject(ctx: typer.Context, ref: TaskRef,
                  note: Annotated[str, typer.Option("--note", help="what is wrong: the next attempt's prompt carries it")]) -> None:
    """Send a task back to the queue with a note for its next attempt."""
    from worker.cli import rt

    store = rt(ctx).store()
    task = store.get_task(ref)
    console.print(f"task {task.id}: {store.review_reject(task.id, note)} (the note goes into its next prompt)")


def register(root: typer.Typer) -> None:
    root.command("profiles")(profiles)
    root.command("resume")(resume)
    root.add_typer(review_app, name="review")
