"""One exception hierarchy for lanefleet, each with a message a user can act on.

SQL functions raise SQLSTATEs of class ``LF`` (see migrations/*_fleet_api.sql); the store maps
each to the exception here, so a caller never parses error text.
"""

from __future__ import annotations


def one_line(text: str) -> str:
    """A message of several lines (libpq's "Connection refused" and "Is the server running …") as
    one, its runs of white space made one space and a full stop after a line that ends without
    one."""
    lines = [" ".join(line.split()) for line in text.splitlines()]
    lines = [line for line in lines if line]
    return " ".join(line if i == len(lines) - 1 or line[-1] in ".:;,!?" else line + "."
                    for i, line in enumerate(lines))


class FleetError(Exception):
    """Base of every error lanefleet raises on purpose. ``str(err)`` is one line for the user."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint or None

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class LeaseLost(FleetError):
    """The lease token no longer holds the task: it was repaired, re-claimed or cancelled."""


class UnknownLane(FleetError):
    """The lane is not in fleet.lanes (not in the config, or not synced)."""


class UnknownTask(FleetError):
    """No task with that id or key."""


class InvalidState(FleetError):
    """The transition is not allowed from the task's current state."""


class InvalidInput(FleetError):
    """An argument is malformed or out of range."""


class SessionLost(FleetError):
    """The shift's session is unknown, ended, or was declared lost by the monitor."""


class RouteRefused(FleetError):
    """The target lane does not accept tasks routed from this lane."""


class LaneForbidden(FleetError):
    """The caller's key may not work that lane (its JWT's fleet_lanes claim does not list it)."""


class LaneRetired(FleetError):
    """The lane was retired (`fleet lanes retire`): it takes no tasks until `fleet lanes unretire`."""


class ConfigError(FleetError):
    """fleet.toml or the environment holds a bad value."""


class MigrationError(FleetError):
    """The migrations on disk and the ones applied to the database disagree."""


class DatabaseUnavailable(FleetError):
    """The database could not be reached."""


SQLSTATE_ERRORS: dict[str, type[FleetError]] = {
    "LF001": LeaseLost,
    "LF002": UnknownLane,
    "LF003": UnknownTask,
    "LF004": InvalidState,
    "LF005": InvalidInput,
    "LF006": SessionLost,
    "LF007": RouteRefused,
    "LF008": LaneForbidden,
    "LF009": LaneRetired,
}


#: SQLSTATEs of a call whose transaction the server rolled back for a conflict with another
#: transaction, by name: nothing was committed and the same call may well succeed at once, so both
#: stores repeat any call that meets one. (Not 40002, a deferred constraint that failed at commit,
#: which would fail again; not 40003, "statement completion unknown", which may have committed.)
CONFLICTS: dict[str, str] = {
    "40000": "transaction rollback",
    "40001": "serialization failure",
    "40P01": "deadlock",
    "55P03": "lock not available",
}


def conflict(sqlstate: str | None) -> str | None:
    """The name of the conflict ``sqlstate`` is (:data:`CONFLICTS`), or None if it is none."""
    return CONFLICTS.get(sqlstate or "")
