"""A switch never cuts a real engine's work, and never calls a forced stop "ok" (issue 19).

The docs/placement-rules.md §4.6 sequence over :mod:`enforce_fakes`, one branch per test:

- the drain also asks each victim's engine (docs/placement-rules.md §4.6, "Drain: the
  engine's own word"): a stream sent straight to the engine holds the stop back; a
  sleeping llama-server is idle and its ``/slots`` is never asked (that would wake it);
  without ``/slots`` the ``/metrics`` gauges speak; an engine with no busy signal does
  not block and is named; one that does not answer counts as busy;
- a stop systemd forced with ``SIGKILL`` after the stop timeout is a not-ok ``stop``
  step, a ``forced_stop`` alert and a line of the CLI, and the switch goes on
  (docs/placement-rules.md §4.6, "Forced stops"); the rollback's stop is read the same way;
- verify-free on the host (``cpu0``) is the victim's processes gone, not a free-memory
  figure (docs/placement-rules.md §4.6, "Verify-free on the host").

The same against a contained ``systemd --user``: ``tests/systemd/test_forced_stop.py``.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from enforce_fakes import (
    GPU,
    HOST,
    Scene,
    detail,
    endpoint_of,
    host_reading,
    llama,
    ok,
    resident,
    steps,
    swap_registry,
)
from test_cli_enforce import run as run_cli
from test_cli_enforce import scripted

from tests.worlds import builders
from tests.worlds.steps import APPLY_STEPS, UNLOAD_STEPS
from uapplace.core.alerts import AlertKind, Severity
from uapplace.core.model import (
    ROUTER_LEVER,
    DeviceReading,
    Holder,
    ProbeSource,
    Registry,
    Resident,
)
from uapplace.enforce.run import Run, StepFailed, Target
from uapplace.enforce.steps import drain
from uapplace.io.units import UnitError

ALPHA = endpoint_of("alpha")
ALPHA_TARGET = f"gpu0:{ALPHA}"
ROUTER = "http://127.0.0.1:8999"
KEY = ("chat", "c1", "cpu0")
FORWARD = APPLY_STEPS[: APPLY_STEPS.index("verify-up") + 1]
ENGINE_ROUTES = ["/props", "/slots"]


@pytest.fixture
def swap(tmp_path: Path) -> Scene:
    """alpha runs on gpu0; beta only fits once alpha stops (``enforce_fakes.swap_registry``)."""
    return Scene(tmp_path, swap_registry(), [resident("alpha", "a1")])


def drain_reads(scene: Scene) -> list[str]:
    """The routes the drain asked of alpha's engine, in order."""
    return [a.removeprefix(ALPHA) for a in scene.engines.asked if a.startswith(ALPHA)]


async def apply_beta(scene: Scene) -> dict[str, Any]:
    return await scene.enforcer.apply(scene.park("beta"), 1, ["alpha/a1"])


# --------------------------------------------------------------------------- the drain


async def test_a_stream_sent_straight_to_the_engine_holds_the_stop_back(swap: Scene) -> None:
    swap.engines.processing[ALPHA] = 1  # the proxy's list is empty: only the engine knows
    polls: list[list[str]] = []

    def on_poll() -> None:
        polls.append(list(swap.units.jobs))
        if len(polls) == 3:  # the stream ends while the drain waits
            swap.engines.processing[ALPHA] = 0

    swap.host.on_inflight = on_poll

    result = await apply_beta(swap)

    assert result["ok"] is True
    assert steps(result) == ok(*APPLY_STEPS)
    assert polls == [[], [], []]  # nothing stopped while the engine was busy
    assert drain_reads(swap) == ENGINE_ROUTES * 3
    assert detail(result, "drain").startswith("no in-flight work or holds (waited ")
    assert detail(result, "drain").endswith(
        f"asked: proxy list: 0 in flight for {ALPHA_TARGET}; alpha/a1 engine: idle "
        "(/props is_sleeping false, /slots 0 of 2 slots processing)"
    )
    swap.assert_ended_cleanly()


async def test_an_engine_busy_until_the_drain_bound_rolls_back_before_any_stop(
    swap: Scene,
) -> None:
    swap.engines.processing[ALPHA] = 2

    result = await apply_beta(swap)

    assert result["ok"] is False and result["rolledBack"] is True
    assert steps(result) == [*ok(*FORWARD[:3]), ("drain", False), ("rollback-clear", True)]
    assert detail(result, "drain").startswith(
        "still busy after 0.05s: alpha/a1: its engine says busy "
        "(/props is_sleeping false, /slots 2 of 2 slots processing) (nothing was cut off; "
    )
    assert swap.units.jobs == []
    assert swap.host.states() == {"alpha/a1": "hot"}
    swap.assert_ended_cleanly()


