"""Placement options for one requested id, and the impact preview (spec §4.4, §4.5).

``plan`` answers "what can this machine do for <id> right now": reuse a
resident, load a measured config alongside what is loaded, or displace a
minimal set of residents. Every rejected candidate gets one human line naming
the device and the number that failed, so the operator can see why.

Rules that are easy to get wrong, all fail-closed:

- The GPU budget is a sum: ``total − reserved − Σ gpu_mib of everything that
  stays loaded``. A free-memory reading is never the budget; a probe is only
  used to tell whether a device is there at all (``source=absent``).
- A resident with an unknown ``gpu_mib`` makes its device's budget unknown:
  nothing loads on that device, and it is never a victim.
- Only measured configs (``Config.is_measured``) whose ``measured_on`` names
  the candidate device are loaded. Unmeasured residents may be reused, never
  displaced.
- Host RAM is a hard gate on ``cpu0``: the config's ``host_rss_mib`` must fit
  in the probe's MemAvailable, plus what the victims free, minus the host
  reserve.
- A resident held on the bus (a ``hold`` holder) is never a victim.
- Two residents cannot share one systemd unit: a resident that runs the
  candidate's unit on the same device must be among the victims, and one on
  another device makes the candidate infeasible.

``paused`` residents are not offered for reuse: a paused resident cannot serve
a request (admission does not forward to it either), so "reuse" would promise
a forward that never comes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from uapplace.conflicts import (
    EPSILON_MIB,
    candidate_devices,
    conflicting_units,
    fits,
    gpu_shortfall_mib,
)
from uapplace.model import (
    DEFAULT_CELLS,
    EXECUTABLE_LEVERS,
    Config,
    Device,
    DeviceKind,
    DeviceReading,
    Model,
    Option,
    OptionKind,
    Plan,
    PreviewReason,
    ProbeSource,
    Registry,
    Resident,
    ResidentState,
    Victim,
    VictimAction,
    cost_mib,
)
from uapplace.topology import same_endpoint

_EPSILON_MIB = EPSILON_MIB

_NOT_SERVING = (ResidentState.DRAINING, ResidentState.PAUSED)


@dataclass(frozen=True)
class PlanInput:
    """Everything ``plan`` reads: the registry, the ledger's residents, the probes.

    ``residents`` carry their ``holders`` (proxy in-flight requests, kind
    ``inflight``, and bus holds, kind ``hold``). ``inflight_known=False`` means
    the proxy did not answer: every victim's ``in_flight`` is then ``None``.
    """

    registry: Registry
    residents: Sequence[Resident]
    readings: Mapping[str, DeviceReading]
    inflight_known: bool = True


# --------------------------------------------------------------------------- public entry points


def plan(
    inp: PlanInput, requested: str, cells: int = DEFAULT_CELLS, task: str | None = None
) -> Plan:
    """The ranked options for ``requested`` at ``cells`` of context (spec §4.4).

    ``task`` (``code``, ``general``…) is optional: the admit path carries none.
    It only affects ``affinity_match`` on ``load_alongside`` options; see
    :func:`affinity_match`.
    """
    if cells <= 0:
        raise ValueError(f"cells: must be a positive integer, got {cells}")
    reuse = tuple(_reuse_options(inp, requested))
    resolved = inp.registry.resolve(requested) if requested else None
    if resolved is None:
        reason = PreviewReason.OK if reuse else PreviewReason.NOT_IN_REGISTRY
        return Plan(requested, reason, reuse, ())
    model, pinned = resolved
    configs = (pinned,) if pinned is not None else tuple(model.configs.values())
    infeasible = [_unmeasured_line(model, c) for c in configs if not c.is_measured]
    measured = [c for c in configs if c.is_measured]
    search = _Search(inp, requested, cells, task, model)
    options = list(reuse)
    for config in measured:
        for device_key in candidate_devices(inp.registry, model):
            for outcome in search.place(config, device_key):
                if isinstance(outcome, Option):
                    options.append(outcome)
                else:
                    infeasible.append(outcome)
    ranked = rank_options(options)
    if ranked:
        reason = PreviewReason.OK
    elif not measured:
        reason = PreviewReason.NO_MEASURED_CONFIG
    else:
        reason = PreviewReason.NO_FEASIBLE_OPTION
    return Plan(requested, reason, ranked, tuple(infeasible))


def _unmeasured_line(model: Model, config: Config) -> str:
    label = f"{model.key}/{config.key}"
    if config.untrusted:
        return f"{label}: no measurement counts on this machine: {config.untrusted}"
    return f"{label}: unmeasured; never loaded until a measurement is recorded"


def plan_unload(inp: PlanInput, model: str) -> tuple[Victim, ...]:
    """The residents an ``Unload(model)`` would stop, as preview victims.

    ``model`` is matched like a request: model key, config key or advertised
    id. Raises ``KeyError`` when nothing resident matches.
    """
    matched = [r for r in inp.residents if serves(inp.registry, r, model)]
    if not matched:
        raise KeyError(f"{model!r} is not resident")
    matched.sort(key=lambda r: (r.signature, r.device))
    return tuple(victim_of(inp.registry, r, inp.inflight_known) for r in matched)


def rank_options(options: Iterable[Option]) -> tuple[Option, ...]:
    """Spec §4.4 order: reuse > wake with nothing to displace > load_alongside with
    affinity > load_alongside > displace (and wake needing room) freeing the fewest
    MiB > … > the most. Ties: fewer victims, then device and config key, so the
    order is deterministic.

    The stop and pause forms of one displacement (issue 12) share every key but the
    last: MiB are counted as what *stopping* the victims would free
    (:func:`displaced_mib`), so the two forms sit next to each other, ordered by
    ``Option.form_rank``: the expected time until the victims serve again where
    the envelopes measure it, else pause before stop.
    """

    def key(option: Option) -> tuple[int, int, float, int, str, str, str, str, float]:
        kind = option.kind.value
        if option.kind is OptionKind.REUSE:
            return (0, 0, 0.0, 0, option.device, option.model, option.config, kind, 0.0)
        if option.kind is OptionKind.WAKE and not option.victims:
            return (1, 0, 0.0, 0, option.device, option.model, option.config, kind, 0.0)
        if option.kind is OptionKind.LOAD_ALONGSIDE:
            rank = 0 if option.affinity_match else 1
            return (2, rank, 0.0, 0, option.device, option.model, option.config, kind, 0.0)
        return (
            3,
            0,
            displaced_mib(option),
            len(option.victims),
            option.device,
            option.model,
            option.config,
            kind,
            option.form_rank,
        )

    return tuple(sorted(options, key=key))


def displaced_mib(option: Option) -> float:
    """What stopping every victim of ``option`` would free: the ranking's MiB, the same
    for an option's stop and pause forms."""
    return sum(v.frees_mib + v.residual_mib for v in option.victims)


