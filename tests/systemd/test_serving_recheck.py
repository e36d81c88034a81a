"""A ``hot`` engine put to sleep by hand is unpublished within the re-check bound, and
published again once it is woken (issue 20, "Serving means serving, continuously").

The machine of :mod:`tests.systemd.placement_world` with ``alpha`` alone: a unit of the
contained ``systemd --user`` running the fake engine in vLLM's sleep mode
(``--sleep-mode``), adopted ``hot`` by ``uapplaced`` (a real process on that manager's
bus, ``serving_check_s`` 0.5). The test then calls the engine's own ``POST /sleep``
directly, as anyone on the machine could, and the daemon must show, within
:meth:`~uapplace.files.timeouts.Timeouts.serving_bound_s`:

- ``alpha`` no longer ``hot`` (``warming``), an admit for it parked ``warming``, never
  forwarded to an engine that would answer 503;
- a ``not_serving`` alert naming the unit and the problem ``asleep``;

and after the test's ``POST /wake_up``, ``alpha`` ``hot`` again and the alert ``info``,
saying it serves again. Both with the pause lever declared in the registry
(``vllm-sleep-1``) and without (an engine started in sleep mode that the registry
knows nothing about): docs/placement-rules.md §4.2, "Serving is re-checked".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from tests.bus.conftest import DaemonProcess, start_daemon
from tests.systemd.conftest import EngineUnit, Machine
from tests.systemd.live_world import seed_daemon_files
from tests.systemd.placement_world import FAST, declare_pause_lever, registry_json
from tests.worlds import polling
from uapplace.bus.client import PlacementClient
from uapplace.io import engines
from uapplace.publish.publication import MEMORY_TICK_S
from uapplace.sim.gpu import SimGpu

pytestmark = pytest.mark.systemd

GUARD_S = 30.0
"""Upper bound on any wait: a hang guard, never an assertion about speed."""
TIMEOUTS = replace(FAST, serving_check_s=0.5)
BOUND_S = TIMEOUTS.serving_bound_s()
SLOW = "slow"
"""The world's parameter for the default period (5 s): only the probe's sign is quick."""
SLOW_TIMEOUTS = replace(FAST, serving_check_s=5.0)
SIGN_S = MEMORY_TICK_S + 1.5
"""A memory tick, the re-check it pokes (one look, the engine local) and the test's polls."""
SLACK_S = 1.0
"""The test's own GetState polls (every 50 ms) on a loaded 2-core host."""


@dataclass
class World:
    daemon: DaemonProcess
    client: PlacementClient
    alpha: EngineUnit

    async def until(self, what: str, check: Callable[[], Any], guard_s: float = GUARD_S) -> Any:
        return await polling.until(what, check, self.daemon.log, guard_s=guard_s)

    async def alpha_state(self) -> str | None:
        state = await self.client.get_state()
        return next((r["state"] for r in state["residents"] if r["model"] == "alpha"), None)

    async def not_serving_alert(self) -> dict[str, Any] | None:
        alerts = (await self.client.get_state())["alerts"]
        return next((a for a in alerts if a["kind"] == "not_serving"), None)


@pytest.fixture
async def world(machine: Machine, request: pytest.FixtureRequest) -> AsyncIterator[World]:
    lever: str | None = request.param
    timeouts = SLOW_TIMEOUTS if lever == SLOW else TIMEOUTS
    lever = None if lever == SLOW else lever
    units, unit_files = machine.units, machine.unit_files
    uap = machine.uap()
    sim = SimGpu(Path(uap.env["UAPPLACE_SIM_GPU"]))
    args = ["--load-secs", "0.2", "--kv", "int8", "--sleep-mode", "--sleep-delay", "0.3"]
    alpha = unit_files.engine("alpha", "alpha", sim, mib=14000, engine_args=args)
    beta = unit_files.engine("beta", "beta", sim, mib=16000, engine_args=args)
    await units.reload()
    registry = registry_json(alpha, beta)
    if lever is not None:
        declare_pause_lever(registry, lever)
    seed_daemon_files(uap, registry, timeouts)
    started = await units.start_unit(alpha.name, GUARD_S)
    assert started.ok, started
    daemon = await asyncio.to_thread(start_daemon, uap)
    try:
        client = await PlacementClient.connect(uap.bus_address, call_timeout=GUARD_S)
        try:
            yield World(daemon, client, alpha)
        finally:
            client.disconnect()
    finally:
        code = await asyncio.to_thread(daemon.stop)
        assert code == 0, f"uapplaced exited {code}:\n{daemon.log()[-4000:]}"


