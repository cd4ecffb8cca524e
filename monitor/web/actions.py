"""The operator's actions in the console: each one store method, the same SQL function as the CLI
command named beside it (journaled and fenced there); the console only says what it answered."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker.errors import InvalidInput
from worker.store.postgres import PostgresStore
from worker.store.supabase import SupabaseStore

Store = PostgresStore | SupabaseStore


@dataclass(frozen=True)
class Action:
    label: str  # the button
    function: str  # the SQL function it calls (what the flash message names)
    cli: str  # the same thing on the command line
    call: Callable[[Store, int, str | None], Any]
    needs_note: bool = False


def _reject(store: Store, task: int, note: str | None) -> Any:
    if not note:
        raise InvalidInput("reject needs a note: what the agent is to change")
    return store.review_reject(task, note)


ACTIONS: dict[str, Action] = {
    "resume": Action("Resume", "fleet.resume", "fleet resume", lambda s, t, _n: s.resume(t)),
    "retry": Action("Retry", "fleet.retry", "fleet retry", lambda s, t, _n: s.retry(t)),
    "cancel": Action("Cancel", "fleet.cancel", "fleet cancel", lambda s, t, _n: s.cancel(t)),
    "approve": Action("Approve", "fleet.review_approve", "fleet review approve",
                      lambda s, t, n: s.review_approve(t, n or None)),
    "reject": Action("Reject", "fleet.review_reject", "fleet review reject", _reject, needs_note=True),
    "batch-resume": Action("Resume batch", "fleet.batch_resume", "fleet resume --batch",
                           lambda s, b, _n: s.batch_call("batch_resume", {"p_batch": b})),
}


def act(store: Store, name: str, target: int, note: str | None) -> str:
    """Run action ``name`` on task (or batch) ``target``; what to tell the operator. Errors are the
    store's (FleetError: an unknown task, a wrong state), raised for the caller to show."""
    action = ACTIONS.get(name)
    if action is None:
        raise InvalidInput(f"unknown action {name!r} (known: {', '.join(ACTIONS)})")
    note = (note or "").strip() or None
    if note is not None and len(note) > 4000:
        raise InvalidInput("the note is over 4000 characters")
    answer = action.call(store, target, note)
    return f"{action.function}({target}) answered: {answer}"
