"""The fake engine's llama.cpp shapes (issue 19): what the engine-contract suite
(``tests/engines/test_contract.py``) checks against the real server, here in-process and
in detail: the Strata-like extras only when asked, slots before and after a task, a
deferred request, llama.cpp's idle sleep against the simulated GPU, the flags' checks.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.worlds import polling
from uapplace.io import engines
from uapplace.sim import serving
from uapplace.sim.engine import (
    BUILD_INFO,
    WAKE_FAILED_EXIT,
    EngineMemory,
    EngineOptions,
    FakeEngine,
    parse_options,
)
from uapplace.sim.gpu import SimGpu, sim_uuid

GUARD_S = 10.0
"""A hang guard, never an assertion about speed."""


@asynccontextmanager
async def served(
    options: EngineOptions, gpu: SimGpu | None = None
) -> AsyncIterator[tuple[str, FakeEngine]]:
    """The fake engine loaded and served in this loop (its idle watcher included)."""
    memory = EngineMemory(options, gpu, os.getpid())
    memory.claim_gpu()
    engine = FakeEngine(options, memory)
    await engine.finish_loading()
    runner, url = await serving.start(engine.app())
    try:
        yield url, engine
    finally:
        await runner.cleanup()
        memory.release_gpu()


def options(**fields: Any) -> EngineOptions:
    return EngineOptions(**{"port": 0, "model_id": "tiny", **fields})


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as reply:
        assert reply.status == 200, await reply.text()
        return await reply.json()


async def until(condition: Callable[[], bool]) -> None:
    await polling.until_sync("the engine's state", condition, guard_s=GUARD_S)


@pytest.fixture
def sim_gpu(tmp_path: Path) -> SimGpu:
    gpu = SimGpu(tmp_path / "gpu.json")
    gpu.create([("", 4096)])
    return gpu


# --------------------------------------------------------------------------- metrics


async def test_a_plain_engine_serves_llama_cpp_metrics_only() -> None:
    async with served(options()) as (url, _):
        found = await engines.metrics(url)
    assert found["requests_processing"] == 0.0 and found["tokens_predicted_total"] == 0.0
    assert not {"max_context", "slots", "kv", "llamacpp:max_context"} & set(found)


@pytest.mark.parametrize(
    ("fields", "kv", "pool"),
    [({"kv": "int8"}, "int8", 32768.0), ({"max_context": 65536}, "f16", 65536.0)],
)
async def test_kv_or_max_context_turn_the_strata_extras_on(
    fields: dict[str, Any], kv: str, pool: float
) -> None:
    async with served(options(slots=2, **fields)) as (url, _):
        found = await engines.metrics(url)
    assert (found["kv"], found["max_context"], found["slots"]) == (kv, pool, 2.0)


async def test_the_build_it_reports_can_be_told() -> None:
    """``--build-info`` (else ``$UAPPLACE_SIM_BUILD_INFO``): an engine "upgraded" in place
    (issue 21 item 3, tests/systemd/test_measure_stale.py)."""
    options = parse_options(["--port", "0", "--model-id", "m", "--build-info", "b7-new"])
    async with served(options) as (url, _):
        props = await get_json(f"{url}/props")
    assert props["build_info"] == "b7-new"
    with pytest.raises(SystemExit):
        parse_options(["--port", "0", "--model-id", "m", "--build-info", " "])


async def test_the_context_pool_is_c_split_across_the_slots() -> None:
    async with served(
        parse_options(["--port", "0", "--model-id", "m", "-c", "512", "-np", "2"])
    ) as (
        url,
        _,
    ):
        props = await get_json(f"{url}/props")
        models = await get_json(f"{url}/v1/models")
        slots = await get_json(f"{url}/slots")
    assert (props["total_slots"], props["default_generation_settings"]["n_ctx"]) == (2, 256)
    assert (props["build_info"], props["model_alias"], props["is_sleeping"]) == (
        BUILD_INFO,
        "m",
        False,
    )
    assert models["data"][0]["meta"]["n_ctx"] == 256
    assert [s["n_ctx"] for s in slots] == [256, 256]


# --------------------------------------------------------------------------- slots and work


async def test_a_slot_that_ran_a_task_carries_it_as_llama_cpp_does() -> None:
    async with served(options(slots=2)) as (url, engine), aiohttp.ClientSession() as session:
        body = {"prompt": "hello there", "max_tokens": 5, "ignore_eos": True}
        async with session.post(f"{url}/v1/completions", json=body) as reply:
            answer = await reply.json()
        slots = await get_json(f"{url}/slots")
    assert answer["usage"] == {
        "completion_tokens": 5,
        "prompt_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert answer["choices"][0]["text"] == "Hello from tiny. . ."
    first, second = slots
    assert set(second) == {"id", "n_ctx", "speculative", "is_processing"}
    assert (first["id_task"], first["is_processing"], first["params"]["n_predict"]) == (0, False, 5)
    assert first["next_token"][0]["n_decoded"] == 5
    assert engine.predicted_tokens == 5 and engine.prompt_tokens == 2


async def test_a_request_waits_for_a_free_slot_and_is_counted_deferred() -> None:
    async with (
        served(options(slots=1, token_secs=0.05)) as (url, engine),
        aiohttp.ClientSession() as session,
    ):
        body = {"prompt": "hi", "max_tokens": 10, "ignore_eos": True}
        first = asyncio.create_task(session.post(f"{url}/v1/completions", json=body))
        await until(lambda: engine.processing == 1)
        second = asyncio.create_task(session.post(f"{url}/v1/completions", json=body))
        await until(lambda: engine.deferred == 1)
        metrics = await engines.metrics(url)
        replies = await asyncio.gather(first, second)
        for reply in replies:
            reply.release()
    assert (metrics["requests_processing"], metrics["requests_deferred"]) == (1.0, 1.0)
    assert [r.status for r in replies] == [200, 200]
    assert (engine.processing, engine.deferred) == (0, 0)


async def test_streamed_chat_is_llama_cpp_sse() -> None:
    async with served(options()) as (url, _), aiohttp.ClientSession() as session:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with session.post(f"{url}/v1/chat/completions", json=body) as reply:
            text = await reply.text()
    payloads = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert payloads[-1] == "[DONE]"
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": None},
        {"content": "Hello from tiny."},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]


async def test_a_bad_prompt_is_a_400() -> None:
    async with (
        served(options()) as (url, _),
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json={"prompt": 3}) as reply,
    ):
        assert reply.status == 400
        error = (await reply.json())["error"]
    assert error == {
        "code": 400,
        "message": "'prompt' must be a string or a list",
        "type": "invalid_request_error",
    }


# --------------------------------------------------------------------------- idle sleep


async def test_idle_sleep_frees_the_claim_and_slots_take_it_again(sim_gpu: SimGpu) -> None:
    opts = options(gpu_uuid=sim_uuid(0), mib=1000, sleep_idle_seconds=0.2)
    async with served(opts, sim_gpu) as (url, engine):
        await until(lambda: engine.idle_asleep)
        assert sim_gpu.read().used_mib(sim_uuid(0)) == 0
        for route in ("/health", "/props", "/v1/models"):
            await get_json(url + route)
        await engines.metrics(url)
        assert engine.idle_asleep, "no probe but /slots wakes it"
        assert (await get_json(f"{url}/props"))["is_sleeping"] is True
        await get_json(f"{url}/slots")
        assert not engine.idle_asleep
        assert sim_gpu.read().used_mib(sim_uuid(0)) == 1000


async def test_a_wake_that_does_not_fit_ends_the_engine(sim_gpu: SimGpu) -> None:
    opts = options(gpu_uuid=sim_uuid(0), mib=1000, sleep_idle_seconds=0.2)
    async with served(opts, sim_gpu) as (url, engine), aiohttp.ClientSession() as session:
        await until(lambda: engine.idle_asleep)
        sim_gpu.claim(sim_uuid(0), os.getppid(), 3500, "someone else")
        try:
            async with session.get(f"{url}/slots") as reply:
                assert reply.status == 500
        finally:
            sim_gpu.release(os.getppid())
    assert engine.stopping.is_set() and engine.exit_code == WAKE_FAILED_EXIT


async def test_generation_is_no_idle_time() -> None:
    async with (
        served(options(sleep_idle_seconds=0.2, token_secs=0.05)) as (url, engine),
        aiohttp.ClientSession() as session,
    ):
        body = {"prompt": "hi", "max_tokens": 12, "ignore_eos": True}
        async with session.post(f"{url}/v1/completions", json=body) as reply:
            assert reply.status == 200
        assert not engine.idle_asleep, "0.6 s of generation did not count as idle"
        await until(lambda: engine.idle_asleep)


# --------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sleep-idle-seconds", "0"], "--sleep-idle-seconds: out of range"),
        (["--sleep-idle-seconds", "5", "--sleep-mode"], "not with --sleep-mode or --orphan"),
        (["-c", "1", "--parallel", "2"], "smaller than --parallel 2"),
        (["--token-secs", "-1"], "--token-secs: out of range"),
    ],
)
def test_bad_flags_are_named(flags: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "uapplace.sim.engine", "--port", "0", "--model-id", "q", *flags],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert done.returncode == 2
    assert message in done.stderr
