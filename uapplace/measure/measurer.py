"""Footprints from the live engine (docs/placement-rules.md §4.1.1): ``uapplace measure <model>``.

The engine must be running under its registry unit, loaded and idle. From its
unit's cgroup PIDs:

- ``resident_gpu_mib``: the GPU memory those PIDs hold (NVML compute apps, or
  the simulated GPU), on exactly one device, which becomes ``measured_on``;
- ``host_rss_mib``: their resident set, ``VmRSS`` summed over the engine's own PIDs
  (psutil), taken once the engine has loaded and while it is idle. ``VmRSS``
  counts the pages of a memory-mapped file that are resident: with llama.cpp's
  default mmap loading the model file's pages count in the RSS once touched (they
  are page cache shared with the file, which is why the host's free memory and the
  process's memory disagree, up to ~100× on a small model). That is the footprint
  recorded: what the engine keeps resident after load, weights included;
- KV geometry where the engine reports it (:mod:`uapplace.measure.geometry`):
  ``context_pool_cells`` and ``kv`` from ``/metrics`` (``max_context``, the ``kv``
  label) where a Strata-like engine exports them; for llama.cpp, which exports no
  setting there, ``per_session_cap_cells`` = ``/props``
  ``default_generation_settings.n_ctx`` (per slot), the pool from it, ``/props``
  ``total_slots`` and the unit's live ``ExecStart`` flags, ``kv`` from
  ``--cache-type-k`` (default ``f16``) and ``kv_mib_per_1k_cells`` 0 (its pool is
  fixed at start), so the config is placeable at any context a request names;
  ``kv_resident_cells`` = the pool (allocated at start) unless the registry already
  states it; ``expert_cache_mib`` / ``arena_mib`` when ``/metrics`` has them
  (diagnostic only, never in the cost). Nothing is invented where the engine
  reports nothing. ``/slots`` is asked only when ``/props`` has no per-slot
  context, and never of a sleeping engine (it would wake it).

- ``flags``: the arguments of the unit's live ``ExecStart`` (after the program), the
  launch line the footprint was measured under; ``validate`` checks the capacity
  policy's ``execStartMustContain`` against them (they replace the registry's).

The result names where each recorded figure came from (``sources``).

Only the machine-local registry (``$UAP_HOME/model-registry.json``) is
written: the config entry (keeping the registry's flags, unit and endpoint),
with ``measured_on``, ``measured_at`` and the host free RAM seen
(``host_free_mib``), and the device's ``reserved_mib`` derived as
``total − free − Σ(GPU memory of uapplace backends)``: whatever no backend
accounts for, graphics memory included, attributed to a PID or not.

- ``exec_start_sha256`` and ``measured_build``: the SHA-256 of the unit's live
  ``ExecStart`` and the build the engine reports (llama.cpp ``/props`` ``build_info``,
  vLLM ``/version``), so a later change of either makes the figures stale
  (:mod:`uapplace.core.staleness`).

Refused, with the reason, and nothing written (docs/placement-rules.md §4.1.1):

- the unit is not running, or not healthy yet;
- the engine is not idle: the proxy lists a request in flight for it, or the engine
  itself says it is working (:mod:`uapplace.io.busy`, as the drain asks it);
- the engine is asleep (``/props`` ``is_sleeping``: llama.cpp's
  ``--sleep-idle-seconds``; vLLM's ``/is_sleeping``), before or while it is read:
  asleep, it has given its memory back;
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
import math
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any

import psutil

from uapplace.core.errors import InvalidArgument
from uapplace.core.model import Config, Device, DeviceKind, DeviceReading, Model, Registry, iso
from uapplace.core.staleness import LiveLaunch, exec_start_digest
from uapplace.core.unitnames import unit_file_name
from uapplace.files.paths import Paths
from uapplace.files.registry_write import write_local_device, write_local_measurement
from uapplace.io import busy, engines
from uapplace.io.devices import process_rss_mib
from uapplace.io.seams import UnitControl
from uapplace.io.units import UnitError
from uapplace.measure.envelope import ENVELOPE_BOUND_S, EnvelopeMeasurer, SwitchWindow
from uapplace.measure.geometry import Geometry, kv_geometry, launch_args, launch_flags
from uapplace.measure.launch import engine_build, read_live_launch
from uapplace.measure.reading import (
    DEFAULT_FLOOR_MIB,
    EngineReader,
    EngineReading,
    MeasureHost,
    MeasurementRefused,
    refuse_asleep,
)

MIB = 1024 * 1024


class Measurer:
    """``measure(model, config)`` and ``measure_envelope(model, config)`` for the daemon
    (``Controller.measurer``); the envelope is
    :class:`~uapplace.measure.envelope.EnvelopeMeasurer`'s."""

    def __init__(
        self,
        paths: Paths,
        host: MeasureHost,
        units: UnitControl,
        *,
        floor_mib: float = DEFAULT_FLOOR_MIB,
        http_s: float = engines.PROBE_TIMEOUT_S,
        envelope_bound_s: float = ENVELOPE_BOUND_S,
        window: SwitchWindow | None = None,
        after_write: Callable[[], Awaitable[Any]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.paths = paths
        self.host = host
        self.units = units
        self.reader = EngineReader(host, units, floor_mib=floor_mib, http_s=http_s)
        self.envelope = EnvelopeMeasurer(
            paths,
            self.reader,
            bound_s=envelope_bound_s,
            window=window,
            after_write=after_write,
            clock=clock,
        )
        self.after_write = after_write
        """Called once the local registry changed (the daemon re-reads its registry)."""
        self._clock = clock

    async def measure(self, model: str, config: str = "") -> dict[str, Any]:
        """Measure the running engine of ``model``/``config`` and record it.

        ``config`` may be empty when the model is resident (its resident's config)
        or has one config. Raises ``UnknownModel``/``NotFound``/``InvalidArgument``
        for bad arguments and :class:`MeasurementRefused` for a reading that cannot
        be trusted. An engine that holds no GPU memory is the CPU tier: recorded on
        the host device (``measured_on: cpu0``, ``resident_gpu_mib: 0``) with the RSS
        of its unit's processes, and no device reserve derived (the host has its own
        ``reserved_mib``).
        """
        registry = self.host.registry()
        found, chosen = self.reader.pick(registry, model, config)
        unit = found.unit_for(chosen)
        if unit is None:
            raise InvalidArgument(f"{found.key}/{chosen.key} has no unit: nothing to measure")
        endpoint = found.endpoint_for(chosen)
        seen = await self.reader.read(registry, unit_file_name(unit), endpoint, chosen)
        await self._refuse_busy(found, chosen, endpoint)
        await self._check_foreign(registry, seen)
        reserve = None
        if seen.reading.kind is not DeviceKind.CPU:
            device = registry.devices.get(seen.device)
            reserve = await self._derived_reserve(registry, seen, device)
        fields, sources, now = await self._footprint(found, chosen, seen, endpoint)
        path = self.paths.local_registry
        await asyncio.to_thread(write_local_measurement, path, found.key, chosen.key, fields)
        shown: dict[str, Any] = {
            "key": seen.device,
            "kind": "cpu",
            "free_mib": seen.reading.free_mib,
        }
        if reserve is not None:
            shown = await self._write_reserve(seen, *reserve, now)
        if self.after_write is not None:
            await self.after_write()
        return {
            "model": found.key,
            "config": chosen.key,
            "unit": seen.unit,
            "pids": list(seen.pids),
            "written": str(path),
            "measurement": fields,
            "sources": sources,
            "device": shown,
        }

    async def measure_envelope(
        self, model: str, config: str = "", expected: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Take ``model``/``config`` down and up again, timing each part, under the
        consent ``expected`` carries
        (:meth:`uapplace.measure.envelope.EnvelopeMeasurer.measure`)."""
        return await self.envelope.measure(model, config, expected)

    async def live_launch(
        self, registry: Registry, only: Collection[str] | None = None
    ) -> dict[str, LiveLaunch]:
        """What each measured config's unit runs now (:func:`read_live_launch`)."""
        return await read_live_launch(registry, self.units, self.reader.http_s, only)

    # ------------------------------------------------------------------ steps

    async def _write_reserve(
        self, seen: EngineReading, reserved: int, backends: float, now: float
    ) -> dict[str, Any]:
        """Record the device's derived ``reserved_mib`` with its reason; what was written."""
        reason = (
            f"derived by `uapplace measure` at {iso(now)}: total "
            f"{seen.reading.total_mib:,.0f} − free {seen.reading.free_mib:,.0f} − "
            f"uapplace backends {backends:,.0f} MiB"
        )
        await asyncio.to_thread(
            write_local_device,
            self.paths.local_registry,
            seen.device,
            {"reserved_mib": reserved, "reserve_reason": reason},
        )
        return {
            "key": seen.device,
            "total_mib": seen.reading.total_mib,
            "free_mib": seen.reading.free_mib,
            "backends_mib": backends,
            "reserved_mib": reserved,
            "reserve_reason": reason,
        }

    async def _footprint(
        self, found: Model, chosen: Config, seen: EngineReading, endpoint: str | None
    ) -> tuple[dict[str, Any], dict[str, str], float]:
        """The config entry to write for ``seen``, where each figure came from, and when
        it was read. The RSS is read before ``/props``, so an engine that fell asleep
        meanwhile is caught (:meth:`_geometry`) rather than recorded small."""
        rss = await asyncio.to_thread(process_rss_mib, seen.pids)
        geometry = await self._geometry(chosen, endpoint, seen.exec_start)
        host_free = await asyncio.to_thread(_host_free_mib)
        now = self._clock()
        pids = ", ".join(map(str, seen.pids))
        sources = geometry.sources | {
            "host_rss_mib": f"VmRSS of PIDs {pids} (resident mmap'd model pages included)",
            "resident_gpu_mib": (
                "none: no GPU memory held (CPU-only engine)"
                if seen.reading.kind is DeviceKind.CPU
                else f"GPU memory of PIDs {pids} on {seen.device}"
            ),
        }
        fields = _config_fields(chosen, geometry.fields) | {
            "resident_gpu_mib": round(seen.gpu_mib, 1),
            "host_rss_mib": round(rss, 1),
            "measured_at": iso(now),
            "measured_on": seen.device,
        }
        if seen.reading.kind is not DeviceKind.CPU:
            fields["measured_device"] = _device_identity(seen.reading)
        launched = launch_args(seen.exec_start)
        if launched:
            fields["flags"] = list(launched)
            sources["flags"] = f"{seen.unit}'s live ExecStart, the launch line measured under"
        fields["host_free_mib"] = round(host_free, 1)
        if found.engine_build is not None:
            fields["engine_build"] = found.engine_build
        if seen.exec_start:
            fields["exec_start_sha256"] = exec_start_digest(seen.exec_start)
            sources["exec_start_sha256"] = f"SHA-256 of {seen.unit}'s live ExecStart"
        build = await engine_build(endpoint, self.reader.http_s)
        if build is not None:
            fields["measured_build"] = build
            sources["measured_build"] = "the build the engine reports (/props or /version)"
        return fields, sources, now

    async def _refuse_busy(self, found: Model, chosen: Config, endpoint: str | None) -> None:
        """A footprint is read at rest (docs/placement-rules.md §4.1.1): refused while the
        proxy lists a request in flight for the resident, or the engine says it works.
        A proxy that cannot answer is not held against it (the engine's word decides:
        a measurement stops nothing, unlike a drain, where unknown counts as busy)."""
        resident = next(
            (r for r in self.host.residents() if (r.model, r.config) == (found.key, chosen.key)),
            None,
        )
        listed = await self.host.inflight() if resident is not None else None
        requests = listed.get(resident.target_id, ()) if listed and resident else ()
        inflight = [h.client for h in requests]
        if inflight:
            raise MeasurementRefused(
                f"{found.key}/{chosen.key} is not idle: {len(inflight)} request(s) in flight "
                f"({', '.join(sorted(set(inflight)))}); measure once they ended"
            )
        if endpoint is None:
            return
        http_s = self.reader.http_s

        async def fetch(route: str) -> tuple[int | None, str]:
            return await engines.get_reply(endpoint, route, http_s)

        work = await busy.ask(fetch)
        if work.verdict is busy.Verdict.BUSY:
            raise MeasurementRefused(
                f"{found.key}/{chosen.key} is not idle: its engine says {work.text()}; "
                "measure once its work ended"
            )

    async def _check_foreign(self, registry: Registry, seen: EngineReading) -> None:
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
        self, registry: Registry, seen: EngineReading, device: Device | None
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

    async def _geometry(self, config: Config, endpoint: str | None, exec_start: str) -> Geometry:
        """KV geometry and diagnostics the engine reports (:func:`kv_geometry`); nothing it
        does not. ``/props`` first: a sleeping engine is refused, and ``/slots`` (which
        would wake it) is asked only for a per-slot context ``/props`` lacks."""
        if endpoint is None:
            return Geometry()
        http_s = self.reader.http_s
        try:
            metrics = await engines.metrics(endpoint, timeout_s=http_s)
        except engines.EngineError:
            metrics = {}
        try:
            props: dict[str, Any] | None = await engines.props(endpoint, timeout_s=http_s)
        except engines.EngineError:
            props = None
        if props is not None and engines.props_sleeping(props):
            refuse_asleep(endpoint, engines.SleepState(True, "props"))
        slot_list = None
        settings = props.get(engines.N_CTX_SETTING) if props is not None else None
        if not (isinstance(settings, dict) and settings.get("n_ctx")):
            slot_list = await engines.slots(endpoint, timeout_s=http_s)
        return kv_geometry(config, metrics, props, slot_list, launch_flags(exec_start))


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
    another device class counts as unknown (docs/placement-rules.md §4.1: ``measured_on`` gates
    reuse).
    """
    identity: dict[str, Any] = {"total_mib": round(reading.total_mib)}
    if reading.uuid:
        identity["uuid"] = reading.uuid
    if reading.name:
        identity["name"] = reading.name
    return identity
