"""The engine contract: the probes uapplace uses, against the fake and the real llama-server.

docs/architecture.md ("Simulated GPU and fake engine"): where the fake
(:mod:`uapplace.sim.engine`) and the real ``llama-server`` answer differently, the real
one is right and the fake is fixed. Each test runs twice, ``[fake]`` and ``[real]``, each
engine a plain subprocess started from the same llama.cpp settings
(``tests/engines/engine_process.py``: ``--alias tiny -c 512 --parallel 2``, so 256 cells
a slot). The ``[real]`` half skips where ``llama-server`` is not built (and fails under
``UAPPLACE_REQUIRE_ENGINES=1``); the ``[fake]`` half always runs.

What is checked, and what uapplace reads it for:

- ``/health``: 200 ``{"status": "ok"}`` once loaded; while loading every route answers
  503 ``{"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}``
  (verify-up's health);
- ``/v1/models``: ``data[].id`` is the alias, ``meta.n_ctx`` one slot's context (the served id);
- ``/slots``: one object per slot, ``id``, ``n_ctx``, ``speculative``, ``is_processing``, and
  nothing else before a task (rails, drain);
- ``/props``: ``total_slots``, ``is_sleeping``, ``build_info``, ``model_alias``,
  ``default_generation_settings.n_ctx`` per slot (rails, sleep, the KV geometry);
- ``/metrics``: llama.cpp's ``llamacpp:*`` names, and none of the Strata-like extras
  (``max_context``, ``slots``, ``engine_info``) that llama.cpp does not export;
- streamed ``/v1/completions`` and ``/v1/chat/completions``: SSE ``data:`` chunks of the
  OpenAI shapes, the last carrying ``finish_reason``, then ``data: [DONE]``;
- a generation in flight shows in ``/slots`` ``is_processing`` and in
  ``llamacpp:requests_processing``, and both clear when the client goes away;
- idle sleep (``--sleep-idle-seconds``): ``/props`` says ``is_sleeping``; ``/health``,
  ``/props``, ``/v1/models`` and ``/metrics`` answer without waking it; ``GET /slots`` and
  a completion wake it;
- vLLM's ``/is_sleeping`` is absent (404): uapplace's sleep probe reads ``/props``; a
  malformed request is a 400 OpenAI error.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.engines.engine_process import KINDS, EngineProcess, Kind, Shape, spawn
from tests.worlds import polling
from tests.worlds.llama import TinyModels
from uapplace.io import engines
from uapplace.io.rails import probe_rails

pytestmark = pytest.mark.engines

Start = Callable[..., EngineProcess]
LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
IDLE_SLOT_KEYS = {"id", "n_ctx", "speculative", "is_processing"}
LLAMACPP_METRICS = (
    "llamacpp:prompt_tokens_total",
    "llamacpp:prompt_tokens_cached_total",
    "llamacpp:tokens_predicted_total",
    "llamacpp:n_decode_total",
    "llamacpp:prompt_tokens_seconds",
    "llamacpp:predicted_tokens_seconds",
    "llamacpp:requests_processing",
    "llamacpp:requests_deferred",
)
"""Names uapplace may read from a llama.cpp ``/metrics`` (a subset of what it serves)."""
NOT_LLAMACPP = ("llamacpp:max_context", "llamacpp:slots", "llamacpp:engine_info")
"""Strata-like extras the fake serves only when asked (``--kv``, ``--max-context``)."""
PER_SLOT = 256


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> Kind:
    value: Kind = request.param
    return value


@pytest.fixture
def start(
    kind: Kind, request: pytest.FixtureRequest, tmp_path: Path, tiny_models: TinyModels
) -> Iterator[Start]:
    """``start(shape)``: the engine of this test's kind, listening; stopped at the end."""
    binary: Path | None = request.getfixturevalue("llama_server") if kind == "real" else None
    started: list[EngineProcess] = []

    def starter(shape: Shape | None = None) -> EngineProcess:
        shape = shape or Shape()
        model = None
        if binary is not None:
            model = tiny_models.path("tiny-c" if shape.slow_tokens else shape.preset)
        engine = spawn(kind, shape, tmp_path / f"engine-{len(started)}", binary, model)
        started.append(engine)
        return engine

    yield starter
    codes = [(engine.stop(), engine) for engine in started]
    for code, engine in codes:
        assert code == 0, f"the {engine.kind} engine exited {code}:\n{engine.log()[-3000:]}"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    """``GET url``: the status and the body (parsed when it is JSON)."""
    async with http.get(url) as reply:
        text = await reply.text()
    try:
        return reply.status, json.loads(text)
    except ValueError:
        return reply.status, text


