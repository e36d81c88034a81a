"""Enforcement safety on a contained systemd --user: preflight, rollback always, facts.

The machine is :mod:`tests.systemd.placement_world`'s: ``alpha`` (14000 MiB)
resident on a simulated 24 GiB GPU, ``beta`` (16000 MiB) needing its place, so
every apply here displaces ``alpha``. Each test breaks ``beta`` (or the device)
in one way and checks the promise that matters: nothing stops when the run
cannot succeed (preflight), a victim comes back whenever it safely can, an
engine that never turns healthy is given up on within a bound derived from its
measured start, and a device left emptier than before is an alert in
``GetState``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any

import pytest
from pystemd.dbuslib import DBusAddress

from tests.systemd.placement_world import (
    ALPHA_MIB,
    FAST,
    GUARD_S,
    World,
    step,
    step_names,
)
from uapplace.controller import views
from uapplace.core.model import ParkReason
from uapplace.files.timeouts import Timeouts
from uapplace.io import engines
from uapplace.io.units import MANAGER_IFACE, MANAGER_PATH, SYSTEMD
from uapplace.sim.gpu import pid_alive, sim_uuid

pytestmark = pytest.mark.systemd

ALPHA_VICTIM = ["alpha/a1"]


@pytest.fixture
def world(alpha_world: World) -> World:
    """The tier's placement machine, ``alpha`` hot (conftest; ``world_options`` shapes it)."""
    return alpha_world


async def main_pid(world: World, unit: str) -> int:
    return (await world.units.state(unit)).main_pid


async def assert_alpha_serving(world: World) -> None:
    """alpha's unit runs, answers healthy with its own id, and is published hot."""
    state = await world.units.state(world.alpha.name)
    assert state.active_state == "active", state
    assert await engines.health(world.alpha.endpoint)
    assert await engines.served_ids(world.alpha.endpoint) == ["alpha"]
    await world.events.until(lambda: world.state_of("alpha") == "hot")


def alpha_running(world: World) -> dict[str, Any]:
    return {
        "model": "alpha",
        "config": "a1",
        "device": "gpu0",
        "unit": world.alpha.name,
        "state": "active/running",
    }


def reload_now(world: World) -> None:
    """A blocking ``Reload()`` of the user manager, for use inside a step hook."""
    bus = DBusAddress(world.units.bus_address.encode(), False)
    bus.open()
    try:
        bus.call_method(SYSTEMD, MANAGER_PATH, MANAGER_IFACE, b"Reload", [])
    finally:
        bus.close()


# --------------------------------------------------------------------------- (b) preflight


async def test_a_new_unit_that_does_not_exist_is_refused_and_the_victim_never_stopped(
    world: World,
) -> None:
    entry = await world.park("beta")
    world.beta.path.unlink()
    await world.units.reload()
    pid_before = await main_pid(world, world.alpha.name)
    changes_before = len(world.timeline.changes)

    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.apply(entry.id, 1, ALPHA_VICTIM)

    assert result["ok"] is False and "rolledBack" not in result, result
    assert step_names(result) == ["revalidate", "preflight"]
    preflight = step(result, "preflight")
    assert preflight["ok"] is False
    assert preflight["detail"] == (
        f"unit {world.beta.name}: LoadState is 'not-found', not 'loaded': Unit "
        f"{world.beta.name} not found. (no unit file: install it in the user unit directory, "
        "then daemon-reload)"
    )
    assert result["error"].endswith("; nothing was stopped")
    # alpha was never touched: same process, no state change, never marked draining.
    assert await main_pid(world, world.alpha.name) == pid_before
    assert world.timeline.changes[changes_before:] == []
    assert "draining" not in world.events.states_of("alpha")
    await assert_alpha_serving(world)
    assert result["runningAfter"] == [alpha_running(world)]
    refused = world.controller.admission.get(entry.id)  # kept, and says so (issue 21 item 2)
    assert refused is not None and refused.reason is ParkReason.FAILED
    assert world.controller.admit("beta", entry.client, "", 0).reason == "failed"
    assert world.controller.alerts.active() == []  # the operator's own call: the result says it


