"""Executable pause on a contained systemd --user (issue 12): the fake engine's vLLM sleep
API against the simulated GPU, driven by the real controller's enforcement.

The machine of :mod:`tests.systemd.placement_world`: ``alpha`` (14,000 MiB) resident,
``beta`` (16,000 MiB) needing its place on one 24 GiB card. Both engines run with
``--sleep-mode`` and both configs declare ``pause_lever: vllm-sleep-1``, so every
displacement comes in two forms (pause, stop) and the consent names which.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.systemd.conftest import UnitFiles
from tests.systemd.placement_world import (
    ALPHA_MIB,
    BETA_MIB,
    FAST,
    GUARD_S,
    World,
    build_world,
    close_world,
    declare_pause_lever,
)
from uapplace.consent.auto import AutoRunner, enforcement_envelope_s
from uapplace.consent.idle import IdleSweep
from uapplace.core.model import OptionKind, ParkReason, PendingEntry, Plan, PreviewReason
from uapplace.files.autopolicy import PolicyStore
from uapplace.io import engines
from uapplace.io.units import UnitManager
from uapplace.publish import verify
from uapplace.sim.gpu import SimGpu

pytestmark = pytest.mark.systemd

ALPHA_PAUSED = ["alpha/a1@pause"]
BETA_PAUSED = ["beta/b1@pause"]
BETA_STOPPED = ["beta/b1"]


def declare_levers(world: World, lever: str = "vllm-sleep-1") -> None:
    """Both configs declare the lever, in the repo file and the machine-local one."""
    for path in (world.paths.repo_registry, world.paths.local_registry):
        doc = json.loads(path.read_text(encoding="utf-8"))
        declare_pause_lever(doc, lever)
        path.write_text(json.dumps(doc), encoding="utf-8")


async def sleeping_world(
    tmp_path: Path,
    units: UnitManager,
    unit_files: UnitFiles,
    sim: SimGpu,
    alpha_args: Sequence[str] = (),
    lever: str = "vllm-sleep-1",
) -> World:
    world = await build_world(
        tmp_path,
        units,
        unit_files,
        sim,
        alpha_args=["--sleep-mode", *alpha_args],
        beta_args=["--sleep-mode"],
    )
    try:
        declare_levers(world, lever)
        assert await world.controller.reload()
        async with asyncio.timeout(GUARD_S):
            await world.start_alpha()
    except BaseException:
        await close_world(world)
        raise
    return world


@pytest.fixture
async def world(
    tmp_path: Path, units: UnitManager, unit_files: UnitFiles, sim_gpu: SimGpu
) -> AsyncIterator[World]:
    built = await sleeping_world(tmp_path, units, unit_files, sim_gpu)
    try:
        yield built
    finally:
        await close_world(built)


@pytest.fixture
async def failing_wake_world(
    tmp_path: Path, units: UnitManager, unit_files: UnitFiles, sim_gpu: SimGpu
) -> AsyncIterator[World]:
    # Level 2 (weights discarded): pausing beta as well must fit the host's RAM, which a
    # level-1 copy of both engines' weights (14,000 + 16,000 MiB) does not.
    built = await sleeping_world(
        tmp_path, units, unit_files, sim_gpu, ["--fail-wake"], lever="vllm-sleep-2"
    )
    try:
        yield built
    finally:
        await close_world(built)


def allocations(world: World) -> list[float]:
    return sorted(a.used_mib for a in world.sim.read().allocations)


def forms(entry: PendingEntry) -> list[tuple[str, tuple[str, ...]]]:
    return [(o.kind.value, o.signature) for o in entry.options]


def step_names(result: dict[str, Any]) -> list[str]:
    return [step["name"] for step in result["steps"]]


async def active(world: World, unit: str) -> str:
    return (await world.units.state(unit)).active_state


async def pause_alpha_for_beta(world: World) -> None:
    entry = await world.park("beta")
    assert forms(entry) == [("displace", tuple(ALPHA_PAUSED)), ("displace", ("alpha/a1",))]
    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.apply(entry.id, 1, ALPHA_PAUSED)
    assert result["ok"] is True, result
    assert "pause" in step_names(result) and "start" in step_names(result)


async def test_pause_frees_the_vram_and_a_later_request_wakes_alpha(world: World) -> None:
    await pause_alpha_for_beta(world)

    # Alpha's engine is asleep, its unit still active, its memory back on the card.
    assert await active(world, world.alpha.name) == "active"
    assert await engines.is_sleeping(world.alpha.endpoint) is True
    assert allocations(world) == [BETA_MIB]
    alpha = world.resident("alpha")
    assert alpha is not None and alpha.state.value == "paused" and alpha.gpu_mib == 0
    assert world.state_of("beta") == "hot"
    assert "paused" in world.events.states_of("alpha")
    # The one publication check refuses a sleeping engine (it still answers /health 200).
    alpha_model = world.controller.registry.models["alpha"]
    expect = verify.expectation(alpha_model, alpha_model.configs["a1"])
    verdict = await verify.check(world.alpha.endpoint, expect, 2.0)
    assert not verdict.ok and "asleep" in verdict.detail, verdict
    # A paused resident is not forwarded to: the request parks with a wake option,
    # which needs room, so beta must go. Only stopped: pausing beta too would park its
    # 16,000 MiB of weights in host RAM beside alpha's 14,000 (level 1), more than the
    # host holds once residents count at their measured footprints.
    entry = await world.park("alpha")
    assert [o.kind for o in entry.options] == [OptionKind.WAKE]
    assert forms(entry) == [("wake", tuple(BETA_STOPPED))]
    plan = await world.controller.plan_for("alpha", 1000)
    assert any("host RAM" in why and "short" in why for why in plan.infeasible), plan

    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.apply(entry.id, 1, BETA_STOPPED)

    assert result["ok"] is True, result
    names = step_names(result)
    assert "wake" in names and "start" not in names and "pause" not in names
    assert await active(world, world.beta.name) == "inactive"
    assert await engines.is_sleeping(world.alpha.endpoint) is False
    assert allocations(world) == [ALPHA_MIB]
    assert world.state_of("alpha") == "hot" and world.resident("beta") is None
    forwarded = world.controller.admit("alpha", "client-1", "", 0)
    assert forwarded.decision == "forward", forwarded
    # Both units were active together while alpha slept (that is what a pause is); the
    # card never held both engines' memory: the simulated GPU refuses a claim past it.


async def test_consent_names_the_action(world: World) -> None:
    entry = await world.park("beta")
    # Approving the stop never runs the pause form, and the other way round: the run
    # that executes is the form whose signature was approved.
    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.apply(entry.id, 2, ["alpha/a1"])
    assert result["ok"] is True, result
    assert "pause" not in step_names(result)
    assert await active(world, world.alpha.name) == "inactive"
    assert world.resident("alpha") is None


async def test_a_failing_wake_rolls_back_and_beta_serves_again(
    failing_wake_world: World,
) -> None:
    world = failing_wake_world
    await pause_alpha_for_beta(world)
    entry = await world.park("alpha")
    assert forms(entry)[0] == ("wake", tuple(BETA_PAUSED))

    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.apply(entry.id, 1, BETA_PAUSED)

    assert result["ok"] is False and result["rolledBack"] is True, result
    names = step_names(result)
    assert names[names.index("pause") :][:4] == ["pause", "stop", "verify-free", "wake"]
    assert "rollback-sleep" in names and "rollback-wake" in names
    assert all(s["ok"] for s in result["steps"] if s["name"].startswith("rollback")), result
    # Beta was paused for the wake and woken again; alpha stays paused, as before.
    assert await engines.is_sleeping(world.beta.endpoint) is False
    assert await engines.is_sleeping(world.alpha.endpoint) is True
    assert allocations(world) == [BETA_MIB]
    assert world.state_of("beta") == "hot" and world.state_of("alpha") == "paused"
    assert world.controller.admit("beta", "client-1", "", 0).decision == "forward"
    assert world.enforcer.marks.draining == frozenset()


# --------------------------------------------------------------------------- the paused lifecycle


def wire_consent(world: World, **policy: Any) -> tuple[AutoRunner, IdleSweep]:
    """The auto runner and the idle sweep over the world's controller, as ``wiring`` builds
    them, under the auto policy ``policy``."""
    path = world.paths.auto_policy
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(policy), encoding="utf-8")
    registry = world.controller.config.registry
    store = PolicyStore(path, registry)
    runner = AutoRunner(
        world.controller, world.enforcer, store, registry, envelope_s=enforcement_envelope_s(FAST)
    )
    return runner, IdleSweep(world.controller, world.enforcer, store, registry)


async def test_a_paused_model_parks_paused_and_auto_wakes_it_when_that_stops_nobody(
    world: World,
) -> None:
    """Issue 21 item 6: the park says ``paused``; once beta is gone the wake stops nobody,
    so auto takes it with no ``allow_displace``."""
    await pause_alpha_for_beta(world)
    parked = world.controller.admit("alpha", "client-2", "", 0)
    assert (parked.decision, parked.reason) == ("park", "paused")
    async with asyncio.timeout(GUARD_S):
        unloaded = await world.controller.enforcement.unload("beta", BETA_STOPPED)
    assert unloaded["ok"] is True, unloaded

    runner, _ = wire_consent(world, enabled=True)
    entry = await world.park("alpha", "client-3")
    assert entry.reason is ParkReason.PAUSED
    assert forms(entry) == [("wake", ())]
    scheduled = await runner.schedule(entry, Plan("alpha", PreviewReason.OK, entry.options))
    assert scheduled is ParkReason.AUTO_LOADING
    async with asyncio.timeout(GUARD_S):
        await runner.wait_idle()
    assert world.state_of("alpha") == "hot"
    assert await engines.is_sleeping(world.alpha.endpoint) is False
    assert world.controller.admit("alpha", "client-3", "", 0).decision == "forward"


async def test_the_idle_sweep_unloads_a_paused_resident_it_may(world: World) -> None:
    """Issue 21 item 6: a paused resident holds host RAM; the sweep unloads it past its
    window under ``unload_allow``, and leaves it alone without consent."""
    await pause_alpha_for_beta(world)
    _, refused = wire_consent(world, unload_idle_after_secs=60, unload_allow=["beta-other"])
    now = time.time()
    await refused.tick(now)
    report = await refused.tick(now + 120)
    assert report.unloaded == [] and world.state_of("alpha") == "paused"

    _, sweep = wire_consent(world, unload_idle_after_secs=60, unload_allow=["alpha"])
    await sweep.tick(now + 200)
    async with asyncio.timeout(GUARD_S):
        report = await sweep.tick(now + 400)
    assert report.unloaded == ["alpha"], report
    assert await active(world, world.alpha.name) == "inactive"
    assert world.resident("alpha") is None and world.state_of("beta") == "hot"
    assert allocations(world) == [BETA_MIB]
