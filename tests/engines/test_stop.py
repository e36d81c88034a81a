"""A stop never cuts a real llama-server's work silently (issue 19: drain and forced stops).

llama-server ignores ``SIGTERM`` while it runs a **non-streaming** generation (it hangs
until the generation ends), so a stop of a busy one ends in systemd's ``SIGKILL`` after
the unit's ``TimeoutStopSec=`` (2 s here). Every generation below is one of those, sent
straight to the engine (never through the proxy, whose in-flight list stays empty), with
one slot, ``--context-shift`` and a million tokens to go: it runs until it is cut.

Three promises (docs/placement-rules.md §4.6, "Drain: the engine's own word" and "Forced
stops"), each on the real engine:

- **the drain refuses**: with ``/slots`` on (llama-server's default), ``uapplace unload
  alpha --yes`` sees the busy slot, waits out its bound and refuses "still busy":
  nothing is stopped, the generation goes on in the same process;
- **a forced stop is reported**: an engine that cannot tell (``--no-slots``, no
  ``--metrics``) does not block the drain (docs: "it cannot tell; the proxy's list and
  bus holds decide"), so the same unload stops it; the ``stop`` step is **not ok** and
  says "stopped by SIGKILL after the stop timeout", a ``forced_stop`` alert is raised,
  the unit ended ``failed``/``timeout``/``SIGKILL``, and the client's request was cut;
- **the rollback's stop** is read the same way: the rollback stops the unit a failed run
  started without draining it (it was never published, so admission sent it nothing);
  a client talking to that engine directly is cut, and ``rollback-stop`` says so, not
  ok, with the same alert, while the victim is restarted as usual.

The drain is never bypassed to reach a stop: the forward stop is reached through an
engine that gives the drain no signal, the rollback's through the one stop that has no
drain.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from tests.worlds.llama import LLAMA_TIMEOUTS, LlamaModel, LlamaWorld, free_port
from tests.worlds.steps import UNLOAD_STEPS, detail
from uapplace.io.units import CLD_KILLED

pytestmark = pytest.mark.engines

STOP_TIMEOUT_S = 2
DRAIN_S = 2.0
VERIFY_UP_S = 4.0
ENDLESS = {"prompt": "hello", "max_tokens": 1_000_000, "ignore_eos": True}
"""A non-streaming generation that outlives every test (the client's cancel ends it)."""
BUSY = ("--context-shift", "-t", "1")
"""One thread (the daemon and the CLI keep a core); context shift (it never fills up)."""
RESERVED_MIB = 256
MODEL_MIB = 100.0


def busy_model(key: str, **more: Any) -> LlamaModel:
    """``key`` (tiny-a) with one 2048-cell slot, stopped by SIGKILL 2 s after SIGTERM."""
    extra = (*more.pop("extra_args", ()), *BUSY)
    return LlamaModel(
        key,
        "tiny-a",
        ctx_size=2048,
        parallel=1,
        extra_args=extra,
        stop_timeout_s=STOP_TIMEOUT_S,
        host_rss_mib=MODEL_MIB,
        **more,
    )


SLOTS_ON = (busy_model("alpha", started=True),)
CANNOT_TELL = (busy_model("alpha", started=True, metrics=False, extra_args=("--no-slots",)),)
UNREACHED = f"http://127.0.0.1:{free_port()}"
"""Nothing listens here: beta's registry endpoint, so its verify-up never sees /health."""
SWAP_ONTO_BUSY = (
    LlamaModel("alpha", "tiny-a", started=True, host_rss_mib=MODEL_MIB),
    busy_model("beta", entry={"endpoint": UNREACHED}),
)


@pytest.fixture
def world_options() -> dict[str, Any]:
    """A short drain and verify-up; ``cpu0`` holds one model (the reserve + 150 MiB)."""
    return {
        "timeouts": replace(LLAMA_TIMEOUTS, drain_s=DRAIN_S, verify_up_s=VERIFY_UP_S),
        "cpu_total_mib": RESERVED_MIB + 150,
        "cpu_reserved_mib": RESERVED_MIB,
    }


async def generate(world: LlamaWorld, key: str) -> dict[str, Any] | str:
    """:data:`ENDLESS` straight to ``key``'s server: the answer, or how it was cut."""
    url = f"{world.engine(key).endpoint}/v1/completions"
    try:
        async with world.http.post(url, json=ENDLESS) as reply:
            body: dict[str, Any] = await reply.json()
            return body
    except aiohttp.ClientError as err:
        return f"{type(err).__name__}: {err}"


async def generating(world: LlamaWorld, key: str) -> asyncio.Task[dict[str, Any] | str]:
    """Start :func:`generate` and return once ``key``'s one slot is processing it (seen by
    ``/slots``, or, when that is off, by the engine's log)."""
    task = asyncio.create_task(generate(world, key))
    if "--no-slots" in world.engine(key).argv:

        async def started() -> bool:
            return "launch_slot_: id  0 | task 0 | processing task" in world.engine_log(key)
    else:

        async def started() -> bool:
            return await world.slots_processing(key) == 1

    await world.until(f"{key}'s slot to process the generation", started)
    return task


async def unload(world: LlamaWorld, model: str) -> tuple[int, dict[str, Any]]:
    """``uapplace unload MODEL --yes --json``: its exit status and result."""
    done = await world.cli("unload", model, "--yes", "--json")
    assert done.stdout, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return done.returncode, result


FORCED = (
    "stopped by SIGKILL after the stop timeout (unit result timeout): "
    "in-flight work may have been cut"
)
"""How uapplace words a stop systemd had to force (:func:`uapplace.io.units.forced_stop_text`)."""


@pytest.mark.parametrize("world_models", [SLOTS_ON], indirect=True)
async def test_a_busy_victim_is_never_cut_the_drain_refuses(llama: LlamaWorld) -> None:
    pid = await llama.main_pid("alpha")
    work = await generating(llama, "alpha")
    try:
        code, result = await unload(llama, "alpha")

        assert code == 1 and result["ok"] is False, result
        assert [s["name"] for s in result["steps"]] == [
            "revalidate",
            "preflight",
            "mark-draining",
            "drain",
            "rollback-clear",
        ], result["steps"]
        assert detail(result, "rollback-clear") == (
            "draining marks cleared (alpha/alpha-f32); running now: alpha/alpha-f32 on cpu0, "
            f"{llama.engine('alpha').name} active/running"
        )
        assert result["error"].startswith(
            f"drain: still busy after {DRAIN_S:g}s: alpha/alpha-f32: its engine says busy "
            "(/props is_sleeping false, /slots 1 of 1 slots processing) (nothing was cut off;"
        ), result["error"]
        # Nothing was stopped: the same process is still generating for its client.
        assert await llama.main_pid("alpha") == pid
        assert (await llama.unit_state("alpha")).active_state == "active"
        assert await llama.slots_processing("alpha") == 1
        assert not work.done()
        await llama.wait_resident("alpha", "hot")
        assert await llama.alerts("forced_stop") == []
        assert "cleaning up before exit" not in llama.engine_log("alpha"), "no SIGTERM sent"
        assert (await llama.unit_state("alpha")).main_pid == pid
    finally:
        work.cancel()


@pytest.mark.parametrize("world_models", [CANNOT_TELL], indirect=True)
async def test_a_victim_that_cannot_tell_is_sigkilled_and_uapplace_says_so(
    llama: LlamaWorld,
) -> None:
    alpha = llama.engine("alpha")
    work = await generating(llama, "alpha")
    try:
        started = time.monotonic()
        code, result = await unload(llama, "alpha")
        took = time.monotonic() - started
        cut = await asyncio.wait_for(work, 10.0)
    finally:
        work.cancel()

    assert code == 0 and result["ok"] is True, result  # the victim is down: the run went on
    assert [s["name"] for s in result["steps"]] == UNLOAD_STEPS
    assert detail(result, "drain").endswith(
        "alpha/alpha-f32 engine: no signal (/props is_sleeping false, /slots HTTP 501, "
        "/metrics HTTP 501): it cannot tell; the proxy's list and bus holds decide"
    ), detail(result, "drain")
    [stop] = [s for s in result["steps"] if s["name"] == "stop"]
    assert stop["ok"] is False
    assert stop["detail"] == (
        f"stopped {alpha.name}; {alpha.name} {FORCED} (not fatal: the victims are down, "
        "the switch goes on; a forced_stop alert says so)"
    )
    assert took >= STOP_TIMEOUT_S, "systemd waited TimeoutStopSec= before its SIGKILL"

    # systemd's own account, the engine's, and the client's.
    state = await llama.unit_state("alpha")
    assert (state.active_state, state.result) == ("failed", "timeout")
    assert (state.exec_main_code, state.exec_main_status) == (CLD_KILLED, 9)
    assert await llama.units.pids(alpha.name) == []
    # result "timeout" is systemd's word for "SIGTERM sent, the process outlived
    # TimeoutStopSec="; llama-server's own "cleaning up before exit" line is written by a
    # log thread the SIGKILL may beat, so the engine log is no evidence either way.
    assert isinstance(cut, str), f"the generation was cut, not answered: {cut}"

    [alert] = await llama.alerts("forced_stop")
    assert (alert["severity"], alert["subject"]) == ("warning", alpha.name)
    assert alert["message"].startswith(f"{alpha.name} (alpha/alpha-f32) {FORCED}, during unload")
    assert (alert["detail"]["result"], alert["detail"]["execMainCode"]) == ("timeout", CLD_KILLED)
    assert alert["detail"]["execMainStatus"] == 9
    assert await llama.resident_states() == {}


@pytest.mark.parametrize("world_models", [SWAP_ONTO_BUSY], indirect=True)
async def test_the_rollback_stop_of_a_busy_newcomer_is_reported_forced(
    llama: LlamaWorld,
) -> None:
    alpha, beta = llama.engine("alpha"), llama.engine("beta")
    placement = await llama.park("beta", "rollback-client")
    run = asyncio.create_task(llama.resolve(placement, 1))
    work: asyncio.Task[dict[str, Any] | str] | None = None
    try:
        # beta comes up on its own port; its registry endpoint is elsewhere, so verify-up
        # waits its bound, and a client talking to beta directly makes it busy meanwhile.
        await llama.wait_healthy("beta")
        work = await generating(llama, "beta")
        result = await run
        cut = await asyncio.wait_for(work, 10.0)
    finally:
        run.cancel()
        if work is not None:
            work.cancel()

    assert (result["ok"], result["rolledBack"]) == (False, True), result
    assert result["error"].startswith(
        f"verify-up: {beta.name} not healthy after {VERIFY_UP_S:g}s (unit active/running)"
    ), result["error"]
    [stop] = [s for s in result["steps"] if s["name"] == "rollback-stop"]
    assert stop["ok"] is False
    assert stop["detail"] == (
        f"{beta.name}, which this run started, is failed/failed (result timeout) (stop job "
        f"done): nothing of it runs; it was {FORCED} (not fatal)"
    )
    assert isinstance(cut, str), f"beta's client was cut, not answered: {cut}"
    state = await llama.unit_state("beta")
    assert (state.result, state.exec_main_code, state.exec_main_status) == (
        "timeout",
        CLD_KILLED,
        9,
    )
    [alert] = await llama.alerts("forced_stop")
    assert alert["subject"] == beta.name
    assert alert["message"].startswith(f"{beta.name} {FORCED}, during apply {placement}")
    # The victim came back as usual: nothing of beta runs.
    assert detail(result, "rollback-start") == f"restarted {alpha.name} (alpha/alpha-f32)"
    await llama.wait_resident("alpha", "hot")
    assert await llama.resident_states() == {"alpha": "hot"}
    assert await llama.pending_entry(placement) is not None
