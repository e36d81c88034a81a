"""The CPU tier's memory truth holds still, and a park's texts name commands that exist
(issue 19: "The CPU tier's memory truth is fragile", "the 409 text names a command that
does not exist").

The world: ``alpha`` (tiny-a, running, adopted) and ``beta`` (tiny-b, stopped), each
recorded at 100 MiB measured (``host_rss_mib``); ``cpu0``'s budget is the reserve plus
400 MiB, so beta fits beside alpha.

- ``test_the_host_room_holds_still_while_free_memory_swings``: ``GetState`` and
  ``uapplace status`` a second apart show the same ``room_mib`` for ``cpu0`` (``total −
  reserved − Σ host_rss_mib`` of the residents: 300 MiB) and the registry's reserve, and
  they still do after the test itself takes 512 MiB of the host's memory: the live free
  reading moved, the room placement uses and the reserve did not (docs/placement-rules.md
  §4.4). A reserve is the registry's figure, read, never derived again from a reading.
- ``test_a_park_names_the_commands_that_resolve_it_and_they_exist``: a request for beta
  through the gate proxy (:mod:`uapplace.sim.gateproxy`, in front of the world's shim)
  is parked with a ``409`` in both dialects, and the shim's own admit answers the same
  park; the texts (OpenAI ``message``, Anthropic ``message`` and ``resolve_with``, and
  ``uapplace pending``'s hint) name ``uapplace pending`` and ``uapplace apply``, every
  command they name is in ``uapplace --help``, and doing what they say works: ``uapplace
  pending`` lists the placement, ``uapplace apply ID 1 --yes`` loads beta, and the same
  request then goes through (docs/http-contract.md §2).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from tests.worlds.llama import PROXY_TOKEN, LlamaModel, LlamaWorld
from uapplace.gate import RESOLVE_WITH
from uapplace.sim import gateproxy

RESERVED_MIB = 256
BUDGET_MIB = 400
MODEL_MIB = 100.0
WORLD = (
    LlamaModel("alpha", "tiny-a", started=True, host_rss_mib=MODEL_MIB),
    LlamaModel("beta", "tiny-b", host_rss_mib=MODEL_MIB),
)
SWING_MIB = 512
"""What the test takes of the host's memory between two readings (a shared host's swing)."""
CLIENT = "host-truth"
COMMAND = re.compile(r"`(uapplace [^`]+)`")
"""A command a text names, in backticks."""

pytestmark = [pytest.mark.engines, pytest.mark.parametrize("world_models", [WORLD], indirect=True)]


@pytest.fixture
def world_options() -> dict[str, Any]:
    return {"cpu_total_mib": RESERVED_MIB + BUDGET_MIB, "cpu_reserved_mib": RESERVED_MIB}


async def cpu0(world: LlamaWorld) -> dict[str, Any]:
    device: dict[str, Any] = (await world.state())["devices"]["cpu0"]
    return device


async def status_cpu0_row(world: LlamaWorld) -> str:
    """The ``cpu0`` row of ``uapplace status``'s device table."""
    done = await world.cli("status")
    assert done.returncode == 0, done.stderr
    devices = done.stdout.split("Devices", 1)[1].split("Residents", 1)[0]
    [row] = [line for line in devices.splitlines() if re.match(r"^\W*cpu0\b", line)]
    return row


def taken_memory(mib: int) -> bytes:
    """``mib`` MiB held and written (every page resident), as another program would."""
    return b"\x5a" * (mib * 2**20)


async def test_the_host_room_holds_still_while_free_memory_swings(llama: LlamaWorld) -> None:
    expected_room = BUDGET_MIB - MODEL_MIB
    first = await cpu0(llama)
    first_row = await status_cpu0_row(llama)
    await asyncio.sleep(1.0)
    second = await cpu0(llama)
    second_row = await status_cpu0_row(llama)
    for reading in (first, second):
        assert (reading["room_mib"], reading["reserved_mib"]) == (expected_room, RESERVED_MIB)
    assert _room_of(first_row) == _room_of(second_row) == "300 MiB", (first_row, second_row)

    taken = taken_memory(SWING_MIB)
    try:
        swung = await cpu0(llama)
        swung_row = await status_cpu0_row(llama)
    finally:
        del taken
    assert second["free_mib"] - swung["free_mib"] >= SWING_MIB / 2, (second, swung)
    assert (swung["room_mib"], swung["reserved_mib"]) == (expected_room, RESERVED_MIB), swung
    assert _room_of(swung_row) == "300 MiB", swung_row
    assert await llama.alerts("below_reserve") == []
    print(
        f"\ncpu0 room {expected_room:.0f} MiB on every reading; free "
        f"{first['free_mib']:,.0f} → {second['free_mib']:,.0f} → {swung['free_mib']:,.0f} MiB"
    )


