"""Residents follow the systemd units, whoever starts or stops them; nothing is
published before it is verified (docs/invariants.md, invariants 2 and 5).

:class:`UnitSync` listens to :meth:`UnitManager.on_change` for every unit the
registry names and turns unit states into resident states:

=====================  =========================================================
unit                   resident
=====================  =========================================================
``activating``         ``warming`` (admission parks ``warming``, never forwards)
``active``             ``warming`` until :func:`uapplace.publish.verify.check` passes
                       (``/health`` 200, the id in ``/v1/models``, the capacity
                       policy's ``metricsMustMatch``), then ``hot``
``inactive``/``failed``  gone (``failed`` raises a ``resident_dropped`` alert)
``deactivating``       unchanged (a run that stops it has marked it ``draining``)
=====================  =========================================================

Publication (invariant 2): ``hot`` means "verified in this daemon's life". The
controller restores every ledger resident as ``warming`` (``Controller.restore``),
so a resident the previous daemon published is verified again before anything
is forwarded to it. A unit found running at start-up or started by hand is
verified the same way. An engine that answers but serves the wrong id (or
breaks ``metricsMustMatch``) is never published: a ``wrong_model`` alert names
the unit, what it serves and what was expected, and the check is repeated with
a growing pause (:func:`uapplace.publish.publication.verify_until_ok`), because an
operator may swap the engine to the right model in place. A resident
published ``hot`` whose unit reports a new main PID (restarted between two
signals) goes back to ``warming`` and is verified again.

A unit a run is starting is not published here at all: the run's ``verify-up``
(the same check) publishes it. Its going down is still followed. A resident an
enforcement run marked ``draining`` stays ``draining``
(:meth:`EnforcementMarks.overlay`).

While a resident is ``hot``, the :class:`~uapplace.publish.publication.SleepWatch`
re-checks it every ``serving_check_s`` and at once when its unit changes or the probe shows
its memory collapsed (health, served id, sleep state, its processes' memory; never
``/slots``, which wakes a
llama.cpp): one that sleeps on its own is shown ``asleep``, still ``hot``
(docs/placement-rules.md §4.2, "Asleep is not paused"); one asleep the way no request
undoes, gone or serving another id goes back to ``warming`` (a ``not_serving`` alert)
and is verified again like a unit that came up, re-published ``hot`` once it serves
("Serving is re-checked").

Reconcile (invariant 5, :meth:`UnitSync.sync_all`, run at start-up, after a
registry reload and after a measurement): every registry unit's state is read
and followed; then every resident whose unit is unknown to the registry, has no
unit, or is not running is dropped with a ``resident_dropped`` alert. After it,
the residents are exactly the running registry units. The probe (device memory)
is what the planner uses for free memory, so it wins over the residents' costs
by construction; processes holding device memory that belong to no resident's
unit, more than the device's ``reserved_mib`` in all, are reported as a
``probe_mismatch`` alert.

Which config a unit runs: the one a running enforcement is starting, else the
resident already recorded for the unit, else the registry's only config under
that unit (several: the first measured one, in registry order). Its device: the
config's ``measured_on``, else the model's first affinity device, else the
first GPU in the registry.

A llama.cpp router's unit (every config under it ``pause_lever: llamacpp-router``)
hosts several models, each loaded or not inside it (docs/placement-rules.md §4.2,
"What paused is"): its unit being active says nothing about any one model. So no
resident is invented for it (a model of it becomes resident when a run loads or wakes
it), and each resident it has is followed on its own (:meth:`UnitSync._follow_router`):
``paused`` and ``hot`` stay, ``warming`` is verified (the router's ``GET /models`` must
say it is loaded), and all of them go when the unit goes down.

:class:`~uapplace.publish.publication.LedgerPublication` is the same verification for a
daemon without a systemd user manager (no unit sync): restored residents are
verified over HTTP alone and published ``hot`` when the check passes; nothing
else changes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from uapplace.core.alerts import AlertKind, Severity
from uapplace.core.model import (
    Config,
    DeviceKind,
    Model,
    Registry,
    Resident,
    ResidentKey,
    ResidentState,
    iso,
    processes_text,
    resident_key,
)
from uapplace.core.unitnames import unit_file_name
from uapplace.io import engines
from uapplace.io.units import (
    DOWN_STATES,
    RUNNING_STATES,
    STARTING_STATES,
    UnitError,
    UnitManager,
    UnitState,
    state_text,
)
from uapplace.publish.publication import SLEEP_CHECK_S, ResidentSink, SleepWatch, verify_until_ok

log = logging.getLogger(__name__)


class EnforcementMarks:
    """What a running enforcement asserts about residents, for anyone rebuilding them.

    - draining: residents a run marked; a sync that rebuilds a resident must keep
      it ``draining`` (:meth:`overlay`); the run clears its marks when it ends.
    - starting: unit → ``(model, config, device)`` a run is starting, so a unit
      sync can tell which config a unit shared by several configs is running.

    One draining truth: these marks. A resident's published ``draining`` state
    (what admission and the planner read) is derived from them by :meth:`overlay`,
    the only code that turns a resident ``draining``: the enforcer publishes its
    marked victims through it (``enforce_steps.mark_draining``) and the unit sync
    publishes every rebuilt resident through it. The marks, not ``Resident.state``,
    are the truth because a resident is a value the unit sync rebuilds from unit
    states at any time (a new main PID, a restart signal), it cannot say which run
    marked it, and a run must clear exactly its own marks whatever ends it
    (:meth:`clear_run`, cancellation included). Code that asks "is this draining?"
    asks :meth:`is_draining`.
    """

    def __init__(self) -> None:
        self._draining: dict[ResidentKey, str] = {}
        self._starting: dict[str, tuple[ResidentKey, str]] = {}
        self._on_cleared: list[Callable[[], None]] = []

    def on_cleared(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after a run's marks are cleared (the run is ending)."""
        self._on_cleared.append(callback)

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
        for callback in self._on_cleared:
            callback()
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


