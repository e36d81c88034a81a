"""Publication and reconcile on real units (docs/invariants.md, invariants 2 and 5; issue 10 e).

Two layers:

- in-process (:mod:`tests.systemd.placement_world`: the real controller, unit sync
  and enforcer on the contained ``systemd --user``): a wrong-id engine started by
  hand, the reconcile that drops residents no running registry unit backs;
- the real ``uapplaced`` process on that manager's bus: a wrong-id engine found
  running at start-up and one started by hand are never forwarded to and are
  reported in ``GetState``'s alerts; a daemon restarted over a ledger that says
  ``hot`` answers ``park``/``warming`` until its own verify-up passes (the engine
  is frozen with SIGSTOP, so "not yet" is a fact, not a race), then forwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.bus.conftest import DaemonProcess, UapEnv, start_daemon
from tests.systemd.conftest import EngineUnit, UnitFiles
from tests.systemd.placement_world import GUARD_S, World, build_world, close_world
from tests.worlds import polling
from tests.worlds.registries import unit_registry
from uapplace.bus.client import PlacementClient
from uapplace.core.alerts import AlertKind
from uapplace.io.units import UnitManager
from uapplace.sim.gpu import SimGpu

pytestmark = pytest.mark.systemd


# --------------------------------------------------------------------------- in-process


@pytest.fixture
async def world(
    tmp_path: Path, units: UnitManager, unit_files: UnitFiles, sim_gpu: SimGpu
) -> AsyncIterator[World]:
    built = await build_world(tmp_path, units, unit_files, sim_gpu, beta_args=["--wrong-id"])
    try:
        yield built
    finally:
        await close_world(built)


async def test_a_wrong_id_unit_started_by_hand_is_reported_and_never_published(
    world: World,
) -> None:
    parked = world.controller.admit("beta", "client-1", "", 0)
    assert parked.reason == "not_resident"
    started = await world.units.start_unit(world.beta.name, GUARD_S)
    assert started.ok, started

    def reported() -> bool:
        return any(a.kind is AlertKind.WRONG_MODEL for a in world.events.alerts)

    await world.events.until(reported)
    alert = next(a for a in world.events.alerts if a.kind is AlertKind.WRONG_MODEL)
    assert alert.subject == world.beta.name
    assert alert.detail["served"] == ["wrong-beta"]
    assert "beta" in alert.detail["expected"] and "beta-latest" in alert.detail["expected"]
    assert world.state_of("beta") == "warming"
    for requested in ("beta", "beta-latest", "b1"):
        decision = world.controller.admit(requested, "client-1", "", 0)
        assert (decision.decision, decision.reason) == ("park", "warming"), requested
    assert "hot" not in world.events.states_of("beta")
    assert (parked.placement_id, "forwarded") not in world.events.resolved
    assert world.controller.admission.get(parked.placement_id) is not None


async def test_reconcile_drops_residents_no_running_registry_unit_backs(world: World) -> None:
    await world.start_alpha()
    alpha = world.resident("alpha")
    assert alpha is not None
    # What a stale ledger may hold: beta "hot" with its unit stopped, and a resident
    # whose unit left the registry.
    stale_beta = replace(
        alpha, model="beta", config="b1", unit=world.beta.name, endpoint=world.beta.endpoint
    )
    gone_unit = replace(alpha, model="alpha", config="a1", device="gpu1", unit="left.service")
    world.controller.upsert_resident(stale_beta)
    world.controller.upsert_resident(gone_unit)

    await world.sync.sync_all()

    assert [(r.model, r.device) for r in world.controller.residents] == [("alpha", "gpu0")]
    dropped = {a.subject: a for a in world.events.alerts if a.kind is AlertKind.RESIDENT_DROPPED}
    assert set(dropped) == {world.beta.name, "left.service"}
    assert "is inactive/dead" in dropped[world.beta.name].message
    assert "not in the registry" in dropped["left.service"].message
    assert world.state_of("alpha") == "hot"


async def test_a_crashed_unit_drops_its_resident_with_an_alert(world: World) -> None:
    await world.start_alpha()
    pid = (await world.units.state(world.alpha.name)).main_pid
    os.kill(pid, signal.SIGKILL)
    await world.events.until(lambda: world.resident("alpha") is None)
    alert = next(a for a in world.events.alerts if a.kind is AlertKind.RESIDENT_DROPPED)
    assert alert.subject == world.alpha.name
    assert "failed" in alert.message


# --------------------------------------------------------------------------- the daemon


@dataclass
class Machine:
    uap: UapEnv
    client: PlacementClient
    units: UnitManager
    engines: dict[str, EngineUnit]
    daemons: list[DaemonProcess]

    @property
    def daemon(self) -> DaemonProcess:
        return self.daemons[-1]

    async def until(self, what: str, check: Callable[[], Any]) -> Any:
        """Await ``check()`` until it returns something truthy; fail with the daemon's log."""
        return await polling.until(what, check, lambda: self.daemon.log(), guard_s=GUARD_S)

    async def state(self) -> dict[str, Any]:
        state: dict[str, Any] = await self.client.get_state()
        return state

    async def resident_state(self, model: str) -> str | None:
        rows = (await self.state())["residents"]
        return next((r["state"] for r in rows if r["model"] == model), None)

    async def wrong_model_alert(self, unit: str) -> dict[str, Any] | None:
        alerts = (await self.state())["alerts"]
        return next(
            (a for a in alerts if a["kind"] == "wrong_model" and a["subject"] == unit), None
        )

    async def start_daemon(self) -> None:
        self.daemons.append(await asyncio.to_thread(start_daemon, self.uap))