def affinity_match(model: Model, device_key: str, task: str | None = None) -> bool:
    """Whether loading ``model`` on ``device_key`` matches the model's stated affinity.

    With a ``task``: the model lists it in ``task_affinity`` and the device is
    one of its ``affinity_devices`` (or the model names none). Without one (the
    admit path carries no task): the device is one of the model's
    ``affinity_devices``, so a model that states no device affinity matches
    nothing. Since every option of one plan is for one model, the flag mostly
    tells the operator whether the placement follows the registry's stated
    preference; the ranking still puts matching options first.
    """
    on_device = device_key in model.affinity_devices
    if task is None:
        return on_device
    return task in model.task_affinity and (on_device or not model.affinity_devices)


__all__ = ["PlanInput", "candidate_devices", "minimal_eviction", "plan", "plan_unload"]


# --------------------------------------------------------------------------- residents


def model_of(registry: Registry, resident: Resident) -> Model | None:
    """The registry model a resident runs (its ``model`` is normally the model key)."""
    found = registry.models.get(resident.model)
    if found is not None:
        return found
    resolved = registry.resolve(resident.model)
    return resolved[0] if resolved is not None else None


def config_of(registry: Registry, resident: Resident) -> Config | None:
    model = model_of(registry, resident)
    return model.configs.get(resident.config) if model is not None else None


def serves(registry: Registry, resident: Resident, model_id: str) -> bool:
    """CONTRACT.md §1: the id is the resident's model key, its config key or an advertised id."""
    if not model_id:
        return False
    if model_id in (resident.model, resident.config):
        return True
    model = model_of(registry, resident)
    return model is not None and model_id in model.advertises


def holds(resident: Resident) -> list[str]:
    """``held by <app_id>: <reason>`` for each bus hold on the resident."""
    return [
        f"held by {h.client}: {h.detail}" if h.detail else f"held by {h.client}"
        for h in resident.holders
        if h.kind == "hold"
    ]


def in_flight(resident: Resident, inflight_known: bool) -> bool | None:
    """``None`` when the proxy did not answer (unknown counts as busy, never idle)."""
    if not inflight_known:
        return None
    return any(h.kind == "inflight" for h in resident.holders)


def consequence(state: ResidentState, busy: bool | None) -> str:
    """Spec §4.5: what stopping a resident in ``state`` costs its users."""
    if state is ResidentState.HOT:
        if busy is True:
            return "active generation aborted; context lost"
        if busy is None:
            return (
                "in-flight work unknown (the proxy did not answer), counted as busy: "
                "an active generation may be aborted; context lost"
            )
        return "session idle, context lost, reload needed"
    if state is ResidentState.WARMING:
        return "load wasted; VRAM returns on stop"
    if state is ResidentState.PAUSED:
        return "already offloaded; restore path lost"
    if busy is True:
        return "already draining; stopping now aborts the generation still in flight; context lost"
    if busy is None:
        return (
            "already draining; in-flight work unknown (the proxy did not answer), counted as "
            "busy: a generation may be aborted; context lost"
        )
    return "already draining and idle; the stop completes the drain, reload needed"


