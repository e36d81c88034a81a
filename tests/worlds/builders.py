"""Builders for the core model's objects (:mod:`uapplace.core.model`) the pure tests plan over.

A GPU and the host (:func:`gpu`, :func:`cpu`) and a config measured on this machine
(:func:`measured`), with the defaults the planner's tests use; the enforcement fakes and
the other planner tests pass their own figures. What the probes read on them
(:func:`gpu_reading`, :func:`cpu_reading`) and a parked request (:func:`parked`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from uapplace.core.model import (
    Config,
    ConfigStatus,
    Device,
    DeviceKind,
    DeviceReading,
    Option,
    ParkReason,
    PendingEntry,
    ProbeSource,
    ProcessUsage,
)

MEASURED_AT = "2026-10-08T14:02:00Z"


def gpu(key: str = "gpu0", total: int = 24_576, reserved: int = 2_048) -> Device:
    return Device(key, DeviceKind.GPU, total, reserved)


def cpu(total: int = 126_944, reserved: int = 8_192) -> Device:
    return Device("cpu0", DeviceKind.CPU, total, reserved)


def measured(
    key: str,
    gpu_mib: float,
    host_mib: float = 1_000.0,
    on: str | None = "gpu0",
    kv_resident_cells: int | None = 32_768,
    **fields: Any,
) -> Config:
    """A config measured on ``on`` at :data:`MEASURED_AT`; ``fields``: other :class:`Config`
    fields (``unit``, ``pause_lever``, ``envelope``, ``kv_mib_per_1k_cells``)."""
    return Config(
        key,
        ConfigStatus.MEASURED,
        resident_gpu_mib=gpu_mib,
        host_rss_mib=host_mib,
        kv_resident_cells=kv_resident_cells,
        measured_at=MEASURED_AT,
        measured_on=on,
        **fields,
    )


def gpu_reading(
    total_mib: float,
    free_mib: float,
    *,
    key: str = "gpu0",
    source: ProbeSource = ProbeSource.SIM,
    processes: Iterable[ProcessUsage] = (),
) -> DeviceReading:
    """What the GPU probe reads on ``key`` (the simulated GPU unless ``source`` says)."""
    return DeviceReading(key, DeviceKind.GPU, total_mib, free_mib, source, tuple(processes))


def cpu_reading(total_mib: float, free_mib: float) -> DeviceReading:
    """What ``MemAvailable`` reads on ``cpu0``, the host."""
    return DeviceReading("cpu0", DeviceKind.CPU, total_mib, free_mib, ProbeSource.MEMAVAILABLE)


def parked(
    model: str,
    *options: Option,
    id: str = "plc-000001",
    client: str = "client",
    session: str | None = None,
    created_at: float = 0.0,
    expires_at: float = 1e12,
) -> PendingEntry:
    """``client``'s request for ``model``, parked as not resident, offering ``options``."""
    return PendingEntry(
        id, model, client, session, created_at, expires_at, ParkReason.NOT_RESIDENT, options=options
    )
