"""Capacity windows with real shifts (issue #23): two pools, the first with a 5-hour window; the
scripted agent's recorded usage fills it, and the claims spill to the second pool before the
first's budget is crossed — no throttle its recorded usage could have foreseen. `fleet status`
shows the window."""

from __future__ import annotations

from pathlib import Path

from fleetkit import AGENT, Backend, Fleet, lane_defaults


def test_claims_spill_to_the_second_pool_before_the_first_windows_budget_is_crossed(db_url: str,
                                                                                    tmp_path: Path) -> None:
    script = "steps=1,sleep=0.05,tokens=100"
    # (no sandbox: these test the windows, test_agent_sandbox.py the sandbox, which needs bwrap)
    profiles = {"first": {"command": [*AGENT, "--script", script], "agent": "claude", "pool": "first",
                          "sandbox": "none"},
                "second": {"command": [*AGENT, "--script", script], "agent": "claude", "pool": "second",
                           "sandbox": "none"}}
    # a task records ~1,850 tokens here (the scripted agent's usage at tokens=100)
    pools = {"first": {"slots": 4, "reserve": 0.0,
                       "windows": {"five_hour": {"hours": 5, "budget_tokens": 4_000}}},
             "second": {"slots": 4}}
    lane = lane_defaults(pools=["first", "second"], profile="first")
    del lane["command"]  # the profiles' commands
    fleet = Fleet(Backend("postgres", db_url), tmp_path, {"work": lane}, tables={"pools": pools, "profiles": profiles})
    try:
        ids = [fleet.enqueue("work", f"t{n}") for n in range(4)]
        drawn = []
        for task_id in ids:
            summary = fleet.run_shift("work", max_tasks=1)
            assert summary.claimed == 1
            drawn.append(fleet.runs(task_id)[-1]["pool"])
        per_task = sum(fleet.runs(ids[0])[0][k] for k in ("input_tokens", "cache_creation_tokens",
                                                          "cache_read_tokens", "output_tokens"))
        assert 2 * per_task <= 4_000 < 3 * per_task, per_task
        # two tasks fit the 4,000 tokens; the third, expected to spend what the first did, does not
        assert drawn[:2] == ["first", "first"] and drawn[2:] == ["second", "second"], (drawn, per_task)
        used = fleet.sql("select used_tokens from fleet.pool_windows where pool = 'first'")[0]["used_tokens"]
        assert used == 2 * per_task <= 4_000
        assert not fleet.sql("select 1 from fleet.journal where kind = 'throttled'")
        status = fleet.cli("status")
        assert status.returncode == 0, status.stderr
        assert "usage windows" in status.stdout and "five_hour" in status.stdout
    finally:
        fleet.close()


def test_the_providers_reading_in_a_real_run_corrects_the_estimate(db_url: str, tmp_path: Path) -> None:
    """Claude Code's rate_limit_event (as the scripted agent prints it, in the shape of a real
    capture) lands in fleet.pool_window_readings; the window's figure is then the provider's."""
    script = "steps=3,sleep=0.05,tokens=100,window_warning_at_step=1,window_warning_type=five_hour,window_warning_utilization=0.6"
    profiles = {"claude": {"command": [*AGENT, "--script", script], "agent": "claude", "pool": "max",
                           "sandbox": "none"}}  # (as above)
    pools = {"max": {"slots": 2, "windows": {"five_hour": {"hours": 5, "budget_tokens": 1_000_000}}}}
    lane = lane_defaults(profile="claude")
    del lane["command"]
    fleet = Fleet(Backend("postgres", db_url), tmp_path, {"work": lane}, tables={"pools": pools, "profiles": profiles})
    try:
        task_id = fleet.enqueue("work", "warned")
        fleet.run_shift("work", max_tasks=1)
        (reading,) = fleet.sql("select * from fleet.pool_window_readings where pool = 'max' and window_name = 'five_hour'")
        assert float(reading["utilization"]) == 0.6 and reading["status"] == "allowed_warning"
        (w,) = fleet.sql("select * from fleet.pool_windows where pool = 'max'")
        assert w["source"] == "provider" and float(w["utilization"]) >= 0.6
        # what the runs said then: this run's tokens over the budget, far below the provider's 0.6
        estimate = float(reading["estimate_utilization"])
        assert estimate < 0.01 and abs(float(w["estimate_off_by"]) - (0.6 - estimate)) < 1e-4
        assert fleet.runs(task_id)[0]["pool"] == "max"
    finally:
        fleet.close()
