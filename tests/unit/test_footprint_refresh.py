"""A resident takes the footprint its config's measurement records after a reload
(:func:`uapplace.controller.configstate.measured_footprint`, issue 19): the re-measured
figure, never the old one; and a resident adopted before it was measured, on a guessed
device, moves to the device its measurement was taken on."""

from __future__ import annotations

from dataclasses import replace

from uapplace.controller.configstate import measured_footprint
from uapplace.core.model import (
    Config,
    ConfigStatus,
    Device,
    DeviceKind,
    Model,
    Registry,
    Resident,
    ResidentState,
)

DEVICES = {
    "gpu0": Device("gpu0", DeviceKind.GPU, 24576, 0),
    "cpu0": Device("cpu0", DeviceKind.CPU, 65536, 256),
}


def registry(measured_on: str, host_rss_mib: float) -> Registry:
    config = Config(
        "c1",
        ConfigStatus.MEASURED,
        resident_gpu_mib=0.0,
        host_rss_mib=host_rss_mib,
        kv_resident_cells=512,
        measured_at="2026-12-03T10:00:00Z",
        measured_on=measured_on,
        provenance="local",
    )
    model = Model("tiny", "Tiny", "llama.cpp", {"c1": config}, unit="uap-tiny")
    return Registry(DEVICES, {"tiny": model})


def resident(device: str, host_rss_mib: float | None, gpu_mib: float | None) -> Resident:
    return Resident(
        model="tiny",
        config="c1",
        device=device,
        engine="llama.cpp",
        endpoint="http://127.0.0.1:8080",
        unit="uap-tiny.service",
        state=ResidentState.HOT,
        gpu_mib=gpu_mib,
        host_rss_mib=host_rss_mib,
        since="2026-12-03T10:00:00Z",
    )


def test_a_re_measured_figure_replaces_the_old_one() -> None:
    refreshed = measured_footprint(registry("cpu0", 813.7), resident("cpu0", 285.5, 0.0))
    assert (refreshed.device, refreshed.host_rss_mib, refreshed.gpu_mib) == ("cpu0", 813.7, 0.0)


def test_an_unchanged_resident_is_returned_as_it_is() -> None:
    same = resident("cpu0", 16.1, 0.0)
    assert measured_footprint(registry("cpu0", 16.1), same) is same


def test_a_resident_adopted_unmeasured_moves_to_the_measured_device() -> None:
    guessed = resident("gpu0", None, None)  # the unit sync's guess: the first GPU
    moved = measured_footprint(registry("cpu0", 16.1), guessed)
    assert (moved.device, moved.host_rss_mib, moved.gpu_mib) == ("cpu0", 16.1, 0.0)
    assert moved.target_id == "cpu0:http://127.0.0.1:8080"


def test_a_placed_resident_never_moves_to_another_device() -> None:
    """A resident with figures was placed on its device; a measurement elsewhere is not its."""
    placed = resident("gpu0", 20.0, 300.0)
    assert measured_footprint(registry("cpu0", 16.1), placed) is placed


def test_a_paused_resident_keeps_what_its_pause_left() -> None:
    paused = replace(resident("cpu0", 2.0, 0.0), state=ResidentState.PAUSED)
    assert measured_footprint(registry("cpu0", 16.1), paused) is paused