async def test_a_sleeping_llama_server_is_idle_and_the_drain_never_wakes_it(
    swap: Scene,
) -> None:
    swap.engines.idle_asleep.add(ALPHA)

    result = await apply_beta(swap)

    assert result["ok"] is True
    assert set(drain_reads(swap)) == {"/props"}  # never /slots: it would wake the server
    assert swap.engines.woken == []
    assert "alpha/a1 engine: asleep (/props is_sleeping true: nothing in flight)" in detail(
        result, "drain"
    )
    swap.assert_ended_cleanly()


async def test_without_slots_the_drain_reads_the_request_gauges(swap: Scene) -> None:
    swap.engines.no_slots.add(ALPHA)  # llama-server --no-slots: /slots answers 501
    swap.engines.processing[ALPHA] = 1
    polls: list[int] = []

    def on_poll() -> None:
        polls.append(1)
        if len(polls) == 2:
            swap.engines.processing[ALPHA] = 0

    swap.host.on_inflight = on_poll

    result = await apply_beta(swap)

    assert result["ok"] is True
    assert drain_reads(swap)[:3] == ["/props", "/slots", "/metrics"]
    assert detail(result, "drain").endswith(
        "alpha/a1 engine: idle (/props is_sleeping false, /slots HTTP 501, "
        "/metrics llamacpp:requests_processing 0, llamacpp:requests_deferred 0)"
    )


async def test_an_engine_with_no_busy_signal_does_not_block_and_is_named(swap: Scene) -> None:
    swap.engines.no_props.add(ALPHA)
    swap.engines.no_slots.add(ALPHA)
    swap.engines.no_metrics.add(ALPHA)  # llama-server --no-slots, without --metrics

    result = await apply_beta(swap)

    assert result["ok"] is True
    assert detail(result, "drain").endswith(
        "alpha/a1 engine: no signal (/props HTTP 404, /slots HTTP 501, /metrics HTTP 501): "
        "it cannot tell; the proxy's list and bus holds decide"
    )


async def test_the_proxy_list_still_counts_when_the_engine_has_no_signal(swap: Scene) -> None:
    swap.engines.no_props.add(ALPHA)
    swap.engines.no_slots.add(ALPHA)
    swap.engines.no_metrics.add(ALPHA)
    swap.host.in_flight = {ALPHA_TARGET: [Holder("client-7", "inflight")]}

    result = await apply_beta(swap)

    assert result["ok"] is False
    assert f"still busy after 0.05s: {ALPHA_TARGET}: 1 in flight (client-7) (" in detail(
        result, "drain"
    )
    assert swap.units.jobs == []


async def test_an_engine_that_does_not_answer_counts_as_busy(swap: Scene) -> None:
    swap.engines.unanswered.add(ALPHA)

    result = await apply_beta(swap)

    assert result["ok"] is False and result["rolledBack"] is True
    assert "alpha/a1: its engine says unreachable (/props no answer (timed out)): " in detail(
        result, "drain"
    )
    assert detail(result, "drain").count("unknown counts as busy") == 1
    assert drain_reads(swap)[0] == "/props" and "/slots" not in drain_reads(swap)
    assert swap.units.jobs == []
    swap.assert_ended_cleanly()


async def test_a_victim_without_an_endpoint_is_said_so(tmp_path: Path) -> None:
    scene = Scene(tmp_path, swap_registry(), [resident("alpha", "a1", endpoint=None)])

    result = await apply_beta(scene)

    assert result["ok"] is True
    assert "alpha/a1 engine: no endpoint to ask" in detail(result, "drain")
    assert scene.engines.asked == []


