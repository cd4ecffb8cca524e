"""``fleet up`` and ``fleet run`` through a restart of their database: say so once, retry, go on.

The loop of ``fleet up`` reads the queue, runs monitor passes and redraws its table; while the
server restarts (``fleet db stop --force`` and the next command, a crash, a maintenance restart)
those calls fail with :class:`~worker.errors.DatabaseUnavailable`. :class:`Outage` turns each
failure into a wait that doubles up to :data:`MAX_WAIT`, says "database restarting, reconnecting"
on the first one only, and says when the database answers again. The shifts ``fleet up`` started
keep to their own deadlines meanwhile (their lease fence), and the monitor repairs what they lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

FIRST_WAIT = 0.5
MAX_WAIT = 5.0


@dataclass
class Outage:
    where: str  # the database, for the messages (Runtime.database)
    say: Callable[[str], None]
    since: float | None = None  # monotonic time of the first failure of this outage
    wait: float = FIRST_WAIT

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, error: Exception) -> float:
        """A call failed: the seconds to wait before the next try."""
        if self.since is None:
            self.since = time.monotonic()
            self.wait = FIRST_WAIT
            why = (str(error).strip().splitlines() or [""])[0][:200]
            # (the store's errors name the database already: "the embedded database in … is unreachable")
            self.say(f"database restarting, reconnecting: {why}" if self.where in why
                     else f"database restarting, reconnecting ({self.where}: {why})")
            return self.wait
        self.wait = min(self.wait * 2, MAX_WAIT)
        return self.wait

    def answered(self) -> None:
        """A pass went through: if the database was down, say that it is back."""
        if self.since is not None:
            self.say(f"database back after {time.monotonic() - self.since:.0f}s ({self.where})")
            self.since = None

    def attempt(self, call: Callable[[], object]) -> bool:
        """Run one pass of work that talks to the database (``fleet run``'s monitor job): False when
        the database did not answer (said once per outage; the next pass tries again)."""
        from worker.errors import DatabaseUnavailable

        try:
            call()
        except DatabaseUnavailable as exc:
            self.failed(exc)
            return False
        self.answered()
        return True

