"""A tiny agent that replays a captured output: prints the file to stdout, exits with the code given.

    python tests/agents/replay.py FILE [EXIT_CODE]
"""

import sys

sys.stdout.write(open(sys.argv[1], encoding="utf-8").read())
sys.stdout.flush()
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
