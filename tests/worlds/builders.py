"""Builders for the core model's objects (:mod:`uapplace.core.model`) the pure tests plan over.

A GPU and the host (:func:`gpu`, :func:`cpu`) and a config measured on this machine
(:func:`measured`), with the defaults the planner's tests use; the enforcement fakes and
the other planner tests pass their own figures.
"""

from __future__ import annotations

from typing import Any

from uapplace.core.model import Config, ConfigStatus, Device, DeviceKind

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
