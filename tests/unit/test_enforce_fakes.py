"""The docs/placement-rules.md §4.6 sequence over fakes: every success path and rollback branch.

A real :class:`~uapplace.enforce.enforcer.Enforcer` (real planner, real journal file) runs
against :mod:`enforce_fakes`: units in memory with scripted job outcomes, engines
whose health follows their unit, and a host over plain lists whose gpu0 reading is
what the running engines leave free. Timeouts are tiny, so a wait that must fail
fails in about 0.1 s. Each test shows the step sequence, the result, and the units
and residents after. The same proofs against a real ``systemd --user`` and real
engine processes: ``tests/systemd/test_enforce.py`` and ``test_enforce_safety.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest
from enforce_fakes import (
    FakeEngines,
    Scene,
    detail,
    endpoint_of,
    measured,
    ok,
    resident,
    steps,
    swap_registry,
    vllm,
)

from tests.worlds.steps import APPLY_STEPS
from uapplace.core.alerts import AlertKind, Severity
from uapplace.core.errors import Drifted
from uapplace.core.model import (
    PAUSE_SUFFIX,
    Holder,
    ProcessUsage,
    Registry,
    Resident,
    ResidentKey,
    ResidentState,
)
from uapplace.files.capacity import ServicePolicy

ALPHA = endpoint_of("alpha")
BETA = endpoint_of("beta")
CODER = endpoint_of("coder")
SUCCESS = APPLY_STEPS
FORWARD = APPLY_STEPS[: APPLY_STEPS.index("verify-up") + 1]
RESTORED = ["rollback-stop", "rollback-start", "rollback-verify", "rollback-clear"]


@pytest.fixture
def swap(tmp_path: Path) -> Scene:
    """alpha runs on gpu0; beta (16,000 MiB) only fits once alpha (14,000 MiB) stops."""
    return Scene(tmp_path, swap_registry(), [resident("alpha", "a1")])


# --------------------------------------------------------------------------- success


async def test_apply_stops_the_victim_starts_the_new_unit_and_resolves(swap: Scene) -> None:
    entry = swap.park("beta")

    result = await swap.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["ok"] is True and "rolledBack" not in result and "error" not in result
    assert steps(result) == ok(*SUCCESS)
    assert detail(result, "refresh-proxy") == "skipped: no proxy configured"
    assert swap.units.running() == {"alpha.service": "inactive", "beta.service": "active"}
    assert swap.host.states() == {"beta/b1": "hot"}
    assert swap.host.resolved == [(entry.id, "applied")]
    assert [(r["model"], r["state"]) for r in result["runningAfter"]] == [("beta", "hot")]
    # Each unit change came after the journal said what was about to happen.
    assert swap.units.journaled == [("stop alpha.service", "stop"), ("start beta.service", "start")]
    swap.assert_ended_cleanly()


async def test_mid_drain_the_marks_are_the_truth_and_the_resident_shows_them(
    swap: Scene,
) -> None:
    entry = swap.park("beta")
    seen: list[tuple[dict[str, str], frozenset[ResidentKey]]] = []
    swap.host.on_inflight = lambda: seen.append((swap.host.states(), swap.enforcer.marks.draining))

    await swap.enforcer.apply(entry, 1, ["alpha/a1"])

    assert seen == [({"alpha/a1": "draining"}, frozenset({("alpha", "a1", "gpu0")}))]
    swap.assert_ended_cleanly()


async def test_load_with_room_stops_nothing(tmp_path: Path) -> None:
    scene = Scene(tmp_path, swap_registry(), [])

    result = await scene.enforcer.load("beta", [])

    assert result["ok"] is True
    assert steps(result) == ok(*SUCCESS)
    assert detail(result, "stop") == "no victims"
    assert scene.units.jobs == ["start beta.service"]
    assert scene.host.states() == {"beta/b1": "hot"}
    scene.assert_ended_cleanly()


async def test_unload_drains_and_stops_and_starts_nothing(swap: Scene) -> None:
    result = await swap.enforcer.unload("alpha", ["alpha/a1"])

    assert result["ok"] is True
    expected = ["revalidate", "preflight", "mark-draining", "drain", "stop", "verify-free"]
    assert steps(result) == ok(*expected, "refresh-proxy", "resolve")
    assert detail(result, "preflight") == "nothing starts (unload); alpha/a1 stops"
    assert swap.units.running() == {"alpha.service": "inactive"}
    assert swap.host.live == []
    swap.assert_ended_cleanly()


# --------------------------------------------------------------------------- pause and wake


def pause_registry() -> Registry:
    """coder (vLLM, 16,000 MiB, sleep level 2) and beta (16,000 MiB) share gpu0."""
    coder = vllm("coder", measured("c1", 16000, pause_lever="vllm-sleep-2"))
    base = swap_registry()
    return Registry(base.devices, {"coder": coder, "beta": base.models["beta"]})


def coder_resident(state: ResidentState = ResidentState.HOT) -> Resident:
    return resident("coder", "c1", state, engine="vllm", gpu_mib=16000.0)


@pytest.fixture
def paused_swap(tmp_path: Path) -> Scene:
    return Scene(tmp_path, pause_registry(), [coder_resident()])


async def test_a_pause_swap_sleeps_the_victim_and_keeps_its_unit(paused_swap: Scene) -> None:
    scene = paused_swap
    entry = scene.park("beta")
    assert entry.options[0].signature == (f"coder/c1{PAUSE_SUFFIX}",)

    result = await scene.enforcer.apply(entry, 1, [f"coder/c1{PAUSE_SUFFIX}"])

    assert result["ok"] is True
    assert steps(result) == ok(
        "revalidate", "preflight", "mark-draining", "drain", "pause", *SUCCESS[4:]
    )
    assert detail(result, "stop") == "paused instead"
    assert scene.units.running() == {"beta.service": "active", "coder.service": "active"}
    assert scene.engines.asleep == {CODER}
    assert scene.host.states() == {"coder/c1": "paused", "beta/b1": "hot"}
    assert scene.engines.journaled == [(f"sleep {CODER}", "pause")]
    assert scene.units.journaled == [("start beta.service", "start")]
    scene.assert_ended_cleanly()


@pytest.fixture
def asleep(tmp_path: Path) -> Scene:
    """coder is paused: its unit runs, its engine sleeps."""
    scene = Scene(tmp_path, pause_registry(), [coder_resident(ResidentState.PAUSED)])
    scene.engines.asleep.add(CODER)
    return scene


async def test_a_wake_replaces_start_and_publishes_the_woken_resident(asleep: Scene) -> None:
    entry = asleep.park("coder")

    result = await asleep.enforcer.apply(entry, 1, [])

    assert result["ok"] is True
    expected = ["revalidate", "preflight", "mark-draining", "drain", "stop", "verify-free"]
    assert steps(result) == ok(*expected, "wake", "verify-up", "refresh-proxy", "resolve")
    assert asleep.engines.asleep == set()
    assert asleep.units.jobs == []
    assert asleep.host.states() == {"coder/c1": "hot"}
    assert asleep.engines.journaled == [(f"wake {CODER}", "wake")]
    asleep.assert_ended_cleanly()


# --------------------------------------------------------------------------- refusals


async def test_revalidate_drift_touches_nothing(swap: Scene) -> None:
    entry = swap.park("beta")

    with pytest.raises(Drifted, match=r"approved \[gamma/g1\], now \[alpha/a1\]"):
        await swap.enforcer.apply(entry, 1, ["gamma/g1"])

    assert [(s[1], s[2]) for s in swap.host.steps] == [("revalidate", False)]
    assert swap.units.jobs == [] and swap.units.journaled == []
    assert swap.host.states() == {"alpha/a1": "hot"}
    swap.assert_ended_cleanly()


async def test_a_preflight_refusal_touches_nothing(swap: Scene) -> None:
    entry = swap.park("beta")
    swap.units.unreadable.add("beta.service")

    result = await swap.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["ok"] is False and "rolledBack" not in result
    assert steps(result) == [("revalidate", True), ("preflight", False)]
    assert result["error"].startswith("preflight: unit beta.service: its state cannot be read")
    assert swap.units.jobs == []
    assert swap.host.states() == {"alpha/a1": "hot"}
    assert entry.id in swap.host.entries
    swap.assert_ended_cleanly()


# --------------------------------------------------------------------------- rollbacks


@pytest.mark.parametrize(
    ("inflight", "says"),
    [
        ({"gpu0:" + ALPHA: [Holder("editor", "inflight")]}, f"gpu0:{ALPHA}: 1 in flight (editor)"),
        (None, "the proxy's in-flight list is unavailable (unknown counts as busy)"),
    ],
    ids=["in-flight", "proxy-unknown"],
)
async def test_a_drain_that_times_out_rolls_back_before_any_stop(
    swap: Scene, inflight: Mapping[str, Sequence[Holder]] | None, says: str
) -> None:
    entry = swap.park("beta")
    swap.host.in_flight = inflight

    result = await swap.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["ok"] is False and result["rolledBack"] is True
    assert steps(result) == [*ok(*FORWARD[:3]), ("drain", False), ("rollback-clear", True)]
    assert says in detail(result, "drain")
    assert result["error"].endswith("; rolled back")
    assert swap.units.jobs == []
    assert swap.host.states() == {"alpha/a1": "hot"}  # the draining mark is gone
    assert entry.id in swap.host.entries  # a complete rollback leaves it pending
    swap.assert_ended_cleanly()


async def test_a_failed_stop_job_restarts_the_victim(swap: Scene) -> None:
    entry = swap.park("beta")
    swap.units.stop_result["alpha.service"] = "timeout"
    swap.units.survives_stop.add("alpha.service")

    result = await swap.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["rolledBack"] is True
    assert steps(result) == [
        *ok(*FORWARD[:4]),
        ("stop", False),
        *ok("rollback-start", "rollback-verify", "rollback-clear"),
    ]
    assert detail(result, "stop") == "alpha.service: stop job timeout; unit active/running"
    assert swap.units.journaled == [
        ("stop alpha.service", "stop"),
        ("start alpha.service", "rollback-start"),
    ]
    assert swap.units.running() == {"alpha.service": "active"}
    assert swap.host.states() == {"alpha/a1": "hot"}
    swap.assert_ended_cleanly()


async def test_verify_free_names_the_orphan_and_rolls_back(swap: Scene) -> None:
    entry = swap.park("beta")
    swap.world.leaves_orphan["alpha.service"] = ProcessUsage(999, 20000.0, "stray-child")

    result = await swap.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["rolledBack"] is True
    assert steps(result) == [
        *ok(*FORWARD[:5]),
        ("verify-free", False),
        *ok("rollback-start", "rollback-verify", "rollback-clear"),
    ]
    assert "gpu0 has 4,576 MiB free, 16,000 MiB needed" in detail(result, "verify-free")
    assert "pid 999 `stray-child` 20,000 MiB" in detail(result, "verify-free")
    assert swap.units.jobs == ["stop alpha.service", "start alpha.service"]
    assert swap.host.states() == {"alpha/a1": "hot"}
    swap.assert_ended_cleanly()


async def test_a_failed_start_job_stops_the_new_unit_and_restarts_the_victim(
    swap: Scene,
) -> None:
    entry = swap.park("beta")
    swap.units.start_result["beta.service"] = "failed"

    result = await swap.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["rolledBack"] is True
    assert steps(result) == [*ok(*FORWARD[:6]), ("start", False), *ok(*RESTORED)]
    assert detail(result, "start") == "beta.service: start job failed; unit failed/failed"
    assert [step for _, step in swap.units.journaled] == [
        "stop",
        "start",
        "rollback-stop",
        "rollback-start",
    ]
    assert swap.units.running() == {"alpha.service": "active", "beta.service": "inactive"}
    assert swap.host.states() == {"alpha/a1": "hot"}
    swap.assert_ended_cleanly()


POLICY = ServicePolicy("llm", None, {"kv": "int8"}, (), None)


def never_healthy(scene: Scene) -> None:
    scene.engines.never_healthy.add(BETA)


def serves_another_model(scene: Scene) -> None:
    scene.engines.served[BETA] = ["gamma"]


def breaks_the_metrics_policy(scene: Scene) -> None:
    scene.host.policy = POLICY
    scene.engines.metrics_of.update({ALPHA: {"kv": "int8"}, BETA: {"kv": "fp16"}})


def turns_failed_after_start(scene: Scene) -> None:
    scene.units.after_start["beta.service"] = "failed"


@pytest.mark.parametrize(
    ("break_it", "says"),
    [
        (never_healthy, "beta.service not healthy after 0.1s"),
        (serves_another_model, "serves [gamma], not beta"),
        (
            breaks_the_metrics_policy,
            "metricsMustMatch of service llm: kv is 'fp16', policy wants 'int8'",
        ),
        (turns_failed_after_start, "beta.service went failed/failed while loading"),
    ],
    ids=["never-healthy", "wrong-served-id", "metrics-must-match", "unit-turns-failed"],
)
async def test_a_failed_verify_up_rolls_back(
    swap: Scene, break_it: Callable[[Scene], None], says: str
) -> None:
    entry = swap.park("beta")
    break_it(swap)

    result = await swap.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["ok"] is False and result["rolledBack"] is True
    assert steps(result) == [*ok(*FORWARD[:7]), ("verify-up", False), *ok(*RESTORED)]
    assert says in detail(result, "verify-up")
    assert swap.units.running() == {"alpha.service": "active", "beta.service": "inactive"}
    assert swap.host.states() == {"alpha/a1": "hot"}
    assert [(r["model"], r["state"]) for r in result["runningAfter"]] == [
        ("alpha", "active/running")
    ]
    swap.assert_ended_cleanly()


class FailingRefresher:
    async def refresh(self) -> tuple[bool, str]:
        return False, "the proxy answered HTTP 502"


async def test_a_failed_proxy_refresh_is_a_failed_step_not_a_failed_run(tmp_path: Path) -> None:
    swap = Scene(tmp_path, swap_registry(), [resident("alpha", "a1")], FailingRefresher())
    entry = swap.park("beta")

    result = await swap.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["ok"] is True and "rolledBack" not in result
    assert steps(result) == [*ok(*FORWARD), ("refresh-proxy", False), ("resolve", True)]
    assert detail(result, "refresh-proxy") == "the proxy answered HTTP 502 (not fatal)"
    assert swap.host.states() == {"beta/b1": "hot"}
    swap.assert_ended_cleanly()


async def test_a_victim_that_cannot_restart_is_rollback_incomplete_everywhere(
    swap: Scene,
) -> None:
    entry = swap.park("beta")
    swap.engines.never_healthy.add(BETA)
    swap.units.start_result["alpha.service"] = "failed"

    result = await swap.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["ok"] is False and result["rolledBack"] is False
    assert steps(result) == [
        *ok(*FORWARD[:7]),
        ("verify-up", False),
        ("rollback-stop", True),
        ("rollback-start", False),
        ("rollback-clear", True),
    ]
    assert (
        "; ROLLBACK INCOMPLETE: alpha.service: start job failed; unit failed/failed"
        in (result["error"])
    )
    [(kind, severity, subject, message)] = swap.host.alerts
    assert (kind, severity, subject) == (
        AlertKind.ROLLBACK_INCOMPLETE,
        Severity.CRITICAL,
        "gpu0",
    )
    assert "gpu0 is now EMPTY (it had alpha/a1)" in message
    assert swap.host.resolved == [(entry.id, "failed")]  # its clients fall back at once
    assert swap.units.running() == {"alpha.service": "failed", "beta.service": "inactive"}
    assert swap.host.live == []
    assert result["runningAfter"] == []
    swap.assert_ended_cleanly()


async def test_a_new_unit_seen_still_up_leaves_the_victims_down(swap: Scene) -> None:
    entry = swap.park("beta")
    swap.engines.never_healthy.add(BETA)
    swap.units.survives_stop.add("beta.service")

    result = await swap.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["rolledBack"] is False
    assert steps(result) == [
        *ok(*FORWARD[:7]),
        ("verify-up", False),
        ("rollback-stop", False),
        ("rollback-start", False),
        ("rollback-clear", True),
    ]
    assert "beta.service still active/running after its stop job (done)" in detail(
        result, "rollback-stop"
    )
    assert swap.units.jobs == ["stop alpha.service", "start beta.service", "stop beta.service"]
    assert swap.units.running() == {"alpha.service": "inactive", "beta.service": "active"}
    assert [alert[0] for alert in swap.host.alerts] == [AlertKind.ROLLBACK_INCOMPLETE]
    assert [(r["model"], r["state"]) for r in result["runningAfter"]] == [
        ("beta", "active/running")
    ]
    swap.assert_ended_cleanly()


async def test_an_unexpected_exception_mid_run_still_rolls_back(swap: Scene) -> None:
    entry = swap.park("beta")
    swap.engines.broken.add(BETA)

    result = await swap.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["rolledBack"] is True
    assert steps(result) == [*ok(*FORWARD[:7]), ("unexpected-error", False), *ok(*RESTORED)]
    assert detail(result, "unexpected-error") == f"RuntimeError: the probe of {BETA} died"
    assert swap.units.running() == {"alpha.service": "active", "beta.service": "inactive"}
    assert swap.host.states() == {"alpha/a1": "hot"}
    swap.assert_ended_cleanly()


# --------------------------------------------------------------------------- pause rollbacks


def refuses_to_sleep(engines: FakeEngines) -> None:
    engines.refuse_sleep.add(CODER)


def never_seen_asleep(engines: FakeEngines) -> None:
    engines.sleep_unseen.add(CODER)


@pytest.mark.parametrize(
    ("break_it", "says"),
    [
        (refuses_to_sleep, f"sleep level 2: {CODER}/sleep: HTTP 500"),
        (never_seen_asleep, "the sleep was answered but /is_sleeping is false"),
    ],
    ids=["sleep-refused", "never-seen-asleep"],
)
async def test_a_failed_pause_wakes_the_victim_again(
    paused_swap: Scene, break_it: Callable[[FakeEngines], None], says: str
) -> None:
    scene = paused_swap
    entry = scene.park("beta")
    break_it(scene.engines)

    result = await scene.enforcer.apply(entry, 1, [f"coder/c1{PAUSE_SUFFIX}"])

    assert result["rolledBack"] is True
    assert steps(result) == [
        *ok(*FORWARD[:4]),
        ("pause", False),
        *ok("rollback-wake", "rollback-clear"),
    ]
    assert says in detail(result, "pause")
    assert scene.engines.asleep == set()
    assert scene.units.jobs == []
    assert scene.host.states() == {"coder/c1": "hot"}
    scene.assert_ended_cleanly()


async def test_a_failed_start_after_a_pause_wakes_the_victim(paused_swap: Scene) -> None:
    scene = paused_swap
    entry = scene.park("beta")
    scene.units.start_result["beta.service"] = "failed"

    result = await scene.enforcer.apply(entry, 1, [f"coder/c1{PAUSE_SUFFIX}"])

    assert result["rolledBack"] is True
    assert steps(result) == [
        *ok(*FORWARD[:4], "pause", "stop", "verify-free"),
        ("start", False),
        *ok("rollback-stop", "rollback-wake", "rollback-clear"),
    ]
    assert scene.engines.journaled == [
        (f"sleep {CODER}", "pause"),
        (f"wake {CODER}", "rollback-wake"),
    ]
    assert scene.engines.asleep == set()
    assert scene.host.states() == {"coder/c1": "hot"}
    scene.assert_ended_cleanly()


async def test_a_paused_victim_that_cannot_wake_stays_paused_rollback_incomplete(
    paused_swap: Scene,
) -> None:
    scene = paused_swap
    entry = scene.park("beta")
    scene.units.start_result["beta.service"] = "failed"
    scene.engines.refuse_wake.add(CODER)

    result = await scene.enforcer.apply(entry, 1, [f"coder/c1{PAUSE_SUFFIX}"])

    assert result["rolledBack"] is False
    assert steps(result)[-3:] == [
        ("rollback-stop", True),
        ("rollback-wake", False),
        ("rollback-clear", True),
    ]
    assert f"coder/c1: wake_up: {CODER}/wake_up: HTTP 500" in result["error"]
    assert scene.engines.asleep == {CODER}
    assert scene.host.states() == {"coder/c1": "paused"}  # asleep: never published as serving
    assert [alert[0] for alert in scene.host.alerts] == [AlertKind.ROLLBACK_INCOMPLETE]
    scene.assert_ended_cleanly()


async def test_a_refused_wake_puts_nothing_back_but_the_sleep(asleep: Scene) -> None:
    entry = asleep.park("coder")
    asleep.engines.refuse_wake.add(CODER)

    result = await asleep.enforcer.apply(entry, 1, [])

    assert result["rolledBack"] is True
    assert steps(result) == [
        *ok(*FORWARD[:6]),
        ("wake", False),
        *ok("rollback-sleep", "rollback-clear"),
    ]
    assert detail(result, "rollback-sleep") == "coder/c1 is asleep again (paused)"
    assert asleep.engines.asleep == {CODER}
    assert asleep.host.states() == {"coder/c1": "paused"}
    asleep.assert_ended_cleanly()


async def test_a_woken_engine_that_fails_verify_is_put_back_to_sleep(asleep: Scene) -> None:
    entry = asleep.park("coder")
    asleep.engines.served[CODER] = ["someone-else"]

    result = await asleep.enforcer.apply(entry, 1, [])

    assert result["rolledBack"] is True
    assert steps(result) == [
        *ok(*FORWARD[:6], "wake"),
        ("verify-up", False),
        *ok("rollback-sleep", "rollback-clear"),
    ]
    assert asleep.engines.levers == [f"wake {CODER}", f"sleep {CODER}"]
    assert asleep.engines.journaled[-1] == (f"sleep {CODER}", "rollback-sleep")
    assert asleep.engines.asleep == {CODER}
    asleep.assert_ended_cleanly()


async def test_a_woken_engine_that_will_not_sleep_again_is_rollback_incomplete(
    asleep: Scene,
) -> None:
    entry = asleep.park("coder")
    asleep.engines.served[CODER] = ["someone-else"]
    asleep.engines.refuse_sleep.add(CODER)

    result = await asleep.enforcer.apply(entry, 1, [])

    assert result["rolledBack"] is False
    assert steps(result)[-2:] == [("rollback-sleep", False), ("rollback-clear", True)]
    assert "coder/c1 not seen asleep after the failed wake" in result["error"]
    assert [alert[1] for alert in asleep.host.alerts] == [Severity.CRITICAL]
    asleep.assert_ended_cleanly()
