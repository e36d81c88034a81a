"""Pause for llama.cpp made executable (issue 19): a router model's swap, wake, unload and
rollback over fakes (:mod:`router_fakes`), with the real planner and enforcer.

What the finding was: the "swap" restarted the whole router unit and verify-up passed
with both models unloaded. Here every run shows the router's calls in order, that no
unit job ran while the router was up, and what the ledger holds after.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from enforce_fakes import ok, steps
from router_fakes import ROUTER_UNIT, RouterWorld, router_resident

from tests.worlds.steps import APPLY_STEPS
from uapplace.core.model import PAUSE_SUFFIX, OptionKind, ResidentState

PAUSED = ResidentState.PAUSED
RA_PAUSE = [f"ra/ra-q4{PAUSE_SUFFIX}"]
RB_PAUSE = [f"rb/rb-q4{PAUSE_SUFFIX}"]


def names(result: dict[str, Any]) -> list[str]:
    return [s["name"] for s in result["steps"]]


def detail(result: dict[str, Any], name: str) -> str:
    return " | ".join(str(s["detail"]) for s in result["steps"] if s["name"] == name)


def forms(world: RouterWorld, model: str) -> list[tuple[str, tuple[str, ...]]]:
    return [(o.kind.value, o.signature) for o in world.park(model).options]


async def test_a_swap_between_two_models_of_one_router_unloads_then_loads(
    tmp_path: Path,
) -> None:
    world = RouterWorld(tmp_path, [router_resident("ra")])
    entry = world.park("rb")
    # The sibling must go (they never fit together); it pauses by unloading.
    assert forms(world, "rb") == [("displace", tuple(RA_PAUSE)), ("displace", ("ra/ra-q4",))]
    assert "the router unloads it" in entry.options[0].victims[0].consequence

    result = await world.enforcer.apply(entry, 1, RA_PAUSE)

    assert result["ok"] is True, result
    assert steps(result) == ok(*APPLY_STEPS[:4], "pause", *APPLY_STEPS[4:])
    assert world.routers.calls == ["unload ra", "load rb"]
    assert world.units.jobs == []  # the router unit was never stopped nor started
    assert "already active (no unit start)" in detail(result, "start")
    assert "rb loaded in the router router.service" in detail(result, "verify-up")
    assert world.states() == {"ra/ra-q4": "paused", "rb/rb-q4": "hot"}
    paused = next(r for r in world.host.live if r.model == "ra")
    assert (paused.gpu_mib, paused.host_rss_mib) == (0.0, 0.0)  # its process is gone
    world.assert_ended_cleanly()


async def test_the_stop_form_unloads_and_forgets_but_never_stops_the_router(
    tmp_path: Path,
) -> None:
    world = RouterWorld(tmp_path, [router_resident("ra")])
    entry = world.park("rb")

    result = await world.enforcer.apply(entry, 2, ["ra/ra-q4"])

    assert result["ok"] is True, result
    assert "pause" not in names(result)
    assert "ra/ra-q4 unloaded from the router router.service" in detail(result, "stop")
    assert world.routers.calls == ["unload ra", "load rb"]
    assert world.units.jobs == []
    assert world.states() == {"rb/rb-q4": "hot"}


async def test_a_paused_router_model_wakes_by_loading(tmp_path: Path) -> None:
    world = RouterWorld(tmp_path, [router_resident("ra", PAUSED), router_resident("rb")])
    entry = world.park("ra")
    assert [o.kind for o in entry.options] == [OptionKind.WAKE, OptionKind.WAKE]
    assert entry.options[0].signature == tuple(RB_PAUSE)

    result = await world.enforcer.apply(entry, 1, RB_PAUSE)

    assert result["ok"] is True, result
    assert "wake" in names(result) and "start" not in names(result)
    assert world.routers.calls == ["unload rb", "load ra"]
    assert world.units.jobs == []
    assert world.states() == {"ra/ra-q4": "hot", "rb/rb-q4": "paused"}


async def test_a_paused_sibling_is_not_in_the_way(tmp_path: Path) -> None:
    world = RouterWorld(tmp_path, [router_resident("ra", PAUSED)])
    # ra is unloaded: it holds no place in the router and nothing on the card.
    assert forms(world, "rb") == [("load_alongside", ())]
    result = await world.enforcer.apply(world.park("rb"), 1, [])
    assert result["ok"] is True, result
    assert world.routers.calls == ["load rb"]
    assert world.states() == {"ra/ra-q4": "paused", "rb/rb-q4": "hot"}


async def test_a_router_that_is_down_is_started_then_asked_to_load(tmp_path: Path) -> None:
    world = RouterWorld(tmp_path, [], router_up=False)

    result = await world.enforcer.apply(world.park("ra"), 1, [])

    assert result["ok"] is True, result
    assert world.units.jobs == [f"start {ROUTER_UNIT}"]
    assert world.routers.calls == ["load ra"]
    assert f"started the router {ROUTER_UNIT}" in detail(result, "start")
    assert world.states() == {"ra/ra-q4": "hot"}


async def test_a_load_that_fails_is_rolled_back_and_the_victim_loaded_again(
    tmp_path: Path,
) -> None:
    world = RouterWorld(tmp_path, [router_resident("ra")])
    world.routers.fail_load.add("rb")

    result = await world.enforcer.apply(world.park("rb"), 1, RA_PAUSE)

    assert result["ok"] is False and result["rolledBack"] is True, result
    assert "rb unloaded (failed, exit code 1)" in detail(result, "verify-up")
    assert names(result)[-3:] == ["rollback-stop", "rollback-wake", "rollback-clear"]
    assert all(s["ok"] for s in result["steps"] if s["name"].startswith("rollback")), result
    assert world.routers.calls == ["unload ra", "load rb", "unload rb", "load ra"]
    assert world.units.jobs == []
    assert world.states() == {"ra/ra-q4": "hot"}
    world.assert_ended_cleanly()


async def test_a_load_that_never_ends_is_bounded_and_undone(tmp_path: Path) -> None:
    world = RouterWorld(tmp_path, [router_resident("ra")])
    world.routers.never_loads.add("rb")

    result = await world.enforcer.apply(world.park("rb"), 1, RA_PAUSE)

    assert result["ok"] is False and result["rolledBack"] is True, result
    assert "not loaded or sleeping" in detail(result, "verify-up")
    assert "(last seen: rb loading)" in detail(result, "verify-up")
    assert world.routers.status["rb"] == "unloaded" and "rb" not in world.routers.child
    assert world.states() == {"ra/ra-q4": "hot"}


async def test_a_victim_the_router_cannot_unload_rolls_back_with_nothing_loaded(
    tmp_path: Path,
) -> None:
    world = RouterWorld(tmp_path, [router_resident("ra")])
    world.routers.ignores_unload.add("ra")

    result = await world.enforcer.apply(world.park("rb"), 1, RA_PAUSE)

    assert result["ok"] is False and result["rolledBack"] is True, result
    assert "unload from the router router.service" in detail(result, "pause")
    assert "load rb" not in world.routers.calls  # nothing was loaded beside it
    assert world.states() == {"ra/ra-q4": "hot"}


async def test_rollback_stops_a_router_this_run_started(tmp_path: Path) -> None:
    world = RouterWorld(tmp_path, [], router_up=False)
    world.routers.fail_load.add("ra")

    result = await world.enforcer.apply(world.park("ra"), 1, [])

    assert result["ok"] is False and result["rolledBack"] is True, result
    assert world.units.jobs == [f"start {ROUTER_UNIT}", f"stop {ROUTER_UNIT}"]
    assert world.units.running()[ROUTER_UNIT] == "inactive"
    assert world.states() == {}


async def test_unload_of_a_router_model_keeps_the_router_running(tmp_path: Path) -> None:
    world = RouterWorld(tmp_path, [router_resident("ra")])

    result = await world.enforcer.unload("ra", ["ra/ra-q4"])

    assert result["ok"] is True, result
    assert world.routers.calls == ["unload ra"]
    assert world.units.jobs == [] and world.units.running()[ROUTER_UNIT] == "active"
    assert world.states() == {}
