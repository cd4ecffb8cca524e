"""Any other agent command: one that prints Claude-Code-style stream-json, as lanefleet's own
scripted agent does (worker/dev/example_agent.py: an init record, assistant turns and a final
``result`` with ``modelUsage`` for a main model and a sub-agent).

What is read is the Claude reader's (worker/agent/adapters/claude.py): the ``result`` record's
outcome, tokens and cost, ``session_id`` on any record, rate-limit records. There is no default
command: a generic profile gives its own.
"""

from __future__ import annotations

from worker.agent.adapters import Adapter
from worker.agent.adapters.claude import ClaudeReader


class GenericReader(ClaudeReader):
    agent = "generic"


ADAPTER = Adapter(
    name="generic",
    programs=(),
    command=(),
    reader=GenericReader,
    reports_cost=True,
    describe="Claude-Code-style stream-json result records (lanefleet's example agent and the like)",
)
