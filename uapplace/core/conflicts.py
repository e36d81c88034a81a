"""Which backend units can never be resident together: the ``Conflicts=`` graph, in MiB.

systemd enforces a ``Conflicts=`` edge without asking anyone: starting one unit stops
the other, with no drain and no approval. So an edge is only drawn where the planner
itself would never keep the two together, and both sides use the same arithmetic:
:func:`fits` is the one test of "these footprints fit on this device", called by the
planner for every ``load_alongside`` and by :func:`conflict_edges` for every pair.

Where each unit can be resident (:func:`placements`):

- a config whose figures count on this machine (``Config.is_measured``) sits on its
  ``measured_on`` device (the planner loads it nowhere else, and the unit sync files a
  unit started by hand there), costing its smallest footprint :func:`floor_cost_mib`
  (the cost of a request at or under its resident KV pool: no request costs less).
  Decision: the smallest footprint, not the cost at the default 32,768 cells, because an
  edge claims "never"; where a small request would fit and a default one would not, the
  planner offers a displace (with consent) instead of systemd stopping anything;
- any other config (unmeasured, measured only in the repo file, measured on another
  device or build, or a cost unknown at every context size) may sit on any device the
  model may use (its affinity devices, else every GPU) and counts as that device's
  whole budget (unknown fails closed).

Two units conflict when every way of having both resident puts them on one device
where they do not fit. A unit that could sit on another device than the other one
never conflicts with it: a model with no device affinity on a machine with two GPUs
conflicts with nothing across devices. A CPU device has no GPU budget, so nothing
conflicts there (host RAM is a live reading, checked by the planner at each request,
not a static fact systemd could enforce).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from uapplace.core.model import (
    EXECUTABLE_LEVERS,
    Config,
    Device,
    DeviceKind,
    Model,
    Registry,
    cost_mib,
)

EPSILON_MIB = 1e-6
"""Float noise tolerated when comparing a cost with a budget (cost math makes fractions)."""


# --------------------------------------------------------------------------- the fit test


def gpu_budget_mib(device: Device) -> float | None:
    """What a device can hold with nothing loaded; ``None`` for a device with no GPU budget."""
    if device.kind is not DeviceKind.GPU:
        return None
    return float(device.total_mib - device.reserved_mib)


def gpu_shortfall_mib(device: Device, costs: Iterable[float]) -> float:
    """MiB missing for ``costs`` to be resident together on ``device`` (≤ 0: they fit).

    A device is a sum (docs/placement-rules.md §4.4): ``total − reserved − Σ costs``;
    never a free-memory reading. A CPU device has no GPU budget: nothing is ever
    missing there.
    """
    budget = gpu_budget_mib(device)
    if budget is None:
        return 0.0
    return sum(costs) - budget


def fits(device: Device, costs: Iterable[float]) -> bool:
    """The one fit test: the planner's ``load_alongside`` and the ``Conflicts=`` graph."""
    return gpu_shortfall_mib(device, costs) <= EPSILON_MIB


# --------------------------------------------------------------------------- where units sit


def candidate_devices(registry: Registry, model: Model) -> tuple[str, ...]:
    """The devices a model may load on: its ``affinity_devices``, else every GPU, plus the
    host device (``cpu0``) when one of its configs was measured there (a CPU-only engine,
    placed against host RAM alone; issue 12)."""
    if model.affinity_devices:
        return model.affinity_devices
    gpus = tuple(d.key for d in registry.gpus())
    host = registry.host()
    on_host = host is not None and any(c.measured_on == host.key for c in model.configs.values())
    return (*gpus, host.key) if on_host and host is not None else gpus


def floor_cost_mib(config: Config) -> float | None:
    """The least any request costs with this config resident, or ``None`` when unknown.

    ``cost(config, cells)`` grows with ``cells``, so its least value is at the smallest
    request: the whole resident KV pool is already paid for, ``resident_gpu_mib``.
    """
    return cost_mib(config, max(1, config.kv_resident_cells or 1))


