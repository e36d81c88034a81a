"""A swap between two real llama-servers while a real stream runs straight to the victim.

Issue 19 ("Build", tier 4): park → preview → apply on the CPU tier, the whole §4.6
sequence against the real engine (docs/placement-rules.md §4.6). ``cpu0``'s budget is
cut to the reserve plus 150 MiB, and each model's measured ``host_rss_mib`` is 100 MiB:
alpha (tiny-c, one slot, running) and beta (tiny-a) cannot both be resident, so the only
option for beta displaces alpha.

The stream is sent **straight to alpha's llama-server**, not through the proxy, so the
proxy's in-flight list is empty all along: only the engine's own ``/slots`` can hold the
stop back (docs/placement-rules.md §4.6, "Drain: the engine's own word"). Its length is
set from alpha's measured token rate, so it lasts seconds (:data:`STREAM_S`) on any machine.
Then: the stream ends whole (``data: [DONE]``), alpha's unit is stopped and its processes
are gone (verify-free on the host), beta is started and verified on the real ``/health``,
the served id of ``/v1/models`` and ``metricsMustMatch`` ``{"n_ctx": 256, "total_slots":
2}``, facts llama.cpp serves only in ``/props`` (``-c 512 --parallel 2``), the proxy is
refreshed, and beta serves. Once through the CLI (``uapplace pending``, ``preview``,
``apply ID 1 --yes``), once through the shim (the dashboard's ``resolve``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import Any

import psutil
import pytest

from tests.worlds.llama import LLAMA_TIMEOUTS, LlamaModel, LlamaWorld
from tests.worlds.steps import APPLY_STEPS, detail

pytestmark = pytest.mark.engines

STREAM_S = {"cli": 5.0, "shim": 3.0}
"""How long the stream to alpha should last, by the path that applies: long enough to be
caught mid-generation by the drain (a CLI call takes a second or two to get there on a
loaded machine; the shim's call a few milliseconds), short enough for the drain bound.
The rate probe is a rough guide on a shared machine: streams ran 0.6 to 1.6 times the
time it predicted."""
RESERVED_MIB = 256
MODEL_MIB = 100.0
VICTIM = LlamaModel(
    "alpha",
    "tiny-c",
    started=True,
    ctx_size=1024,
    parallel=1,
    # One thread, so the daemon and the CLI keep a core; context shift, so the stream's
    # length is set by max_tokens alone.
    extra_args=("--context-shift", "-t", "1"),
    host_rss_mib=MODEL_MIB,
)
NEWCOMER = LlamaModel(
    "beta", "tiny-a", host_rss_mib=MODEL_MIB, metrics_must_match={"n_ctx": 256, "total_slots": 2}
)
SWAP = (VICTIM, NEWCOMER)


@pytest.fixture
def world_options() -> dict[str, Any]:
    """``cpu0`` holds one of the two (the reserve + 150 MiB); the drain may wait 45 s."""
    return {
        "timeouts": replace(LLAMA_TIMEOUTS, drain_s=45.0),
        "cpu_total_mib": RESERVED_MIB + 150,
        "cpu_reserved_mib": RESERVED_MIB,
    }


async def stream_body(world: LlamaWorld, key: str, seconds: float) -> dict[str, Any]:
    """A completion that generates for about ``seconds`` on ``key``'s server, from its
    token rate on a short completion first (tiny models differ by machine and load)."""
    probe = {"prompt": "hello", "max_tokens": 32, "ignore_eos": True}
    rate = float((await world.complete(key, probe))["timings"]["predicted_per_second"])
    return {"prompt": "hello world", "max_tokens": max(64, round(rate * seconds))}


async def park_beta(world: LlamaWorld) -> str:
    """Beta parks; its one option displaces alpha (the CPU budget holds one of them)."""
    placement = await world.park("beta", "swap-client")
    [option] = await world.options_of(placement)
    assert option["kind"] == "displace", option
    assert [(v["model"], v["config"]) for v in option["victims"]] == [("alpha", "alpha-f32")]
    return placement


async def show_through_cli(world: LlamaWorld, placement: str) -> None:
    """``uapplace pending`` and ``uapplace preview beta`` show the displacement."""
    listed = await world.cli_json("pending")
    [entry] = [e for e in listed["pending"] if e["id"] == placement]
    assert entry["requested_model"] == "beta"
    assert [o["kind"] for o in entry["options"]] == ["displace"]
    plan = await world.cli_json("preview", "beta")
    [first, *_] = plan["options"]
    assert (first["kind"], [v["model"] for v in first["victims"]]) == ("displace", ["alpha"])


async def apply_through_cli(world: LlamaWorld, placement: str) -> dict[str, Any]:
    """``uapplace apply ID 1 --yes``: its result."""
    done = await world.cli("apply", placement, "1", "--yes", "--json")
    assert done.returncode == 0, done.stderr + done.stdout
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.mark.parametrize("world_models", [SWAP], indirect=True)
@pytest.mark.parametrize("path", ["cli", "shim"])
async def test_a_swap_drains_a_stream_straight_to_the_victim_then_serves_the_newcomer(
    llama: LlamaWorld, path: str
) -> None:
    alpha, beta = llama.engine("alpha"), llama.engine("beta")
    placement = await park_beta(llama)
    if path == "cli":
        await show_through_cli(llama, placement)
    body = await stream_body(llama, "alpha", STREAM_S[path])
    victim_pid = await llama.main_pid("alpha")

    stream = asyncio.create_task(llama.stream("alpha", body))
    try:
        await llama.until("alpha's slot to process the stream", lambda: stream_running(llama))
        started = time.monotonic()
        if path == "cli":
            result = await apply_through_cli(llama, placement)
        else:
            result = await llama.resolve(placement, 1)
        took = time.monotonic() - started
        events = await asyncio.wait_for(stream, 5.0)  # it ended before the stop
    finally:
        stream.cancel()

    assert result["ok"] is True, result
    assert [s["name"] for s in result["steps"]] == APPLY_STEPS
    assert all(s["ok"] for s in result["steps"]), result["steps"]

    # The drain waited for the stream, and the engine's /slots is what said so: the proxy
    # listed nothing for alpha all along.
    drain = detail(result, "drain")
    assert (
        "waited for: alpha/alpha-f32: its engine says busy (/props is_sleeping false, "
        "/slots 1 of 1 slots processing)" in drain
    ), drain
    assert f"proxy list: 0 in flight for {alpha.target}" in drain, drain
    assert drain.endswith(
        "alpha/alpha-f32 engine: idle (/props is_sleeping false, /slots 0 of 1 slots processing)"
    ), drain
    waited = float(drain.split("(waited ", 1)[1].split("s;", 1)[0])
    assert 0.3 < waited <= took, (waited, took)

    # The stream ended whole: every token asked for, its finish reason, then [DONE].
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "length", last
    assert last["usage"]["completion_tokens"] == body["max_tokens"], last["usage"]

    # stop, then verify-free on the host: alpha's processes are gone.
    assert detail(result, "stop") == f"stopped {alpha.name}"
    assert f"{alpha.name} empty" in detail(result, "verify-free")
    assert await llama.units.pids(alpha.name) == []
    assert not (await llama.unit_state("alpha")).main_pid
    assert not psutil.pid_exists(victim_pid), "the victim's llama-server has exited"

    # start, verify-up on the real engine: /health, the served id, /props facts.
    assert detail(result, "start") == f"started {beta.name}"
    verify_up = detail(result, "verify-up")
    assert verify_up.startswith(
        f"{beta.name} active, {beta.endpoint} healthy, serves beta; "
        "metricsMustMatch n_ctx, total_slots as policy"
    ), verify_up
    props = await llama.props("beta")
    assert (props["default_generation_settings"]["n_ctx"], props["total_slots"]) == (256, 2)
    status, listing = await llama.engine_get("beta", "/v1/models")
    assert (status, [m["id"] for m in listing["data"]]) == (200, ["beta"])

    # refresh-proxy, resolve: the parked request is applied, beta serves.
    assert llama.proxy.refreshes >= 1
    assert placement in detail(result, "resolve")
    assert await llama.pending_entry(placement) is None
    assert await llama.resident_states() == {"beta": "hot"}
    assert await llama.admit("beta", "swap-client") == {
        "decision": "forward",
        "target_id": beta.target,
    }
    answer = await llama.complete("beta", {"prompt": "hello", "max_tokens": 4})
    assert (answer["model"], answer["usage"]["completion_tokens"]) == ("beta", 4)
    print(
        f"\n{path}: a {body['max_tokens']}-token stream straight to alpha; the drain waited "
        f"{waited:.2f}s of a {took:.2f}s run ({len(result['steps'])} steps)"
    )


async def stream_running(world: LlamaWorld) -> bool:
    return await world.slots_processing("alpha") > 0
