"""``python -m monitor.cli``: the ``fleet`` command (how shifts, tests and benches start it)."""

from monitor.cli.entry import main

main()
