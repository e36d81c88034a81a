"""Executable pause in the planner (issue 12): pause vs stop options, the host-RAM gate
of a level-1 pause, ranking by time to serve again, the consequence table of
docs/placement-rules.md §4.5, and ``wake`` for a paused resident of the requested model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from tests.worlds.builders import MEASURED_AT, cpu, gpu, measured
from uapplace.core.model import (
    PAUSE_SUFFIX,
    Config,
    DeviceKind,
    DeviceReading,
    Envelope,
    Model,
    Option,
    OptionKind,
    PauseLever,
    ProbeSource,
    Registry,
    Resident,
    ResidentState,
)
from uapplace.core.planner import PlanInput, plan
from uapplace.core.ranking import rank_options
from uapplace.core.victims import CONSEQUENCES, consequence, pause_consequence

CARD = gpu()
HOST = cpu()


def envelope(cold: float = 20.0, wake: float | None = 1.5, freed: float | None = None) -> Envelope:
    return Envelope(
        stop_s=1.0,
        free_s=1.2,
        cold_start_s=cold,
        warm_start_s=cold / 2,
        measured_at=MEASURED_AT,
        measured_on="gpu0",
        sleep_s=0.5 if wake is not None else None,
        sleep_freed_mib=freed,
        wake_s=wake,
    )


def config(
    key: str,
    gpu_mib: float,
    host_mib: float = 2_000.0,
    lever: PauseLever | None = None,
    env: Envelope | None = None,
) -> Config:
    return measured(key, gpu_mib, host_mib, unit=f"unit-{key}", pause_lever=lever, envelope=env)


def model(key: str, cfg: Config) -> Model:
    return Model(key=key, display=key, engine="vllm", configs={cfg.key: cfg})


def registry(*models: Model) -> Registry:
    return Registry({CARD.key: CARD, HOST.key: HOST}, {m.key: m for m in models})


def resident(
    m: Model, state: ResidentState = ResidentState.HOT, gpu_mib: float | None = None
) -> Resident:
    cfg = next(iter(m.configs.values()))
    return Resident(
        model=m.key,
        config=cfg.key,
        device="gpu0",
        engine="vllm",
        endpoint=f"http://127.0.0.1:9{len(m.key)}00",
        unit=cfg.unit,
        state=state,
        gpu_mib=cfg.resident_gpu_mib if gpu_mib is None else gpu_mib,
        host_rss_mib=cfg.host_rss_mib,
        since=MEASURED_AT,
    )


def inputs(reg: Registry, residents: Sequence[Resident], host_free: float = 100_000.0) -> PlanInput:
    readings = {
        "gpu0": DeviceReading("gpu0", DeviceKind.GPU, CARD.total_mib, 0.0, ProbeSource.SIM),
        "cpu0": DeviceReading(
            "cpu0", DeviceKind.CPU, HOST.total_mib, host_free, ProbeSource.MEMAVAILABLE
        ),
    }
    return PlanInput(reg, tuple(residents), readings)


def displaces(options: Sequence[Option]) -> list[tuple[str, tuple[str, ...]]]:
    return [
        (o.kind.value, tuple(v.action for v in o.victims))
        for o in options
        if o.kind is not OptionKind.REUSE
    ]


# 22,528 MiB budget: the coder (16 GiB) must go for the chat model (12 GiB) to load.
CODER_SLEEPS = model("coder", config("coder-q4", 16_000, lever="vllm-sleep-1", env=envelope()))
CODER_PLAIN = model("coder", config("coder-q4", 16_000))
CHAT = model("chat", config("chat-q4", 12_000, env=envelope(cold=8.0, wake=None)))


# --------------------------------------------------------------------------- pause vs stop


def test_a_victim_with_a_lever_gives_both_forms_pause_first() -> None:
    reg = registry(CODER_SLEEPS, CHAT)
    result = plan(inputs(reg, [resident(CODER_SLEEPS)]), "chat")
    assert displaces(result.options) == [("displace", ("pause",)), ("displace", ("stop",))]
    paused, stopped = result.options
    assert paused.signature == (f"coder/coder-q4{PAUSE_SUFFIX}",)
    assert stopped.signature == ("coder/coder-q4",)
    assert paused.signature != stopped.signature  # consent names the action
    assert paused.to_json()["victims"][0]["action"] == "pause"
    assert stopped.to_json()["victims"][0]["action"] == "stop"


def test_a_victim_without_a_lever_is_only_stopped() -> None:
    reg = registry(CODER_PLAIN, CHAT)
    result = plan(inputs(reg, [resident(CODER_PLAIN)]), "chat")
    assert displaces(result.options) == [("displace", ("stop",))]
    assert result.options[0].victims[0].alternative == ""


def test_the_llamacpp_router_lever_is_executable() -> None:
    # Issue 19: a router model pauses by unloading (tests/unit/test_router_planner.py).
    router = model("coder", config("coder-q4", 16_000, lever="llamacpp-router"))
    result = plan(inputs(registry(router, CHAT), [resident(router)]), "chat")
    assert displaces(result.options) == [("displace", ("pause",)), ("displace", ("stop",))]
    assert "the router unloads it" in result.options[0].victims[0].consequence


def test_only_a_hot_resident_is_paused() -> None:
    warming = resident(CODER_SLEEPS, ResidentState.WARMING)
    result = plan(inputs(registry(CODER_SLEEPS, CHAT), [warming]), "chat")
    assert displaces(result.options) == [("displace", ("stop",))]


def test_a_victim_on_the_candidates_unit_is_always_stopped() -> None:
    shared = model(
        "chat",
        replace(config("chat-q4", 12_000), unit="unit-coder-q4"),
    )
    result = plan(inputs(registry(CODER_SLEEPS, shared), [resident(CODER_SLEEPS)]), "chat")
    # A paused engine keeps its unit: the candidate could never start beside it.
    assert displaces(result.options) == [("displace", ("stop",))]


def test_each_victim_says_what_the_other_action_costs() -> None:
    reg = registry(CODER_SLEEPS, CHAT)
    paused, stopped = plan(inputs(reg, [resident(CODER_SLEEPS)]), "chat").options
    assert stopped.victims[0].alternative == (
        "pausing instead: wake ≈ 1.5 s, frees 16000 MiB, host RAM +16000 MiB"
    )
    assert paused.victims[0].alternative == "stopping instead: reload ≈ 20.0 s, frees 16000 MiB"
    assert paused.victims[0].serve_again_s == 1.5
    assert stopped.victims[0].serve_again_s == 20.0


def test_expected_switch_durations_come_from_the_envelopes() -> None:
    reg = registry(CODER_SLEEPS, CHAT)
    paused, stopped = plan(inputs(reg, [resident(CODER_SLEEPS)]), "chat").options
    # stop_s 1.0 + chat cold start 8.0; sleep_s 0.5 + 8.0
    assert stopped.expected_s == pytest.approx(9.0)
    assert paused.expected_s == pytest.approx(8.5)
    assert stopped.to_json()["expected_s"] == 9.0


def test_an_unmeasured_envelope_leaves_the_duration_unknown() -> None:
    bare = model("coder", config("coder-q4", 16_000, lever="vllm-sleep-2"))
    paused, stopped = plan(inputs(registry(bare, CHAT), [resident(bare)]), "chat").options
    assert paused.expected_s is None and stopped.expected_s is None
    assert paused.victims[0].action == "pause"  # default order: pause before stop
    assert stopped.victims[0].alternative.startswith("pausing instead: wake ≈ unmeasured")


# --------------------------------------------------------------------------- host-RAM gate


def test_a_level_1_pause_must_pass_the_host_ram_gate() -> None:
    reg = registry(CODER_SLEEPS, CHAT)
    # 8,192 reserve + 2,000 for chat + 16,000 of offloaded weights = 26,192 needed.
    # Stopping frees the coder's 2,000 host MiB; pausing keeps them and adds 16,000.
    result = plan(inputs(reg, [resident(CODER_SLEEPS)], host_free=26_000.0), "chat")
    assert displaces(result.options) == [("displace", ("stop",))]
    assert any(
        line.startswith("cpu0: gpu0: pausing instead of stopping (chat/chat-q4) moves 16000 MiB")
        for line in result.infeasible
    ), result.infeasible
    roomy = plan(inputs(reg, [resident(CODER_SLEEPS)], host_free=26_200.0), "chat")
    assert displaces(roomy.options)[0] == ("displace", ("pause",))


def test_the_measured_offload_figure_beats_the_resident_footprint() -> None:
    coder = model(
        "coder", config("coder-q4", 16_000, lever="vllm-sleep-1", env=envelope(freed=15_000))
    )
    reg = registry(coder, CHAT)
    # 15,000 freed still covers the 12,000 - (22,528 - 16,000) = 5,472 MiB need.
    result = plan(inputs(reg, [resident(coder)], host_free=25_300.0), "chat")
    assert displaces(result.options)[0] == ("displace", ("pause",))
    victim = result.options[0].victims[0]
    assert (victim.frees_mib, victim.residual_mib, victim.host_grows_mib) == (15_000, 1_000, 15_000)


def test_a_level_2_pause_moves_nothing_into_host_ram() -> None:
    coder = model("coder", config("coder-q4", 16_000, lever="vllm-sleep-2", env=envelope()))
    result = plan(inputs(registry(coder, CHAT), [resident(coder)], host_free=10_300.0), "chat")
    assert displaces(result.options) == [("displace", ("pause",)), ("displace", ("stop",))]
    assert result.options[0].victims[0].host_grows_mib == 0.0


def test_a_pause_that_frees_too_little_gpu_is_not_offered() -> None:
    coder = model(
        "coder", config("coder-q4", 16_000, lever="vllm-sleep-1", env=envelope(freed=7_000))
    )
    growing = model("chat", replace(config("chat-q4", 12_000), kv_mib_per_1k_cells=100.0))
    # At 52,768 cells chat costs 14,000: 16,000 + 14,000 − 22,528 = 7,472 MiB to free.
    result = plan(inputs(registry(coder, growing), [resident(coder)]), "chat", cells=52_768)
    assert displaces(result.options) == [("displace", ("stop",))]
    assert any("frees 7000 MiB, 7472 MiB needed" in line for line in result.infeasible)


def test_a_residual_that_can_never_fit_beside_is_a_conflict_so_only_a_stop() -> None:
    coder = model(
        "coder", config("coder-q4", 16_000, lever="vllm-sleep-1", env=envelope(freed=4_000))
    )
    # Paused, the coder still holds 12,000; with chat's 12,000 that never fits, so the
    # units conflict (systemd would stop the paused one): no pause form at all.
    result = plan(inputs(registry(coder, CHAT), [resident(coder)]), "chat")
    assert displaces(result.options) == [("displace", ("stop",))]


# --------------------------------------------------------------------------- ranking


def test_measured_times_rank_stop_first_when_reloading_is_faster() -> None:
    slow_wake = model(
        "coder", config("coder-q4", 16_000, lever="vllm-sleep-2", env=envelope(cold=3, wake=9))
    )
    result = plan(inputs(registry(slow_wake, CHAT), [resident(slow_wake)]), "chat")
    assert displaces(result.options) == [("displace", ("stop",)), ("displace", ("pause",))]


def test_the_two_forms_sit_together_in_the_mib_order() -> None:
    small = model("small", config("small-q4", 7_000, lever="vllm-sleep-1", env=envelope()))
    big = model("big", config("big-q4", 9_000, lever="vllm-sleep-1", env=envelope()))
    reg = registry(small, big, model("chat", config("chat-q4", 12_000)))
    # 22,528 − 16,000 loaded = 6,528 room; chat needs 12,000: either victim alone frees enough.
    pinned = plan(inputs(reg, [resident(small), resident(big)]), "chat-q4")
    assert [(o.victims[0].model, o.victims[0].action) for o in pinned.options] == [
        ("small", "pause"),
        ("small", "stop"),
    ]
    ranked = rank_options(reversed(pinned.options))
    assert ranked == pinned.options


# --------------------------------------------------------------------------- wake


def test_a_paused_resident_of_the_requested_model_is_woken() -> None:
    asleep = resident(CODER_SLEEPS, ResidentState.PAUSED, gpu_mib=0.0)
    result = plan(inputs(registry(CODER_SLEEPS, CHAT), [asleep]), "coder")
    assert [(o.kind, o.victims) for o in result.options] == [(OptionKind.WAKE, ())]
    assert result.options[0].expected_s == 1.5
    assert result.options[0].to_json()["signature"] == []


def test_a_wake_that_needs_room_displaces_like_any_load() -> None:
    asleep = resident(CODER_SLEEPS, ResidentState.PAUSED, gpu_mib=0.0)
    chat_sleeps = model("chat", config("chat-q4", 12_000, lever="vllm-sleep-2", env=envelope()))
    result = plan(
        inputs(registry(CODER_SLEEPS, chat_sleeps), [asleep, resident(chat_sleeps)]), "coder"
    )
    assert displaces(result.options) == [("wake", ("pause",)), ("wake", ("stop",))]
    assert result.options[0].signature == (f"chat/chat-q4{PAUSE_SUFFIX}",)
    assert result.options[1].signature == ("chat/chat-q4",)


def test_a_paused_resident_without_a_lever_is_not_woken() -> None:
    asleep = resident(CODER_PLAIN, ResidentState.PAUSED, gpu_mib=0.0)
    result = plan(inputs(registry(CODER_PLAIN, CHAT), [asleep]), "coder")
    assert result.options == ()
    assert any("already resident on gpu0 (paused)" in line for line in result.infeasible)


def test_a_paused_resident_is_never_paused_again_only_stopped() -> None:
    asleep = resident(CODER_SLEEPS, ResidentState.PAUSED, gpu_mib=3_000.0)
    big = model("big", config("big-q4", 21_000))
    result = plan(inputs(registry(CODER_SLEEPS, big), [asleep]), "big")
    assert displaces(result.options) == [("displace", ("stop",))]
    assert result.options[0].victims[0].consequence == "already offloaded; restore path lost"


# --------------------------------------------------------------------------- consequence table


def test_the_consequence_table_has_a_pause_row() -> None:
    rows = {(state, action, busy): text for state, action, busy, text in CONSEQUENCES}
    assert rows[("hot", "stop", "no")] == consequence(ResidentState.HOT, False)
    assert rows[("hot", "stop", "yes")] == consequence(ResidentState.HOT, True)
    assert rows[("hot", "pause (level 1)", "no")] == (
        "session idle, context lost; paused: weights offloaded to host RAM, wake needed (no reload)"
    )
    assert rows[("hot", "pause (level 2)", "no")] == (
        "session idle, context lost; paused: weights discarded, wake reloads them from disk"
    )
    assert rows[("paused", "stop", "—")] == consequence(ResidentState.PAUSED, None)
    # KV and context are lost either way; in-flight work is aborted either way.
    assert pause_consequence(1, True).startswith("active generation aborted; context lost")
    assert pause_consequence(2, None).startswith("in-flight work unknown")


def test_a_unit_that_can_pause_has_no_conflicts_edge_its_awake_size_would_draw() -> None:
    from uapplace.core.conflicts import conflict_edges

    assert conflict_edges(registry(CODER_PLAIN, CHAT)) == {
        "unit-chat-q4": frozenset({"unit-coder-q4"}),
        "unit-coder-q4": frozenset({"unit-chat-q4"}),
    }
    # Paused, the coder holds (at most) its unmeasured residual, counted 0: it fits.
    assert conflict_edges(registry(CODER_SLEEPS, CHAT)) == {}


# --------------------------------------------------------------------------- the notification


def test_the_notification_labels_the_action_and_the_durations() -> None:
    from uapplace.daemon.notify import action_label, body_text

    result = plan(inputs(registry(CODER_SLEEPS, CHAT), [resident(CODER_SLEEPS)]), "chat")
    assert body_text(result).splitlines() == [
        "Recommended: load chat/chat-q4 on gpu0 — pauses coder: no clients, nothing in flight, "
        "wake ≈ 1.5 s, frees 16,000 MiB; swap ≈ 8.5 s",
        "coder: stopping instead: reload ≈ 20.0 s, frees 16000 MiB",
        "Approval signature: coder/coder-q4@pause",
        "1 other option: `uapplace pending`",
    ]
    assert [action_label(o) for o in result.options] == [
        "Pause coder and load",
        "Stop coder and load",
    ]
    asleep = resident(CODER_SLEEPS, ResidentState.PAUSED, gpu_mib=0.0)
    woken = plan(inputs(registry(CODER_SLEEPS, CHAT), [asleep]), "coder")
    assert body_text(woken) == (
        "Recommended: wake coder/coder-q4 on gpu0 (paused) — nothing is stopped; swap ≈ 1.5 s"
    )
    assert action_label(woken.options[0]) == "Wake coder"


def test_the_shims_expected_victims_carry_the_action() -> None:
    from uapplace.shim.bodies import VictimRefBody, signature_of

    refs = [
        VictimRefBody.model_validate({"model": "coder", "config": "q4", "action": "pause"}),
        VictimRefBody.model_validate(
            {"model": "chat", "config": "q4", "action": "stop", "consequence": "…"}
        ),
    ]
    assert signature_of(refs) == ["chat/q4", f"coder/q4{PAUSE_SUFFIX}"]
    with pytest.raises(ValueError, match="action"):
        VictimRefBody.model_validate({"model": "coder", "config": "q4", "action": "kill"})
