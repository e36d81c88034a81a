"""llama.cpp's router mode: the client (:mod:`uapplace.io.router`) against the fake router
(:mod:`uapplace.sim.router`), and the probes that must read one model of it.

The fake router is served in this process (aiohttp on 127.0.0.1); its children are the
fake engine served by tasks of this loop (:class:`~uapplace.sim.router.InProcessLauncher`),
so a load takes milliseconds. One test runs the router as a process with real child
processes: the ``--alias`` in their command line is how uapplace tells one model's
process from the router's and its siblings', and a child ignores SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import psutil
import pytest
from http_fixtures import serving

from tests.worlds.builders import measured
from uapplace.core.model import Model
from uapplace.io import router
from uapplace.io.rails import ProbeState, probe_rails
from uapplace.io.router import HTTP_ROUTER, RouterError
from uapplace.publish import verify
from uapplace.sim.router import (
    READY_PREFIX,
    FakeRouter,
    InProcessLauncher,
    RouterOptions,
    discover,
    models_in,
    parse_preset,
)

FAST = router.Polling(first_s=0.01, max_s=0.05, http_s=2.0)


@contextlib.asynccontextmanager
async def fake_router(
    tmp_path: Path, preset: str = "", models_max: int = 1, **options: object
) -> AsyncIterator[tuple[str, FakeRouter]]:
    """A router over ``tiny-a`` and ``tiny-b`` (files) plus the preset's models."""
    folder = models_in(["tiny-a", "tiny-b"], tmp_path / "models")
    specs = discover(folder, parse_preset(preset))
    opts = RouterOptions(port=0, models_dir=folder, models_max=models_max, **options)  # type: ignore[arg-type]
    fake = FakeRouter(opts, specs, InProcessLauncher())
    async with serving(fake.app()) as url:
        yield url, fake


async def statuses(url: str) -> dict[str, str]:
    return {k: m.status for k, m in (await HTTP_ROUTER.models(url, 2.0)).items()}


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


async def loaded(url: str, model_id: str) -> router.RouterModel:
    await HTTP_ROUTER.load(url, model_id, 2.0)
    return await router.wait_for(HTTP_ROUTER, url, model_id, router.SERVING, 5.0, FAST)


# --------------------------------------------------------------------------- the routes


async def test_models_lists_every_model_loaded_or_not(tmp_path: Path) -> None:
    async with fake_router(tmp_path) as (url, _):
        assert await statuses(url) == {"tiny-a": "unloaded", "tiny-b": "unloaded"}
        # What made verify-up pass with nothing loaded: every id is "served".
        async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as r:
            ids = [m["id"] for m in (await r.json())["data"]]
        assert ids == ["tiny-a", "tiny-b"]
        status, body = await get(f"{url}/health")
        assert (status, body) == (200, '{"status": "ok"}')


async def test_load_answers_at_once_then_the_status_moves(tmp_path: Path) -> None:
    async with fake_router(tmp_path) as (url, fake):
        await HTTP_ROUTER.load(url, "tiny-a", 2.0)
        assert (await statuses(url))["tiny-a"] == "loading"
        seen = await router.wait_for(HTTP_ROUTER, url, "tiny-a", router.SERVING, 5.0, FAST)
        assert seen.status == "loaded" and not seen.failed
        assert router.alias_of(seen.args) == "tiny-a" and "--port" in seen.args
        # Loading a running model is the state asked for: no error.
        await HTTP_ROUTER.load(url, "tiny-a", 2.0)
        await HTTP_ROUTER.unload(url, "tiny-a", 2.0)
        done = await router.wait_for(
            HTTP_ROUTER, url, "tiny-a", frozenset({router.UNLOADED}), 5.0, FAST
        )
        assert not done.failed and done.exit_code is None  # shown only after a failure
        await HTTP_ROUTER.unload(url, "tiny-a", 2.0)  # not running: the state asked for
        assert fake.instances["tiny-a"].child is None


