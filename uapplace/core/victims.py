"""The victims of a placement: which registry config a resident runs, what stopping
or pausing it costs its users, and the figures a pause frees and moves
(docs/placement-rules.md §4.5).

Pure functions over the registry and the ledger's residents. The planner builds its
preview victims here (:func:`victim_of`); the controller re-reads each victim's
holders and consequence at call time with the same functions, and enforcement and
recovery find a resident's config (:func:`config_of`) and a pause's figures
(:func:`pause_figures`) here, so the preview and the run agree on every number.
"""

from __future__ import annotations

from uapplace.core.model import (
    EXECUTABLE_LEVERS,
    Config,
    DeviceKind,
    Model,
    Registry,
    Resident,
    ResidentState,
    Victim,
    VictimAction,
)

# --------------------------------------------------------------------------- residents


def model_of(registry: Registry, resident: Resident) -> Model | None:
    """The registry model a resident runs (its ``model`` is normally the model key)."""
    found = registry.models.get(resident.model)
    if found is not None:
        return found
    resolved = registry.lookup(resident.model)
    return resolved[0] if resolved is not None else None


def config_of(registry: Registry, resident: Resident) -> Config | None:
    """The registry config a resident runs; ``None`` once the registry no longer has it."""
    model = model_of(registry, resident)
    return model.configs.get(resident.config) if model is not None else None


def serves(registry: Registry, resident: Resident, model_id: str) -> bool:
    """``model_id`` is its model key, config key or an advertised id (docs/http-contract.md §1)."""
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


def device_kind_of(registry: Registry, resident: Resident) -> DeviceKind:
    """The kind of the device a resident is on (a device the registry lost counts as a GPU,
    the kind every figure of a victim was first written for)."""
    device = registry.devices.get(resident.device)
    return device.kind if device is not None else DeviceKind.GPU


def memory_word(kind: DeviceKind) -> str:
    """What a device's memory is called in a consequence: ``VRAM``, or ``host RAM`` on
    the CPU tier (docs/placement-rules.md §4.5)."""
    return "host RAM" if kind is DeviceKind.CPU else "VRAM"


def consequence(state: ResidentState, busy: bool | None, kind: DeviceKind = DeviceKind.GPU) -> str:
    """docs/placement-rules.md §4.5: what stopping a resident in ``state`` costs its users
    (``kind``: its device's, which names the memory a warming load wastes)."""
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
        return f"load wasted; {memory_word(kind)} returns on stop"
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


ROUTER_PAUSE_LEVEL = 2
"""A llama.cpp router model pauses like vLLM's level 2 discards: its child process ends,
so its whole footprint (weights, KV, host RAM) is freed and nothing moves into host RAM;
a wake loads it from disk again (docs/placement-rules.md §4.2, "What paused is")."""


def pause_consequence(level: int, busy: bool | None, router: bool = False) -> str:
    """The §4.5 table's ``pause`` row (issue 12): KV and context are lost either way;
    what differs from a stop is where the weights go and how the model comes back
    (``router``: a llama.cpp router model, whose pause ends its child process)."""
    if busy is True:
        first = "active generation aborted; context lost"
    elif busy is None:
        first = (
            "in-flight work unknown (the proxy did not answer), counted as busy: "
            "an active generation may be aborted; context lost"
        )
    else:
        first = "session idle, context lost"
    if router:
        return (
            f"{first}; paused: the router unloads it (its process ends, its memory is "
            "freed), wake reloads it from disk in the router (no unit restart)"
        )
    if level == 1:
        return f"{first}; paused: weights offloaded to host RAM, wake needed (no reload)"
    return f"{first}; paused: weights discarded, wake reloads them from disk"


