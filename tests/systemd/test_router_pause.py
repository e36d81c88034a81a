"""Pause for llama.cpp made executable (issue 19), on a contained ``systemd --user``: the
fake llama.cpp router (:mod:`uapplace.sim.router`) as one real unit hosting ``ra``
(14,000 MiB) and ``rb`` (16,000 MiB) on the simulated 24 GiB card, each model a child
process of the router claiming its memory, driven by the real controller.

What the finding was, and what each test shows instead: the "swap" restarted the whole
router unit (here its MainPID never changes while models come and go); verify-up passed
with both models unloaded (here ``hot`` only once the router says ``loaded``); ``measure``
of one model recorded the other's memory (here it reads that model's child); rails
failed on ``/slots`` (here they come from ``/props?model=ID&autoload=false``); no
``/models/load`` was ever called (here every start and wake is one).
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.systemd.conftest import UnitFiles, free_port
from tests.systemd.placement_world import (
    FAST,
    GUARD_S,
    Recorder,
    park,
    step_names,
    wire_controller,
)
from tests.worlds.registries import measured, sim_devices
from uapplace.controller.controller import Controller
from uapplace.core.model import OptionKind, PendingEntry, ResidentState
from uapplace.daemon.wiring import EnforcementStack
from uapplace.enforce.host import ControllerHost
from uapplace.io import rails, router
from uapplace.io.router import HTTP_ROUTER
from uapplace.io.units import UnitManager
from uapplace.measure.reading import EngineReader, MeasurementRefused
from uapplace.sim import proxy as sim_proxy
from uapplace.sim.gpu import SimGpu, sim_uuid
from uapplace.sim.router import models_in

pytestmark = pytest.mark.systemd

MIB = {"ra": 14000, "rb": 16000}
RA_PAUSE = ["ra/ra-q4@pause"]
RB_PAUSE = ["rb/rb-q4@pause"]


@dataclass
class RouterWorld:
    units: UnitManager
    unit: str
    endpoint: str
    sim: SimGpu
    controller: Controller
    stack: EnforcementStack
    events: Recorder
    proxy_runner: Any

    def state_of(self, model: str) -> str | None:
        found = next((r for r in self.controller.residents if r.model == model), None)
        return found.state.value if found is not None else None

    def states(self) -> dict[str, str]:
        return {r.model: r.state.value for r in self.controller.residents}

    async def main_pid(self) -> int:
        return (await self.units.state(self.unit)).main_pid

    def claims(self) -> dict[str, float]:
        """The simulated card's claims, by the ``--alias`` of the process holding each."""
        out: dict[str, float] = {}
        for claim in self.sim.read().allocations:
            alias = router.alias_of(psutil.Process(claim.pid).cmdline())
            out[alias or f"pid {claim.pid}"] = claim.used_mib
        return out

    async def park(self, model: str) -> PendingEntry:
        return await park(self.controller, self.events, model)

    async def apply(self, entry: PendingEntry, option: int, expected: list[str]) -> dict[str, Any]:
        async with asyncio.timeout(GUARD_S):
            return await self.controller.enforcement.apply(entry.id, option, expected)


def router_unit(unit_files: UnitFiles, sim: SimGpu, tmp_path: Path) -> tuple[str, str]:
    """The fake router as a unit: ``ra``, ``rb`` and a model that cannot load (``rc``)."""
    folder = models_in(["ra", "rb"], tmp_path / "models")
    gpu = f"gpu-uuid = {sim_uuid(0)}\nload-secs = 0.2\n"
    preset = (
        f"[*]\nparallel = 2\n{gpu}"
        f"[ra]\nmib = {MIB['ra']}\n[rb]\nmib = {MIB['rb']}\n"
        f"[rc]\nmodel = {folder}/rc.gguf\nmib = 100\nfail-at-start = true\n"
    )
    (tmp_path / "preset.ini").write_text(preset, encoding="utf-8")
    port = free_port()
    argv = [sys.executable, "-m", "uapplace.sim.router", "--port", str(port)]
    argv += ["--models-dir", str(folder), "--models-preset", str(tmp_path / "preset.ini")]
    argv += ["--models-max", "1"]
    service = "\n".join(
        [
            "Type=exec",
            f"ExecStart={shlex.join(argv)}",
            f"Environment=UAPPLACE_SIM_GPU={sim.path}",
            "KillMode=mixed",
            "TimeoutStopSec=15",
        ]
    )
    return unit_files.raw("router", service), f"http://127.0.0.1:{port}"


def registry_json(unit: str, endpoint: str) -> dict[str, Any]:
    def model(key: str, mib: int) -> dict[str, Any]:
        config = measured(mib, pause_lever="llamacpp-router")
        return {
            "display": key.upper(),
            "engine": "llama.cpp",
            "unit": unit,
            "endpoint": endpoint,
            "configs": {f"{key}-q4": config},
        }

    models = {key: model(key, mib) for key, mib in MIB.items()}
    models["rc"] = model("rc", 100)
    return {"version": 1, "devices": sim_devices(), "models": models}


@pytest.fixture
async def world(
    tmp_path: Path, units: UnitManager, unit_files: UnitFiles, sim_gpu: SimGpu
) -> AsyncIterator[RouterWorld]:
    proxy = sim_proxy.FakeProxy()
    proxy_runner, proxy_url = await sim_proxy.start(proxy)
    unit, endpoint = router_unit(unit_files, sim_gpu, tmp_path)
    await units.reload()
    wired = await wire_controller(
        tmp_path,
        units,
        registry_json(unit, endpoint),
        proxy_url=proxy_url,
        timeouts=FAST,
        policy={"services": []},
        sim=sim_gpu,
    )
    controller, stack, events = wired.controller, wired.stack, wired.events
    built = RouterWorld(units, unit, endpoint, sim_gpu, controller, stack, events, proxy_runner)
    try:
        yield built
    finally:
        await stack.sync.close()
        await controller.shutdown(wait_s=GUARD_S)
        await proxy_runner.cleanup()


