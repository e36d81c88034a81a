"""Placement options for one requested id, and the impact preview.

docs/placement-rules.md §4.4, §4.5.

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
  in the host's room, plus what the victims free. The room counts every resident
  at its measured footprint, whatever the probe shows it using now
  (:func:`host_room`): ``min(probe free − reserved, total − reserved − Σ
  host_rss_mib of every resident)``. An engine that gave its memory back for a
  while (llama.cpp's idle sleep: 833 MB down to 20 MB, and back on the next
  request) is still counted whole, and a swing of a shared host's free memory
  can only lower the room, never lend out memory a resident will take back. A
  resident with no measured ``host_rss_mib`` counts 0 in the sum (the probe's
  term still sees what it holds).
- A resident held on the bus (a ``hold`` holder) is never a victim.
- Two residents cannot share one systemd unit: a resident that runs the
  candidate's unit on the same device must be among the victims, and one on
  another device makes the candidate infeasible.

``paused`` residents are not offered for reuse: a paused resident cannot serve
a request (admission does not forward to it either), so "reuse" would promise
a forward that never comes.

The seams: who a victim is and what stopping or pausing it costs live in
:mod:`uapplace.core.victims`; the exact minimal eviction set in :mod:`uapplace.core.eviction`;
the order of the options in :mod:`uapplace.core.ranking`. This module generates the
candidates and says why each rejected one failed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from uapplace.core.conflicts import (
    EPSILON_MIB,
    candidate_devices,
    conflicting_units,
    fits,
    gpu_shortfall_mib,
)
from uapplace.core.eviction import EvictionItem, ceil_mib, eviction_item, minimal_eviction
from uapplace.core.model import (
    DEFAULT_CELLS,
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
from uapplace.core.ranking import affinity_match, form_ranks, rank_options
from uapplace.core.topology import same_endpoint
from uapplace.core.unitnames import unit_file_name
from uapplace.core.victims import (
    config_of,
    envelope_figure,
    fmt_mib,
    holds,
    model_of,
    pause_frees_host,
    pause_level,
    serves,
    victim_of,
)

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
    """The ranked options for ``requested`` at ``cells`` of context (docs/placement-rules.md §4.4).

    ``task`` (``code``, ``general``…) is optional: the admit path carries none.
    It only affects ``affinity_match`` on ``load_alongside`` options; see
    :func:`affinity_match`.
    """
    if cells <= 0:
        raise ValueError(f"cells: must be a positive integer, got {cells}")
    reuse = tuple(_reuse_options(inp, requested))
    resolved = inp.registry.lookup(requested) if requested else None
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


@dataclass(frozen=True)
class HostRoom:
    """The host RAM placement may still use above the host's reserve
    (docs/placement-rules.md §4.4), and the two readings it is the lesser of."""

    host: Device
    probe_free_mib: float
    """What the probe reads free now (``MemAvailable``)."""
    held_mib: float
    """Σ measured ``host_rss_mib`` of every resident."""
    residents: int

    @property
    def by_probe(self) -> float:
        return self.probe_free_mib - self.host.reserved_mib

    @property
    def by_footprints(self) -> float:
        """What is left with every resident at its measured footprint."""
        return self.host.total_mib - self.host.reserved_mib - self.held_mib

    @property
    def mib(self) -> float:
        return min(self.by_probe, self.by_footprints)

    def text(self) -> str:
        """``91,808 MiB available above the 8,192 MiB reserve`` and, when the residents'
        measured footprints are what limits it, how that figure was reached."""
        reserve = f"the {fmt_mib(self.host.reserved_mib)} MiB reserve"
        text = f"{fmt_mib(self.mib)} MiB available above {reserve}"
        if self.by_footprints < self.by_probe:
            text += (
                f" (residents counted at their measured footprints: "
                f"{fmt_mib(self.host.total_mib)} total − {fmt_mib(self.host.reserved_mib)} "
                f"reserved − {fmt_mib(self.held_mib)} held by {self.residents} resident(s); "
                f"the probe reads {fmt_mib(self.probe_free_mib)} MiB free)"
            )
        return text


def host_room(host: Device, reading: DeviceReading, residents: Sequence[Resident]) -> HostRoom:
    """The host's room for planning (docs/placement-rules.md §4.4): ``min(probe free −
    reserved, total − reserved − Σ host_rss_mib of every resident)``. Every resident
    counts at its measured footprint whatever the probe shows it using now (an engine
    asleep gave its memory back only until its next request); the probe's term still
    catches what no resident accounts for."""
    held = sum(r.host_rss_mib or 0.0 for r in residents)
    return HostRoom(host, reading.free_mib, held, len(residents))


__all__ = ["HostRoom", "PlanInput", "host_room", "plan", "plan_unload"]


def _reuse_options(inp: PlanInput, requested: str) -> list[Option]:
    return [
        Option(
            OptionKind.REUSE,
            r.model,
            r.config,
            r.device,
            cost_mib=0.0,
            device_kind=_kind_of(inp.registry, r.device),
        )
        for r in inp.residents
        if r.state not in _NOT_SERVING and serves(inp.registry, r, requested)
    ]


def _kind_of(registry: Registry, device_key: str) -> DeviceKind:
    device = registry.devices.get(device_key)
    return device.kind if device is not None else DeviceKind.GPU


# --------------------------------------------------------------------------- one candidate


@dataclass(frozen=True)
class _Budget:
    """One device's arithmetic for one candidate."""

    device: Device
    host: HostRoom
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

        The same arithmetic as the ``Conflicts=`` graph (:mod:`uapplace.core.conflicts`).
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
        """Host RAM above the reserve, every resident at its measured footprint."""
        return self.host.mib


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
        one is the display state of docs/placement-rules.md §4.2 and is not woken), never
        loaded a second time: its budget counts the other residents
        plus the config's full cost (the paused process's residual is part of that
        cost once awake), and it needs no host RAM (waking moves weights *out* of the
        host, or back from disk into the GPU).
        """
        label = f"{self.model.key}/{config.key}"
        twin = self._same_config_resident(config)
        wake: Resident | None = None
        if twin is not None:
            can_wake = config.sleep_level is not None or config.is_router_model
            wakeable = twin.state is ResidentState.PAUSED and can_wake
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
        port_owners, clash = self._port_clash(device_key, wake, config)
        if clash is not None:
            return [f"{device_key}: {clash}"]
        required += [r for r in port_owners if r not in required]
        gpu_need = budget.gpu_need
        host_rss = _host_to_add(config, waking=wake is not None)
        host_need = host_rss - budget.host_room
        if budget.fits_alongside and host_need <= EPSILON_MIB and not required:
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
                    host_mib=host_rss,
                    device_kind=budget.device.kind,
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
            host_mib=_host_to_add(config, waking=kind is OptionKind.WAKE),
            device_kind=budget.device.kind,
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
        return _Budget(device, host_room(host, host_reading, self.inp.residents), cost, on_device)

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
            if resident == wake or self._idle_sibling(resident, config):
                continue
            if resident.unit is not None and unit_file_name(resident.unit) == unit_file_name(unit):
                # Residents carry the unit's file name (``x.service``), the registry may not.
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

    def _co_hosted(self, resident: Resident, config: Config) -> bool:
        """``resident`` and the candidate ``config`` are models of one llama.cpp router
        (both ``pause_lever: llamacpp-router``, one unit): the router stays up and one
        model makes room for the other by unloading (docs/placement-rules.md §4.2)."""
        if not config.is_router_model:
            return False
        theirs = config_of(self.registry, resident)
        if theirs is None or not theirs.is_router_model:
            return False
        unit = self.model.unit_for(config)
        if unit is None or resident.unit is None:
            return False
        return unit_file_name(resident.unit) == unit_file_name(unit)

    def _idle_sibling(self, resident: Resident, config: Config) -> bool:
        """A paused model of the candidate's router: unloaded, it holds no place in the
        router (``--models-max``) and nothing on the device, so it is not in the way."""
        return resident.state is ResidentState.PAUSED and self._co_hosted(resident, config)

    def _port_clash(
        self, device_key: str, wake: Resident | None = None, config: Config | None = None
    ) -> tuple[list[Resident], str | None]:
        """Behind a single-upstream proxy (``proxy.single_upstream``) one engine at a time
        owns the port: every resident on it must go, so a load is never ``load_alongside``
        while one is resident (:mod:`uapplace.core.topology`). A resident with no endpoint
        counts as on the port (nothing says otherwise); one on another address is a
        registry error ``validate`` names, and not in the way here."""
        upstream = self.registry.single_upstream
        if upstream is None:
            return [], None
        required: list[Resident] = []
        for resident in self.inp.residents:
            if resident == wake or (config is not None and self._idle_sibling(resident, config)):
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
                items.append(eviction_item(resident))
        forced = [eviction_item(r) for r in required]
        found = minimal_eviction(
            items,
            ceil_mib(gpu_need) - sum(it.gpu_mib for it in forced),
            ceil_mib(host_need) - sum(it.host_mib for it in forced),
        )
        if found is None:
            host_rss = _host_to_add(config, waking=kind is OptionKind.WAKE)
            return [self._no_room(label, budget, items + forced, gpu_need, host_rss, notes)]
        chosen = sorted(
            (it.resident for it in (*forced, *found)), key=lambda r: (r.signature, r.device)
        )
        victims = tuple(victim_of(self.registry, r, self.inp.inflight_known) for r in chosen)
        stop_form = self._option(kind, config, budget, victims, form_rank=1.0)
        paused = self._pause_form(config, budget, chosen, required, gpu_need, host_need)
        if paused is None:
            return [stop_form]
        if isinstance(paused, str):
            return [stop_form, paused]
        pause_form = self._option(kind, config, budget, paused, form_rank=0.0)
        stop_rank, pause_rank = form_ranks(victims, paused)
        return [replace(stop_form, form_rank=stop_rank), replace(pause_form, form_rank=pause_rank)]

    def _pause_form(
        self,
        config: Config,
        budget: _Budget,
        chosen: Sequence[Resident],
        required: Sequence[Resident],
        gpu_need: float,
        host_need: float,
    ) -> tuple[Victim, ...] | str | None:
        """The same victims, each paused where it can be (issue 12), or why that does
        not fit, or ``None`` when none can be paused.

        A victim that must go because it runs the candidate's unit, or owns the single
        upstream, is always stopped (a paused engine keeps its unit and its port) —
        unless it is a model of the candidate's own llama.cpp router, which makes room by
        unloading while the router keeps the unit and the port (:meth:`_co_hosted`). The
        form is checked on both devices: the GPU MiB the pauses free (the envelope's
        ``sleep_freed_mib`` when measured) plus the stops must still cover the need,
        and a level-1 pause moves weights into host RAM, so the host-RAM gate counts
        them (:func:`pause_figures`). It is the stop form's victim set, not a new
        search: the two forms differ only in what happens to each victim.
        """
        label = f"{self.model.key}/{config.key}"
        actions: list[VictimAction] = [
            "pause"
            if pause_level(self.registry, r) is not None
            and (r not in required or self._co_hosted(r, config))
            else "stop"
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
        if freed < ceil_mib(gpu_need):
            return (
                f"{what} frees {fmt_mib(freed)} MiB, {fmt_mib(gpu_need)} MiB needed (the paused "
                "engines keep the rest)"
            )
        stopped_host = sum(
            r.host_rss_mib or 0.0
            for r, a in zip(chosen, actions, strict=True)
            if a == "stop" or pause_frees_host(self.registry, r)
        )
        grows = sum(v.host_grows_mib for v in victims)
        short = host_need + grows - stopped_host
        if short > EPSILON_MIB:
            return (
                f"{budget.host.host.key}: {what} moves {fmt_mib(grows)} MiB of weights into "
                f"host RAM; {budget.host.text()} is {fmt_mib(short)} MiB short"
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
        if ceil_mib(gpu_need) > most_gpu:
            more = (
                ", and displacing every eligible resident frees at most "
                f"{fmt_mib(most_gpu)} MiB more"
                if eligible
                else ""
            )
            return (
                f"{device.key}: {label} needs {fmt_mib(budget.cost)} MiB; "
                f"{fmt_mib(device.total_mib)} total − {fmt_mib(device.reserved_mib)} reserved − "
                f"{fmt_mib(budget.gpu_loaded)} loaded leaves {fmt_mib(budget.gpu_room)} MiB"
                f"{more}{suffix}"
            )
        extra = sum(it.host_mib for it in eligible)
        freed = (
            f", even after displacing every eligible resident there (+{fmt_mib(extra)} MiB)"
            if eligible
            else ""
        )
        return (
            f"{budget.host.host.key}: host RAM {fmt_mib(host_rss)} MiB needed, "
            f"{budget.host.text()} (for {label} on {device.key}{freed}){suffix}"
        )


def _host_to_add(config: Config, waking: bool) -> float:
    """Host RAM the candidate adds: its ``host_rss_mib``; a wake adds none (waking moves
    weights out of the host, or back from disk into the GPU), except a router model's,
    whose wake loads it into a new child process (docs/placement-rules.md §4.2)."""
    if waking and not config.is_router_model:
        return 0.0
    return config.host_rss_mib or 0.0


def _unavailable(device_key: str, reading: DeviceReading | None) -> str | None:
    if reading is None:
        return f"{device_key}: no probe reading; unavailable"
    if reading.source is ProbeSource.ABSENT:
        detail = f" ({reading.error})" if reading.error else ""
        return f"{device_key}: absent from the probe{detail}; unavailable"
    return None
