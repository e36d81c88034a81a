"""Forward leases (issue 20; docs/placement-rules.md §4.6, "Forward leases").

A request ``Admit`` answered ``forward`` is in the proxy's in-flight list only once the
proxy sends it. Here the proxy "sends" it ``SEND_DELAY_S`` after the answer and the request
runs ``REQUEST_S``: the drain must see it. Without the lease the first look finds the list
empty and the victim stops under the request (what the issue saw: drain passed in 0.01 s).
The controller side: each ``forward`` answer leaves the lease on its target.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest
from controller_fixtures import alpha_resident, registry, registry_paths
from enforce_fakes import FAST, Scene, detail, resident, swap_registry

from tests.worlds.seed_docs import alpha_model
from uapplace.controller.controller import Controller
from uapplace.controller.leases import ForwardLeases
from uapplace.core.model import Holder, Resident
from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.timeouts import MAX_LEASE_S, Timeouts

LEASE_S = 1.0
SEND_DELAY_S = 0.05
REQUEST_S = 0.3


class LateProxy:
    """A proxy that lists a forwarded request only ``SEND_DELAY_S`` after the answer, until
    it ends ``REQUEST_S`` later; records when the victim's unit stopped."""

    def __init__(self, scene: Scene, target_id: str) -> None:
        self.answered = time.monotonic()
        self.target_id = target_id
        scene.host.forward_age = self.age  # type: ignore[method-assign]
        scene.host.on_inflight = self.update
        self.scene = scene

    def age(self, target_id: str) -> float | None:
        return time.monotonic() - self.answered if target_id == self.target_id else None

    def update(self) -> None:
        since = time.monotonic() - self.answered
        listed = SEND_DELAY_S <= since < SEND_DELAY_S + REQUEST_S
        holder = Holder(client="late-client", kind="inflight")
        self.scene.host.in_flight = {self.target_id: [holder]} if listed else {}


def scene_with(tmp_path: Path, lease_s: float) -> tuple[Scene, Resident]:
    alpha = resident("alpha", "a1")
    scene = Scene(tmp_path, swap_registry(), [alpha])
    timeouts = replace(FAST, drain_s=2.0, forward_lease_s=lease_s)
    scene.enforcer.use_timeouts(timeouts)
    return scene, alpha


async def test_a_forward_answered_just_before_apply_is_waited_for(tmp_path: Path) -> None:
    scene, alpha = scene_with(tmp_path, LEASE_S)
    entry = scene.park("beta")
    proxy = LateProxy(scene, alpha.target_id)

    result = await scene.enforcer.apply(entry, 1, ["alpha/a1"])
    stopped_after = time.monotonic() - proxy.answered

    assert result["ok"] is True, result
    drained = detail(result, "drain")
    waited_for = drained.split("waited for: ", 1)[1].split("; asked: ", 1)[0]
    assert f"{alpha.target_id}: forward lease" in waited_for, drained
    assert f"lease {LEASE_S:g}s" in drained
    # The request the proxy listed only after the first look ended before the stop.
    assert stopped_after >= SEND_DELAY_S + REQUEST_S, stopped_after
    assert scene.units.jobs == ["stop alpha.service", "start beta.service"]
    scene.assert_ended_cleanly()


async def test_without_a_recent_forward_the_drain_does_not_wait(tmp_path: Path) -> None:
    scene, alpha = scene_with(tmp_path, LEASE_S)
    scene.host.forwarded = {alpha.target_id: LEASE_S + 1.0}
    entry = scene.park("beta")

    result = await scene.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["ok"] is True, result
    drained = detail(result, "drain")
    assert "forward lease" not in drained and "waited for" not in drained, drained
    assert float(drained.split("(waited ", 1)[1].split("s;", 1)[0]) < LEASE_S, drained


async def test_a_lease_that_outlives_the_drain_bound_rolls_back_naming_it(
    tmp_path: Path,
) -> None:
    scene, alpha = scene_with(tmp_path, 5.0)
    scene.enforcer.use_timeouts(replace(scene.enforcer.timeouts, drain_s=0.05))
    scene.host.forwarded = {alpha.target_id: 0.0}
    entry = scene.park("beta")

    result = await scene.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["ok"] is False
    assert "forward lease" in detail(result, "drain")
    assert scene.units.jobs == []
    assert scene.host.states() == {"alpha/a1": "hot"}


def test_the_lease_is_a_bounded_timeout_with_a_default(tmp_path: Path) -> None:
    assert Timeouts().forward_lease_s == 0.3
    path = tmp_path / "enforcement-timeouts.json"
    path.write_text('{"forward_lease_s": 1.5}', encoding="utf-8")
    assert Timeouts.load(path).forward_lease_s == 1.5
    path.write_text(f'{{"forward_lease_s": {MAX_LEASE_S + 1}}}', encoding="utf-8")
    with pytest.raises(ConfigFileError, match=r"\$\.forward_lease_s"):
        Timeouts.load(path)


async def test_each_forward_answer_leaves_a_lease_on_its_target(tmp_path: Path) -> None:
    paths = registry_paths(tmp_path, registry({"alpha": alpha_model(rails=1)}))
    controller = Controller.open(paths)
    served = alpha_resident()
    assert controller.forward_age(served.target_id) is None
    controller.upsert_resident(served)

    decision = controller.admit("alpha", "c1", "", 0)

    assert (decision.decision, decision.target_id) == ("forward", served.target_id)
    age = controller.forward_age(served.target_id)
    assert age is not None and 0.0 <= age < 1.0
    await asyncio.sleep(0)
    await controller.background_done()


def test_forward_leases_age_from_their_last_grant() -> None:
    now = [100.0]
    leases = ForwardLeases(lambda: now[0])
    leases.granted("gpu0:a")
    now[0] = 100.25
    assert leases.age("gpu0:a") == 0.25
    leases.granted("gpu0:a")
    assert leases.age("gpu0:a") == 0.0
    assert leases.age("gpu0:b") is None