def pause_consequence(level: int, busy: bool | None) -> str:
    """The §4.5 table's ``pause`` row (issue 12): KV and context are lost either way;
    what differs from a stop is where the weights go and how the model comes back."""
    if busy is True:
        first = "active generation aborted; context lost"
    elif busy is None:
        first = (
            "in-flight work unknown (the proxy did not answer), counted as busy: "
            "an active generation may be aborted; context lost"
        )
    else:
        first = "session idle, context lost"
    if level == 1:
        return f"{first}; paused: weights offloaded to host RAM, wake needed (no reload)"
    return f"{first}; paused: weights discarded, wake reloads them from disk"


CONSEQUENCES: tuple[tuple[str, str, str, str], ...] = (
    ("hot", "stop", "yes", "active generation aborted; context lost"),
    ("hot", "stop", "no", "session idle, context lost, reload needed"),
    ("hot", "pause (level 1)", "no", pause_consequence(1, False)),
    ("hot", "pause (level 2)", "no", pause_consequence(2, False)),
    ("warming", "stop", "—", "load wasted; VRAM returns on stop"),
    ("paused", "stop", "—", "already offloaded; restore path lost"),
)
"""Spec §4.5's consequence table with the ``pause`` rows (state, action, in flight,
consequence); :func:`consequence` and :func:`pause_consequence` compute each cell.
Only a ``hot`` resident is ever paused: a warming one has nothing to offload yet,
a paused one is paused already, a draining one is being stopped."""


def envelope_figure(config: Config | None, name: str) -> float | None:
    """One figure of a config's measured enforcement envelope (``model.Envelope``:
    ``stop_s``, ``free_s``, ``cold_start_s``, ``warm_start_s``, ``sleep_s``,
    ``sleep_freed_mib``, ``wake_s``), ``None`` when unmeasured. ``cold_start_s`` falls
    back to the config's measured ``start_s``."""
    if config is None:
        return None
    value = getattr(config.envelope, name, None) if config.envelope is not None else None
    if value is None and name == "cold_start_s":
        value = config.start_s
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


def pause_level(registry: Registry, resident: Resident) -> int | None:
    """The sleep level enforcement would pause ``resident`` with, ``None`` when it cannot
    be paused: only a ``hot`` resident whose config declares an executable lever
    (:data:`~uapplace.model.EXECUTABLE_LEVERS`), measured for this machine, with an
    endpoint to send the sleep to."""
    config = config_of(registry, resident)
    if config is None or config.pause_lever not in EXECUTABLE_LEVERS:
        return None
    if resident.state is not ResidentState.HOT or resident.endpoint is None:
        return None
    return config.sleep_level


def pause_figures(config: Config | None, resident: Resident, level: int) -> tuple[float, float]:
    """(GPU MiB a pause frees, host MiB it moves into the process).

    Frees the envelope's measured ``sleep_freed_mib`` when there is one, else the
    resident's whole footprint (``gpu_mib``): the residual CUDA context is then
    unknown and counted as zero, which the verify-free probe checks after the sleep.
    Level 1 moves the weights to host RAM: ``sleep_freed_mib`` when measured, else
    the config's ``resident_gpu_mib`` as the offloaded-weights figure (it includes
    the KV pool, which is discarded, so this over-counts: fail-closed for the host
    gate). Level 2 discards the weights: the host does not grow.
    """
    held = resident.gpu_mib or 0.0
    measured = envelope_figure(config, "sleep_freed_mib")
    freed = min(held, measured) if measured is not None else held
    if level != 1:
        return freed, 0.0
    weights = measured if measured is not None else (config.resident_gpu_mib if config else None)
    return freed, float(weights if weights is not None else held)


def _seconds(value: float | None) -> str:
    return f"{value:.1f} s" if value is not None else "unmeasured"