async def test_a_missing_exec_start_binary_is_refused_and_an_unattended_run_raises_an_alert(
    world: World,
) -> None:
    entry = await world.park("beta")
    missing = "/nonexistent/uapplace/llama-server"
    world.unit_files.raw("beta", f"Type=exec\nExecStart={missing} --port {world.beta.port}")
    await world.units.reload()
    pid_before = await main_pid(world, world.alpha.name)

    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.apply(
            entry.id, 1, ALPHA_VICTIM, origin="notification click"
        )

    assert result["ok"] is False, result
    preflight = step(result, "preflight")
    assert preflight["detail"] == (
        f"unit {world.beta.name}: ExecStart binary {missing} does not exist"
    )
    assert await main_pid(world, world.alpha.name) == pid_before
    await assert_alpha_serving(world)
    alerts = (await views.state_json(world.controller))["alerts"]
    assert [(a["kind"], a["severity"], a["subject"]) for a in alerts] == [
        ("enforcement_failed", "warning", "beta")
    ]
    assert alerts[0]["message"].startswith("notification click: apply ")
    assert missing in alerts[0]["message"]


# --------------------------------------------------------------------------- (c) rollback


async def test_a_start_job_that_fails_after_the_victim_stopped_brings_the_victim_back(
    world: World,
) -> None:
    dropins = world.beta.path.parent / f"{world.beta.name}.d"
    dropins.mkdir()
    (dropins / "10-fail.conf").write_text("[Service]\nExecStartPre=/bin/false\n", "utf-8")
    await world.units.reload()
    entry = await world.park("beta")
    pid_before = await main_pid(world, world.alpha.name)

    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.apply(entry.id, 1, ALPHA_VICTIM)

    assert result["ok"] is False and result["rolledBack"] is True, result
    start = step(result, "start")
    assert start["ok"] is False
    assert f"{world.beta.name}: start job failed" in start["detail"]
    assert "unit failed/failed (result exit-code)" in start["detail"]
    assert step(result, "rollback-stop")["ok"] is True
    verify = step(result, "rollback-verify")
    assert verify["ok"] is True and verify["detail"].startswith("alpha/a1 healthy again")
    assert result["error"].startswith("start: ") and result["error"].endswith("; rolled back")
    # A new alpha process, serving again; beta down; the result says what runs.
    assert await main_pid(world, world.alpha.name) not in (0, pid_before)
    await assert_alpha_serving(world)
    assert result["runningAfter"] == [alpha_running(world)]
    assert (
        f"running now: alpha/a1 on gpu0, {world.alpha.name}"
        in step(result, "rollback-clear")["detail"]
    )
    assert world.timeline.overlaps() == []
    assert world.controller.admission.get(entry.id) is not None


async def test_a_new_unit_that_vanishes_after_the_victim_stopped_does_not_block_the_rollback(
    world: World,
) -> None:
    """The issue's case: starting and then stopping the new unit both fail (it is gone);
    the victim must still come back, since nothing of the new unit runs."""

    def remove_beta(name: str, ok: bool) -> None:
        if name == "stop" and ok:
            world.beta.path.unlink()
            reload_now(world)

    world.events.step_hook = remove_beta
    entry = await world.park("beta")

    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.apply(entry.id, 1, ALPHA_VICTIM)

    assert result["ok"] is False and result["rolledBack"] is True, result
    start = step(result, "start")
    assert start["ok"] is False and "start job error" in start["detail"]
    rollback_stop = step(result, "rollback-stop")
    assert rollback_stop["ok"] is True
    assert f"{world.beta.name}, which this run started, does not exist" in rollback_stop["detail"]
    assert "stop job error" in rollback_stop["detail"]
    assert step_names(result)[-3:] == ["rollback-start", "rollback-verify", "rollback-clear"]
    await assert_alpha_serving(world)
    assert result["runningAfter"] == [alpha_running(world)]
    assert world.controller.alerts.active() == []


# --------------------------------------------------------------------------- (d) timeouts


def record_start_s(world: World, model: str, config: str, start_s: float) -> None:
    """Write a measured cold start into every registry file that describes ``config``."""
    for path in (world.paths.repo_registry, world.paths.local_registry):
        if not path.exists():
            continue
        doc = json.loads(path.read_text(encoding="utf-8"))
        configs = doc.get("models", {}).get(model, {}).get("configs", {})
        if config in configs:
            configs[config]["start_s"] = start_s
            path.write_text(json.dumps(doc), encoding="utf-8")


# The global verify-up wait is the old 600 s: only the derived bound can end this run.
MEASURED = Timeouts(
    **{
        **FAST.to_json(),
        "verify_up_s": 600.0,
        "measured_start_margin_s": 1.0,
        "measured_start_floor_s": 2.0,
    }
)


