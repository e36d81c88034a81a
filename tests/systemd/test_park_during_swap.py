"""A request parked while a swap runs is re-planned once the swap ends (issue 13).

The machine of tests/systemd/test_notify_apply.py (the real ``uapplaced`` on the
contained ``systemd --user``, real units running the fake engine on one simulated
24 GiB GPU, the proxy's internal routes over real HTTP): ``alpha`` (10000 MiB) is
resident, an ``Apply`` swaps it for ``beta`` (17000 MiB), and a request for
``alpha`` parks while that swap is under way (planned then, ``alpha`` is still
resident, draining or stopping, so there is nothing to offer). Once the swap has
ended, the entry must show the options a fresh ``Preview`` shows: stop ``beta``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.systemd import test_notify_apply as world
from tests.systemd.test_notify_apply import Machine
from tests.worlds import polling

pytestmark = pytest.mark.systemd

machine = world.machine
"""The shared machine fixture (alpha resident, beta and gamma installed)."""


async def entry(machine: Machine, placement_id: str) -> dict[str, Any]:
    listed = await machine.client.list_pending()
    found: dict[str, Any] = next(e for e in listed["pending"] if e["id"] == placement_id)
    return found


async def set_inflight(machine: Machine, target: str, requests: list[dict[str, Any]]) -> None:
    """The sim proxy's own control route: what it lists as in flight on ``target``."""
    url = machine.daemon.uap.env["UAP_PROXY_URL"] + "/_sim/inflight"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json={"target": target, "requests": requests}) as response,
    ):
        assert response.status == 200, await response.text()


async def test_a_park_made_during_a_swap_shows_the_previewed_options_after_it(
    machine: Machine,
) -> None:
    log = machine.daemon.log
    swap_for = await machine.park("beta", "swap-asker")
    options = await polling.until("beta's options", lambda: _options(machine, swap_for), log)
    assert options[0]["signature"] == ["alpha/a1"]

    # A request in flight on alpha holds the swap in its drain until we end it, so
    # the next park certainly lands mid-swap (alpha draining, still resident).
    alpha_target = f"gpu0:{machine.engines['alpha'].endpoint}"
    await set_inflight(machine, alpha_target, [{"id": "req-1", "client": "busy-client"}])
    machine.client.call_timeout = None  # the run takes as long as its steps take
    swap = asyncio.create_task(machine.client.apply(swap_for, 1, ["alpha/a1"]))
    await machine.until(
        "the swap to mark alpha draining",
        lambda: any(step == "mark-draining" for step, _ok, _d in machine.signals.steps()),
    )
    parked_mid_swap = await machine.park("alpha", "mid-swap-asker")
    await set_inflight(machine, alpha_target, [])  # the request finished: the drain ends
    result = await swap
    assert result["ok"], result
    assert await machine.active("beta") == "active"
    assert await machine.active("alpha") == "inactive"

    replanned = await polling.until(
        "the mid-swap park's options", lambda: _options(machine, parked_mid_swap), log
    )
    preview = await machine.client.preview("alpha", 0)
    assert preview["reason"] == "ok"
    assert replanned == preview["options"]
    assert replanned[0]["signature"] == ["beta/b1"]


async def _options(machine: Machine, placement_id: str) -> list[Any]:
    options: list[Any] = (await entry(machine, placement_id))["options"]
    return options
