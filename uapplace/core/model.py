"""The plain typed objects every module shares.

Pydantic lives at the edges (files, bus, HTTP); inside, the program passes these
frozen dataclasses around. Each edge module converts to and from them.

Units: memory in MiB (floats where the docs/placement-rules.md §4.4 cost produces fractions),
context in cells (tokens), times as POSIX seconds (``float``) inside and
ISO-8601 UTC strings in files and on the wire.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

# Re-exported: they live in conventions so that a bus client needs none of this module.
from uapplace.core.conventions import DEFAULT_CELLS as DEFAULT_CELLS
from uapplace.core.conventions import iso as iso
from uapplace.core.conventions import parse_iso as parse_iso

Provenance = Literal["repo", "local"]

PauseLever = Literal["vllm-sleep-1", "vllm-sleep-2", "llamacpp-router"]
"""The in-process lever an engine has to give its GPU memory back without exiting
(docs/placement-rules.md §4.2 "What paused is", §9.4, issue 12). ``vllm-sleep-1``: sleep level 1
(weights offloaded to host RAM, KV discarded; ``POST /sleep?level=1``, ``/wake_up``);
``vllm-sleep-2``: level 2 (weights and KV discarded, reloaded from disk on wake);
``llamacpp-router``: llama.cpp's router unloads the model in place. Declared per config
by the operator in the registry; whether it is executable is :data:`EXECUTABLE_LEVERS`."""

EXECUTABLE_LEVERS: frozenset[str] = frozenset({"vllm-sleep-1", "vllm-sleep-2", "llamacpp-router"})
"""The levers enforcement can drive: vLLM's sleep API (:mod:`uapplace.io.engines`) and
llama.cpp's router (:mod:`uapplace.io.router`: ``POST /models/unload`` pauses, ``POST
/models/load`` wakes; docs/placement-rules.md §4.2, "What paused is")."""

ROUTER_LEVER = "llamacpp-router"
"""The lever of a router model: one model of a llama.cpp router
(``llama-server --models-dir``), paused by unloading its child process."""


# --------------------------------------------------------------------------- registry


class DeviceKind(StrEnum):
    GPU = "gpu"
    CPU = "cpu"


@dataclass(frozen=True)
class Device:
    """A placement device from the registry: ``gpu0``, ``gpu1``, ``cpu0``."""

    key: str
    kind: DeviceKind
    total_mib: int
    reserved_mib: int
    name: str = ""
    uuid: str | None = None
    """NVML (or simulated) UUID this key is bound to; ``None`` → the index in the key."""
    reserve_reason: str = ""
    provenance: Mapping[str, Provenance] = field(default_factory=dict)
    """Per field name: which registry file it came from."""


@dataclass(frozen=True)
class DeviceIdentity:
    """What identifies a device class for a measurement: name, UUID, total memory."""

    name: str | None = None
    uuid: str | None = None
    total_mib: int | None = None


class ConfigStatus(StrEnum):
    MEASURED = "measured"
    UNMEASURED = "unmeasured"


@dataclass(frozen=True)
class Envelope:
    """A config's measured enforcement envelope on this machine (docs/placement-rules.md §4.6, §10):
    how long taking it down and bringing it up took, per ``uapplace measure --envelope``.

    Seconds throughout; ``sleep_*``/``wake_s`` only for an engine with a sleep lever.
    Enforcement derives its drain, verify-free and verify-up waits from it
    (``timeouts.Timeouts``); the planner its expected time to serve again.
    """

    stop_s: float
    """The stop job, from asking to the unit inactive."""
    free_s: float
    """From asking for the stop until the probe showed the memory back."""
    cold_start_s: float
    """First start: from the start job until healthy and serving the model's id."""
    warm_start_s: float
    """The start right after (page cache hot), the same way."""
    measured_at: str
    measured_on: str
    sleep_s: float | None = None
    sleep_freed_mib: float | None = None
    """What the probe saw freed on the device by the sleep."""
    wake_s: float | None = None
    """From ``POST /wake_up`` until healthy, serving, and holding its memory again."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "stop_s": self.stop_s,
            "free_s": self.free_s,
            "cold_start_s": self.cold_start_s,
            "warm_start_s": self.warm_start_s,
        }
        for name in ("sleep_s", "sleep_freed_mib", "wake_s"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        out["measured_at"] = self.measured_at
        out["measured_on"] = self.measured_on
        return out


@dataclass(frozen=True)
class Config:
    """One launch configuration of a model, with its footprint (docs/placement-rules.md §4.1)."""

    key: str
    status: ConfigStatus
    resident_gpu_mib: float | None = None
    host_rss_mib: float | None = None
    context_pool_cells: int | None = None
    per_session_cap_cells: int | None = None
    kv_resident_cells: int | None = None
    kv_mib_per_1k_cells: float | None = None
    kv: str | None = None
    """KV cache dtype the engine runs with (``int8``, ``f16``), for ``metricsMustMatch``."""
    measured_at: str | None = None
    measured_on: str | None = None
    flags: tuple[str, ...] = ()
    unit: str | None = None
    """Overrides the model's unit when this config runs under its own unit."""
    endpoint: str | None = None
    provenance: Provenance = "repo"
    measured_device: DeviceIdentity | None = None
    """The device its figures were measured on (docs/placement-rules.md §4.1, ``measured_on``)."""
    engine_build: str | None = None
    """The engine build the figures were taken with, where ``measure`` recorded one."""
    exec_start_sha256: str | None = None
    """SHA-256 of the unit's live ``ExecStart`` when measured (:mod:`uapplace.core.staleness`)."""
    measured_build: str | None = None
    """The build the engine itself reported when measured (llama.cpp ``/props``
    ``build_info``, vLLM ``/version``), compared with what it reports now."""
    untrusted: str = ""
    """Why the figures do not count on this machine (repo-only, another device or build);
    empty when they do. Set by the registry loader, never by hand."""
    start_s: float | None = None
    """Measured cold start: seconds from the start job until ``/health`` is 200 on this
    machine. Enforcement derives its verify-up bound from it (``timeouts.Timeouts``)."""
    start_timeout_s: float | None = None
    """The operator's explicit verify-up bound for this config when no start is measured."""
    envelope: Envelope | None = None
    """The measured enforcement envelope (``uapplace measure --envelope``), machine-local."""
    pause_lever: PauseLever | None = None
    """How this config's engine can pause in place (:data:`PauseLever`); ``None``: it
    cannot, and the only way to free its memory is a stop."""

    @property
    def sleep_level(self) -> int | None:
        """vLLM sleep level of an executable lever (1 or 2); ``None`` when it has none."""
        if self.pause_lever == "vllm-sleep-1":
            return 1
        if self.pause_lever == "vllm-sleep-2":
            return 2
        return None

    @property
    def is_router_model(self) -> bool:
        """One model of a llama.cpp router (:data:`ROUTER_LEVER`): its unit and endpoint are
        the router's, shared with its sibling models (docs/placement-rules.md §4.2)."""
        return self.pause_lever == ROUTER_LEVER

    @property
    def is_measured(self) -> bool:
        """Placeable at all: a measurement for both the GPU and the host figure that counts
        on this machine (machine-local, taken on this device class and engine build)."""
        return (
            self.status is ConfigStatus.MEASURED
            and not self.untrusted
            and self.measured_at is not None
            and self.resident_gpu_mib is not None
            and self.host_rss_mib is not None
        )


