"""Device probes: what each registry device holds right now (the probe wins over the ledger).

Every probe answers ``read() -> {registry device key: DeviceReading}``:

- :class:`NvmlProbe`: per GPU through NVML (``pynvml`` from nvidia-ml-py): total,
  free, per-PID compute usage. A registry device binds to its ``uuid`` when set,
  else to the index in its key (``gpu1`` → NVML index 1).
- :class:`SimProbe`: the same output read from the simulated GPU file
  (:mod:`uapplace.sim.gpu`), with ``source=sim``; nothing else differs.
- :class:`HostProbe`: the ``cpu`` devices, from ``MemAvailable``.

A probe never raises: a GPU it cannot read is reported with ``source=absent``,
total and free 0, and an ``error`` that says why. Reads block (NVML, ``/proc``):
the daemon calls them in a thread, one read at a time per probe.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import psutil

from uapplace.core.model import (
    Device,
    DeviceKind,
    DeviceReading,
    ProbeSource,
    ProcessUsage,
    Registry,
)
from uapplace.files.paths import Paths
from uapplace.sim.gpu import SimDevice, SimGpu, SimGpuError, SimState

MIB = 1024 * 1024


class Probe(Protocol):
    def read(self) -> dict[str, DeviceReading]: ...


def absent_reading(device: Device, error: str) -> DeviceReading:
    return DeviceReading(
        key=device.key,
        kind=device.kind,
        total_mib=0.0,
        free_mib=0.0,
        source=ProbeSource.ABSENT,
        uuid=device.uuid,
        error=error,
    )


def gpu_index(key: str) -> int | None:
    """The index a key names when the registry gives no uuid: ``gpu1`` → 1."""
    match = re.search(r"(\d+)$", key)
    return int(match.group(1)) if match else None


def _binding(device: Device) -> str:
    if device.uuid:
        return f"uuid {device.uuid}"
    index = gpu_index(device.key)
    return f"index {index}" if index is not None else "no uuid and no index in the key"


def process_command(pid: int) -> str:
    """The command line of ``pid``, or its name; ``""`` when it cannot be read."""
    try:
        process = psutil.Process(pid)
        return " ".join(process.cmdline()) or process.name()
    except (psutil.Error, OSError):
        return ""


# --------------------------------------------------------------------------- NVML


class NvmlApi(Protocol):
    """The part of the ``pynvml`` module the probe calls (a test passes a fake)."""

    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None: ...

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any: ...

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> Sequence[Any]: ...


def _error_text(err: BaseException) -> str:
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class NvmlProbe:
    """GPU devices through NVML. Initialises once and keeps the handles; after an NVML
    error it shuts down and initialises again on the next read."""

    def __init__(
        self,
        devices: Iterable[Device],
        nvml: NvmlApi | None = None,
        command_of: Callable[[int], str] = process_command,
    ) -> None:
        self.devices = tuple(d for d in devices if d.kind is DeviceKind.GPU)
        self._nvml = nvml
        self._command_of = command_of
        self._initialised = False
        self._handles: dict[str, Any] = {}

    def read(self) -> dict[str, DeviceReading]:
        if not self.devices:
            return {}
        problem = self._start()
        if problem is not None:
            return {d.key: absent_reading(d, problem) for d in self.devices}
        return {d.key: self._read_device(d) for d in self.devices}

    def close(self) -> None:
        """Shut NVML down (the next read initialises it again)."""
        self._reset()

    # ----------------------------------------------------------------- internals

    def _start(self) -> str | None:
        """Load and initialise NVML if needed; the reason it failed, or ``None``."""
        if self._initialised:
            return None
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError:
                return "NVML unavailable: the pynvml module (nvidia-ml-py) is not installed"
        try:
            self._nvml.nvmlInit()
        except Exception as err:
            return f"NVML unavailable: {_error_text(err)}"
        self._initialised = True
        return None

    def _reset(self) -> None:
        self._handles.clear()
        if self._initialised and self._nvml is not None:
            # Re-initialising is the recovery; a failed shutdown changes nothing.
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
        self._initialised = False

    def _handle(self, nvml: NvmlApi, device: Device) -> Any:
        if device.key in self._handles:
            return self._handles[device.key]
        if device.uuid:
            handle = nvml.nvmlDeviceGetHandleByUUID(device.uuid)
        else:
            index = gpu_index(device.key)
            if index is None:
                raise LookupError("no uuid in the registry and no index in the key")
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self._handles[device.key] = handle
        return handle

    def _read_device(self, device: Device) -> DeviceReading:
        nvml = self._nvml
        assert nvml is not None  # _start succeeded
        try:
            handle = self._handle(nvml, device)
        except Exception as err:
            # A wrong binding is the registry's problem, not NVML's: no re-init.
            return absent_reading(device, f"NVML: no GPU at {_binding(device)}: {_error_text(err)}")
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            uuid = device.uuid or _text(nvml.nvmlDeviceGetUUID(handle))
        except Exception as err:
            self._reset()
            return absent_reading(
                device, f"NVML: reading {_binding(device)} failed: {_error_text(err)}"
            )
        return DeviceReading(
            key=device.key,
            kind=DeviceKind.GPU,
            total_mib=int(memory.total) / MIB,
            free_mib=int(memory.free) / MIB,
            source=ProbeSource.NVML,
            processes=tuple(self._usage(p) for p in running),
            uuid=uuid,
            name=_device_name(nvml, handle),
        )

    def _usage(self, process: Any) -> ProcessUsage:
        pid = int(process.pid)
        used = process.usedGpuMemory  # None where the driver does not say (containers)
        used_mib = int(used) / MIB if used is not None else 0.0
        return ProcessUsage(pid=pid, used_mib=used_mib, command=self._command_of(pid))


def _device_name(nvml: NvmlApi, handle: Any) -> str | None:
    """The product name (``NVIDIA GeForce RTX 3090``), or ``None`` where NVML gives none.

    Optional on the API: a measurement's device identity compares it when both sides have it.
    """
    get_name = getattr(nvml, "nvmlDeviceGetName", None)
    if get_name is None:
        return None
    try:
        return _text(get_name(handle)) or None
    except Exception:
        return None


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


# --------------------------------------------------------------------------- simulated GPU


class SimProbe:
    """GPU devices read from the simulated GPU file, bound like NVML binds them."""

    def __init__(self, sim: SimGpu, devices: Iterable[Device]) -> None:
        self.sim = sim
        self.devices = tuple(d for d in devices if d.kind is DeviceKind.GPU)

    def read(self) -> dict[str, DeviceReading]:
        if not self.devices:
            return {}
        try:
            state = self.sim.read()
        except SimGpuError as err:
            return {d.key: absent_reading(d, f"simulated GPU: {err}") for d in self.devices}
        return {d.key: self._reading(state, d) for d in self.devices}

    def _reading(self, state: SimState, device: Device) -> DeviceReading:
        sim_device = self._bound(state, device)
        if sim_device is None:
            return absent_reading(
                device, f"simulated GPU {self.sim.path}: no device at {_binding(device)}"
            )
        return DeviceReading(
            key=device.key,
            kind=DeviceKind.GPU,
            total_mib=float(sim_device.total_mib),
            free_mib=state.free_mib(sim_device.uuid),
            source=ProbeSource.SIM,
            processes=tuple(
                ProcessUsage(a.pid, a.used_mib, a.command)
                for a in state.allocations_on(sim_device.uuid)
            ),
            uuid=sim_device.uuid,
            name=sim_device.name or None,
        )

    @staticmethod
    def _bound(state: SimState, device: Device) -> SimDevice | None:
        if device.uuid:
            return state.device(device.uuid)
        index = gpu_index(device.key)
        if index is None or index >= len(state.devices):
            return None
        return state.devices[index]


# --------------------------------------------------------------------------- host RAM


class HostProbe:
    """The ``cpu`` devices: total RAM and ``MemAvailable``."""

    def __init__(self, devices: Iterable[Device]) -> None:
        self.devices = tuple(d for d in devices if d.kind is DeviceKind.CPU)

    def read(self) -> dict[str, DeviceReading]:
        if not self.devices:
            return {}
        try:
            memory = psutil.virtual_memory()
        except (OSError, RuntimeError) as err:
            return {d.key: absent_reading(d, f"MemAvailable: {err}") for d in self.devices}
        return {
            d.key: DeviceReading(
                key=d.key,
                kind=DeviceKind.CPU,
                total_mib=memory.total / MIB,
                free_mib=memory.available / MIB,
                source=ProbeSource.MEMAVAILABLE,
            )
            for d in self.devices
        }


# --------------------------------------------------------------------------- composition


class CombinedProbe:
    """Several probes read as one, in the registry's device order."""

    def __init__(self, probes: Sequence[Probe], order: Sequence[str]) -> None:
        self.probes = tuple(probes)
        self.order = tuple(order)

    def read(self) -> dict[str, DeviceReading]:
        found: dict[str, DeviceReading] = {}
        for probe in self.probes:
            found.update(probe.read())
        ordered = {key: found[key] for key in self.order if key in found}
        ordered.update(found)
        return ordered


