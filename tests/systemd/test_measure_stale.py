"""Stale measurements and re-filing on measure (issue 21 items 3, 4 and 8's measure rows),
against fake engines under real units (docs/placement-rules.md §4.1.1).

- ``measure`` records the digest of the unit's live ``ExecStart`` and the build the
  engine reports; a drop-in that changes the flags, or an engine that reports another
  build, makes the figures unknown: ``validate`` fails naming the field, the planner
  parks the model ``no_measured_config``;
- ``execStartMustContain`` is checked against the unit's live ``ExecStart``, not the
  registry's ``flags``;
- ``measure`` refuses an engine with a request in flight;
- a resident adopted before measurement is re-filed when the measurement lands, and one
  listed on another device than its measurement says raises ``misfiled``.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import time
from typing import Any

import pytest

from tests.systemd.placement_world import GUARD_S, POLICY, World
from uapplace.controller import views
from uapplace.controller.reserve import device_rooms
from uapplace.core.alerts import Alert, AlertKind, Severity
from uapplace.core.staleness import exec_start_digest
from uapplace.io import engines
from uapplace.measure.reading import MeasurementRefused
from uapplace.sim.engine import BUILD_INFO, BUILD_INFO_ENV

pytestmark = pytest.mark.systemd


@pytest.fixture
def world(built_world: World) -> World:
    return built_world


def alpha_errors(report: dict[str, Any]) -> list[dict[str, str]]:
    return [
        f
        for f in report["findings"]
        if f["severity"] == "error" and f["json_path"].startswith("$.models.alpha.configs.a1")
    ]


async def measured_alpha(world: World) -> dict[str, Any]:
    """alpha started and measured through the daemon; the config entry written."""
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
        await world.controller.enforcement.measure("alpha", "a1")
    written: dict[str, Any] = world.local_doc()["models"]["alpha"]["configs"]["a1"]
    return written


async def test_measure_records_the_live_exec_start_and_engine_build(world: World) -> None:
    written = await measured_alpha(world)
    live = (await world.units.state(world.alpha.name)).exec_start
    assert written["exec_start_sha256"] == exec_start_digest(live)
    assert written["measured_build"] == BUILD_INFO
    assert written["flags"] == shlex.split(live)[1:]
    assert alpha_errors(await views.validate(world.controller)) == []
    assert world.controller.registry.models["alpha"].configs["a1"].is_measured


async def test_a_drop_in_that_changes_the_flags_makes_the_measurement_stale(
    world: World,
) -> None:
    await measured_alpha(world)
    async with asyncio.timeout(GUARD_S):
        assert (await world.units.stop_unit(world.alpha.name, GUARD_S)).ok
        await world.events.until(lambda: world.state_of("alpha") is None)
    live = (await world.units.state(world.alpha.name)).exec_start
    changed = live.replace("--load-secs 0.3", "--load-secs 0.5")
    assert changed != live
    dropins = world.unit_files.unit_dir / f"{world.alpha.name}.d"
    dropins.mkdir(exist_ok=True)
    (dropins / "10-flags.conf").write_text(
        f"[Service]\nExecStart=\nExecStart={changed}\n", encoding="utf-8"
    )
    await world.units.reload()

    report = await views.validate(world.controller)
    errors = alpha_errors(report)
    assert [e["json_path"] for e in errors] == ["$.models.alpha.configs.a1.flags"], report
    assert "--load-secs 0.5" in errors[0]["message"] and "stale" in errors[0]["message"]
    assert report["ok"] is False
    # The planner: unknown, never placeable.
    config = world.controller.registry.models["alpha"].configs["a1"]
    assert not config.is_measured and "stale" in config.untrusted
    decision = world.controller.admit("alpha", "client-1", "", 0)
    assert (decision.decision, decision.reason) == ("park", "no_measured_config")
    preview = await views.preview(world.controller, "alpha", 0)
    assert preview["options"] == []
    assert "a1: no measurement counts on this machine: measured at" in json.dumps(preview)


async def test_another_engine_build_makes_the_measurement_stale(world: World) -> None:
    await measured_alpha(world)
    doc = world.local_doc()
    doc["models"]["alpha"]["configs"]["a1"]["measured_build"] = "b0-before-the-upgrade"
    world.paths.local_registry.write_text(json.dumps(doc), encoding="utf-8")

    report = await views.validate(world.controller)
    errors = alpha_errors(report)
    assert [e["json_path"] for e in errors] == ["$.models.alpha.configs.a1.measured_build"]
    assert f"reports {BUILD_INFO!r} now" in errors[0]["message"]
    assert not world.controller.registry.models["alpha"].configs["a1"].is_measured


async def test_exec_start_must_contain_reads_the_live_exec_start(world: World) -> None:
    """The registry's flags claim ``--slots 4``; the unit does not run it."""
    doc = world.local_doc()
    doc["models"]["beta"]["configs"]["b1"]["flags"] = ["--slots", "4"]
    world.paths.local_registry.write_text(json.dumps(doc), encoding="utf-8")
    policy = json.loads(json.dumps(POLICY))
    policy["services"][0]["execStartMustContain"] = ["--slots 4"]
    world.paths.capacity_policy.write_text(json.dumps(policy), encoding="utf-8")

    report = await views.validate(world.controller)
    live = [
        f
        for f in report["findings"]
        if f["json_path"] == "$.services[0].execStartMustContain[0]"
        and "live ExecStart" in f["message"]
    ]
    assert len(live) == 1, report["findings"]
    assert f"{world.beta.name}'s live ExecStart lacks '--slots 4'" in live[0]["message"]
    assert live[0]["severity"] == "error" and report["ok"] is False