def cost_mib(config: Config, cells: int) -> float | None:
    """Admission cost (docs/placement-rules.md §4.1, §4.4), or ``None`` when unknown (fail closed).

    ``resident_gpu_mib + max(0, cells − kv_resident_cells)/1000 × kv_mib_per_1k_cells``.
    Unknown when the config is unmeasured, or when the request goes past the
    resident KV pool and no per-1k rate was measured.
    """
    if not config.is_measured or config.resident_gpu_mib is None:
        return None
    resident_cells = config.kv_resident_cells or 0
    extra_cells = max(0, cells - resident_cells)
    if extra_cells == 0:
        return float(config.resident_gpu_mib)
    if config.kv_mib_per_1k_cells is None or config.kv_resident_cells is None:
        return None
    return config.resident_gpu_mib + extra_cells / 1000 * config.kv_mib_per_1k_cells


@dataclass(frozen=True)
class Model:
    key: str
    display: str
    engine: str
    configs: Mapping[str, Config]
    unit: str | None = None
    endpoint: str | None = None
    launch: str | None = None
    profile: str | None = None
    service: str | None = None
    """Name of the matching ``services[]`` entry in capacity-policy.json."""
    rails: int | None = None
    rails_source: str | None = None
    task_affinity: tuple[str, ...] = ()
    affinity_devices: tuple[str, ...] = ()
    advertises: tuple[str, ...] = ()
    engine_build: str | None = None
    """The engine build installed now; a config measured with another build is unknown."""

    def unit_for(self, config: Config) -> str | None:
        return config.unit or self.unit

    def endpoint_for(self, config: Config) -> str | None:
        return config.endpoint or self.endpoint

    def serves(self, model_id: str) -> bool:
        return model_id == self.key or model_id in self.advertises or model_id in self.configs


