"""Nothing stops without a yes, on every operator path (issue 10, "Must show" (g)).

The world of :mod:`tests.systemd.live_world`: real units running the fake engine
on one simulated 24 GiB GPU, the real ``uapplaced`` on the contained user
manager's bus and the real ``uapplace-shim`` in front of it. ``alpha``
(14000 MiB) is resident; ``beta`` (16000 MiB) fits only by stopping it, so
``Preview(beta)``'s recommended option has the signature ``[alpha/a1]``.

Every refusal is proved by its outcome: ``alpha``'s unit is still active and its
resident still ``hot``.
"""

from __future__ import annotations

import asyncio
import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.systemd.conftest import UnitFiles
from tests.systemd.live_world import CLI_TIMEOUT_S, LiveWorld, cli, live_world
from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.io.units import UnitManager
from uapplace.shim.bodies import MISSING_SIGNATURE
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.systemd


@pytest.fixture
async def world(
    user_manager: ContainedUserManager, units: UnitManager, unit_files: UnitFiles, tmp_path: Path
) -> AsyncIterator[LiveWorld]:
    async with live_world(tmp_path, user_manager.bus_address, units, unit_files) as live:
        yield live


def answer_on_a_terminal(world: LiveWorld, args: list[str], answer: str) -> tuple[int, str]:
    """Run the CLI on a pseudo-terminal, answer its y/N prompt; exit code and what it showed."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "uapplace.cli", *args],
        env=world.uap.env,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        close_fds=True,
    )
    os.close(follower)
    shown = b""
    answered = False
    deadline = time.monotonic() + CLI_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(leader, 4096)
                except OSError:  # the terminal closed: the command exited
                    break
                if not chunk:
                    break
                shown += chunk
            if not answered and b"[y/N]" in shown:
                os.write(leader, answer.encode() + b"\n")
                answered = True
            if process.poll() is not None and not ready:
                break
        return process.wait(timeout=CLI_TIMEOUT_S), shown.decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(leader)


async def assert_untouched(world: LiveWorld) -> None:
    assert await world.active(world.alpha) == "active"
    assert await world.active(world.beta) == "inactive"
    assert (await world.resident_states()) == {"alpha": "hot"}


async def test_load_that_evicts_needs_a_yes_and_the_signature_it_showed(world: LiveWorld) -> None:
    # The CLI without --yes (no terminal to ask on): impact printed, nothing stops, exit 1.
    code, out, err = await cli(world, "load", "beta")
    assert code == 1, out + err
    assert "Load beta: displace beta/b1 on gpu0" in out
    assert "alpha/a1" in out and "It stops" in out and "Frees 14,000 MiB in total." in out
    assert "nothing stopped; re-run with --yes" in err
    await assert_untouched(world)

    # Unload shows what stops and needs the same yes.
    code, out, err = await cli(world, "unload", "alpha")
    assert code == 1, out + err
    assert "Unload alpha:" in out and "alpha/a1" in out
    await assert_untouched(world)

    # A stale or empty signature on the bus: Drifted, nothing stops.
    client = await PlacementClient.connect(world.uap.bus_address)
    try:
        for stale in ([], ["alpha/a0"], ["alpha/a1", "gamma/g1"]):
            with pytest.raises(PlacementError) as drifted:
                await client.load("beta", stale)
            assert drifted.value.short == "Drifted", drifted.value
            assert "now [alpha/a1]" in drifted.value.message
        with pytest.raises(PlacementError) as drifted:
            await client.unload("alpha", [])
        assert drifted.value.short == "Drifted"
    finally:
        client.disconnect()
    await assert_untouched(world)

    # The shim's load route: an omitted signature is refused as required; a stale one drifts.
    token = world.shim.token
    status, body = await world.shim_post("/api/placement/load", {"model": "beta"}, token)
    assert status == 409 and body["error"].startswith(MISSING_SIGNATURE), body
    stale_body = {
        "model": "beta",
        "expected_victims": [{"model": "alpha", "config": "a0", "action": "stop"}],
    }
    status, body = await world.shim_post("/api/placement/load", stale_body, token)
    assert status == 409 and "victim set changed" in body["error"], body
    await assert_untouched(world)

    # On a terminal it asks instead; anything but y stops nothing.
    code, shown = await asyncio.to_thread(answer_on_a_terminal, world, ["load", "beta"], "n")
    assert code == 1, shown
    assert "Stop the models above to load beta? [y/N]" in shown and "nothing stopped" in shown
    await assert_untouched(world)

    # With --yes the CLI sends the signature it showed and follows the run to its end.
    code, out, err = await cli(world, "load", "beta", "--yes")
    assert code == 0, out + err
    for step in ("revalidate", "drain", "stop", "verify-free", "start", "verify-up"):
        assert f" {step}" in out, (step, out)
    assert "load beta: done" in out
    print(f"\n`uapplace load beta --yes`:\n{out}")
    assert await world.active(world.alpha) == "inactive"
    assert await world.active(world.beta) == "active"
    assert (await world.resident_states()).get("beta") == "hot"

    # Unload with --yes sends PreviewUnload's signature and stops exactly that.
    code, out, err = await cli(world, "unload", "beta", "--yes")
    assert code == 0, out + err
    assert "beta/b1" in out and "unload beta: done" in out
    assert await world.active(world.beta) == "inactive"
    assert "beta" not in await world.resident_states()
