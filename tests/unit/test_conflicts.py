"""The ``Conflicts=`` graph and the planner agree, in MiB (issue 10).

The property tests enumerate registries (hypothesis) and prove both directions:

- every edge is a pair the planner never co-places (no ``load_alongside`` across it,
  whichever of the two is resident and wherever it sits);
- every pair the planner co-places has no edge;
- and the graph is not over-eager: every pair without an edge is either placeable on
  different devices or fits together, and then the planner does offer the second one
  ``load_alongside`` the first.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.worlds import builders
from tests.worlds.builders import MEASURED_AT, cpu_reading, gpu, gpu_reading
from uapplace.core.conflicts import (
    Placement,
    candidate_devices,
    conflict_edges,
    conflicting_units,
    dropin_groups,
    fits,
    floor_cost_mib,
    placements,
)
from uapplace.core.model import (
    Config,
    ConfigStatus,
    Device,
    DeviceReading,
    Model,
    OptionKind,
    Registry,
    Resident,
    ResidentState,
)
from uapplace.core.planner import PlanInput, plan

HOST_MIB = 1_000_000
"""Host RAM is never what binds here: the graph is about GPU MiB only."""


# --------------------------------------------------------------------------- builders


def host() -> Device:
    return builders.cpu(HOST_MIB, 0)


def measured(key: str, mib: float, on: str, unit: str | None = None, **extra: Any) -> Config:
    return builders.measured(key, mib, 100.0, on, unit=unit, **extra)


def model(key: str, unit: str, configs: list[Config], affinity: tuple[str, ...] = ()) -> Model:
    return Model(
        key,
        key.title(),
        "llama.cpp",
        {c.key: c for c in configs},
        unit=unit,
        affinity_devices=affinity,
    )


def registry(devices: list[Device], models: list[Model]) -> Registry:
    return Registry({d.key: d for d in [*devices, host()]}, {m.key: m for m in models})


def readings(reg: Registry) -> dict[str, DeviceReading]:
    out = {d.key: gpu_reading(d.total_mib, d.total_mib, key=d.key) for d in reg.gpus()}
    out["cpu0"] = cpu_reading(HOST_MIB, HOST_MIB)
    return out


def resident_of(m: Model, c: Config, device: str) -> Resident:
    """What the unit sync records for a unit found running (``gpu_mib`` = the figure)."""
    return Resident(
        model=m.key,
        config=c.key,
        device=device,
        engine=m.engine,
        endpoint=None,
        unit=m.unit_for(c),
        state=ResidentState.HOT,
        gpu_mib=c.resident_gpu_mib,
        host_rss_mib=c.host_rss_mib,
        since=MEASURED_AT,
    )


def configs_of(reg: Registry) -> Iterator[tuple[Model, Config, str]]:
    for m in reg.models.values():
        for c in m.configs.values():
            unit = m.unit_for(c)
            if unit is not None:
                yield m, c, unit


def resident_spots(reg: Registry, m: Model, c: Config) -> tuple[str, ...]:
    """Every device a config can be found resident on (the planner or a hand start)."""
    if c.is_measured and c.measured_on is not None and c.measured_on in reg.devices:
        return (c.measured_on,)
    return tuple(candidate_devices(reg, m))


def alongside(reg: Registry, resident: Resident, m: Model, c: Config) -> str | None:
    """The device the planner offers ``c`` ``load_alongside`` ``resident`` on, if any."""
    cells = max(1, c.kv_resident_cells or 1)
    result = plan(PlanInput(reg, (resident,), readings(reg)), c.key, cells)
    return next(
        (
            o.device
            for o in result.options
            if o.kind is OptionKind.LOAD_ALONGSIDE and (o.model, o.config) == (m.key, c.key)
        ),
        None,
    )


# --------------------------------------------------------------------------- generated registries


@st.composite
def registries(draw: st.DrawFn) -> Registry:
    gpu_count = draw(st.integers(1, 2))
    devices = [
        gpu(
            f"gpu{i}",
            draw(st.sampled_from([8_192, 16_384, 24_576])),
            draw(st.sampled_from([0, 512, 2_048])),
        )
        for i in range(gpu_count)
    ]
    keys = [d.key for d in devices]
    models: list[Model] = []
    config_no = 0
    for index in range(draw(st.integers(2, 4))):
        affinity = draw(st.sampled_from([(), *[(k,) for k in keys], tuple(keys)]))
        configs: list[Config] = []
        for _ in range(draw(st.integers(1, 2))):
            config_no += 1
            key = f"c{config_no}"
            own_unit = draw(st.sampled_from([None, None, f"uap-c{config_no}"]))
            kind = draw(st.sampled_from(["measured", "measured", "unmeasured", "repo-only"]))
            if kind == "unmeasured":
                configs.append(Config(key, ConfigStatus.UNMEASURED, unit=own_unit))
                continue
            mib = draw(st.integers(1, 24)) * 1_000 + draw(st.sampled_from([0, 0.5]))
            on = draw(st.sampled_from(keys))
            small_pool = draw(st.booleans())
            extra: dict[str, object] = (
                {"kv_resident_cells": 4_096, "kv_mib_per_1k_cells": 50.0} if small_pool else {}
            )
            if kind == "repo-only":
                extra["untrusted"] = "measured only in the repo file"
            configs.append(measured(key, mib, on, own_unit, **extra))
        unit = draw(st.sampled_from([f"uap-m{index}", f"uap-m{index}", "uap-shared"]))
        models.append(model(f"m{index}", unit, configs, affinity))
    return registry(devices, models)


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- properties


@PROPERTY
@given(registries())
def test_every_edge_is_a_pair_the_planner_never_co_places(reg: Registry) -> None:
    edges = conflict_edges(reg)
    for m_res, c_res, u_res in configs_of(reg):
        for m_new, c_new, u_new in configs_of(reg):
            if u_new not in edges.get(u_res, frozenset()):
                continue
            for spot in resident_spots(reg, m_res, c_res):
                offered = alongside(reg, resident_of(m_res, c_res, spot), m_new, c_new)
                assert offered is None, (u_res, u_new, spot, offered)


@PROPERTY
@given(registries())
def test_every_pair_the_planner_co_places_has_no_edge(reg: Registry) -> None:
    edges = conflict_edges(reg)
    for m_res, c_res, u_res in configs_of(reg):
        for m_new, c_new, u_new in configs_of(reg):
            if u_res == u_new:
                continue
            for spot in resident_spots(reg, m_res, c_res):
                if alongside(reg, resident_of(m_res, c_res, spot), m_new, c_new) is not None:
                    assert u_new not in edges.get(u_res, frozenset()), (u_res, u_new)


@PROPERTY
@given(registries())
def test_a_pair_without_an_edge_can_really_be_resident_together(reg: Registry) -> None:
    """Not over-eager: an edge makes systemd stop a model without a yes, so none is
    drawn where the two fit; where both are placed by the planner on one device and fit,
    the planner offers the second alongside the first."""
    edges = conflict_edges(reg)
    where = placements(reg)
    for unit, mine in where.items():
        for other, theirs in where.items():
            if unit >= other or other in edges.get(unit, frozenset()):
                continue
            assert any(_together(reg, a, b) for a in mine for b in theirs), (unit, other)
            for a in mine:
                for b in theirs:
                    if a.device == b.device and _planner_pair(reg, a, b):
                        _assert_offered(reg, a, b)


@PROPERTY
@given(registries())
def test_the_graph_is_symmetric_and_matches_each_row(reg: Registry) -> None:
    edges = conflict_edges(reg)
    for unit, others in edges.items():
        assert unit not in others
        for other in others:
            assert unit in edges[other]
    for unit in placements(reg):
        assert conflicting_units(reg, unit) == edges.get(unit, frozenset())


@PROPERTY
@given(registries())
def test_a_unit_that_can_sit_on_two_devices_conflicts_with_nothing(reg: Registry) -> None:
    edges = conflict_edges(reg)
    for unit, found in placements(reg).items():
        if len({p.device for p in found}) > 1:
            assert unit not in edges


def _together(reg: Registry, a: Placement, b: Placement) -> bool:
    if a.device != b.device:
        return True
    device = reg.devices[a.device]
    return fits(device, (a.charge(device), b.charge(device)))


def _planner_pair(reg: Registry, a: Placement, b: Placement) -> bool:
    """Both measured here, and the planner may load ``b``'s config on its device."""
    m_b = reg.models[b.model]
    c_a, c_b = reg.models[a.model].configs[a.config], m_b.configs[b.config]
    return (
        a.cost_mib is not None
        and b.cost_mib is not None
        and c_a.is_measured
        and c_b.is_measured
        and b.device in candidate_devices(reg, m_b)
        and (a.model, a.config) != (b.model, b.config)
        and fits(reg.devices[a.device], (a.cost_mib, b.cost_mib))
    )