@dataclass(frozen=True)
class Registry:
    devices: Mapping[str, Device]
    models: Mapping[str, Model]
    single_upstream: str | None = None
    """``proxy.single_upstream``: the proxy sends every request to this one address and
    routes by nothing else (the stock UAP proxy; :mod:`uapplace.core.topology`). ``None``:
    the proxy routes by ``target_id``."""

    def lookup(self, model_id: str) -> tuple[Model, Config | None] | None:
        """The model a requested id names: by model key, advertised id or config key.

        A config key pins that config; otherwise the config is the planner's choice.
        """
        if model_id in self.models:
            return self.models[model_id], None
        for model in self.models.values():
            if model_id in model.advertises:
                return model, None
            if model_id in model.configs:
                return model, model.configs[model_id]
        return None

    def gpus(self) -> list[Device]:
        return [d for d in self.devices.values() if d.kind is DeviceKind.GPU]

    def host(self) -> Device | None:
        return next((d for d in self.devices.values() if d.kind is DeviceKind.CPU), None)


# --------------------------------------------------------------------------- probes


class ProbeSource(StrEnum):
    NVML = "nvml"
    SIM = "sim"
    ABSENT = "absent"
    MEMAVAILABLE = "MemAvailable"


@dataclass(frozen=True)
class ProcessUsage:
    pid: int
    used_mib: float
    command: str = ""


def processes_text(processes: Iterable[ProcessUsage]) -> str:
    """``pid 1234 `cmd` 12,000 MiB; …``: how steps and alerts name who holds device memory."""
    return "; ".join(f"pid {p.pid} `{p.command or '?'}` {p.used_mib:,.0f} MiB" for p in processes)


@dataclass(frozen=True)
class DeviceReading:
    """What a probe saw on one device just now. The probe wins over the ledger."""

    key: str
    kind: DeviceKind
    total_mib: float
    free_mib: float
    source: ProbeSource
    processes: tuple[ProcessUsage, ...] = ()
    uuid: str | None = None
    error: str | None = None
    name: str | None = None
    """The device's product name where the probe reads one (NVML, the simulated GPU)."""


# --------------------------------------------------------------------------- ledger


class ResidentState(StrEnum):
    HOT = "hot"
    WARMING = "warming"
    PAUSED = "paused"
    DRAINING = "draining"


@dataclass(frozen=True)
class Holder:
    """Someone using a resident: an in-flight request from the proxy, or a bus Hold."""

    client: str
    kind: Literal["inflight", "hold"]
    detail: str = ""
    started_at: str | None = None
    cookie: int | None = None


@dataclass(frozen=True)
class Resident:
    model: str
    config: str
    device: str
    engine: str
    endpoint: str | None
    unit: str | None
    state: ResidentState
    gpu_mib: float | None
    host_rss_mib: float | None
    since: str
    holders: tuple[Holder, ...] = ()
    main_pid: int | None = None
    asleep: bool = False
    """Its engine says it is asleep on its own (llama.cpp ``--sleep-idle-seconds``,
    ``/props`` ``is_sleeping``): a live fact shown to the operator, not a state. It
    stays ``hot`` (the engine wakes itself on the next request, so admission keeps
    forwarding) and the planner still counts its measured footprint
    (docs/placement-rules.md §4.2, "Asleep is not paused")."""

    @property
    def target_id(self) -> str:
        """docs/http-contract.md §1: ``<device>:<endpoint or 'default'>``."""
        return f"{self.device}:{self.endpoint or 'default'}"

    @property
    def signature(self) -> str:
        return f"{self.model}/{self.config}"


ResidentKey = tuple[str, str, str]
"""``(model, config, device)``."""


def resident_key(resident: Resident) -> ResidentKey:
    """``(model, config, device)``: how a resident is named across the program."""
    return (resident.model, resident.config, resident.device)


