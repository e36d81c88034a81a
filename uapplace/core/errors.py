"""The domain errors every module raises; ``service.py`` maps them to D-Bus error names.

Each class carries the short name of its ``org.uap.Placement1.Error.*`` reply, so
the bus layer needs no table: ``DBusError(f"{ERROR_PREFIX}{err.short}", str(err))``.
Messages are written for an operator reading them in a terminal: they name the
id, model, file or argument that is wrong and, where one exists, what to do.
"""

from __future__ import annotations

from typing import ClassVar

ERROR_PREFIX = "org.uap.Placement1.Error."


class PlacementFailure(Exception):
    """Base of the errors that have a name on the bus."""

    short: ClassVar[str] = "Failed"

    @property
    def bus_name(self) -> str:
        return ERROR_PREFIX + self.short


class UnknownModel(PlacementFailure):
    """The model id is in no registry file (neither by key, config key nor advertised id)."""

    short = "UnknownModel"


class NotFound(PlacementFailure):
    """A placement id, hold cookie or resident that does not exist (any more)."""

    short = "NotFound"


class Drifted(PlacementFailure):
    """What the operator approved no longer matches the machine (victim set changed)."""

    short = "Drifted"


class Busy(PlacementFailure):
    """Another enforcement is running, or a victim is held / in flight."""

    short = "Busy"


class NotAuthorized(PlacementFailure):
    """polkit (or the same-uid rule) said no to a mutating call."""

    short = "NotAuthorized"


class InvalidArgument(PlacementFailure):
    """An argument that parses but makes no sense (bad JSON, option 0, …)."""

    short = "InvalidArgument"


class Failed(PlacementFailure):
    """Anything else that went wrong (a failed run, a refused measurement, …)."""

    short = "Failed"


class Unavailable(PlacementFailure):
    """The daemon is up but the collaborator this method needs is absent here.

    Only the enforcer and the measurer may be absent (no systemd user manager, or
    the moment between the daemon taking its name and wiring them). Its own bus
    name lets a caller (the shim answers ``503``) tell it from a failed run
    without reading the message. Decision: it is additive to the seven first names,
    documented in ``dbus/org.uap.Placement1.xml`` and docs/bus-api.md ("Errors").
    """

    short = "Unavailable"


ALL_ERRORS: tuple[type[PlacementFailure], ...] = (
    UnknownModel,
    NotFound,
    Drifted,
    Busy,
    NotAuthorized,
    InvalidArgument,
    Failed,
    Unavailable,
)


def unavailable(method: str, why: str) -> Unavailable:
    """A method whose collaborator is not there: no user manager, or not wired yet."""
    return Unavailable(f"{method} is not available: {why}")


def no_pending(placement_id: str) -> NotFound:
    """A placement id that names no pending entry (any more)."""
    return NotFound(f"no pending placement {placement_id} (it may have expired or been resolved)")
