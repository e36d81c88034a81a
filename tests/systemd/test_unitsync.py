"""Residents follow the units (``UnitSync``), including units started or stopped by hand."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace

import pytest

from tests.systemd.placement_world import GUARD_S, World
from uapplace.core.model import ResidentState
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.systemd


@pytest.fixture
def world(built_world: World) -> World:
    """The tier's placement machine, nothing started (conftest)."""
    return built_world


async def systemctl(user_manager: ContainedUserManager, *args: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "systemctl", "--user", *args, env=user_manager.client_env()
    )
    assert await proc.wait() == 0


async def test_a_unit_started_and_stopped_by_hand_becomes_and_stops_being_a_resident(
    world: World, user_manager: ContainedUserManager
) -> None:
    assert world.controller.residents == []

    await systemctl(user_manager, "start", world.alpha.name)
    await world.events.until(lambda: world.state_of("alpha") == "hot")

    changes = [row for row in world.events.resident_changes if row[0] == "alpha"]
    assert changes[0] == ("alpha", "a1", "gpu0", "warming")
    assert changes[-1] == ("alpha", "a1", "gpu0", "hot")
    resident = world.resident("alpha")
    assert resident is not None
    assert resident.main_pid == (await world.units.state(world.alpha.name)).main_pid
    assert resident.unit == world.alpha.name
    forwarded = world.controller.admit("alpha-latest", "client", "", 0)
    assert (forwarded.decision, forwarded.target_id) == ("forward", resident.target_id)

    await systemctl(user_manager, "stop", world.alpha.name)
    await world.events.until(lambda: world.resident("alpha") is None)

    assert world.events.resident_changes[-1] == ("alpha", "a1", "gpu0", "gone")
    assert world.controller.admit("alpha", "client", "", 0).decision == "park"


async def test_a_unit_that_fails_is_gone_from_the_residents(world: World) -> None:
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
    pid = (await world.units.state(world.alpha.name)).main_pid

    os.kill(pid, signal.SIGKILL)  # the engine crashes: the unit goes failed
    await world.events.until(lambda: world.resident("alpha") is None)

    assert (await world.units.state(world.alpha.name)).active_state == "failed"
    assert world.events.states_of("alpha")[-1] == "gone"


async def test_a_full_sync_adopts_running_units_and_drops_stale_residents(world: World) -> None:
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
    alpha = world.resident("alpha")
    assert alpha is not None
    # What a restarted daemon may find: the ledger forgot alpha and still lists beta,
    # whose unit is not running.
    world.controller.drop_resident("alpha", "a1", "gpu0")
    stale_beta = replace(
        alpha,
        model="beta",
        config="b1",
        endpoint=world.beta.endpoint,
        unit=world.beta.name,
        state=ResidentState.HOT,
        gpu_mib=16000,
        main_pid=None,
    )
    world.controller.upsert_resident(stale_beta)

    await world.sync.sync_all()
    await world.events.until(lambda: world.state_of("alpha") == "hot")

    assert world.resident("beta") is None
    assert world.events.states_of("beta")[-1] == "gone"
    assert [r.model for r in world.controller.residents] == ["alpha"]
