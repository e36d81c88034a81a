"""A switch never cuts an engine's work silently, on a contained ``systemd --user`` (issue 19).

The machine is :mod:`tests.systemd.placement_world`'s (``alpha`` resident on the simulated
GPU, ``beta`` needing its place). Two promises, with real units, real signals and HTTP:

- a stream sent **straight to the engine** (not through the proxy, so not in its
  in-flight list) holds the stop back: the drain asks the engine's ``/slots``
  (docs/placement-rules.md §4.6, "Drain: the engine's own word"), and the stream
  ends whole;
- a victim that ignores ``SIGTERM`` (llama-server does while it generates) is
  ``SIGKILL``ed by systemd after ``TimeoutStopSec=``, and uapplace says so: the
  ``stop`` step is not ok and names it, the unit's ``Result``/``ExecMainCode``/
  ``ExecMainStatus`` are what it read, a ``forced_stop`` alert is raised, and the switch
  goes on (docs/placement-rules.md §4.6, "Forced stops").

The fake engine is not changed for this: alpha's ``ExecStart=`` becomes a shell that
traps ``TERM`` and runs the engine as its child, under ``KillMode=mixed`` (``SIGTERM``
to the main process only, the final ``SIGKILL`` to the whole cgroup).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from tests.systemd.placement_world import FAST, GUARD_S, World, step, step_names
from tests.worlds.polling import until
from tests.worlds.steps import APPLY_STEPS, UNLOAD_STEPS
from uapplace.core.alerts import AlertKind, Severity
from uapplace.io import engines
from uapplace.io.units import CLD_KILLED

pytestmark = pytest.mark.systemd

STOP_TIMEOUT_S = 1
TOKENS = 40
TOKEN_SECS = 0.05
"""A direct stream of 40 tokens, one every 50 ms: about 2 s of generation."""


@pytest.fixture
def world_options() -> dict[str, Any]:
    """alpha generates slowly; the drain may wait long enough for its stream to end. The
    stop bound is shorter than alpha's ``TimeoutStopSec=``: a stop job is awaited that
    long plus a margin anyway, so systemd's SIGKILL, not our deadline, ends it."""
    return {
        "alpha_args": ["--token-secs", str(TOKEN_SECS)],
        "timeouts": replace(FAST, drain_s=GUARD_S, stop_s=0.2),
    }


async def ignore_sigterm(world: World) -> None:
    """Rewrite alpha's unit: a shell that traps TERM runs the engine; SIGKILL after 1 s."""
    text = world.alpha.path.read_text(encoding="utf-8")
    [line] = [row for row in text.splitlines() if row.startswith("ExecStart=")]
    command = line.removeprefix("ExecStart=")
    assert not set(command) & set("'\"%$"), command  # no quoting or specifiers to escape
    wrapped = f"ExecStart=/bin/sh -c 'trap \"\" TERM; {command} & wait'"
    extra = f"KillMode=mixed\nTimeoutStopSec={STOP_TIMEOUT_S}\n"
    world.alpha.path.write_text(text.replace(line, wrapped) + extra, encoding="utf-8")
    await world.units.reload()


async def direct_stream(endpoint: str) -> list[str]:
    """A completion streamed straight from the engine: every ``data:`` payload received."""
    body = {"prompt": "hello", "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    events: list[str] = []
    timeout = aiohttp.ClientTimeout(total=GUARD_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(f"{endpoint}/v1/completions", json=body) as response,
    ):
        assert response.status == 200
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    return events


async def test_a_stream_straight_to_the_engine_is_drained_not_cut(
    alpha_world: World,
) -> None:
    world = alpha_world
    entry = await world.park("beta")
    stream = asyncio.create_task(direct_stream(world.alpha.endpoint))
    try:
        await until("alpha's slot processing the stream", lambda: slots_processing(world))
        async with asyncio.timeout(GUARD_S):
            started = time.monotonic()
            result = await world.controller.enforcement.apply(entry.id, 1, ["alpha/a1"])
            events = await stream
    finally:
        stream.cancel()

    assert result["ok"] is True, result
    assert step_names(result) == APPLY_STEPS
    assert world.proxy.inflight_calls > 1  # the proxy's list was empty all along
    drain = step(result, "drain")["detail"]
    assert "alpha/a1 engine: idle (/props is_sleeping false, /slots 0 of " in drain
    waited = float(drain.split("(waited ", 1)[1].split("s;", 1)[0])
    assert waited > 0.3  # it waited for the stream, which was mid-generation
    assert time.monotonic() - started >= waited
    # The stream ended whole: its last chunk has a finish reason, then [DONE].
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("length", "stop")
    assert world.state_of("beta") == "hot"


async def slots_processing(world: World) -> bool:
    slots = await engines.slots(world.alpha.endpoint)
    return any(slot.get("is_processing") for slot in slots or ())


@pytest.mark.parametrize("verb", ["unload", "apply"])
async def test_a_victim_that_ignores_sigterm_is_reported_stopped_by_sigkill(
    built_world: World, verb: str
) -> None:
    world = built_world
    await ignore_sigterm(world)
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
        started = time.monotonic()
        if verb == "unload":
            result = await world.controller.enforcement.unload("alpha", ["alpha/a1"])
        else:
            entry = await world.park("beta")
            result = await world.controller.enforcement.apply(entry.id, 1, ["alpha/a1"])
    took = time.monotonic() - started

    assert result["ok"] is True, result  # the victim is down: the switch went on
    assert step_names(result) == (UNLOAD_STEPS if verb == "unload" else APPLY_STEPS)
    stop = step(result, "stop")
    assert stop["ok"] is False
    assert stop["detail"] == (
        f"stopped {world.alpha.name}; {world.alpha.name} stopped by SIGKILL after the stop "
        "timeout (unit result timeout): in-flight work may have been cut (not fatal: the "
        "victims are down, the switch goes on; a forced_stop alert says so)"
    )
    assert took >= STOP_TIMEOUT_S  # systemd waited TimeoutStopSec= before its SIGKILL
    state = await world.units.state(world.alpha.name)
    assert (state.active_state, state.result) == ("failed", "timeout")
    assert (state.exec_main_code, state.exec_main_status) == (CLD_KILLED, 9)
    assert await world.units.pids(world.alpha.name) == []  # nothing of alpha is left
    forced = [a for a in world.events.alerts if a.kind is AlertKind.FORCED_STOP]
    assert [(a.severity, a.subject) for a in forced] == [(Severity.WARNING, world.alpha.name)]
    assert forced[0].detail["result"] == "timeout"
    assert forced[0].detail["execMainStatus"] == 9
    assert world.resident("alpha") is None
    if verb == "apply":
        assert world.state_of("beta") == "hot"
    assert world.timeline.overlaps() == []
