"""The fake engine's vLLM sleep API against the simulated GPU, through engines.sleep/wake.

In-process engines (aiohttp on 127.0.0.1) holding a real claim on a simulated GPU
file under this test's PID; one subprocess test for the flags and the process RSS.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from aiohttp import web

from uapplace.io import engines
from uapplace.io.engines import EngineError
from uapplace.sim.engine import READY_PREFIX, EngineMemory, EngineOptions, FakeEngine
from uapplace.sim.gpu import SimGpu, sim_uuid

GPU_MIB = 1000.0


@pytest.fixture
def sim_gpu(tmp_path: Path) -> SimGpu:
    gpu = SimGpu(tmp_path / "gpu.json")
    gpu.create([("", 4096)])
    return gpu


@asynccontextmanager
async def sleepy_engine(gpu: SimGpu, **options: Any) -> AsyncIterator[tuple[str, FakeEngine]]:
    """A loaded fake engine with sleep mode holding ``GPU_MIB`` on the simulated GPU."""
    opts = EngineOptions(
        **{
            "port": 0,
            "model_id": "qwen",
            "gpu_uuid": sim_uuid(0),
            "mib": GPU_MIB,
            "sleep_mode": True,
            **options,
        }
    )
    memory = EngineMemory(opts, gpu, os.getpid())
    memory.hold_host()
    memory.claim_gpu()
    engine = FakeEngine(opts, memory)
    engine.loaded = True
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}", engine
    finally:
        await runner.cleanup()
        memory.release_gpu()
        memory.drop_host()


def held_mib(gpu: SimGpu) -> float:
    return gpu.read().used_mib(sim_uuid(0))


async def chat_status(url: str) -> int:
    body = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", json=body) as response,
    ):
        return response.status


async def test_level_1_frees_the_gpu_and_keeps_host_memory(sim_gpu: SimGpu) -> None:
    async with sleepy_engine(sim_gpu, host_mib=8, offload_mib=4) as (url, engine):
        assert held_mib(sim_gpu) == GPU_MIB
        assert await engines.is_sleeping(url) is False

        await engines.sleep(url, 1, timeout=10)

        assert held_mib(sim_gpu) == 0
        assert engine.memory.host_held_mib == 12, "host memory kept, the weights' copy added"
        assert await engines.is_sleeping(url) is True
        assert await engines.health(url) is True, "vLLM stays healthy while asleep"
        assert await engines.served_ids(url) == ["qwen"]
        assert await chat_status(url) == 503


async def test_level_2_frees_the_gpu_and_host_memory(sim_gpu: SimGpu) -> None:
    async with sleepy_engine(sim_gpu, host_mib=8, offload_mib=4) as (url, engine):
        await engines.sleep(url, 2, timeout=10)
        assert held_mib(sim_gpu) == 0
        assert engine.memory.host_held_mib == 0
        assert await engines.is_sleeping(url) is True


async def test_wake_restores_the_claim_after_the_delay(sim_gpu: SimGpu) -> None:
    async with sleepy_engine(sim_gpu, host_mib=8, wake_delay=0.3) as (url, engine):
        await engines.sleep(url, 2, timeout=10)
        waking = asyncio.create_task(engines.wake(url, timeout=10))
        await asyncio.sleep(0.05)
        assert not waking.done(), "wake answers only after --wake-delay"
        assert held_mib(sim_gpu) == 0, "the claim comes back at the end of the wake"
        await waking
        assert held_mib(sim_gpu) == GPU_MIB
        assert engine.memory.host_held_mib == 8
        assert await engines.is_sleeping(url) is False
        assert await chat_status(url) == 200


async def test_wake_of_an_awake_engine_is_a_no_op(sim_gpu: SimGpu) -> None:
    async with sleepy_engine(sim_gpu) as (url, _):
        await engines.wake(url, timeout=10)
        assert held_mib(sim_gpu) == GPU_MIB
        assert await engines.is_sleeping(url) is False


async def test_failing_wake_raises_and_stays_asleep(sim_gpu: SimGpu) -> None:
    async with sleepy_engine(sim_gpu, fail_wake=True) as (url, _):
        await engines.sleep(url, 1, timeout=10)
        with pytest.raises(EngineError, match=r"POST .*/wake_up: HTTP 500: .*--fail-wake"):
            await engines.wake(url, timeout=10)
        assert held_mib(sim_gpu) == 0
        assert await engines.is_sleeping(url) is True
        assert await chat_status(url) == 503


async def test_wake_that_does_not_fit_stays_asleep(sim_gpu: SimGpu) -> None:
    async with sleepy_engine(sim_gpu) as (url, _):
        await engines.sleep(url, 1, timeout=10)
        sim_gpu.claim(sim_uuid(0), os.getppid(), 3500, "someone else")
        try:
            with pytest.raises(EngineError, match=r"HTTP 500: .*out of memory"):
                await engines.wake(url, timeout=10)
            assert await engines.is_sleeping(url) is True
        finally:
            sim_gpu.release(os.getppid())


async def test_sleep_routes_are_404_without_sleep_mode(sim_gpu: SimGpu) -> None:
    async with sleepy_engine(sim_gpu, sleep_mode=False) as (url, _):
        with pytest.raises(EngineError, match=r"HTTP 404: .*--enable-sleep-mode"):
            await engines.sleep(url, 1, timeout=10)
        with pytest.raises(EngineError, match=r"/wake_up: HTTP 404"):
            await engines.wake(url, timeout=10)
        # No vLLM sleep routes, but the engine's /props (llama.cpp's) says it is awake.
        assert await engines.is_sleeping(url) is False
        assert held_mib(sim_gpu) == GPU_MIB


async def test_bad_levels_are_refused(sim_gpu: SimGpu) -> None:
    async with sleepy_engine(sim_gpu) as (url, _):
        with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
            await engines.sleep(url, 3)
        async with aiohttp.ClientSession() as session, session.post(f"{url}/sleep?level=3") as r:
            assert r.status == 400
        assert held_mib(sim_gpu) == GPU_MIB


async def test_sleep_while_loading_is_503(sim_gpu: SimGpu) -> None:
    async with sleepy_engine(sim_gpu) as (url, engine):
        engine.loaded = False
        with pytest.raises(EngineError, match="HTTP 503"):
            await engines.sleep(url, 1, timeout=10)


def test_engine_process_sleep_flags_and_rss(sim_gpu: SimGpu) -> None:
    """The real process: ``--sleep-mode`` flags, level 1 keeps the RSS, level 2 drops it."""
    env = {**os.environ, "UAPPLACE_SIM_GPU": str(sim_gpu.path)}
    command = [
        *(sys.executable, "-m", "uapplace.sim.engine", "--port", "0", "--model-id", "q"),
        *("--gpu-uuid", sim_uuid(0), "--mib", "500", "--host-mib", "64", "--sleep-mode"),
    ]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().removeprefix(READY_PREFIX).strip()

        async def scenario() -> tuple[float, float, float]:
            assert await engines.wait_healthy(url, time.monotonic() + 20)
            rss = psutil.Process(proc.pid).memory_info().rss / 2**20
            await engines.sleep(url, 1, timeout=10)
            after_1 = psutil.Process(proc.pid).memory_info().rss / 2**20
            await engines.sleep(url, 2, timeout=10)
            after_2 = psutil.Process(proc.pid).memory_info().rss / 2**20
            return rss, after_1, after_2

        rss, after_1, after_2 = asyncio.run(scenario())
        assert held_mib(sim_gpu) == 0
        assert after_1 > rss - 8, "level 1 keeps the host memory"
        assert after_2 < after_1 - 48, "level 2 drops it"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        if proc.stdout is not None:
            proc.stdout.close()
    assert held_mib(sim_gpu) == 0


def test_sleep_flag_ranges_are_checked() -> None:
    flags = ("--port", "0", "--model-id", "q", "--wake-delay", "-1")
    result = subprocess.run(
        [sys.executable, "-m", "uapplace.sim.engine", *flags],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 2
    assert "--wake-delay: out of range" in result.stderr
