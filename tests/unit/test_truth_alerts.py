"""Truth surfaced (issue 21 item 7): footprint drift and a broken capacity policy are alerts.

- :class:`~uapplace.controller.drift.DriftWatch` judges a GPU's memory in use (the probe)
  against its residents' measured footprints: beyond ``reserved_mib`` + the tolerance, or
  below minus it, unbroken for the hold time, is one ``footprint_drift`` per crossing;
  a device with a resident mid-change is not judged;
- the controller's tick runs it against the simulated GPU;
- a reload (``validate``, a finished ``measure``) that finds the capacity policy broken
  raises ``config_error`` naming the file, once while open, and the last good policy stays.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from controller_fixtures import registry, registry_paths

from tests.worlds.seed_docs import alpha_model
from uapplace.controller.controller import Controller
from uapplace.controller.drift import DRIFT_HOLD_S, DRIFT_TOLERANCE_MIB, DriftWatch
from uapplace.core.alerts import Alert, AlertBoard, AlertKind
from uapplace.core.model import (
    Device,
    DeviceKind,
    DeviceReading,
    ProbeSource,
    Registry,
    Resident,
    ResidentState,
)
from uapplace.sim.gpu import SimGpu, sim_uuid

RESERVED = 1024.0
GPU = Device("gpu0", DeviceKind.GPU, 24_576, int(RESERVED))
REGISTRY = Registry({"gpu0": GPU}, {})
HOLD_S = 60.0


def resident(gpu_mib: float | None, state: ResidentState = ResidentState.HOT) -> Resident:
    return Resident(
        "alpha", "a1", "gpu0", "llama.cpp", "http://h:1", "u", state, gpu_mib, 100.0, "t"
    )


def reading(used_mib: float) -> DeviceReading:
    return DeviceReading("gpu0", DeviceKind.GPU, 24_576, 24_576 - used_mib, ProbeSource.SIM)


def board() -> tuple[AlertBoard, list[Alert]]:
    raised: list[Alert] = []
    return AlertBoard(lambda: 0.0, raised.append), raised


@pytest.mark.parametrize(
    ("used", "drifts"),
    [
        (10_000 + RESERVED + DRIFT_TOLERANCE_MIB, False),  # at the edge: within
        (10_000 + RESERVED + DRIFT_TOLERANCE_MIB + 1, True),  # grew past it
        (10_000 - DRIFT_TOLERANCE_MIB, False),
        (10_000 - DRIFT_TOLERANCE_MIB - 1, True),  # holds less than measured
    ],
)
def test_drift_beyond_the_reserve_and_tolerance_for_the_hold_is_one_alert(
    used: float, drifts: bool
) -> None:
    alerts, raised = board()
    watch = DriftWatch(alerts, HOLD_S)
    for now in (0.0, HOLD_S - 1):
        watch.check(REGISTRY, [resident(10_000)], {"gpu0": reading(used)}, now)
    assert raised == []  # not for long enough yet
    for now in (HOLD_S, HOLD_S + 5, HOLD_S + 10):
        watch.check(REGISTRY, [resident(10_000)], {"gpu0": reading(used)}, now)
    assert [(a.kind, a.subject) for a in raised] == (
        [(AlertKind.FOOTPRINT_DRIFT, "gpu0")] if drifts else []
    )
    if drifts:
        assert raised[0].detail["unaccounted_mib"] == used - 10_000
        assert "alpha/a1 10000 MiB" in raised[0].message


def test_a_drift_that_ends_and_comes_back_raises_again() -> None:
    alerts, raised = board()
    watch = DriftWatch(alerts, HOLD_S)
    grown = {"gpu0": reading(14_000)}
    watch.check(REGISTRY, [resident(10_000)], grown, 0.0)
    watch.check(REGISTRY, [resident(10_000)], grown, HOLD_S)
    watch.check(REGISTRY, [resident(10_000)], {"gpu0": reading(10_500)}, HOLD_S + 1)
    watch.check(REGISTRY, [resident(10_000)], grown, HOLD_S + 2)
    assert len(raised) == 1  # its clock started again
    watch.check(REGISTRY, [resident(10_000)], grown, 2 * HOLD_S + 2)
    assert [a.count for a in raised] == [1, 2]


@pytest.mark.parametrize(
    "moving", [resident(10_000, ResidentState.WARMING), resident(None)], ids=["warming", "unknown"]
)
def test_a_device_mid_change_or_unknown_is_not_judged(moving: Resident) -> None:
    alerts, raised = board()
    watch = DriftWatch(alerts, HOLD_S)
    for now in (0.0, HOLD_S, 2 * HOLD_S):
        watch.check(REGISTRY, [moving], {"gpu0": reading(20_000)}, now)
    assert raised == []


async def test_the_tick_raises_drift_for_a_resident_grown_past_its_measurement(
    tmp_path: Path,
) -> None:
    """The simulated GPU holds 4,000 MiB more than alpha's measured 8,000 (plus the reserve)."""
    paths = registry_paths(tmp_path, registry({"alpha": alpha_model()}))
    now = [1_800_000_000.0]
    controller = Controller.open(paths, clock=lambda: now[0])
    controller.upsert_resident(replace(resident(8_000), config="alpha-q4"))
    held = 8_000 + 4_000 + RESERVED
    SimGpu(tmp_path / "sim.json").claim(sim_uuid(0), os.getpid(), held)
    await controller.check_reserve()
    assert controller.alerts.active() == []  # drifted, not for long enough yet
    now[0] += DRIFT_HOLD_S
    await controller.check_reserve()
    [alert] = controller.alerts.active()
    assert (alert.kind, alert.subject) == (AlertKind.FOOTPRINT_DRIFT, "gpu0")
    assert (alert.detail["accounted_mib"], alert.detail["used_mib"]) == (8_000, held)
    assert (
        "4000 MiB more than its residents' footprints (alpha/alpha-q4 8000 MiB) and the "
        "1024 MiB reserve account for" in alert.message
    )


async def test_a_reload_with_a_broken_capacity_policy_raises_config_error_once(
    tmp_path: Path,
) -> None:
    paths = registry_paths(tmp_path, registry({"alpha": alpha_model()}))
    controller = Controller.open(paths)
    assert controller.config.state.policy_state == "loaded"
    paths.capacity_policy.write_text("{not json", encoding="utf-8")
    assert await controller.reload()  # the registry is fine; the policy is kept
    assert await controller.reload()
    [alert] = controller.alerts.active()
    assert (alert.kind, alert.subject, alert.count) == (
        AlertKind.CONFIG_ERROR,
        str(paths.capacity_policy),
        1,
    )
    assert alert.message.endswith("; the last good policy stays"), alert.message
    assert controller.config.state.policy_state == "last-good"
    paths.capacity_policy.write_text(json.dumps({"services": []}), encoding="utf-8")
    assert await controller.reload()
    assert controller.config.state.policy_state == "loaded"


async def test_a_reload_with_a_broken_local_registry_raises_config_error(tmp_path: Path) -> None:
    paths = registry_paths(tmp_path, registry({"alpha": alpha_model()}))
    controller = Controller.open(paths)
    paths.local_registry.write_text('{"version": 1, "models": {"alpha": 7}}', encoding="utf-8")
    assert await controller.reload()  # the repo registry is fine: the last good local stays
    [alert] = controller.alerts.active()
    assert (alert.kind, alert.subject) == (AlertKind.CONFIG_ERROR, str(paths.local_registry))
    assert alert.message.endswith("stays in force until it is fixed"), alert.message