def victim_of(
    registry: Registry,
    resident: Resident,
    inflight_known: bool,
    action: VictimAction = "stop",
) -> Victim:
    """The preview victim for ``resident``: stopped, or paused (``action="pause"``,
    only where :func:`pause_level` allows). Each carries what the other action would
    cost (``alternative``) where it has one."""
    busy = in_flight(resident, inflight_known)
    config = config_of(registry, resident)
    level = pause_level(registry, resident)
    cold = envelope_figure(config, "cold_start_s")
    wake = envelope_figure(config, "wake_s")
    freed, grows = pause_figures(config, resident, level) if level is not None else (0.0, 0.0)
    if action == "pause":
        if level is None:
            raise ValueError(f"{resident.signature}: cannot be paused (no executable lever)")
        text = pause_consequence(level, busy)
        held = _fmt(resident.gpu_mib or 0.0)
        alternative = f"stopping instead: reload ≈ {_seconds(cold)}, frees {held} MiB"
    else:
        text = consequence(resident.state, busy)
        alternative = ""
        if level is not None:
            host = f", host RAM +{_fmt(grows)} MiB" if grows else ""
            alternative = f"pausing instead: wake ≈ {_seconds(wake)}, frees {_fmt(freed)} MiB{host}"
    if resident.gpu_mib is None:
        text += "; VRAM it frees is unknown (footprint not measured)"
    reload_mib = config.resident_gpu_mib if config is not None and config.is_measured else None
    paused = action == "pause"
    return Victim(
        model=resident.model,
        config=resident.config,
        state=resident.state,
        device=resident.device,
        holders=resident.holders,
        in_flight=busy,
        frees_mib=freed if paused else resident.gpu_mib or 0.0,
        consequence=text,
        reload_mib=reload_mib if reload_mib is not None else resident.gpu_mib,
        action=action,
        serve_again_s=wake if paused else cold,
        residual_mib=max(0.0, (resident.gpu_mib or 0.0) - freed) if paused else 0.0,
        host_grows_mib=grows if paused else 0.0,
        alternative=alternative,
    )


def _reuse_options(inp: PlanInput, requested: str) -> list[Option]:
    return [
        Option(OptionKind.REUSE, r.model, r.config, r.device, cost_mib=0.0)
        for r in inp.residents
        if r.state not in _NOT_SERVING and serves(inp.registry, r, requested)
    ]


# --------------------------------------------------------------------------- minimal eviction set


@dataclass(frozen=True)
class EvictionItem:
    """One eligible victim in integer MiB: what it frees on the GPU and on the host."""

    resident: Resident
    gpu_mib: int
    host_mib: int


def minimal_eviction(
    items: Sequence[EvictionItem], need_gpu: int, need_host: int = 0
) -> tuple[EvictionItem, ...] | None:
    """The exact minimal set freeing ``≥ need_gpu`` GPU MiB and ``≥ need_host`` host MiB.

    Minimal means, in order: the fewest GPU MiB freed, then the fewest victims,
    then the lexically smallest sorted list of ``model/config`` signatures.
    ``()`` when nothing needs freeing, ``None`` when even every item together
    is not enough. Fractions are the caller's business: pass what each victim
    frees rounded down and the need rounded up.

    Both methods below are exact subset-sum searches over integer MiB; neither
    is greedy (largest-first and smallest-first both miss the optimum).
    """
    need_gpu = max(0, need_gpu)
    need_host = max(0, need_host)
    if need_gpu == 0 and need_host == 0:
        return ()
    ordered = sorted(items, key=lambda it: (it.resident.signature, it.resident.device))
    if need_host == 0:
        chosen = _fewest_mib_bitsets([it.gpu_mib for it in ordered], need_gpu)
    else:
        chosen = _fewest_mib_states(ordered, need_gpu, need_host)
    return None if chosen is None else tuple(ordered[i] for i in chosen)


def _lowest_bit_from(bits: int, start: int) -> int | None:
    high = bits >> start
    return None if high == 0 else start + (high & -high).bit_length() - 1


def _fewest_mib_bitsets(weights: Sequence[int], need: int) -> tuple[int, ...] | None:
    """GPU need only: reachable sums as integer bitsets, layered by victim count.

    ``layers[k]`` has bit ``s`` set when some k items sum to exactly ``s``. Only
    sums below ``need + max weight`` matter (a minimal set minus any member
    falls short), which bounds every bitset. First pass: the smallest sum
    ``≥ need`` and the fewest items reaching it. Second pass: the same layers
    over each suffix ``items[i:]``, so the lexically first set is picked item by
    item. Cost: O(n²) shifts of (need + max weight)-bit integers, each a few
    hundred machine words on a 24 GiB card: well under a millisecond for 64
    residents, and independent of how the sums are spread.
    """
    if not weights:
        return None
    width = need + max(weights)
    mask = (1 << width) - 1
    layers = [1] + [0] * len(weights)
    for weight in weights:
        for count in range(len(weights), 0, -1):
            layers[count] |= (layers[count - 1] << weight) & mask
    reach = 0
    for layer in layers:
        reach |= layer
    target = _lowest_bit_from(reach, need)
    if target is None:
        return None
    fewest = next(k for k, layer in enumerate(layers) if layer >> target & 1)
    # suffix[i][k]: sums of exactly k items among weights[i:], for k ≤ fewest.
    suffix = [[1] + [0] * fewest]
    for weight in reversed(weights):
        after = suffix[-1]
        here = [after[0]] + [
            after[k] | ((after[k - 1] << weight) & mask) for k in range(1, fewest + 1)
        ]
        suffix.append(here)
    suffix.reverse()
    chosen: list[int] = []
    left, count = target, fewest
    for index, weight in enumerate(weights):
        if count == 0:
            break
        if weight <= left and suffix[index + 1][count - 1] >> (left - weight) & 1:
            chosen.append(index)
            left -= weight
            count -= 1
    return tuple(chosen)


