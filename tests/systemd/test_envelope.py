"""The measured enforcement envelope and the CPU tier on real units (issue 12).

- ``measure --envelope`` on the fake engine (with vLLM's sleep API) under a real unit:
  stop, memory back, cold and warm start, sleep, freed memory, wake; stored in the
  machine-local registry, the daemon reloads it, the engine is left serving.
- A never-healthy engine is rolled back within the bound its envelope gives (the
  step details name the bound and where it came from; no timed assertion).
- A CPU-only config: ``measure`` records it on ``cpu0`` (host RSS, no GPU memory),
  the planner places it against host RAM, and it serves.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from tests.systemd.placement_world import (
    ALPHA_MIB,
    FAST,
    GUARD_S,
    World,
    step,
)
from uapplace.controller import views
from uapplace.core.model import Envelope
from uapplace.files.timeouts import Timeouts
from uapplace.io import engines
from uapplace.measure.reading import MeasurementRefused

pytestmark = pytest.mark.systemd

LOAD_SECS = 0.3
"""The world's engines load this long (``--load-secs``): a start can never be quicker."""
WAKE_DELAY = 0.2
ALPHA = ("alpha/a1",)
"""``PreviewUnload("alpha")``'s signature: the one resident that stops."""


@pytest.fixture
def world(built_world: World) -> World:
    """The tier's placement machine, nothing started (conftest; ``world_options`` shapes it)."""
    return built_world


async def measure_envelope(world: World, expected: tuple[str, ...] = ALPHA) -> dict[str, Any]:
    """``MeasureEnvelope`` of alpha/a1 with the signature ``PreviewUnload`` shows."""
    return await world.controller.enforcement.measure(
        "alpha", "a1", envelope=True, expected=expected
    )


def edit_local_config(world: World, model: str, config: str, **fields: Any) -> None:
    doc = world.local_doc()
    doc["models"][model]["configs"][config].update(fields)
    world.paths.local_registry.write_text(json.dumps(doc), encoding="utf-8")


# --------------------------------------------------------------------------- measured


@pytest.mark.parametrize(
    "world_options",
    [{"alpha_args": ["--sleep-mode", "--wake-delay", str(WAKE_DELAY)]}],
    indirect=True,
)
async def test_envelope_is_measured_on_the_fake_engine_and_stored(world: World) -> None:
    edit_local_config(world, "alpha", "a1", pause_lever="vllm-sleep-1")
    assert await world.controller.reload()
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
        first_pid = (await world.units.state(world.alpha.name)).main_pid

        result = await measure_envelope(world)

    written = world.local_doc()["models"]["alpha"]["configs"]["a1"]
    envelope = written["envelope"]
    assert envelope == result["envelope"]
    assert envelope["measured_on"] == "gpu0"
    assert envelope["measured_at"] >= written["measured_at"]
    # Each figure is what the engine's own delays make it at least (never an upper bound).
    assert envelope["free_s"] >= envelope["stop_s"] > 0
    assert envelope["cold_start_s"] >= LOAD_SECS and envelope["warm_start_s"] >= LOAD_SECS
    assert envelope["wake_s"] >= WAKE_DELAY and envelope["sleep_s"] > 0
    assert envelope["sleep_freed_mib"] == ALPHA_MIB, "the probe saw the whole claim freed"
    # The footprint next to it is kept whole (pause lever included).
    assert (written["resident_gpu_mib"], written["pause_lever"]) == (ALPHA_MIB, "vllm-sleep-1")

    # The daemon re-read the local file: the envelope is in force.
    config = world.controller.registry.models["alpha"].configs["a1"]
    assert config.envelope == Envelope(**envelope)
    # Left serving: a new process (two restarts), awake, holding its memory, hot again.
    async with asyncio.timeout(GUARD_S):
        await world.events.until(lambda: world.state_of("alpha") == "hot")
    state = await world.units.state(world.alpha.name)
    assert state.active_state == "active" and state.main_pid != first_pid
    assert [(a.pid, a.used_mib) for a in world.sim.read().allocations] == [
        (state.main_pid, ALPHA_MIB)
    ]
    report = await views.validate(world.controller)
    rows = [r for r in report["provenance"] if r.get("envelope")]
    assert [r["entry"] for r in rows] == ["$.models.alpha.configs.a1"]
    assert "wake " in rows[0]["envelope"]


async def test_envelope_needs_the_footprint_first(world: World) -> None:
    doc = world.local_doc()
    del doc["models"]["alpha"]
    world.paths.local_registry.write_text(json.dumps(doc), encoding="utf-8")
    assert await world.controller.reload()
    async with asyncio.timeout(GUARD_S):
        await world.units.start_unit(world.alpha.name, GUARD_S)
        with pytest.raises(MeasurementRefused, match=r"run `uapplace measure alpha a1` first"):
            await measure_envelope(world)
    assert (await world.units.state(world.alpha.name)).active_state == "active", "untouched"


