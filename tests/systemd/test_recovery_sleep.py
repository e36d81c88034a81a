"""The pause and wake rows of the crash recovery, live (issue 20): a SIGKILL of
``uapplaced`` while a victim's ``/sleep`` or a paused model's ``/wake_up`` is in flight.

The machine of :mod:`tests.systemd.test_crash_recovery` (``alpha`` 14000 MiB, ``beta``
16000 MiB, one simulated 24 GiB GPU, both engines in vLLM's sleep mode and both configs
``pause_lever: vllm-sleep-1``), with engines that take 2 s to sleep and to wake. The
daemon SIGKILLs itself right after journaling the step (``UAPPLACE_TEST_CRASH_AT``); the
request the dead daemon had in flight is then sent by the test (an engine keeps serving
a request whose client died, so this is what the engine sees either way), and the daemon
is started again:

- **sleep in flight** (a pause switch, killed at ``pause``): the repair must not trust
  one look at ``alpha`` answering awake (it falls asleep 2 s later); it settles the sleep,
  wakes ``alpha`` and verifies it: ``alpha`` ``hot`` and still awake after the sleep the
  dead daemon had sent has long finished; the alert says the sleep was in flight.
- **wake in flight** (a wake run, killed at ``wake``): the repair waits for the wake
  within the wake bound, sees ``alpha`` awake and verified: the run is finished, ``alpha``
  ``hot``, ``beta`` (which the run stopped) gone; the alert says the wake may have been in
  flight.

docs/invariants.md ("Crash recovery"); the rows are numbered in
:mod:`uapplace.recovery.recover`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest

from tests.systemd.conftest import Machine
from tests.systemd.test_crash_recovery import (
    GUARD_S,
    Case,
    CrashWorld,
    crash_world,
    option_signature,
    park_beta,
    planned_options,
    resident_states,
)
from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.io import engines

pytestmark = pytest.mark.systemd

LEVER_S = 2.0
"""How long each engine takes to sleep and to wake (``--sleep-delay``, ``--wake-delay``)."""
SETTLED_S = LEVER_S + 1.0
"""Past the in-flight request's own end: an engine that was going to fall asleep has."""


@pytest.fixture
async def sleep_world(
    machine: Machine, request: pytest.FixtureRequest
) -> AsyncIterator[CrashWorld]:
    lever = ["--sleep-mode", "--sleep-delay", f"{LEVER_S:g}", "--wake-delay", f"{LEVER_S:g}"]
    case: Case = request.param
    async with crash_world(case, machine, lever) as world:
        yield world