async def test_measure_refuses_an_engine_with_a_request_in_flight(world: World) -> None:
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
    world.proxy.set_inflight(world.target_of(world.alpha), "claude-code")
    before = world.paths.local_registry.read_text(encoding="utf-8")
    with pytest.raises(MeasurementRefused, match=r"not idle: 1 request\(s\) in flight"):
        await world.controller.enforcement.measure("alpha", "a1")
    assert world.paths.local_registry.read_text(encoding="utf-8") == before


# --------------------------------------------------------------------------- re-file (item 4)


async def test_a_cpu_engine_adopted_before_measurement_is_refiled_when_measured(
    world: World,
) -> None:
    """Started by hand while unmeasured: adopted on the first GPU (a guess), which makes
    gpu0's budget unknown; its measurement (``measured_on: cpu0``) moves it to cpu0 at
    once, with its measured footprint, and gpu0's budget is known again. No alert."""
    gamma = await world.add_cpu_gamma(["--host-mib", "32"])
    async with asyncio.timeout(GUARD_S):
        assert (await world.units.start_unit(gamma.name, GUARD_S)).ok
        assert await engines.wait_healthy(gamma.endpoint, time.monotonic() + GUARD_S)
        await world.events.until(lambda: world.resident("gamma") is not None)
    adopted = world.resident("gamma")
    assert adopted is not None and adopted.device == "gpu0" and adopted.gpu_mib is None
    assert "gpu0" not in device_rooms(world.controller.registry, world.controller.residents, {})

    async with asyncio.timeout(GUARD_S):
        await world.controller.enforcement.measure("gamma", "c1")
    refiled = world.resident("gamma")
    assert refiled is not None
    assert (refiled.device, refiled.gpu_mib) == ("cpu0", 0.0)
    assert refiled.host_rss_mib is not None and refiled.host_rss_mib >= 32
    assert "gpu0" in device_rooms(world.controller.registry, world.controller.residents, {})
    assert not [a for a in world.controller.alert_board.active() if a.kind == AlertKind.MISFILED]
    async with asyncio.timeout(GUARD_S):
        assert (await world.units.stop_unit(gamma.name, GUARD_S)).ok


async def test_a_resident_listed_on_another_device_than_measured_raises_misfiled(
    world: World,
) -> None:
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
    doc = world.local_doc()
    config = doc["models"]["alpha"]["configs"]["a1"]
    config.update(measured_on="cpu0", resident_gpu_mib=0.0)
    config.pop("measured_device", None)
    world.paths.local_registry.write_text(json.dumps(doc), encoding="utf-8")
    assert await world.controller.reload()

    alpha = world.resident("alpha")
    assert alpha is not None and alpha.device == "gpu0", "figures of its own: never moved"
    misfiled = [a for a in world.controller.alert_board.active() if a.kind == AlertKind.MISFILED]
    assert [a.subject for a in misfiled] == ["alpha/a1"]
    assert "listed on gpu0" in misfiled[0].message and "measured_on cpu0" in misfiled[0].message
    assert await world.controller.reload()
    again = [a for a in world.controller.alert_board.active() if a.kind == AlertKind.MISFILED]
    assert [a.count for a in again] == [1], "raised once while open"


async def test_an_engine_upgraded_and_restarted_by_hand_is_caught_when_it_answers(
    world: World,
) -> None:
    """Issue 21 items 3 and 7: the same ``ExecStart``, a new build (the fake engine's
    ``$UAPPLACE_SIM_BUILD_INFO`` stands for a new binary at the same path); no reload:
    the unit coming back up is what re-reads the launch (uapplace.controller.launchgate)."""
    await measured_alpha(world)
    async with asyncio.timeout(GUARD_S):
        assert (await world.units.stop_unit(world.alpha.name, GUARD_S)).ok
        await world.events.until(lambda: world.state_of("alpha") is None)
    before = (await world.units.state(world.alpha.name)).exec_start
    dropins = world.unit_files.unit_dir / f"{world.alpha.name}.d"
    dropins.mkdir(exist_ok=True)
    (dropins / "10-upgrade.conf").write_text(
        f"[Service]\nEnvironment={BUILD_INFO_ENV}=b1-upgraded\n", encoding="utf-8"
    )
    await world.units.reload()
    assert (await world.units.state(world.alpha.name)).exec_start == before

    def stale() -> list[Alert]:
        return [
            a
            for a in world.controller.alert_board.active()
            if a.kind == AlertKind.STALE_MEASUREMENT and a.severity == Severity.WARNING
        ]

    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()  # by hand: the unit sync publishes it once it answers
        await world.events.until(lambda: bool(stale()))
    (alert,) = stale()
    assert alert.subject == "alpha/a1" and "'b1-upgraded'" in alert.message
    assert alert.detail["field"] == "measured_build"
    config = world.controller.registry.models["alpha"].configs["a1"]
    assert not config.is_measured and "stale" in config.untrusted
    decision = world.controller.admit("alpha", "client-2", "", 0)
    assert decision.decision == "forward", "a resident stays served; only its figures are unknown"
    async with asyncio.timeout(GUARD_S):
        assert (await world.units.stop_unit(world.alpha.name, GUARD_S)).ok
