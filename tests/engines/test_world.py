"""The llama world's shapes do what they say on the real server (``tests/worlds/llama.py``).

Before a test builds on a corrupt model, a wrong alias, a taken port or an idle sleep, this
checks each is what llama-server really does with it: the corrupt file and the taken port
end the unit ``failed`` with llama.cpp's own words in the engine's log, the wrong alias
serves another id, and the sleeper falls asleep (seen in ``/props``) while uapplaced keeps
it a resident.
"""

from __future__ import annotations

import pytest

from tests.worlds.llama import CORRUPT, LlamaModel, LlamaWorld, rss_mib

pytestmark = pytest.mark.engines

SHAPES = (
    LlamaModel("alpha", "tiny-a", started=True),
    LlamaModel("broken", CORRUPT),
    LlamaModel("wrong", "tiny-a", alias="someone-else"),
    LlamaModel("blocked", "tiny-a", port_taken=True),
)
FAILS_WITH = {
    "broken": "exiting due to model loading error",
    "blocked": "couldn't bind HTTP server socket",
}


@pytest.mark.parametrize("world_models", [SHAPES], indirect=True)
async def test_each_failure_shape_fails_as_llama_server_does(llama: LlamaWorld) -> None:
    for key, words in FAILS_WITH.items():
        await llama.start(key)

        async def failed(key: str = key) -> bool:
            return (await llama.unit_state(key)).active_state == "failed"

        await llama.until(f"{key}'s unit to fail", failed)
        assert words in llama.engine_log(key)
        assert (await llama.resident_states()).get(key) is None

    assert (await llama.start("wrong")).ok
    await llama.wait_healthy("wrong")
    status, listing = await llama.engine_get("wrong", "/v1/models")
    assert status == 200
    assert [m["id"] for m in listing["data"]] == ["someone-else"]
    assert (await llama.resident_states()).get("alpha") == "hot", "alpha was never touched"


@pytest.mark.parametrize(
    "world_models",
    [(LlamaModel("sleepy", "tiny-c", sleep_idle_s=2, started=True),)],
    indirect=True,
)
async def test_an_idle_server_falls_asleep_and_gives_its_memory_back(llama: LlamaWorld) -> None:
    pid = await llama.main_pid("sleepy")
    body = {"prompt": "hello", "max_tokens": 4}
    async with llama.http.post(f"{llama.engine('sleepy').endpoint}/v1/completions", json=body) as r:
        assert r.status == 200, "a completion wakes it (if the world's start let it sleep)"
    awake_mib = rss_mib(pid)
    await llama.wait_asleep("sleepy")
    assert rss_mib(pid) < awake_mib - 20, "tiny-c's weights are freed (mmap, the default)"
    assert await llama.main_pid("sleepy") == pid, "asleep, not restarted"
