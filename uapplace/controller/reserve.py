"""The host below its reserve: one ``below_reserve`` alert each time the host's memory
truth crosses it (docs/placement-rules.md §4.4, docs/invariants.md "Alerts").

The planner never places past the reserve, but the host can get there on its own: a
llama.cpp server that slept (``--sleep-idle-seconds``) gives its memory back and takes
it again on its next request, another program on a shared machine grows, a re-measure
finds a resident bigger than recorded. The truth checked is the planner's own
(:func:`uapplace.core.planner.host_room`): the room above the reserve is below zero when
the probe reads less free than ``reserved_mib``, or when every resident at its measured
footprint leaves less than the reserve.

The controller calls :meth:`ReserveWatch.check` on every tick with a fresh probe. An alert
is raised on the way down only (a host that stays below is one alert, not one per
tick: each raise is a desktop notification); once the host is back above, the next
crossing raises again. Like every alert it stays until acknowledged. GPU devices are
not checked here: their budget is the sum alone, which the planner never exceeds, and
memory held there by no resident is ``probe_mismatch``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from uapplace.core.alerts import AlertBoard, AlertKind, Severity
from uapplace.core.conflicts import EPSILON_MIB, gpu_shortfall_mib
from uapplace.core.model import DeviceKind, DeviceReading, ProbeSource, Registry, Resident
from uapplace.core.planner import HostRoom, host_room
from uapplace.core.victims import fmt_mib


class ReserveWatch:
    """Which devices are below their reserve now, and the alert on each crossing."""

    def __init__(self, board: AlertBoard) -> None:
        self._board = board
        self._below: frozenset[str] = frozenset()

    @property
    def below(self) -> frozenset[str]:
        """The devices below their reserve at the last check."""
        return self._below

    def check(
        self,
        registry: Registry,
        residents: Sequence[Resident],
        readings: Mapping[str, DeviceReading],
    ) -> frozenset[str]:
        """Raise ``below_reserve`` for the host if it went below its reserve since the
        last check; the devices below now. An unreadable host is left as it was."""
        host = registry.host()
        reading = readings.get(host.key) if host is not None else None
        if host is None or reading is None or not _readable(reading):
            return self._below
        room = host_room(host, reading, residents)
        below = frozenset({host.key}) if room.mib < -EPSILON_MIB else frozenset()
        if below and host.key not in self._below:
            self._board.raise_alert(
                AlertKind.BELOW_RESERVE,
                Severity.WARNING,
                host.key,
                below_reserve_text(room),
                _detail(room, residents),
            )
        self._below = below
        return below


def device_rooms(
    registry: Registry,
    residents: Sequence[Resident],
    readings: Mapping[str, DeviceReading],
) -> dict[str, float]:
    """Per device, the MiB placement may still use above its reserve, as the planner
    counts them (``GetState`` ``devices.<key>.room_mib``): on a GPU ``total − reserved −
    Σ gpu_mib`` of its residents (left out while one is unknown); on the host
    :func:`~uapplace.core.planner.host_room` (left out while unreadable)."""
    rooms: dict[str, float] = {}
    for key, device in registry.devices.items():
        if device.kind is DeviceKind.GPU:
            held = [r.gpu_mib for r in residents if r.device == key]
            if all(mib is not None for mib in held):
                rooms[key] = -gpu_shortfall_mib(device, (mib or 0.0 for mib in held))
            continue
        reading = readings.get(key)
        if reading is not None and _readable(reading):
            rooms[key] = host_room(device, reading, residents).mib
    return rooms


def below_reserve_text(room: HostRoom) -> str:
    """What the alert says: how far below, and which of the two readings says so."""
    host = room.host
    reserve = fmt_mib(host.reserved_mib)
    if room.by_probe <= room.by_footprints:
        why = (
            f"the probe reads {fmt_mib(room.probe_free_mib)} MiB free, "
            f"{fmt_mib(-room.by_probe)} MiB below the {reserve} MiB reserve"
        )
    else:
        why = (
            f"its {room.residents} resident(s) at their measured footprints hold "
            f"{fmt_mib(room.held_mib)} MiB of {fmt_mib(host.total_mib)}, "
            f"{fmt_mib(-room.by_footprints)} MiB into the {reserve} MiB reserve"
        )
    return (
        f"{host.key}: host memory is below its reserve: {why}. Nothing more loads there "
        "until it is back above; an engine that slept gives its memory back only until its "
        "next request (see `uapplace status`)"
    )


def _detail(room: HostRoom, residents: Sequence[Resident]) -> dict[str, object]:
    return {
        "device": room.host.key,
        "free_mib": round(room.probe_free_mib, 3),
        "total_mib": room.host.total_mib,
        "reserved_mib": room.host.reserved_mib,
        "held_mib": round(room.held_mib, 3),
        "room_mib": round(room.mib, 3),
        "residents": {r.signature: r.host_rss_mib for r in residents},
    }


def _readable(reading: DeviceReading) -> bool:
    return reading.source is not ProbeSource.ABSENT and reading.total_mib > 0
