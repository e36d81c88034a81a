"""Footprint drift: a GPU's memory in use, as the probe reads it, against what its
residents' measured footprints account for (docs/invariants.md, invariant 5 and "Alerts").

The planner places by measured footprints; the probe records fact. On a GPU the memory in
use that no resident's footprint accounts for is ``used − Σ gpu_mib`` (``used`` = total −
free). Some of it is always there (the driver's context, a display): that is what the
device's ``reserved_mib`` sets aside. So the device has drifted when

- more than ``reserved_mib + DRIFT_TOLERANCE_MIB`` is unaccounted (a resident grew past
  its measurement, or something outside uapplace holds memory), or
- less than ``−DRIFT_TOLERANCE_MIB`` is (a resident holds less than measured: the
  planner keeps room free that is not needed, or the measurement is of another config),

for at least ``DRIFT_HOLD_S`` without a break: a switch in progress disagrees for
seconds, so a device with a resident that is not ``hot`` or ``paused`` (or one whose
footprint is unknown) is not judged and its clock restarts. The tolerance is the one the
shipped Prometheus rule ``UapplaceFootprintDrift`` uses (contrib/prometheus), which judges
the same difference from ``/metrics``; this alert is the daemon's own, for a machine
with no Prometheus. One ``footprint_drift`` warning per device per crossing (like
``below_reserve``: each raise is a desktop notification), naming the residents and their
footprints; it stays until acknowledged. The host (``cpu0``) is ``below_reserve``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from uapplace.core.alerts import AlertBoard, AlertKind, Severity
from uapplace.core.model import (
    Device,
    DeviceKind,
    DeviceReading,
    ProbeSource,
    Registry,
    Resident,
    ResidentState,
)
from uapplace.core.victims import fmt_mib

DRIFT_TOLERANCE_MIB = 1024.0
"""How far past the reserve (or below zero) the unaccounted memory may go."""
DRIFT_HOLD_S = 60.0
"""How long a drift must last, unbroken, before it is an alert."""
_SETTLED = frozenset({ResidentState.HOT, ResidentState.PAUSED})


def unaccounted_mib(reading: DeviceReading, residents: Sequence[Resident]) -> float | None:
    """Memory in use on the device that its residents' footprints do not account for;
    ``None`` while a footprint is unknown or a resident is mid-change."""
    if any(r.state not in _SETTLED or r.gpu_mib is None for r in residents):
        return None
    used = reading.total_mib - reading.free_mib
    return used - sum(r.gpu_mib or 0.0 for r in residents)


class DriftWatch:
    """Per GPU, since when it has drifted; the alert once per crossing."""

    def __init__(self, board: AlertBoard, hold_s: float = DRIFT_HOLD_S) -> None:
        self._board = board
        self._hold_s = hold_s
        self._since: dict[str, float] = {}
        self._raised: set[str] = set()

    @property
    def drifted(self) -> frozenset[str]:
        """The devices whose drift has been raised and has not ended since."""
        return frozenset(self._raised)

    def check(
        self,
        registry: Registry,
        residents: Sequence[Resident],
        readings: Mapping[str, DeviceReading],
        now: float,
    ) -> frozenset[str]:
        """Judge every GPU the probe read; raise ``footprint_drift`` where it is due."""
        for key, device in registry.devices.items():
            reading = readings.get(key)
            if device.kind is not DeviceKind.GPU or reading is None or not _readable(reading):
                continue
            on_device = [r for r in residents if r.device == key]
            self._judge(device, reading, on_device, now)
        return self.drifted

    def _judge(
        self, device: Device, reading: DeviceReading, residents: Sequence[Resident], now: float
    ) -> None:
        unaccounted = unaccounted_mib(reading, residents)
        if unaccounted is None or not _beyond(device, unaccounted):
            self._since.pop(device.key, None)
            if unaccounted is not None:
                self._raised.discard(device.key)  # back within: the next crossing raises
            return
        since = self._since.setdefault(device.key, now)
        if now - since < self._hold_s or device.key in self._raised:
            return
        self._raised.add(device.key)
        self._board.raise_alert(
            AlertKind.FOOTPRINT_DRIFT,
            Severity.WARNING,
            device.key,
            drift_text(device, reading, residents, unaccounted),
            {
                "device": device.key,
                "used_mib": round(reading.total_mib - reading.free_mib, 3),
                "accounted_mib": round(sum(r.gpu_mib or 0.0 for r in residents), 3),
                "unaccounted_mib": round(unaccounted, 3),
                "reserved_mib": device.reserved_mib,
                "tolerance_mib": DRIFT_TOLERANCE_MIB,
                "residents": {r.signature: r.gpu_mib for r in residents},
            },
        )


def _beyond(device: Device, unaccounted: float) -> bool:
    return (
        unaccounted > device.reserved_mib + DRIFT_TOLERANCE_MIB
        or unaccounted < -DRIFT_TOLERANCE_MIB
    )


def drift_text(
    device: Device, reading: DeviceReading, residents: Sequence[Resident], unaccounted: float
) -> str:
    used = reading.total_mib - reading.free_mib
    held = ", ".join(f"{r.signature} {fmt_mib(r.gpu_mib or 0.0)} MiB" for r in residents)
    footprints = f"its residents' footprints ({held or 'none'})"
    if unaccounted > 0:
        why = (
            f"{fmt_mib(unaccounted - device.reserved_mib)} MiB more than {footprints} and "
            f"the {fmt_mib(device.reserved_mib)} MiB reserve account for: a resident grew "
            "past its measurement, or something outside uapplace holds memory"
        )
    else:
        why = (
            f"{fmt_mib(-unaccounted)} MiB less than {footprints} claim: a measurement is "
            "larger than what the engine holds"
        )
    return (
        f"{device.key}: the probe reads {fmt_mib(used)} MiB in use, {why}. Re-measure "
        "(`uapplace measure`) or raise the device's reserved_mib"
    )


def _readable(reading: DeviceReading) -> bool:
    return reading.source is not ProbeSource.ABSENT and reading.total_mib > 0 and not reading.error
