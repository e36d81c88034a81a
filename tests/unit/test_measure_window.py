"""The window ``measure --envelope`` runs in (issue 21 item 1; uapplace.enforce.measuring),
over the enforcement fakes: a router unit shared with another resident is refused, a
clean window is journaled as a ``measure`` run and leaves no mark or journal behind.
The systemd tier (held, in flight, drift, crash): ``tests/systemd/test_measure_consent.py``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from enforce_fakes import GPU, HOST, Scene, llama, resident

from tests.worlds import builders
from uapplace.core.errors import Busy
from uapplace.core.model import ROUTER_LEVER, Registry, Resident
from uapplace.enforce.measuring import EnvelopeWindow

ROUTER = "http://127.0.0.1:8999"


def router_scene(tmp_path: Path, residents: tuple[str, ...]) -> Scene:
    """``chat`` and ``code``: two models of one llama.cpp router unit on the host."""
    models = {
        key: replace(
            llama(key, builders.measured("c1", 0.0, 900.0, on="cpu0", pause_lever=ROUTER_LEVER)),
            unit="router",
            endpoint=ROUTER,
        )
        for key in ("chat", "code")
    }
    registry = Registry({GPU.key: GPU, HOST.key: HOST}, models)
    running = [routed(key) for key in residents]
    scene = Scene(tmp_path, registry, running)
    scene.engines.unit_of[ROUTER] = "router.service"
    scene.units.already_running("router.service")
    return scene


def routed(model: str) -> Resident:
    one = resident(model, "c1", device="cpu0", gpu_mib=0.0, host_rss_mib=900.0)
    return replace(one, unit="router.service", endpoint=ROUTER)


async def test_a_router_unit_serving_another_resident_is_refused(tmp_path: Path) -> None:
    scene = router_scene(tmp_path, ("chat", "code"))
    window = EnvelopeWindow(scene.enforcer)
    with pytest.raises(Busy, match=r"would also stop code/c1 \(router\.service\)"):
        async with window.open("chat", ["chat/c1"]):
            raise AssertionError("the window must not open")
    assert scene.units.state_now("router.service").active_state == "active"
    scene.assert_ended_cleanly()
    assert scene.enforcer.running is None


async def test_a_clean_window_is_journaled_as_a_measure_run_and_cleared(tmp_path: Path) -> None:
    scene = router_scene(tmp_path, ("chat",))
    async with EnvelopeWindow(scene.enforcer).open("chat", ["chat/c1"]) as steps:
        record = scene.journal.read()
        assert record is not None
        assert (record.kind, record.step, [v.model for v in record.victims]) == (
            "measure",
            "stop",
            ["chat"],
        )
        assert [s["name"] for s in steps] == ["revalidate", "mark-draining", "drain"]
        assert scene.enforcer.running == "measure --envelope chat"
    scene.assert_ended_cleanly()
