"""What the start-up repair observes: unit states, the publication check, ``/is_sleeping``,
a llama.cpp router's model statuses, free device memory.

:class:`RunChecks` answers the questions the table of :mod:`uapplace.recovery.recover` asks
about one journaled run (is the new unit up and verified, is a victim asleep, is
there room to restart the victims); :class:`~uapplace.recovery.repair.Repair` decides
and acts on the answers. It changes nothing itself: it reads units through
:class:`~uapplace.io.seams.UnitControl`, engines through
:class:`~uapplace.io.seams.EngineProbe`, routers through
:class:`~uapplace.io.router.RouterProbe` and devices through :class:`RecoveryHost`.

A resident that is one model of a llama.cpp router (``pause_lever: llamacpp-router``,
:meth:`RunChecks.slot_of`) is judged by its router's ``GET /models``, never by its unit
(the router's, shared with its siblings) nor by ``/is_sleeping``: it runs while its
status is ``loading``/``loaded``/``sleeping`` (its child holds memory), it is asleep
(paused, holding nothing) once the router says ``unloaded``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from uapplace.core.alerts import AlertBoard
from uapplace.core.model import (
    DeviceReading,
    Model,
    ProbeSource,
    Registry,
    Resident,
    ResidentState,
    processes_text,
)
from uapplace.core.steps import PAUSE, ROLLBACK_WAKE, STOP
from uapplace.core.topology import verify_endpoint
from uapplace.core.unitnames import unit_file_name
from uapplace.core.victims import config_of
from uapplace.files.capacity import ServicePolicy
from uapplace.files.journal import RunRecord
from uapplace.io import engines, router
from uapplace.io.router import HTTP_ROUTER, RouterError, RouterModel, RouterProbe, RouterSlot
from uapplace.io.seams import EngineProbe, UnitControl
from uapplace.io.units import (
    DOWN_STATES,
    RUNNING_OR_STARTING_STATES,
    UnitState,
    state_text,
    unit_of,
)
from uapplace.publish import verify

if TYPE_CHECKING:
    from uapplace.files.timeouts import Timeouts, UpBound

FIRST_POLL_S = 0.05
MAX_POLL_S = 0.5


class RecoveryHost(Protocol):
    """The controller as the repair sees it
    (:class:`~uapplace.enforce.host.ControllerRecoveryHost`; fakes in tests)."""

    alert_board: AlertBoard
    """Where this path reports what a human must see."""

    def registry(self) -> Registry: ...

    def residents(self) -> Sequence[Resident]: ...

    def put_resident(self, resident: Resident) -> None: ...

    def drop_resident(self, resident: Resident) -> None: ...

    def resolve_entry(self, placement_id: str, outcome: str) -> bool: ...

    def resolve_served(self, resident: Resident, outcome: str) -> list[str]: ...

    def service_policy(self, model: Model) -> ServicePolicy | None: ...

    async def read_devices(self) -> Mapping[str, DeviceReading]: ...

    async def replan_pending(self) -> None: ...


class RunChecks:
    """The observations of one journaled run's repair (read-only, except what it remembers:
    :attr:`asleep_seen`)."""

    def __init__(
        self,
        record: RunRecord,
        host: RecoveryHost,
        units: UnitControl,
        timeouts: Timeouts,
        probe: EngineProbe,
        routers: RouterProbe = HTTP_ROUTER,
    ) -> None:
        self.record = record
        self.host = host
        self.units = units
        self.timeouts = timeouts
        self.probe = probe
        self.routers = routers
        self.asleep_seen: set[str] = set()
        """``model/config`` of every resident seen asleep (``/is_sleeping`` true, or a
        router model its router says is ``unloaded``)."""

    async def state(self, unit: str) -> UnitState:
        """``unit`` as systemd reports it now."""
        return await self.units.state(unit)

    async def victim_state(self, victim: Resident) -> UnitState:
        """The state of ``victim``'s unit (a unitless resident counts as running)."""
        unit = unit_of(victim)
        if unit is None:  # enforcement never stops a unitless resident; treat it as running
            return UnitState("active", "running", "loaded", 0, "")
        return await self.state(unit)

    # ------------------------------------------------------------------ router models

    def slot_of(self, resident: Resident | None) -> RouterSlot | None:
        """Where ``resident`` lives when it is one model of a llama.cpp router (its
        registry config's ``pause_lever`` is ``llamacpp-router``), else ``None``."""
        if resident is None or resident.unit is None or resident.endpoint is None:
            return None
        model = self.host.registry().models.get(resident.model)
        if model is None or not router.is_router_config(model.configs.get(resident.config)):
            return None
        return RouterSlot(
            unit_file_name(resident.unit), resident.endpoint, router.router_model_id(model)
        )

    async def router_status(self, slot: RouterSlot) -> RouterModel | None:
        """The model's entry in its router's ``GET /models``; ``None`` when the router does
        not answer (or does not list it)."""
        try:
            return await router.status_of(
                self.routers, slot.endpoint, slot.model_id, self.timeouts.http_s
            )
        except RouterError:
            return None

    async def routed_running(self, slot: RouterSlot) -> bool:
        """The router model's child may hold memory: its router unit is up and the router
        says ``loading``/``loaded``/``sleeping``, or does not answer (unknown counts as
        running: nothing is started beside what may hold the device)."""
        if not is_up(await self.state(slot.unit)):
            return False
        seen = await self.router_status(slot)
        return seen is None or seen.running

    def unload_in_flight(self, victim: Resident) -> bool:
        """The run died at the step that unloads ``victim`` from its router (``pause`` for
        a paused one, ``stop`` for a stopped one): its ``POST /models/unload`` may have
        reached the router, which then unloads it whatever became of the client (the
        status stays ``loaded`` while the child takes up to its stop-timeout to exit)."""
        step = self.record.step
        action = self.record.action_of(victim)
        return (step, action) in ((PAUSE, "pause"), (STOP, "stop")) and (
            self.slot_of(victim) is not None
        )

    async def verify_loaded(
        self, slot: RouterSlot, expect: verify.Expectation, bound: UpBound
    ) -> str | None:
        """A router model's verify-up: its router says ``loaded`` (waited for within
        ``bound``; a load that ended shows ``unloaded`` at once), then the publication
        check through the router (health, served id, status, metrics policy)."""
        started = time.monotonic()
        polling = router.Polling(FIRST_POLL_S, MAX_POLL_S, self.timeouts.http_s)
        try:
            await router.wait_for(
                self.routers, slot.endpoint, slot.model_id, router.SERVING, bound.seconds, polling
            )
        except RouterError as err:
            return f"{err}; {bound.text()}"
        left = replace(bound, seconds=max(0.5, bound.seconds - (time.monotonic() - started)))
        endpoint = verify_endpoint(slot.endpoint, self.host.registry().single_upstream)
        return await self._await_verified(slot.unit, endpoint, expect, left)

    # ------------------------------------------------------------------ engines

    def _may_sleep(self, resident: Resident) -> bool:
        """Whether ``/is_sleeping`` means anything for ``resident``: the run paused it,
        it was paused before, or its config has a pause lever (else not asked: a
        llama.cpp engine has no such route)."""
        if (
            self.record.action_of(resident) == "pause"
            or resident.signature in self.record.paused
            or resident.state is ResidentState.PAUSED
            or (self.record.wake is not None and resident.signature == self.record.wake.signature)
        ):
            return True
        config = config_of(self.host.registry(), resident)
        return config is not None and config.sleep_level is not None

    def sleep_in_flight(self, victim: Resident) -> bool:
        """The run died at its ``pause`` step with ``victim``'s sleep attempted: its
        ``POST /sleep`` may still be running in the engine (an engine keeps answering a
        request whose client died), so a check that sees it awake proves nothing yet."""
        return (
            self.record.step == PAUSE
            and self.record.action_of(victim) == "pause"
            and victim.signature in self.record.paused
            and victim.endpoint is not None
            and self._sleep_level(victim) is not None
        )

    def wake_in_flight(self, victim: Resident) -> bool:
        """The run died while its rollback woke the victims it had paused."""
        return self.record.step == ROLLBACK_WAKE and victim.signature in self.record.paused

    def _sleep_level(self, resident: Resident) -> int | None:
        config = config_of(self.host.registry(), resident)
        return config.sleep_level if config is not None else None

    async def asleep(self, resident: Resident) -> bool:
        """``/is_sleeping`` says true, or for a router model its router answers and says
        ``unloaded`` (remembered for ``Repair._finish``)."""
        slot = self.slot_of(resident)
        if slot is not None:
            seen = await self.router_status(slot) if is_up(await self.state(slot.unit)) else None
            asleep: bool | None = seen is not None and seen.status == router.UNLOADED
        elif resident.endpoint is None or not self._may_sleep(resident):
            return False
        else:
            try:
                asleep = await self.probe.is_sleeping(resident.endpoint, self.timeouts.http_s)
            except engines.EngineError:
                asleep = None
        if asleep is True:
            self.asleep_seen.add(resident.signature)
        return asleep is True

    async def verify_new(self, unit: str) -> str | None:
        """The new unit's verify-up (:func:`uapplace.publish.verify.check`), bounded per config."""
        new = self.record.new
        assert new is not None
        model = self.host.registry().models.get(new.model)
        if model is None:
            return f"{new.model} is no longer in the registry"
        config = model.configs.get(new.config)
        expect = verify.expectation(
            model, config, self.record.requested, self.host.service_policy(model)
        )
        expect = replace(expect, accepted=expect.accepted | set(self.record.accepted_ids))
        bound = self.timeouts.verify_up_bound(new.signature, config, self.timeouts.verify_up_s)
        slot = self.slot_of(new)
        if slot is not None:
            return await self.verify_loaded(slot, expect, bound)
        return await self._await_verified(unit, self._verify_address(new), expect, bound)

    async def verify_woken(self, twin: Resident) -> str | None:
        """A woken engine's verify-up: the publication check, ``/is_sleeping`` false."""
        expect = self._expectation(twin, self.record.requested)
        config = config_of(self.host.registry(), twin)
        bound = self.timeouts.wake_bound(twin.signature, config, self.timeouts.verify_up_s)
        slot = self.slot_of(twin)
        if slot is not None:
            return await self.verify_loaded(slot, expect, bound)
        return await self._await_verified(unit_of(twin), self._verify_address(twin), expect, bound)

    async def verify_victim(self, victim: Resident) -> str | None:
        """A restored victim's check; a router model's is a load's (its wake bound)."""
        config = config_of(self.host.registry(), victim)
        expect = self._expectation(victim, None)
        slot = self.slot_of(victim)
        if slot is not None:
            bound = self.timeouts.wake_bound(victim.signature, config, self.timeouts.rollback_up_s)
            return await self.verify_loaded(slot, expect, bound)
        bound = self.timeouts.verify_up_bound(victim.signature, config, self.timeouts.rollback_up_s)
        return await self._await_verified(unit_of(victim), victim.endpoint, expect, bound)

    def _verify_address(self, resident: Resident) -> str | None:
        """Where enforcement's verify-up asks: the single upstream when the registry has
        one (the address the proxy uses, issue 13), else the resident's endpoint."""
        return verify_endpoint(resident.endpoint, self.host.registry().single_upstream)

    def _expectation(self, resident: Resident, requested: str | None) -> verify.Expectation:
        """The check a resident must pass; ``/is_sleeping`` is always asked of one the
        run paused or wakes (it was put to sleep, whatever the registry says now), never
        of a router model (its router's status says it instead)."""
        model = self.host.registry().models.get(resident.model)
        if model is None:
            accepted = frozenset({resident.model, resident.config})
            return verify.Expectation(resident.model, resident.model, accepted, can_sleep=True)
        config = model.configs.get(resident.config)
        expect = verify.expectation(model, config, requested, self.host.service_policy(model))
        sleeps = self.record.action_of(resident) == "pause" or resident.signature in (
            self.record.paused
        )
        if self.slot_of(resident) is not None:
            return expect
        return replace(expect, can_sleep=expect.can_sleep or sleeps or requested is not None)

    async def _await_verified(
        self, unit: str | None, endpoint: str | None, expect: verify.Expectation, bound: UpBound
    ) -> str | None:
        """Poll until the unit is active and :func:`uapplace.publish.verify.check` passes (the
        one publication check: health, served id, not asleep, ``metricsMustMatch``);
        ``None`` then, else why not. A unit that goes down, a wrong id or a policy
        mismatch end the wait at once; the rest is polled within ``bound``."""
        deadline = time.monotonic() + bound.seconds
        interval = FIRST_POLL_S
        name = unit or expect.requested
        last = "never active"
        while True:
            ready = True
            if unit is not None:
                state = await self.state(unit)
                if state.active_state in DOWN_STATES:
                    return f"{unit} is {state_text(state)}"
                ready = state.active_state == "active"
                last = f"unit {state_text(state)}"
            if ready:
                if endpoint is None:
                    return None
                verdict = await verify.check(
                    endpoint, expect, self.timeouts.http_s, self.probe, self.routers
                )
                if verdict.ok:
                    return None
                if verdict.is_wrong_engine:
                    return verdict.detail
                last = verdict.detail
            if time.monotonic() >= deadline:
                return f"{name} not healthy after {bound.seconds:g}s ({last}); {bound.text()}"
            await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            interval = min(interval * 1.5, MAX_POLL_S)

    async def memory_problem(self, victims: Sequence[Resident]) -> str | None:
        """Wait (``verify_free_s``) until the probe shows room for every victim to restart."""
        need = sum(v.gpu_mib or 0.0 for v in victims if v.device == self.record.device)
        deadline = time.monotonic() + self.timeouts.verify_free_s
        while True:
            reading = (await self.host.read_devices()).get(self.record.device)
            problem = _room_problem(reading, self.record.device, need)
            if problem is None:
                return None
            if time.monotonic() >= deadline:
                return f"after {self.timeouts.verify_free_s:g}s: {problem}"
            await asyncio.sleep(self.timeouts.verify_free_poll_s)


def is_up(state: UnitState) -> bool:
    """Active, activating or reloading: the unit holds (or is taking) its memory."""
    return state.active_state in RUNNING_OR_STARTING_STATES


def is_down(state: UnitState) -> bool:
    """Inactive or failed: the unit's memory is (or is being) given back."""
    return state.active_state in DOWN_STATES


def _room_problem(reading: DeviceReading | None, device: str, need: float) -> str | None:
    if reading is None:
        return f"{device} is not in the probe's readings"
    if reading.source is ProbeSource.ABSENT:
        return f"{device} cannot be read: {reading.error or 'absent'}"
    if reading.free_mib + 1e-6 >= need:
        return None
    rows = processes_text(reading.processes)
    held = f" (processes on it: {rows})" if rows else ""
    return f"{device} has {reading.free_mib:,.0f} MiB free, the victims need {need:,.0f} MiB{held}"
