"""``uapplace measure --envelope``: a config's enforcement envelope (issue 12), timed
on the live engine: stop, memory back, cold and warm start to serving, and sleep/wake
where the config has a sleep level (:class:`~uapplace.core.model.Envelope`).

It takes the backend down and up, so it is a switch (issue 21, item 1;
docs/placement-rules.md §4.1.1, "Measuring is a switch"): it runs inside a ``window``
(:class:`uapplace.enforce.measuring.EnvelopeWindow` in the daemon) that checks the
operator's ``PreviewUnload`` signature, refuses a held model and a router unit shared
with other residents, drains the model's in-flight work, journals the run and holds
enforcement off while it runs; and it leaves the engine running and serving again
when a step fails (:meth:`EnvelopeMeasurer._restore`).
:class:`uapplace.measure.measurer.Measurer` owns one and hands ``measure_envelope`` to it;
the written figures feed :mod:`uapplace.files.timeouts` and the planner's expected seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import psutil

from uapplace.core.errors import InvalidArgument
from uapplace.core.model import Config, DeviceKind, DeviceReading, Envelope, Model, ProbeSource, iso
from uapplace.core.unitnames import unit_file_name
from uapplace.files.paths import Paths
from uapplace.files.registry_write import write_local_envelope
from uapplace.io import engines
from uapplace.io.units import DOWN_STATES, UnitError
from uapplace.measure.reading import EngineReader, EngineReading, MeasurementRefused
from uapplace.publish import verify

ENVELOPE_BOUND_S = 600.0
"""An envelope measurement is attended and exists to find the slow cases: each part may
take ten minutes (a large model's cold start) before it is abandoned."""
ENVELOPE_POLL_S = 0.05
"""Between two looks while timing: the envelope's resolution."""

SwitchWindow = Callable[
    [str, Sequence[str]], contextlib.AbstractAsyncContextManager[Sequence[Mapping[str, Any]]]
]
"""``window(model, expected)``: the consented, drained, journaled window a measurement
that stops ``model`` runs in; yields the run's steps so far (JSON rows)."""


class EnvelopeMeasurer:
    """Times one config's envelope and records it in the machine-local registry."""

    def __init__(
        self,
        paths: Paths,
        reader: EngineReader,
        *,
        bound_s: float = ENVELOPE_BOUND_S,
        window: SwitchWindow | None = None,
        after_write: Callable[[], Awaitable[Any]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.paths = paths
        self.reader = reader
        self.host = reader.host
        self.units = reader.units
        self.bound_s = bound_s
        """The longest any one part of an envelope measurement may take (stop, memory
        back, start to serving, sleep, wake) before it is abandoned."""
        self.window = window
        """The consent, drain, journal and one-run lock around the stops
        (:data:`SwitchWindow`); ``None`` only where nothing else runs (unit fakes)."""
        self.after_write = after_write
        """Called once the local registry changed (the daemon re-reads its registry)."""
        self._clock = clock

    async def measure(
        self, model: str, config: str = "", expected: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Take ``model``/``config`` down and up again, timing each part (:class:`Envelope`).

        ``expected`` is the signature the operator approved (``PreviewUnload``'s: the
        residents that stop); the window refuses any other (``Drifted``), a held model
        and a shared router unit (``Busy``), and drains first.

        The engine must be running, healthy and already measured here (its footprint in
        the machine-local registry). Times are wall-clock seconds from the request to
        what the probe or the engine shows. The cold start is the first start after the
        stop: the weights may still sit in the page cache (dropping it needs root and
        slows every other process), so it is the start this machine sees after a switch;
        the warm start is the second. Any failure leaves the engine running again when it
        can (:meth:`_restore`), writes nothing, and raises :class:`MeasurementRefused`
        naming the step.
        """
        registry = self.host.registry()
        found, chosen = self.reader.pick(registry, model, config)
        unit_key = found.unit_for(chosen)
        endpoint = found.endpoint_for(chosen)
        if unit_key is None or endpoint is None:
            raise InvalidArgument(
                f"{found.key}/{chosen.key} needs a unit and an endpoint to measure its envelope"
            )
        if chosen.provenance != "local" or not chosen.is_measured:
            raise MeasurementRefused(
                f"{found.key}/{chosen.key} has no footprint measured on this machine: run "
                f"`uapplace measure {found.key} {chosen.key}` first"
            )
        unit = unit_file_name(unit_key)
        if self.window is None:
            return await self._envelope(found, chosen, unit, endpoint)
        async with self.window(found.key, expected) as steps:
            result = await self._envelope(found, chosen, unit, endpoint)
        return result | {"steps": list(steps)}

    async def _envelope(
        self, found: Model, chosen: Config, unit: str, endpoint: str
    ) -> dict[str, Any]:
        registry = self.host.registry()
        seen = await self.reader.read(registry, unit, endpoint, chosen)
        expect = verify.expectation(found, chosen)
        label = f"{found.key}/{chosen.key}"
        try:
            stop_s, free_s = await self._timed_stop(unit, seen)
            cold_s = await self._timed_start(unit, endpoint, expect)
            seen = await self.reader.read(registry, unit, endpoint, chosen)
            await self._timed_stop(unit, seen)
            warm_s = await self._timed_start(unit, endpoint, expect)
            seen = await self.reader.read(registry, unit, endpoint, chosen)
            sleep: dict[str, float] = {}
            if chosen.sleep_level is not None:
                sleep = await self._timed_sleep_wake(seen, endpoint, expect, chosen.sleep_level)
        except MeasurementRefused as err:
            restored = await self._restore(unit, endpoint, expect)
            raise MeasurementRefused(f"{label}: {err}; nothing was written; {restored}") from None
        envelope = Envelope(
            stop_s=round(stop_s, 3),
            free_s=round(free_s, 3),
            cold_start_s=round(cold_s, 3),
            warm_start_s=round(warm_s, 3),
            measured_at=iso(self._clock()),
            measured_on=seen.device,
            sleep_s=sleep.get("sleep_s"),
            sleep_freed_mib=sleep.get("sleep_freed_mib"),
            wake_s=sleep.get("wake_s"),
        )
        path = self.paths.local_registry
        await asyncio.to_thread(
            write_local_envelope, path, found.key, chosen.key, envelope.to_json()
        )
        if self.after_write is not None:
            await self.after_write()
        return {
            "model": found.key,
            "config": chosen.key,
            "unit": unit,
            "written": str(path),
            "envelope": envelope.to_json(),
        }

    async def _timed_stop(self, unit: str, seen: EngineReading) -> tuple[float, float]:
        """``(stop_s, free_s)``: the stop job, then until the probe shows the memory back
        (no PID of the unit holds memory on the device; for a CPU engine, all gone)."""
        started = time.monotonic()
        outcome = await self.units.stop_unit(unit, self.bound_s)
        if not outcome.ok:
            raise MeasurementRefused(f"stop: {unit}: stop job {outcome.result}")
        stop_s = time.monotonic() - started
        deadline = started + self.bound_s
        while not await self._released(seen):
            if time.monotonic() >= deadline:
                raise MeasurementRefused(
                    f"memory back: {unit}'s processes still hold memory on {seen.device} "
                    f"{self.bound_s:g}s after the stop"
                )
            await asyncio.sleep(ENVELOPE_POLL_S)
        return stop_s, time.monotonic() - started

    async def _released(self, seen: EngineReading) -> bool:
        if seen.reading.kind is DeviceKind.CPU:
            alive = await asyncio.to_thread(lambda: [p for p in seen.pids if psutil.pid_exists(p)])
            return not alive
        readings = await self.host.read_devices()
        reading = readings.get(seen.device)
        if reading is None or reading.source is ProbeSource.ABSENT:
            return False
        return not any(p.pid in seen.pids and p.used_mib > 0 for p in reading.processes)

    async def _timed_start(self, unit: str, endpoint: str, expect: verify.Expectation) -> float:
        """Seconds from the start job until the unit is active, healthy and serving an
        accepted id."""
        started = time.monotonic()
        outcome = await self.units.start_unit(unit, self.bound_s)
        if not outcome.ok:
            raise MeasurementRefused(f"start: {unit}: start job {outcome.result}")
        why = await self._until_serving(unit, endpoint, expect, started)
        if why is not None:
            raise MeasurementRefused(f"start: {why}")
        return time.monotonic() - started

    async def _until_serving(
        self, unit: str, endpoint: str, expect: verify.Expectation, started: float
    ) -> str | None:
        """Poll until ``unit`` is active and :func:`verify.check` passes; why not, else."""
        deadline = started + self.bound_s
        while True:
            state = await self.units.state(unit)
            if state.active_state in DOWN_STATES:
                return f"{unit} is {state.active_state}/{state.sub_state}"
            if state.active_state == "active":
                verdict = await verify.check(endpoint, expect, self.reader.http_s)
                if verdict.ok:
                    return None
                last = verdict.detail
            else:
                last = f"{unit} is {state.active_state}"
            if time.monotonic() >= deadline:
                return f"not serving {self.bound_s:g}s after the start: {last}"
            await asyncio.sleep(ENVELOPE_POLL_S)

    async def _timed_sleep_wake(
        self, seen: EngineReading, endpoint: str, expect: verify.Expectation, level: int
    ) -> dict[str, float]:
        """``sleep_s``, ``sleep_freed_mib``, ``wake_s`` through vLLM's sleep API."""
        before = seen.reading.free_mib
        started = time.monotonic()
        try:
            await engines.sleep(endpoint, level, timeout=self.bound_s)
        except engines.EngineError as err:
            raise MeasurementRefused(f"sleep: {err}") from None
        freed_reading = await self._until_released_by_sleep(seen, started)
        sleep_s = time.monotonic() - started
        freed = max(0.0, freed_reading.free_mib - before)
        started = time.monotonic()
        try:
            await engines.wake(endpoint, timeout=self.bound_s)
        except engines.EngineError as err:
            raise MeasurementRefused(f"wake: {err}") from None
        why = await self._until_serving(seen.unit, endpoint, expect, started)
        if why is None and await engines.is_sleeping(endpoint, timeout=self.reader.http_s):
            why = f"{endpoint}/is_sleeping still true after /wake_up answered"
        if why is None and not await self._holds_again(seen):
            why = f"{seen.unit} does not hold its GPU memory again after /wake_up"
        if why is not None:
            raise MeasurementRefused(f"wake: {why}")
        wake_s = time.monotonic() - started
        return {
            "sleep_s": round(sleep_s, 3),
            "sleep_freed_mib": round(freed, 1),
            "wake_s": round(wake_s, 3),
        }

    async def _until_released_by_sleep(self, seen: EngineReading, started: float) -> DeviceReading:
        """The first reading where the unit holds at most half of what it held awake."""
        deadline = started + self.bound_s
        while True:
            readings = await self.host.read_devices()
            reading = readings.get(seen.device)
            if reading is not None and reading.source is not ProbeSource.ABSENT:
                held = sum(p.used_mib for p in reading.processes if p.pid in seen.pids)
                if held <= seen.gpu_mib / 2:
                    return reading
            if time.monotonic() >= deadline:
                raise MeasurementRefused(
                    f"sleep: {seen.unit} still holds its memory on {seen.device} "
                    f"{self.bound_s:g}s after /sleep"
                )
            await asyncio.sleep(ENVELOPE_POLL_S)

    async def _holds_again(self, seen: EngineReading) -> bool:
        deadline = time.monotonic() + self.bound_s
        while time.monotonic() < deadline:
            readings = await self.host.read_devices()
            reading = readings.get(seen.device)
            if reading is not None:
                held = sum(p.used_mib for p in reading.processes if p.pid in seen.pids)
                if held >= seen.gpu_mib / 2:
                    return True
            await asyncio.sleep(ENVELOPE_POLL_S)
        return False

    async def _restore(self, unit: str, endpoint: str, expect: verify.Expectation) -> str:
        """After a failed measurement: leave the engine running and serving if possible.

        A sleeping engine is woken; one that is not serving is restarted (stop, start)."""
        try:
            if await engines.is_sleeping(endpoint, timeout=self.reader.http_s):
                try:
                    await engines.wake(endpoint, timeout=self.bound_s)
                except engines.EngineError:
                    await self.units.stop_unit(unit, self.bound_s)
            state = await self.units.state(unit)
            if state.active_state == "active":
                verdict = await verify.check(endpoint, expect, self.reader.http_s)
                if verdict.ok:
                    return f"{unit} is running and serving"
                await self.units.stop_unit(unit, self.bound_s)
            started = time.monotonic()
            outcome = await self.units.start_unit(unit, self.bound_s)
            if not outcome.ok:
                return f"{unit} could not be started again: start job {outcome.result}"
            why = await self._until_serving(unit, endpoint, expect, started)
        except UnitError as err:
            return f"{unit} could not be restored: {err}"
        return f"{unit} restarted and serving" if why is None else f"{unit} not restored: {why}"