async def loaded(http: aiohttp.ClientSession, engine: EngineProcess) -> EngineProcess:
    """Wait until ``/health`` is 200."""

    async def healthy() -> bool:
        return (await get(http, f"{engine.url}/health"))[0] == 200

    await polling.until(f"the {engine.kind} engine to load", healthy, engine.log)
    return engine


async def props(http: aiohttp.ClientSession, engine: EngineProcess) -> dict[str, Any]:
    status, body = await get(http, f"{engine.url}/props")
    assert status == 200 and isinstance(body, dict), (status, body)
    return body


async def asleep(http: aiohttp.ClientSession, engine: EngineProcess) -> bool:
    """``/props`` ``is_sleeping`` (``/props`` never wakes the engine)."""
    return (await props(http, engine))["is_sleeping"] is True


def sse_data(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order (comments and blank lines dropped)."""
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def busy_slots(slots: list[dict[str, Any]]) -> list[int]:
    return [slot["id"] for slot in slots if slot["is_processing"]]


# --------------------------------------------------------------------------- health


async def test_health_is_ok_once_loaded(start: Start, http: aiohttp.ClientSession) -> None:
    engine = await loaded(http, start())
    assert await get(http, f"{engine.url}/health") == (200, {"status": "ok"})
    assert await engines.health(engine.url) is True


async def test_every_route_is_503_loading_model_while_loading(
    start: Start, http: aiohttp.ClientSession
) -> None:
    engine = start(Shape(slow_load=True))
    first = await get(http, f"{engine.url}/health")
    answers = {"/health": first}
    for route in ("/v1/models", "/slots", "/props", "/metrics"):
        answers[route] = await get(http, engine.url + route)
    probed = await engines.health(engine.url)
    still_loading = await get(http, f"{engine.url}/health")
    assert first == (503, LOADING), "the first answer comes while the model loads"
    assert still_loading[0] == 503, "the load outlasted the probes (else nothing is shown)"
    assert answers == dict.fromkeys(answers, (503, LOADING))
    assert probed is False
    await loaded(http, engine)


# --------------------------------------------------------------------------- the probes


async def test_models_list_the_alias_with_one_slots_context(
    start: Start, http: aiohttp.ClientSession
) -> None:
    engine = await loaded(http, start())
    status, body = await get(http, f"{engine.url}/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in body["data"]] == [
        ("tiny", "model", "llamacpp")
    ]
    assert body["data"][0]["meta"]["n_ctx"] == PER_SLOT
    assert await engines.served_ids(engine.url) == ["tiny"]


async def test_slots_before_any_task(start: Start, http: aiohttp.ClientSession) -> None:
    engine = await loaded(http, start())
    status, slots = await get(http, f"{engine.url}/slots")
    assert status == 200
    assert [set(slot) for slot in slots] == [IDLE_SLOT_KEYS] * 2
    assert [(s["id"], s["n_ctx"], s["speculative"], s["is_processing"]) for s in slots] == [
        (0, PER_SLOT, False, False),
        (1, PER_SLOT, False, False),
    ]
    live = await probe_rails(engine.url, "llama.cpp")
    assert live.rails == 2, live


async def test_props_name_slots_context_build_and_sleep(
    start: Start, http: aiohttp.ClientSession
) -> None:
    engine = await loaded(http, start())
    body = await props(http, engine)
    assert (body["total_slots"], body["default_generation_settings"]["n_ctx"]) == (2, PER_SLOT)
    assert (body["model_alias"], body["is_sleeping"]) == ("tiny", False)
    assert re.fullmatch(r"b\d+-[0-9a-z-]+", body["build_info"]), body["build_info"]
    assert (body["endpoint_slots"], body["endpoint_metrics"]) == (True, True)


async def test_metrics_are_llama_cpp_names_only(start: Start, http: aiohttp.ClientSession) -> None:
    engine = await loaded(http, start())
    async with http.get(f"{engine.url}/metrics") as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = await reply.text()
    names = {line.split()[0].split("{")[0] for line in text.splitlines() if line[:1] not in "#"}
    assert set(LLAMACPP_METRICS) <= names, sorted(set(LLAMACPP_METRICS) - names)
    assert not names & set(NOT_LLAMACPP), "llama.cpp exports no context size or settings"
    parsed = await engines.metrics(engine.url)
    assert (parsed["requests_processing"], parsed["requests_deferred"]) == (0.0, 0.0)
    assert "max_context" not in parsed and "kv" not in parsed


# --------------------------------------------------------------------------- completions


async def test_streamed_text_completion(start: Start, http: aiohttp.ClientSession) -> None:
    engine = await loaded(http, start())
    body = {"prompt": "hello world", "max_tokens": 6, "ignore_eos": True, "stream": True}
    async with http.post(f"{engine.url}/v1/completions", json=body) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        payloads = sse_data(await reply.text())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert {(c["object"], c["model"]) for c in chunks} == {("text_completion", "tiny")}
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[:-1] == [None] * (len(chunks) - 1) and reasons[-1] == "length"
    assert all(isinstance(c["choices"][0]["text"], str) for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 6


async def test_streamed_chat_completion(start: Start, http: aiohttp.ClientSession) -> None:
    engine = await loaded(http, start())
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    async with http.post(f"{engine.url}/v1/chat/completions", json=body) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        payloads = sse_data(await reply.text())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert {(c["object"], c["model"]) for c in chunks} == {("chat.completion.chunk", "tiny")}
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert all(isinstance(d.get("content", ""), str | None) for d in deltas), deltas
    assert {d["role"] for d in deltas if "role" in d} <= {"assistant"}
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[:-1] == [None] * (len(chunks) - 1) and reasons[-1] in ("length", "stop")


async def test_a_generation_in_flight_shows_in_slots_and_metrics(
    start: Start, http: aiohttp.ClientSession
) -> None:
    engine = await loaded(http, start(Shape(slow_tokens=True)))
    body = {"prompt": "hello", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
    async with http.post(f"{engine.url}/v1/completions", json=body) as reply:
        assert reply.status == 200
        for _ in range(3):
            assert (await reply.content.readline()) is not None
        _, slots = await get(http, f"{engine.url}/slots")
        during = await engines.metrics(engine.url)
        reply.close()  # the client goes away mid-generation
    assert len(busy_slots(slots)) == 1, slots
    assert during["requests_processing"] == 1.0

    async def idle_again() -> bool:
        _, now = await get(http, f"{engine.url}/slots")
        metrics = await engines.metrics(engine.url)
        return not busy_slots(now) and metrics["requests_processing"] == 0.0

    await polling.until("the slot to be free once the client left", idle_again, engine.log)


async def test_a_malformed_request_is_a_400_openai_error(
    start: Start, http: aiohttp.ClientSession
) -> None:
    engine = await loaded(http, start())
    async with http.post(f"{engine.url}/v1/completions", json="not an object") as reply:
        assert reply.status == 400
        error = (await reply.json())["error"]
    assert (error["code"], error["type"]) == (400, "invalid_request_error")


async def test_vllm_sleep_route_is_absent_and_props_tell(
    start: Start, http: aiohttp.ClientSession
) -> None:
    engine = await loaded(http, start())
    assert (await get(http, f"{engine.url}/is_sleeping"))[0] == 404
    assert await engines.is_sleeping(engine.url) is False, "from /props is_sleeping"


# --------------------------------------------------------------------------- idle sleep


async def test_idle_sleep_is_seen_in_props_and_only_slots_or_work_wake_it(
    start: Start, http: aiohttp.ClientSession
) -> None:
    engine = await loaded(http, start(Shape(sleep_idle_s=1)))

    async def sleeping() -> bool:
        return await asleep(http, engine)

    await polling.until("the engine to fall asleep", sleeping, engine.log)
    for route in ("/health", "/props", "/v1/models", "/metrics"):
        assert (await get(http, engine.url + route))[0] == 200, route
        assert await asleep(http, engine), f"GET {route} woke it"
    assert await engines.health(engine.url) is True, "asleep is not down"
    assert await engines.is_sleeping(engine.url) is True
    assert await asleep(http, engine), "uapplace's sleep probe woke it"

    status, slots = await get(http, f"{engine.url}/slots")
    assert (status, len(slots)) == (200, 2)
    assert not await asleep(http, engine), "GET /slots wakes it"

    await polling.until("the engine to fall asleep again", sleeping, engine.log)
    body = {"prompt": "hello", "max_tokens": 2}
    async with http.post(f"{engine.url}/v1/completions", json=body) as reply:
        assert reply.status == 200
    assert not await asleep(http, engine), "a completion wakes it"
