"""Repair latency (issue #7, item 6): a shift holding 10 tasks is SIGKILLed; how long until all 10
are claimable again (state queued, run_at <= now())?

    uv run python bench/repair.py             # lease 30 s; 5 kills per case (about 5 min)
    uv run python bench/repair.py --quick     # lease 6 s; 2 kills per case (about 30 s)

A real ``fleet shift`` (slots 10, lane max_running 10) runs 10 agents of the scripted agent that
hang; when all 10 run, the bench SIGKILLs the shift and polls the database every 10 ms until the
10 tasks are claimable. The cases:

- ``same host, --every 1s``: ``fleet monitor --every 1s`` on the shift's host. Its pass checks the
  host's sessions by pid and start time, finds the shift gone and declares its session lost at
  once (``pid-gone``): the latency is about half an interval plus one pass.
- ``same host, --every 10s``: the same at a longer interval.
- ``other host only, --every 1s``: ``fleet monitor --every 1s --no-local``, a monitor that cannot
  see the shift's pids (it runs elsewhere, or the host's monitor is down). The tasks come back
  when the session misses its heartbeat for the lane's session timeout (default: the lease) or
  the leases expire, at the next pass: lease - (time since the last heartbeat) + up to one
  interval. The kill falls at a random point of the heartbeat cycle (lease/3), as it would.

Every case asserts that the 10 tasks come back queued (one evaporation each, nothing dead) and
that no agent nor supervisor outlives the killed shift. Times are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from bench.harness import (
    AGENT,
    DEFAULT_URL,
    FleetBench,
    alive,
    git_state,
    log,
    machine,
    scratch_db,
    wait_agents,
    wait_for,
)

N = 10
HANG = {"mode": "hang", "steps": 1}


def claimable(b: FleetBench, ids: list[int]) -> int:
    row = b.conn.execute("select count(*) from fleet.tasks where id = any(%s) and state = 'queued'"
                         " and run_at <= now()", (ids,)).fetchone()
    return int(row[0]) if row else 0


def one_kill(b: FleetBench, lease: int, timeout: float) -> dict[str, object]:
    ids = b.enqueue("rep", N, HANG)
    shift = b.spawn("shift", "--lane", "rep", "--max-seconds", "3600", "--slots", str(N))
    try:
        b.expect(shift, f"{N} running", lambda: b.count("rep") == N)
        tree = wait_agents(shift.pid, N)
        # kill at a random point of the heartbeat cycle
        time.sleep(random.uniform(0.5, 0.5 + max(0.5, lease / 3)))
        row = b.conn.execute("select extract(epoch from now() - heartbeat_at) from fleet.sessions"
                             " where lane = 'rep' and state = 'active'").fetchone()
        since_beat = float(row[0]) if row else float("nan")
        t0 = time.monotonic()
        os.kill(shift.pid, signal.SIGKILL)
        shift.wait()
        while claimable(b, ids) < N:
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"only {claimable(b, ids)} of {N} tasks claimable after {timeout:.0f} s")
            time.sleep(0.01)
        latency = time.monotonic() - t0
    finally:
        if shift.poll() is None:
            shift.kill()
            shift.wait()
    pids = [p for s, kids in tree.items() for p in (s, *kids)]
    survivors = wait_for("no agent or supervisor left", lambda: not [p for p in pids if alive(p)] or None,
                         timeout=15)
    assert survivors, "agents outlived their shift"
    rows = b.conn.execute(
        "select t.state, t.evaporations, e.detail ->> 'reason' from fleet.tasks t"
        "  join fleet.events e on e.task_id = t.id and e.kind = 'repaired' where t.id = any(%s)",
        (ids,)).fetchall()
    assert len(rows) == N and all(r[0] == "queued" and r[1] == 1 for r in rows), rows
    reasons = sorted({r[2] for r in rows})
    # clean up for the next kill: the repaired tasks are not needed any more
    b.conn.execute("update fleet.tasks set state = 'cancelled', finished_at = now() where id = any(%s)", (ids,))
    return {"latency": latency, "since_heartbeat": since_beat, "reasons": reasons}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="lease 6 s, 2 kills per case")
    ap.add_argument("--lease", type=int, help="the lane's lease_seconds (default 30, --quick 6)")
    ap.add_argument("--kills", type=int, help="kills per case (default 5, --quick 2)")
    ap.add_argument("--url", default=DEFAULT_URL)
    args = ap.parse_args()
    lease = args.lease or (6 if args.quick else 30)
    kills = args.kills or (2 if args.quick else 5)
    cases = [("same host, --every 1s", ["--every", "1s"]),
             ("same host, --every 10s", ["--every", "10s"]),
             ("other host only, --every 1s", ["--every", "1s", "--no-local"])]
    if args.quick:
        cases = [cases[0], cases[2]]
    started = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="lf_bench_repair_") as tmp, scratch_db(args.url, "repair") as url:
        b = FleetBench(url, Path(tmp), {"rep": {
            "command": AGENT, "lease_seconds": lease, "max_running": N, "slots": N, "grace_seconds": 2,
            "max_attempts": 3, "hidden_files": ["fleet"]}})
        log(f"{datetime.now():%Y-%m-%d %H:%M}; {machine(b.conn)}; tree {git_state()}")
        log(f"lane: lease_seconds {lease} (heartbeat every {max(0.5, lease / 3):g} s; session timeout = lease); "
            f"{N} tasks per shift; {kills} kills per case")
        log(f"{'case':32s} {'median':>8s} {'min':>8s} {'max':>8s}  each kill (s), [time since the last heartbeat at the kill]")
        for label, monitor_args in cases:
            monitor = b.spawn("monitor", *monitor_args, "--json")
            try:
                time.sleep(1.0)
                assert monitor.poll() is None, b.log_of(monitor)[-2000:]
                xs = [one_kill(b, lease, timeout=lease * 2 + 30) for _ in range(kills)]
            finally:
                b.stop(monitor)
            lat = [float(x["latency"]) for x in xs]  # type: ignore[arg-type]
            log(f"{label:32s} {statistics.median(lat):6.2f} s {min(lat):6.2f} s {max(lat):6.2f} s  "
                + " ".join(f"{x['latency']:.2f} [{x['since_heartbeat']:.1f}]" for x in xs)
                + f"  repaired as: {', '.join(sorted({r for x in xs for r in x['reasons']}))}")  # type: ignore[attr-defined]
            results.append({"case": label, "latency_s": [round(v, 3) for v in lat],
                            "since_heartbeat_s": [round(float(x["since_heartbeat"]), 2) for x in xs]})  # type: ignore[arg-type]
        b.close()
    log(json.dumps({"lease_seconds": lease, "repair": results}))
    log(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
