"""The router lever as the start-up repair pulls it: a llama.cpp router model unloaded (and
seen so), or loaded again (issue 19; docs/invariants.md, "Crash recovery").

A router model's pause is ``POST /models/unload`` and its wake ``POST /models/load``
(:mod:`uapplace.io.router`); both answer at once and the status then moves, and a request
the router received outlives the daemon that sent it. So "put back to sleep" and "stop
new" are an unload that must be *seen*: the router says ``unloaded`` and the model's child
(``--alias ID`` among the router unit's processes) is gone, within ``stop_s``; only then
may a victim take the memory back. The router's unit, which hosts the sibling models,
is never stopped for one of them. The load's outcome is what
:meth:`~uapplace.recovery.checks.RunChecks.verify_loaded` then checks.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from uapplace.io import router
from uapplace.io.router import RouterError, RouterSlot
from uapplace.recovery.checks import FIRST_POLL_S, MAX_POLL_S

if TYPE_CHECKING:
    from uapplace.recovery.checks import RunChecks


async def unload(checks: RunChecks, slot: RouterSlot) -> str | None:
    """Unload ``slot``'s model and see it gone; ``None`` once it is, else why not."""
    limit_s = checks.timeouts.stop_s
    deadline = time.monotonic() + limit_s
    try:
        await checks.routers.unload(slot.endpoint, slot.model_id, checks.timeouts.http_s)
        polling = router.Polling(FIRST_POLL_S, MAX_POLL_S, checks.timeouts.http_s)
        await router.wait_for(
            checks.routers,
            slot.endpoint,
            slot.model_id,
            frozenset({router.UNLOADED}),
            limit_s,
            polling,
        )
    except RouterError as err:
        return f"unload of {slot.model_id} from {slot.label}: {err}"
    while True:
        pids = await checks.units.pids(slot.unit)
        left = await checks.routers.children(sorted(pids), slot.model_id)
        if not left:
            return None
        if time.monotonic() >= deadline:
            return (
                f"{slot.model_id} is unloaded from {slot.label} but its process "
                f"{', '.join(map(str, left))} is still there after {limit_s:g}s"
            )
        await asyncio.sleep(FIRST_POLL_S)


async def load(checks: RunChecks, slot: RouterSlot) -> None:
    """Ask the router to load ``slot``'s model (answered at once; a model already running
    counts as done). Raises :class:`~uapplace.io.router.RouterError`."""
    await checks.routers.load(slot.endpoint, slot.model_id, checks.timeouts.http_s)
