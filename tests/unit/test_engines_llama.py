"""engines.py against the exact answers of a real llama-server (tests/unit/llama_shapes.py):
``/props`` as facts, sleep told apart for llama.cpp and vLLM, and no probe that wakes a
sleeping server."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web
from http_fixtures import closed_port_url, serving
from llama_shapes import BUILD_INFO, PROPS, ROUTER_PROPS, LlamaShapes

from uapplace.io import engines
from uapplace.io.engines import EngineError, SleepState


def test_props_facts_of_a_single_model_server() -> None:
    facts = engines.props_facts(PROPS)
    assert facts["n_ctx"] == 256.0  # default_generation_settings.n_ctx: one slot's context
    assert facts["total_slots"] == 2.0
    assert facts["build_info"] == BUILD_INFO
    assert facts["model_alias"] == "tiny-a"
    assert facts["model_ftype"] == "all F32"
    assert facts["is_sleeping"] == "false"  # a boolean as text: policies hold no booleans
    assert facts["endpoint_slots"] == "true"
    assert "default_generation_settings" not in facts and "modalities" not in facts
    assert engines.props_fact_source("n_ctx", PROPS) == "/props default_generation_settings.n_ctx"
    assert engines.props_fact_source("total_slots", PROPS) == "/props total_slots"


def test_props_facts_of_a_router() -> None:
    facts = engines.props_facts(ROUTER_PROPS)
    assert (facts["role"], facts["n_ctx"], facts["max_instances"]) == ("router", 0.0, 1.0)
    assert "total_slots" not in facts and "is_sleeping" not in facts
    assert engines.props_sleeping(ROUTER_PROPS) is None


async def test_props_answers_asleep_without_waking() -> None:
    shapes = LlamaShapes(asleep=True)
    async with serving(shapes.app()) as url:
        body = await engines.props(f"{url}/v1")
    assert body["is_sleeping"] is True and body["total_slots"] == 2
    assert shapes.asleep and shapes.hits["/slots"] == 0


async def test_props_errors_name_the_url() -> None:
    shapes = LlamaShapes(no_props_route=True)
    async with serving(shapes.app()) as url:
        with pytest.raises(EngineError, match=rf"GET {url}/props: HTTP 404: .*File Not Found"):
            await engines.props(url)
    dead = closed_port_url()
    with pytest.raises(EngineError, match=rf"GET {dead}/props: "):
        await engines.props(dead)
    with pytest.raises(EngineError, match="not a JSON object"):
        engines.props_body("http://h/props", 200, "[1, 2]")


async def test_sleep_state_of_llama_cpp_comes_from_props() -> None:
    shapes = LlamaShapes(asleep=True)
    async with serving(shapes.app()) as url:
        assert await engines.sleep_state(url) == SleepState(True, "props")
        assert await engines.is_sleeping(url) is True
        shapes.asleep = False
        assert await engines.sleep_state(url) == SleepState(False, "props")
    assert shapes.hits["/slots"] == 0
    assert "--sleep-idle-seconds" in SleepState(True, "props").why_asleep()


async def test_sleep_state_of_vllm_comes_from_is_sleeping() -> None:
    """vLLM has no /props (404): its own ``GET /is_sleeping`` answers."""
    asleep = {"now": True}

    async def is_sleeping(_: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": asleep["now"]})

    app = web.Application()
    app.router.add_get("/is_sleeping", is_sleeping)
    async with serving(app) as url:
        assert await engines.sleep_state(url) == SleepState(True, "is_sleeping")
        asleep["now"] = False
        assert await engines.is_sleeping(url) is False
    assert "vLLM" in SleepState(True, "is_sleeping").why_asleep()


async def test_sleep_state_unknown_when_nothing_tells() -> None:
    router = LlamaShapes(router=True)  # its own /props has no is_sleeping, no /is_sleeping
    async with serving(router.app()) as url:
        assert await engines.sleep_state(url) is None
    assert await engines.sleep_state(closed_port_url()) is None


async def test_slots_are_never_asked_of_a_sleeping_server() -> None:
    shapes = LlamaShapes(asleep=True, total_slots=2)
    async with serving(shapes.app()) as url:
        assert await engines.slots(url) is None
        assert shapes.asleep and shapes.hits["/slots"] == 0
        shapes.asleep = False
        found = await engines.slots(url)
    assert found is not None and [s["n_ctx"] for s in found] == [256, 256]
    assert shapes.hits["/slots"] == 1


async def test_real_metrics_have_no_settings() -> None:
    shapes = LlamaShapes()
    async with serving(shapes.app()) as url:
        found = await engines.metrics(url)
        shapes.metrics_enabled = False
        with pytest.raises(EngineError, match=r"/metrics: HTTP 501: .*--metrics"):
            await engines.metrics(url)
    assert found["requests_processing"] == 0.0
    assert found["llamacpp:n_tokens_max"] == 256.0
    assert "max_context" not in found and "kv" not in found and "n_ctx" not in found


ALIASED_MODELS = {
    "object": "list",
    "data": [
        {
            "id": "alpha-chat",
            "aliases": ["alpha-chat", "zeta"],
            "tags": [],
            "object": "model",
            "created": 1796293848,
            "owned_by": "llamacpp",
            "meta": {"n_ctx": 256, "n_params": 120896},
        }
    ],
}
"""``GET /v1/models`` of the real llama-server started with ``--alias zeta,alpha-chat``: ONE
entry, its ``id`` the alphabetically first alias, ``aliases`` holding both."""


NO_ALIASES = {"data": [{"id": "qwen"}, {"id": "qwen-27b", "aliases": None}]}
"""vLLM and the OpenAI shape have no ``aliases``; ``null`` counts as none."""


@pytest.mark.parametrize(
    ("body", "ids"),
    [
        pytest.param(ALIASED_MODELS, ["alpha-chat", "zeta"], id="every-alias-of-a-llama-cpp-model"),
        pytest.param(NO_ALIASES, ["qwen", "qwen-27b"], id="without-aliases-the-ids"),
    ],
)
async def test_served_ids_are_every_id_and_alias_served(body: Any, ids: list[str]) -> None:
    async def models(_: web.Request) -> web.Response:
        return web.json_response(body)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with serving(app) as url:
        assert await engines.served_ids(url) == ids