@pytest.mark.parametrize(
    "world_options",
    [{"beta_args": ["--never-healthy"], "timeouts": MEASURED}],
    indirect=True,
)
async def test_a_never_healthy_engine_with_a_measured_start_is_rolled_back_within_its_bound(
    world: World,
) -> None:
    record_start_s(world, "beta", "b1", 1.0)
    assert await world.controller.reload()
    assert world.controller.registry.models["beta"].configs["b1"].start_s == 1.0
    entry = await world.park("beta")

    # Queued like the auto runner's run (wait=True): unattended, so a failure is an alert.
    async with asyncio.timeout(GUARD_S):
        result = await world.enforcer.apply(entry, 1, ALPHA_VICTIM, wait=True)

    bound = max(
        MEASURED.measured_start_floor_s,
        MEASURED.measured_start_multiple * 1.0 + MEASURED.measured_start_margin_s,
    )
    assert bound == 4.0
    assert result["ok"] is False and result["rolledBack"] is True, result
    verify = step(result, "verify-up")
    assert verify["ok"] is False
    assert f"{world.beta.name} not healthy after {bound:g}s" in verify["detail"]
    assert (
        f"bound {bound:g}s (beta/b1 measured start 1s: max(2s, 3 × 1s + 1s))" in (verify["detail"])
    )
    assert step_names(result)[-4:] == [
        "rollback-stop",
        "rollback-start",
        "rollback-verify",
        "rollback-clear",
    ]
    await assert_alpha_serving(world)
    assert "hot" not in world.events.states_of("beta")
    (alert,) = (await views.state_json(world.controller))["alerts"]
    assert (alert["kind"], alert["severity"], alert["subject"]) == (
        "enforcement_failed",
        "warning",
        "beta",
    )
    assert alert["message"].startswith(f"auto-load: apply {entry.id} option 1 ")
    assert "failed and was rolled back: verify-up: " in alert["message"]
    assert (
        f"Running now: alpha/a1 on gpu0, {world.alpha.name} active/running." in (alert["message"])
    )


# --------------------------------------------------------------------------- (f) incomplete


async def test_an_orphan_holding_vram_makes_the_rollback_incomplete_and_raises_an_alert(
    world: World,
) -> None:
    """Once alpha stopped, an orphan (a process outside any unit) holds alpha's VRAM:
    beta cannot fit and alpha cannot come back. gpu0 ends empty: a critical alert."""
    orphans: list[subprocess.Popen[bytes]] = []

    def orphan_grabs_the_card(name: str, ok: bool) -> None:
        if name == "stop" and ok:
            orphan = subprocess.Popen(["sleep", str(GUARD_S * 2)])
            orphans.append(orphan)
            world.sim.claim(sim_uuid(0), orphan.pid, ALPHA_MIB, "llama-server (orphan)")

    world.events.step_hook = orphan_grabs_the_card
    entry = await world.park("beta")
    try:
        async with asyncio.timeout(GUARD_S):
            result = await world.controller.enforcement.apply(entry.id, 1, ALPHA_VICTIM)

        assert result["ok"] is False and result["rolledBack"] is False, result
        (orphan,) = orphans
        verify_free = step(result, "verify-free")
        assert f"pid {orphan.pid} `llama-server (orphan)`" in verify_free["detail"]
        assert "start" not in step_names(result)  # beta never started
        assert "; ROLLBACK INCOMPLETE: " in result["error"]
        assert f"{world.alpha.name} went failed" in result["error"]
        assert result["runningAfter"] == []
        assert world.controller.residents == []

        state = await views.state_json(world.controller)
        (alert,) = state["alerts"]
        assert (alert["kind"], alert["severity"], alert["subject"]) == (
            "rollback_incomplete",
            "critical",
            "gpu0",
        )
        assert alert["message"].startswith("ROLLBACK INCOMPLETE on gpu0: apply ")
        assert (
            f"alpha/a1 ({world.alpha.name}): {world.alpha.name} went failed" in (alert["message"])
        )
        assert "gpu0 is now EMPTY (it had alpha/a1)" in alert["message"]
        assert alert["detail"]["notRestored"][0]["unit"] == world.alpha.name
        assert [a.kind.value for a in world.events.alerts] == ["rollback_incomplete"]
        # The parked request is told at once rather than waiting for a model that is gone.
        assert (entry.id, "failed") in world.events.resolved
        assert world.controller.admission.get(entry.id) is None
    finally:
        for orphan in orphans:
            orphan.kill()
            orphan.wait()
            world.sim.release(orphan.pid)
    assert not any(pid_alive(o.pid) for o in orphans)