def _assert_offered(reg: Registry, a: Placement, b: Placement) -> None:
    m_a, m_b = reg.models[a.model], reg.models[b.model]
    c_a, c_b = m_a.configs[a.config], m_b.configs[b.config]
    resident = replace(resident_of(m_a, c_a, a.device), gpu_mib=floor_cost_mib(c_a))
    assert alongside(reg, resident, m_b, c_b) == b.device, (a, b)


# --------------------------------------------------------------------------- named cases


def two_gpu_machine() -> list[Device]:
    return [gpu("gpu0", 24_576, 2_048), gpu("gpu1", 24_576, 1_024)]


def test_two_models_that_fit_together_do_not_conflict() -> None:
    reg = registry(
        two_gpu_machine(),
        [
            model("a", "uap-a", [measured("a1", 9_000, "gpu0")], ("gpu0",)),
            model("b", "uap-b", [measured("b1", 12_000, "gpu0")], ("gpu0",)),
        ],
    )
    assert conflict_edges(reg) == {}
    a, b = reg.models["a"], reg.models["b"]
    assert alongside(reg, resident_of(a, a.configs["a1"], "gpu0"), b, b.configs["b1"]) == "gpu0"


def test_two_models_that_cannot_fit_conflict_both_ways() -> None:
    reg = registry(
        two_gpu_machine(),
        [
            model("a", "uap-a", [measured("a1", 12_000, "gpu0")], ("gpu0",)),
            model("b", "uap-b", [measured("b1", 12_000, "gpu0")], ("gpu0",)),
        ],
    )
    assert conflict_edges(reg) == {"uap-a": {"uap-b"}, "uap-b": {"uap-a"}}
    assert dropin_groups(conflict_edges(reg)) == {"uap-a + uap-b": ["uap-a", "uap-b"]}


