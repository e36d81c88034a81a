"""Enforcement (docs/placement-rules.md §4.6) in a contained user manager, real engines and HTTP.

Every test builds the two-model machine of :mod:`tests.systemd.placement_world`
(``alpha`` resident, ``beta`` needing its place), drives the real controller's
``apply`` and checks the machine afterwards: the unit states, the simulated
GPU, the residents, the signals. No two units of the device may ever run at
the same time, whatever fails.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

import pytest

from tests.systemd.conftest import APPLY_STEPS
from tests.systemd.placement_world import (
    ALPHA_MIB,
    BETA_MIB,
    FAST,
    GUARD_S,
    World,
    step_names,
)
from tests.worlds.steps import UNLOAD_STEPS
from uapplace.core.errors import Busy, Drifted
from uapplace.core.model import ParkReason
from uapplace.files.timeouts import Timeouts
from uapplace.io import engines
from uapplace.sim.gpu import sim_uuid

pytestmark = pytest.mark.systemd

ALPHA_VICTIM = ["alpha/a1"]


@pytest.fixture
def world(alpha_world: World) -> World:
    """``alpha`` hot, ``beta`` installed: every apply here displaces ``alpha`` (conftest's
    ``alpha_world``; ``world_options`` shapes it)."""
    return alpha_world


def allocations(world: World) -> list[float]:
    return sorted(a.used_mib for a in world.sim.read().allocations)


async def unit_state(world: World, unit: str) -> str:
    return (await world.units.state(unit)).active_state


async def assert_alpha_back(world: World) -> None:
    """The victim runs again, healthy and serving, hot in the residents; beta is down."""
    assert await unit_state(world, world.alpha.name) == "active"
    assert await engines.health(world.alpha.endpoint)
    assert await engines.served_ids(world.alpha.endpoint) == ["alpha"]
    await world.events.until(lambda: world.state_of("alpha") == "hot")
    assert await unit_state(world, world.beta.name) in ("inactive", "failed")
    assert world.resident("beta") is None
    assert world.enforcer.marks.draining == frozenset()
    assert world.timeline.overlaps() == []


# --------------------------------------------------------------------------- success


async def test_displace_swap_stops_alpha_and_serves_beta(world: World) -> None:
    entry = await world.park("beta")
    assert [o.kind.value for o in entry.options] == ["displace"]

    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.apply(entry.id, 1, ALPHA_VICTIM)

    assert result["ok"] is True, result
    assert result["placementId"] == entry.id
    assert "rolledBack" not in result and "error" not in result
    assert step_names(result) == APPLY_STEPS
    assert all(step["ok"] for step in result["steps"])
    # Each step also went out as an EnforcementStep signal, in order, under one run id.
    assert [s[1] for s in world.events.steps] == APPLY_STEPS
    assert {s[0] for s in world.events.steps} == {result["runId"]}

    assert await unit_state(world, world.alpha.name) == "inactive"
    assert await unit_state(world, world.beta.name) == "active"
    assert allocations(world) == [BETA_MIB]
    assert world.resident("alpha") is None
    beta = world.resident("beta")
    assert beta is not None and beta.state.value == "hot"
    assert beta.target_id == f"gpu0:{world.beta.endpoint}"
    assert (entry.id, "applied") in world.events.resolved
    assert world.proxy.refreshes == 1
    assert "draining" in world.events.states_of("alpha")
    assert world.events.states_of("alpha")[-1] == "gone"
    assert world.timeline.overlaps() == []

    # Admit now forwards beta (and its advertised id) to the new resident.
    forwarded = world.controller.admit("beta-latest", "client-1", "", 0)
    assert (forwarded.decision, forwarded.target_id) == ("forward", beta.target_id)


async def test_a_failed_proxy_refresh_is_a_failed_step_not_a_failed_swap(world: World) -> None:
    world.proxy.refresh_fails = True
    entry = await world.park("beta")

    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.apply(entry.id, 1, ALPHA_VICTIM)

    assert result["ok"] is True
    refresh = next(s for s in result["steps"] if s["name"] == "refresh-proxy")
    assert refresh["ok"] is False and "HTTP 500" in refresh["detail"]
    assert world.state_of("beta") == "hot"


# --------------------------------------------------------------------------- rollback


ROLLBACK_CASES = {
    "exits-at-start": ({"beta_args": ["--fail-at-start"]}, "verify-up", "went failed"),
    "never-healthy": (
        {
            "beta_args": ["--never-healthy"],
            "timeouts": Timeouts(**{**FAST.to_json(), "verify_up_s": 1.5}),
        },
        "verify-up",
        "not healthy after 1.5s",
    ),
    "wrong-id": ({"beta_args": ["--wrong-id"]}, "verify-up", "serves [wrong-beta], not beta"),
    "wrong-kv-metrics": (
        {"beta_args": ["--kv", "f16"]},
        "verify-up",
        "kv is 'f16', policy wants 'int8'",
    ),
}


@pytest.mark.parametrize(
    ("world_options", "failing_step", "says"),
    list(ROLLBACK_CASES.values()),
    ids=list(ROLLBACK_CASES),
    indirect=["world_options"],
)
async def test_a_failed_new_backend_is_rolled_back_and_alpha_is_healthy_again(
    world: World, failing_step: str, says: str
) -> None:
    entry = await world.park("beta")

    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.apply(entry.id, 1, ALPHA_VICTIM)

    assert result["ok"] is False and result["rolledBack"] is True, result
    failed = [s for s in result["steps"] if not s["ok"]]
    assert [s["name"] for s in failed] == [failing_step]
    assert says in failed[0]["detail"]
    assert result["error"].startswith(f"{failing_step}: ") and result["error"].endswith(
        "; rolled back"
    )
    assert step_names(result)[-4:] == [
        "rollback-stop",
        "rollback-start",
        "rollback-verify",
        "rollback-clear",
    ]
    await assert_alpha_back(world)
    assert allocations(world) == [ALPHA_MIB]
    # beta was never published as hot: admission never forwarded to a broken backend.
    assert "hot" not in world.events.states_of("beta")
    # The pending entry is still there for the operator (the swap did not happen), and
    # says ``failed``: the client's retry can tell it from waiting (issue 21 item 2).
    failed_entry = world.controller.admission.get(entry.id)
    assert failed_entry is not None and failed_entry.reason is ParkReason.FAILED
    retry = world.controller.admit("beta", entry.client, "", 0)
    assert (retry.placement_id, retry.reason) == (entry.id, "failed")


@pytest.mark.parametrize("world_options", [{"orphan": True}], indirect=True)
async def test_an_orphan_holding_vram_is_named_and_the_swap_rolled_back(world: World) -> None:
    await world.events.until(world.orphan_pidfile.exists)
    orphan = world.orphan_pid()
    entry = await world.park("beta")

    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.apply(entry.id, 1, ALPHA_VICTIM)

    assert result["ok"] is False and result["rolledBack"] is True, result
    verify = next(s for s in result["steps"] if s["name"] == "verify-free")
    assert verify["ok"] is False
    assert f"pid {orphan}" in verify["detail"]
    assert "not an expected resident" in verify["detail"]
    assert f"{ALPHA_MIB:,} MiB" in verify["detail"]
    assert "start" not in step_names(result)  # beta was never started
    assert step_names(result)[-3:] == ["rollback-start", "rollback-verify", "rollback-clear"]
    await assert_alpha_back(world)


@pytest.mark.parametrize(
    "world_options",
    [
        {
            # No TimeoutStopSec= of its own: stop_s alone bounds the wait (a finite one is
            # awaited past, docs/placement-rules.md §4.6 "Forced stops").
            "alpha_service": "ExecStop=/bin/sleep 1\nTimeoutStopSec=infinity",
            "timeouts": Timeouts(**{**FAST.to_json(), "stop_s": 0.3}),
        }
    ],
    indirect=True,
)
async def test_a_stop_job_that_fails_rolls_back_without_starting_beta(world: World) -> None:
    entry = await world.park("beta")

    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.apply(entry.id, 1, ALPHA_VICTIM)

    assert result["ok"] is False and result["rolledBack"] is True, result
    stop = next(s for s in result["steps"] if s["name"] == "stop")
    assert stop["ok"] is False and "stop job timeout" in stop["detail"]
    assert "start" not in step_names(result)
    await assert_alpha_back(world)


async def test_a_victim_that_cannot_come_back_is_reported_not_retried(world: World) -> None:
    # Someone grabs the card the moment alpha's memory is free: beta cannot claim its
    # 16000 MiB (it exits), and alpha cannot claim its 14000 MiB back either.
    def grab(step: str, ok: bool) -> None:
        if step == "verify-free" and ok:
            world.sim.claim(sim_uuid(0), os.getpid(), 12000, "someone else")

    world.events.step_hook = grab
    entry = await world.park("beta")

    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.apply(entry.id, 1, ALPHA_VICTIM)

    assert result["ok"] is False and result["rolledBack"] is False, result
    assert "; ROLLBACK INCOMPLETE: " in result["error"]
    assert f"{world.alpha.name} went failed" in result["error"]
    names = step_names(result)
    assert names.count("rollback-start") == 1  # tried once, never looped
    assert names[-3:] == ["rollback-start", "rollback-verify", "rollback-clear"]
    assert await unit_state(world, world.alpha.name) == "failed"
    assert await unit_state(world, world.beta.name) == "failed"
    assert world.controller.residents == []
    assert world.enforcer.marks.draining == frozenset()
    assert world.timeline.overlaps() == []


# --------------------------------------------------------------------------- drain


async def test_drain_waits_for_in_flight_work_and_admit_stops_forwarding(world: World) -> None:
    target = world.target_of(world.alpha)
    world.proxy.set_inflight(target, "claude-code")
    entry = await world.park("beta")

    run = asyncio.create_task(world.controller.enforcement.apply(entry.id, 1, ALPHA_VICTIM))
    try:
        await world.events.until(lambda: world.state_of("alpha") == "draining")
        calls_before = world.proxy.inflight_calls
        await world.events.until(lambda: world.proxy.inflight_calls > calls_before + 1)
        # Mid-drain: alpha still runs, but admission no longer forwards to it.
        assert await unit_state(world, world.alpha.name) == "active"
        assert world.controller.admit("alpha", "other", "", 0).decision == "park"
        # A unit-state resync mid-drain keeps the marker.
        await world.sync.sync_all()
        assert world.state_of("alpha") == "draining"
        # One enforcement at a time: a second operator call is refused at once.
        with pytest.raises(Busy, match="another enforcement is running"):
            await world.enforcer.load("alpha", [])
        world.proxy.set_inflight(target)  # the request finished
        async with asyncio.timeout(GUARD_S):
            result = await run
    finally:
        run.cancel()
    assert result["ok"] is True, result
    drain = next(s for s in result["steps"] if s["name"] == "drain")
    assert drain["ok"] and "no in-flight work" in drain["detail"]
    assert world.state_of("beta") == "hot"


@pytest.mark.parametrize("unknown", [False, True], ids=["busy", "proxy-unknown"])
async def test_drain_timeout_rolls_back_without_cutting_anyone_off(
    world: World, unknown: bool
) -> None:
    if unknown:
        world.proxy.unavailable = True
    else:
        world.proxy.set_inflight(world.target_of(world.alpha), "claude-code")
    entry = await world.park("beta")
    seen_before = len(world.timeline.changes)

    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.apply(entry.id, 1, ALPHA_VICTIM)

    assert result["ok"] is False and result["rolledBack"] is True, result
    assert step_names(result) == [
        "revalidate",
        "preflight",
        "mark-draining",
        "drain",
        "rollback-clear",
    ]
    drain = result["steps"][3]
    expected = "unknown counts as busy" if unknown else "1 in flight (claude-code)"
    assert expected in drain["detail"] and "nothing was cut off" in drain["detail"]
    # Never stopped, never restarted: alpha ran all along and is hot again.
    assert world.timeline.changes[seen_before:] == []
    await assert_alpha_back(world)
    assert world.events.states_of("alpha")[-2:] == ["draining", "hot"]


# --------------------------------------------------------------------------- revalidate


async def test_a_changed_victim_set_is_refused_before_anything_is_touched(world: World) -> None:
    entry = await world.park("beta")

    with pytest.raises(
        Drifted, match=r"victim set changed: approved \[gamma/g1\], now \[alpha/a1\]"
    ):
        await world.controller.enforcement.apply(entry.id, 1, ["gamma/g1"])

    assert [(s[1], s[2]) for s in world.events.steps] == [("revalidate", False)]
    assert world.state_of("alpha") == "hot"
    assert await unit_state(world, world.alpha.name) == "active"
    assert "draining" not in world.events.states_of("alpha")


async def test_unload_drains_stops_and_frees_the_device(world: World) -> None:
    async with asyncio.timeout(GUARD_S):
        result = await world.controller.enforcement.unload("alpha", ["alpha/a1"])

    assert result["ok"] is True, result
    assert step_names(result) == UNLOAD_STEPS
    assert world.resident("alpha") is None
    assert allocations(world) == []
    assert await unit_state(world, world.alpha.name) == "inactive"


async def test_load_with_room_starts_alongside_without_victims(world: World) -> None:
    async with asyncio.timeout(GUARD_S):
        unloaded = await world.controller.enforcement.unload("alpha", ["alpha/a1"])
        assert unloaded["ok"], unloaded
        result = await world.controller.enforcement.load("alpha", [])

    assert result["ok"] is True, result
    details: Sequence[str] = [s["detail"] for s in result["steps"][2:5]]
    assert details == ["no victims", "no victims", "no victims"]
    assert world.state_of("alpha") == "hot"
    assert allocations(world) == [ALPHA_MIB]
