"""``fleet review list|approve|reject``: the completed tasks of lanes with ``review = true``."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from worker.cli.context import JsonTablesOpt, KeyLaneOpt, TaskRef, WideOpt, console, emit_json, rt
from worker.tables import Col, FitTable, print_table

review_app = typer.Typer(no_args_is_help=True, help="Review: completed tasks of lanes with review = true.")


@review_app.command("list")
def review_list(ctx: typer.Context, lane: Annotated[str | None, typer.Option("--lane")] = None,
                wide: WideOpt = False, as_json: JsonTablesOpt = False) -> None:
    """Tasks waiting for review, oldest first."""
    store = rt(ctx).store()
    store.check_lane(lane)
    tasks = [t for t in store.list_tasks(lane=lane, state="review", limit=1000)]
    if as_json:
        emit_json([{"id": t.id, "lane": t.lane, "key": t.key, "title": t.title, "tier": t.tier,
                    "profile": t.run_profile, "since": t.updated_at.isoformat(),
                    "summary": (t.result or {}).get("summary") if isinstance(t.result, dict) else None}
                   for t in tasks])
        return
    if not tasks:
        console.print("nothing waits for review")
        return
    table = FitTable([Col("id", "num"), Col("lane", "key"), Col("key", "key"), Col("tier", "key", 2),
                      Col("profile", "key", 2), Col("since", "key", 1), Col("summary", min_width=16)],
                     title="waiting for review", wide=wide)
    for t in tasks:
        summary = (t.result or {}).get("summary") if isinstance(t.result, dict) else None
        table.add_row(str(t.id), escape(t.lane), escape(t.key), escape(t.tier or ""), escape(t.run_profile or ""),
                      f"{t.updated_at:%Y-%m-%d %H:%M}", escape(str(summary or "")[:300]))
    print_table(console, table, wide=wide)


@review_app.command("approve")
def review_approve(ctx: typer.Context, ref: TaskRef,
                   note: Annotated[str | None, typer.Option("--note", help="kept in the journal")] = None,
                   lane: KeyLaneOpt = None) -> None:
    """Accept a task's result: it is done."""
    store = rt(ctx).store()
    task = store.get_task(ref, lane)
    console.print(f"task {task.id}: {store.review_approve(task.id, note)}")


@review_app.command("reject")
def review_reject(ctx: typer.Context, ref: TaskRef,
                  note: Annotated[str, typer.Option("--note", help="what is wrong: the next attempt's prompt carries it")],
                  lane: KeyLaneOpt = None) -> None:
    """Send a task back to the queue with a note for its next attempt."""
    store = rt(ctx).store()
    task = store.get_task(ref, lane)
    console.print(f"task {task.id}: {store.review_reject(task.id, note)} (the note goes into its next prompt)")