@pytest.mark.parametrize(
    "world_options", [{"alpha_args": ["--sleep-mode", "--fail-wake"]}], indirect=True
)
async def test_a_failing_wake_writes_nothing_and_leaves_the_engine_serving(world: World) -> None:
    edit_local_config(world, "alpha", "a1", pause_lever="vllm-sleep-2")
    assert await world.controller.reload()
    before = world.paths.local_registry.read_text(encoding="utf-8")
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
        with pytest.raises(MeasurementRefused, match=r"wake: .*--fail-wake.*restarted and serving"):
            await measure_envelope(world)
        await world.events.until(lambda: world.state_of("alpha") == "hot")
    assert world.paths.local_registry.read_text(encoding="utf-8") == before
    held = [a.used_mib for a in world.sim.read().allocations]
    assert held == [ALPHA_MIB]


# --------------------------------------------------------------------------- the bound


ENVELOPED = Timeouts(
    **{
        **FAST.to_json(),
        "verify_up_s": 600.0,
        "drain_s": 600.0,
        "verify_free_s": 600.0,
        "measured_start_margin_s": 1.0,
        "measured_start_floor_s": 2.0,
        "verify_free_floor_s": 1.0,
        "verify_free_margin_s": 1.0,
        "drain_floor_s": 1.0,
    }
)
"""The global waits are ten minutes: only the envelope-derived bounds can end this run."""


def recorded(cold_start_s: float) -> dict[str, Any]:
    return {
        "stop_s": 0.5,
        "free_s": 0.75,
        "cold_start_s": cold_start_s,
        "warm_start_s": cold_start_s,
        "measured_at": "2026-10-08T15:00:00Z",
        "measured_on": "gpu0",
    }


@pytest.mark.parametrize(
    "world_options", [{"beta_args": ["--never-healthy"], "timeouts": ENVELOPED}], indirect=True
)
async def test_a_never_healthy_engine_is_rolled_back_within_its_envelope_bound(
    world: World,
) -> None:
    edit_local_config(world, "alpha", "a1", envelope=recorded(0.4))
    edit_local_config(world, "beta", "b1", envelope=recorded(1.0))
    assert await world.controller.reload()
    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
        entry = await world.park("beta")
        result = await world.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["ok"] is False and result["rolledBack"] is True, result
    # drain: 2 × (stop alpha 0.5 s + start beta 1 s) = 3 s.
    assert (
        "bound 3s (switch 1.5s (stop alpha/a1 0.5s + start beta/b1 1s): max(1s, 2 × 1.5s))"
        in (step(result, "drain")["detail"])
    )
    # verify-free: alpha's memory came back 0.25 s after its stop: max(1, 3 × 0.25 + 1).
    assert (
        "bound 1.75s (alpha/a1 memory back 0.25s after its stop"
        in (step(result, "verify-free")["detail"])
    )
    verify = step(result, "verify-up")
    assert verify["ok"] is False
    assert f"{world.beta.name} not healthy after 4s" in verify["detail"]
    assert "bound 4s (beta/b1 envelope cold start 1s: max(2s, 3 × 1s + 1s))" in verify["detail"]
    rollback = step(result, "rollback-verify")
    assert rollback["ok"] is True, rollback
    async with asyncio.timeout(GUARD_S):
        await world.events.until(lambda: world.state_of("alpha") == "hot")
    assert world.state_of("beta") is None


# --------------------------------------------------------------------------- CPU tier


async def test_a_cpu_only_config_is_measured_on_cpu0_placed_and_served(world: World) -> None:
    gamma = await world.add_cpu_gamma(["--load-secs", str(LOAD_SECS), "--host-mib", "32"])

    async with asyncio.timeout(GUARD_S):
        await world.start_alpha()
        assert (await world.units.start_unit(gamma.name, GUARD_S)).ok
        assert await engines.wait_healthy(gamma.endpoint, time.monotonic() + GUARD_S)
        measured = await world.controller.enforcement.measure("gamma", "c1")
    written = world.local_doc()["models"]["gamma"]["configs"]["c1"]
    assert (written["measured_on"], written["resident_gpu_mib"]) == ("cpu0", 0.0)
    assert written["host_rss_mib"] >= 32, "the unit's RSS, host memory included"
    assert measured["device"]["kind"] == "cpu"
    report = await views.validate(world.controller)
    assert not [f for f in report["findings"] if "configs.c1" in f["json_path"]], report
    assert report["ok"] is True, report["findings"]

    async with asyncio.timeout(GUARD_S):
        assert (await world.units.stop_unit(gamma.name, GUARD_S)).ok
        await world.events.until(lambda: world.state_of("gamma") is None)
        preview = await views.preview(world.controller, "gamma", 0)
        first = preview["options"][0]
        # On the host, alongside alpha: no GPU memory, nothing displaced.
        assert (first["kind"], first["device"], first["cost_mib"]) == ("load_alongside", "cpu0", 0)
        result = await world.enforcer.load("gamma", [])
    assert result["ok"] is True, result
    assert world.state_of("alpha") == "hot", "alpha was not touched"
    decision = world.controller.admit("gamma", "client-1", "", 0)
    assert (decision.decision, decision.target_id) == ("forward", f"cpu0:{gamma.endpoint}")
    body = {"model": "gamma", "messages": [{"role": "user", "content": "hi"}]}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{gamma.endpoint}/v1/chat/completions", json=body) as response,
    ):
        assert response.status == 200
        assert "gamma" in (await response.json())["choices"][0]["message"]["content"]
    async with asyncio.timeout(GUARD_S):
        assert (await world.units.stop_unit(gamma.name, GUARD_S)).ok
