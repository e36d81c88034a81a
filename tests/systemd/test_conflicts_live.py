"""The ``Conflicts=`` drop-ins and the planner agree, on real units (issue 10, must-show a).

One simulated 24 GiB GPU and three real units running the fake engine: ``alpha``
(8,000 MiB) and ``beta`` (10,000 MiB) fit together; ``gamma`` (20,000 MiB) fits with
neither. ``WriteUnits`` draws exactly the two edges alpha–gamma and beta–gamma, so:

- ``load_alongside`` beta next to alpha leaves both running (systemd stops nothing);
- with gamma resident, beta has no ``load_alongside`` option (only a displace of gamma),
  and starting beta's unit by hand makes systemd itself stop gamma.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.systemd.conftest import EngineUnit, UnitFiles
from tests.systemd.placement_world import GUARD_S, World, build_world, close_world
from tests.worlds.registries import measured, unit_model
from uapplace.controller.dropins import UnitDropins
from uapplace.core.model import OptionKind
from uapplace.files.registry import local_measurements
from uapplace.io.units import DROPIN_NAME, UnitManager, unit_name
from uapplace.sim.gpu import SimGpu
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.systemd

ALPHA_MIB, BETA_MIB, GAMMA_MIB = 8000, 10000, 20000


@dataclasses.dataclass
class Machine:
    world: World
    gamma: EngineUnit
    unit_dir: Path


@pytest.fixture
async def machine(
    tmp_path: Path,
    user_manager: ContainedUserManager,
    units: UnitManager,
    unit_files: UnitFiles,
    sim_gpu: SimGpu,
) -> AsyncIterator[Machine]:
    # Drop-ins go where this user manager reads units (the daemon's own XDG dir).
    world = await build_world(
        tmp_path,
        units,
        unit_files,
        sim_gpu,
        alpha_mib=ALPHA_MIB,
        beta_mib=BETA_MIB,
        unit_dir=user_manager.unit_dir,
    )
    try:
        gamma = unit_files.engine(
            "gamma", "gamma", sim_gpu, mib=GAMMA_MIB, engine_args=["--load-secs", "0.3"]
        )
        await units.reload()
        add_gamma(world, gamma)
        controller = world.controller
        assert controller.paths.user_unit_dir == user_manager.unit_dir
        assert await controller.reload()
        yield Machine(world, gamma, user_manager.unit_dir)
    finally:
        await close_world(world)


def add_gamma(world: World, gamma: EngineUnit) -> None:
    """A third model in both registry files (its figures are this machine's own)."""
    repo = world.paths.repo_registry
    doc: dict[str, Any] = json.loads(repo.read_text(encoding="utf-8"))
    doc["models"]["gamma"] = unit_model("gamma", gamma, measured(GAMMA_MIB))
    repo.write_text(json.dumps(doc), encoding="utf-8")
    local = json.dumps(local_measurements(doc))
    world.paths.local_registry.write_text(local, encoding="utf-8")


def conflicts_of(unit_dir: Path, unit: str) -> set[str]:
    text = (unit_dir / f"{unit_name(unit)}.d" / DROPIN_NAME).read_text(encoding="utf-8")
    line = next(x for x in text.splitlines() if x.startswith("Conflicts="))
    return set(line.removeprefix("Conflicts=").split())


async def active(units: UnitManager, unit: str) -> str:
    return (await units.state(unit)).active_state


async def until_state(units: UnitManager, unit: str, wanted: str) -> None:
    """Wait for systemd's own signal that ``unit`` reached ``wanted`` (re-read each change)."""
    changed = asyncio.Event()
    units.on_change(lambda name, _state: changed.set() if name == unit_name(unit) else None)
    async with asyncio.timeout(GUARD_S):
        while await active(units, unit) != wanted:
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), 1.0)


