"""``measure`` against a running fake engine under a real unit (docs/placement-rules.md §4.1.1)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from tests.systemd.placement_world import ALPHA_MIB, GUARD_S, World
from uapplace.files.registry import load_registry
from uapplace.io.units import UnitManager
from uapplace.measure.measurer import Measurer
from uapplace.measure.reading import MeasurementRefused
from uapplace.sim.gpu import sim_uuid

pytestmark = pytest.mark.systemd


@pytest.fixture
def world(built_world: World) -> World:
    """The tier's placement machine, nothing started (conftest; ``world_options`` shapes it)."""
    return built_world


def local_text(world: World) -> str:
    """The machine-local registry as it is (the world writes its own measurements there)."""
    return world.paths.local_registry.read_text(encoding="utf-8")


def measurer(world: World, floor_mib: float = 64.0) -> Measurer:
    return Measurer(
        world.paths,
        world.host,
        world.units,
        floor_mib=floor_mib,
        after_write=world.controller.reload,
    )


async def test_measure_writes_the_local_registry_from_the_live_engine(world: World) -> None:
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
    # A non-backend tenant (say, the desktop) holds 1000 MiB under a PID of its own.
    world.sim.claim(sim_uuid(0), os.getpid(), 1000, "Xorg (simulated)")
    main_pid = (await world.units.state(world.alpha.name)).main_pid

    result = await measurer(world).measure("alpha", "")

    assert result["pids"] == [main_pid]
    local = json.loads(world.paths.local_registry.read_text(encoding="utf-8"))
    written = local["models"]["alpha"]["configs"]["a1"]
    assert written["resident_gpu_mib"] == ALPHA_MIB
    assert written["measured_on"] == "gpu0"
    # The card it was measured on, compared with the live probe at every registry load.
    card = world.sim.read().devices[0]
    assert written["measured_device"] == {
        "total_mib": card.total_mib,
        "uuid": sim_uuid(0),
        "name": card.name,
    }
    assert written["host_rss_mib"] > 0 and written["host_free_mib"] > 0
    assert written["measured_at"] == result["measurement"]["measured_at"]
    # Geometry from /metrics and /slots (the fake engine: 32768 cells, 1 slot, int8).
    assert (written["context_pool_cells"], written["per_session_cap_cells"]) == (32768, 32768)
    assert (written["kv_resident_cells"], written["kv"]) == (32768, "int8")
    assert "expert_cache_mib" not in written  # the engine reports none: nothing invented
    device = local["devices"]["gpu0"]
    assert device["reserved_mib"] == 1000  # 24576 total − 9576 free − 14000 of backends
    assert "uapplace backends 14,000 MiB" in device["reserve_reason"]

    # The daemon re-read its registry: the new numbers are the ones in force.
    config = world.controller.registry.models["alpha"].configs["a1"]
    assert (config.provenance, config.resident_gpu_mib) == ("local", ALPHA_MIB)
    merged = load_registry(world.paths.repo_registry, world.paths.local_registry)
    assert merged.errors == () and merged.registry.devices["gpu0"].reserved_mib == 1000


async def test_measure_refuses_a_unit_that_is_not_running(world: World) -> None:
    before = local_text(world)
    with pytest.raises(MeasurementRefused, match=r"is not running \(inactive/dead\)"):
        await measurer(world).measure("alpha", "a1")
    assert local_text(world) == before


async def test_measure_refuses_a_reading_below_the_sanity_floor(world: World) -> None:
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()

    before = local_text(world)
    with pytest.raises(MeasurementRefused, match="below the sanity floor of 20000 MiB"):
        await measurer(world, floor_mib=20000).measure("alpha", "a1")
    assert local_text(world) == before


async def test_measure_refuses_a_reserve_larger_than_the_device(world: World) -> None:
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
    world.sim.claim(sim_uuid(0), os.getpid(), 10000, "someone else")
    registry = json.loads(world.paths.repo_registry.read_text(encoding="utf-8"))
    registry["devices"]["gpu0"]["total_mib"] = 8192  # the registry believes in a smaller card
    world.paths.repo_registry.write_text(json.dumps(registry), encoding="utf-8")
    assert await world.controller.reload()

    before = local_text(world)
    with pytest.raises(MeasurementRefused, match=r"reserved_mib for gpu0 \(10,000 MiB\) exceeds"):
        await measurer(world).measure("alpha", "a1")
    assert local_text(world) == before


@pytest.mark.parametrize("world_options", [{"orphan": True}], indirect=True)
async def test_measure_refuses_a_reading_that_includes_a_leftover_allocation(
    world: World, units: UnitManager
) -> None:
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
        await world.events.until(world.orphan_pidfile.exists)
        orphan = world.orphan_pid()
        # Restart: the first run's orphan stays in the cgroup, holding its memory.
        assert (await units.stop_unit(world.alpha.name, GUARD_S)).ok
        assert (await units.start_unit(world.alpha.name, GUARD_S)).ok
        await world.events.until(lambda: world.state_of("alpha") == "hot")
    assert orphan in await units.pids(world.alpha.name)

    before = local_text(world)
    with pytest.raises(MeasurementRefused, match=f"pid {orphan} .* predate its main process"):
        await measurer(world).measure("alpha", "a1")
    assert local_text(world) == before
