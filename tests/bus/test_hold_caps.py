"""Holds are bounded over the real bus (issue 20): 70 holds with a 1 MiB reason and app id
made ``GetState``/``Preview`` fail for everyone, and 300 took the daemon to 2.48 GB. Now a
reason or app id over 1,024 characters is ``InvalidArgument`` naming it, a connection or an
app id past 32 holds and the daemon past 256 are ``Busy`` naming the cap, and everyone
else's calls keep answering."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.bus.conftest import DaemonProcess
from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.controller.holds import MAX_HOLDS, MAX_HOLDS_PER_CLIENT
from uapplace.daemon.service import MAX_REASON_CHARS
from uapplace.files import jsonfile

pytestmark = pytest.mark.bus

FULL = "r" * MAX_REASON_CHARS


async def refused(client: PlacementClient, reason: str, app_id: str) -> PlacementError:
    with pytest.raises(PlacementError) as caught:
        await client.hold("alpha", reason, app_id)
    return caught.value


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line")


async def test_a_1_mib_reason_or_app_id_is_refused_by_name(client: PlacementClient) -> None:
    big = "r" * (1 << 20)
    error = await refused(client, big, "app")
    assert error.short == "InvalidArgument"
    assert "argument reason: 1,048,576 characters, over the 1,024 limit" in error.message
    error = await refused(client, "why", big)
    assert error.short == "InvalidArgument" and "argument app_id: 1,048,576" in error.message
    assert (await client.get_state())["holds"] == []


async def test_hold_counts_are_capped_and_everyone_else_still_answers(
    daemon: DaemonProcess, client: PlacementClient
) -> None:
    before = rss_mib(daemon.pid)
    for _ in range(MAX_HOLDS_PER_CLIENT):
        await client.hold("alpha", FULL, "greedy")
    error = await refused(client, FULL, "other-app")
    assert error.short == "Busy" and "has 32 holds, the 32 one connection may take" in error.message
    others: list[PlacementClient] = []
    try:
        while len(others) * MAX_HOLDS_PER_CLIENT < MAX_HOLDS - MAX_HOLDS_PER_CLIENT:
            other = await PlacementClient.connect(daemon.uap.bus_address)
            others.append(other)
            for index in range(MAX_HOLDS_PER_CLIENT):
                await other.hold("beta", FULL, f"app-{len(others)}-{index}")
        error = await refused(others[-1], "one more", "fresh-app")
        assert error.short == "Busy"
        assert "256 holds are taken, the 256 uapplaced keeps at most" in error.message
        started = time.monotonic()
        state = await client.get_state()
        preview = await client.preview("beta", 0)
        assert time.monotonic() - started < 5.0
        assert len(state["holds"]) == MAX_HOLDS and preview["model"] == "beta"
        assert rss_mib(daemon.pid) - before < 200  # was 2.48 GB at 300 holds of 1 MiB
    finally:
        for other in others:
            other.disconnect()
    ledger = daemon.uap.ledger
    assert ledger.stat().st_size < jsonfile.LEDGER_MAX_BYTES
    json.loads(ledger.read_text())
    assert not list(ledger.parent.glob("placement.json.corrupt-*"))
    assert "Traceback" not in daemon.log()
