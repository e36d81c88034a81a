"""End to end behind a proxy with one upstream, the stock UAP proxy's topology (issue 13).

Everything is real (:mod:`tests.systemd.live_world` with ``single_upstream=True``):
``alpha`` and ``beta`` are units of a contained ``systemd --user`` whose fake
engines listen on the *same* port, one at a time; the registry says
``proxy.single_upstream`` is that port; the gate proxy runs in its single-upstream
mode (every forward to that one address, ``target_id`` only for the slot and the
in-flight bucket). Both engines fit the card together (8000 MiB each of 24 GiB),
so only the topology keeps ``load_alongside`` off the options.

Also here, since an apply needs real units: the shim's event stream shows the
park, every step of the apply and the resolution, in order.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.systemd.conftest import APPLY_STEPS
from tests.systemd.live_world import GUARD_S, LiveWorld, validate
from uapplace.bus.events import parse_sse

pytestmark = pytest.mark.systemd

CLIENT = {"x-uap-client-id": "single-upstream", "x-uap-session-id": "s1"}


@pytest.fixture
def world_options() -> dict[str, Any]:
    """One upstream for both engines, and footprints that fit the card together."""
    return {"single_upstream": True, "mibs": (8000, 8000)}


@pytest.fixture
def world(live: LiveWorld) -> LiveWorld:
    """The tier's live machine (conftest) with the options above."""
    return live


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "say hello"}]}


async def ask(world: LiveWorld, model: str) -> tuple[int, Any]:
    async with world.http.post(
        world.proxy_url + "/v1/chat/completions", json=chat(model), headers=CLIENT
    ) as reply:
        return reply.status, await reply.json()


Seen = list[tuple[str, dict[str, Any]]]


def run_done(seen: Seen) -> bool:
    """The resolution and the run's last step have both arrived."""
    kinds = {event for event, _ in seen}
    last = [d["data"]["step"] for e, d in seen if e == "EnforcementStep"][-1:]
    return "Resolved" in kinds and last == ["resolve"]


async def read_events(http: aiohttp.ClientSession, url: str) -> Seen:
    """SSE messages from ``url`` until :func:`run_done`."""
    seen: Seen = []
    text = ""
    async with asyncio.timeout(GUARD_S * 2), http.get(url) as reply:
        assert reply.status == 200
        async for chunk in reply.content.iter_any():
            text += chunk.decode()
            seen = [(m.event, json.loads(m.data)) for m in parse_sse(text)]
            if run_done(seen):
                return seen
    return seen


async def test_park_apply_retry_through_one_upstream_with_the_event_stream(
    world: LiveWorld,
) -> None:
    assert world.alpha.port == world.beta.port
    events = asyncio.ensure_future(
        read_events(world.http, world.shim.base_url + "/api/placement/events")
    )
    await asyncio.sleep(0.5)  # connected before the park (a guard, not a measurement)

    status, answer = await ask(world, "alpha")
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == "Hello from alpha."

    status, parked = await ask(world, "beta")
    assert status == 409, parked
    placement_id = parked["error"]["message"].rsplit("placement ", 1)[1].rstrip(")")

    # Both would fit the card, but one port holds one engine: no load_alongside.
    options = await world.options_of(placement_id)
    assert [o["kind"] for o in options] == ["displace"], options
    victims = [
        {"model": v["model"], "config": v["config"], "action": v["action"]}
        for v in options[0]["victims"]
    ]
    assert victims == [{"model": "alpha", "config": "a1", "action": "stop"}]

    status, applied = await world.resolve(placement_id, 1, victims)
    assert status == 200, applied
    assert applied["ok"] is True, applied
    assert [s["name"] for s in applied["steps"]] == APPLY_STEPS
    verify_up = next(s for s in applied["steps"] if s["name"] == "verify-up")
    assert world.alpha.endpoint in verify_up["detail"]  # checked on the one upstream

    # The retry forwards through the same single upstream, now served by beta.
    status, answer = await ask(world, "beta")
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == "Hello from beta."
    assert world.target_of(world.beta) in world.proxy.inflight  # its slot bucket, by target

    # The stream: the park, the apply's steps in order, and the resolution after the
    # engine was verified.
    seen = await events
    kinds = [event for event, _ in seen]
    assert kinds[0] == "Parked" and seen[0][1]["data"]["placement_id"] == placement_id
    steps = [data["data"]["step"] for event, data in seen if event == "EnforcementStep"]
    assert steps == APPLY_STEPS
    (resolved,) = [(i, d["data"]) for i, (e, d) in enumerate(seen) if e == "Resolved"]
    assert resolved[1] == {"placement_id": placement_id, "outcome": "applied"}
    verified = next(
        i
        for i, (e, d) in enumerate(seen)
        if e == "EnforcementStep" and d["data"]["step"] == "verify-up"
    )
    assert resolved[0] > verified
    ids = [data["id"] for _, data in seen]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


async def test_validate_flags_a_second_port_under_a_single_upstream(world: LiveWorld) -> None:
    code, report = await asyncio.to_thread(validate, world)
    assert (code, report["ok"]) == (0, True), report
    registry = json.loads(world.uap.registry.read_text())
    registry["models"]["beta"]["endpoint"] = "http://127.0.0.1:9"
    world.uap.write_registry(registry)
    code, report = await asyncio.to_thread(validate, world)
    assert code == 1 and report["ok"] is False
    (finding,) = [f for f in report["findings"] if f["json_path"] == "$.models.beta.endpoint"]
    assert finding["severity"] == "error"
    assert "unreachable after a switch through a single-upstream proxy" in finding["message"]
    state = await world.shim_get("/api/placement/state")
    assert any(
        a["kind"] == "config_error" and a["subject"].endswith("proxy.single_upstream")
        for a in state["alerts"]
    )
