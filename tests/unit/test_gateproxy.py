"""sim/gateproxy.py over real HTTP: a scripted controller, the fake engine, the proxy between.

The controller is a small aiohttp app whose admit answer each test sets (or that
does not answer at all); the upstream is :class:`uapplace.sim.engine.FakeEngine`
served in-process; the proxy is :class:`uapplace.sim.gateproxy.GateProxy`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from http_fixtures import closed_port_url, serve

from uapplace.gate import RESOLVE_WITH
from uapplace.sim import gateproxy
from uapplace.sim.engine import EngineOptions, FakeEngine
from uapplace.sim.gateproxy import GateProxy

TOKEN = "proxy-token-123"
ANTHROPIC_BODY = {
    "model": "beta",
    "max_tokens": 64,
    "system": "Be brief.",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}],
}
OPENAI_BODY = {"model": "beta", "messages": [{"role": "user", "content": "hi there"}]}


@dataclass
class Controller:
    """Answers admit with ``answer`` (``None``: a 500, which the gate reads as no answer)."""

    answer: dict[str, Any] | None = None
    seen: list[dict[str, Any]] = field(default_factory=list)

    async def admit(self, request: web.Request) -> web.Response:
        self.seen.append(await request.json())
        if self.answer is None:
            return web.json_response({"error": "down"}, status=500)
        return web.json_response(self.answer)


@dataclass
class Stack:
    controller: Controller
    engine_url: str
    proxy: GateProxy
    url: str
    http: aiohttp.ClientSession

    def forward_to(self, endpoint: str) -> None:
        self.controller.answer = {"decision": "forward", "target_id": f"gpu0:{endpoint}"}

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        async with self.http.post(self.url + path, json=body, headers=headers) as reply:
            return reply.status, dict(reply.headers), await reply.json(content_type=None)

    async def internal(self, method: str, path: str, token: str | None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.http.request(method, self.url + path, headers=headers) as reply:
            return reply.status, await reply.json()


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    controller = Controller()
    app = web.Application()
    app.router.add_post("/api/placement/admit", controller.admit)
    controller_runner, controller_url = await serve(app)
    engine = FakeEngine(EngineOptions(port=0, model_id="beta", advertise=("beta-latest",)))
    engine.loaded = True
    engine_runner, engine_url = await serve(engine.app())
    proxy = GateProxy(controller_url, TOKEN)
    proxy_runner, proxy_url = await gateproxy.start(proxy)
    async with aiohttp.ClientSession() as http:
        yield Stack(controller, engine_url, proxy, proxy_url, http)
    for runner in (proxy_runner, engine_runner, controller_runner):
        await runner.cleanup()


# --------------------------------------------------------------------------- forwarding


async def test_openai_forward_passes_the_body_and_the_answer_through(stack: Stack) -> None:
    stack.forward_to(stack.engine_url)
    status, _, body = await stack.post(
        "/v1/chat/completions", OPENAI_BODY, {"x-uap-client-id": "cli", "x-uap-session-id": "s9"}
    )
    assert status == 200
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "Hello from beta."
    assert stack.controller.seen == [
        {"model_id": "beta", "client": "x-uap-client-id:cli", "session": "s9"}
    ]


async def test_openai_streaming_is_relayed(stack: Stack) -> None:
    stack.forward_to(stack.engine_url)
    async with stack.http.post(
        stack.url + "/v1/chat/completions", json={**OPENAI_BODY, "stream": True}
    ) as reply:
        text = await reply.text()
        content_type = reply.headers["Content-Type"]
    assert content_type.startswith("text/event-stream")
    assert "Hello from beta." in text
    assert text.rstrip().endswith("data: [DONE]")


async def test_anthropic_forward_is_translated_both_ways(stack: Stack) -> None:
    stack.forward_to(stack.engine_url)
    status, _, body = await stack.post("/v1/messages", ANTHROPIC_BODY)
    assert status == 200
    assert body["type"] == "message"
    assert body["role"] == "assistant"
    assert body["model"] == "beta"
    assert body["content"] == [{"type": "text", "text": "Hello from beta."}]
    assert body["stop_reason"] == "end_turn"
    assert body["usage"] == {"input_tokens": 4, "output_tokens": 3}
    assert stack.controller.seen[0]["client"] == "remote:127.0.0.1"


async def test_a_forwarded_target_stays_listed_idle(stack: Stack) -> None:
    stack.forward_to(stack.engine_url)
    await stack.post("/v1/messages", ANTHROPIC_BODY)
    status, body = await stack.internal("GET", "/internal/placement/inflight", TOKEN)
    assert (status, body) == (200, {"targets": {f"gpu0:{stack.engine_url}": []}})


async def test_a_request_is_listed_in_flight_while_it_runs(stack: Stack) -> None:
    """Upstream held open: the inflight page names the request's target and client."""
    release = asyncio.Event()
    arrived = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        arrived.set()
        await release.wait()
        return web.json_response({"choices": [{"message": {"content": "late"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", slow)
    runner, slow_url = await serve(app)
    try:
        stack.forward_to(slow_url)
        sent = asyncio.ensure_future(
            stack.post("/v1/messages", ANTHROPIC_BODY, {"x-uap-client-id": "slow"})
        )
        await asyncio.wait_for(arrived.wait(), 10)
        _, during = await stack.internal("GET", "/internal/placement/inflight", TOKEN)
        release.set()
        status, _, body = await sent
    finally:
        await runner.cleanup()
    [entry] = during["targets"][f"gpu0:{slow_url}"]
    assert entry["client"] == "x-uap-client-id:slow"
    assert entry["id"].startswith("req-")
    assert (status, body["content"][0]["text"]) == (200, "late")


# --------------------------------------------------------------------------- parks


async def test_anthropic_park_is_the_exact_409(stack: Stack) -> None:
    stack.controller.answer = {
        "decision": "park",
        "placement_id": "plc-0a1b2c",
        "reason": "not_resident",
    }
    status, headers, body = await stack.post("/v1/messages", ANTHROPIC_BODY)
    assert status == 409
    assert headers["Retry-After"] == "2"
    assert body == {
        "type": "error",
        "error": {
            "type": "model_placement_pending",
            "message": "model beta is not loaded; resolve with `uapplace pending` "
            "(placement plc-0a1b2c)",
            "placement_id": "plc-0a1b2c",
            "requested_model": "beta",
            "reason": "not_resident",
            "retry_after_ms": 2000,
            "resolve_with": RESOLVE_WITH,
        },
    }


async def test_openai_park_is_the_openai_409(stack: Stack) -> None:
    stack.controller.answer = {"decision": "park", "placement_id": "plc-00ff00", "reason": "x_y"}
    status, headers, body = await stack.post("/v1/chat/completions", OPENAI_BODY)
    assert (status, headers["Retry-After"]) == (409, "2")
    assert body == {
        "error": {
            "message": "model beta is not loaded; resolve with `uapplace pending` "
            "(placement plc-00ff00)",
            "type": "upstream_error",
        }
    }


async def test_no_controller_and_no_route_parks_as_unroutable(stack: Stack) -> None:
    """Nothing cached (fail-open forward to ``default``) and no default upstream."""
    status, _, body = await stack.post("/v1/messages", ANTHROPIC_BODY)
    assert status == 409
    assert body["error"]["reason"] == "unroutable_target"


async def test_no_controller_falls_back_to_the_cached_route(stack: Stack) -> None:
    stack.forward_to(stack.engine_url)
    assert (await stack.post("/v1/messages", ANTHROPIC_BODY))[0] == 200
    stack.controller.answer = None
    status, _, body = await stack.post("/v1/messages", ANTHROPIC_BODY)
    assert (status, body["content"][0]["text"]) == (200, "Hello from beta.")
    listed = (await stack.internal("GET", "/internal/placement/inflight", TOKEN))[1]
    assert set(listed["targets"]) == {f"gpu0:{stack.engine_url}", "default"}
    other = {**ANTHROPIC_BODY, "model": "never-served"}
    status, _, body = await stack.post("/v1/messages", other)
    assert (status, body["error"]["reason"]) == (409, "no_controller")


# --------------------------------------------------------------------------- controller routes


async def test_refresh_forgets_the_cached_routes_and_is_counted(stack: Stack) -> None:
    stack.forward_to(stack.engine_url)
    await stack.post("/v1/messages", ANTHROPIC_BODY)
    assert stack.proxy.cached_ids() == {"beta"}
    status, body = await stack.internal("POST", "/internal/placement/refresh", TOKEN)
    assert (status, body) == (200, {"ok": True, "cleared": ["upstream_model_ids", "park_bursts"]})
    assert stack.proxy.refreshes == 1
    assert stack.proxy.cached_ids() is None


async def test_refresh_lets_a_parked_client_ask_again_at_once(stack: Stack) -> None:
    """Without it the gate's 5 s burst map would re-park the retry after a swap."""
    stack.controller.answer = {"decision": "park", "placement_id": "plc-0a1b2c", "reason": "r"}
    assert (await stack.post("/v1/messages", ANTHROPIC_BODY))[0] == 409
    stack.forward_to(stack.engine_url)
    assert (await stack.post("/v1/messages", ANTHROPIC_BODY))[0] == 409
    assert len(stack.controller.seen) == 1
    await stack.internal("POST", "/internal/placement/refresh", TOKEN)
    status, _, body = await stack.post("/v1/messages", ANTHROPIC_BODY)
    assert (status, body["content"][0]["text"]) == (200, "Hello from beta.")
    assert len(stack.controller.seen) == 2


@pytest.mark.parametrize("token", [None, "wrong"])
@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/internal/placement/inflight"), ("POST", "/internal/placement/refresh")],
)
async def test_internal_routes_need_the_bearer_token(
    stack: Stack, method: str, path: str, token: str | None
) -> None:
    status, body = await stack.internal(method, path, token)
    assert (status, body) == (401, {"error": "missing or wrong bearer token"})
    assert stack.proxy.refreshes == 0


# --------------------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"stream": True}, "stream"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "type"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"tools": []}, "tools"),
        ({"model": ""}, "model"),
    ],
)
async def test_anthropic_requests_it_cannot_translate_are_400_naming_the_field(
    stack: Stack, change: dict[str, Any], named: str
) -> None:
    stack.forward_to(stack.engine_url)
    status, _, body = await stack.post("/v1/messages", {**ANTHROPIC_BODY, **change})
    assert status == 400
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert named in body["error"]["message"]
    assert stack.controller.seen == []


async def test_openai_body_without_a_model_is_400(stack: Stack) -> None:
    status, _, body = await stack.post("/v1/chat/completions", {"messages": []})
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "body", "kind"),
    [
        ("/v1/messages", ANTHROPIC_BODY, "api_error"),
        ("/v1/chat/completions", OPENAI_BODY, "upstream_error"),
    ],
)
async def test_an_unreachable_upstream_is_502_in_the_dialect(
    stack: Stack, path: str, body: dict[str, Any], kind: str
) -> None:
    dead = closed_port_url()
    stack.forward_to(dead)
    status, _, answer = await stack.post(path, body)
    assert status == 502
    assert answer["error"]["type"] == kind
    assert dead in answer["error"]["message"]
    listed = (await stack.internal("GET", "/internal/placement/inflight", TOKEN))[1]
    assert listed["targets"][f"gpu0:{dead}"] == []
