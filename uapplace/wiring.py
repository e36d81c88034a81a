"""Wiring enforcement into a running controller (unit sync, recovery, the enforcer)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from uapplace.enforce import Enforcer
from uapplace.enforce_host import ControllerHost, ProxyRefresher
from uapplace.journal import Journal
from uapplace.measure import Measurer
from uapplace.recovery import ControllerRecoveryHost, recover
from uapplace.timeouts import Timeouts
from uapplace.units import (
    UnitManager,
)
from uapplace.unitsync import EnforcementMarks, UnitSync

if TYPE_CHECKING:
    from uapplace.controller import Controller
    from uapplace.paths import Paths

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- wiring


@dataclass
class EnforcementStack:
    """What :func:`attach_enforcement` built: close it when the daemon stops."""

    units: UnitManager
    enforcer: Enforcer
    sync: UnitSync
    measurer: Measurer
    controller: Controller

    async def reload(self) -> bool:
        """Re-read the registry (a bad one keeps the last good), then re-sync the units."""
        changed = await self.controller.reload()
        await self.sync.sync_all()
        return changed

    async def close(self) -> None:
        await self.sync.close()
        self.units.close()


async def attach_enforcement(
    controller: Controller,
    paths: Paths,
    refresher: ProxyRefresher | None,
    *,
    units: UnitManager | None = None,
    timeouts: Timeouts | None = None,
) -> EnforcementStack:
    """Connect to the user manager and give ``controller`` its enforcer and measurer.

    Residents then follow the units (:class:`~uapplace.unitsync.UnitSync`, synced
    once now). Before that sync, a run the journal shows cut short by a crash is
    repaired (:func:`uapplace.recovery.recover`). The controller gets its
    enforcer and measurer only once all of that has started. Raises
    :class:`~uapplace.units.UnitError` when the user manager is unreachable,
    :class:`~uapplace.registry.ConfigFileError` for a bad
    ``enforcement-timeouts.json``, and whatever the first sync raised; then
    ``controller`` gets no enforcer or measurer, the unit sync is closed and the
    :class:`~uapplace.units.UnitManager` this call made (not one passed in as
    ``units``) is closed.
    """
    if timeouts is None:
        timeouts = await asyncio.to_thread(Timeouts.load, paths.enforcement_timeouts)
    manager = units or UnitManager()
    host = ControllerHost(controller)
    marks = EnforcementMarks()
    journal = Journal(paths.enforcement_journal, crash_at=paths.test_crash_at)
    enforcer = Enforcer(
        host, manager, timeouts=timeouts, refresher=refresher, marks=marks, journal=journal
    )
    sync = UnitSync(host, manager, marks, http_s=timeouts.http_s)

    async def after_measure() -> None:
        await controller.reload()
        await sync.sync_all()

    measurer = Measurer(
        paths,
        host,
        manager,
        http_s=timeouts.http_s,
        after_write=after_measure,
        exclusive=enforcer.exclusive,
    )
    try:
        await manager.connect()
        # A run a crash cut short is repaired before the sync publishes any unit
        # and before the controller accepts a new run (uapplace.recovery).
        await recover(journal, ControllerRecoveryHost(controller), manager, timeouts=timeouts)
        await sync.start()
    except BaseException:
        await sync.close()
        if units is None:
            manager.close()
        raise
    # Only now: a half-wired controller would accept an Apply it cannot see through.
    controller.enforcer = enforcer
    controller.measurer = measurer
    return EnforcementStack(manager, enforcer, sync, measurer, controller)