async def in_flight(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """The request the dead daemon had sent, sent now; given a moment to reach the engine."""
    task = asyncio.create_task(coro)
    await asyncio.sleep(0.2)
    assert not task.done(), "the engine answered at once: nothing was in flight"
    return task


async def killed_apply(world: CrashWorld, client: PlacementClient, call: Any) -> None:
    apply = asyncio.ensure_future(call)
    await world.until_killed()
    with pytest.raises(PlacementError):
        await apply  # the daemon died mid-call


@pytest.mark.parametrize(
    "sleep_world",
    [pytest.param(Case("pause", (), "rolled_back", "alpha", pause=True), id="sleep-in-flight")],
    indirect=True,
)
async def test_a_kill_while_the_victims_sleep_is_in_flight_never_publishes_it_asleep(
    sleep_world: CrashWorld,
) -> None:
    world = sleep_world
    client = await world.start_daemon("pause")
    try:
        await world.until_alpha_hot(client)
        placement_id, index, signature = await park_beta(world, client)
        assert signature == ["alpha/a1@pause"], signature
        await killed_apply(world, client, client.apply(placement_id, index, signature))
    finally:
        client.disconnect()
    journal = json.loads(world.journal.read_text(encoding="utf-8"))
    assert (journal["step"], journal["paused"]) == ("pause", ["alpha/a1"]), journal
    sleep = await in_flight(engines.sleep(world.alpha.endpoint, 1, timeout=GUARD_S))
    assert await engines.is_sleeping(world.alpha.endpoint) is False, "not asleep yet"

    client = await world.start_daemon(None)
    try:
        found = await world.recovery_alert(client, journal["run_id"])
        print(f"sleep in flight: {found['message']}")
        assert (found["kind"], found["detail"]["outcome"]) == ("recovery_done", "rolled_back")
        message = found["message"]
        assert "alpha/a1's sleep was in flight when uapplaced died" in message, found
        assert "woke alpha/a1" in message and "nothing to repair" not in message, found
        await world.until_residents(client, {"alpha": "hot"})
        with contextlib.suppress(engines.EngineError):
            await sleep  # the dead daemon's sleep has ended (however the engine answered it)
        await asyncio.sleep(SETTLED_S)
        assert await engines.is_sleeping(world.alpha.endpoint) is False
        assert await resident_states(client) == {"alpha": "hot"}
        forwarded = await client.admit("alpha", "crash-test", "", 0)
        assert forwarded["decision"] == "forward", forwarded
        pending = {e["id"] for e in (await client.list_pending())["pending"]}
        assert placement_id in pending, "rolled back: the placement stays pending, re-planned"
        assert (await world.units.state(world.beta.name)).active_state in ("inactive", "failed")
        assert not world.journal.exists()
    finally:
        client.disconnect()
    assert world.timeline.overlaps() == [], world.timeline.changes


async def wake_option(world: CrashWorld, client: PlacementClient) -> tuple[str, int, list[str]]:
    """Admit alpha (paused: parks), its ``wake`` option's index and signature (the planner
    offers to stop beta for it: beta's own pause would leave its weights in host RAM)."""
    decision = await client.admit("alpha", "crash-test", "", 0)
    assert decision["decision"] == "park", decision
    placement_id = decision["placement_id"]
    options = await planned_options(world, client, placement_id, "alpha's options")
    index, option = next((i, o) for i, o in enumerate(options, 1) if o["kind"] == "wake")
    return placement_id, index, option_signature(option)


@pytest.mark.parametrize(
    "sleep_world",
    [pytest.param(Case("wake", (), "finished", "alpha", pause=True), id="wake-in-flight")],
    indirect=True,
)
async def test_a_kill_while_a_wake_is_in_flight_waits_for_it_and_finishes_the_run(
    sleep_world: CrashWorld,
) -> None:
    world = sleep_world
    client = await world.start_daemon("wake")
    try:
        await world.until_alpha_hot(client)
        placement_id, index, signature = await park_beta(world, client)
        result = await client.apply(placement_id, index, signature)  # pauses alpha: no wake
        assert result["ok"], result
        await world.until_residents(client, {"alpha": "paused", "beta": "hot"})
        placement_id, index, signature = await wake_option(world, client)
        await killed_apply(world, client, client.apply(placement_id, index, signature))
    finally:
        client.disconnect()
    journal = json.loads(world.journal.read_text(encoding="utf-8"))
    assert (journal["step"], journal["wake"]["model"]) == ("wake", "alpha"), journal
    assert (await world.units.state(world.beta.name)).active_state == "inactive", "stopped"
    wake = await in_flight(engines.wake(world.alpha.endpoint, GUARD_S))
    assert await engines.is_sleeping(world.alpha.endpoint) is True, "not awake yet"

    client = await world.start_daemon(None)
    try:
        found = await world.recovery_alert(client, journal["run_id"])
        print(f"wake in flight: {found['message']}")
        assert (found["kind"], found["detail"]["outcome"]) == ("recovery_done", "finished")
        message = found["message"]
        assert "alpha/a1's wake may have been in flight (journal step wake)" in message, found
        assert "published alpha/a1 hot" in message, found
        await world.until_residents(client, {"alpha": "hot"})
        await wake
        assert await engines.is_sleeping(world.alpha.endpoint) is False
        assert (await world.units.state(world.beta.name)).active_state == "inactive"
        pending = {e["id"] for e in (await client.list_pending())["pending"]}
        assert placement_id not in pending, "finished: the placement is resolved"
        assert not world.journal.exists()
    finally:
        client.disconnect()
    assert world.timeline.overlaps() == [], world.timeline.changes
