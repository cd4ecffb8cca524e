"""Self-fencing: a shift stops its agents before its lease could be repaired.

A session's lease is granted by the database for ``valid_for`` seconds from its own ``now()``
(``fleet.heartbeat``; a claim renews it too). That ``now()`` came after the shift sent the call,
so by the shift's own monotonic clock the lease certainly holds until ``sent + valid_for`` — the
grant minus the round trip that obtained it — whatever the two clocks read (only their rates must
agree: ``MARGIN`` covers a drift far beyond any real clock's, and the latency of a kill). No
wall clock, no clock sync.

:class:`Fence` watches that moment from a thread of its own, so a main loop blocked in a database
call (a partition, a server that stopped answering) cannot delay it. Unless a renewal came first:

- at ``until - MARGIN - term_window`` it asks every agent to stop (SIGTERM to its group, through
  its supervisor), ``term_window`` being a sixth of the lease, at most the lane's grace;
- at ``until - MARGIN`` it kills every agent (SIGKILL to its group) and goes on killing any agent
  that appears (a verify gate started meanwhile) until the next renewal.

So by the time the monitor may repair a task (its lease ran out by the database's clock, which
is never earlier than ``until``), its agent is gone. Should the shift itself freeze (SIGSTOP, a
stalled machine) its thread freezes too; so each renewal also tells every agent's supervisor — a
process of its own — the same two moments (``AgentProcess.fence``), and the supervisor stops
the agent at them unless a later renewal moved them. The agents it stopped are handed off when
they exit (the shift sees ``fenced`` on their jobs); if the lease was repaired meanwhile, the
hand-off is refused and nothing more is written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

MARGIN = 0.5  # seconds kept between the kill and the first moment the lease could run out


def term_window(lease_seconds: float, grace_seconds: float) -> float:
    """How long before the kill the agents get SIGTERM: a sixth of the lease, at most the grace."""
    return max(0.0, min(grace_seconds, lease_seconds / 6))


class Fence:
    """The shift's own view of its lease (see the module doc). ``on_fence(stage, first)``: stop the
    agents now — ``stage`` 'term' (ask them to stop; ``first``: the first time since the last
    renewal) or 'kill' (kill them, and any that appeared since); called from the fence's thread.
    ``clock``: monotonic seconds (a test passes a frozen one and calls :meth:`check` itself instead
    of :meth:`start`)."""

    def __init__(self, on_fence: Callable[[str, bool], None], *, term_window: float,
                 margin: float = MARGIN, on_renew: Callable[[float, float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, log: Any = None) -> None:
        self.on_fence = on_fence
        self.on_renew = on_renew
        self.term_window = term_window
        self.margin = margin
        self.clock = clock
        self.log = log if log is not None else structlog.get_logger("lanefleet.fence")
        self.until: float | None = None  # monotonic: the lease certainly holds before this
        self.stage: str | None = None  # None | 'term' | 'kill': how far it went since the last renewal
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    # -- what the shift tells it

    def renewed(self, sent_at: float, valid_for: float) -> None:
        """A call sent at ``sent_at`` (monotonic) was granted ``valid_for`` seconds by the database.
        ``on_renew(term_at, kill_at)`` hears of the new moments (the agents' supervisors, which
        enforce them should this process freeze)."""
        until = sent_at + valid_for
        with self._cond:
            moved = self.until is None or until > self.until
            if moved:
                self.until = until
                if self.stage is not None and until - self.margin - self.term_window > self.clock():
                    self.log.info("lease renewed: agents may run again", valid_for=round(valid_for, 2))
                    self.stage = None
            self._cond.notify_all()
        if moved and self.on_renew is not None:
            self.on_renew(until - self.margin - self.term_window, until - self.margin)

    def remaining(self) -> float | None:
        """Seconds the lease certainly holds from now (negative: it may have run out); None before
        the first grant."""
        with self._cond:
            return None if self.until is None else self.until - self.clock()

    @property
    def term_at(self) -> float | None:
        return None if self.until is None else self.until - self.margin - self.term_window

    @property
    def kill_at(self) -> float | None:
        return None if self.until is None else self.until - self.margin

    # -- what it does

    def check(self) -> float | None:
        """Act on the clock now: SIGTERM or SIGKILL the agents if their moment came. Returns the
        seconds until the next moment to look again (None: nothing granted yet)."""
        with self._cond:
            if self.until is None:
                return None
            now = self.clock()
            term_at, kill_at = self.until - self.margin - self.term_window, self.until - self.margin
            if now >= kill_at:
                stage, wait = "kill", 0.1  # keep killing what appears until a renewal
            elif now >= term_at:
                stage, wait = "term", kill_at - now
            else:
                return term_at - now
            first = self.stage != stage
            self.stage = stage
        if first:
            self.log.warning("lease not renewed in time: asking the agents to stop" if stage == "term"
                             else "lease about to run out: killing the agents",
                             left=round(self.until - now, 2) if self.until is not None else None)
        self.on_fence(stage, first)
        return wait

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="fleet-fence", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            wait = self.check()
            with self._cond:
                if self._stopped:
                    return
                self._cond.wait(1.0 if wait is None else max(0.01, min(wait, 1.0)))
                if self._stopped:
                    return

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