async def test_an_unknown_id_is_refused_by_name(tmp_path: Path) -> None:
    async with fake_router(tmp_path) as (url, _):
        with pytest.raises(RouterError, match="HTTP 404"):
            await HTTP_ROUTER.load(url, "nope", 2.0)
        with pytest.raises(RouterError, match=r"no model 'nope' \(it lists: tiny-a, tiny-b\)"):
            await router.status_of(HTTP_ROUTER, url, "nope", 2.0)


async def test_a_failed_load_shows_failed_and_its_exit_code(tmp_path: Path) -> None:
    preset = "[broken]\nmodel = /nowhere/broken.gguf\nfail-at-start = true\n"
    async with fake_router(tmp_path, preset) as (url, _):
        await HTTP_ROUTER.load(url, "broken", 2.0)
        with pytest.raises(RouterError, match=r"broken unloaded \(failed, exit code 1\)"):
            await router.wait_for(HTTP_ROUTER, url, "broken", router.SERVING, 5.0, FAST)


async def test_models_max_evicts_the_least_recently_used(tmp_path: Path) -> None:
    async with fake_router(tmp_path, models_max=1) as (url, _):
        await loaded(url, "tiny-a")
        await loaded(url, "tiny-b")
        assert await statuses(url) == {"tiny-a": "unloaded", "tiny-b": "loaded"}


async def test_model_routes_need_a_model_and_autoload_false_never_loads(tmp_path: Path) -> None:
    async with fake_router(tmp_path) as (url, _):
        for path in ("/slots", "/metrics"):
            status, body = await get(f"{url}{path}")
            assert status == 400 and "model name is missing from the request" in body
        status, body = await get(f"{url}/props")
        assert status == 200 and '"role": "router"' in body
        query = router.model_query("tiny-a")
        for path in ("/props", "/slots", "/metrics"):
            status, body = await get(f"{url}{path}?{query}")
            assert status == 400 and "model is not loaded" in body, (path, body)
        assert (await statuses(url))["tiny-a"] == "unloaded"
        # Without autoload=false, /slots?model= loads it (what uapplace never sends).
        status, _ = await get(f"{url}/slots?model=tiny-a")
        assert status == 200 and (await statuses(url))["tiny-a"] == "loaded"


async def test_a_completion_is_routed_by_its_model(tmp_path: Path) -> None:
    async with fake_router(tmp_path, models_max=2) as (url, _):
        body = {"model": "tiny-b", "messages": [{"role": "user", "content": "hi"}]}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{url}/v1/chat/completions", json=body) as response,
        ):
            answer = await response.json()
        assert response.status == 200 and "tiny-b" in answer["choices"][0]["message"]["content"]
        assert await statuses(url) == {"tiny-a": "unloaded", "tiny-b": "loaded"}


# --------------------------------------------------------------------------- the probes


def router_model(key: str) -> Model:
    config = measured(f"{key}-q4", 100.0, pause_lever="llamacpp-router", unit="router")
    return Model(key, key, "llama.cpp", {config.key: config}, unit="router")


async def test_verify_check_needs_the_model_loaded_in_the_router(tmp_path: Path) -> None:
    async with fake_router(tmp_path) as (url, _):
        model = router_model("tiny-a")
        expect = verify.expectation(model, model.configs["tiny-a-q4"])
        assert expect.router_id == "tiny-a"
        verdict = await verify.check(url, expect, 2.0)
        assert verdict.outcome is verify.Outcome.UNHEALTHY
        assert "says tiny-a unloaded: not loaded, so not serving" in verdict.detail
        await loaded(url, "tiny-a")
        verdict = await verify.check(url, expect, 2.0)
        assert verdict.ok, verdict


