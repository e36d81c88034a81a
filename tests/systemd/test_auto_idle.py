"""Standing consent on a contained systemd --user: auto-load and the idle sweep, for real.

Built on the two-model machine of :mod:`tests.systemd.placement_world` (``alpha``
14000 MiB and ``beta`` 16000 MiB on one simulated 24 GiB GPU, real units running
the fake engine, the real controller, enforcer and unit sync). The auto runner
and the idle sweep are wired to them as the daemon wires them; the policy is the
real file under the test's ``UAP_HOME``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.systemd.conftest import UnitFiles
from tests.systemd.placement_world import FAST, GUARD_S, World, build_world, close_world
from tests.worlds.builders import parked
from uapplace.consent.auto import COOLDOWN_S, AutoRunner, enforcement_envelope_s
from uapplace.consent.idle import IdleSweep
from uapplace.core.admission import new_placement_id
from uapplace.core.model import ParkReason, PendingEntry, Plan, PreviewReason
from uapplace.files.autopolicy import PolicyStore
from uapplace.io.units import UnitManager
from uapplace.sim.gpu import SimGpu

pytestmark = pytest.mark.systemd


@dataclass
class Consent:
    world: World
    store: PolicyStore
    runner: AutoRunner
    sweep: IdleSweep

    def write(self, **knobs: Any) -> None:
        path = self.world.paths.auto_policy
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(knobs), encoding="utf-8")

    async def park_and_schedule(self, model: str, client: str) -> tuple[str, ParkReason | None]:
        """What the controller does for a new park: plan it, then hand it to the runner."""
        entry = await self.world.park(model, client)
        found = Plan(model, PreviewReason.OK, entry.options)
        return entry.id, await self.runner.schedule(entry, found)

    def entry(self, placement_id: str) -> PendingEntry | None:
        return self.world.controller.admission.get(placement_id)

    async def unit_state(self, name: str) -> str:
        return (await self.world.units.state(name)).active_state


def wire(world: World) -> Consent:
    controller = world.controller
    registry = controller.config.registry
    store = PolicyStore(world.paths.auto_policy, registry)
    runner = AutoRunner(
        controller,
        world.enforcer,
        store,
        registry,
        envelope_s=enforcement_envelope_s(FAST),
    )
    store.describe_runs = runner.status
    sweep = IdleSweep(controller, world.enforcer, store, registry)
    return Consent(world, store, runner, sweep)


async def _built(
    tmp_path: Path,
    units: UnitManager,
    unit_files: UnitFiles,
    sim_gpu: SimGpu,
    *,
    start_alpha: bool,
    **options: Any,
) -> AsyncIterator[Consent]:
    world = await build_world(tmp_path, units, unit_files, sim_gpu, **options)
    consent = wire(world)
    try:
        if start_alpha:
            async with asyncio.timeout(GUARD_S):
                await world.start_alpha()
        yield consent
    finally:
        await consent.runner.close()
        await close_world(world)


@pytest.fixture
async def with_alpha(
    tmp_path: Path, units: UnitManager, unit_files: UnitFiles, sim_gpu: SimGpu
) -> AsyncIterator[Consent]:
    async for consent in _built(tmp_path, units, unit_files, sim_gpu, start_alpha=True):
        yield consent


@pytest.fixture
async def failing_beta(
    tmp_path: Path, units: UnitManager, unit_files: UnitFiles, sim_gpu: SimGpu
) -> AsyncIterator[Consent]:
    built = _built(
        tmp_path, units, unit_files, sim_gpu, start_alpha=False, beta_args=["--fail-at-start"]
    )
    async for consent in built:
        yield consent


# --------------------------------------------------------------------------- auto-load


async def test_a_failed_auto_load_marks_auto_failed_and_cools_down(failing_beta: Consent) -> None:
    world = failing_beta.world
    failing_beta.write(enabled=True)
    placement_id, reason = await failing_beta.park_and_schedule("beta", "client-1")
    assert reason is ParkReason.AUTO_LOADING
    async with asyncio.timeout(GUARD_S):
        await failing_beta.runner.wait_idle()

    entry = failing_beta.entry(placement_id)
    assert entry is not None and entry.reason is ParkReason.AUTO_FAILED
    until = world.controller.cooldowns["beta"]
    assert time.time() < until <= time.time() + COOLDOWN_S
    steps = {(step, ok) for _run, step, ok, _detail in world.events.steps}
    assert ("start", True) in steps and ("verify-up", False) in steps
    assert ("rollback-stop", True) in steps
    assert await failing_beta.unit_state(world.beta.name) in ("failed", "inactive")
    assert world.sim.read().allocations == ()
    assert world.resident("beta") is None

    # The cooldown reaches the ledger; a new park in it is not auto-loaded.
    await world.controller.flush()
    ledger = json.loads(world.paths.ledger.read_text(encoding="utf-8"))
    assert "beta" in ledger["cooldowns"]
    second, reason = await failing_beta.park_and_schedule("beta", "client-2")
    assert reason is None
    again = failing_beta.entry(second)
    assert again is not None and again.reason is ParkReason.NOT_RESIDENT


async def test_auto_displaces_only_for_an_allowlisted_model(with_alpha: Consent) -> None:
    world = with_alpha.world
    with_alpha.write(enabled=True)
    waiting, reason = await with_alpha.park_and_schedule("beta", "client-1")
    assert reason is None  # beta only fits by displacing alpha, and nobody consented
    assert world.state_of("alpha") == "hot"

    status = await with_alpha.store.set({"allow_displace": ["beta"]}, True)
    assert status["allow_displace"] == ["beta"]
    placement_id, reason = await with_alpha.park_and_schedule("beta", "client-2")
    assert reason is ParkReason.AUTO_LOADING
    async with asyncio.timeout(GUARD_S):
        await with_alpha.runner.wait_idle()

    assert world.state_of("beta") == "hot" and world.resident("alpha") is None
    assert await with_alpha.unit_state(world.alpha.name) == "inactive"
    assert with_alpha.entry(placement_id) is None and with_alpha.entry(waiting) is None
    assert (placement_id, "applied") in world.events.resolved
    assert "beta" not in world.controller.cooldowns
    assert world.timeline.overlaps() == []


# --------------------------------------------------------------------------- idle unload


async def test_an_idle_allowlisted_resident_is_unloaded(with_alpha: Consent) -> None:
    world = with_alpha.world
    with_alpha.write(unload_idle_after_secs=60, unload_allow=["alpha"])
    now = time.time()
    first = await with_alpha.sweep.tick(now)
    assert first.skipped["alpha"].startswith("used 0 s ago")
    assert world.controller.usage["alpha"] == now

    async with asyncio.timeout(GUARD_S):
        report = await with_alpha.sweep.tick(now + 60)
    assert report.unloaded == ["alpha"], report
    assert world.resident("alpha") is None
    assert await with_alpha.unit_state(world.alpha.name) == "inactive"
    assert world.sim.read().allocations == ()
    assert "alpha" not in world.controller.usage
    steps = [step for _run, step, ok, _detail in world.events.steps if ok]
    assert steps[:5] == ["revalidate", "preflight", "mark-draining", "drain", "stop"]


async def test_no_unload_with_an_open_connection_a_pending_demand_or_no_consent(
    with_alpha: Consent,
) -> None:
    world = with_alpha.world
    controller = world.controller
    with_alpha.write(unload_idle_after_secs=60, unload_allow=[])
    now = time.time()
    await with_alpha.sweep.tick(now)

    # No consent: idle for an hour and still loaded.
    report = await with_alpha.sweep.tick(now + 3600)
    assert report.unloaded == [] and "alpha" not in report.skipped
    with_alpha.write(unload_idle_after_secs=60, unload_allow=["alpha"])
    await with_alpha.sweep.tick(now + 3600)  # first look under consent starts its window
    now += 3600

    # A pending demand for alpha (an entry kept in the ledger, parked for the operator).
    demand = parked(
        "alpha-latest",
        id=new_placement_id(),
        client="client-9",
        created_at=now,
        expires_at=now + 3600,
    )
    controller.admission.restore([demand], now)
    report = await with_alpha.sweep.tick(now + 120)
    assert report.skipped["alpha"] == "a pending request wants it"
    controller.dismiss(demand.id)

    # A client connected straight to the engine's port (past the gate).
    _reader, writer = await asyncio.open_connection("127.0.0.1", world.alpha.port)
    try:
        report = await with_alpha.sweep.tick(now + 240)
        assert report.skipped["alpha"] == f"ESTABLISHED connection on port {world.alpha.port}"
        assert controller.usage["alpha"] == now + 240
    finally:
        writer.close()
        await writer.wait_closed()

    assert world.state_of("alpha") == "hot"
    assert await with_alpha.unit_state(world.alpha.name) == "active"
    assert [s for s in world.events.steps if s[1] == "stop"] == []

    # With every obstacle gone, the next full window unloads it: they were the reason.
    async with asyncio.timeout(GUARD_S):
        report = await with_alpha.sweep.tick(now + 240 + 60)
    assert report.unloaded == ["alpha"], report
    assert await with_alpha.unit_state(world.alpha.name) == "inactive"