class ParkReason(StrEnum):
    UNKNOWN_MODEL = "unknown_model"
    NO_MEASURED_CONFIG = "no_measured_config"
    NOT_RESIDENT = "not_resident"
    AUTO_LOADING = "auto_loading"
    AUTO_FAILED = "auto_failed"
    INVALID_REQUEST = "invalid_request"
    WARMING = "warming"
    """A resident serves the id but has not passed verify-up in this daemon's life yet."""
    PAUSED = "paused"
    """Only a ``paused`` resident (weights offloaded) serves the id: a ``wake`` brings it back."""
    FAILED = "failed"
    """The switch approved for this entry failed (rolled back) or was refused before
    anything stopped: the entry stays for another option (issue 21)."""
    REFUSED = "refused"
    """This client's entry for the id was dismissed or expired unanswered within the
    refusal window: the retry gets that entry's id and no new prompt (issue 21)."""


# --------------------------------------------------------------------------- planner


class OptionKind(StrEnum):
    REUSE = "reuse"
    LOAD_ALONGSIDE = "load_alongside"
    DISPLACE = "displace"
    WAKE = "wake"
    """Wake a ``paused`` resident of the requested model in place (issue 12); may itself
    need room, so it carries victims like a displace."""


class PreviewReason(StrEnum):
    OK = "ok"
    NOT_IN_REGISTRY = "not_in_registry"
    NO_MEASURED_CONFIG = "no_measured_config"
    NO_FEASIBLE_OPTION = "no_feasible_option"


VictimAction = Literal["stop", "pause"]

PAUSE_SUFFIX = "@pause"
"""Appended to a victim's ``model/config`` in an approval signature when the option
pauses it rather than stopping it, so consent names the action (issue 12): approving
``coder/q4`` never approves ``coder/q4@pause`` and the other way round."""


@dataclass(frozen=True)
class Victim:
    """One resident a displace (or wake) option stops or pauses, with its
    consequence (docs/placement-rules.md §4.5)."""

    model: str
    config: str
    state: ResidentState
    device: str
    holders: tuple[Holder, ...]
    in_flight: bool | None
    """``None`` when the proxy did not answer: unknown, which counts as busy."""
    frees_mib: float
    consequence: str
    reload_mib: float | None = None
    action: VictimAction = "stop"
    serve_again_s: float | None = None
    """Expected seconds until this victim serves again: its measured wake for a pause,
    its measured cold start for a stop; ``None`` when unmeasured."""
    residual_mib: float = 0.0
    """GPU MiB the paused process keeps (its CUDA context); 0 for a stop."""
    host_grows_mib: float = 0.0
    """Host RAM the pause moves into the victim's process (vLLM sleep level 1 offloads
    the weights to host RAM); 0 for a stop or a level-2 pause."""
    alternative: str = ""
    """What the other action would cost for this victim ("pausing instead: wake ≈ 1.5 s,
    host RAM +6,000 MiB"), empty when there is no other action."""
    frees_host_mib: float = 0.0
    """Host RAM its action gives back: its measured ``host_rss_mib`` for a stop (and for
    a router model's pause, whose process ends); 0 for a vLLM pause, whose process
    stays. On a CPU device (``device_kind`` ``cpu``) this is the memory that counts."""
    device_kind: DeviceKind = DeviceKind.GPU
    """The kind of its device: on ``cpu`` its memory is host RAM and ``frees_mib`` (GPU)
    is 0, so a preview shows ``frees_host_mib`` (docs/placement-rules.md §4.5)."""

    @property
    def on_host(self) -> bool:
        return self.device_kind is DeviceKind.CPU

    @property
    def signature(self) -> str:
        base = f"{self.model}/{self.config}"
        return base + PAUSE_SUFFIX if self.action == "pause" else base

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "config": self.config,
            "state": self.state.value,
            "device": self.device,
            "holders": [holder_json(h) for h in self.holders],
            "in_flight": self.in_flight,
            "frees_mib": self.frees_mib,
            "consequence": self.consequence,
            "reload_mib": self.reload_mib,
            "action": self.action,
            "serve_again_s": self.serve_again_s,
            "frees_host_mib": round(self.frees_host_mib, 3),
            "device_kind": self.device_kind.value,
        }
        if self.residual_mib:
            out["residual_mib"] = round(self.residual_mib, 3)
        if self.host_grows_mib:
            out["host_grows_mib"] = round(self.host_grows_mib, 3)
        if self.alternative:
            out["alternative"] = self.alternative
        return out


