"""Serving is re-checked, on the REAL ``llama-server`` (issue 20): a router model that is
``hot`` and unloaded by hand (``POST /models/unload`` on the router, not through
uapplace) is unpublished within the re-check bound, and published again once it is
loaded by hand.

The world is :func:`tests.engines.test_router.real_router` (a real router unit,
``--models-max 1``, the real controller and enforcer in this process, the unit sync's
re-check every ``serving_check_s`` = 5 s, the default). An unloaded router model
frees its whole footprint but its router keeps answering ``/health`` 200 and lists it in
``/v1/models``: only its status in ``GET /models`` tells, and the re-check reads it there
(docs/placement-rules.md §4.2, "Serving is re-checked"; never ``/slots``, which would
load it).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.engines.test_router import GUARD_S, TIMEOUTS, RealRouter, real_router  # noqa: F401
from uapplace.core.alerts import AlertKind, Severity
from uapplace.io.router import HTTP_ROUTER

pytestmark = pytest.mark.engines

BOUND_S = TIMEOUTS.serving_bound_s()
SLACK_S = 2.0
"""The test's own polls and a loaded 2-core host."""


async def test_a_router_model_unloaded_by_hand_is_unpublished_then_republished(
    real_router: RealRouter,  # noqa: F811 - the fixture imported above
) -> None:
    world = real_router
    await world.load_alone("ra")
    assert world.states() == {"ra": "hot"}
    assert world.controller.admit("ra", "client-1", "", 0).decision == "forward"

    await HTTP_ROUTER.unload(world.endpoint, "ra", GUARD_S)
    unloaded_at = time.monotonic()
    async with asyncio.timeout(BOUND_S + SLACK_S):
        await world.events.until(lambda: world.states() == {"ra": "warming"})
    took = time.monotonic() - unloaded_at
    print(f"ra unpublished {took:.2f}s after the unload (bound {BOUND_S:g}s)")
    assert (await world.statuses())["ra"] == "unloaded", "nothing of ours loaded it again"
    parked = world.controller.admit("ra", "client-1", "", 0)
    assert (parked.decision, parked.reason) == ("park", "warming"), parked
    active = world.controller.alert_board.active()
    alert = next(a for a in active if a.kind is AlertKind.NOT_SERVING)
    assert (alert.severity, alert.detail["problem"]) == (Severity.WARNING, "gone"), alert
    assert "not loaded, so not serving" in alert.message, alert.message

    await HTTP_ROUTER.load(world.endpoint, "ra", GUARD_S)
    await world.events.until(lambda: world.states() == {"ra": "hot"})
    assert world.controller.admit("ra", "client-1", "", 0).decision == "forward"
