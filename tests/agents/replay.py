"""A tiny agent that replays a captured output: prints the file to stdout, exits with the code given.

    python tests/agents/replay.py FILE [EXIT_CODE | hang]

``hang``: after printing, stay alive and silent (a stalled agent).
"""

import sys
import time

sys.stdout.write(open(sys.argv[1], encoding="utf-8").read())
sys.stdout.flush()
if len(sys.argv) > 2 and sys.argv[2] == "hang":
    while True:
        time.sleep(60)
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