async def test_a_router_model_is_asked_through_its_router_and_never_loaded(
    tmp_path: Path,
) -> None:
    # Two models of one llama.cpp router: one unit, one endpoint, told apart by ?model=.
    config = builders.measured("c1", 0.0, 900.0, on="cpu0", pause_lever=ROUTER_LEVER)
    chat = replace(
        llama("chat", config),
        unit="router",
        endpoint=ROUTER,
        advertises=("tiny-a",),
    )
    registry = Registry({GPU.key: GPU, HOST.key: HOST}, {"chat": chat})
    victim = on_cpu("chat", "c1", 900.0)
    victim = replace(victim, unit="router.service", endpoint=ROUTER)
    scene = Scene(tmp_path, registry, [victim])
    scene.engines.unit_of[ROUTER] = "router.service"
    scene.units.already_running("router.service")
    scene.engines.processing[ROUTER] = 1
    target = Target(
        "unload", "chat", chat, None, "cpu0", 0.0, (victim,), None, routed=frozenset({KEY})
    )
    run = Run("run-router", "unload chat", scene.host)

    with pytest.raises(StepFailed):
        await drain(scene.enforcer.ctx, run, target)

    query = "?model=tiny-a&autoload=false"
    assert scene.engines.asked[:2] == [f"{ROUTER}/props{query}", f"{ROUTER}/slots{query}"]
    assert "chat/c1: its engine says busy (/props is_sleeping false, /slots 1 of 2" in (
        run.steps[-1].detail
    )


# --------------------------------------------------------------------------- forced stops

FORCED = (
    "alpha.service stopped by SIGKILL after the stop timeout (unit result timeout): "
    "in-flight work may have been cut"
)


async def test_a_forced_stop_is_not_ok_and_alerted_and_the_switch_goes_on(swap: Scene) -> None:
    swap.units.forced_kill.add("alpha.service")

    result = await apply_beta(swap)

    assert result["ok"] is True and "rolledBack" not in result
    stop_index = APPLY_STEPS.index("stop")
    expected = ok(*APPLY_STEPS)
    expected[stop_index] = ("stop", False)
    assert steps(result) == expected
    assert detail(result, "stop") == (
        f"stopped alpha.service; {FORCED} (not fatal: the victims are down, the switch goes "
        "on; a forced_stop alert says so)"
    )
    assert swap.units.running() == {"alpha.service": "failed", "beta.service": "active"}
    assert swap.host.states() == {"beta/b1": "hot"}
    [(kind, severity, subject, message)] = swap.host.alerts
    assert (kind, severity, subject) == (AlertKind.FORCED_STOP, Severity.WARNING, "alpha.service")
    assert message.startswith(f"alpha.service (alpha/a1) {FORCED.removeprefix('alpha.service ')}")
    assert "during apply plc-000001 option 1" in message
    swap.assert_ended_cleanly()


def test_the_cli_prints_the_forced_stop_line(swap: Scene, monkeypatch: pytest.MonkeyPatch) -> None:
    swap.units.forced_kill.add("alpha.service")
    result = asyncio.run(swap.enforcer.unload("alpha", ["alpha/a1"]))
    assert result["ok"] is True
    assert steps(result)[UNLOAD_STEPS.index("stop")] == ("stop", False)
    scripted(monkeypatch, result=result)  # the CLI gets this run's result from the bus

    shown = run_cli("unload", "alpha", "--yes")

    assert shown.exit_code == 0, shown.output
    assert f"  stop: FAILED: stopped alpha.service; {FORCED} (not fatal" in shown.stdout
    assert shown.stdout.rstrip().endswith("unload alpha: done")


async def test_a_clean_stop_raises_no_alert(swap: Scene) -> None:
    result = await apply_beta(swap)

    assert detail(result, "stop") == "stopped alpha.service"
    assert swap.host.alerts == []


async def test_a_forced_stop_of_the_new_unit_in_rollback_is_reported_and_victims_return(
    swap: Scene,
) -> None:
    swap.engines.never_healthy.add(endpoint_of("beta"))
    swap.units.forced_kill.add("beta.service")

    result = await apply_beta(swap)

    assert result["ok"] is False and result["rolledBack"] is True
    assert ("rollback-stop", False) in steps(result)
    assert detail(result, "rollback-stop") == (
        "beta.service, which this run started, is failed/failed (result timeout) (stop job "
        "done): nothing of it runs; it was stopped by SIGKILL after the stop timeout (unit "
        "result timeout): in-flight work may have been cut (not fatal)"
    )
    assert swap.units.running() == {"alpha.service": "active", "beta.service": "failed"}
    assert [(a[0], a[2]) for a in swap.host.alerts] == [(AlertKind.FORCED_STOP, "beta.service")]
    swap.assert_ended_cleanly()


# --------------------------------------------------------------------------- verify-free on cpu0


def cpu_registry() -> Registry:
    """``chat`` (2,500 MiB of host RAM) runs on cpu0; ``big`` (4,000 MiB) needs its room."""
    chat = llama("chat", builders.measured("c1", 0.0, 2500.0, on="cpu0"))
    big = llama("big", builders.measured("g1", 0.0, 4000.0, on="cpu0"))
    return Registry({GPU.key: GPU, HOST.key: HOST}, {"chat": chat, "big": big})


