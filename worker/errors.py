"""One exception hierarchy for lanefleet, each with a message a user can act on.

SQL functions raise SQLSTATEs of class ``LF`` (see migrations/*_fleet_api.sql); the store maps
each to the exception here, so a caller never parses error text.
"""

from __future__ import annotations


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