def _fewest_mib_states(
    ordered: Sequence[EvictionItem], need_gpu: int, need_host: int
) -> tuple[int, ...] | None:
    """GPU and host need: a dynamic programme over (GPU MiB, host MiB capped at the need).

    Items come in signature order, so adding one appends it to every set's
    sorted signature list and keeps the (count, lexical) order between two
    sets: keeping only the best set per state is exact. A set meeting both
    needs is finished and never extended (a superset frees more); a set that
    can no longer reach the need, or frees more GPU MiB than the best finished
    one, is dropped. Cost: O(n · S) for S ≤ min(2ⁿ, (need_gpu + max weight) ·
    (need_host + 1)) states. It only runs when host RAM is short, which with a
    handful of residents per device stays in milliseconds; it grows
    exponentially past about 20 residents on one device.
    """
    left_gpu = list(itertools.accumulate(reversed([it.gpu_mib for it in ordered]), initial=0))
    left_host = list(itertools.accumulate(reversed([it.host_mib for it in ordered]), initial=0))
    left_gpu.reverse()
    left_host.reverse()
    # (gpu freed, host freed capped at the need) -> (victim count, indices)
    states: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {(0, 0): (0, ())}
    best: tuple[int, int, tuple[int, ...]] | None = None
    for index, item in enumerate(ordered):
        for (gpu, host), (count, chosen) in list(states.items()):
            if (
                gpu + left_gpu[index] < need_gpu
                or host + left_host[index] < need_host
                or (best is not None and gpu > best[0])
            ):
                del states[(gpu, host)]
                continue
            key = (gpu + item.gpu_mib, min(need_host, host + item.host_mib))
            grown = (count + 1, (*chosen, index))
            if key[0] >= need_gpu and key[1] >= need_host:
                if best is None or (key[0], *grown) < best:
                    best = (key[0], *grown)
                continue
            current = states.get(key)
            if current is None or grown < current:
                states[key] = grown
    return None if best is None else best[2]


# --------------------------------------------------------------------------- one candidate


def _fmt(mib: float) -> str:
    """MiB for a human: integers bare, fractions to the spec's three decimals."""
    rounded = round(mib, 3)
    return str(int(rounded)) if float(rounded).is_integer() else f"{rounded:.3f}"


def _ceil_mib(mib: float) -> int:
    return math.ceil(mib - _EPSILON_MIB)


@dataclass(frozen=True)
class _Budget:
    """One device's arithmetic for one candidate."""

    device: Device
    host: Device
    host_free_mib: float
    cost: float
    on_device: tuple[Resident, ...]

    @property
    def gpu_loaded(self) -> float:
        return sum(r.gpu_mib or 0.0 for r in self.on_device)

    @property
    def gpu_room(self) -> float:
        """What is left for the candidate with everything on the device staying loaded."""
        return self.device.total_mib - self.device.reserved_mib - self.gpu_loaded

    @property
    def gpu_need(self) -> float:
        """MiB the victims must free on the device; a CPU device has no GPU budget.

        The same arithmetic as the ``Conflicts=`` graph (:mod:`uapplace.conflicts`).
        """
        loaded = tuple(r.gpu_mib or 0.0 for r in self.on_device)
        return gpu_shortfall_mib(self.device, (*loaded, self.cost))

    @property
    def fits_alongside(self) -> bool:
        """Everything on the device stays loaded and the candidate still fits."""
        loaded = tuple(r.gpu_mib or 0.0 for r in self.on_device)
        return fits(self.device, (*loaded, self.cost))

    @property
    def host_room(self) -> float:
        return self.host_free_mib - self.host.reserved_mib