async def test_rails_of_a_router_model_come_from_its_props(tmp_path: Path) -> None:
    async with fake_router(tmp_path, "[*]\nparallel = 3\n") as (url, _):
        live = await probe_rails(url, "llama.cpp", 2.0, router_model="tiny-a")
        assert live.state is ProbeState.NOT_PROBED and "not loaded" in live.detail
        assert (await statuses(url))["tiny-a"] == "unloaded"  # the probe loaded nothing
        await loaded(url, "tiny-a")
        live = await probe_rails(url, "llama.cpp", 2.0, router_model="tiny-a")
        assert (live.state, live.rails, live.source) == (ProbeState.OK, 3, "props")
        # Without the model the router's /slots is a 400: never one rail.
        plain = await probe_rails(url, "llama.cpp", 2.0)
        assert plain.rails is None


def test_the_router_model_id_is_the_first_advertised_id_else_the_key() -> None:
    plain = router_model("tiny-a")
    assert router.router_model_id(plain) == "tiny-a"
    named = Model("qwen", "Qwen", "llama.cpp", plain.configs, advertises=("Qwen3-Q4", "qwen3"))
    assert router.router_model_id(named) == "Qwen3-Q4"


def test_the_alias_is_read_from_a_command_line() -> None:
    assert router.alias_of(["llama-server", "--port", "1", "--alias", "tiny-a"]) == "tiny-a"
    assert router.alias_of(["llama-server", "-a", "x"]) == "x"
    assert router.alias_of(["llama-server", "--alias=y"]) == "y"
    assert router.alias_of(["llama-server", "--models-dir", "/m"]) is None


def test_a_preset_is_parsed_like_llama_cpp_s() -> None:
    text = (
        "version = 1\n[*]\nc = 512\n[tiny-a]\nalias = small, a\nmib = 30\n"
        "[big]\nmodel = /m/c.gguf\n"
    )
    sections = parse_preset(text)
    assert sections == {
        "*": {"c": "512"},
        "tiny-a": {"alias": "small, a", "mib": "30"},
        "big": {"model": "/m/c.gguf"},
    }
    specs = discover(None, {k: v for k, v in sections.items() if k != "tiny-a"})
    assert specs["big"].args == ("--c", "512") and specs["big"].path == "/m/c.gguf"
    with pytest.raises(ValueError, match="no `model = PATH`"):
        discover(None, {"tiny-a": {"alias": "x"}})


# --------------------------------------------------------------------------- real processes


def test_children_are_processes_with_their_alias_and_ignore_sigterm(tmp_path: Path) -> None:
    folder = models_in(["tiny-a", "tiny-b"], tmp_path / "models")
    argv = [
        sys.executable,
        "-m",
        "uapplace.sim.router",
        "--port",
        "0",
        "--models-dir",
        str(folder),
        "--models-max",
        "2",
        "--parallel",
        "2",
    ]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith(READY_PREFIX), line
        url = line.removeprefix(READY_PREFIX).split()[0]
        asyncio.run(_load_both(url))
        pids = [process.pid, *(c.pid for c in psutil.Process(process.pid).children())]
        a, b = router.child_pids(pids, "tiny-a"), router.child_pids(pids, "tiny-b")
        assert len(a) == 1 and len(b) == 1 and a != b and process.pid not in a + b
        os.kill(a[0], signal.SIGTERM)
        time.sleep(0.5)
        assert psutil.pid_exists(a[0]), "a router's child ignores SIGTERM"
        assert asyncio.run(statuses(url))["tiny-a"] == "loaded"
        asyncio.run(HTTP_ROUTER.unload(url, "tiny-a", 2.0))
        psutil.Process(a[0]).wait(timeout=5)
    finally:
        process.terminate()  # the router unloads every child, then exits 0
        assert process.wait(timeout=15) == 0
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(folder) in " ".join(p.info["cmdline"] or [])
    ]


async def _load_both(url: str) -> None:
    for model_id in ("tiny-a", "tiny-b"):
        await HTTP_ROUTER.load(url, model_id, 2.0)
    for model_id in ("tiny-a", "tiny-b"):
        await router.wait_for(HTTP_ROUTER, url, model_id, router.SERVING, 15.0, FAST)
