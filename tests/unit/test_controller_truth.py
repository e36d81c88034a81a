"""The controller after a registry reload, and what it shows of the host (issue 19).

- a re-measured config's figures replace the resident's recorded footprint (the ledger
  kept 285.5 MiB after 813.7 MiB was measured);
- pending entries are re-planned on every reload (a park kept "no options" after its
  model was measured), and their reason follows the registry;
- a resident asleep stays ``hot``, is forwarded to and is shown ``asleep``;
- the host below its reserve raises ``below_reserve`` (docs/placement-rules.md §4.4).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from controller_fixtures import registry, registry_paths, tiny_model, tiny_resident

from tests.worlds.polling import until_sync
from uapplace.controller import views
from uapplace.controller.configstate import measured_footprint
from uapplace.controller.controller import Controller
from uapplace.core.alerts import AlertKind
from uapplace.core.model import OptionKind, ParkReason, Resident, ResidentState
from uapplace.files.ledger import LedgerDoc
from uapplace.files.paths import Paths
from uapplace.files.registry import local_measurements

MEASURED_AT = "2026-12-03T10:00:00Z"


def tiny(host_rss_mib: float | None) -> dict[str, Any]:
    """A llama-server on the CPU tier; ``None``: its config is not measured yet."""
    if host_rss_mib is None:
        return tiny_model({"status": "unmeasured"})
    return tiny_model(
        {
            "resident_gpu_mib": 0,
            "host_rss_mib": host_rss_mib,
            "kv_resident_cells": 32768,
            "measured_at": MEASURED_AT,
            "measured_on": "cpu0",
        }
    )


def world(host_rss_mib: float | None, **cpu0: int) -> dict[str, Any]:
    doc = registry({"tiny": tiny(host_rss_mib)})
    doc["devices"]["cpu0"].update(cpu0)
    return doc


def remeasure(paths: Paths, doc: dict[str, Any]) -> None:
    """What ``uapplace measure`` leaves behind: the machine-local figures rewritten."""
    paths.local_registry.write_text(json.dumps(local_measurements(doc)))


def resident(host_rss_mib: float, state: ResidentState = ResidentState.HOT) -> Resident:
    return tiny_resident(host_rss_mib, MEASURED_AT, state=state)


@pytest.fixture
def measured_paths(tmp_path: Path) -> Paths:
    return registry_paths(tmp_path, world(285.5))


async def test_a_re_measured_footprint_replaces_the_recorded_one(measured_paths: Paths) -> None:
    controller = Controller.open(measured_paths)
    controller.upsert_resident(resident(285.5))
    remeasure(measured_paths, world(813.7))
    assert await controller.reload() is True
    (now,) = controller.residents
    assert (now.host_rss_mib, now.gpu_mib, now.state) == (813.7, 0.0, ResidentState.HOT)
    state = await views.state_json(controller)
    assert state["residents"][0]["host_rss_mib"] == 813.7
    await controller.shutdown(wait_s=1)


def test_a_paused_or_unmeasured_resident_keeps_its_figures(measured_paths: Paths) -> None:
    controller = Controller.open(measured_paths)
    registry_now = controller.registry
    paused = replace(resident(0.0, ResidentState.PAUSED), gpu_mib=0.0)
    assert measured_footprint(registry_now, paused) is paused  # what its pause left
    elsewhere = replace(resident(100.0), device="gpu0")  # not where it was measured
    assert measured_footprint(registry_now, elsewhere) is elsewhere
    same = resident(285.5)
    assert measured_footprint(registry_now, same) is same
    draining = resident(10.0, ResidentState.DRAINING)
    assert measured_footprint(registry_now, draining).host_rss_mib == 285.5


def test_a_restored_resident_takes_the_figure_measured_while_the_daemon_was_down(
    measured_paths: Paths,
) -> None:
    controller = Controller.open(measured_paths)
    old = replace(resident(120.0), asleep=True)
    controller.restore(LedgerDoc(updated_at=0.0, residents=[old]))
    (restored,) = controller.residents
    assert (restored.host_rss_mib, restored.state) == (285.5, ResidentState.WARMING)
    assert restored.asleep is False  # a live fact: asked again, never restored


async def test_a_park_is_re_planned_when_the_registry_reloads(tmp_path: Path) -> None:
    unmeasured = world(None)
    paths = registry_paths(tmp_path, unmeasured)
    controller = Controller.open(paths, tick_s=3600)
    controller.start_background()
    try:
        parked = controller.admit("tiny", "client-1", "", 0)
        assert parked.reason == "no_measured_config"

        def entry_now() -> Any:
            return controller.pending_entry(parked.placement_id)

        await controller.background_done()  # the park's planning
        await until_sync("the start-up re-plan", lambda: controller.planning.idle)
        assert entry_now().options == ()  # nothing measured: no options

        remeasure(paths, world(813.7))
        await controller.reload()
        await until_sync("the re-plan after the reload", lambda: entry_now().options)
        (option,) = entry_now().options
        assert (option.kind, option.device, option.host_mib) == (
            OptionKind.LOAD_ALONGSIDE,
            "cpu0",
            813.7,
        )
        # The client's next retry hears what the registry says now.
        assert entry_now().reason is ParkReason.NOT_RESIDENT
        again = controller.admit("tiny", "client-1", "", 0)
        assert (again.placement_id, again.reason) == (parked.placement_id, "not_resident")
    finally:
        await controller.shutdown(wait_s=1)


async def test_an_asleep_resident_is_forwarded_to_and_shown_asleep(measured_paths: Paths) -> None:
    controller = Controller.open(measured_paths)
    controller.upsert_resident(replace(resident(285.5), asleep=True))
    decision = controller.admit("tiny", "client-1", "", 0)
    assert (decision.decision, decision.target_id) == ("forward", "cpu0:http://127.0.0.1:18090")
    state = await views.state_json(controller)
    assert state["residents"][0]["asleep"] is True
    assert state["residents"][0]["state"] == "hot"
    cpu0 = state["devices"]["cpu0"]
    assert cpu0["room_mib"] == pytest.approx(
        min(cpu0["free_mib"] - 1024, 65536 - 1024 - 285.5), abs=1e-3
    )
    controller.upsert_resident(resident(285.5))  # awake: no key at all
    assert "asleep" not in (await views.state_json(controller))["residents"][0]


async def test_the_host_below_its_reserve_is_an_alert(tmp_path: Path) -> None:
    # A reserve larger than the whole host: the probe reads less free than it, always.
    paths = registry_paths(tmp_path, world(285.5, total_mib=1 << 24, reserved_mib=1 << 23))
    controller = Controller.open(paths)
    assert await controller.check_reserve() == {"cpu0"}
    assert await controller.check_reserve() == {"cpu0"}
    (alert,) = controller.alerts.active()
    assert (alert.kind, alert.subject, alert.count) == (AlertKind.BELOW_RESERVE, "cpu0", 1)
    assert "below the 8388608 MiB reserve" in alert.message


async def test_the_tick_checks_the_reserve(tmp_path: Path) -> None:
    paths = registry_paths(tmp_path, world(285.5, total_mib=1 << 24, reserved_mib=1 << 23))
    controller = Controller.open(paths, tick_s=0.01)
    controller.start_background()
    try:
        await until_sync("a below_reserve alert", controller.alerts.active)
        assert controller.alerts.active()[0].kind is AlertKind.BELOW_RESERVE
    finally:
        await controller.shutdown(wait_s=1)
