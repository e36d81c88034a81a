"""Pause for llama.cpp made executable (issue 19), against the REAL ``llama-server`` in
router mode: ``--models-dir DIR --models-max 1`` as one hardened unit of the contained
``systemd --user`` on the CPU tier, its models ``ra`` (tiny-a), ``rb`` (tiny-b) and ``rc``
(a GGUF cut short), driven by the real controller and enforcer in this process (as
``tests/systemd/test_router_pause.py`` drives the fake router).

Each finding of the issue, on the real binary: a swap and a wake never restart the
router (its MainPID stays), a model is ``hot`` only once the router says ``loaded``,
``measure`` reads that model's child process alone, rails come from
``/props?model=ID&autoload=false`` (and no probe loads anything), every start and wake
is a ``POST /models/load``, and a model that cannot load rolls back inside the router.
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.systemd.placement_world import Recorder, park, wire_controller
from tests.worlds.llama import TinyModels
from tests.worlds.registries import MEASURED_AT, host_mib
from uapplace.controller.controller import Controller
from uapplace.core.model import OptionKind, PendingEntry
from uapplace.daemon.wiring import EnforcementStack
from uapplace.enforce.host import ControllerHost
from uapplace.files.timeouts import Timeouts
from uapplace.io import rails, router
from uapplace.io.router import HTTP_ROUTER
from uapplace.io.units import UnitManager
from uapplace.measure.reading import EngineReader
from uapplace.sim import proxy as sim_proxy
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.engines

GUARD_S = 60.0
TIMEOUTS = Timeouts(
    drain_s=2.0, stop_s=20.0, verify_free_s=5.0, start_s=20.0, verify_up_s=20.0, rollback_up_s=20.0
)
MODELS = {"ra": "tiny-a", "rb": "tiny-b"}
RA_PAUSE = ["ra/ra-c1@pause"]
RB_PAUSE = ["rb/rb-c1@pause"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@dataclass
class RealRouter:
    units: UnitManager
    unit: str
    endpoint: str
    binary: Path
    controller: Controller
    stack: EnforcementStack
    events: Recorder

    def states(self) -> dict[str, str]:
        return {r.model: r.state.value for r in self.controller.residents}

    async def main_pid(self) -> int:
        return (await self.units.state(self.unit)).main_pid

    async def statuses(self) -> dict[str, str]:
        return {k: m.status for k, m in (await HTTP_ROUTER.models(self.endpoint, 5.0)).items()}

    async def children(self) -> dict[str, int]:
        """``--alias`` → PID of every real llama-server child in the router's unit."""
        out: dict[str, int] = {}
        for pid in await self.units.pids(self.unit):
            try:
                process = psutil.Process(pid)
                alias = router.alias_of(process.cmdline())
                exe = Path(process.exe())
            except psutil.Error:
                continue
            if alias is not None:
                assert exe == self.binary  # the real binary, not the fake
                out[alias] = pid
        return out

    async def park(self, model: str) -> PendingEntry:
        try:
            return await park(self.controller, self.events, model)
        except TimeoutError:
            plan = await ControllerHost(self.controller).plan_for(model, 32768)
            raise AssertionError(f"no options for {model}: {plan.to_json()}") from None

    async def apply(self, entry: PendingEntry, option: int, expected: list[str]) -> dict[str, Any]:
        async with asyncio.timeout(GUARD_S):
            return await self.controller.enforcement.apply(entry.id, option, expected)

    async def load_alone(self, model: str) -> dict[str, Any]:
        """``model`` placed beside nothing (its one option loads it alongside): the result."""
        entry = await self.park(model)
        assert [o.kind for o in entry.options] == [OptionKind.LOAD_ALONGSIDE]
        result = await self.apply(entry, 1, [])
        assert result["ok"] is True, result
        return result


def registry_json(unit: str, endpoint: str) -> dict[str, Any]:
    def model(key: str) -> dict[str, Any]:
        config = {
            "resident_gpu_mib": 0,
            "host_rss_mib": 64,
            "kv_resident_cells": 32768,
            "pause_lever": "llamacpp-router",
            "measured_at": MEASURED_AT,
            "measured_on": "cpu0",
        }
        return {
            "display": key.upper(),
            "engine": "llama.cpp",
            "unit": unit,
            "endpoint": endpoint,
            "configs": {f"{key}-c1": config},
        }

    devices = {"cpu0": {"kind": "cpu", "total_mib": host_mib(), "reserved_mib": 256}}
    return {"version": 1, "devices": devices, "models": {k: model(k) for k in (*MODELS, "rc")}}