MIB = {"alpha": 8000, "beta": 6000, "gamma": 6000}


@pytest.fixture
async def machine(uap: UapEnv, units: UnitManager, unit_files: UnitFiles) -> AsyncIterator[Machine]:
    """alpha serves its id; beta and gamma serve ``wrong-<id>``. beta runs before the daemon."""
    sim = SimGpu(uap.root / "sim-gpu.json")
    wrong = ["--wrong-id"]
    engines = {
        model: unit_files.engine(
            model,
            model,
            sim,
            mib=MIB[model],
            engine_args=["--load-secs", "0.2", *(wrong if model != "alpha" else [])],
        )
        for model in MIB
    }
    await units.reload()
    uap.write_registry(unit_registry(engines, MIB, advertise=True))
    for model in ("alpha", "beta"):
        started = await units.start_unit(engines[model].name, GUARD_S)
        assert started.ok, started
    daemons: list[DaemonProcess] = []
    client: PlacementClient | None = None
    try:
        daemons.append(await asyncio.to_thread(start_daemon, uap))
        client = await PlacementClient.connect(uap.bus_address)
        yield Machine(uap, client, units, engines, daemons)
    finally:
        if client is not None:
            client.disconnect()
        codes = [await asyncio.to_thread(d.stop) for d in daemons if d.process.poll() is None]
        for engine in engines.values():  # a test may have frozen one (SIGSTOP)
            pid = (await units.state(engine.name)).main_pid
            if pid:
                os.kill(pid, signal.SIGCONT)
    assert all(code == 0 for code in codes), codes


async def test_wrong_id_engines_found_at_start_and_started_by_hand_are_never_forwarded(
    machine: Machine,
) -> None:
    beta = machine.engines["beta"].name
    found = await machine.until("beta's wrong_model alert", lambda: machine.wrong_model_alert(beta))
    assert found["severity"] == "warning"
    assert found["detail"]["served"] == ["wrong-beta"]
    await machine.until("alpha verified", lambda: _is(machine.resident_state("alpha"), "hot"))

    started = await machine.units.start_unit(machine.engines["gamma"].name, GUARD_S)
    assert started.ok, started
    gamma = machine.engines["gamma"].name
    by_hand = await machine.until("gamma's alert", lambda: machine.wrong_model_alert(gamma))
    assert by_hand["detail"]["served"] == ["wrong-gamma"]

    for model in ("beta", "beta-latest", "gamma", "gamma-latest"):
        decision = await machine.client.admit(model, "client-1", "", 0)
        assert decision["decision"] == "park", (model, decision)
        assert decision["reason"] == "warming", (model, decision)
    assert await machine.resident_state("beta") == "warming"
    assert await machine.resident_state("gamma") == "warming"
    forwarded = await machine.client.admit("alpha-latest", "client-1", "", 0)
    assert forwarded == {
        "decision": "forward",
        "target_id": f"gpu0:{machine.engines['alpha'].endpoint}",
    }
    pending = {e["requested_model"] for e in (await machine.client.list_pending())["pending"]}
    assert {"beta", "beta-latest", "gamma", "gamma-latest"} <= pending  # none "forwarded"