def paused_cost_mib(config: Config) -> float | None:
    """What a config holds on its device while paused (issue 12), ``None`` when it cannot
    pause: a unit whose engine can sleep in place stays resident (its unit active) with
    only this much, so it is never in a ``Conflicts=`` edge that only its awake footprint
    would draw: systemd would otherwise stop a paused engine the moment the unit that
    displaced it starts. The residual is the measured ``resident_gpu_mib −
    sleep_freed_mib`` where the envelope has it, else 0 (fewer edges is the safe side:
    without an edge the planner asks for consent, with one systemd asks no one)."""
    if config.pause_lever not in EXECUTABLE_LEVERS or config.resident_gpu_mib is None:
        return None
    freed = config.envelope.sleep_freed_mib if config.envelope is not None else None
    if freed is None:
        return 0.0
    return max(0.0, config.resident_gpu_mib - freed)


@dataclass(frozen=True)
class Placement:
    """One way a unit can be resident: which config, on which device, for how much.

    ``cost_mib`` is ``None`` when the cost is unknown: it counts as the device's whole
    budget.
    """

    unit: str
    model: str
    config: str
    device: str
    cost_mib: float | None

    def charge(self, device: Device) -> float:
        if self.cost_mib is not None:
            return self.cost_mib
        return gpu_budget_mib(device) or 0.0


def placements(registry: Registry) -> dict[str, tuple[Placement, ...]]:
    """Unit name → every way it can be resident (see the module docstring)."""
    out: dict[str, list[Placement]] = {}
    for model in registry.models.values():
        for config in model.configs.values():
            unit = model.unit_for(config)
            if unit is not None:
                out.setdefault(unit, []).extend(_config_placements(registry, model, config, unit))
    return {unit: tuple(found) for unit, found in out.items()}


def _config_placements(
    registry: Registry, model: Model, config: Config, unit: str
) -> list[Placement]:
    floor = floor_cost_mib(config) if config.is_measured else None
    home = config.measured_on
    if floor is not None and home is not None and home in registry.devices:
        found = [Placement(unit, model.key, config.key, home, floor)]
        paused = paused_cost_mib(config)
        if paused is not None:
            found.append(Placement(unit, model.key, config.key, home, paused))
        return found
    return [
        Placement(unit, model.key, config.key, device, None)
        for device in candidate_devices(registry, model)
        if device in registry.devices
    ]


# --------------------------------------------------------------------------- the graph


def compatible(registry: Registry, one: Placement, other: Placement) -> bool:
    """Whether these two can be resident at the same time."""
    if one.device != other.device:
        return True
    device = registry.devices[one.device]
    return fits(device, (one.charge(device), other.charge(device)))


def units_conflict(
    registry: Registry,
    one: Iterable[Placement],
    other: Iterable[Placement],
) -> bool:
    """True when no placement of one unit can be resident with any placement of the other.

    A unit with no placement at all (no device it could use) conflicts with nothing:
    there is no fact about it to enforce.
    """
    mine, theirs = tuple(one), tuple(other)
    if not mine or not theirs:
        return False
    return not any(compatible(registry, a, b) for a in mine for b in theirs)


def conflict_edges(registry: Registry) -> dict[str, frozenset[str]]:
    """Unit → the units it can never be resident with (symmetric; units with none omitted)."""
    where = placements(registry)
    units = sorted(where)
    edges: dict[str, set[str]] = {}
    for index, unit in enumerate(units):
        for other in units[index + 1 :]:
            if units_conflict(registry, where[unit], where[other]):
                edges.setdefault(unit, set()).add(other)
                edges.setdefault(other, set()).add(unit)
    return {unit: frozenset(others) for unit, others in edges.items()}


def conflicting_units(registry: Registry, unit: str) -> frozenset[str]:
    """The units ``unit`` can never be resident with (one row of :func:`conflict_edges`)."""
    where = placements(registry)
    mine = where.get(unit, ())
    return frozenset(
        other
        for other, theirs in where.items()
        if other != unit and units_conflict(registry, mine, theirs)
    )


def dropin_groups(edges: Mapping[str, Iterable[str]]) -> dict[str, list[str]]:
    """The edges as two-unit groups for :func:`uapplace.io.units.write_conflict_dropins`.

    Each group's members all conflict with each other, so a pair is the honest group:
    ``{"a + b": ["a", "b"]}``.
    """
    pairs = {tuple(sorted((unit, other))) for unit, others in edges.items() for other in others}
    return {f"{a} + {b}": [a, b] for a, b in sorted(pairs)}
