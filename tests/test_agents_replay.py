"""Real agent CLI output (tests/agents/corpus/, sources in its README) replayed through real shifts
by tests/agents/replay.py, on both store back-ends: what the run, the task and the journal record,
against figures worked out by hand from each sample."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from fleetkit import Backend, Fleet, lane_defaults

CORPUS = Path(__file__).resolve().parent / "agents" / "corpus"
REPLAY = str(Path(__file__).resolve().parent / "agents" / "replay.py")


def replay(*pairs: tuple[str, int | str], resume: bool = False) -> list[str]:
    """The replay agent's argv: attempt N replays pair N (sample under the corpus, exit code)."""
    argv = [sys.executable, REPLAY]
    for sample, code in pairs:
        argv += [sample if sample.startswith("/") else str(CORPUS / sample), str(code)]
    return [*argv, "--resume", "{agent_session}"] if resume else argv


@pytest.fixture
def agent_fleet(backend: Backend, tmp_path: Path):
    """A lane ``work`` whose profile ``p`` runs the replay agent under the adapter ``agent``."""
    made: list[Fleet] = []

    def make(agent: str, command: list[str], model: str = "m", **lane: Any) -> Fleet:
        settings = lane_defaults(profile="p", **lane)
        del settings["command"]
        tables = {"profiles": {"p": {"command": command, "agent": agent, "model": model}}}
        f = Fleet(backend, tmp_path, {"work": settings}, tables=tables)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def one_run(fleet: Fleet, key: str, **shift: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    task = fleet.enqueue("work", key, {})
    fleet.run_shift("work", max_tasks=1, once=True, **shift)
    runs = fleet.runs(task)
    assert len(runs) == 1, runs
    return fleet.task(task), runs[0]


def tokens(run: dict[str, Any]) -> tuple[int, int, int, int, int]:
    return (run["input_tokens"], run["cache_creation_tokens"], run["cache_read_tokens"], run["output_tokens"],
            run["reasoning_tokens"])


def events(fleet: Fleet, task: int, kind: str) -> list[dict[str, Any]]:
    return [r["detail"] for r in fleet.sql("select detail from fleet.events where task_id = %s and kind = %s "
                                           "order by id", (task, kind))]