async def load_ra(world: RouterWorld) -> int:
    """``ra`` placed on a stopped router: the router unit started, then asked to load."""
    entry = await world.park("ra")
    assert [o.kind for o in entry.options] == [OptionKind.LOAD_ALONGSIDE]
    result = await world.apply(entry, 1, [])
    assert result["ok"] is True, json.dumps(result["steps"], indent=1)
    assert f"started the router {world.unit}" in next(
        s["detail"] for s in result["steps"] if s["name"] == "start"
    )
    assert world.state_of("ra") == "hot"
    assert world.claims() == {"ra": MIB["ra"]}
    return await world.main_pid()


async def test_swap_and_wake_inside_one_router_never_restart_it(world: RouterWorld) -> None:
    router_pid = await load_ra(world)

    entry = await world.park("rb")
    assert [(o.kind.value, o.signature) for o in entry.options] == [
        ("displace", tuple(RA_PAUSE)),
        ("displace", ("ra/ra-q4",)),
    ]
    result = await world.apply(entry, 1, RA_PAUSE)
    assert result["ok"] is True, result
    assert "pause" in step_names(result)
    assert await world.main_pid() == router_pid  # the router unit was never restarted
    assert world.claims() == {"rb": MIB["rb"]}  # ra's child is gone, rb's holds its memory
    assert world.states() == {"ra": "paused", "rb": "hot"}
    statuses = {k: m.status for k, m in (await HTTP_ROUTER.models(world.endpoint, 2)).items()}
    assert statuses == {"ra": "unloaded", "rb": "loaded", "rc": "unloaded"}
    assert world.controller.admit("rb", "client-1", "", 0).decision == "forward"
    assert world.controller.admit("ra", "client-1", "", 0).decision == "park"

    entry = await world.park("ra")
    assert (entry.options[0].kind.value, entry.options[0].signature) == ("wake", tuple(RB_PAUSE))
    result = await world.apply(entry, 1, RB_PAUSE)
    assert result["ok"] is True, result
    assert "wake" in step_names(result) and "start" not in step_names(result)
    assert await world.main_pid() == router_pid
    assert world.claims() == {"ra": MIB["ra"]}
    assert world.states() == {"ra": "hot", "rb": "paused"}


async def test_measure_and_rails_read_the_model_s_own_child(world: RouterWorld) -> None:
    router_pid = await load_ra(world)
    registry = world.controller.registry
    config = registry.models["ra"].configs["ra-q4"]
    reader = EngineReader(ControllerHost(world.controller), world.units)
    seen = await reader.read(registry, world.unit, world.endpoint, config)
    (child,) = seen.pids
    assert child != router_pid and router.alias_of(psutil.Process(child).cmdline()) == "ra"
    assert (seen.device, seen.gpu_mib) == ("gpu0", MIB["ra"])
    with pytest.raises(MeasurementRefused, match="rb is not loaded in the router"):
        await reader.read(
            registry, world.unit, world.endpoint, registry.models["rb"].configs["rb-q4"]
        )

    queries = rails.queries_for(world.controller.residents, registry.models)
    (row,) = await rails.target_rails(queries)
    assert (row.live.state, row.rails, row.rails_source) == (rails.ProbeState.OK, 2, "props")
    statuses = {k: m.status for k, m in (await HTTP_ROUTER.models(world.endpoint, 2)).items()}
    assert statuses["rb"] == "unloaded"  # no probe loaded anything


async def test_a_model_that_cannot_load_is_rolled_back_inside_the_router(
    world: RouterWorld,
) -> None:
    router_pid = await load_ra(world)
    entry = await world.park("rc")
    result = await world.apply(entry, 1, RA_PAUSE)

    assert result["ok"] is False and result["rolledBack"] is True, result
    assert "rc unloaded (failed, exit code 1)" in result["error"]
    assert step_names(result)[-3:] == ["rollback-stop", "rollback-wake", "rollback-clear"]
    assert await world.main_pid() == router_pid
    assert world.claims() == {"ra": MIB["ra"]}
    assert world.states() == {"ra": "hot"}
    assert world.controller.admit("ra", "client-1", "", 0).decision == "forward"


async def test_the_unit_sync_follows_each_router_model_on_its_own(world: RouterWorld) -> None:
    # A router started by hand, nothing loaded: no resident is invented for it.
    outcome = await world.units.start_unit(world.unit, GUARD_S)
    assert outcome.ok, outcome
    await world.stack.sync.sync_all()
    assert world.states() == {}
    await world.units.stop_unit(world.unit, GUARD_S)

    await load_ra(world)
    entry = await world.park("rb")
    assert (await world.apply(entry, 1, RA_PAUSE))["ok"] is True
    # As after a daemon restart: the serving resident is restored `warming`; the sync
    # verifies it on its own (the router says it is loaded) and keeps the paused one.
    rb = next(r for r in world.controller.residents if r.model == "rb")
    world.controller.upsert_resident(replace(rb, state=ResidentState.WARMING))
    await world.stack.sync.sync_all()
    await world.events.until(lambda: world.states() == {"ra": "paused", "rb": "hot"})
    # The router going down takes every one of its models out of the ledger.
    await world.units.stop_unit(world.unit, GUARD_S)
    await world.events.until(lambda: world.states() == {})