async def test_the_graph_lets_fitting_models_share_and_systemd_stops_only_across_an_edge(
    machine: Machine,
) -> None:
    world, gamma, unit_dir = machine.world, machine.gamma, machine.unit_dir
    alpha, beta = world.alpha.name, world.beta.name
    controller = world.controller

    written = await controller.collaborators.unit_writer.write_units()

    assert sorted(Path(p).parent.name for p in written) == sorted(
        f"{unit_name(u)}.d" for u in (alpha, beta, gamma.name)
    )
    assert conflicts_of(unit_dir, alpha) == {unit_name(gamma.name)}
    assert conflicts_of(unit_dir, beta) == {unit_name(gamma.name)}
    assert conflicts_of(unit_dir, gamma.name) == {unit_name(alpha), unit_name(beta)}
    assert await controller.collaborators.unit_writer.check_units() == []

    # alpha resident; beta fits alongside: both run, systemd stops nothing.
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
    entry = await world.park("beta")
    assert entry.options[0].kind is OptionKind.LOAD_ALONGSIDE
    mark = len(world.timeline.changes)
    async with asyncio.timeout(GUARD_S):
        result = await controller.enforcement.apply(entry.id, 1, [])
    assert result["ok"], result
    async with asyncio.timeout(GUARD_S):
        await world.events.until(lambda: world.state_of("beta") == "hot")
    assert (await active(world.units, alpha), await active(world.units, beta)) == (
        "active",
        "active",
    )
    assert world.state_of("alpha") == "hot"
    alpha_after = [s for u, s in world.timeline.changes[mark:] if u == unit_name(alpha)]
    assert alpha_after == [], world.timeline.changes  # never stopped, not even for a moment

    # gamma started by hand: systemd stops alpha and beta (the edges), nobody else.
    assert (await world.units.start_unit(gamma.name, GUARD_S)).ok
    await until_state(world.units, alpha, "inactive")
    await until_state(world.units, beta, "inactive")
    assert await active(world.units, gamma.name) == "active"
    async with asyncio.timeout(GUARD_S):
        await world.events.until(lambda: world.state_of("gamma") == "hot")
        await world.events.until(lambda: world.state_of("beta") is None)

    # Two that do not fit: no load_alongside, only a displace that names gamma.
    parked = await world.park("beta", client="client-2")
    assert [o.kind for o in parked.options] == [OptionKind.DISPLACE]
    assert [v.model for v in parked.options[0].victims] == ["gamma"]

    # And beta started by hand makes systemd stop gamma.
    assert (await world.units.start_unit(beta, GUARD_S)).ok
    await until_state(world.units, gamma.name, "inactive")
    assert await active(world.units, beta) == "active"


async def test_a_registry_change_regenerates_the_graph_and_check_reports_staleness(
    machine: Machine,
) -> None:
    world, gamma, unit_dir = machine.world, machine.gamma, machine.unit_dir
    controller = world.controller
    await controller.collaborators.unit_writer.write_units()
    gamma_dropin = unit_dir / f"{unit_name(gamma.name)}.d" / DROPIN_NAME
    assert gamma_dropin.exists()

    # A hand edit makes the files stale: --check names them and touches nothing.
    gamma_dropin.write_text("[Unit]\nConflicts=\n", encoding="utf-8")
    assert await controller.collaborators.unit_writer.check_units() == [str(gamma_dropin.resolve())]
    assert gamma_dropin.read_text(encoding="utf-8") == "[Unit]\nConflicts=\n"

    # gamma re-measured smaller: it now fits with both, and the reload rewrites the graph.
    local = json.loads(world.paths.local_registry.read_text(encoding="utf-8"))
    local["models"]["gamma"]["configs"]["g1"]["resident_gpu_mib"] = 4000
    world.paths.local_registry.write_text(json.dumps(local), encoding="utf-8")
    assert await controller.reload()

    assert not list(unit_dir.glob(f"*.d/{DROPIN_NAME}"))
    assert await controller.collaborators.unit_writer.check_units() == []

    # Issue 21 item 5: with every drop-in gone the graph still follows. gamma grows back:
    # the next reload writes its edges again.
    local["models"]["gamma"]["configs"]["g1"]["resident_gpu_mib"] = GAMMA_MIB
    world.paths.local_registry.write_text(json.dumps(local), encoding="utf-8")
    assert await controller.reload()
    assert conflicts_of(unit_dir, gamma.name) == {
        unit_name(world.alpha.name),
        unit_name(world.beta.name),
    }
    assert await controller.collaborators.unit_writer.check_units() == []
    # A restarted daemon (a new writer over the same directory) follows too.
    big = controller.config.registry()
    local["models"]["gamma"]["configs"]["g1"]["resident_gpu_mib"] = 4000
    world.paths.local_registry.write_text(json.dumps(local), encoding="utf-8")
    assert await controller.reload()
    assert not list(unit_dir.glob(f"*.d/{DROPIN_NAME}"))

    async def reload_units() -> bool:
        await world.units.reload()
        return True

    restarted = UnitDropins(unit_dir, lambda: big, reload_units)
    assert len(await restarted.refresh()) == 3  # gamma's, alpha's and beta's drop-ins
    assert await restarted.check_units() == []