def make_probe(paths: Paths, registry: Registry) -> Probe:
    """The simulated GPU when ``paths.sim_gpu`` is set (``UAPPLACE_SIM_GPU``), NVML otherwise;
    plus the host probe for the ``cpu`` devices."""
    devices = list(registry.devices.values())
    gpu_probe: Probe
    if paths.sim_gpu is not None:
        gpu_probe = SimProbe(SimGpu(paths.sim_gpu), devices)
    else:
        gpu_probe = NvmlProbe(devices)
    return CombinedProbe([gpu_probe, HostProbe(devices)], list(registry.devices))


# --------------------------------------------------------------------------- per-PID figures


def process_rss_mib(pids: Iterable[int]) -> float:
    """Sum of the resident set of these PIDs in MiB; PIDs that are gone are skipped."""
    total = 0
    for pid in set(pids):
        try:
            total += psutil.Process(pid).memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total / MIB


def gpu_usage_of(readings: Mapping[str, DeviceReading], pids: Iterable[int]) -> dict[str, float]:
    """MiB per device held by these PIDs. A device appears only when one of them has a
    context on it (its figure can be 0 where NVML does not report per-process memory)."""
    wanted = set(pids)
    usage: dict[str, float] = {}
    for key, reading in readings.items():
        held = [p.used_mib for p in reading.processes if p.pid in wanted]
        if held:
            usage[key] = sum(held)
    return usage
