"""The planner with llama.cpp router models (issue 19; docs/placement-rules.md §4.2,
"What paused is"): models of one router share its unit and endpoint, a loaded sibling
makes room by unloading (the pause form) while the router stays, an unloaded (paused)
sibling is in nobody's way, and both gates count a router model's whole footprint: its
pause frees its host RAM too, its wake needs it again (a cold start of its child)."""

from __future__ import annotations

from collections.abc import Sequence

from tests.worlds.builders import MEASURED_AT, cpu, cpu_reading, gpu, gpu_reading, measured
from uapplace.core.model import (
    Config,
    Model,
    OptionKind,
    Registry,
    Resident,
    ResidentState,
)
from uapplace.core.planner import PlanInput, plan

CARD = gpu()
HOST = cpu(total=8_192, reserved=1_024)
ROUTER = "http://127.0.0.1:8080"


def router_config(key: str, gpu_mib: float, host_mib: float, on: str = "gpu0") -> Config:
    return measured(key, gpu_mib, host_mib, on=on, pause_lever="llamacpp-router")


def router_model(key: str, config: Config) -> Model:
    return Model(key, key, "llama.cpp", {config.key: config}, unit="router", endpoint=ROUTER)


def registry(*models: Model, upstream: str | None = None) -> Registry:
    return Registry({CARD.key: CARD, HOST.key: HOST}, {m.key: m for m in models}, upstream)


def resident(m: Model, state: ResidentState = ResidentState.HOT) -> Resident:
    config = next(iter(m.configs.values()))
    paused = state is ResidentState.PAUSED
    return Resident(
        model=m.key,
        config=config.key,
        device=config.measured_on or "gpu0",
        engine="llama.cpp",
        endpoint=ROUTER,
        unit="router.service",
        state=state,
        gpu_mib=0.0 if paused else config.resident_gpu_mib,
        host_rss_mib=0.0 if paused else config.host_rss_mib,
        since=MEASURED_AT,
    )


def inputs(reg: Registry, residents: Sequence[Resident], host_free: float = 6_000.0) -> PlanInput:
    readings = {
        "gpu0": gpu_reading(CARD.total_mib, 0.0),
        "cpu0": cpu_reading(HOST.total_mib, host_free),
    }
    return PlanInput(reg, tuple(residents), readings)


def forms(reg: Registry, residents: Sequence[Resident], model: str, **kw: float) -> list[str]:
    result = plan(inputs(reg, residents, **kw), model)
    return [
        f"{o.kind.value}:" + ",".join(f"{v.model}@{v.action}" for v in o.victims)
        for o in result.options
    ] or list(result.infeasible)


SMALL = router_model("small", router_config("small-q4", 4_000, 500))
LARGE = router_model("large", router_config("large-q4", 6_000, 500))


def test_a_loaded_sibling_makes_room_by_unloading_first() -> None:
    # 4,000 + 6,000 MiB would fit the card: the router still runs one model at a time
    # (uapplace assumes --models-max 1), so the sibling goes, paused first.
    reg = registry(SMALL, LARGE)
    assert forms(reg, [resident(SMALL)], "large") == [
        "displace:small@pause",
        "displace:small@stop",
    ]


def test_an_unloaded_sibling_is_in_nobody_s_way() -> None:
    reg = registry(SMALL, LARGE)
    assert forms(reg, [resident(SMALL, ResidentState.PAUSED)], "large") == ["load_alongside:"]


def test_a_paused_router_model_is_woken_and_its_loaded_sibling_pauses() -> None:
    reg = registry(SMALL, LARGE)
    residents = [resident(SMALL, ResidentState.PAUSED), resident(LARGE)]
    result = plan(inputs(reg, residents), "small")
    assert [o.kind for o in result.options] == [OptionKind.WAKE, OptionKind.WAKE]
    assert [v.action for v in result.options[0].victims] == ["pause"]


def test_on_the_cpu_tier_a_router_pause_frees_its_host_ram() -> None:
    # Host room: 2,024 − 1,024 reserve = 1,000 MiB; the new model needs 1,500 MiB. Only
    # what the sibling's process gives back (900 MiB) makes it fit; a router pause
    # ends that process, so the pause form passes the host gate like a stop.
    small = router_model("small", router_config("small-q4", 0.0, 900, on="cpu0"))
    large = router_model("large", router_config("large-q4", 0.0, 1_500, on="cpu0"))
    reg = registry(small, large)
    assert forms(reg, [resident(small)], "large", host_free=2_024.0) == [
        "displace:small@pause",
        "displace:small@stop",
    ]


def test_a_router_model_s_wake_needs_its_host_ram_again() -> None:
    small = router_model("small", router_config("small-q4", 0.0, 1_500, on="cpu0"))
    reg = registry(small)
    paused = [resident(small, ResidentState.PAUSED)]
    assert forms(reg, paused, "small", host_free=6_000.0) == ["wake:"]
    (line,) = forms(reg, paused, "small", host_free=2_024.0)
    assert line.startswith("cpu0: host RAM 1500 MiB needed, 1000 MiB available"), line


def test_behind_a_single_upstream_the_sibling_still_pauses() -> None:
    # The router keeps the port: pausing a sibling leaves it there for the new model.
    reg = registry(SMALL, LARGE, upstream=ROUTER)
    assert forms(reg, [resident(SMALL)], "large") == [
        "displace:small@pause",
        "displace:small@stop",
    ]
    assert forms(reg, [resident(SMALL, ResidentState.PAUSED)], "large") == ["load_alongside:"]
