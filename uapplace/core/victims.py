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


def consequence(state: ResidentState, busy: bool | None) -> str:
    """docs/placement-rules.md §4.5: what stopping a resident in ``state`` costs its users."""
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
        held = fmt_mib(resident.gpu_mib or 0.0)
        alternative = f"stopping instead: reload ≈ {_seconds(cold)}, frees {held} MiB"
    else:
        text = consequence(resident.state, busy)
        alternative = ""
        if level is not None:
            host = f", host RAM +{fmt_mib(grows)} MiB" if grows else ""
            alternative = (
                f"pausing instead: wake ≈ {_seconds(wake)}, frees {fmt_mib(freed)} MiB{host}"
            )
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


def fmt_mib(mib: float) -> str:
    """MiB for a human: integers bare, fractions to 3 decimals (docs/placement-rules.md §4.4)."""
    rounded = round(mib, 3)
    return str(int(rounded)) if float(rounded).is_integer() else f"{rounded:.3f}"