def test_exactly_the_budget_fits_and_one_mib_more_conflicts() -> None:
    budget = 24_576 - 2_048
    fitting = registry(
        two_gpu_machine(),
        [
            model("a", "uap-a", [measured("a1", budget - 10_000, "gpu0")], ("gpu0",)),
            model("b", "uap-b", [measured("b1", 10_000, "gpu0")], ("gpu0",)),
        ],
    )
    assert conflict_edges(fitting) == {}
    over = registry(
        two_gpu_machine(),
        [
            model("a", "uap-a", [measured("a1", budget - 10_000 + 1, "gpu0")], ("gpu0",)),
            model("b", "uap-b", [measured("b1", 10_000, "gpu0")], ("gpu0",)),
        ],
    )
    assert set(conflict_edges(over)) == {"uap-a", "uap-b"}


def test_models_on_different_devices_never_conflict() -> None:
    reg = registry(
        two_gpu_machine(),
        [
            model("a", "uap-a", [measured("a1", 20_000, "gpu0")], ("gpu0",)),
            model("b", "uap-b", [measured("b1", 20_000, "gpu1")], ("gpu1",)),
        ],
    )
    assert conflict_edges(reg) == {}


def test_an_unmeasured_model_takes_its_whole_device() -> None:
    reg = registry(
        two_gpu_machine(),
        [
            model("a", "uap-a", [measured("a1", 1_000, "gpu0")], ("gpu0",)),
            model("u", "uap-u", [Config("u1", ConfigStatus.UNMEASURED)], ("gpu0",)),
            model("g", "uap-g", [measured("g1", 20_000, "gpu1")], ("gpu1",)),
        ],
    )
    assert conflict_edges(reg) == {"uap-a": {"uap-u"}, "uap-u": {"uap-a"}}


def test_a_model_without_device_affinity_conflicts_with_nothing_across_devices() -> None:
    reg = registry(
        two_gpu_machine(),
        [
            model("free", "uap-free", [Config("f1", ConfigStatus.UNMEASURED)]),
            model("a", "uap-a", [measured("a1", 20_000, "gpu0")], ("gpu0",)),
            model("b", "uap-b", [measured("b1", 20_000, "gpu1")], ("gpu1",)),
        ],
    )
    assert conflict_edges(reg) == {}


def test_repo_only_figures_count_as_the_whole_device() -> None:
    """Figures that do not count on this machine are unknown: the whole budget."""
    untrusted = measured("a1", 1_000, "gpu0", untrusted="measured only in the repo file")
    reg = registry(
        two_gpu_machine(),
        [
            model("a", "uap-a", [untrusted], ("gpu0",)),
            model("b", "uap-b", [measured("b1", 1_000, "gpu0")], ("gpu0",)),
        ],
    )
    assert conflict_edges(reg) == {"uap-a": {"uap-b"}, "uap-b": {"uap-a"}}


def test_the_smallest_request_decides_not_the_default_one() -> None:
    """A config whose pool is smaller than the default request costs more at 32768 cells:
    the edge is drawn only if even its smallest footprint cannot fit."""
    grows = measured("a1", 10_000, "gpu0", kv_resident_cells=4_096, kv_mib_per_1k_cells=200.0)
    reg = registry(
        two_gpu_machine(),
        [
            model("a", "uap-a", [grows], ("gpu0",)),
            model("b", "uap-b", [measured("b1", 12_000, "gpu0")], ("gpu0",)),
        ],
    )
    assert conflict_edges(reg) == {}


def test_the_planner_makes_a_resident_across_an_edge_a_victim() -> None:
    """A resident whose ledger figure is smaller than its measurement still conflicts:
    systemd would stop it, so the operator must see it as a victim."""
    reg = registry(
        two_gpu_machine(),
        [
            model("a", "uap-a", [measured("a1", 12_000, "gpu0")], ("gpu0",)),
            model("b", "uap-b", [measured("b1", 12_000, "gpu0")], ("gpu0",)),
        ],
    )
    small = replace(resident_of(reg.models["a"], reg.models["a"].configs["a1"], "gpu0"))
    small = replace(small, gpu_mib=1_000.0)
    result = plan(PlanInput(reg, (small,), readings(reg)), "b1")
    assert [o.kind for o in result.options] == [OptionKind.DISPLACE]
    assert [v.model for v in result.options[0].victims] == ["a"]
