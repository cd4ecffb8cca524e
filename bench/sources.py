"""What a GitHub source's pass costs: requests, seconds and database calls, first and unchanged.

    uv run python -m bench.sources [--issues 1000] [--url URL]

Against the loopback GitHub of tests/github_api/ (its OpenAPI checks on, as in the tests: the
figures include them; needs npm once, for GitHub's description), on a scratch database. A
repository with ``--issues`` open issues (a third labelled for the fleet's lane), then: the first
pass (every labelled issue becomes a task), a second (everything updated since the first's
cursor), an unchanged one (only 304s), one after 10 issues changed (closed or relabelled). Prints
per pass the wall seconds, the requests and how many were answered 304, and what it did.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import log, machine, scratch_db, write_fleet_toml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from github_api.stand_in import GitHubStandIn  # noqa: E402

from worker.config import load_config  # noqa: E402
from worker.sources.passes import run_pass  # noqa: E402
from worker.store.postgres import PostgresStore  # noqa: E402
from worker.store.sync import sync_config  # noqa: E402

REPO = "acme/widgets"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--issues", type=int, default=1000)
    parser.add_argument("--url", default=os.environ.get("TEST_DATABASE_URL",
                                                        "postgresql://postgres@127.0.0.1:5432/postgres"))
    args = parser.parse_args()
    with scratch_db(args.url, "sources") as url, tempfile.TemporaryDirectory() as tmp, GitHubStandIn() as gh:
        gh.add_repo(REPO)
        for n in range(args.issues):
            gh.add_issue(REPO, f"issue {n}", "body " * 40, ["fleet:bugfix"] if n % 3 == 0 else ["question"])
        toml = write_fleet_toml(Path(tmp) / "fleet.toml", url, Path(tmp), {
            "bugfix": {"command": ["true"], "max_payload_bytes": 100_000}})
        with toml.open("a") as f:
            f.write(f'\n[sources.gh]\nrepository = "{REPO}"\napi_url = "{gh.url}"\ntoken_env = "BENCH_TOKEN"\n'
                    'labels = { "fleet:bugfix" = "bugfix" }\n')
        cfg = load_config(toml, environ={})
        store = PostgresStore(url, max_size=2)
        sync_config(store, cfg)
        log(machine())
        log(f"{args.issues} open issues, {len(range(0, args.issues, 3))} labelled fleet:bugfix\n")
        log(f"{'pass':<28} {'seconds':>8} {'requests':>9} {'304s':>6}  what it did")

        def one(what: str) -> None:
            start = time.perf_counter()
            report = run_pass(store, cfg, "gh", environ={"BENCH_TOKEN": gh.token})
            wall = time.perf_counter() - start
            did = ", ".join(f"{n} {a}" for a, n in sorted(report.actions.items())) or "nothing"
            log(f"{what:<28} {wall:>8.2f} {report.traffic.requests:>9} {report.traffic.not_modified:>6}  {did}")
            assert report.error is None, report.error

        one("first")
        one("second (since the cursor)")
        one("unchanged")
        for i, number in enumerate(range(1, 31, 3)):  # ten of the labelled ones
            if i % 2:
                gh.close_issue(REPO, number)
            else:
                gh.set_labels(REPO, number, ["wontfix"])
        one("10 issues changed")
        store.close()
        if gh.problems:
            log(f"\n{len(gh.problems)} request(s) or answer(s) broke GitHub's description: {gh.problems[:3]}")


if __name__ == "__main__":
    main()
