"""The start-up repair of a llama.cpp router run (issue 19), against the real fake router.

The world of :mod:`tests.systemd.test_router_pause` (the fake router as one real unit on
a contained ``systemd --user``, ``ra`` and ``rb`` each a child process claiming its
memory on the simulated card, ``--models-max 1``). Each test leaves the router as a
swap ``ra`` → ``rb`` cut short at one step would (the dead daemon's requests sent by the
test), writes that run's journal, and calls :func:`~uapplace.recovery.recover.recover`
with the real HTTP engine and router clients, as uapplaced does at start. The router's
MainPID never changes (its unit is never stopped for one of its models) and the card
ends holding what the ledger says. The same rows over fakes, one by one:
``tests/unit/test_recovery_router.py``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.systemd.test_router_pause import MIB, RouterWorld, load_ra, world
from uapplace.core.model import Resident, ResidentState
from uapplace.core.steps import PAUSE, ROLLBACK_STOP, VERIFY_UP
from uapplace.enforce.host import ControllerRecoveryHost
from uapplace.files.journal import Journal, RunRecord
from uapplace.io import router
from uapplace.io.router import HTTP_ROUTER
from uapplace.recovery.recover import recover
from uapplace.recovery.repair import Outcome, RecoveryReport

pytestmark = pytest.mark.systemd

__all__ = ["world"]  # the fixture, shared with test_router_pause

GUARD_S = 30.0


def resident_of(world: RouterWorld, model: str) -> Resident:
    found = next(r for r in world.controller.residents if r.model == model)
    return found


def cut_short(world: RouterWorld, step: str, ra: Resident) -> RunRecord:
    """The journal of the swap ``ra`` (paused) → ``rb`` at ``step``."""
    rb_config = world.controller.registry.models["rb"].configs["rb-q4"]
    rb = Resident(
        model="rb",
        config="rb-q4",
        device=ra.device,
        engine="llama.cpp",
        endpoint=world.endpoint,
        unit=world.unit,
        state=ResidentState.HOT,
        gpu_mib=rb_config.resident_gpu_mib,
        host_rss_mib=rb_config.host_rss_mib,
        since=ra.since,
    )
    now = time.time()
    return RunRecord(
        run_id="run-router-cut",
        kind="apply",
        requested="rb",
        device=ra.device,
        placement_id=None,
        victims=(ra,),
        new=rb,
        accepted_ids=("rb", "rb-q4"),
        step=step,
        started_at=now,
        updated_at=now,
        detail="verify-up: cut" if step == ROLLBACK_STOP else "",
        victim_actions={ra.signature: "pause"},
        paused=(ra.signature,),
    )


async def until_status(world: RouterWorld, model: str, want: str) -> None:
    await router.wait_for(HTTP_ROUTER, world.endpoint, model, frozenset({want}), GUARD_S)


async def repaired(world: RouterWorld, tmp_path: Path, record: RunRecord) -> RecoveryReport:
    journal = Journal(tmp_path / "enforcement-journal.json")
    await journal.record(record)
    async with asyncio.timeout(GUARD_S):
        report = await recover(
            journal,
            ControllerRecoveryHost(world.controller),
            world.units,
            timeouts=world.stack.enforcer.timeouts,
        )
    assert report is not None
    assert journal.read() is None
    return report


async def statuses(world: RouterWorld) -> dict[str, str]:
    return {k: m.status for k, m in (await HTTP_ROUTER.models(world.endpoint, 2)).items()}


async def ra_unloaded_rb_asked(world: RouterWorld) -> tuple[int, Resident]:
    """What the dead daemon's swap had done: ``ra`` unloaded, the router asked to load
    ``rb``; the router's main PID and ``ra`` as a resident before the swap."""
    router_pid = await load_ra(world)
    ra = resident_of(world, "ra")
    await HTTP_ROUTER.unload(world.endpoint, "ra", 2)
    await until_status(world, "ra", "unloaded")
    await HTTP_ROUTER.load(world.endpoint, "rb", 2)
    return router_pid, ra


async def test_row2_killed_at_verify_up_with_rb_loaded_finishes_without_a_restart(
    world: RouterWorld, tmp_path: Path
) -> None:
    router_pid, ra = await ra_unloaded_rb_asked(world)

    report = await repaired(world, tmp_path, cut_short(world, VERIFY_UP, ra))

    assert report.outcome is Outcome.FINISHED, report.message
    assert await world.main_pid() == router_pid
    assert (await statuses(world))["rb"] == "loaded"
    assert world.claims() == {"rb": MIB["rb"]}
    assert world.states() == {"ra": "paused", "rb": "hot"}


async def test_row4_killed_while_rolling_back_unloads_rb_and_loads_ra_again(
    world: RouterWorld, tmp_path: Path
) -> None:
    router_pid, ra = await ra_unloaded_rb_asked(world)
    await until_status(world, "rb", "loaded")

    report = await repaired(world, tmp_path, cut_short(world, ROLLBACK_STOP, ra))

    assert report.outcome is Outcome.ROLLED_BACK, report.message
    assert await world.main_pid() == router_pid
    assert world.claims() == {"ra": MIB["ra"]}
    assert world.states() == {"ra": "hot"}


async def test_row16_killed_at_pause_settles_the_unload_then_loads_ra_again(
    world: RouterWorld, tmp_path: Path
) -> None:
    router_pid = await load_ra(world)
    ra = resident_of(world, "ra")
    await HTTP_ROUTER.unload(world.endpoint, "ra", 2)  # the dead daemon's unload, in flight

    report = await repaired(world, tmp_path, cut_short(world, PAUSE, ra))

    assert report.outcome is Outcome.ROLLED_BACK, report.message
    assert "unload may have been in flight" in report.message
    assert await world.main_pid() == router_pid
    assert (await statuses(world))["ra"] == "loaded"
    assert world.claims() == {"ra": MIB["ra"]}
    assert world.states() == {"ra": "hot"}
