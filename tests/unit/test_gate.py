"""gate.py: the proxy side of docs/http-contract.md §1, §2, against a real loopback controller."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from uapplace.gate import (
    RESOLVE_WITH,
    GateClient,
    GateDecision,
    admit_body,
    anthropic_409,
    dialect_for_path,
    new_placement_id,
    ollama_409,
    openai_409,
    park_409,
    park_message,
)

Responder = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class StubController:
    """A placement controller on 127.0.0.1 whose admit answer each test sets."""

    url: str
    seen: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    respond: Responder | None = None
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def answer_json(self, payload: Any, status: int = 200) -> None:
        async def respond(_: web.Request) -> web.StreamResponse:
            return web.json_response(payload, status=status)

        self.respond = respond


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def controller() -> AsyncIterator[StubController]:
    stub = StubController(url="")

    async def admit(request: web.Request) -> web.StreamResponse:
        stub.paths.append(request.path)
        stub.seen.append(await request.json())
        assert stub.respond is not None, "the test did not set an answer"
        return await stub.respond(request)

    app = web.Application()
    app.router.add_post("/api/placement/admit", admit)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    stub.url = str(server.make_url(""))
    yield stub
    stub.release.set()
    await server.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def gate_for(
    stub: StubController, clock: FakeClock, served: list[str] | None = None, timeout: float = 2.0
) -> GateClient:
    return GateClient(stub.url + "/", timeout, upstream_ids=lambda: served, clock=clock)


FORWARD = {"decision": "forward", "target_id": "gpu0:http://127.0.0.1:8080"}
PARK = {"decision": "park", "placement_id": "plc-0a1b2c", "reason": "not_resident"}


# --------------------------------------------------------------------------- the request


async def test_admit_posts_the_contract_body_to_the_admit_path(
    controller: StubController, clock: FakeClock
) -> None:
    controller.answer_json(FORWARD)
    async with gate_for(controller, clock) as gate:
        await gate.admit("qwen3.8-27b", "x-uap-client-id:claude-code", "sess-1", 40000)
    assert controller.paths == ["/api/placement/admit"]
    assert controller.seen == [
        {
            "model_id": "qwen3.8-27b",
            "client": "x-uap-client-id:claude-code",
            "session": "sess-1",
            "cells": 40000,
        }
    ]


async def test_session_none_is_null_and_cells_only_when_positive(
    controller: StubController, clock: FakeClock
) -> None:
    controller.answer_json(FORWARD)
    async with gate_for(controller, clock) as gate:
        await gate.admit("m", "remote:127.0.0.1", None, 0)
        await gate.admit("m", "remote:127.0.0.1", None, None)
    assert controller.seen == [
        {"model_id": "m", "client": "remote:127.0.0.1", "session": None},
        {"model_id": "m", "client": "remote:127.0.0.1", "session": None},
    ]


def test_admit_body_drops_bool_and_negative_cells() -> None:
    assert "cells" not in admit_body("m", "c", None, True)
    assert "cells" not in admit_body("m", "c", None, -5)
    assert admit_body("m", "c", "s", 1)["cells"] == 1


# --------------------------------------------------------------------------- controller answers


async def test_forward_answer(controller: StubController, clock: FakeClock) -> None:
    controller.answer_json(FORWARD)
    async with gate_for(controller, clock) as gate:
        decision = await gate.admit("m", "c", None, None)
    assert decision == GateDecision(
        "forward", target_id="gpu0:http://127.0.0.1:8080", source="controller"
    )


async def test_park_answer(controller: StubController, clock: FakeClock) -> None:
    controller.answer_json(PARK)
    async with gate_for(controller, clock) as gate:
        decision = await gate.admit("m", "c", None, None)
    assert decision == GateDecision(
        "park", placement_id="plc-0a1b2c", reason="not_resident", source="controller"
    )
    assert decision.parked


@pytest.mark.parametrize(
    ("payload", "status"),
    [
        (FORWARD, 500),
        (PARK, 201),
        ([FORWARD], 200),
        ("forward", 200),
        ({"decision": "maybe", "target_id": "gpu0:x"}, 200),
        ({"decision": "forward"}, 200),
        ({"decision": "forward", "target_id": "no colon"}, 200),
        ({"decision": "park", "placement_id": "plc-XYZ", "reason": "not_resident"}, 200),
        ({"decision": "park", "placement_id": "plc-0a1b2c"}, 200),
    ],
)
async def test_malformed_answers_count_as_no_answer(
    controller: StubController, clock: FakeClock, payload: Any, status: int
) -> None:
    controller.answer_json(payload, status)
    async with gate_for(controller, clock, served=["served-model"]) as gate:
        decision = await gate.admit("other-model", "c", None, None)
    assert decision.source == "fallback"
    assert decision.reason == "no_controller"


async def test_invalid_json_counts_as_no_answer(
    controller: StubController, clock: FakeClock
) -> None:
    async def respond(_: web.Request) -> web.StreamResponse:
        return web.Response(text='{"decision": "forw', content_type="application/json")

    controller.respond = respond
    async with gate_for(controller, clock, served=["m"]) as gate:
        decision = await gate.admit("m", "c", None, None)
    assert decision == GateDecision("forward", target_id="default", source="fallback")


async def test_slow_controller_falls_back_after_the_timeout(
    controller: StubController, clock: FakeClock
) -> None:
    async def respond(_: web.Request) -> web.StreamResponse:
        await controller.release.wait()
        return web.json_response(FORWARD)

    controller.respond = respond
    async with gate_for(controller, clock, served=[], timeout=0.2) as gate:
        decision = await gate.admit("m", "c", None, None)
    assert decision.source == "fallback"
    assert decision.reason == "no_controller"
    assert len(controller.seen) == 1


async def test_unreachable_controller_falls_back(clock: FakeClock) -> None:
    server = TestServer(web.Application(), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url(""))
    await server.close()
    async with GateClient(url, upstream_ids=lambda: ["m"], clock=clock) as gate:
        assert (await gate.admit("m", "c", None, None)).source == "fallback"


# --------------------------------------------------------------------------- read-only fallback


def test_fallback_forwards_a_served_id_parks_an_unserved_one_forwards_when_unprobed() -> None:
    served = GateClient("http://127.0.0.1:9", upstream_ids=lambda: ["a", "b"])
    assert served.fallback("b") == GateDecision("forward", target_id="default", source="fallback")
    parked = served.fallback("c")
    assert parked.decision == "park"
    assert parked.reason == "no_controller"
    assert parked.placement_id is not None
    assert re.fullmatch(r"plc-[0-9a-f]{6}", parked.placement_id)
    unprobed = GateClient("http://127.0.0.1:9")
    assert unprobed.fallback("anything").decision == "forward"


def test_fallback_with_a_broken_cache_reads_as_unprobed() -> None:
    def broken() -> list[str]:
        raise RuntimeError("cache exploded")

    assert GateClient("http://127.0.0.1:9", upstream_ids=broken).fallback("m").decision == "forward"


def test_placement_ids_are_plc_and_six_lowercase_hex() -> None:
    ids = {new_placement_id() for _ in range(200)}
    assert all(re.fullmatch(r"plc-[0-9a-f]{6}", i) for i in ids)
    assert len(ids) > 150


# --------------------------------------------------------------------------- burst map


async def test_burst_map_reparks_without_asking_for_five_seconds(
    controller: StubController, clock: FakeClock
) -> None:
    controller.answer_json(PARK)
    async with gate_for(controller, clock) as gate:
        first = await gate.admit("m", "c", None, None)
        clock.now += 4.9
        again = await gate.admit("m", "c", "another-session", None)
        other_client = await gate.admit("m", "c2", None, None)
        clock.now += 0.1
        after_window = await gate.admit("m", "c", None, None)
    assert again == GateDecision(
        "park", placement_id=first.placement_id, reason=first.reason, source="burst"
    )
    assert other_client.source == "controller"
    assert after_window.source == "controller"
    assert len(controller.seen) == 3


async def test_auto_loading_parks_under_the_model_only_key(
    controller: StubController, clock: FakeClock
) -> None:
    controller.answer_json(
        {"decision": "park", "placement_id": "plc-abcdef", "reason": "auto_loading"}
    )
    async with gate_for(controller, clock) as gate:
        await gate.admit("m", "client-1", None, None)
        rotated = await gate.admit("m", "client-2", None, None)
        other_model = await gate.admit("n", "client-2", None, None)
    assert rotated == GateDecision(
        "park", placement_id="plc-abcdef", reason="auto_loading", source="burst"
    )
    assert other_model.source == "controller"
    assert [body["client"] for body in controller.seen] == ["client-1", "client-2"]


async def test_forget_parks_makes_the_next_admit_ask_again(
    controller: StubController, clock: FakeClock
) -> None:
    controller.answer_json(
        {"decision": "park", "placement_id": "plc-abcdef", "reason": "auto_loading"}
    )
    async with gate_for(controller, clock) as gate:
        await gate.admit("m", "c", None, None)
        controller.answer_json(FORWARD)
        assert gate.forget_parks() == 2  # (c, m) and (__auto__, m)
        after = await gate.admit("m", "c", None, None)
        assert gate.forget_parks() == 0
    assert after == GateDecision("forward", target_id=FORWARD["target_id"])
    assert len(controller.seen) == 2


async def test_forward_is_never_remembered(controller: StubController, clock: FakeClock) -> None:
    controller.answer_json(FORWARD)
    async with gate_for(controller, clock) as gate:
        await gate.admit("m", "c", None, None)
        await gate.admit("m", "c", None, None)
    assert len(controller.seen) == 2


async def test_fallback_parks_enter_the_burst_map(
    controller: StubController, clock: FakeClock
) -> None:
    controller.answer_json({}, 503)
    async with gate_for(controller, clock, served=[]) as gate:
        first = await gate.admit("m", "c", None, None)
        second = await gate.admit("m", "c", None, None)
    assert second.source == "burst"
    assert second.placement_id == first.placement_id
    assert len(controller.seen) == 1


# --------------------------------------------------------------------------- 409 bodies


def test_messages_by_reason_are_exact() -> None:
    assert park_message("qwen3.8-27b", "plc-7f2a00", "not_resident") == (
        "model qwen3.8-27b is not loaded; resolve with `uapplace pending` (placement plc-7f2a00)"
    )
    assert park_message("m", "plc-000001", "no_controller") == (
        "model m is not loaded; resolve with `uapplace pending` (placement plc-000001)"
    )
    assert park_message("m", "plc-000001", "auto_loading") == (
        "model m is being loaded automatically; retrying is correct and it will forward when "
        "the load completes"
    )
    assert park_message("m", "plc-000001", "auto_failed") == (
        "model m failed to load automatically; resolve with `uapplace pending` "
        "(placement plc-000001)"
    )


def test_anthropic_409_exact() -> None:
    status, headers, body = anthropic_409("qwen3.8-27b", "plc-7f2a00", "not_resident")
    assert status == 409
    assert headers == {"Retry-After": "2"}
    assert body == {
        "type": "error",
        "error": {
            "type": "model_placement_pending",
            "message": "model qwen3.8-27b is not loaded; resolve with `uapplace pending` "
            "(placement plc-7f2a00)",
            "placement_id": "plc-7f2a00",
            "requested_model": "qwen3.8-27b",
            "reason": "not_resident",
            "retry_after_ms": 2000,
            "resolve_with": "uapplace pending | uapplace apply <placement_id> <option>",
        },
    }
    assert list(body["error"]) == [
        "type",
        "message",
        "placement_id",
        "requested_model",
        "reason",
        "retry_after_ms",
        "resolve_with",
    ]
    assert body["error"]["resolve_with"] == RESOLVE_WITH


def test_openai_409_exact() -> None:
    status, headers, body = openai_409("m", "plc-000001", "auto_loading")
    assert (status, headers) == (409, {"Retry-After": "2"})
    assert body == {
        "error": {
            "message": "model m is being loaded automatically; retrying is correct and it will "
            "forward when the load completes",
            "type": "upstream_error",
        }
    }


def test_ollama_409_exact() -> None:
    status, headers, body = ollama_409("m", "plc-000001", "auto_failed")
    assert (status, headers) == (409, {"Retry-After": "2"})
    assert json.dumps(body) == (
        '{"error": "model m failed to load automatically; resolve with `uapplace pending` '
        '(placement plc-000001)"}'
    )


@pytest.mark.parametrize(
    ("path", "dialect"),
    [
        ("/v1/messages", "anthropic"),
        ("/anthropic/v1/messages", "anthropic"),
        ("/v1/messages?beta=true", "anthropic"),
        ("/v1/chat/completions", "openai"),
        ("/v1/chat/completions/", "openai"),
        ("/api/chat", "ollama"),
        ("/api/generate", "ollama"),
        ("/v1/models", None),
        ("/", None),
    ],
)
def test_dialect_for_path(path: str, dialect: str | None) -> None:
    assert dialect_for_path(path) == dialect


def test_park_409_picks_the_dialect() -> None:
    assert park_409("/api/chat", "m", "plc-000001", "not_resident")[2] == {
        "error": park_message("m", "plc-000001", "not_resident")
    }
    assert park_409("/v1/chat/completions", "m", "plc-000001", "x")[2]["error"]["type"] == (
        "upstream_error"
    )
    assert park_409("/elsewhere", "m", "plc-000001", "x")[2]["type"] == "error"