def on_cpu(model: str, config: str, host_mib: float) -> Resident:
    return resident(model, config, device="cpu0", gpu_mib=0.0, host_rss_mib=host_mib)


@pytest.fixture
def host_swap(tmp_path: Path) -> Scene:
    scene = Scene(tmp_path, cpu_registry(), [on_cpu("chat", "c1", 2500.0)])
    gpu = scene.world.readings()["gpu0"]

    def readings() -> dict[str, DeviceReading]:
        # Host RAM: 3,000 MiB free while chat runs, 5,500 once it is down (reserve 1,024).
        chat_up = scene.units.state_now("chat.service").active_state == "active"
        return {"gpu0": gpu, "cpu0": host_reading(3000.0 if chat_up else 5500.0)}

    scene.host.readings = readings
    return scene


async def test_on_the_host_verify_free_is_the_victims_processes_gone(host_swap: Scene) -> None:
    entry = host_swap.park("big")
    assert [(o.kind.value, o.device) for o in entry.options][:1] == [("displace", "cpu0")]

    result = await host_swap.enforcer.apply(entry, 1, ["chat/c1"])

    assert result["ok"] is True, result
    assert detail(result, "verify-free").startswith(
        "host: victim processes gone (2,500 MiB measured footprint released; "
        "chat.service empty); cpu0 reads 5,500 MiB free of 65,536 (not relied on: host "
        "memory moves with the rest of the machine); "
    )
    assert host_swap.units.running() == {"big.service": "active", "chat.service": "inactive"}
    host_swap.assert_ended_cleanly()


async def test_on_the_host_a_process_left_in_the_unit_fails_verify_free(
    host_swap: Scene,
) -> None:
    host_swap.units.leftover_pids["chat.service"] = [5123, 5124]  # KillMode=process

    result = await host_swap.enforcer.unload("chat", ["chat/c1"])

    assert result["ok"] is False and result["rolledBack"] is True
    assert detail(result, "verify-free").startswith(
        "after 0.05s: chat.service still has processes (its cgroup is not empty): pid 5123, 5124 ("
    )
    assert host_swap.units.jobs == ["stop chat.service", "start chat.service"]
    host_swap.assert_ended_cleanly()


async def test_on_the_host_free_memory_that_did_not_move_does_not_fail_verify_free(
    host_swap: Scene,
) -> None:
    # A shared host: someone else took the memory chat gave back. Not the victim's doing.
    host_swap.host.readings = lambda: {"cpu0": host_reading(10.0)}

    result = await host_swap.enforcer.unload("chat", ["chat/c1"])

    assert result["ok"] is True
    assert detail(result, "verify-free").startswith(
        "host: victim processes gone (2,500 MiB measured footprint released; "
        "chat.service empty); cpu0 reads 10 MiB free of 65,536"
    )


@pytest.mark.parametrize(
    ("reading", "says"),
    [
        (None, "cpu0 is not in the probe's readings"),
        (
            DeviceReading("cpu0", HOST.kind, 0, 0, ProbeSource.ABSENT, error="MemAvailable: EIO"),
            "cpu0 cannot be read: MemAvailable: EIO",
        ),
        (
            replace(host_reading(), free_mib=70000.0),
            "cpu0 reading is not sane: 70,000 MiB free of 65,536 MiB",
        ),
        (
            replace(host_reading(), free_mib=float("nan")),
            "cpu0 reading is not sane: nan MiB free of 65,536 MiB",
        ),
    ],
)
async def test_on_the_host_an_unreadable_or_insane_reading_fails_verify_free(
    host_swap: Scene, reading: DeviceReading | None, says: str
) -> None:
    host_swap.host.readings = lambda: {} if reading is None else {"cpu0": reading}

    result = await host_swap.enforcer.unload("chat", ["chat/c1"])

    assert result["ok"] is False and result["rolledBack"] is True
    assert detail(result, "verify-free").startswith(f"after 0.05s: {says} (")


async def test_on_the_host_a_unit_whose_processes_cannot_be_listed_fails_verify_free(
    host_swap: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refuse(name: str) -> list[int]:
        raise UnitError("GetUnitProcesses: Access denied")

    monkeypatch.setattr(host_swap.units, "pids", refuse)

    result = await host_swap.enforcer.unload("chat", ["chat/c1"])

    assert result["ok"] is False
    assert "the processes of chat.service cannot be listed: GetUnitProcesses: Access denied" in (
        detail(result, "verify-free")
    )
