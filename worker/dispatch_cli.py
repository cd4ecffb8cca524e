"""Dispatch and guard-rail commands of ``fleet``: ``fleet profiles`` (every profile and every lane's
dispatch, resolved exactly as a spawn resolves it), ``fleet resume TASK`` (a blocked task goes back
to the queue; blocked by its verify gate, the next claim re-runs only the gate) and ``fleet review
list|approve|reject``."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from worker.agent.executor import render_argv
from worker.config import FleetConfig
from worker.shift.dispatch import lane_dispatch

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
    ref: Annotated[str | None, typer.Argument(help="task id or key")] = None,
    max_cost: Annotated[float | None, typer.Option("--max-cost", help="a new cost budget in USD (0: none)")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="a new token budget (0: none)")] = None,
    batch: Annotated[int | None, typer.Option("--batch", help="resume a blocked batch: the next shift "
                                              "continues its member (re-runs the gate, or the landing)")] = None,
) -> None:
    """Queue a blocked task again: blocked by its verify gate, only the gate runs again; blocked by
    its budget, give it a new one (--max-cost / --max-tokens) or it blocks again at once.
    ``--batch ID``: a blocked batch's carrier goes back to the queue."""
    from worker.cli import rt

    store = rt(ctx).store()
    if batch is not None:
        if ref is not None:
            raise typer.BadParameter("give a task or --batch, not both")
        state = store.batch_call("batch_resume", {"p_batch": batch})
        console.print(f"batch {batch}: {state} (the next shift continues its member)")
        return
    if ref is None:
        raise typer.BadParameter("name a task (id or key), or --batch ID")
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


batch_app = typer.Typer(no_args_is_help=True, help="Batches: members of a lane run one after another, "
                        "landed on one integration branch, shipped once.")


@batch_app.command("create")
def batch_create(
    ctx: typer.Context,
    lane: Annotated[str, typer.Argument(help="the lane (it must have a `repo`)")],
    keys: Annotated[list[str], typer.Argument(help="the members' task keys, in the order they run")],
    max_members: Annotated[int, typer.Option("--max", help="at most this many members")] = 4,
    profile: Annotated[str | None, typer.Option("--profile", help="the dispatch profile of every member "
                                                "and every recovery (default: the lane's)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Make a batch of queued tasks of LANE: one slot, members run one after another in one shift."""
    from worker.cli import emit_json, rt
    from worker.errors import ConfigError

    r = rt(ctx)
    lane_cfg = r.cfg.lanes.get(lane)
    if lane_cfg is not None and not lane_cfg.repo:
        raise ConfigError(f"lane {lane} has no `repo`: a batch lands its members on a git integration branch",
                          f"set [lanes.{lane}] repo = \"<path or URL>\" (and base) in fleet.toml")
    batch_id = r.store().batch_call("batch_create", {"p_lane": lane, "p_keys": list(keys), "p_max": max_members,
                                                     "p_profile": profile})
    if as_json:
        emit_json({"batch": batch_id, "lane": lane, "members": list(keys), "profile": profile})
    else:
        console.print(f"batch {batch_id}: {len(keys)} members in lane {lane} (carrier batch:{batch_id})")


@batch_app.command("show")
def batch_show(ctx: typer.Context, batch_id: Annotated[int, typer.Argument(help="the batch id")],
               as_json: JsonOpt = False) -> None:
    """A batch and its members: state, branch, landed range, gate, spend."""
    from worker.cli import emit_json, rt

    b = rt(ctx).store().batch_call("batch_get", {"p_batch": batch_id}, idempotent=True)
    if as_json:
        emit_json(b)
        return
    console.print(f"batch {b['id']} · lane {b['lane']} · {b['state']}"
                  + (f" ({b['block_reason']})" if b.get("block_reason") else "")
                  + f" · branch {b.get('integration_branch') or '-'} · profile {b.get('profile') or '-'}")
    table = Table("n", "key", "state", "gate", "branch", "landed", "tokens", "cost")
    for m in b["members"]:
        landed = f"{str(m['landed_from'])[:10]}..{str(m['landed_to'])[:10]}" if m.get("landed_to") else ""
        table.add_row(str(m["n"]), escape(m["key"]), m["state"], m.get("gate") or "", escape(m.get("branch") or ""),
                      landed, str(m.get("tokens") or 0), f"${float(m.get('cost_usd') or 0):.4f}")
    console.print(table)
    if b.get("report", {}).get("ship"):
        console.print(f"ship: {escape(json.dumps(b['report']['ship']))}")


def register(root: typer.Typer) -> None:
    root.command("profiles")(profiles)
    root.command("resume")(resume)
    root.add_typer(review_app, name="review")
    root.add_typer(batch_app, name="batch")
