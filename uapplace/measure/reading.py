"""A running engine as both measurements read it: which config is meant, the unit's
PIDs, and the one device their memory is on.

``uapplace measure`` (:mod:`uapplace.measure.measurer`, the footprint) and ``uapplace measure
--envelope`` (:mod:`uapplace.measure.envelope`, the stop/start/sleep timings) both start
from :meth:`EngineReader.read`, and both refuse with :class:`MeasurementRefused`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from uapplace.core.errors import Failed, InvalidArgument, NotFound, UnknownModel
from uapplace.core.model import (
    Config,
    DeviceKind,
    DeviceReading,
    Holder,
    Model,
    ProbeSource,
    Registry,
    Resident,
)
from uapplace.io import engines
from uapplace.io.devices import gpu_usage_of
from uapplace.io.router import child_pids, is_router_config, router_model_id
from uapplace.io.seams import UnitControl
from uapplace.io.units import UnitError

DEFAULT_FLOOR_MIB = 64.0
"""Below this, a GPU reading is not a loaded model (a CUDA context alone is ~300 MiB)."""


class MeasurementRefused(Failed):
    """The reading is not trustworthy; nothing was written. The message says why."""


class MeasureHost(Protocol):
    """What measuring needs from the controller (``ControllerHost`` provides it)."""

    def registry(self) -> Registry: ...

    def residents(self) -> Sequence[Resident]: ...

    async def read_devices(self) -> Mapping[str, DeviceReading]: ...

    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        """The proxy's in-flight list by target id; ``None``: unknown."""
        ...


@dataclass(frozen=True)
class EngineReading:
    """What was seen of the engine, before any check."""

    unit: str
    main_pid: int
    pids: tuple[int, ...]
    device: str
    gpu_mib: float
    reading: DeviceReading
    exec_start: str = ""
    """The unit's live ``ExecStart`` (``UnitState.exec_start``): the launch flags the
    KV geometry of a llama.cpp is read from (:mod:`uapplace.measure.geometry`)."""


class EngineReader:
    """Finds the config a measurement means and reads its running engine."""

    def __init__(
        self,
        host: MeasureHost,
        units: UnitControl,
        *,
        floor_mib: float = DEFAULT_FLOOR_MIB,
        http_s: float = engines.PROBE_TIMEOUT_S,
    ) -> None:
        self.host = host
        self.units = units
        self.floor_mib = floor_mib
        self.http_s = http_s

    def pick(self, registry: Registry, model: str, config: str) -> tuple[Model, Config]:
        """The model and config ``model``/``config`` mean: the named config, the pinned
        one, the resident's, or the only one; otherwise the argument is refused."""
        resolved = registry.lookup(model)
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

    async def read(
        self, registry: Registry, unit: str, endpoint: str | None, config: Config | None = None
    ) -> EngineReading:
        """The unit's PIDs and the one device their memory is on; refused when the unit is
        not running and healthy, asleep (:func:`refuse_asleep`), holds nothing, spreads
        over devices or is below the floor. An engine that holds no GPU memory is read on
        the host (:func:`_host_for_cpu_engine`)."""
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
        if endpoint is not None:
            refuse_asleep(endpoint, await engines.sleep_state(endpoint, self.http_s))
        if not pids:
            raise MeasurementRefused(f"engine PID not found: {unit} has no process")
        main_pid = state.main_pid
        routed = _router_model_id(registry, config)
        if routed is not None:
            # One model of a llama.cpp router: its child alone, never the router's own
            # process nor a sibling's (docs/placement-rules.md §4.2, "What paused is").
            pids = tuple(await asyncio.to_thread(child_pids, pids, routed))
            if not pids:
                raise MeasurementRefused(
                    f"{routed} is not loaded in the router {unit}: no process of the unit "
                    f"carries --alias {routed}; load it (POST /models/load), then measure"
                )
            main_pid = pids[0]
        readings = await self.host.read_devices()
        usage = gpu_usage_of({k: r for k, r in readings.items() if r.kind is DeviceKind.GPU}, pids)
        if not usage:
            host, why = _host_for_cpu_engine(registry, readings, config)
            if host is None:
                raise MeasurementRefused(
                    f"engine PID not found: none of {unit}'s processes "
                    f"({', '.join(map(str, pids))}) holds memory on a GPU{why}"
                )
            return EngineReading(unit, main_pid, pids, host, 0.0, readings[host], state.exec_start)
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
        return EngineReading(
            unit, main_pid, pids, device, gpu_mib, readings[device], state.exec_start
        )


def refuse_asleep(endpoint: str, state: engines.SleepState | None) -> None:
    """Refuse to measure a sleeping engine: it has given its memory back, so what its PIDs
    hold now is not its footprint. Asked through ``/props`` first, which (unlike
    ``/slots``) does not wake a llama.cpp (:func:`uapplace.io.engines.sleep_state`)."""
    if state is None or not state.asleep:
        return
    if state.source == "props":
        raise MeasurementRefused(
            f"{endpoint}: engine is asleep (llama.cpp --sleep-idle-seconds): send it a "
            "request first, then measure while it is awake"
        )
    raise MeasurementRefused(
        f"{endpoint}: engine is asleep (vLLM POST /sleep): wake it first (POST /wake_up), "
        "then measure"
    )


def _router_model_id(registry: Registry, config: Config | None) -> str | None:
    """The router model id of ``config`` when it is one model of a llama.cpp router."""
    if not is_router_config(config):
        return None
    owner = next((m for m in registry.models.values() if config in m.configs.values()), None)
    return router_model_id(owner) if owner is not None else None


def _host_for_cpu_engine(
    registry: Registry, readings: Mapping[str, DeviceReading], config: Config | None
) -> tuple[str | None, str]:
    """``(host device key, "")`` when an engine holding no GPU memory is a CPU-only
    engine, else ``(None, why)``: why it cannot be told apart from a GPU engine the probe
    does not see (the text that ends the refusal).

    Recorded as CPU only when every GPU can be read (an unreadable one might hold the
    engine's memory) and the config was not last measured on a GPU (a GPU engine whose
    per-process memory the driver stopped reporting must not turn into a free one).
    Decision where docs/placement-rules.md is silent (issue 12's CPU tier).
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
