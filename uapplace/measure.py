"""Footprints from the live engine (spec §4.1.1): ``uapplace measure <model> [config]``.

The engine must be running under its registry unit, loaded and idle. From its
unit's cgroup PIDs:

- ``resident_gpu_mib``: the GPU memory those PIDs hold (NVML compute apps, or
  the simulated GPU), on exactly one device, which becomes ``measured_on``;
- ``host_rss_mib``: their resident set (psutil);
- KV geometry where the engine reports it: ``context_pool_cells`` and ``kv``
  from ``/metrics`` (``max_context``, the ``kv`` label), ``per_session_cap_cells``
  from ``/slots`` (one slot's ``n_ctx``), ``kv_resident_cells`` = the pool (a
  llama.cpp-like engine allocates its whole pool at start) unless the registry
  already states it; ``expert_cache_mib`` / ``arena_mib`` when ``/metrics`` has
  them (diagnostic only, never in the cost). Nothing is invented where the
  engine reports nothing.

Only the machine-local registry (``$UAP_HOME/model-registry.json``) is
written: the config entry (keeping the registry's flags, unit and endpoint),
with ``measured_on``, ``measured_at`` and the host free RAM seen
(``host_free_mib``), and the device's ``reserved_mib`` derived as
``total − free − Σ(GPU memory of uapplace backends)``: whatever no backend
accounts for, graphics memory included, attributed to a PID or not.

Refused, with the reason, and nothing written (spec §4.1.1):

- the unit is not running, or not healthy yet;
- engine PID not found: the unit has no process, or none of its processes
  holds GPU memory;
- ``resident_gpu_mib`` below the sanity floor (``floor_mib``, 64 MiB);
- the reading includes another backend's allocation: a PID of the unit also
  belongs to another registry unit, or is older than the unit's main process
  (left over in the cgroup from an earlier run, e.g. an orphan under
  ``KillMode=process``);
- the derived ``reserved_mib`` is negative or exceeds the device's capacity
  (the probe contradicts itself or the registry's ``total_mib``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import psutil

from uapplace import engines, verify
from uapplace.devices import gpu_usage_of, process_rss_mib
from uapplace.errors import Failed, InvalidArgument, NotFound, UnknownModel
from uapplace.model import (
    Config,
    Device,
    DeviceKind,
    DeviceReading,
    Envelope,
    Model,
    ProbeSource,
    Registry,
    Resident,
    iso,
)
from uapplace.paths import Paths
from uapplace.registry import (
    unit_file_name,
    write_local_device,
    write_local_envelope,
    write_local_measurement,
)
from uapplace.units import UnitError, UnitManager

DEFAULT_FLOOR_MIB = 64.0
"""Below this, a GPU reading is not a loaded model (a CUDA context alone is ~300 MiB)."""
MIB = 1024 * 1024
ENVELOPE_BOUND_S = 600.0
"""An envelope measurement is attended and exists to find the slow cases: each part may
take ten minutes (a large model's cold start) before it is abandoned."""
ENVELOPE_POLL_S = 0.05
"""Between two looks while timing: the envelope's resolution."""


class MeasurementRefused(Failed):
    """The reading is not trustworthy; nothing was written. The message says why."""


class MeasureHost(Protocol):
    """What measuring needs from the controller (``ControllerHost`` provides it)."""

    def registry(self) -> Registry: ...

    def residents(self) -> Sequence[Resident]: ...

    async def read_devices(self) -> Mapping[str, DeviceReading]: ...


@dataclass(frozen=True)
class _Reading:
    """What was seen of the engine, before any check."""

    unit: str
    main_pid: int
    pids: tuple[int, ...]
    device: str
    gpu_mib: float
    reading: DeviceReading


class Measurer:
    """``measure(model, config)`` for the daemon (``Controller.measurer``)."""

    def __init__(
        self,
        paths: Paths,
        host: MeasureHost,
        units: UnitManager,
        *,
        floor_mib: float = DEFAULT_FLOOR_MIB,
        http_s: float = engines.PROBE_TIMEOUT_S,
        envelope_bound_s: float = ENVELOPE_BOUND_S,
        exclusive: Callable[[str], contextlib.AbstractAsyncContextManager[None]] | None = None,
        after_write: Callable[[], Awaitable[Any]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.paths = paths
        self.host = host
        self.units = units
        self.floor_mib = floor_mib
        self.http_s = http_s
        self.envelope_bound_s = envelope_bound_s
        self.exclusive = exclusive
        """Holds enforcement off while an envelope is measured (``Enforcer.exclusive``):
        a run must not plan around a unit this takes down and up."""
        """The longest any one part of an envelope measurement may take (stop, memory
        back, start to serving, sleep, wake) before it is abandoned."""
        self.after_write = after_write
        """Called once the local registry changed (the daemon re-reads its registry)."""
        self._clock = clock

    async def measure(self, model: str, config: str = "") -> dict[str, Any]:
        """Measure the running engine of ``model``/``config`` and record it.

        ``config`` may be empty when the model is resident (its resident's config)
        or has one config. Raises ``UnknownModel``/``NotFound``/``InvalidArgument``
        for bad arguments and :class:`MeasurementRefused` for a reading that cannot
        be trusted.
        """
        registry = self.host.registry()
        found, chosen = self._pick(registry, model, config)
        unit = found.unit_for(chosen)
        if unit is None:
            raise InvalidArgument(f"{found.key}/{chosen.key} has no unit: nothing to measure")
        endpoint = found.endpoint_for(chosen)
        seen = await self._read_engine(registry, unit_file_name(unit), endpoint, chosen)
        await self._check_foreign(registry, seen)
        device = registry.devices.get(seen.device)
        if seen.reading.kind is DeviceKind.CPU:
            return await self._record_cpu_engine(found, chosen, seen, endpoint)
        reserved, backends = await self._derived_reserve(registry, seen, device)
        geometry = await self._geometry(chosen, endpoint)
        rss = await asyncio.to_thread(process_rss_mib, seen.pids)
        host_free = await asyncio.to_thread(_host_free_mib)
        now = self._clock()
        fields = _config_fields(chosen, geometry) | {
            "resident_gpu_mib": round(seen.gpu_mib, 1),
            "host_rss_mib": round(rss, 1),
            "measured_at": iso(now),
            "measured_on": seen.device,
            "measured_device": _device_identity(seen.reading),
            "host_free_mib": round(host_free, 1),
        }
        if found.engine_build is not None:
            fields["engine_build"] = found.engine_build
        reason = (
            f"derived by `uapplace measure` at {iso(now)}: total "
            f"{seen.reading.total_mib:,.0f} − free {seen.reading.free_mib:,.0f} − "
            f"uapplace backends {backends:,.0f} MiB"
        )
        path = self.paths.local_registry
        await asyncio.to_thread(write_local_measurement, path, found.key, chosen.key, fields)
        await asyncio.to_thread(
            write_local_device,
            path,
            seen.device,
            {"reserved_mib": reserved, "reserve_reason": reason},
        )
        if self.after_write is not None:
            await self.after_write()
        return {
            "model": found.key,
            "config": chosen.key,
            "unit": seen.unit,
            "pids": list(seen.pids),
            "written": str(path),
            "measurement": fields,
            "device": {
                "key": seen.device,
                "total_mib": seen.reading.total_mib,
                "free_mib": seen.reading.free_mib,
                "backends_mib": backends,
                "reserved_mib": reserved,
                "reserve_reason": reason,
            },
        }

    async def _record_cpu_engine(
        self, found: Model, chosen: Config, seen: _Reading, endpoint: str | None
    ) -> dict[str, Any]:
        """The CPU tier: an engine that holds no GPU memory is recorded on the host device
        (``measured_on: cpu0``, ``resident_gpu_mib: 0``) with the RSS of its unit's
        processes; no device reserve is derived (the host has its own ``reserved_mib``)."""
        geometry = await self._geometry(chosen, endpoint)
        rss = await asyncio.to_thread(process_rss_mib, seen.pids)
        host_free = await asyncio.to_thread(_host_free_mib)
        now = self._clock()
        fields = _config_fields(chosen, geometry) | {
            "resident_gpu_mib": 0.0,
            "host_rss_mib": round(rss, 1),
            "measured_at": iso(now),
            "measured_on": seen.device,
            "host_free_mib": round(host_free, 1),
        }
        if found.engine_build is not None:
            fields["engine_build"] = found.engine_build
        path = self.paths.local_registry
        await asyncio.to_thread(write_local_measurement, path, found.key, chosen.key, fields)
        if self.after_write is not None:
            await self.after_write()
        return {
            "model": found.key,
            "config": chosen.key,
            "unit": seen.unit,
            "pids": list(seen.pids),
            "written": str(path),
            "measurement": fields,
            "device": {"key": seen.device, "kind": "cpu", "free_mib": seen.reading.free_mib},
        }

    # ------------------------------------------------------------------ the envelope

    async def measure_envelope(self, model: str, config: str = "") -> dict[str, Any]:
        """Take ``model``/``config`` down and up again, timing each part (:class:`Envelope`).

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
        found, chosen = self._pick(registry, model, config)
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
        label = f"{found.key}/{chosen.key}"
        if self.exclusive is None:
            return await self._envelope(found, chosen, unit_file_name(unit_key), endpoint)
        async with self.exclusive(f"measure --envelope {label}"):
            return await self._envelope(found, chosen, unit_file_name(unit_key), endpoint)

    async def _envelope(
        self, found: Model, chosen: Config, unit: str, endpoint: str
    ) -> dict[str, Any]:
        registry = self.host.registry()
        seen = await self._read_engine(registry, unit, endpoint, chosen)
        expect = verify.expectation(found, chosen)
        label = f"{found.key}/{chosen.key}"
        try:
            stop_s, free_s = await self._timed_stop(unit, seen)
            cold_s = await self._timed_start(unit, endpoint, expect)
            seen = await self._read_engine(registry, unit, endpoint, chosen)
            await self._timed_stop(unit, seen)
            warm_s = await self._timed_start(unit, endpoint, expect)
            seen = await self._read_engine(registry, unit, endpoint, chosen)
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

    async def _timed_stop(self, unit: str, seen: _Reading) -> tuple[float, float]:
        """``(stop_s, free_s)``: the stop job, then until the probe shows the memory back
        (no PID of the unit holds memory on the device; for a CPU engine, all gone)."""
        started = time.monotonic()
        outcome = await self.units.stop_unit(unit, self.envelope_bound_s)
        if not outcome.ok:
            raise MeasurementRefused(f"stop: {unit}: stop job {outcome.result}")
        stop_s = time.monotonic() - started
        deadline = started + self.envelope_bound_s
        while not await self._released(seen):
            if time.monotonic() >= deadline:
                raise MeasurementRefused(
                    f"memory back: {unit}'s processes still hold memory on {seen.device} "
                    f"{self.envelope_bound_s:g}s after the stop"
                )
            await asyncio.sleep(ENVELOPE_POLL_S)
        return stop_s, time.monotonic() - started

    async def _released(self, seen: _Reading) -> bool:
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
        outcome = await self.units.start_unit(unit, self.envelope_bound_s)
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
        deadline = started + self.envelope_bound_s
        while True:
            state = await self.units.state(unit)
            if state.active_state in ("failed", "inactive"):
                return f"{unit} is {state.active_state}/{state.sub_state}"
            if state.active_state == "active":
                verdict = await verify.check(endpoint, expect, self.http_s)
                if verdict.ok:
                    return None
                last = verdict.detail
            else:
                last = f"{unit} is {state.active_state}"
            if time.monotonic() >= deadline:
                return f"not serving {self.envelope_bound_s:g}s after the start: {last}"
            await asyncio.sleep(ENVELOPE_POLL_S)

    async def _timed_sleep_wake(
        self, seen: _Reading, endpoint: str, expect: verify.Expectation, level: int
    ) -> dict[str, float]:
        """``sleep_s``, ``sleep_freed_mib``, ``wake_s`` through vLLM's sleep API."""
        before = seen.reading.free_mib
        started = time.monotonic()
        try:
            await engines.sleep(endpoint, level, timeout=self.envelope_bound_s)
        except engines.EngineError as err:
            raise MeasurementRefused(f"sleep: {err}") from None
        freed_reading = await self._until_released_by_sleep(seen, started)
        sleep_s = time.monotonic() - started
        freed = max(0.0, freed_reading.free_mib - before)
        started = time.monotonic()
        try:
            await engines.wake(endpoint, timeout=self.envelope_bound_s)
        except engines.EngineError as err:
            raise MeasurementRefused(f"wake: {err}") from None
        why = await self._until_serving(seen.unit, endpoint, expect, started)
        if why is None and await engines.is_sleeping(endpoint, timeout=self.http_s):
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

    async def _until_released_by_sleep(self, seen: _Reading, started: float) -> DeviceReading:
        """The first reading where the unit holds at most half of what it held awake."""
        deadline = started + self.envelope_bound_s
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
                    f"{self.envelope_bound_s:g}s after /sleep"
                )
            await asyncio.sleep(ENVELOPE_POLL_S)

    async def _holds_again(self, seen: _Reading) -> bool:
        deadline = time.monotonic() + self.envelope_bound_s
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
            if await engines.is_sleeping(endpoint, timeout=self.http_s):
                try:
                    await engines.wake(endpoint, timeout=self.envelope_bound_s)
                except engines.EngineError:
                    await self.units.stop_unit(unit, self.envelope_bound_s)
            state = await self.units.state(unit)
            if state.active_state == "active":
                verdict = await verify.check(endpoint, expect, self.http_s)
                if verdict.ok:
                    return f"{unit} is running and serving"
                await self.units.stop_unit(unit, self.envelope_bound_s)
            started = time.monotonic()
            outcome = await self.units.start_unit(unit, self.envelope_bound_s)
            if not outcome.ok:
                return f"{unit} could not be started again: start job {outcome.result}"
            why = await self._until_serving(unit, endpoint, expect, started)
        except UnitError as err:
            return f"{unit} could not be restored: {err}"
        return f"{unit} restarted and serving" if why is None else f"{unit} not restored: {why}"

    # ------------------------------------------------------------------ steps

    def _pick(self, registry: Registry, model: str, config: str) -> tuple[Model, Config]:
        resolved = registry.resolve(model)
        if resolved is None:
            raise UnknownModel(f"model {model!r} is in no registry file")
        found, pinned = resolved
        if config:
            chosen = found.configs.get(config)
            if chosen is None:
                known = ", ".join(found.configs) or "none"
                raise NotFound(f"model {found.key} has no config {config!r} (configs: {known})")
            return found, chosen
        if pinned is not None:
            return found, pinned
        resident = next((r for r in self.host.residents() if r.model == found.key), None)
        if resident is not None and resident.config in found.configs:
            return found, found.configs[resident.config]
        if len(found.configs) == 1:
            return found, next(iter(found.configs.values()))
        raise InvalidArgument(
            f"{found.key} has configs {', '.join(found.configs)} and none is resident: "
            "name the config that is running"
        )

    async def _read_engine(
        self, registry: Registry, unit: str, endpoint: str | None, config: Config | None = None
    ) -> _Reading:
        try:
            state = await self.units.state(unit)
            pids = tuple(sorted(await self.units.pids(unit)))
        except UnitError as err:
            raise MeasurementRefused(f"cannot read {unit}: {err}") from None
        if state.active_state != "active":
            raise MeasurementRefused(
                f"{unit} is not running ({state.active_state}/{state.sub_state}): start it, "
                "let it load, then measure"
            )
        if endpoint is not None and not await engines.health(endpoint, timeout_s=self.http_s):
            raise MeasurementRefused(
                f"{endpoint}/health is not 200: measure once the engine has loaded"
            )
        if not pids:
            raise MeasurementRefused(f"engine PID not found: {unit} has no process")
        readings = await self.host.read_devices()
        usage = gpu_usage_of({k: r for k, r in readings.items() if r.kind is DeviceKind.GPU}, pids)
        if not usage:
            host, why = _host_for_cpu_engine(registry, readings, config)
            if host is None:
                raise MeasurementRefused(
                    f"engine PID not found: none of {unit}'s processes "
                    f"({', '.join(map(str, pids))}) holds memory on a GPU{why}"
                )
            return _Reading(unit, state.main_pid, pids, host, 0.0, readings[host])
        if len(usage) > 1:
            spread = ", ".join(f"{k} {v:,.0f} MiB" for k, v in usage.items())
            raise MeasurementRefused(
                f"{unit} holds memory on several devices ({spread}); a config is placed on one"
            )
        device, gpu_mib = next(iter(usage.items()))
        if gpu_mib < self.floor_mib:
            raise MeasurementRefused(
                f"resident_gpu_mib {gpu_mib:,.1f} MiB on {device} is below the sanity floor "
                f"of {self.floor_mib:g} MiB: the model is not loaded (or the driver does "
                "not report per-process memory)"
            )
        return _Reading(unit, state.main_pid, pids, device, gpu_mib, readings[device])

    async def _check_foreign(self, registry: Registry, seen: _Reading) -> None:
        """Refuse a reading that includes another backend's allocation."""
        holders = {p.pid for p in seen.reading.processes if p.used_mib > 0}
        for other in _other_units(registry, seen.unit):
            try:
                shared = holders.intersection(seen.pids, await self.units.pids(other))
            except UnitError:
                continue
            if shared:
                raise MeasurementRefused(
                    f"the reading includes another backend's allocation: PID(s) "
                    f"{', '.join(map(str, sorted(shared)))} also belong to {other}"
                )
        leftovers = await asyncio.to_thread(_older_than, seen.main_pid, holders & set(seen.pids))
        if leftovers:
            rows = ", ".join(f"pid {pid} `{_command(pid)}`" for pid in leftovers)
            raise MeasurementRefused(
                f"the reading includes another backend's allocation: {rows} in {seen.unit}'s "
                f"cgroup predate its main process {seen.main_pid} (left over from an earlier "
                "run); stop the unit, end the leftover, start it again"
            )

    async def _derived_reserve(
        self, registry: Registry, seen: _Reading, device: Device | None
    ) -> tuple[int, float]:
        """``total − free − Σ backends`` (rounded up), and the backends' sum."""
        backend_pids = set(seen.pids)
        for unit in _other_units(registry, seen.unit):
            try:
                backend_pids.update(await self.units.pids(unit))
            except UnitError:
                continue
        reading = seen.reading
        backends = sum(p.used_mib for p in reading.processes if p.pid in backend_pids)
        derived = reading.total_mib - reading.free_mib - backends
        capacity = min(reading.total_mib, device.total_mib) if device else reading.total_mib
        if derived < -0.5:
            raise MeasurementRefused(
                f"derived reserved_mib for {seen.device} is negative ({derived:,.0f} MiB: total "
                f"{reading.total_mib:,.0f} − free {reading.free_mib:,.0f} − backends "
                f"{backends:,.0f}): the probe contradicts itself"
            )
        if derived > capacity:
            raise MeasurementRefused(
                f"derived reserved_mib for {seen.device} ({derived:,.0f} MiB) exceeds its "
                f"capacity ({capacity:,.0f} MiB; registry total_mib "
                f"{device.total_mib if device else '?'}, probe {reading.total_mib:,.0f})"
            )
        return max(0, math.ceil(derived)), backends

    async def _geometry(self, config: Config, endpoint: str | None) -> dict[str, Any]:
        """KV geometry and diagnostics the engine reports; nothing it does not."""
        out: dict[str, Any] = {}
        if endpoint is None:
            return out
        try:
            metrics = await engines.metrics(endpoint, timeout_s=self.http_s)
        except engines.EngineError:
            metrics = {}
        pool = _positive_int(metrics.get("max_context"))
        if pool is not None:
            out["context_pool_cells"] = pool
            out["kv_resident_cells"] = config.kv_resident_cells or pool
        kv = metrics.get("kv")
        if isinstance(kv, str) and kv:
            out["kv"] = kv
        for name in ("expert_cache_mib", "arena_mib"):
            value = metrics.get(name)
            if isinstance(value, float) and value >= 0:
                out[name] = value
        slots = await engines.slots(endpoint, timeout_s=self.http_s)
        if slots:
            per_slot = _positive_int(slots[0].get("n_ctx"))
            if per_slot is not None:
                out["per_session_cap_cells"] = per_slot
        return out


# --------------------------------------------------------------------------- helpers


def _other_units(registry: Registry, unit: str) -> list[str]:
    units = {
        unit_file_name(u)
        for model in registry.models.values()
        for config in model.configs.values()
        if (u := model.unit_for(config))
    }
    units.discard(unit)
    return sorted(units)


def _host_for_cpu_engine(
    registry: Registry, readings: Mapping[str, DeviceReading], config: Config | None
) -> tuple[str | None, str]:
    """``(host device key, "")`` when an engine holding no GPU memory is a CPU-only
    engine, else ``(None, why)``: why it cannot be told apart from a GPU engine the probe
    does not see (the text that ends the refusal).

    Recorded as CPU only when every GPU can be read (an unreadable one might hold the
    engine's memory) and the config was not last measured on a GPU (a GPU engine whose
    per-process memory the driver stopped reporting must not turn into a free one).
    Decision where the spec is silent (issue 12's CPU tier).
    """
    absent = [f"{k}: {r.error}" for k, r in readings.items() if r.source is ProbeSource.ABSENT]
    if absent:
        return None, f" (unreadable: {'; '.join(absent)})"
    host = registry.host()
    if host is None or host.key not in readings:
        return None, " and the registry declares no cpu device to record a CPU-only engine on"
    earlier = registry.devices.get(config.measured_on or "") if config is not None else None
    was_gpu = earlier is not None and earlier.kind is DeviceKind.GPU
    if config is not None and config.is_measured and earlier is not None and was_gpu:
        return None, (
            f"; {config.key} was measured on {earlier.key} before: the probe no longer "
            "sees its GPU memory, so it is not recorded as CPU-only"
        )
    return host.key, ""


def _config_fields(config: Config, geometry: Mapping[str, Any]) -> dict[str, Any]:
    """The config entry to write: what the registry states, then what was measured.

    The local file replaces a config *whole*, so the repo's flags, unit and
    endpoint are carried over or they would be lost; so are the start facts, the
    pause lever and the envelope (which ``validate`` then flags as older than this
    footprint, asking for a re-measure).
    """
    out: dict[str, Any] = {"status": "measured"}
    kept = {
        "context_pool_cells": config.context_pool_cells,
        "per_session_cap_cells": config.per_session_cap_cells,
        "kv_resident_cells": config.kv_resident_cells,
        "kv_mib_per_1k_cells": config.kv_mib_per_1k_cells,
        "kv": config.kv,
        "unit": config.unit,
        "endpoint": config.endpoint,
        "start_s": config.start_s,
        "start_timeout_s": config.start_timeout_s,
        "pause_lever": config.pause_lever,
        "envelope": config.envelope.to_json() if config.envelope is not None else None,
    }
    out.update({k: v for k, v in kept.items() if v is not None})
    if config.flags:
        out["flags"] = list(config.flags)
    out.update(geometry)
    return out


def _positive_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if math.isfinite(value) and value >= 1 else None


def _older_than(main_pid: int, pids: set[int]) -> list[int]:
    """The PIDs created before ``main_pid`` (PIDs that are gone are skipped)."""
    try:
        main_started = psutil.Process(main_pid).create_time()
    except psutil.Error:
        return []
    older = []
    for pid in sorted(pids - {main_pid}):
        try:
            if psutil.Process(pid).create_time() < main_started:
                older.append(pid)
        except psutil.Error:
            continue
    return older


def _command(pid: int) -> str:
    try:
        process = psutil.Process(pid)
        return " ".join(process.cmdline()) or process.name()
    except psutil.Error:
        return "?"


def _host_free_mib() -> float:
    return psutil.virtual_memory().available / MIB


def _device_identity(reading: DeviceReading) -> dict[str, Any]:
    """The card the figures were taken on (name, UUID, total MiB), for ``measured_on``.

    The registry compares it with the live probe at every load: a measurement taken on
    another device class counts as unknown (spec §4.1 "``measured_on`` gates reuse").
    """
    identity: dict[str, Any] = {"total_mib": round(reading.total_mib)}
    if reading.uuid:
        identity["uuid"] = reading.uuid
    if reading.name:
        identity["name"] = reading.name
    return identity