CONSEQUENCES: tuple[tuple[str, str, str, str], ...] = (
    ("hot", "stop", "yes", "active generation aborted; context lost"),
    ("hot", "stop", "no", "session idle, context lost, reload needed"),
    ("hot", "pause (level 1)", "no", pause_consequence(1, False)),
    ("hot", "pause (level 2)", "no", pause_consequence(2, False)),
    ("hot", "pause (router)", "no", pause_consequence(ROUTER_PAUSE_LEVEL, False, router=True)),
    ("warming", "stop", "—", "load wasted; VRAM returns on stop"),
    ("warming (cpu)", "stop", "—", consequence(ResidentState.WARMING, None, DeviceKind.CPU)),
    ("paused", "stop", "—", "already offloaded; restore path lost"),
)
"""The consequence table of docs/placement-rules.md §4.5 (state, action, in flight,
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
    (:data:`~uapplace.core.model.EXECUTABLE_LEVERS`), measured for this machine, with an
    endpoint to send the sleep to. A router model's is :data:`ROUTER_PAUSE_LEVEL`."""
    config = config_of(registry, resident)
    if config is None or config.pause_lever not in EXECUTABLE_LEVERS:
        return None
    if resident.state is not ResidentState.HOT or resident.endpoint is None:
        return None
    return ROUTER_PAUSE_LEVEL if config.is_router_model else config.sleep_level


def host_freed(registry: Registry, resident: Resident, action: VictimAction) -> float:
    """Host RAM ``action`` gives back: the resident's measured ``host_rss_mib`` for a stop
    or a router model's pause (its process ends), 0 for a vLLM pause (it stays)."""
    if action == "pause" and not pause_frees_host(registry, resident):
        return 0.0
    return resident.host_rss_mib or 0.0


def pause_frees_host(registry: Registry, resident: Resident) -> bool:
    """Whether pausing ``resident`` gives its host RAM back (a router model's child
    process ends); a vLLM sleep keeps the process, and its host RAM, alive."""
    config = config_of(registry, resident)
    return config is not None and config.is_router_model


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
    kind = device_kind_of(registry, resident)
    cold = envelope_figure(config, "cold_start_s")
    wake = envelope_figure(config, "wake_s")
    freed, grows = pause_figures(config, resident, level) if level is not None else (0.0, 0.0)
    if action == "pause":
        if level is None:
            raise ValueError(f"{resident.signature}: cannot be paused (no executable lever)")
        text = pause_consequence(level, busy, router=config is not None and config.is_router_model)
        held = _freed_text(kind, resident.gpu_mib or 0.0, host_freed(registry, resident, "stop"))
        alternative = f"stopping instead: reload ≈ {_seconds(cold)}, frees {held}"
    else:
        text = consequence(resident.state, busy, kind)
        alternative = ""
        if level is not None:
            host = f", host RAM +{fmt_mib(grows)} MiB" if grows else ""
            paused_frees = _freed_text(kind, freed, host_freed(registry, resident, "pause"))
            alternative = f"pausing instead: wake ≈ {_seconds(wake)}, frees {paused_frees}{host}"
    footprint = resident.host_rss_mib if kind is DeviceKind.CPU else resident.gpu_mib
    if footprint is None:
        text += f"; {memory_word(kind)} it frees is unknown (footprint not measured)"
    reload_mib = _reload_mib(config, kind)
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
        reload_mib=reload_mib if reload_mib is not None else footprint,
        action=action,
        serve_again_s=wake if paused else cold,
        residual_mib=max(0.0, (resident.gpu_mib or 0.0) - freed) if paused else 0.0,
        host_grows_mib=grows if paused else 0.0,
        alternative=alternative,
        frees_host_mib=host_freed(registry, resident, action),
        device_kind=kind,
    )


def _reload_mib(config: Config | None, kind: DeviceKind) -> float | None:
    """What bringing the victim back costs on its device: its measured GPU figure, or
    on the CPU tier its measured host RAM; ``None`` when unmeasured."""
    if config is None or not config.is_measured:
        return None
    return config.host_rss_mib if kind is DeviceKind.CPU else config.resident_gpu_mib


def _freed_text(kind: DeviceKind, gpu_mib: float, host_mib: float) -> str:
    """``4,000 MiB`` on a GPU; ``813.7 MiB of host RAM`` on the CPU tier."""
    if kind is DeviceKind.CPU:
        return f"{fmt_mib(host_mib)} MiB of host RAM"
    return f"{fmt_mib(gpu_mib)} MiB"


def fmt_mib(mib: float) -> str:
    """MiB for a human: integers bare, fractions to 3 decimals (docs/placement-rules.md §4.4)."""
    rounded = round(mib, 3)
    return str(int(rounded)) if float(rounded).is_integer() else f"{rounded:.3f}"