@pytest.mark.parametrize(
    "world",
    [pytest.param("vllm-sleep-1", id="lever"), pytest.param(None, id="no-lever")],
    indirect=True,
)
async def test_a_hot_engine_put_to_sleep_by_hand_is_unpublished_within_the_bound(
    world: World,
) -> None:
    async def alpha_hot() -> bool:
        return await world.alpha_state() == "hot"

    await world.until("alpha hot", alpha_hot)
    first = await world.client.admit("alpha", "recheck-test", "", 0)
    assert first["decision"] == "forward", first

    slept_at = time.monotonic()
    await engines.sleep(world.alpha.endpoint, 1, timeout=GUARD_S)  # by hand, not through us
    assert await engines.is_sleeping(world.alpha.endpoint) is True

    async def unpublished() -> str | None:
        state = await world.alpha_state()
        return state if state not in (None, "hot") else None

    state = await world.until("alpha unpublished", unpublished, guard_s=BOUND_S + SLACK_S)
    took = time.monotonic() - slept_at
    print(f"unpublished {took:.2f}s after the sleep answered (bound {BOUND_S:g}s): {state}")
    assert state == "warming"
    assert took <= BOUND_S + SLACK_S

    parked = await world.client.admit("alpha", "recheck-test", "", 0)
    assert (parked["decision"], parked["reason"]) == ("park", "warming"), parked
    alert = await world.not_serving_alert()
    assert alert is not None, (await world.client.get_state())["alerts"]
    assert (alert["severity"], alert["subject"]) == ("warning", world.alpha.name), alert
    assert alert["detail"]["problem"] == "asleep", alert
    assert "is asleep (vLLM POST /sleep, /is_sleeping)" in alert["message"], alert
    assert "does not wake on a request" in alert["message"], alert
    await asyncio.sleep(4 * TIMEOUTS.serving_check_s)  # verification keeps it unpublished
    assert await world.alpha_state() == "warming"

    await engines.wake(world.alpha.endpoint, GUARD_S)
    await world.until("alpha hot again", alpha_hot)

    async def served_again() -> dict[str, Any] | None:
        found = await world.not_serving_alert()
        return found if found is not None and found["severity"] == "info" else None

    again = await world.until("the alert to say alpha serves again", served_again)
    assert "serves again: re-published hot" in again["message"], again
    forwarded = await world.client.admit("alpha", "recheck-test", "", 0)
    assert forwarded["decision"] == "forward", forwarded


@pytest.mark.parametrize("world", [pytest.param(SLOW, id="sign")], indirect=True)
async def test_the_probe_showing_its_memory_gone_re_checks_before_the_period(
    world: World,
) -> None:
    """With the default 5 s period, the sleep frees alpha's simulated-GPU claim: the probe,
    read alone every second, sees the collapse and the re-check runs at once."""

    async def alpha_hot() -> bool:
        return await world.alpha_state() == "hot"

    await world.until("alpha hot", alpha_hot)
    await asyncio.sleep(SLOW_TIMEOUTS.serving_check_s + 0.5)  # a first round: the baseline
    await engines.sleep(world.alpha.endpoint, 1, timeout=GUARD_S)
    slept_at = time.monotonic()

    async def unpublished() -> bool:
        return await world.alpha_state() == "warming"

    await world.until("alpha unpublished on the probe's sign", unpublished, guard_s=GUARD_S)
    took = time.monotonic() - slept_at
    print(f"unpublished {took:.2f}s after the sleep (period {SLOW_TIMEOUTS.serving_check_s:g}s)")
    assert took <= SIGN_S, f"{took:.2f}s: not on the probe's sign (period 5 s)"
