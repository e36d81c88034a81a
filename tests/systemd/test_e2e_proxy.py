"""End to end: a client behind the gate proxy, a park, the operator's yes, the retry that forwards.

Everything is real (see :mod:`tests.systemd.live_world`): engines as units of a
contained ``systemd --user``, ``uapplaced`` on its bus, ``uapplace-shim`` in
front, and a small aiohttp proxy built on :mod:`uapplace.gate` forwarding
``/v1/messages`` (Anthropic) and ``/v1/chat/completions`` (OpenAI) to the
admitted target's endpoint. ``alpha`` is resident; ``beta`` needs it displaced.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.systemd.conftest import APPLY_STEPS
from tests.systemd.live_world import LiveWorld
from uapplace.gate import RESOLVE_WITH

pytestmark = pytest.mark.systemd

CLIENT = {"x-uap-client-id": "e2e-client", "x-uap-session-id": "e2e-session"}


@pytest.fixture
def world(live: LiveWorld) -> LiveWorld:
    """The tier's live machine (conftest), every part a real program."""
    return live


async def ask(world: LiveWorld, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    async with world.http.post(world.proxy_url + path, json=body, headers=CLIENT) as reply:
        return reply.status, dict(reply.headers), await reply.json()


def messages_body(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 32,
        "messages": [{"role": "user", "content": "say hello"}],
    }


def chat_body(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "say hello"}]}


async def test_park_then_operator_apply_then_the_retry_forwards(world: LiveWorld) -> None:
    # The resident answers through the proxy (OpenAI dialect), straight away.
    status, _, answer = await ask(world, "/v1/chat/completions", chat_body("alpha"))
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == "Hello from alpha."

    # beta is not resident: the Anthropic client gets the exact park.
    status, headers, parked = await ask(world, "/v1/messages", messages_body("beta"))
    assert status == 409, parked
    assert headers["Retry-After"] == "2"
    error = parked["error"]
    placement_id = error["placement_id"]
    assert re.fullmatch(r"plc-[0-9a-f]{6}", placement_id)
    assert parked == {
        "type": "error",
        "error": {
            "type": "model_placement_pending",
            "message": "model beta is not loaded; resolve with `uapplace pending` "
            f"(placement {placement_id})",
            "placement_id": placement_id,
            "requested_model": "beta",
            "reason": "not_resident",
            "retry_after_ms": 2000,
            "resolve_with": RESOLVE_WITH,
        },
    }
    entry = await world.pending_entry(placement_id)
    assert entry is not None
    assert (entry["client"], entry["session"]) == ("x-uap-client-id:e2e-client", "e2e-session")

    # The operator looks at the options: beta displaces alpha.
    options = await world.options_of(placement_id)
    index, option = next((i, o) for i, o in enumerate(options, 1) if o["kind"] == "displace")
    victims = [
        {"model": v["model"], "config": v["config"], "action": v["action"]}
        for v in option["victims"]
    ]
    assert victims == [{"model": "alpha", "config": "a1", "action": "stop"}]

    # A stale approval (a victim set that is not the real one) is refused; nothing moves.
    status, refused = await world.resolve(placement_id, index, [])
    assert status == 409, refused
    assert list(refused) == ["ok", "placementId", "steps", "error"]
    assert (refused["ok"], refused["placementId"], refused["steps"]) == (False, placement_id, [])
    assert refused["error"].startswith("victim set changed"), refused
    assert await world.active(world.alpha) == "active"
    assert await world.active(world.beta) == "inactive"
    assert await world.pending_entry(placement_id) is not None
    assert world.proxy.refreshes == 0

    # The approval that matches: the swap runs, and the proxy is told to refresh once.
    status, applied = await world.resolve(placement_id, index, victims)
    assert status == 200, applied
    assert applied["ok"] is True, applied
    assert applied["placementId"] == placement_id
    assert [step["name"] for step in applied["steps"]] == APPLY_STEPS
    assert all(step["ok"] for step in applied["steps"]), applied["steps"]
    refresh = next(step for step in applied["steps"] if step["name"] == "refresh-proxy")
    assert refresh["detail"] == "cleared upstream_model_ids, park_bursts"
    assert world.proxy.refreshes == 1
    assert await world.active(world.alpha) == "inactive"
    assert await world.active(world.beta) == "active"
    assert await world.pending_entry(placement_id) is None

    # The client's retry forwards and gets the new engine's answer.
    status, _, answer = await ask(world, "/v1/messages", messages_body("beta"))
    assert status == 200, answer
    assert answer["type"] == "message"
    assert answer["model"] == "beta"
    assert answer["content"] == [{"type": "text", "text": "Hello from beta."}]
    status, _, answer = await ask(world, "/v1/chat/completions", chat_body("beta-latest"))
    assert (status, answer["choices"][0]["message"]["content"]) == (200, "Hello from beta.")
    targets = world.proxy.inflight
    assert set(targets) == {world.target_of(world.alpha), world.target_of(world.beta)}
    assert all(not requests for requests in targets.values())

    # The old resident is now the one that parks (OpenAI dialect).
    status, headers, parked = await ask(world, "/v1/chat/completions", chat_body("alpha"))
    assert (status, headers["Retry-After"]) == (409, "2")
    assert parked["error"]["type"] == "upstream_error"
    assert parked["error"]["message"].startswith("model alpha is not loaded")
    assert world.proxy.refreshes == 1
