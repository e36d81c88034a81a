"""engines.py against real aiohttp servers on 127.0.0.1: the fake engine and a tiny fake proxy.

Also the fake engine as a process: claims and releases on the simulated GPU,
failure flags, the orphan child.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from http_fixtures import closed_port_url, serving

from uapplace.io import engines
from uapplace.io.engines import EngineError, ProxyClient, ProxyTokenRejected, parse_prometheus
from uapplace.sim.engine import READY_PREFIX, EngineOptions, FakeEngine
from uapplace.sim.gpu import SimGpu, pid_alive, sim_uuid

# --------------------------------------------------------------------------- helpers


@asynccontextmanager
async def fake_engine(**options: Any) -> AsyncIterator[tuple[str, FakeEngine]]:
    engine = FakeEngine(EngineOptions(port=0, **{"model_id": "qwen", **options}))
    loading = asyncio.create_task(engine.finish_loading())
    async with serving(engine.app()) as url:
        try:
            yield url, engine
        finally:
            loading.cancel()


async def eventually(condition: Callable[[], bool], guard_s: float = 20) -> None:
    """Poll a condition nothing signals (a file appearing, a PID ending); guard against hangs."""
    async with asyncio.timeout(guard_s):
        while True:
            if condition():
                return
            await asyncio.sleep(0.02)


# --------------------------------------------------------------------------- engine probes


async def test_health_is_false_while_loading_then_true() -> None:
    async with fake_engine(load_secs=3600) as (url, engine):
        assert await engines.health(url) is False
        engine.loaded = True
        assert await engines.health(url) is True


async def test_probes_of_a_dead_endpoint() -> None:
    url = closed_port_url()
    assert await engines.health(url) is False
    assert await engines.slots(url) is None
    with pytest.raises(EngineError, match=rf"GET {url}/v1/models: "):
        await engines.served_ids(url)
    with pytest.raises(EngineError, match=rf"GET {url}/metrics: "):
        await engines.metrics(url)


async def test_served_ids_in_order_and_v1_suffix_accepted() -> None:
    async with fake_engine(advertise=("qwen-27b", "qwen")) as (url, _):
        assert await engines.served_ids(url) == ["qwen", "qwen-27b"]
        assert await engines.served_ids(f"{url}/v1/") == ["qwen", "qwen-27b"]


async def test_wrong_id_is_served_when_asked() -> None:
    async with fake_engine(wrong_id=True, advertise=("other",)) as (url, _):
        assert await engines.served_ids(url) == ["wrong-qwen"]


async def test_served_ids_while_loading_names_the_url_and_status() -> None:
    async with fake_engine(never_healthy=True) as (url, _):
        with pytest.raises(EngineError, match=rf"GET {url}/v1/models: HTTP 503"):
            await engines.served_ids(url)
        assert await engines.slots(url) is None


async def test_served_ids_rejects_a_non_openai_body() -> None:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"models": ["x"]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with serving(app) as url:
        with pytest.raises(EngineError, match=r"not an OpenAI model list: data: Field required"):
            await engines.served_ids(url)


async def test_metrics_give_the_metrics_must_match_keys() -> None:
    async with fake_engine(kv="int8", max_context=131072, slots=2) as (url, _):
        found = await engines.metrics(url)
    assert found["kv"] == "int8"
    assert found["max_context"] == 131072.0
    assert found["slots"] == 2.0
    assert found["llamacpp:max_context"] == 131072.0
    assert found['llamacpp:engine_info{kv="int8",model="qwen",engine="uapplace-sim"}'] == 1.0
    assert found["model"] == "qwen"


async def test_slots_split_the_pool() -> None:
    async with fake_engine(max_context=131072, slots=2, kv="int8") as (url, _):
        found = await engines.slots(url)
    assert found is not None
    assert [(s["id"], s["n_ctx"]) for s in found] == [(0, 65536), (1, 65536)]


async def test_chat_completion_names_the_model() -> None:
    async with fake_engine() as (url, engine), aiohttp.ClientSession() as session:
        body = {"model": "qwen", "messages": [{"role": "user", "content": "hi there"}]}
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 200
            reply = await response.json()
        async with session.post(
            f"{url}/v1/chat/completions", json={**body, "stream": True}
        ) as response:
            stream = await response.text()
    assert reply["model"] == "qwen"
    assert reply["choices"][0]["message"]["content"] == "Hello from qwen."
    assert reply["usage"]["prompt_tokens"] == 2
    assert "Hello from qwen." in stream
    assert stream.endswith("data: [DONE]\n\n")
    assert engine.prompt_tokens == 4


async def test_wait_healthy_follows_loading() -> None:
    async with fake_engine(load_secs=0.3) as (url, _):
        assert await engines.wait_healthy(url, time.monotonic() + 30) is True


async def test_wait_healthy_gives_up_at_the_deadline() -> None:
    async with fake_engine(never_healthy=True) as (url, _):
        assert await engines.wait_healthy(url, time.monotonic() + 0.3) is False
    assert await engines.wait_healthy(closed_port_url(), time.monotonic() + 0.2) is False


# --------------------------------------------------------------------------- Prometheus text


def test_parse_prometheus_labels_escapes_and_specials() -> None:
    text = "\n".join(
        [
            "# HELP x_total Something.",
            "# TYPE x_total counter",
            'x_total{path="/a b",q="say \\"hi\\"\\n"} 3 1700000000',
            "ns:up +Inf",
            "ns:down NaN",
            "up 1",
            'build_info{version="1.2",kv="f16"} 1',
            "",
        ]
    )
    found = parse_prometheus(text)
    assert found['x_total{path="/a b",q="say \\"hi\\"\\n"}'] == 3.0
    assert found["up"] == 1.0  # the explicit name wins over ns:up's alias
    assert found["ns:up"] == math.inf
    assert isinstance(found["down"], float) and math.isnan(found["down"])
    assert found["version"] == "1.2"
    assert found["kv"] == "f16"


@pytest.mark.parametrize(
    ("line", "why"),
    # prometheus_client's parser says why (its words), the line number is ours.
    [
        ("x{a=1} 2", "Invalid labels"),
        ('x{a="1} 2', "could not convert"),
        ("x abc", "could not convert"),
    ],
)
def test_parse_prometheus_names_the_bad_line(line: str, why: str) -> None:
    with pytest.raises(ValueError, match=rf"metrics line 2: {why}"):
        parse_prometheus(f"ok 1\n{line}\n")


# --------------------------------------------------------------------------- the proxy


class FakeProxy:
    def __init__(self) -> None:
        self.auth: list[str | None] = []
        self.inflight_reply: tuple[int, Any] = (200, {"targets": {}})
        self.refresh_reply: tuple[int, Any] = (200, {"ok": True, "cleared": []})
        self.delay = 0.0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/internal/placement/inflight", self.inflight)
        app.router.add_post("/internal/placement/refresh", self.refresh)
        return app

    async def _answer(self, request: web.Request, reply: tuple[int, Any]) -> web.Response:
        self.auth.append(request.headers.get("Authorization"))
        await asyncio.sleep(self.delay)
        status, body = reply
        if isinstance(body, str):
            return web.Response(status=status, text=body)
        return web.json_response(body, status=status)

    async def inflight(self, request: web.Request) -> web.Response:
        return await self._answer(request, self.inflight_reply)

    async def refresh(self, request: web.Request) -> web.Response:
        return await self._answer(request, self.refresh_reply)


@pytest.fixture
def proxy() -> FakeProxy:
    return FakeProxy()


async def test_inflight_returns_targets_with_the_bearer_token(proxy: FakeProxy) -> None:
    busy = {"id": "r1", "client": "claude", "started_at": "2026-10-08T14:02:00Z"}
    proxy.inflight_reply = (200, {"targets": {"gpu0:http://127.0.0.1:8080": [busy], "x": []}})
    async with serving(proxy.app()) as url:
        found = await ProxyClient(url + "/", "s3cret").inflight()
    assert found == {"gpu0:http://127.0.0.1:8080": [busy], "x": []}
    assert proxy.auth == ["Bearer s3cret"]


async def test_no_token_sends_no_authorization(proxy: FakeProxy) -> None:
    async with serving(proxy.app()) as url:
        assert await ProxyClient(url, None).inflight() == {}
    assert proxy.auth == [None]


@pytest.mark.parametrize(
    "reply",
    [(403, {"error": "no"}), (500, "boom"), (200, "not json"), (200, {"targets": [1]}), (200, {})],
)
async def test_inflight_unknown_is_none(proxy: FakeProxy, reply: tuple[int, Any]) -> None:
    proxy.inflight_reply = reply
    async with serving(proxy.app()) as url:
        assert await ProxyClient(url, "t").inflight() is None


async def test_a_401_is_a_token_mismatch_everywhere(proxy: FakeProxy) -> None:
    """Not "unknown": inflight raises, refresh and check name the mismatch."""
    proxy.inflight_reply = proxy.refresh_reply = (401, {"error": "missing or wrong bearer token"})
    async with serving(proxy.app()) as url:
        client = ProxyClient(url, "wrong")
        with pytest.raises(ProxyTokenRejected, match="HTTP 401") as raised:
            await client.inflight()
        ok, detail = await client.refresh()
        problem = await client.check()
        no_token = await ProxyClient(url, None).check()
    assert isinstance(raised.value, EngineError)
    assert f"{url}/internal/placement/inflight refused the token" in str(raised.value)
    assert ok is False and "different tokens" in detail and "/refresh" in detail
    assert problem == str(raised.value)
    assert no_token is not None and "refused no token" in no_token


async def test_check_of_a_good_and_a_dead_proxy(proxy: FakeProxy) -> None:
    async with serving(proxy.app()) as url:
        assert await ProxyClient(url, "t").check() is None
    dead = await ProxyClient(closed_port_url(), "t").check()
    assert dead is not None and "no usable answer" in dead


async def test_inflight_timeout_and_refused_are_none(proxy: FakeProxy) -> None:
    proxy.delay = 0.3
    async with serving(proxy.app()) as url:
        assert await ProxyClient(url, None, timeout_s=0.05).inflight() is None
    assert await ProxyClient(closed_port_url(), None).inflight() is None


async def test_refresh_reports_what_was_cleared(proxy: FakeProxy) -> None:
    proxy.refresh_reply = (200, {"ok": True, "cleared": ["upstream_ids", "slots"]})
    async with serving(proxy.app()) as url:
        assert await ProxyClient(url, "t").refresh() == (True, "cleared upstream_ids, slots")
    assert proxy.auth == ["Bearer t"]


@pytest.mark.parametrize(
    ("reply", "detail"),
    [
        ((500, "boom"), "HTTP 500: boom"),
        ((200, "nope"), "body is not JSON"),
        ((200, {"ok": False}), "proxy did not answer ok"),
    ],
)
async def test_refresh_failures_say_why(
    proxy: FakeProxy, reply: tuple[int, Any], detail: str
) -> None:
    proxy.refresh_reply = reply
    async with serving(proxy.app()) as url:
        ok, text = await ProxyClient(url, None).refresh()
    assert ok is False
    assert f"POST {url}/internal/placement/refresh: {detail}" in text


async def test_refresh_of_a_dead_proxy() -> None:
    ok, text = await ProxyClient(closed_port_url(), None).refresh()
    assert ok is False
    assert "/internal/placement/refresh: " in text


# --------------------------------------------------------------------------- the engine process


@pytest.fixture
def sim_gpu(tmp_path: Path) -> SimGpu:
    gpu = SimGpu(tmp_path / "gpu.json")
    gpu.create([("", 24576)])
    return gpu


class EngineProcess:
    def __init__(self, sim: SimGpu, *args: str) -> None:
        env = {**os.environ, "UAPPLACE_SIM_GPU": str(sim.path)}
        command = [sys.executable, "-m", "uapplace.sim.engine", "--port", "0", *args]
        self.proc = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def url(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith(READY_PREFIX), line + self.stderr()
        return line.removeprefix(READY_PREFIX).strip()

    def stderr(self) -> str:
        assert self.proc.stderr is not None
        return self.proc.stderr.read() if self.proc.poll() is not None else ""

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(10)


@pytest.fixture
def processes() -> Iterator[list[EngineProcess]]:
    started: list[EngineProcess] = []
    yield started
    for engine in started:
        if engine.proc.poll() is None:
            engine.proc.kill()
            engine.proc.wait(10)
        for stream in (engine.proc.stdout, engine.proc.stderr):
            if stream is not None:
                stream.close()


def held(sim: SimGpu) -> list[tuple[int, float]]:
    return [(a.pid, a.used_mib) for a in sim.read().allocations]


async def test_engine_claims_after_binding_and_releases_on_sigterm(
    sim_gpu: SimGpu, processes: list[EngineProcess]
) -> None:
    engine = EngineProcess(
        sim_gpu, "--model-id", "qwen", "--gpu-uuid", sim_uuid(0), "--mib", "1000"
    )
    processes.append(engine)
    url = engine.url()
    assert await engines.wait_healthy(url, time.monotonic() + 20)
    assert held(sim_gpu) == [(engine.proc.pid, 1000.0)]

    assert engine.stop() == 0
    assert held(sim_gpu) == []


def test_engine_fail_at_start_claims_nothing(
    sim_gpu: SimGpu, processes: list[EngineProcess]
) -> None:
    engine = EngineProcess(
        sim_gpu, "--model-id", "q", "--gpu-uuid", sim_uuid(0), "--mib", "10", "--fail-at-start"
    )
    processes.append(engine)
    assert engine.proc.wait(20) == 1
    assert "--fail-at-start" in engine.stderr()
    assert held(sim_gpu) == []


def test_engine_that_does_not_fit_exits_1(sim_gpu: SimGpu, processes: list[EngineProcess]) -> None:
    engine = EngineProcess(sim_gpu, "--model-id", "q", "--gpu-uuid", sim_uuid(0), "--mib", "99999")
    processes.append(engine)
    assert engine.proc.wait(20) == 1
    assert engine.proc.stdout is not None
    assert "out of memory" in engine.proc.stdout.read()
    assert held(sim_gpu) == []


def test_engine_bad_arguments_name_the_flag(
    sim_gpu: SimGpu, processes: list[EngineProcess]
) -> None:
    engine = EngineProcess(sim_gpu, "--model-id", "q", "--slots", "0")
    processes.append(engine)
    assert engine.proc.wait(20) == 2
    assert "--slots: out of range" in engine.stderr()


async def test_orphan_keeps_the_allocation_after_the_parent_stops(
    sim_gpu: SimGpu, processes: list[EngineProcess], tmp_path: Path
) -> None:
    pidfile = tmp_path / "orphan.pid"
    engine = EngineProcess(
        sim_gpu,
        *("--model-id", "q", "--gpu-uuid", sim_uuid(0), "--mib", "2048"),
        *("--orphan", "--orphan-pidfile", str(pidfile), "--orphan-lifetime", "30"),
    )
    processes.append(engine)
    url = engine.url()
    assert await engines.wait_healthy(url, time.monotonic() + 20)
    await eventually(pidfile.exists)  # the child writes it right after its claim
    orphan = int(pidfile.read_text())
    try:
        assert orphan != engine.proc.pid
        assert held(sim_gpu) == [(orphan, 2048.0)]

        assert engine.stop() == 0
        assert pid_alive(orphan)
        assert held(sim_gpu) == [(orphan, 2048.0)]
    finally:
        os.kill(orphan, signal.SIGTERM)
    await eventually(lambda: not pid_alive(orphan))
    assert held(sim_gpu) == []
