"""The planner: options, cost gates, minimal eviction sets, ranking, preview.

docs/placement-rules.md §4.4, §4.5.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Sequence

import pytest

from tests.worlds.builders import MEASURED_AT, cpu, gpu, measured
from uapplace.core.eviction import EvictionItem, minimal_eviction
from uapplace.core.model import (
    Config,
    ConfigStatus,
    Device,
    DeviceKind,
    DeviceReading,
    Holder,
    Model,
    Option,
    OptionKind,
    PreviewReason,
    ProbeSource,
    Registry,
    Resident,
    ResidentState,
    cost_mib,
)
from uapplace.core.planner import PlanInput, plan, plan_unload
from uapplace.core.ranking import affinity_match, rank_options

SESSION_CAP_CELLS = 114_688


# --------------------------------------------------------------------------- builders
# gpu(), cpu() and measured() are tests/worlds/builders.py's.


def unmeasured(key: str) -> Config:
    return Config(key, ConfigStatus.UNMEASURED)


def model(
    key: str,
    *configs: Config,
    affinity: tuple[str, ...] = (),
    advertises: tuple[str, ...] = (),
    tasks: tuple[str, ...] = (),
    unit: str | None = None,
) -> Model:
    return Model(
        key=key,
        display=key,
        engine="llama.cpp",
        configs={c.key: c for c in configs},
        unit=unit,
        affinity_devices=affinity,
        advertises=advertises,
        task_affinity=tasks,
    )


def registry(devices: Iterable[Device], models: Iterable[Model]) -> Registry:
    return Registry({d.key: d for d in devices}, {m.key: m for m in models})


def resident(
    model_key: str,
    config_key: str,
    device: str = "gpu0",
    gpu_mib: float | None = 1_000.0,
    host_mib: float | None = 1_000.0,
    state: ResidentState = ResidentState.HOT,
    holders: tuple[Holder, ...] = (),
    unit: str | None = None,
) -> Resident:
    return Resident(
        model=model_key,
        config=config_key,
        device=device,
        engine="llama.cpp",
        endpoint=None,
        unit=unit if unit is not None else f"unit-{config_key}",
        state=state,
        gpu_mib=gpu_mib,
        host_rss_mib=host_mib,
        since=MEASURED_AT,
        holders=holders,
    )


def readings(
    reg: Registry, cpu_free: float = 100_000.0, absent: Sequence[str] = ()
) -> dict[str, DeviceReading]:
    out: dict[str, DeviceReading] = {}
    for device in reg.devices.values():
        if device.kind is DeviceKind.CPU:
            out[device.key] = DeviceReading(
                device.key, device.kind, device.total_mib, cpu_free, ProbeSource.MEMAVAILABLE
            )
        elif device.key in absent:
            out[device.key] = DeviceReading(
                device.key, device.kind, 0, 0, ProbeSource.ABSENT, error="no such GPU"
            )
        else:
            # A free reading that would mislead: the planner must never use it as a budget.
            out[device.key] = DeviceReading(
                device.key, device.kind, device.total_mib, device.total_mib, ProbeSource.SIM
            )
    return out


def inputs(
    reg: Registry,
    residents: Sequence[Resident] = (),
    cpu_free: float = 100_000.0,
    absent: Sequence[str] = (),
    inflight_known: bool = True,
) -> PlanInput:
    return PlanInput(reg, tuple(residents), readings(reg, cpu_free, absent), inflight_known)


STRATA = measured(
    "strata-iq3_s",
    21_812,
    52_857,
    kv_resident_cells=32_768,
    kv_mib_per_1k_cells=12.2,
    unit="uap-strata-server",
)
FLASH = model(
    "qwen3.8-flash-next",
    STRATA,
    affinity=("gpu0",),
    advertises=("qwen3.8-flash-next-iq3_s", "gpt-5.1-codex"),
)


def strata_resident(
    state: ResidentState = ResidentState.HOT, holders: tuple[Holder, ...] = ()
) -> Resident:
    return resident(
        FLASH.key,
        STRATA.key,
        gpu_mib=21_812,
        host_mib=52_857,
        state=state,
        holders=holders,
        unit="uap-strata-server",
    )


def kinds(options: Sequence[Option]) -> list[tuple[OptionKind, str, str]]:
    return [(o.kind, o.config, o.device) for o in options]


# -------------------------------------------------- the numbers of docs/placement-rules.md §4.4


def test_cost_at_the_session_cap_is_the_specs_number() -> None:
    assert cost_mib(STRATA, SESSION_CAP_CELLS) == pytest.approx(22_811.424)
    assert cost_mib(STRATA, 32_768) == 21_812
    big = gpu("gpu0", total=143_771, reserved=2_048)
    result = plan(inputs(registry([big, cpu()], [FLASH])), FLASH.key, SESSION_CAP_CELLS)
    assert result.reason is PreviewReason.OK
    (option,) = result.options
    assert option.kind is OptionKind.LOAD_ALONGSIDE
    assert option.cost_mib == pytest.approx(22_811.424)
    assert option.to_json()["cost_mib"] == 22_811.424


def test_a_22_gib_candidate_must_displace_the_strata_resident() -> None:
    candidate = model("qwen3.8-27b", measured("llama-mtp", 22 * 1024), affinity=("gpu0",))
    reg = registry([gpu(), cpu()], [FLASH, candidate])
    result = plan(inputs(reg, [strata_resident()]), "qwen3.8-27b")

    assert result.reason is PreviewReason.OK
    assert kinds(result.options) == [(OptionKind.DISPLACE, "llama-mtp", "gpu0")]
    (victim,) = result.options[0].victims
    assert (victim.model, victim.config, victim.frees_mib) == (FLASH.key, STRATA.key, 21_812)
    assert victim.reload_mib == 21_812
    assert result.options[0].signature == ("qwen3.8-flash-next/strata-iq3_s",)


def test_the_strata_config_does_not_fit_the_card_at_its_session_cap() -> None:
    reg = registry([gpu(), cpu()], [FLASH])
    result = plan(inputs(reg), FLASH.key, SESSION_CAP_CELLS)
    assert result.reason is PreviewReason.NO_FEASIBLE_OPTION
    (line,) = result.infeasible
    assert line.startswith("gpu0: qwen3.8-flash-next/strata-iq3_s needs 22811.424 MiB;")
    assert "leaves 22528 MiB" in line


@pytest.mark.parametrize(("candidate_mib", "fits"), [(22_528, True), (22_529, False)])
def test_boundary_on_an_empty_card(candidate_mib: int, fits: bool) -> None:
    candidate = model("m", measured("c", candidate_mib))
    result = plan(inputs(registry([gpu(), cpu()], [candidate])), "m")
    if fits:
        assert kinds(result.options) == [(OptionKind.LOAD_ALONGSIDE, "c", "gpu0")]
    else:
        assert result.reason is PreviewReason.NO_FEASIBLE_OPTION
        assert result.infeasible == (
            "gpu0: m/c needs 22529 MiB; 24576 total − 2048 reserved − 0 loaded leaves 22528 MiB",
        )


@pytest.mark.parametrize(
    ("candidate_mib", "kind"), [(716, OptionKind.LOAD_ALONGSIDE), (717, OptionKind.DISPLACE)]
)
def test_boundary_next_to_a_resident_is_a_sum_not_a_free_reading(
    candidate_mib: int, kind: OptionKind
) -> None:
    candidate = model("m", measured("c", candidate_mib))
    reg = registry([gpu(), cpu()], [FLASH, candidate])
    # The probe says the whole card is free; the budget is 24576 − 2048 − 21812 = 716.
    result = plan(inputs(reg, [strata_resident()]), "m")
    assert kinds(result.options) == [(kind, "c", "gpu0")]


# --------------------------------------------------------------------------- fail closed


def test_unknown_cost_fails_closed() -> None:
    no_rate = measured("c", 10_000, kv_resident_cells=32_768)
    reg = registry([gpu(), cpu()], [model("m", no_rate)])
    assert plan(inputs(reg), "m", 32_768).reason is PreviewReason.OK
    result = plan(inputs(reg), "m", 40_000)
    assert result.reason is PreviewReason.NO_FEASIBLE_OPTION
    assert result.options == ()
    (line,) = result.infeasible
    assert line.startswith("gpu0: cost unknown: m/c at 40000 cells")


def test_measured_on_another_device_fails_closed() -> None:
    config = measured("c", 1_000, on="gpu0")
    reg = registry([gpu("gpu0"), gpu("gpu1"), cpu()], [model("m", config)])
    result = plan(inputs(reg), "m")
    assert kinds(result.options) == [(OptionKind.LOAD_ALONGSIDE, "c", "gpu0")]
    assert result.infeasible == ("gpu1: m/c was measured on gpu0; its cost on gpu1 is unknown",)


def test_unmeasured_configs_are_never_loaded() -> None:
    reg = registry([gpu(), cpu()], [model("qwen3.8-27b", unmeasured("llama-mtp"))])
    result = plan(inputs(reg), "qwen3.8-27b")
    assert result.reason is PreviewReason.NO_MEASURED_CONFIG
    assert result.options == ()
    assert result.infeasible == (
        "qwen3.8-27b/llama-mtp: unmeasured; never loaded until a measurement is recorded",
    )


def test_a_pinned_unmeasured_config_is_not_replaced_by_a_measured_sibling() -> None:
    both = model("m", measured("fast", 1_000), unmeasured("slow"))
    result = plan(inputs(registry([gpu(), cpu()], [both])), "slow")
    assert result.reason is PreviewReason.NO_MEASURED_CONFIG


def test_an_unmeasured_resident_may_be_reused() -> None:
    reg = registry([gpu(), cpu()], [model("m", unmeasured("c"), advertises=("m-chat",))])
    live = resident("m", "c", gpu_mib=None)
    for requested in ("m", "c", "m-chat"):
        result = plan(inputs(reg, [live]), requested)
        assert result.reason is PreviewReason.OK
        assert kinds(result.options) == [(OptionKind.REUSE, "c", "gpu0")]
        assert result.options[0].cost_mib == 0


def test_an_unmeasured_resident_is_never_a_victim() -> None:
    other = model("other", unmeasured("u"))
    candidate = model("m", measured("c", 22_528))
    reg = registry([gpu(), cpu()], [other, candidate])
    result = plan(inputs(reg, [resident("other", "u", gpu_mib=21_812)]), "m")
    assert result.reason is PreviewReason.NO_FEASIBLE_OPTION
    (line,) = result.infeasible
    assert line.startswith("gpu0: m/c needs 22528 MiB;")
    assert "other/u is unmeasured and never a victim" in line


def test_a_resident_with_unknown_footprint_blocks_its_device() -> None:
    other = model("other", measured("o", 500))
    candidate = model("m", measured("c", 100))
    reg = registry([gpu(), cpu()], [other, candidate])
    result = plan(inputs(reg, [resident("other", "o", gpu_mib=None)]), "m")
    assert result.reason is PreviewReason.NO_FEASIBLE_OPTION
    assert result.infeasible == (
        "gpu0: footprint of other/o unknown; the device budget is unknown, so nothing loads there",
    )


def test_an_absent_gpu_is_unavailable() -> None:
    config = measured("c", 1_000, on="gpu1")
    reg = registry([gpu("gpu0"), gpu("gpu1"), cpu()], [model("m", config, affinity=("gpu1",))])
    result = plan(inputs(reg, absent=["gpu1"]), "m")
    assert result.reason is PreviewReason.NO_FEASIBLE_OPTION
    assert result.infeasible == ("gpu1: absent from the probe (no such GPU); unavailable",)


def test_a_gpu_with_no_reading_is_unavailable() -> None:
    reg = registry([gpu(), cpu()], [model("m", measured("c", 1_000))])
    probe = {k: v for k, v in readings(reg).items() if k != "gpu0"}
    result = plan(PlanInput(reg, (), probe), "m")
    assert result.infeasible == ("gpu0: no probe reading; unavailable",)


def test_an_affinity_device_missing_from_the_registry_is_named() -> None:
    reg = registry(
        [gpu(), cpu()], [model("m", measured("c", 1_000, on="gpu9"), affinity=("gpu9",))]
    )
    assert plan(inputs(reg), "m").infeasible == ("gpu9: not a device in the registry",)


# --------------------------------------------------------------------------- holds


def test_a_held_resident_is_never_a_victim() -> None:
    candidate = model("m", measured("c", 22 * 1024), affinity=("gpu0",))
    reg = registry([gpu(), cpu()], [FLASH, candidate])
    hold = Holder("org.example.Editor", "hold", detail="writing the report", cookie=7)
    result = plan(inputs(reg, [strata_resident(holders=(hold,))]), "m")
    assert result.reason is PreviewReason.NO_FEASIBLE_OPTION
    (line,) = result.infeasible
    assert line.endswith(
        "not displaceable: qwen3.8-flash-next/strata-iq3_s held by org.example.Editor: "
        "writing the report"
    )


def test_a_held_resident_is_skipped_for_a_larger_unheld_one() -> None:
    small = model("small", measured("s", 5_000))
    large = model("large", measured("l", 9_000))
    candidate = model("m", measured("c", 10_000))
    reg = registry([gpu(), cpu()], [small, large, candidate])
    hold = Holder("app", "hold", detail="pinned")
    residents = [
        resident("small", "s", gpu_mib=5_000, holders=(hold,)),
        resident("large", "l", gpu_mib=9_000),
    ]
    # Budget 22528 − 14000 = 8528; need 1472: the small one would do, but it is held.
    result = plan(inputs(reg, residents), "m")
    assert [v.model for v in result.options[0].victims] == ["large"]


def test_an_in_flight_request_does_not_protect_a_victim() -> None:
    candidate = model("m", measured("c", 22 * 1024), affinity=("gpu0",))
    reg = registry([gpu(), cpu()], [FLASH, candidate])
    busy = Holder("x-uap-client-id:claude-code", "inflight", started_at=MEASURED_AT)
    result = plan(inputs(reg, [strata_resident(holders=(busy,))]), "m")
    (victim,) = result.options[0].victims
    assert victim.in_flight is True
    assert victim.holders == (busy,)
    assert victim.consequence == "active generation aborted; context lost"


# --------------------------------------------------------------------------- host RAM


def test_the_host_ram_gate_names_cpu0() -> None:
    reg = registry([gpu("gpu0", total=143_771), cpu()], [FLASH])
    # MemAvailable 28192 − 8192 reserve = 20000 < 52857.
    result = plan(inputs(reg, cpu_free=28_192), FLASH.key)
    assert result.reason is PreviewReason.NO_FEASIBLE_OPTION
    assert result.infeasible == (
        "cpu0: host RAM 52857 MiB needed, 20000 MiB available above the 8192 MiB reserve "
        "(for qwen3.8-flash-next/strata-iq3_s on gpu0)",
    )


def test_host_ram_at_exactly_the_reserve_fits() -> None:
    reg = registry([gpu("gpu0", total=143_771), cpu()], [FLASH])
    result = plan(inputs(reg, cpu_free=52_857 + 8_192), FLASH.key)
    assert kinds(result.options) == [(OptionKind.LOAD_ALONGSIDE, STRATA.key, "gpu0")]
    result = plan(inputs(reg, cpu_free=52_857 + 8_192 - 1), FLASH.key)
    assert result.reason is PreviewReason.NO_FEASIBLE_OPTION


def test_victims_free_host_ram_too() -> None:
    # The GPU has room, host RAM does not; displacing the other engine frees its RSS.
    other = model("other", measured("o", 1_000, host_mib=40_000))
    reg = registry([gpu("gpu0", total=143_771), cpu()], [FLASH, other])
    result = plan(
        inputs(reg, [resident("other", "o", host_mib=40_000)], cpu_free=28_192), FLASH.key
    )
    assert kinds(result.options) == [(OptionKind.DISPLACE, STRATA.key, "gpu0")]
    assert [v.model for v in result.options[0].victims] == ["other"]


def test_a_missing_host_reading_fails_closed() -> None:
    reg = registry([gpu(), cpu()], [model("m", measured("c", 1_000))])
    probe = {k: v for k, v in readings(reg).items() if k != "cpu0"}
    result = plan(PlanInput(reg, (), probe), "m")
    assert result.reason is PreviewReason.NO_FEASIBLE_OPTION
    assert result.infeasible == ("cpu0: no host RAM reading; m/c on gpu0 cannot be checked",)


# --------------------------------------------------------------------------- minimal eviction


EIGHT = [6_000, 5_000, 5_000, 4_500, 3_000, 2_000, 1_000, 500]


def greedy(sizes: Sequence[int], need: int, largest_first: bool) -> int:
    freed = 0
    for size in sorted(sizes, reverse=largest_first):
        if freed >= need:
            break
        freed += size
    return freed


def test_eviction_set_is_minimal_where_greedy_is_wrong() -> None:
    names = [f"r{i}" for i in range(len(EIGHT))]
    models = [model(n, measured(n, size)) for n, size in zip(names, EIGHT, strict=True)]
    # Budget 40000 − 1000 − 27000 loaded = 12000; the candidate needs 10000 more.
    candidate = model("m", measured("c", 22_000))
    reg = registry([gpu("gpu0", total=40_000, reserved=1_000), cpu()], [*models, candidate])
    residents = [resident(n, n, gpu_mib=size) for n, size in zip(names, EIGHT, strict=True)]
    assert greedy(EIGHT, 10_000, largest_first=True) == 11_000
    assert greedy(EIGHT, 10_000, largest_first=False) == 11_000

    result = plan(inputs(reg, residents), "m")

    (option,) = result.options
    assert option.frees_mib == 10_000
    # 6000+3000+1000 and 4500+5000+500 also free 10000; two victims beat three.
    assert option.signature == ("r1/r1", "r2/r2")


def brute_force(
    items: Sequence[EvictionItem], need_gpu: int, need_host: int
) -> tuple[int, int, tuple[str, ...]] | None:
    best = None
    for size in range(len(items) + 1):
        for subset in itertools.combinations(items, size):
            if (
                sum(i.gpu_mib for i in subset) < need_gpu
                or sum(i.host_mib for i in subset) < need_host
            ):
                continue
            key = (
                sum(i.gpu_mib for i in subset),
                size,
                tuple(sorted(i.resident.signature for i in subset)),
            )
            best = key if best is None or key < best else best
    return best


def test_eviction_set_matches_brute_force_on_random_instances() -> None:
    rng = random.Random(20261008)
    for _ in range(300):
        count = rng.randint(0, 9)
        items = [
            EvictionItem(
                resident(f"m{i}", f"c{i}", gpu_mib=0, host_mib=0),
                rng.choice([0, 100, 250, 500, 1_000, 1_500, 2_000, rng.randint(1, 3_000)]),
                rng.choice([0, 0, 1_000, 4_000, rng.randint(0, 8_000)]),
            )
            for i in range(count)
        ]
        need_gpu = rng.randint(0, 8_000)
        need_host = rng.choice([0, 0, rng.randint(0, 12_000)])
        found = minimal_eviction(items, need_gpu, need_host)
        expected = brute_force(items, need_gpu, need_host)
        if expected is None:
            assert found is None
        else:
            assert found is not None
            got = (
                sum(i.gpu_mib for i in found),
                len(found),
                tuple(i.resident.signature for i in found),
            )
            assert got == expected


def test_eviction_handles_many_residents() -> None:
    # 40 residents: exponential enumeration would not finish; the DP is bounded by the need.
    items = [EvictionItem(resident(f"m{i:02}", "c", gpu_mib=0), 300 + 37 * i, 0) for i in range(40)]
    found = minimal_eviction(items, 20_011)
    assert found is not None
    assert sum(i.gpu_mib for i in found) == 20_011


def test_one_displace_option_per_config_and_device_and_no_superset() -> None:
    models = [model(f"r{i}", measured(f"r{i}", 4_000)) for i in range(4)]
    candidate = model("m", measured("c", 10_000))
    reg = registry([gpu("gpu0", total=20_000, reserved=0), cpu()], [*models, candidate])
    residents = [resident(f"r{i}", f"r{i}", gpu_mib=4_000) for i in range(4)]
    # Room 4000, need 6000: any two of four residents; one option, the lexically first pair.
    (option,) = plan(inputs(reg, residents), "m").options
    assert option.signature == ("r0/r0", "r1/r1")


# --------------------------------------------------------------------------- reuse, units


def test_reuse_matches_model_key_config_key_and_advertised_id() -> None:
    reg = registry([gpu(), cpu()], [FLASH])
    for requested in (FLASH.key, STRATA.key, "gpt-5.1-codex"):
        result = plan(inputs(reg, [strata_resident()]), requested)
        assert kinds(result.options) == [(OptionKind.REUSE, STRATA.key, "gpu0")]
        assert result.infeasible == ()


@pytest.mark.parametrize("state", [ResidentState.DRAINING, ResidentState.PAUSED])
def test_draining_and_paused_residents_are_not_reused(state: ResidentState) -> None:
    reg = registry([gpu(), cpu()], [FLASH])
    result = plan(inputs(reg, [strata_resident(state=state)]), FLASH.key)
    assert result.reason is PreviewReason.NO_FEASIBLE_OPTION
    assert result.infeasible == (
        f"gpu0: qwen3.8-flash-next/strata-iq3_s is already resident on gpu0 ({state.value})",
    )


def test_a_sibling_config_on_the_same_unit_must_be_displaced() -> None:
    shared = model("m", measured("a", 1_000), measured("b", 1_000), unit="uap-llama-server")
    reg = registry([gpu(), cpu()], [shared])
    live = resident("m", "a", gpu_mib=1_000, unit="uap-llama-server")
    result = plan(inputs(reg, [live]), "b")
    # It would fit alongside, but one unit cannot run two configs.
    assert kinds(result.options) == [(OptionKind.DISPLACE, "b", "gpu0")]
    assert result.options[0].signature == ("m/a",)


def test_a_unit_busy_on_another_device_makes_the_candidate_infeasible() -> None:
    shared = model(
        "m", measured("a", 1_000), measured("b", 1_000, on="gpu1"), unit="uap-llama-server"
    )
    reg = registry([gpu("gpu0"), gpu("gpu1"), cpu()], [shared])
    live = resident("m", "a", gpu_mib=1_000, unit="uap-llama-server")
    result = plan(inputs(reg, [live]), "b")
    assert result.reason is PreviewReason.NO_FEASIBLE_OPTION
    assert "gpu1: unit uap-llama-server already runs m/a on gpu0" in result.infeasible


def test_not_in_registry() -> None:
    reg = registry([gpu(), cpu()], [FLASH])
    assert plan(inputs(reg), "nope").reason is PreviewReason.NOT_IN_REGISTRY
    assert plan(inputs(reg), "").reason is PreviewReason.NOT_IN_REGISTRY


def test_cells_must_be_positive() -> None:
    reg = registry([gpu(), cpu()], [FLASH])
    with pytest.raises(ValueError, match="cells"):
        plan(inputs(reg), FLASH.key, 0)


# --------------------------------------------------------------------------- ranking, affinity


def test_ranking_across_every_kind() -> None:
    configs = [
        measured("a", 1_000, on="gpu0"),
        measured("b", 1_000, on="gpu1"),
        measured("c", 20_000, on="gpu2"),
        measured("d", 20_000, on="gpu3"),
    ]
    wanted = model("m", *configs)
    small = model("small", measured("s", 3_000, on="gpu2"))
    large = model("large", measured("l", 9_000, on="gpu3"))
    devices = [gpu("gpu0"), gpu("gpu1"), gpu("gpu2"), gpu("gpu3"), cpu()]
    reg = registry(devices, [wanted, small, large])
    residents = [
        resident("m", "a", "gpu0"),
        resident("large", "l", "gpu3", gpu_mib=9_000),
        resident("small", "s", "gpu2", gpu_mib=3_000),
    ]
    result = plan(inputs(reg, residents), "m")
    assert kinds(result.options) == [
        (OptionKind.REUSE, "a", "gpu0"),
        (OptionKind.LOAD_ALONGSIDE, "b", "gpu1"),
        (OptionKind.DISPLACE, "c", "gpu2"),
        (OptionKind.DISPLACE, "d", "gpu3"),
    ]
    assert [o.frees_mib for o in result.options[2:]] == [3_000, 9_000]
    assert result.to_json()["options"][1]["affinityMatch"] is False


def test_load_alongside_with_affinity_ranks_first() -> None:
    def alongside(device: str, match: bool) -> Option:
        return Option(OptionKind.LOAD_ALONGSIDE, "m", "c", device, 1.0, affinity_match=match)

    displace = Option(OptionKind.DISPLACE, "m", "c", "gpu0", 1.0)
    reuse = Option(OptionKind.REUSE, "m", "c", "gpu9", 0.0)
    ranked = rank_options([displace, alongside("gpu0", False), alongside("gpu1", True), reuse])
    assert [(o.kind, o.device) for o in ranked] == [
        (OptionKind.REUSE, "gpu9"),
        (OptionKind.LOAD_ALONGSIDE, "gpu1"),
        (OptionKind.LOAD_ALONGSIDE, "gpu0"),
        (OptionKind.DISPLACE, "gpu0"),
    ]


def test_affinity_match_definition() -> None:
    pinned = model("m", affinity=("gpu1",), tasks=("code",))
    loose = model("n", tasks=("code",))
    assert affinity_match(pinned, "gpu1") is True
    assert affinity_match(pinned, "gpu0") is False
    assert affinity_match(loose, "gpu0") is False
    assert affinity_match(pinned, "gpu1", task="code") is True
    assert affinity_match(pinned, "gpu1", task="image") is False
    assert affinity_match(loose, "gpu0", task="code") is True


def test_affinity_match_is_reported_on_the_option() -> None:
    stated = model("m", measured("c", 1_000, on="gpu1"), affinity=("gpu1",))
    reg = registry([gpu("gpu0"), gpu("gpu1"), cpu()], [stated])
    (option,) = plan(inputs(reg), "m").options
    assert (option.device, option.affinity_match) == ("gpu1", True)
    (option,) = plan(inputs(reg), "m", task="image").options
    assert option.affinity_match is False


# --------------------------------------------------------------------------- preview


def every_state_on_one_card() -> tuple[Registry, list[Resident]]:
    states = {
        "busy": (ResidentState.HOT, (Holder("claude-code", "inflight"),)),
        "idle": (ResidentState.HOT, ()),
        "warm": (ResidentState.WARMING, ()),
        "paus": (ResidentState.PAUSED, ()),
        "drain": (ResidentState.DRAINING, ()),
    }
    models = [model(k, measured(k, 4_000)) for k in states]
    candidate = model("m", measured("c", 22_528))
    reg = registry([gpu(), cpu()], [*models, candidate])
    residents = [
        resident(k, k, gpu_mib=4_000, state=state, holders=holders)
        for k, (state, holders) in states.items()
    ]
    return reg, residents


def test_preview_consequence_per_victim_state() -> None:
    reg, residents = every_state_on_one_card()
    (option,) = plan(inputs(reg, residents), "m").options
    by_model = {v.model: (v.state, v.in_flight, v.consequence) for v in option.victims}
    assert by_model == {
        "busy": (ResidentState.HOT, True, "active generation aborted; context lost"),
        "idle": (ResidentState.HOT, False, "session idle, context lost, reload needed"),
        "warm": (ResidentState.WARMING, False, "load wasted; VRAM returns on stop"),
        "paus": (ResidentState.PAUSED, False, "already offloaded; restore path lost"),
        "drain": (
            ResidentState.DRAINING,
            False,
            "already draining and idle; the stop completes the drain, reload needed",
        ),
    }
    assert all(v.frees_mib == 4_000 and v.reload_mib == 4_000 for v in option.victims)
    victim_json = option.to_json()["victims"][0]
    assert set(victim_json) == {
        "model", "config", "state", "device", "holders", "in_flight", "frees_mib",
        "consequence", "reload_mib", "action", "serve_again_s", "frees_host_mib", "device_kind",
    }  # fmt: skip
    assert victim_json["action"] == "stop"


def test_in_flight_is_unknown_when_the_proxy_did_not_answer() -> None:
    reg, residents = every_state_on_one_card()
    (option,) = plan(inputs(reg, residents, inflight_known=False), "m").options
    assert {v.in_flight for v in option.victims} == {None}
    hot = [v.consequence for v in option.victims if v.state is ResidentState.HOT]
    assert all("counted as busy" in text for text in hot)


def test_plan_unload_lists_what_the_unload_stops() -> None:
    reg = registry([gpu(), cpu()], [FLASH])
    (victim,) = plan_unload(inputs(reg, [strata_resident()]), "gpt-5.1-codex")
    assert (victim.model, victim.in_flight, victim.frees_mib) == (FLASH.key, False, 21_812)
    assert victim.consequence == "session idle, context lost, reload needed"
    (victim,) = plan_unload(inputs(reg, [strata_resident()], inflight_known=False), FLASH.key)
    assert victim.in_flight is None
    with pytest.raises(KeyError, match="not resident"):
        plan_unload(inputs(reg), FLASH.key)