def holder_json(holder: Holder) -> dict[str, Any]:
    out: dict[str, Any] = {"client": holder.client, "kind": holder.kind}
    if holder.detail:
        out["detail"] = holder.detail
    if holder.started_at:
        out["started_at"] = holder.started_at
    if holder.cookie is not None:
        out["cookie"] = holder.cookie
    return out


@dataclass(frozen=True)
class Option:
    kind: OptionKind
    model: str
    config: str
    device: str
    cost_mib: float
    victims: tuple[Victim, ...] = ()
    affinity_match: bool = False
    expected_s: float | None = None
    """Expected seconds for the whole switch (victims stopped or paused, then the new
    one started or woken), from the measured envelopes; ``None`` when any part is
    unmeasured."""
    form_rank: float = 0.0
    """Orders the stop and pause forms of one displacement: the expected time until
    the victims serve again when measured, else pause (0) before stop (1)."""
    host_mib: float = 0.0
    """Host RAM the option adds: the config's measured ``host_rss_mib`` (0 for reuse, and
    for a wake that moves weights out of the host). On a CPU device it is the option's
    whole cost (``cost_mib``, the GPU formula of §4.4, is 0 there)."""
    device_kind: DeviceKind = DeviceKind.GPU
    """The kind of the option's device (``cpu``: the CPU tier, placed against host RAM)."""

    @property
    def on_host(self) -> bool:
        return self.device_kind is DeviceKind.CPU

    @property
    def signature(self) -> tuple[str, ...]:
        """The approval signature: sorted ``model/config`` of every victim, with
        ``@pause`` for a victim the option pauses (:data:`PAUSE_SUFFIX`)."""
        return tuple(sorted(v.signature for v in self.victims))

    @property
    def pauses(self) -> bool:
        return any(v.action == "pause" for v in self.victims)

    @property
    def frees_mib(self) -> float:
        return sum(v.frees_mib for v in self.victims)

    @property
    def frees_host_mib(self) -> float:
        return sum(v.frees_host_mib for v in self.victims)

    def to_json(self) -> dict[str, Any]:
        """docs/http-contract.md §4's option (``victims``, ``affinityMatch`` where they apply)."""
        out: dict[str, Any] = {
            "kind": self.kind.value,
            "model": self.model,
            "config": self.config,
            "device": self.device,
            "device_kind": self.device_kind.value,
            "cost_mib": round(self.cost_mib, 3),
            "host_mib": round(self.host_mib, 3),
        }
        # Every kind carries its signature (issue 20; ``[]`` when nothing stops): the
        # ``expected`` an Apply or Load of this option sends.
        out["signature"] = list(self.signature)
        if self.kind in (OptionKind.DISPLACE, OptionKind.WAKE):
            out["victims"] = [v.to_json() for v in self.victims]
            out["frees_mib"] = round(self.frees_mib, 3)
            out["frees_host_mib"] = round(self.frees_host_mib, 3)
        if self.kind is not OptionKind.REUSE:
            out["expected_s"] = None if self.expected_s is None else round(self.expected_s, 1)
        if self.kind is OptionKind.LOAD_ALONGSIDE:
            out["affinityMatch"] = self.affinity_match
        return out


@dataclass(frozen=True)
class Plan:
    """The planner's answer for one requested id (docs/http-contract.md §4 preview)."""

    requested: str
    reason: PreviewReason
    options: tuple[Option, ...] = ()
    infeasible: tuple[str, ...] = ()
    """Why each candidate that did not make the list failed, naming the device."""

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.requested,
            "reason": self.reason.value,
            "options": [o.to_json() for o in self.options],
            "infeasible": list(self.infeasible),
        }


@dataclass(frozen=True)
class PendingEntry:
    id: str
    requested_model: str
    client: str
    session: str | None
    created_at: float
    expires_at: float
    reason: ParkReason
    cells: int = DEFAULT_CELLS
    pid: int | None = None
    options: tuple[Option, ...] = ()

    def expired(self, now: float) -> bool:
        return now >= self.expires_at


@dataclass(frozen=True)
class Decision:
    """The answer to one admit (docs/http-contract.md §1)."""

    decision: Literal["forward", "park"]
    target_id: str = ""
    placement_id: str = ""
    reason: str = ""

    def to_json(self) -> dict[str, str]:
        if self.decision == "forward":
            return {"decision": "forward", "target_id": self.target_id}
        return {"decision": "park", "placement_id": self.placement_id, "reason": self.reason}