class _Search:
    """The candidates of one plan: shared inputs, one ``place`` per (config, device)."""

    def __init__(
        self, inp: PlanInput, requested: str, cells: int, task: str | None, model: Model
    ) -> None:
        self.inp = inp
        self.registry = inp.registry
        self.requested = requested
        self.cells = cells
        self.task = task
        self.model = model
        self._edges: dict[str, frozenset[str]] = {}

    def place(self, config: Config, device_key: str) -> list[Option | str]:
        """The options for one (config, device), and a line for each form that failed;
        empty when reuse already covers it.

        A ``paused`` resident of this very config is woken in place (``wake``) on its
        own device (where its config's lever is executable; a paused resident without
        one is the display state of spec §4.2 and is not woken), never loaded a second
        time: its budget counts the other residents
        plus the config's full cost (the paused process's residual is part of that
        cost once awake), and it needs no host RAM (waking moves weights *out* of the
        host, or back from disk into the GPU).
        """
        label = f"{self.model.key}/{config.key}"
        twin = self._same_config_resident(config)
        wake: Resident | None = None
        if twin is not None:
            wakeable = twin.state is ResidentState.PAUSED and config.sleep_level is not None
            if wakeable and twin.device == device_key:
                wake = twin
            elif wakeable or twin.state not in _NOT_SERVING:
                return []
            else:
                return [
                    f"{device_key}: {label} is already resident on {twin.device} ({twin.state})"
                ]
        budget = self._budget(config, device_key, label, wake)
        if isinstance(budget, str):
            return [budget]
        required, clash = self._unit_clash(config, device_key, wake)
        if clash is not None:
            return [f"{device_key}: {clash}"]
        port_owners, clash = self._port_clash(device_key, wake)
        if clash is not None:
            return [f"{device_key}: {clash}"]
        required += [r for r in port_owners if r not in required]
        gpu_need = budget.gpu_need
        host_rss = 0.0 if wake else config.host_rss_mib or 0.0
        host_need = host_rss - budget.host_room
        if budget.fits_alongside and host_need <= _EPSILON_MIB and not required:
            if wake is not None:
                return [self._option(OptionKind.WAKE, config, budget, ())]
            return [
                Option(
                    OptionKind.LOAD_ALONGSIDE,
                    self.model.key,
                    config.key,
                    device_key,
                    budget.cost,
                    affinity_match=affinity_match(self.model, device_key, self.task),
                    expected_s=envelope_figure(config, "cold_start_s"),
                )
            ]
        kind = OptionKind.WAKE if wake is not None else OptionKind.DISPLACE
        return self._displace(config, label, budget, required, gpu_need, host_need, kind)

    def _option(
        self,
        kind: OptionKind,
        config: Config,
        budget: _Budget,
        victims: tuple[Victim, ...],
        form_rank: float = 0.0,
    ) -> Option:
        return Option(
            kind,
            self.model.key,
            config.key,
            budget.device.key,
            budget.cost,
            victims,
            expected_s=self._expected_s(kind, config, victims),
            form_rank=form_rank,
        )

    def _expected_s(
        self, kind: OptionKind, config: Config, victims: Sequence[Victim]
    ) -> float | None:
        """The switch's expected seconds from the envelopes: each victim's ``stop_s``
        (``sleep_s`` when paused), then the new one's ``cold_start_s`` (``wake_s`` for
        a wake); ``None`` when any figure is unmeasured."""
        total = envelope_figure(config, "wake_s" if kind is OptionKind.WAKE else "cold_start_s")
        for victim in victims:
            resident_config = self.model_config(victim.model, victim.config)
            figure = "sleep_s" if victim.action == "pause" else "stop_s"
            part = envelope_figure(resident_config, figure)
            if total is None or part is None:
                return None
            total += part
        return total

    def model_config(self, model_key: str, config_key: str) -> Config | None:
        model = self.registry.models.get(model_key)
        return model.configs.get(config_key) if model is not None else None

    def _same_config_resident(self, config: Config) -> Resident | None:
        return next(
            (
                r
                for r in self.inp.residents
                if r.config == config.key and model_of(self.registry, r) is self.model
            ),
            None,
        )

    def _budget(
        self, config: Config, device_key: str, label: str, wake: Resident | None = None
    ) -> _Budget | str:
        device = self.registry.devices.get(device_key)
        if device is None:
            return f"{device_key}: not a device in the registry"
        if device.kind is DeviceKind.GPU:
            unavailable = _unavailable(device_key, self.inp.readings.get(device_key))
            if unavailable is not None:
                return unavailable
        if config.measured_on != device_key:
            where = config.measured_on or "no named device"
            return (
                f"{device_key}: {label} was measured on {where}; "
                f"its cost on {device_key} is unknown"
            )
        cost = cost_mib(config, self.cells)
        if cost is None:
            return (
                f"{device_key}: cost unknown: {label} at {self.cells} cells goes past its "
                f"{config.kv_resident_cells or 0} resident KV cells and no kv_mib_per_1k_cells "
                "is measured"
            )
        host = self.registry.host()
        if host is None:
            return f"{device_key}: no cpu device in the registry; host RAM for {label} is unchecked"
        host_reading = self.inp.readings.get(host.key)
        if host_reading is None or host_reading.source is ProbeSource.ABSENT:
            return f"{host.key}: no host RAM reading; {label} on {device_key} cannot be checked"
        on_device = tuple(r for r in self.inp.residents if r.device == device_key and r != wake)
        if device.kind is DeviceKind.GPU:
            unknown = [r.signature for r in on_device if r.gpu_mib is None]
            if unknown:
                return (
                    f"{device_key}: footprint of {', '.join(unknown)} unknown; the device budget "
                    "is unknown, so nothing loads there"
                )
        return _Budget(device, host, host_reading.free_mib, cost, on_device)

    def _unit_clash(
        self, config: Config, device_key: str, wake: Resident | None = None
    ) -> tuple[list[Resident], str | None]:
        """Residents that must go because they run the candidate's unit, or a unit it can
        never be resident with (a ``Conflicts=`` edge: systemd would stop it anyway, so it
        is a victim the operator sees, never a silent ``load_alongside``); or why not."""
        unit = self.model.unit_for(config)
        if unit is None:
            return [], None
        if unit not in self._edges:
            self._edges[unit] = conflicting_units(self.registry, unit)
        edges = self._edges[unit]
        required: list[Resident] = []
        for resident in self.inp.residents:
            if resident == wake:
                continue
            if resident.unit == unit:
                what, link = f"unit {unit} already runs {resident.signature}", "which"
            elif resident.unit is not None and resident.unit in edges:
                what = f"{resident.signature} ({resident.unit}) can never be resident with {unit}"
                link = "and it"
            else:
                continue
            if resident.device != device_key:
                return [], f"{what} on {resident.device}"
            why = self._not_a_victim(resident)
            if why is not None:
                return [], f"{what}, {link} {why}"
            required.append(resident)
        return required, None

    def _port_clash(
        self, device_key: str, wake: Resident | None = None
    ) -> tuple[list[Resident], str | None]:
        """Behind a single-upstream proxy (``proxy.single_upstream``) one engine at a time
        owns the port: every resident on it must go, so a load is never ``load_alongside``
        while one is resident (:mod:`uapplace.topology`). A resident with no endpoint
        counts as on the port (nothing says otherwise); one on another address is a
        registry error ``validate`` names, and not in the way here."""
        upstream = self.registry.single_upstream
        if upstream is None:
            return [], None
        required: list[Resident] = []
        for resident in self.inp.residents:
            if resident == wake:
                continue
            if resident.endpoint is not None and not same_endpoint(resident.endpoint, upstream):
                continue
            what = f"{resident.signature} owns the single upstream {upstream}"
            if resident.device != device_key:
                return [], f"{what} from {resident.device}"
            why = self._not_a_victim(resident)
            if why is not None:
                return [], f"{what}, and it {why}"
            required.append(resident)
        return required, None

    def _not_a_victim(self, resident: Resident) -> str | None:
        held = holds(resident)
        if held:
            return "; ".join(held)
        if serves(self.registry, resident, self.requested):
            return "serves the requested id (reuse it)"
        if resident.gpu_mib is None:
            return "has an unknown footprint"
        config = config_of(self.registry, resident)
        if config is not None and config.untrusted:
            return "has no measurement that counts on this machine and is never a victim"
        if config is None or not config.is_measured:
            return "is unmeasured and never a victim"
        return None

    def _displace(
        self,
        config: Config,
        label: str,
        budget: _Budget,
        required: list[Resident],
        gpu_need: float,
        host_need: float,
        kind: OptionKind = OptionKind.DISPLACE,
    ) -> list[Option | str]:
        notes = []
        items = []
        for resident in budget.on_device:
            why = self._not_a_victim(resident)
            if why is not None:
                notes.append(f"{resident.signature} {why}")
            elif resident not in required:
                items.append(_item(resident))
        forced = [_item(r) for r in required]
        found = minimal_eviction(
            items,
            _ceil_mib(gpu_need) - sum(it.gpu_mib for it in forced),
            _ceil_mib(host_need) - sum(it.host_mib for it in forced),
        )
        if found is None:
            host_rss = 0.0 if kind is OptionKind.WAKE else config.host_rss_mib or 0.0
            return [self._no_room(label, budget, items + forced, gpu_need, host_rss, notes)]
        chosen = sorted(
            (it.resident for it in (*forced, *found)), key=lambda r: (r.signature, r.device)
        )
        victims = tuple(victim_of(self.registry, r, self.inp.inflight_known) for r in chosen)
        stop_form = self._option(kind, config, budget, victims, form_rank=1.0)
        paused = self._pause_form(label, budget, chosen, required, gpu_need, host_need)
        if paused is None:
            return [stop_form]
        if isinstance(paused, str):
            return [stop_form, paused]
        pause_form = self._option(kind, config, budget, paused, form_rank=0.0)
        stop_rank, pause_rank = _form_ranks(victims, paused)
        return [replace(stop_form, form_rank=stop_rank), replace(pause_form, form_rank=pause_rank)]

    def _pause_form(
        self,
        label: str,
        budget: _Budget,
        chosen: Sequence[Resident],
        required: Sequence[Resident],
        gpu_need: float,
        host_need: float,
    ) -> tuple[Victim, ...] | str | None:
        """The same victims, each paused where it can be (issue 12), or why that does
        not fit, or ``None`` when none can be paused.

        A victim that must go because it runs the candidate's unit, or owns the single
        upstream, is always stopped (a paused engine keeps its unit and its port). The
        form is checked on both devices: the GPU MiB the pauses free (the envelope's
        ``sleep_freed_mib`` when measured) plus the stops must still cover the need,
        and a level-1 pause moves weights into host RAM, so the host-RAM gate counts
        them (:func:`pause_figures`). It is the stop form's victim set, not a new
        search: the two forms differ only in what happens to each victim.
        """
        actions: list[VictimAction] = [
            "pause" if r not in required and pause_level(self.registry, r) is not None else "stop"
            for r in chosen
        ]
        if "pause" not in actions:
            return None
        victims = tuple(
            victim_of(self.registry, r, self.inp.inflight_known, action)
            for r, action in zip(chosen, actions, strict=True)
        )
        what = f"{budget.device.key}: pausing instead of stopping ({label})"
        freed = sum(math.floor(v.frees_mib) for v in victims)
        if freed < _ceil_mib(gpu_need):
            return (
                f"{what} frees {_fmt(freed)} MiB, {_fmt(gpu_need)} MiB needed (the paused "
                "engines keep the rest)"
            )
        stopped_host = sum(
            r.host_rss_mib or 0.0 for r, a in zip(chosen, actions, strict=True) if a == "stop"
        )
        grows = sum(v.host_grows_mib for v in victims)
        short = host_need + grows - stopped_host
        if short > _EPSILON_MIB:
            host = budget.host
            return (
                f"{host.key}: {what} moves {_fmt(grows)} MiB of weights into host RAM; "
                f"{_fmt(budget.host_room)} MiB available above the {_fmt(host.reserved_mib)} MiB "
                f"reserve is {_fmt(short)} MiB short"
            )
        return victims

    def _no_room(
        self,
        label: str,
        budget: _Budget,
        eligible: list[EvictionItem],
        gpu_need: float,
        host_rss: float,
        notes: list[str],
    ) -> str:
        device = budget.device
        most_gpu = sum(it.gpu_mib for it in eligible)
        suffix = f"; not displaceable: {'; '.join(notes)}" if notes else ""
        if _ceil_mib(gpu_need) > most_gpu:
            more = (
                f", and displacing every eligible resident frees at most {_fmt(most_gpu)} MiB more"
                if eligible
                else ""
            )
            return (
                f"{device.key}: {label} needs {_fmt(budget.cost)} MiB; "
                f"{_fmt(device.total_mib)} total − {_fmt(device.reserved_mib)} reserved − "
                f"{_fmt(budget.gpu_loaded)} loaded leaves {_fmt(budget.gpu_room)} MiB{more}{suffix}"
            )
        host = budget.host
        extra = sum(it.host_mib for it in eligible)
        freed = (
            f", even after displacing every eligible resident there (+{_fmt(extra)} MiB)"
            if eligible
            else ""
        )
        return (
            f"{host.key}: host RAM {_fmt(host_rss)} MiB needed, "
            f"{_fmt(budget.host_room)} MiB available above the "
            f"{_fmt(host.reserved_mib)} MiB reserve (for {label} on {device.key}{freed}){suffix}"
        )


def _form_ranks(stopped: Sequence[Victim], paused: Sequence[Victim]) -> tuple[float, float]:
    """(stop form, pause form) ranks: the expected seconds until every victim serves
    again (Σ ``serve_again_s``) when both forms are fully measured; otherwise the
    documented default, pause (0) before stop (1), since a wake skips the load."""
    stop_total = [v.serve_again_s for v in stopped]
    pause_total = [v.serve_again_s for v in paused]
    if None in stop_total or None in pause_total:
        return 1.0, 0.0
    return sum(s for s in stop_total if s is not None), sum(s for s in pause_total if s is not None)


def _item(resident: Resident) -> EvictionItem:
    # Floor what a victim frees and ceil what is needed: a fraction never tips a fit.
    return EvictionItem(
        resident,
        math.floor(resident.gpu_mib or 0.0),
        math.floor(resident.host_rss_mib or 0.0),
    )


def _unavailable(device_key: str, reading: DeviceReading | None) -> str | None:
    if reading is None:
        return f"{device_key}: no probe reading; unavailable"
    if reading.source is ProbeSource.ABSENT:
        detail = f" ({reading.error})" if reading.error else ""
        return f"{device_key}: absent from the probe{detail}; unavailable"
    return None
