"""sim/gateproxy.py's two topologies and its per-target slots, over real HTTP.

A scripted controller (admit answer and ``/api/placement/targets`` set per test),
upstreams served in-process, the proxy between. The single-upstream mode behaves
like the stock UAP proxy: one upstream, ``target_id`` keys only the slot and the
in-flight bucket.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from http_fixtures import closed_port_url, serve

from uapplace.sim import gateproxy
from uapplace.sim.engine import EngineOptions, FakeEngine
from uapplace.sim.gateproxy import GateProxy

TOKEN = "tok"
BODY = {"model": "beta", "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Controller:
    answer: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, Any] | None = None
    """The ``/api/placement/targets`` body; ``None`` answers 404 (an older shim)."""

    async def admit(self, request: web.Request) -> web.Response:
        return web.json_response(self.answer)

    async def target_list(self, request: web.Request) -> web.Response:
        if self.targets is None:
            return web.json_response({"error": "no such route"}, status=404)
        return web.json_response(self.targets)


async def until(condition: Callable[[], bool], guard_s: float = 10) -> None:
    async with asyncio.timeout(guard_s):
        while True:
            if condition():
                return
            await asyncio.sleep(0.01)


@dataclass
class World:
    controller: Controller
    controller_url: str
    engine_url: str
    http: aiohttp.ClientSession
    runners: list[web.AppRunner] = field(default_factory=list)

    async def proxy(self, **options: Any) -> tuple[GateProxy, str]:
        proxy = GateProxy(self.controller_url, TOKEN, **options)
        runner, url = await gateproxy.start(proxy)
        self.runners.insert(0, runner)
        return proxy, url

    async def post(self, url: str) -> tuple[int, Any]:
        async with self.http.post(url + "/v1/chat/completions", json=BODY) as reply:
            return reply.status, await reply.json(content_type=None)

    async def inflight(self, url: str) -> Any:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with self.http.get(url + "/internal/placement/inflight", headers=headers) as reply:
            return await reply.json()


@pytest.fixture
async def world() -> AsyncIterator[World]:
    controller = Controller()
    app = web.Application()
    app.router.add_post("/api/placement/admit", controller.admit)
    app.router.add_get("/api/placement/targets", controller.target_list)
    controller_runner, controller_url = await serve(app)
    engine = FakeEngine(EngineOptions(port=0, model_id="beta"))
    engine.loaded = True
    engine_runner, engine_url = await serve(engine.app())
    async with aiohttp.ClientSession() as http:
        state = World(
            controller, controller_url, engine_url, http, [engine_runner, controller_runner]
        )
        yield state
        for runner in state.runners:
            await runner.cleanup()


async def test_single_upstream_sends_every_forward_to_its_one_address(world: World) -> None:
    """The target names another port (the model's registry endpoint); the stock
    proxy's topology ignores it for routing and keys the in-flight bucket by it."""
    target = f"gpu0:{closed_port_url()}"
    world.controller.answer = {"decision": "forward", "target_id": target}
    _, url = await world.proxy(single_upstream=world.engine_url + "/")
    status, body = await world.post(url)
    assert status == 200
    assert body["choices"][0]["message"]["content"] == "Hello from beta."
    assert await world.inflight(url) == {"targets": {target: []}}


async def test_per_target_mode_routes_by_the_target_endpoint(world: World) -> None:
    """The same answer through the per-target proxy goes to the named (dead) port."""
    world.controller.answer = {"decision": "forward", "target_id": f"gpu0:{closed_port_url()}"}
    _, url = await world.proxy()
    status, body = await world.post(url)
    assert status == 502
    assert body["error"]["type"] == "upstream_error"


async def test_slots_follow_the_controllers_rails_and_queued_requests_count_in_flight(
    world: World,
) -> None:
    release = asyncio.Event()
    arrivals: list[int] = []

    async def slow(request: web.Request) -> web.Response:
        arrivals.append(1)
        await release.wait()
        return web.json_response({"choices": [{"message": {"content": "late"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", slow)
    slow_runner, slow_url = await serve(app)
    world.runners.append(slow_runner)
    target = f"gpu0:{slow_url}"
    world.controller.answer = {"decision": "forward", "target_id": target}
    world.controller.targets = {"targets": [{"target_id": target, "rails": 1}]}
    proxy, url = await world.proxy(single_upstream=slow_url)
    await until(lambda: proxy.slots.limit(target) == 1)
    first = asyncio.ensure_future(world.post(url))
    second = asyncio.ensure_future(world.post(url))
    await until(lambda: len(arrivals) == 1 and proxy.slots.waiting(target) == 1)
    listed = await world.inflight(url)
    assert len(listed["targets"][target]) == 2  # the queued one is in flight for a drain
    release.set()
    assert [(await first)[0], (await second)[0]] == [200, 200]
    assert len(arrivals) == 2


async def test_refresh_rereads_the_rails(world: World) -> None:
    target = "gpu0:http://127.0.0.1:9"
    proxy, url = await world.proxy()
    assert proxy.slots.limit(target) is None  # the 404 of an older shim: unlimited
    world.controller.targets = {"targets": [{"target_id": target, "rails": 2}]}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with world.http.post(url + "/internal/placement/refresh", headers=headers) as reply:
        assert reply.status == 200
    await until(lambda: proxy.slots.limit(target) == 2)


def test_command_line_refuses_a_non_url_single_upstream(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        gateproxy.main(["--single-upstream", "127.0.0.1:8080"])
    assert "--single-upstream '127.0.0.1:8080': not an http://" in capsys.readouterr().err
