"""A usage window near its end: the shift asks the agent to hand off, and the work goes on from its
checkpoint (issue #23 item 3).

A real shift runs the scripted agent (worker.dev.example_agent), which reports ``allowed_warning``
at step 2 of 6 with a Claude Code ``rate_limit_event`` (the shape of the corpus sample
stream-json-multi-turn-cumulative-allowed-warning-2.1.285.jsonl). The shift writes
``.fleet/window_closing.json``; the agent checkpoints at its next safe point and exits 75; the
task is handed off (reason ``window-closing``), neither failed nor throttled, and the next shift's
attempt resumes from the checkpoint and finishes.

The run report's ``windows`` are read where the shift hands them over: a PostgresStore that also
keeps each report it sends to ``fleet.record_run`` (the real call is made all the same).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

from fleetkit import Backend, Fleet, lane_defaults

from worker.agent.adapters.base import WindowReading
from worker.shift.shift import WINDOW_HANDOFF_UTILIZATION, Shift, closing_window
from worker.store.postgres import PostgresStore


class KeepsReports(PostgresStore):
    """The real store, keeping the run reports it sent."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.reports: list[dict[str, Any]] = []

    def record_run(self, token: UUID, report: dict[str, Any]) -> None:
        super().record_run(token, report)
        self.reports.append(report)


def test_an_agent_warned_near_its_window_end_hands_off_and_the_next_attempt_resumes(
        db_url: str, tmp_path: Path) -> None:
    f = Fleet(Backend("postgres", db_url), tmp_path, {"work": lane_defaults()})
    store = KeepsReports(db_url)
    try:
        # a second a step: the shift has steps 3..6 to see the warning and write the signal
        task_id = f.enqueue("work", "windowed", {"steps": 6, "sleep": 1.0, "tokens": 10,
                                                 "window_warning_at_step": 2})
        before = datetime.now(UTC)
        first = Shift(store, f.cfg, "work", max_seconds=60, max_tasks=1, once=True, poll_seconds=0.1).run()
        assert first.outcomes == {"handed_off": 1}

        ws = f.workspace("work", "windowed")
        signal = json.loads((ws / ".fleet" / "window_closing.json").read_text())
        assert set(signal) == {"window", "utilization", "resets_at", "asked_at"}
        assert (signal["window"], signal["utilization"]) == ("five_hour", 0.91)
        resets_at = datetime.fromisoformat(signal["resets_at"])
        assert before + timedelta(seconds=3590) < resets_at < datetime.now(UTC) + timedelta(seconds=3610)
        assert before <= datetime.fromisoformat(signal["asked_at"]) + timedelta(seconds=1)

        t = f.task(task_id)
        # handed off: not failed, not throttled, no attempt spent on it
        assert (t["state"], t["carry_over"], t["handoffs"], t["failures"], t["attempts"]) == (
            "queued", True, 1, 0, 1)
        assert t["handoff"]["reason"] == "window-closing"
        assert t["handoff"]["window_closing"] == signal
        stopped_at = t["checkpoint"]["step"]
        assert 3 <= stopped_at <= 5, t["checkpoint"]  # at a step after the warning, before the end
        assert t["checkpoint"] == {"step": stopped_at, "of": 6, "attempt": 1, "handed_off": "window-closing"}
        assert t["handoff"]["checkpoint"] == t["checkpoint"]
        (run,) = f.runs(task_id)
        assert (run["outcome"], run["exit_code"]) == ("handed_off", 75)
        assert f.sql("select count(*) as n from fleet.journal where kind = 'throttled'")[0]["n"] == 0
        assert f.sql("select count(*) as n from fleet.pools where throttled_until is not null")[0]["n"] == 0

        # the run report carries the last reading of each window the agent's output named
        (final,) = [r for r in store.reports if r.get("exit_code") == 75]
        five_hour, seven_day = final["windows"]
        assert five_hour == {"provider": "anthropic", "window": "five_hour", "status": "allowed_warning",
                             "utilization": 0.91, "resets_at": signal["resets_at"], "window_minutes": 300}
        assert seven_day["window"] == "seven_day" and seven_day["status"] is None
        assert (seven_day["utilization"], seven_day["window_minutes"]) == (0.5, 10080)
        assert datetime.fromisoformat(seven_day["resets_at"]) == resets_at + timedelta(seconds=3600)

        second = f.run_shift("work", max_tasks=1)
        assert second.outcomes == {"done": 1}
        t = f.task(task_id)
        assert (t["state"], t["attempts"], t["failures"], t["handoffs"]) == ("done", 2, 0, 1)
        assert t["checkpoint"] == {"step": 6, "of": 6, "attempt": 2}
        # the second attempt began where the first checkpointed, and was not told to stop again
        log = Path(f.runs(task_id)[1]["log_path"]).read_text()
        assert f"step {stopped_at + 1}/6" in log and f"step {stopped_at}/6" not in log
        assert "rate_limit_event" not in log
        assert not (ws / ".fleet" / "window_closing.json").exists()
    finally:
        store.close()
        f.close()


def test_which_window_is_closing() -> None:
    threshold = WINDOW_HANDOFF_UTILIZATION
    calm = WindowReading("anthropic", "five_hour", "allowed", 0.5)
    warned = WindowReading("anthropic", "seven_day", "allowed_warning", 0.77)
    full = WindowReading("openai", "five_hour", None, threshold)
    assert closing_window([calm], threshold) is None
    assert closing_window([calm, warned], threshold) == warned  # the provider's warning, whatever the figure
    assert closing_window([full], threshold) == full  # a snapshot without status: its utilisation
    assert closing_window([WindowReading("openai", "five_hour", None, 0.94)], threshold) is None
    # a rejected window is the throttle's; a later reading of a window replaces its earlier one
    assert closing_window([WindowReading("anthropic", "five_hour", "rejected", 1.0)], threshold) is None
    assert closing_window([WindowReading("anthropic", "five_hour", "allowed_warning", 0.9), calm], threshold) is None