@pytest.fixture
async def real_router(
    llama_server: Path,
    tiny_models: TinyModels,
    user_manager: ContainedUserManager,
    units: UnitManager,
    tmp_path: Path,
) -> AsyncIterator[RealRouter]:
    folder = tmp_path / "models"
    folder.mkdir()
    for key, preset in MODELS.items():
        shutil.copyfile(tiny_models.path(preset), folder / f"{key}.gguf")
    shutil.copyfile(tiny_models.path("corrupt"), folder / "rc.gguf")
    cache = tmp_path / "llama-cache"
    cache.mkdir()
    port = free_port()
    argv = [str(llama_server), "--models-dir", str(folder), "--models-max", "1"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "-c", "512", "--parallel", "2"]
    unit = f"uapplace-router-{port}.service"
    body = "\n".join(
        [
            "[Unit]",
            "Description=uapplace test: a real llama.cpp router",
            "[Service]",
            "Type=exec",
            f"ExecStart={shlex.join(argv)}",
            f"Environment=LLAMA_CACHE={cache}",
            "KillMode=mixed",
            "TimeoutStopSec=20",
            f"StandardError=append:{tmp_path / 'router.log'}",
        ]
    )
    (user_manager.unit_dir / unit).write_text(body + "\n", encoding="utf-8")
    await units.reload()

    proxy_runner, proxy_url = await sim_proxy.start(sim_proxy.FakeProxy())
    endpoint = f"http://127.0.0.1:{port}"
    wired = await wire_controller(
        tmp_path,
        units,
        registry_json(unit, endpoint),
        proxy_url=proxy_url,
        timeouts=TIMEOUTS,
        policy={"services": []},
    )
    controller, stack = wired.controller, wired.stack
    try:
        yield RealRouter(units, unit, endpoint, llama_server, controller, stack, wired.events)
    finally:
        await stack.sync.close()
        await controller.shutdown(wait_s=GUARD_S)
        await proxy_runner.cleanup()
        await units.stop_unit(unit, timeout=30)
        (user_manager.unit_dir / unit).unlink(missing_ok=True)
        await units.reload()


def detail(result: dict[str, Any], name: str) -> str:
    return " | ".join(s["detail"] for s in result["steps"] if s["name"] == name)


async def test_a_real_router_swaps_wakes_and_rolls_back_without_a_restart(
    real_router: RealRouter,
) -> None:
    world = real_router
    # ra on a stopped router: the unit is started, then asked to load ra.
    result = await world.load_alone("ra")
    assert f"started the router {world.unit}" in detail(result, "start")
    assert "ra loaded in the router" in detail(result, "verify-up")
    router_pid = await world.main_pid()
    children = await world.children()
    assert list(children) == ["ra"] and children["ra"] != router_pid
    assert world.states() == {"ra": "hot"}

    # measure reads ra's child alone; rails come from its /props; no probe loads rb.
    registry = world.controller.registry
    reader = EngineReader(ControllerHost(world.controller), world.units)
    seen = await reader.read(
        registry, world.unit, world.endpoint, registry.models["ra"].configs["ra-c1"]
    )
    assert seen.pids == (children["ra"],) and seen.device == "cpu0"
    (row,) = await rails.target_rails(
        rails.queries_for(world.controller.residents, registry.models)
    )
    assert (row.live.state, row.rails, row.rails_source) == (rails.ProbeState.OK, 2, "props")
    assert (await world.statuses())["rb"] == "unloaded"

    # The swap: ra unloaded (its child gone), rb loaded, in the same router process.
    entry = await world.park("rb")
    assert (entry.options[0].kind, list(entry.options[0].signature)) == (
        OptionKind.DISPLACE,
        RA_PAUSE,
    )
    result = await world.apply(entry, 1, RA_PAUSE)
    assert result["ok"] is True, result
    assert await world.main_pid() == router_pid
    assert list(await world.children()) == ["rb"] and not psutil.pid_exists(children["ra"])
    assert world.states() == {"ra": "paused", "rb": "hot"}
    assert world.controller.admit("rb", "client-1", "", 0).decision == "forward"

    # The wake of ra is a load in the same router; rb is paused for it.
    entry = await world.park("ra")
    assert (entry.options[0].kind, list(entry.options[0].signature)) == (OptionKind.WAKE, RB_PAUSE)
    result = await world.apply(entry, 1, RB_PAUSE)
    assert result["ok"] is True, result
    assert await world.main_pid() == router_pid
    assert list(await world.children()) == ["ra"]
    assert world.states() == {"ra": "hot", "rb": "paused"}

    # rc cannot load (a GGUF cut short): the run rolls back inside the router.
    entry = await world.park("rc")
    result = await world.apply(entry, 1, RA_PAUSE)
    assert result["ok"] is False and result["rolledBack"] is True, result
    assert "rc unloaded (failed, exit code 1)" in result["error"], result["error"]
    assert await world.main_pid() == router_pid
    assert list(await world.children()) == ["ra"]
    assert world.states() == {"ra": "hot", "rb": "paused"}
    assert world.controller.admit("ra", "client-1", "", 0).decision == "forward"