async def test_a_restarted_daemon_parks_warming_until_its_own_verify_up(
    machine: Machine,
) -> None:
    alpha = machine.engines["alpha"]
    await machine.until("alpha verified", lambda: _is(machine.resident_state("alpha"), "hot"))

    def ledger_says_hot() -> bool:
        if not machine.uap.ledger.exists():
            return False  # the first write-behind has not landed yet
        rows = machine.uap.read_ledger().get("residents", [])
        return any(r["model"] == "alpha" and r["state"] == "hot" for r in rows)

    await polling.until_sync("the ledger to record alpha hot", ledger_says_hot, machine.daemon.log)
    first = machine.daemon
    first.process.kill()  # SIGKILL: the ledger still says hot
    await asyncio.to_thread(first.process.wait)
    pid = (await machine.units.state(alpha.name)).main_pid
    os.kill(pid, signal.SIGSTOP)  # the engine hangs: /health cannot answer
    try:
        await machine.start_daemon()
        parked = await machine.client.admit("alpha", "client-2", "", 0)
        assert parked["decision"] == "park" and parked["reason"] == "warming", parked
        assert await machine.resident_state("alpha") == "warming"
    finally:
        os.kill(pid, signal.SIGCONT)

    async def forwarded() -> dict[str, str] | None:
        answer = await machine.client.admit("alpha", "client-2", "", 0)
        return answer if answer["decision"] == "forward" else None

    answer = await machine.until("a forward after verify-up", forwarded)
    assert answer["target_id"] == f"gpu0:{alpha.endpoint}"
    resolved = (await machine.client.list_pending())["pending"]
    assert parked["placement_id"] not in {e["id"] for e in resolved}


async def _is(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


@pytest.mark.parametrize("world_options", [{"orphan": True}], indirect=True)
async def test_reconcile_reports_memory_no_resident_unit_holds(built_world: World) -> None:
    """An orphan keeps alpha's VRAM after its unit stopped: the probe wins, and says so.
    (The world ends the orphan when it closes.)"""
    world = built_world
    await world.start_alpha()
    stopped = await world.units.stop_unit(world.alpha.name, GUARD_S)
    assert stopped.ok, stopped
    await world.events.until(lambda: world.resident("alpha") is None)
    orphan = world.orphan_pid()

    await world.sync.sync_all()

    alert = next(a for a in world.events.alerts if a.kind is AlertKind.PROBE_MISMATCH)
    assert alert.subject == "gpu0"
    assert alert.detail["pids"] == [orphan]
    assert f"pid {orphan}" in alert.message and "14,000 MiB" in alert.message


@pytest.mark.parametrize("world_options", [{"alpha_args": ["--never-healthy"]}], indirect=True)
async def test_an_engine_answering_503_is_never_forwarded_to(built_world: World) -> None:
    world = built_world
    started = await world.units.start_unit(world.alpha.name, GUARD_S)
    assert started.ok, started
    await world.events.until(lambda: world.state_of("alpha") == "warming")

    async def answers_503() -> bool:
        with contextlib.suppress(OSError, TimeoutError):
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"{world.alpha.endpoint}/health") as reply,
            ):
                return reply.status == 503
        return False

    # An HTTP server nothing signals about: polled.
    await polling.until("alpha's engine to answer /health with 503", answers_503)
    for requested in ("alpha", "alpha-latest", "a1"):
        decision = world.controller.admit(requested, "client-1", "", 0)
        assert (decision.decision, decision.reason) == ("park", "warming"), requested
    assert world.state_of("alpha") == "warming"


async def test_a_victim_the_rollback_could_not_verify_stays_a_warming_resident(
    world: World,
) -> None:
    """beta serves the wrong id, so the swap rolls back; alpha's unit now starts an engine
    that never turns healthy, so the rollback is incomplete. alpha's unit runs: it is a
    ``warming`` resident (counted by the planner, never forwarded to), not a unit running
    behind the residents' back (docs/invariants.md, invariant 5)."""
    await world.start_alpha()
    text = world.alpha.path.read_text(encoding="utf-8")
    world.alpha.path.write_text(
        text.replace("--model-id alpha", "--model-id alpha --never-healthy"), encoding="utf-8"
    )
    await world.units.reload()
    entry = await world.park("beta")

    result = await world.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["ok"] is False and "ROLLBACK INCOMPLETE" in result["error"], result
    assert (await world.units.state(world.alpha.name)).active_state == "active"
    await world.events.until(lambda: world.state_of("alpha") == "warming")
    decision = world.controller.admit("alpha", "client-2", "", 0)
    assert (decision.decision, decision.reason) == ("park", "warming")
