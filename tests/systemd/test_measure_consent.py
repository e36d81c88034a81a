"""Measuring is a switch (issue 21, item 1): ``measure --envelope`` under consent.

On real units under the contained user manager, wired as the daemon wires it:

- a model pinned by a bus ``Hold`` is refused ``Busy`` and never stopped;
- a model with a request in flight is drained first (admission parks new requests for
  it, the unit keeps running) and measured once the request ended; a request that
  outlasts the drain bound makes the measurement refuse with nothing stopped;
- a signature other than ``PreviewUnload``'s is ``Drifted``;
- the run is journaled as a ``measure`` run before the first stop, and a crash mid-way
  is repaired at start-up by starting the model again (:mod:`uapplace.recovery.repair`).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.systemd.placement_world import GUARD_S, World, step
from uapplace.core.errors import Busy, Drifted
from uapplace.core.steps import STOP
from uapplace.enforce.host import ControllerRecoveryHost
from uapplace.files.journal import Journal, RunRecord
from uapplace.recovery.recover import recover

pytestmark = pytest.mark.systemd

ALPHA = ["alpha/a1"]


@pytest.fixture
def world(built_world: World) -> World:
    return built_world


async def main_pid(world: World) -> int:
    return (await world.units.state(world.alpha.name)).main_pid


async def test_a_held_model_is_refused_and_never_stopped(world: World) -> None:
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
        before = await main_pid(world)
        await world.controller.hold("alpha", "an agent is mid-task", "test-agent", ":1.7")
        with pytest.raises(Busy, match=r"alpha is held on the bus by test-agent"):
            await world.controller.enforcement.measure("alpha", "a1", envelope=True, expected=ALPHA)
    assert await main_pid(world) == before, "a held model is never taken down"
    assert world.state_of("alpha") == "hot"
    assert not world.paths.enforcement_journal.exists()


async def test_another_signature_is_drifted_and_nothing_stops(world: World) -> None:
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
        before = await main_pid(world)
        with pytest.raises(Drifted):
            await world.controller.enforcement.measure("alpha", "a1", envelope=True, expected=[])
    assert await main_pid(world) == before
    assert world.state_of("alpha") == "hot"


async def test_in_flight_work_is_drained_before_the_stop_and_the_run_is_journaled(
    world: World,
) -> None:
    target = world.target_of(world.alpha)
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
    before = await main_pid(world)
    world.proxy.set_inflight(target, "claude-code")
    run = asyncio.create_task(
        world.controller.enforcement.measure("alpha", "a1", envelope=True, expected=ALPHA)
    )
    try:
        async with asyncio.timeout(GUARD_S):
            await world.events.until(lambda: world.state_of("alpha") == "draining")
            calls = world.proxy.inflight_calls
            await world.events.until(lambda: world.proxy.inflight_calls > calls + 1)
        # Mid-drain: the engine still runs (nothing cut off), new requests park.
        assert await main_pid(world) == before
        assert world.controller.admit("alpha", "other", "", 0).decision == "park"
        world.proxy.set_inflight(target)  # the request finished
        journal = world.paths.enforcement_journal
        async with asyncio.timeout(GUARD_S):
            await world.events.until(journal.exists)
        record = json.loads(journal.read_text(encoding="utf-8"))
        assert (record["kind"], record["step"]) == ("measure", STOP)
        assert [v["model"] for v in record["victims"]] == ["alpha"]
        async with asyncio.timeout(GUARD_S):
            result = await run
    finally:
        run.cancel()
    assert step(result, "drain")["ok"] is True
    assert "waited for: gpu0:" in step(result, "drain")["detail"]
    assert "claude-code" in step(result, "drain")["detail"]
    assert result["envelope"]["cold_start_s"] > 0
    assert not world.paths.enforcement_journal.exists(), "cleared when the run ended"
    async with asyncio.timeout(GUARD_S):
        await world.events.until(lambda: world.state_of("alpha") == "hot")


async def test_work_that_outlasts_the_drain_bound_refuses_with_nothing_stopped(
    world: World,
) -> None:
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
    before = await main_pid(world)
    world.proxy.set_inflight(world.target_of(world.alpha), "claude-code")
    async with asyncio.timeout(GUARD_S):
        with pytest.raises(Busy, match=r"still busy after .*claude-code.*nothing was cut off"):
            await world.controller.enforcement.measure("alpha", "a1", envelope=True, expected=ALPHA)
    assert await main_pid(world) == before, "the engine was never stopped"
    assert (await world.units.state(world.alpha.name)).active_state == "active"
    async with asyncio.timeout(GUARD_S):
        await world.events.until(lambda: world.state_of("alpha") == "hot")
    assert not world.paths.enforcement_journal.exists()


async def test_a_measure_run_cut_short_is_repaired_by_starting_the_model_again(
    world: World,
) -> None:
    """A crash between two stops of the envelope: the journal says ``measure``, the unit
    is down; the start-up repair starts it, verifies it and publishes it hot (never
    finishing the run as an unload, which would leave the model down)."""
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
    alpha = world.resident("alpha")
    assert alpha is not None
    journal = Journal(world.paths.enforcement_journal)
    now = time.time()
    await journal.record(
        RunRecord(
            run_id="run-cut",
            kind="measure",
            requested="alpha",
            device=alpha.device,
            placement_id=None,
            victims=(alpha,),
            new=None,
            accepted_ids=("alpha",),
            step=STOP,
            started_at=now,
            updated_at=now,
            stopped_units=(world.alpha.name,),
        )
    )
    async with asyncio.timeout(GUARD_S):
        assert (await world.units.stop_unit(world.alpha.name, GUARD_S)).ok
        await world.events.until(lambda: world.state_of("alpha") is None)
        report = await recover(
            journal,
            ControllerRecoveryHost(world.controller),
            world.units,
            timeouts=world.enforcer.timeouts,
        )
    assert report is not None and report.outcome.value == "rolled_back", report
    assert any(f"restarted {world.alpha.name}" in a for a in report.actions), report
    assert (await world.units.state(world.alpha.name)).active_state == "active"
    assert world.state_of("alpha") == "hot"
    assert not world.paths.enforcement_journal.exists()
