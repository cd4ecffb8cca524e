"""A tiny agent that replays captured output: prints a file to stdout, exits with the code given.

    python tests/agents/replay.py FILE [CODE] [FILE2 CODE2 ...] [--resume SESSION]

With several FILE CODE pairs, attempt N (``FLEET_ATTEMPT``) replays pair N (the last pair for every
attempt after). CODE ``hang``: after printing, stay alive and silent (a stalled agent). Each run
appends its argv (after the script) and ``FLEET_AGENT_SESSION`` to ``replay-argv.jsonl`` in its
working directory (the task's workspace), so a test can see what the shift passed.
"""

import json
import os
import sys
import time

args = sys.argv[1:]
pairs = args[:args.index("--resume")] if "--resume" in args else args
files = pairs[0::2]
codes = pairs[1::2] + ["0"] * (len(files) - len(pairs[1::2]))
at = min(int(os.environ.get("FLEET_ATTEMPT") or 1), len(files)) - 1
with open("replay-argv.jsonl", "a", encoding="utf-8") as fh:
    fh.write(json.dumps({"argv": sys.argv[1:], "session": os.environ.get("FLEET_AGENT_SESSION", "")}) + "\n")
sys.stdout.write(open(files[at], encoding="utf-8").read())
sys.stdout.flush()
if codes[at] == "hang":
    while True:
        time.sleep(60)
sys.exit(int(codes[at]))
