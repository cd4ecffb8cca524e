"""What an agent writes that the database cannot store never ends a shift (worker.shift.storable).

An agent is untrusted code: its log, its checkpoint, its attention file may hold a NUL byte, a NaN,
a lone surrogate. Before worker.shift.storable, each of them raised from the store call that
carried it (the failure's error, the checkpoint, the hand-off's snapshot, the heartbeat's attention
text) and ended the shift: every other agent stopped, and at the shift's end the session stayed
open. Real shifts, a scripted agent that writes the junk, on both back-ends.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from fleetkit import lane_defaults, wait_for

from worker.shift.storable import storable

AGENT = r'''
import json, sys, time
from pathlib import Path
junk = json.loads(Path(".fleet/task.json").read_text())["payload"]["junk"]
out = sys.stdout.buffer
if junk == "fail":        # a failure whose log ends in a NUL and bytes that are not UTF-8
    out.write(b"the tests fail \x00 \xff\xfe here\n"); out.flush()
    sys.exit(1)
if junk == "checkpoint":  # JSON that Python reads and PostgreSQL stores none of as it is
    Path(".fleet/checkpoint.json").write_text(
        '{"note": "a\\u0000b", "ratio": NaN, "big": -Infinity, "lone": "\\ud800", '
        '"pair": "\\ud83d\\ude00", "key\\u0000": [1.5, NaN]}')
if junk == "null":        # a checkpoint the database refuses
    Path(".fleet/checkpoint.json").write_text("null")
if junk == "hang":        # a NUL in its log and in what it waits for, then no end
    out.write(b"working \x00 still\n"); out.flush()
    Path(".fleet/attention.json").write_text('{"message": "allow rm \\u0000 -rf?"}')
    time.sleep(600)
print("finished", flush=True)
'''


@pytest.fixture
def junk_fleet(backend, tmp_path: Path):
    from fleetkit import Fleet

    agent = tmp_path / "junk_agent.py"
    agent.write_text(AGENT)
    f = Fleet(backend, tmp_path, {"work": lane_defaults(command=[sys.executable, str(agent)], max_attempts=1)})
    yield f
    f.close()


def test_junk_in_a_failure_and_a_checkpoint_is_stored_replaced_and_the_shift_goes_on(junk_fleet) -> None:
    f = junk_fleet
    failing = f.enqueue("work", "fail", {"junk": "fail"})
    checkpointed = f.enqueue("work", "checkpoint", {"junk": "checkpoint"})
    refused = f.enqueue("work", "null", {"junk": "null"})
    plain = f.enqueue("work", "plain", {"junk": "none"})
    summary = f.run_shift("work")
    assert summary.outcomes == {"failed": 1, "done": 3}, summary
    assert summary.reason != "error"

    t = f.task(failing)
    assert (t["state"], t["failures"]) == ("dead", 1)
    assert "the tests fail \ufffd \ufffd\ufffd here" in t["last_error"]
    assert f.task(checkpointed)["checkpoint"] == {
        "note": "a\ufffdb", "ratio": None, "big": None, "lone": "\ufffd", "pair": "\U0001f600", "key\ufffd": [1.5, None]}
    assert (f.task(refused)["state"], f.task(refused)["checkpoint"]) == ("done", None)
    assert f.task(plain)["state"] == "done"


def test_junk_in_a_running_agents_log_and_attention_reaches_the_hand_off_and_the_session_closes(junk_fleet) -> None:
    f = junk_fleet
    task_id = f.enqueue("work", "hang", {"junk": "hang"})
    shift = f.shift("work", max_seconds=60)
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(summary=shift.run()), daemon=True)
    thread.start()
    wait_for("the agent's attention to be stored",
             lambda: f.task(task_id).get("attention") == "allow rm \ufffd -rf?", timeout=20)
    shift.request_stop("SIGTERM")
    thread.join(30)
    assert not thread.is_alive()
    summary = out["summary"]
    assert summary.outcomes == {"handed_off": 1}, summary
    t = f.task(task_id)
    assert (t["state"], t["handoffs"], t["evaporations"]) == ("queued", 1, 0)
    assert "working \ufffd still" in t["handoff"]["log_tail"]
    (session,) = f.sql("select state, end_reason from fleet.sessions")
    assert session["state"] == "ended"


def test_storable_replaces_what_postgresql_cannot_store_and_keeps_the_rest() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Item:
        note: str
        n: int

    assert storable({"a\x00": ["x\x00y", float("nan"), float("inf"), 1.5, 2, None, True]}) == {
        "a\ufffd": ["x\ufffdy", None, None, 1.5, 2, None, True]}
    assert storable(("\ud800", "\ud83d\ude00")) == ("\ufffd", "\U0001f600")
    assert storable(Item("n\x00", 3)) == Item("n\ufffd", 3)
    same = {"k": "plain", "n": [1, 2.5]}
    assert storable(same) == same
