"""Residents follow the systemd units, whoever starts or stops them.

:class:`UnitSync` listens to :meth:`UnitManager.on_change` for every unit the
registry names and turns unit states into resident states:

=====================  =========================================================
unit                   resident
=====================  =========================================================
``activating``         ``warming`` (admission forwards to warming residents)
``active``             ``warming`` until ``/health`` answers 200, then ``hot``
``inactive``/``failed``  gone
``deactivating``       unchanged (a run that stops it has marked it ``draining``)
=====================  =========================================================

Every change goes through the host's ``put_resident`` / ``drop_resident``, which
emit ``ResidentChanged``. A resident an enforcement run marked ``draining``
stays ``draining`` (:meth:`EnforcementMarks.overlay`). A unit a run is starting
is not published here at all: the run's ``verify-up`` (health *and* served ids
*and* metrics) publishes it ``hot``, so a server that answers ``/health`` with the
wrong model is never forwarded to. Its going down is still followed.

Which config a unit runs: the one a running enforcement is starting, else the
resident already recorded for the unit, else the registry's only config under
that unit (several: the first measured one, in registry order). Its device: the
config's ``measured_on``, else the model's first affinity device, else the
first GPU in the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from uapplace import engines
from uapplace.model import Config, DeviceKind, Model, Registry, Resident, ResidentState, iso
from uapplace.registry import unit_file_name
from uapplace.units import UnitError, UnitManager, UnitState

log = logging.getLogger(__name__)

_UP = frozenset({"active", "reloading"})
_DOWN = frozenset({"inactive", "failed"})
_STARTING = frozenset({"activating"})


ResidentKey = tuple[str, str, str]
"""``(model, config, device)``."""


class EnforcementMarks:
    """What a running enforcement asserts about residents, for anyone rebuilding them.

    - draining: residents a run marked; a sync that rebuilds a resident must keep
      it ``draining`` (:meth:`overlay`); the run clears its marks when it ends.
    - starting: unit → ``(model, config, device)`` a run is starting, so a unit
      sync can tell which config a unit shared by several configs is running.
    """

    def __init__(self) -> None:
        self._draining: dict[ResidentKey, str] = {}
        self._starting: dict[str, tuple[ResidentKey, str]] = {}

    def mark_draining(self, key: ResidentKey, run_id: str) -> None:
        self._draining[key] = run_id

    def expect_unit(self, unit: str, key: ResidentKey, run_id: str) -> None:
        self._starting[unit_file_name(unit)] = (key, run_id)

    def clear_run(self, run_id: str) -> list[ResidentKey]:
        """Drop every mark of ``run_id``; returns the draining keys it held."""
        cleared = [key for key, owner in self._draining.items() if owner == run_id]
        for key in cleared:
            del self._draining[key]
        for unit in [u for u, (_, owner) in self._starting.items() if owner == run_id]:
            del self._starting[unit]
        return cleared

    def expected_for_unit(self, unit: str) -> ResidentKey | None:
        found = self._starting.get(unit_file_name(unit))
        return found[0] if found is not None else None

    def is_draining(self, key: ResidentKey) -> bool:
        return key in self._draining

    def overlay(self, resident: Resident) -> Resident:
        """``resident`` as it must be published: ``draining`` while a run marks it."""
        if (
            resident_key(resident) in self._draining
            and resident.state is not ResidentState.DRAINING
        ):
            return replace(resident, state=ResidentState.DRAINING)
        return resident

    @property
    def draining(self) -> frozenset[ResidentKey]:
        return frozenset(self._draining)


def resident_key(resident: Resident) -> ResidentKey:
    """``(model, config, device)``: how a resident is named across the program."""
    return (resident.model, resident.config, resident.device)


class ResidentSink(Protocol):
    """The part of the controller unit sync writes to (a subset of ``EnforcementHost``)."""

    def registry(self) -> Registry: ...

    def residents(self) -> Sequence[Resident]: ...

    def put_resident(self, resident: Resident) -> None: ...

    def drop_resident(self, resident: Resident) -> None: ...


def registry_units(registry: Registry) -> dict[str, list[tuple[Model, Config]]]:
    """``unit.service`` → the (model, config) pairs that run under it, in registry order."""
    out: dict[str, list[tuple[Model, Config]]] = {}
    for model in registry.models.values():
        for config in model.configs.values():
            unit = model.unit_for(config)
            if unit:
                out.setdefault(unit_file_name(unit), []).append((model, config))
    return out


def default_device(registry: Registry, model: Model, config: Config) -> str | None:
    """Where a resident of ``config`` that nobody placed is assumed to live."""
    if config.measured_on and config.measured_on in registry.devices:
        return config.measured_on
    for device in model.affinity_devices:
        if device in registry.devices:
            return device
    gpus = registry.gpus()
    if gpus:
        return gpus[0].key
    return next(iter(registry.devices), None)


class UnitSync:
    """Keeps the host's residents in step with the units. ``await start()`` once."""

    def __init__(
        self,
        host: ResidentSink,
        units: UnitManager,
        marks: EnforcementMarks,
        *,
        first_poll_s: float = 0.05,
        max_poll_s: float = 1.0,
        http_s: float = engines.PROBE_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.host = host
        self.units = units
        self.marks = marks
        self.first_poll_s = first_poll_s
        self.max_poll_s = max_poll_s
        self.http_s = http_s
        self._clock = clock
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._started = False
        self._closed = False

    async def start(self) -> None:
        """Listen for changes, then bring every registry unit's resident up to date."""
        if not self._started:
            self.units.on_change(self._on_change)
            self._started = True
        await self.sync_all()

    async def sync_all(self) -> None:
        """Read every registry unit's state now and follow it (start-up, registry reload)."""
        for unit in registry_units(self.host.registry()):
            try:
                state = await self.units.state(unit)
            except UnitError as err:
                log.warning("cannot read the state of %s: %s", unit, err)
                continue
            self.follow(unit, state)

    async def close(self) -> None:
        """Stop every health watcher (the change listener becomes a no-op)."""
        self._closed = True
        watchers = list(self._watchers.values())
        self._watchers.clear()
        for task in watchers:
            task.cancel()
        for task in watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ------------------------------------------------------------------ following

    def _on_change(self, unit: str, state: UnitState) -> None:
        if not self._closed:
            self.follow(unit, state)

    def follow(self, unit: str, state: UnitState) -> None:
        """Apply one unit state to the residents (no-op for units the registry does not name)."""
        unit = unit_file_name(unit)
        if unit not in registry_units(self.host.registry()):
            return
        active = state.active_state
        if active in _DOWN:
            self._stop_watching(unit)
            for gone in self._residents_of(unit):
                self.host.drop_resident(gone)
            return
        if active not in _UP and active not in _STARTING:
            return  # deactivating, or a state systemd may add: leave the resident as it is
        if self.marks.expected_for_unit(unit) is not None:
            # An enforcement run is starting this unit: its verify-up (health, served
            # ids, metrics) publishes the resident. Publishing it here, even as
            # warming, would let admission forward to a backend not verified yet.
            self._stop_watching(unit)
            return
        resident = self._resident_for(unit, state)
        if resident is None:
            return
        if active in _STARTING:
            self._stop_watching(unit)
            self._publish(replace(resident, state=ResidentState.WARMING))
            return
        if resident.state is ResidentState.HOT:
            self._publish(resident)
            return
        self._publish(replace(resident, state=ResidentState.WARMING))
        self._watch_health(unit, resident)

    def _publish(self, resident: Resident) -> None:
        self.host.put_resident(self.marks.overlay(resident))

    def _residents_of(self, unit: str) -> list[Resident]:
        return [r for r in self.host.residents() if r.unit and unit_file_name(r.unit) == unit]

    def _resident_for(self, unit: str, state: UnitState) -> Resident | None:
        """The resident this unit is (or becomes), with its current facts."""
        registry = self.host.registry()
        expected = self.marks.expected_for_unit(unit)
        known = self._residents_of(unit)
        if expected is not None:
            match = next((r for r in known if (r.model, r.config, r.device) == expected), None)
            if match is not None:
                return _with_pid(match, state)
            return self._new_resident(registry, unit, state, *expected)
        if known:
            return _with_pid(known[0], state)
        candidates = registry_units(registry).get(unit, [])
        if not candidates:
            return None
        model, config = next(((m, c) for m, c in candidates if c.is_measured), candidates[0])
        device = default_device(registry, model, config)
        if device is None:
            log.warning("%s is running but the registry has no device to put it on", unit)
            return None
        return self._new_resident(registry, unit, state, model.key, config.key, device)

    def _new_resident(
        self,
        registry: Registry,
        unit: str,
        state: UnitState,
        model_key: str,
        config_key: str,
        device: str,
    ) -> Resident | None:
        model = registry.models.get(model_key)
        config = model.configs.get(config_key) if model is not None else None
        if model is None or config is None:
            return None
        gpu = registry.devices.get(device)
        return Resident(
            model=model.key,
            config=config.key,
            device=device,
            engine=model.engine,
            endpoint=model.endpoint_for(config),
            unit=unit,
            state=ResidentState.WARMING,
            gpu_mib=config.resident_gpu_mib if gpu is None or gpu.kind is DeviceKind.GPU else 0.0,
            host_rss_mib=config.host_rss_mib,
            since=iso(self._clock()),
            main_pid=state.main_pid or None,
        )

    # ------------------------------------------------------------------ health

    def _watch_health(self, unit: str, resident: Resident) -> None:
        current = self._watchers.get(unit)
        if current is not None and not current.done():
            return
        task = asyncio.create_task(self._until_healthy(unit, resident), name=f"health-{unit}")
        self._watchers[unit] = task
        task.add_done_callback(lambda done: self._forget(unit, done))

    def _forget(self, unit: str, task: asyncio.Task[None]) -> None:
        if self._watchers.get(unit) is task:
            del self._watchers[unit]

    def _stop_watching(self, unit: str) -> None:
        task = self._watchers.pop(unit, None)
        if task is not None:
            task.cancel()

    async def _until_healthy(self, unit: str, resident: Resident) -> None:
        """Poll ``/health`` until 200, then publish ``hot``. No deadline: a unit that
        stays up unhealthy stays ``warming``; the watcher ends when the unit goes down."""
        interval = self.first_poll_s
        while resident.endpoint is not None:
            if await engines.health(resident.endpoint, timeout_s=self.http_s):
                break
            await asyncio.sleep(interval)
            interval = min(interval * 2, self.max_poll_s)
        if self.marks.expected_for_unit(unit) is not None:
            return  # a run took this unit over meanwhile: its verify-up decides
        current = next(
            (r for r in self._residents_of(unit) if r.signature == resident.signature), None
        )
        if current is not None:  # else it stopped meanwhile
            self._publish(replace(current, state=ResidentState.HOT))


def _with_pid(resident: Resident, state: UnitState) -> Resident:
    pid = state.main_pid or None
    return resident if resident.main_pid == pid or pid is None else replace(resident, main_pid=pid)
