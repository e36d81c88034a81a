"""The controller's door to enforcement: Apply, Load, Unload and Measure go through it.

It holds the one late-bound part of the controller (see ``controller.py``): the
:class:`~uapplace.controller.ports.EnforcementParts` that exist only with a systemd user manager,
attached once by ``wiring`` after recovery and the first unit sync, or the reason
there are none. Before that, and without them, each request answers the typed
``Unavailable`` (the shim maps it to 503 by its name); during shutdown, ``Busy``.
Every run is preceded by a durable ledger write (docs/invariants.md, invariant 6).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any

from uapplace.controller.ports import EnforcementParts, Signature
from uapplace.core.admission import chosen_option
from uapplace.core.errors import Busy, NotFound, no_pending, unavailable
from uapplace.core.model import Model, ParkReason, PendingEntry, Plan, Registry
from uapplace.core.staleness import LiveLaunch
from uapplace.io.units import UnitError, UnitState

log = logging.getLogger(__name__)

NOT_YET_WIRED = "uapplaced has not wired it (it is still starting)"


class EnforcementDoor:
    """``controller.enforcement``: the operator's Apply/Load/Unload/Measure.

    ``live_entry`` and ``model_named`` are the controller's look-ups (an unknown id
    or model is refused before anything else); ``flush`` its durable ledger write."""

    def __init__(
        self,
        flush: Callable[[], Awaitable[None]],
        live_entry: Callable[[str], PendingEntry | None],
        model_named: Callable[[str], Model],
        mark_failed: Callable[[str], None] = lambda _placement_id: None,
    ) -> None:
        self._flush = flush
        self._live_entry = live_entry
        self._model_named = model_named
        self._mark_failed = mark_failed
        """The controller's: an entry whose approved switch failed says ``failed``."""
        self._parts: EnforcementParts | None = None
        self._why_none = NOT_YET_WIRED
        self._accepting = True

    def attach(self, parts: EnforcementParts) -> None:
        """Enforcer, measurer and auto runner, handed over once every part has started."""
        if self._parts is not None:
            raise RuntimeError("enforcement is attached once")
        self._parts = parts

    def unavailable(self, why: str) -> None:
        """There will be no enforcement in this daemon's life; ``why`` is the answer."""
        self._why_none = why

    @property
    def attached(self) -> bool:
        return self._parts is not None

    async def schedule_auto(self, entry: PendingEntry, found: Plan) -> ParkReason | None:
        """The auto runner's answer for a new park (``None`` without enforcement)."""
        if self._parts is None:
            return None
        return await self._parts.auto_runner.schedule(entry, found)

    async def apply(
        self, placement_id: str, option: int, expected: Signature, *, origin: str | None = None
    ) -> dict[str, Any]:
        """Enforce an option of a pending entry; ``expected`` is the approval signature
        (``model/config`` strings, as ``ListPending`` shows them) and is always checked.
        ``origin`` names an unattended caller (a notification click): a failed run then
        also raises an ``enforcement_failed`` alert."""
        entry = self._live_entry(placement_id)
        if entry is None:
            raise no_pending(placement_id)
        chosen_option(entry, option)
        parts = await self._open("Apply")
        result = await parts.enforcer.apply(entry, option, expected, origin=origin)
        if result.get("ok") is not True:  # rolled back, or refused before anything stopped
            self._mark_failed(placement_id)
        return result

    async def load(self, model: str, expected: Signature) -> dict[str, Any]:
        """Load with the recommended option; ``expected`` is its signature from ``Preview``."""
        self._model_named(model)
        parts = await self._open("Load")
        return await parts.enforcer.load(model, expected)

    async def unload(self, model: str, expected: Signature) -> dict[str, Any]:
        """Stop ``model``; ``expected`` is the signature ``PreviewUnload`` showed."""
        self._model_named(model)
        parts = await self._open("Unload")
        return await parts.enforcer.unload(model, expected)

    async def measure(
        self, model: str, config: str, *, envelope: bool = False, expected: Signature = ()
    ) -> dict[str, Any]:
        """``Measure``, or with ``envelope`` ``MeasureEnvelope`` (issue 12: takes the
        backend down and up; issue 21: a switch, so ``expected`` is the ``PreviewUnload``
        signature the operator approved, and the ledger is written first like any run)."""
        found = self._model_named(model)
        if config and config not in found.configs:
            known = ", ".join(found.configs) or "none"
            raise NotFound(f"model {found.key} has no config {config!r} (configs: {known})")
        if envelope:
            parts = await self._open("MeasureEnvelope")
            return await parts.measurer.measure_envelope(found.key, config, expected)
        if self._parts is None:
            raise unavailable("Measure", self._why_none)
        # It rewrites the machine-local registry, which a running switch plans from.
        self.refuse_while_running("Measure")
        return await self._parts.measurer.measure(found.key, config)

    def refuse_while_running(self, method: str) -> None:
        """``Busy`` naming the run in progress, for a call that would change what it relies
        on (issue 20; docs/bus-api.md, "Methods": busy means busy)."""
        running = self._parts.enforcer.running if self._parts is not None else None
        if running is not None:
            raise Busy(
                f"{method}: an enforcement is running ({running}) and relies on what this "
                "would change; retry when it has finished"
            )

    def refuse_hold_while_drained(self, model: str) -> None:
        """``Busy`` when the run in progress has drained ``model``'s residents and is
        stopping or pausing them: a hold taken now would be ignored, not honoured."""
        if self._parts is None or model not in self._parts.enforcer.drained:
            return
        raise Busy(
            f"Hold: {model} is being switched away ({self._parts.enforcer.running}), past "
            "its drain: a hold now could not be honoured; hold it again once the run ends"
        )

    def refuse_dismiss_while_applied(self, placement_id: str) -> None:
        """``Busy`` when the run in progress is applying ``placement_id``: a dismiss would
        answer ``true`` while the switch goes on and resolves it ``applied`` anyway."""
        if self._parts is None or self._parts.enforcer.applying != placement_id:
            return
        raise Busy(
            f"placement {placement_id} is being applied ({self._parts.enforcer.running}); "
            "it resolves when the run ends: dismiss it then if it is still pending"
        )

    async def live_launch(
        self, registry: Registry, only: Collection[str] | None = None
    ) -> Mapping[str, LiveLaunch]:
        """What each measured config's unit (or only the unit files ``only`` names) runs
        now (``ExecStart``, engine build), for the stale-measurement rule; nothing known
        before enforcement is attached."""
        if self._parts is None:
            return {}
        return await self._parts.measurer.live_launch(registry, only)

    async def unit_states(self, names: Iterable[str]) -> dict[str, UnitState] | None:
        """Each unit as systemd reports it now (one it cannot read is left out); ``None``
        before enforcement is attached or without a user manager (``validate``)."""
        units = self._parts.units if self._parts is not None else None
        if units is None:
            return None
        wanted = list(dict.fromkeys(names))

        async def one(name: str) -> UnitState | None:
            try:
                return await units.state(name)
            except UnitError:
                return None

        found = await asyncio.gather(*(one(n) for n in wanted))
        return {n: s for n, s in zip(wanted, found, strict=True) if s is not None}

    async def close(self, wait_s: float) -> None:
        """Shutdown: refuse new runs, stop the auto runner and let a running run end,
        each wait bounded by ``wait_s``."""
        self._accepting = False
        if self._parts is None:
            return
        try:
            await asyncio.wait_for(self._parts.auto_runner.close(), wait_s)
        except TimeoutError:
            log.error("an auto load was still running after %gs", wait_s)
        try:
            await asyncio.wait_for(self._parts.enforcer.wait_idle(), wait_s)
        except TimeoutError:
            log.error("an enforcement was still running after %gs; flushing anyway", wait_s)

    async def _open(self, method: str) -> EnforcementParts:
        if not self._accepting:
            raise Busy(f"{method}: uapplaced is shutting down; try again once it is back")
        if self._parts is None:
            raise unavailable(method, self._why_none)
        await self._durable_before_run()
        return self._parts

    async def _durable_before_run(self) -> None:
        """Write the ledger before a run changes anything (docs/invariants.md, invariant 6).

        The write-behind coalesces for ``debounce_s``; a park answered just before an
        ``Apply`` could otherwise be lost with a crash mid-run (found by the chaos
        harness: a SIGKILL at ``drain`` 0.2 s after the park). One write per run.
        """
        try:
            await self._flush()
        except Exception as err:  # the run itself does not depend on the ledger write
            log.warning("could not write the ledger before the run: %s", err)