# --------------------------------------------------------------------------- unit sync


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
        sleep_check_s: float | None = SLEEP_CHECK_S,
    ) -> None:
        self.host = host
        self.units = units
        self.marks = marks
        self.first_poll_s = first_poll_s
        self.max_poll_s = max_poll_s
        self.http_s = http_s
        self._clock = clock
        self.sleep_watch = SleepWatch(
            host,
            every_s=sleep_check_s or SLEEP_CHECK_S,
            http_s=http_s,
            publish=self._publish,
            on_unpublished=self._reverify,
            pids_of=self._resident_pids,
        )
        """The serving re-check of every hot resident
        (:class:`~uapplace.publish.publication.SleepWatch`); ``sleep_check_s`` ``None``:
        not run (tests that count every HTTP call)."""
        self._sleep_check = sleep_check_s is not None
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._resync: asyncio.Task[None] | None = None
        self._started = False
        self._closed = False

    async def start(self) -> None:
        """Listen for changes, then reconcile every resident with the units."""
        if not self._started:
            self.units.on_change(self._on_change)
            self.marks.on_cleared(self._after_run)
            self._started = True
        await self.sync_all()
        if self._sleep_check and not self._closed:
            self.sleep_watch.start()

    def _after_run(self) -> None:
        """A run is ending: once its own bookkeeping is done (it drops or restores its
        victims right after clearing its marks, without yielding), follow every unit
        again. A victim the rollback could not verify but whose unit runs is then a
        ``warming`` resident again (never forwarded to, still counted), not a unit
        running behind the residents' back."""
        if self._closed:
            return
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to follow
            loop = asyncio.get_running_loop()
            loop.call_soon(self._spawn_resync)

    def _spawn_resync(self) -> None:
        if self._closed or (self._resync is not None and not self._resync.done()):
            return
        self._resync = asyncio.create_task(self.resync_units(), name="unitsync-resync")

    async def resync_units(self) -> None:
        """Read every registry unit's state and follow it (no alerts, no probe)."""
        for unit in registry_units(self.host.registry()):
            state = await self._read_state(unit)
            if state is not None and not self._closed:
                self.follow(unit, state)

    async def sync_all(self) -> None:
        """Reconcile (module doc): follow every registry unit's state now, then drop the
        residents no running registry unit backs, then compare with the probe."""
        states: dict[str, UnitState] = {}
        for unit in registry_units(self.host.registry()):
            state = await self._read_state(unit)
            if state is not None:
                states[unit] = state
        self._drop_unbacked(states)
        for unit, state in states.items():
            self.follow(unit, state)
        await self._compare_probe()

    async def _read_state(self, unit: str) -> UnitState | None:
        """``unit``'s state, or ``None`` (logged) when the manager cannot say."""
        try:
            return await self.units.state(unit)
        except UnitError as err:
            log.warning("cannot read the state of %s: %s", unit, err)
            return None

    async def close(self) -> None:
        """Stop every verification watcher (the change listener becomes a no-op)."""
        self._closed = True
        await self.sleep_watch.close()
        watchers = list(self._watchers.values())
        if self._resync is not None:
            watchers.append(self._resync)
        self._watchers.clear()
        for task in watchers:
            task.cancel()
        for task in watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ------------------------------------------------------------------ reconcile

    def _drop_unbacked(self, states: Mapping[str, UnitState]) -> None:
        known = registry_units(self.host.registry())
        for resident in list(self.host.residents()):
            unit = unit_file_name(resident.unit) if resident.unit else None
            if unit is None:
                self._drop_with_alert(resident, "it has no systemd unit to check it against")
            elif unit not in known:
                self._drop_with_alert(resident, f"its unit {unit} is not in the registry")
            elif (
                unit in states
                and states[unit].active_state in DOWN_STATES
                and not self.marks.is_draining(resident_key(resident))  # else a run reports
            ):
                state = state_text(states[unit])
                self._drop_with_alert(resident, f"its unit {unit} is {state}")

    def _drop_with_alert(self, resident: Resident, why: str) -> None:
        self.host.drop_resident(resident)
        subject = unit_file_name(resident.unit) if resident.unit else resident.signature
        self.host.alert_board.raise_alert(
            AlertKind.RESIDENT_DROPPED,
            Severity.WARNING,
            subject,
            f"{resident.signature} on {resident.device} was dropped from the residents: {why}",
            {
                "model": resident.model,
                "config": resident.config,
                "device": resident.device,
                "unit": resident.unit,
                "state": resident.state.value,
            },
        )

    async def _compare_probe(self) -> None:
        """Device memory held by processes no resident's unit owns, beyond the device's
        ``reserved_mib`` (the registry's allowance for the desktop and other GPU users),
        is a ``probe_mismatch``: an orphan, or an engine started outside systemd."""
        try:
            readings = await self.host.read_devices()
        except Exception as err:  # the probe is advisory here; the planner reads it itself
            log.warning("reconcile: cannot read the devices: %s", err)
            return
        owned: dict[str, set[int]] = {}
        for resident in self.host.residents():
            if resident.unit:
                pids = await self._pids(resident.unit)
                owned.setdefault(resident.device, set()).update(pids)
        devices = self.host.registry().devices
        for key, reading in readings.items():
            if reading.kind is not DeviceKind.GPU:
                continue
            strangers = [p for p in reading.processes if p.pid not in owned.get(key, set())]
            allowance = devices[key].reserved_mib if key in devices else 0
            if sum(p.used_mib for p in strangers) > allowance:
                rows = processes_text(strangers)
                self.host.alert_board.raise_alert(
                    AlertKind.PROBE_MISMATCH,
                    Severity.WARNING,
                    key,
                    f"{key}: memory is held by processes that are no resident's unit: {rows} "
                    "(the probe wins: the planner counts that memory as used)",
                    {"device": key, "pids": [p.pid for p in strangers]},
                )

    async def _pids(self, unit: str) -> list[int]:
        try:
            return await self.units.pids(unit)
        except UnitError as err:
            log.warning("cannot list the processes of %s: %s", unit, err)
            return []

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
        if active in DOWN_STATES:
            self._stop_watching(unit)
            for gone in self._residents_of(unit):
                if active == "failed" and not self.marks.is_draining(resident_key(gone)):
                    self._drop_with_alert(gone, f"its unit {unit} is {state_text(state)}")
                else:
                    self.host.drop_resident(gone)
            return
        if active not in RUNNING_STATES and active not in STARTING_STATES:
            return  # deactivating, or a state systemd may add: leave the resident as it is
        if self.marks.expected_for_unit(unit) is not None:
            # An enforcement run is starting this unit: its verify-up (the same
            # check) publishes the resident.
            self._stop_watching(unit)
            return
        if self._follow_router(unit, state):
            return
        resident = self._resident_for(unit, state)
        if resident is None:
            return
        if active in STARTING_STATES:
            self._stop_watching(unit)
            self._publish(replace(resident, state=ResidentState.WARMING))
            return
        if resident.state is ResidentState.HOT:
            self._publish(resident)  # verified in this daemon's life, same engine
            if self._sleep_check:
                self.sleep_watch.poke()  # its unit changed: a sign to look again now
            return
        if resident.state is ResidentState.PAUSED:
            self._publish(resident)  # weights offloaded: only a resume publishes it again
            return
        resident = replace(resident, state=ResidentState.WARMING)
        self._publish(resident)
        self._watch_publication(unit, resident)

    def _follow_router(self, unit: str, state: UnitState) -> bool:
        """A router's unit (module doc); ``False`` for any other unit."""
        if not self._is_router_unit(unit):
            return False
        for known in self._residents_of(unit):
            resident = _with_pid(known, state)
            if resident.state is ResidentState.PAUSED or (
                resident.state is ResidentState.HOT and state.active_state in RUNNING_STATES
            ):
                self._publish(resident)
                continue
            resident = replace(resident, state=ResidentState.WARMING)
            self._publish(resident)
            if state.active_state in RUNNING_STATES:
                self._watch_publication(unit, resident, f"{unit}#{resident.signature}")
        return True

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
            match = next((r for r in known if resident_key(r) == expected), None)
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

    # ------------------------------------------------------------------ verification

    def _watch_publication(
        self, unit: str, resident: Resident, key: str = "", *, ask_sleep: bool = False
    ) -> None:
        """Verify ``resident`` until it passes; one watcher per ``key`` (the unit, or a
        router model's ``unit#model/config``)."""
        key = key or unit
        current = self._watchers.get(key)
        if current is not None and not current.done():
            return
        task = asyncio.create_task(
            self._until_verified(unit, resident, ask_sleep=ask_sleep), name=f"verify-{key}"
        )
        self._watchers[key] = task
        task.add_done_callback(lambda done: self._forget(key, done))

    def _reverify(self, resident: Resident) -> None:
        """The re-check unpublished ``resident``: verify it again like a unit that came
        up (its engine must also not be asleep the way no request undoes)."""
        if self._closed or not resident.unit:
            return
        unit = unit_file_name(resident.unit)
        routed = self._is_router_unit(unit)
        key = f"{unit}#{resident.signature}" if routed else unit
        self._watch_publication(unit, resident, key, ask_sleep=True)

    def _is_router_unit(self, unit: str) -> bool:
        candidates = registry_units(self.host.registry()).get(unit, [])
        return bool(candidates) and all(config.is_router_model for _, config in candidates)

    async def _resident_pids(self, resident: Resident) -> list[int]:
        return await self._pids(resident.unit) if resident.unit else []

    def _forget(self, unit: str, task: asyncio.Task[None]) -> None:
        if self._watchers.get(unit) is task:
            del self._watchers[unit]

    def _stop_watching(self, unit: str) -> None:
        task = self._watchers.pop(unit, None)
        if task is not None:
            task.cancel()

    async def _until_verified(
        self, unit: str, resident: Resident, *, ask_sleep: bool = False
    ) -> None:
        """Check the engine until it passes (no deadline: a unit that stays up unverified
        stays ``warming``; the watcher ends when the unit goes down), then publish ``hot``."""

        def current() -> Resident | None:
            if self.marks.expected_for_unit(unit) is not None:
                return None  # a run took this unit over: its verify-up decides
            return next(
                (r for r in self._residents_of(unit) if r.signature == resident.signature), None
            )

        verified = await verify_until_ok(
            self.host,
            resident,
            unit,
            current,
            first_poll_s=self.first_poll_s,
            max_poll_s=self.max_poll_s,
            http_s=self.http_s,
            ask_sleep=ask_sleep,
        )
        if verified is not None and verified.state is not ResidentState.HOT:
            self._publish(replace(verified, state=ResidentState.HOT))


def _with_pid(resident: Resident, state: UnitState) -> Resident:
    """The resident with the unit's main PID; a published one whose engine process
    changed is no longer verified (``warming`` again)."""
    pid = state.main_pid or None
    if resident.main_pid == pid or pid is None:
        return resident
    if resident.state is ResidentState.HOT and resident.main_pid is not None:
        return replace(resident, main_pid=pid, state=ResidentState.WARMING)
    return replace(resident, main_pid=pid)
