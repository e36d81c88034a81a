"""A forward answered just before an Apply is waited for (issue 20, forward leases).

The machine of tests/systemd/test_notify_apply.py (the real ``uapplaced`` on the contained
``systemd --user``, real units running the fake engine, the proxy's internal routes over
real HTTP), with a long forward lease (``forward_lease_s`` :data:`LEASE_S` in
``enforcement-timeouts.json``). ``Admit`` answers ``forward`` to ``alpha``; the operator
applies the swap to ``beta`` at once; the proxy lists the forwarded request only after the
swap has marked ``alpha`` draining, when the drain's first look has found its list empty.
Without the lease that look passes and ``alpha`` stops under the request (what issue 20
saw: drain passed in 0.01 s, the client got the new model's answer); with it, the drain
waits, sees the request and only stops ``alpha`` once it has ended
(docs/placement-rules.md §4.6, "Forward leases").
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.systemd import test_notify_apply as notify_world
from tests.systemd.test_notify_apply import Machine
from tests.systemd.test_park_during_swap import set_inflight
from tests.worlds import polling

pytestmark = pytest.mark.systemd

LEASE_S = 5.0
"""Long enough that the request is listed well within it on a loaded machine (revalidate
and preflight take seconds there)."""

machine = notify_world.machine
"""The shared machine fixture (alpha resident, beta and gamma installed)."""


@pytest.fixture(autouse=True)
def long_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    """Autouse runs before ``machine`` writes ``enforcement-timeouts.json``."""
    timeouts = {**notify_world.TIMEOUTS, "forward_lease_s": LEASE_S, "drain_s": 20.0}
    monkeypatch.setattr(notify_world, "TIMEOUTS", timeouts)


async def test_a_forward_answered_just_before_apply_is_waited_for(machine: Machine) -> None:
    log = machine.daemon.log
    swap_for = await machine.park("beta", "swap-asker")
    options = await polling.until("beta's options", lambda: _options(machine, swap_for), log)
    assert options[0]["signature"] == ["alpha/a1"]
    alpha_target = f"gpu0:{machine.engines['alpha'].endpoint}"

    forwarded = await machine.client.admit("alpha", "late-client", "", 0)
    answered = time.monotonic()
    assert forwarded == {"decision": "forward", "target_id": alpha_target}
    machine.client.call_timeout = None  # the run takes as long as its steps take
    swap = asyncio.create_task(machine.client.apply(swap_for, 1, ["alpha/a1"]))
    await machine.until(
        "the swap to mark alpha draining",
        lambda: any(step == "mark-draining" for step, _ok, _d in machine.signals.steps()),
    )
    # Only now does the proxy send (and list) the request it was told to forward.
    await set_inflight(machine, alpha_target, [{"id": "late-1", "client": "late-client"}])
    listed_after = time.monotonic() - answered
    assert listed_after < LEASE_S, f"listed {listed_after:.2f}s after the answer: no proof"

    await asyncio.sleep(LEASE_S - listed_after + 0.5)  # past the lease: the list was asked
    steps = [step for step, _ok, _d in machine.signals.steps()]
    assert "stop" not in steps, steps
    assert await machine.active("alpha") == "active"

    await set_inflight(machine, alpha_target, [])  # the request ended: the drain ends
    result = await swap
    assert result["ok"] is True, result
    drain = next(s["detail"] for s in result["steps"] if s["name"] == "drain")
    waited_for = drain.split("waited for: ", 1)[1].split("; asked: ", 1)[0]
    assert f"{alpha_target}: forward lease" in waited_for, drain
    assert f"lease {LEASE_S:g}s" in drain
    assert await machine.active("alpha") == "inactive"
    assert await machine.active("beta") == "active"


async def _options(machine: Machine, placement_id: str) -> list[Any] | None:
    listed = await machine.client.list_pending()
    entry = next((e for e in listed["pending"] if e["id"] == placement_id), None)
    return entry["options"] if entry is not None and entry["options"] else None
