"""Misfiled residents (issue 21 item 4; docs/placement-rules.md §4.1.1, "Re-filed on
measure"): the ledger and the measurement disagree on where a resident runs.

A resident adopted before its config was measured sits on a guessed device; when the
measurement lands (``measure`` writes the local registry, the daemon reloads), it moves
to ``measured_on`` and takes the measured footprint
(:func:`uapplace.controller.configstate.measured_footprint`). A resident that had
figures of its own is never moved by a file: when its config's measurement says another
device than the one it is listed on, the disagreement is surfaced as a ``misfiled``
warning alert (subject: the resident's ``model/config``), raised once while open, at
every reload and start, until someone re-measures it or unloads and loads it.
"""

from __future__ import annotations

from collections.abc import Sequence

from uapplace.core.alerts import AlertBoard, AlertKind, Severity
from uapplace.core.model import Registry, Resident, ResidentState
from uapplace.core.victims import config_of


def misfiled(registry: Registry, residents: Sequence[Resident]) -> list[tuple[Resident, str]]:
    """Each resident listed on another device than its counting measurement says, with
    that device. Paused residents (what their pause left) and unmeasured configs are not
    compared."""
    found: list[tuple[Resident, str]] = []
    for resident in residents:
        if resident.state is ResidentState.PAUSED:
            continue
        config = config_of(registry, resident)
        if config is None or not config.is_measured or config.measured_on is None:
            continue
        if config.measured_on != resident.device and config.measured_on in registry.devices:
            found.append((resident, config.measured_on))
    return found


def report_misfiled(registry: Registry, residents: Sequence[Resident], board: AlertBoard) -> None:
    """Raise a ``misfiled`` alert for each of :func:`misfiled` (once while it is open)."""
    for resident, measured_on in misfiled(registry, residents):
        config = config_of(registry, resident)
        when = config.measured_at if config is not None else None
        board.raise_unless_open(
            AlertKind.MISFILED,
            Severity.WARNING,
            resident.signature,
            f"{resident.signature} is listed on {resident.device}, but its measurement "
            f"(measured_on {measured_on}, at {when}) says it runs on {measured_on}: its "
            f"footprint counts against the wrong budget; re-measure it, or unload and load it",
            {"listed_on": resident.device, "measured_on": measured_on, "measured_at": when},
        )