def _room_of(row: str) -> str:
    """The ``room`` cell of a device row (columns: device, kind, total, free, reserved,
    room, source)."""
    cells = [cell.strip() for cell in re.split(r"[│|]", row) if cell.strip()]
    return cells[5]


async def help_commands(world: LlamaWorld) -> set[str]:
    """The commands ``uapplace --help`` lists."""
    done = await world.cli("--help")
    assert done.returncode == 0, done.stderr
    listing = done.stdout.split("Commands:", 1)[1]
    return {m.group(1) for m in re.finditer(r"^  ([a-z][a-z-]*)\s", listing, re.MULTILINE)}


def named_commands(text: str) -> list[str]:
    """The subcommands of the ``uapplace …`` commands a text names."""
    return [command.split()[1] for command in COMMAND.findall(text)]


async def post_through_proxy(
    world: LlamaWorld, url: str, route: str, body: dict[str, Any]
) -> tuple[int, dict[str, str], dict[str, Any]]:
    headers = {gateproxy.CLIENT_HEADER: CLIENT}
    async with world.http.post(url + route, json=body, headers=headers) as reply:
        return reply.status, dict(reply.headers), await reply.json()


async def test_a_park_names_the_commands_that_resolve_it_and_they_exist(
    llama: LlamaWorld,
) -> None:
    proxy = gateproxy.GateProxy(llama.shim.base_url, PROXY_TOKEN)
    runner, url = await gateproxy.start(proxy)
    try:
        await _park_then_resolve_as_the_texts_say(llama, url)
    finally:
        await runner.cleanup()


async def _park_then_resolve_as_the_texts_say(llama: LlamaWorld, url: str) -> None:
    chat = {"model": "beta", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    status, headers, openai = await post_through_proxy(llama, url, "/v1/chat/completions", chat)
    assert (status, headers.get("Retry-After")) == (409, "2"), openai
    message = openai["error"]["message"]
    [placement] = re.findall(r"plc-[0-9a-f]{6}", message)
    assert message == (
        f"model beta is not loaded; resolve with `uapplace pending` (placement {placement})"
    ), message

    messages = {"model": "beta", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    status, _, anthropic = await post_through_proxy(llama, url, "/v1/messages", messages)
    assert status == 409, anthropic
    error = anthropic["error"]
    assert (error["type"], error["placement_id"], error["reason"]) == (
        "model_placement_pending",
        placement,
        "not_resident",
    ), error
    assert error["message"] == message
    assert error["resolve_with"] == RESOLVE_WITH

    # The shim answers the same park (one entry per client and model).
    admitted = await llama.admit("beta", f"{gateproxy.CLIENT_HEADER}:{CLIENT}")
    assert admitted == {"decision": "park", "placement_id": placement, "reason": "not_resident"}

    pending = await llama.cli("pending")
    assert pending.returncode == 0, pending.stderr
    assert placement in pending.stdout, pending.stdout
    assert "`uapplace apply ID OPTION`" in pending.stdout, pending.stdout
    named = named_commands(message) + named_commands(pending.stdout)
    alternatives = [part.strip() for part in error["resolve_with"].split("|")]
    assert all(part.startswith("uapplace ") for part in alternatives), alternatives
    named += [part.split()[1] for part in alternatives]
    assert set(named) == {"pending", "apply"}, named
    commands = await help_commands(llama)
    assert set(named) <= commands, (sorted(set(named) - commands), sorted(commands))

    # Doing what the text says resolves the park: the request then goes through.
    [entry] = [e for e in (await llama.cli_json("pending"))["pending"] if e["id"] == placement]
    assert entry["options"][0]["kind"] == "load_alongside", entry["options"]
    applied = await llama.cli("apply", placement, "1", "--yes")
    assert applied.returncode == 0, applied.stderr + applied.stdout
    await llama.wait_resident("beta", "hot")
    refresh = f"{url}{gateproxy.REFRESH_ROUTE}"
    auth = {"Authorization": f"Bearer {PROXY_TOKEN}"}
    async with llama.http.post(refresh, headers=auth) as reply:  # as the daemon does after a swap
        assert reply.status == 200, await reply.text()
    status, _, answer = await post_through_proxy(llama, url, "/v1/chat/completions", chat)
    assert status == 200, answer
    assert answer["model"] == "beta", answer
