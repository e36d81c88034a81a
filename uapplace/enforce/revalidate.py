"""Revalidation, the first step of every run: what the run will do, if it still may.

**revalidate** recomputes the options now (planner on fresh residents, readings
and in-flight) and refuses with :class:`~uapplace.core.errors.Drifted` when the
approved option is gone or its victim signature differs from what the operator
approved ("victim set changed"). Nothing has been touched yet. Otherwise it
returns the run's :class:`~uapplace.enforce.run.Target`: the model and config
that start (or the paused resident that wakes), the victims, which of them
pause rather than stop, which are llama.cpp router models (unloaded in their router
whatever the action, their unit never stopped), where a router model that starts is
loaded, and the pending entry the run resolves (docs/placement-rules.md §4.2, "What
paused is").

A refusal is recorded as a failed ``revalidate`` step and raised (``Drifted``,
``UnknownModel``, ``NotFound``, ``Busy`` or ``Failed``), so the bus call fails
with that error rather than returning a result. Called by :mod:`uapplace.enforce.enforcer`
(one function per public verb: :func:`option_target`, :func:`load_target`,
:func:`unload_target`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from uapplace.core.errors import Busy, Drifted, Failed, NotFound, UnknownModel
from uapplace.core.model import (
    Option,
    OptionKind,
    PendingEntry,
    Registry,
    Resident,
    ResidentKey,
    ResidentState,
    resident_key,
)
from uapplace.core.steps import REVALIDATE
from uapplace.core.unitnames import unit_file_name, valid_unit_name
from uapplace.core.victims import config_of
from uapplace.enforce.host import EnforcementHost
from uapplace.enforce.run import (
    Run,
    Target,
    option_signature_drift,
    option_text,
    same_placement,
    signature_drift,
)
from uapplace.io.router import is_router_config, router_slot


async def option_target(
    host: EnforcementHost,
    run: Run,
    entry: PendingEntry,
    approved: Option,
    signature: tuple[str, ...],
) -> Target:
    """``Apply``: the approved option of ``entry`` as it stands now, or a refusal.

    The signature names each victim's action (``@pause``), so it must be the approved
    option's own: a stop form's signature never approves the pause form it sits next to,
    nor the other way round (docs/bus-api.md, "The approval signature")."""
    if host.pending_entry(entry.id) is None:
        # A run that waited its turn (the auto runner's) for an entry dismissed meanwhile.
        raise _refuse(
            run,
            NotFound(
                f"placement {entry.id} is no longer pending (dismissed, expired or resolved "
                "while the run waited its turn): nothing to apply"
            ),
        )
    fresh = await host.plan_for(entry.requested_model, entry.cells)
    mismatch = option_signature_drift(approved, signature)
    if mismatch is not None:
        raise _refuse(run, mismatch)
    reuse = next((o for o in fresh.options if o.kind is OptionKind.REUSE), None)
    if reuse is not None:
        return _reuse_target(host, run, entry.requested_model, reuse, entry)
    same = [o for o in fresh.options if same_placement(o, approved)]
    if not same:
        now = "; ".join(option_text(o) for o in fresh.options) or "no option at all"
        why = f" ({'; '.join(fresh.infeasible)})" if fresh.infeasible else ""
        raise _refuse(
            run,
            Drifted(
                f"the approved option ({option_text(approved)}) no longer exists; "
                f"options now: {now}{why}"
            ),
        )
    chosen = next((o for o in same if o.signature == signature), None)
    if chosen is None:
        raise _refuse(
            run,
            Drifted(
                f"victim set changed: approved [{', '.join(signature) or 'none'}], "
                f"now [{', '.join(same[0].signature) or 'none'}]; look at the preview again"
            ),
        )
    return _option_target(host, run, "apply", entry.requested_model, chosen, entry)


async def load_target(
    host: EnforcementHost, run: Run, model: str, cells: int, signature: tuple[str, ...]
) -> Target:
    """``Load``: the planner's recommended option now, if it stops what was approved."""
    registry = host.registry()
    if registry.lookup(model) is None:
        raise _refuse(run, UnknownModel(f"model {model!r} is in no registry file"))
    fresh = await host.plan_for(model, cells)
    if not fresh.options:
        why = "; ".join(fresh.infeasible) or fresh.reason.value
        raise _refuse(run, Failed(f"no way to load {model} now: {why}"))
    # The first placement; of its stop and pause forms (issue 12), the one approved.
    chosen = next(
        (
            o
            for o in fresh.options
            if same_placement(o, fresh.options[0]) and o.signature == signature
        ),
        fresh.options[0],
    )
    drift = signature_drift(signature, chosen.signature)
    if drift is not None:
        raise _refuse(run, drift)
    if chosen.kind is OptionKind.REUSE:
        return _reuse_target(host, run, model, chosen, None)
    return _option_target(host, run, "load", model, chosen, None)


async def unload_target(
    host: EnforcementHost, run: Run, model: str, signature: tuple[str, ...]
) -> Target:
    """``Unload``: every resident serving ``model``, if that is what was approved."""
    registry = host.registry()
    resolved = registry.lookup(model)
    if resolved is None:
        raise _refuse(run, UnknownModel(f"model {model!r} is in no registry file"))
    found = resolved[0]
    victims = tuple(r for r in host.residents() if r.model == found.key)
    if not victims:
        raise _refuse(run, NotFound(f"{found.key} is not resident: nothing to unload"))
    drift = signature_drift(signature, (r.signature for r in victims))
    if drift is not None:
        raise _refuse(run, drift)
    _check_victim_units(run, victims)
    held = [h for r in victims for h in host.holds(r)]
    if held:
        who = ", ".join(f"{h.client} ({h.detail})" if h.detail else h.client for h in held)
        raise _refuse(run, Busy(f"{found.key} is held on the bus by {who}"))
    devices = sorted({r.device for r in victims})
    run.record(
        REVALIDATE,
        True,
        f"unload {', '.join(r.signature for r in victims)} from {', '.join(devices)}",
    )
    return Target(
        kind="unload",
        requested=model,
        model=found,
        config=None,
        device=devices[0],
        cost_mib=0.0,
        victims=victims,
        new_unit=None,
        routed=_routed(registry, victims),
    )


def _reuse_target(
    host: EnforcementHost, run: Run, requested: str, option: Option, entry: PendingEntry | None
) -> Target:
    resident = next(
        (
            r
            for r in host.residents()
            if (r.model, r.config, r.device) == (option.model, option.config, option.device)
        ),
        None,
    )
    if resident is None:
        raise _refuse(run, Drifted(f"{option.model}/{option.config} on {option.device} went away"))
    run.record(
        REVALIDATE,
        True,
        f"{requested} is already served by {resident.signature} on {resident.device}: "
        "nothing to stop or start",
    )
    model = host.registry().models[option.model]
    return Target(
        kind="apply",
        requested=requested,
        model=model,
        config=model.configs.get(option.config),
        device=option.device,
        cost_mib=option.cost_mib,
        victims=(),
        new_unit=None,
        reuse=resident,
        entry=entry,
    )


def _option_target(
    host: EnforcementHost,
    run: Run,
    kind: Literal["apply", "load"],
    requested: str,
    option: Option,
    entry: PendingEntry | None,
) -> Target:
    registry = host.registry()
    model = registry.models.get(option.model)
    config = model.configs.get(option.config) if model is not None else None
    if model is None or config is None:
        raise _refuse(run, Drifted(f"{option.model}/{option.config} is no longer in the registry"))
    unit = model.unit_for(config)
    if unit is None or not valid_unit_name(unit):
        raise _refuse(
            run,
            Failed(
                f"{model.key}/{config.key} has no usable systemd unit ({unit!r}); "
                "enforcement only starts registry units"
            ),
        )
    wanted = {f"{v.model}/{v.config}": v.action for v in option.victims}
    victims = tuple(
        r for r in host.residents() if r.signature in wanted and r.device == option.device
    )
    if len(victims) != len(wanted):
        raise _refuse(run, Drifted("a victim is no longer resident; look at the preview"))
    _check_victim_units(run, victims)
    pause = frozenset(resident_key(r) for r in victims if wanted[r.signature] == "pause")
    wake = _paused_twin(host, run, option) if option.kind is OptionKind.WAKE else None
    slot = router_slot(model, config)
    if config.is_router_model and slot is None:
        raise _refuse(
            run,
            Failed(
                f"{model.key}/{config.key} is a llama.cpp router model (pause_lever "
                "llamacpp-router) without a unit and an endpoint for its router"
            ),
        )
    run.record(REVALIDATE, True, f"{option_text(option)}: still valid")
    return Target(
        kind=kind,
        requested=requested,
        model=model,
        config=config,
        device=option.device,
        cost_mib=option.cost_mib,
        victims=victims,
        new_unit=None if wake is not None else unit_file_name(unit),
        entry=entry,
        pause=pause,
        wake=wake,
        router=slot if wake is None else None,
        routed=_routed(registry, victims),
    )


def _routed(registry: Registry, victims: Iterable[Resident]) -> frozenset[ResidentKey]:
    """The victims that are llama.cpp router models (their router unloads them)."""
    return frozenset(resident_key(v) for v in victims if is_router_config(config_of(registry, v)))


def _paused_twin(host: EnforcementHost, run: Run, option: Option) -> Resident:
    """The paused resident a ``wake`` option wakes; ``Drifted`` when it went away."""
    twin = next(
        (
            r
            for r in host.residents()
            if (r.model, r.config, r.device) == (option.model, option.config, option.device)
            and r.state is ResidentState.PAUSED
        ),
        None,
    )
    if twin is None or twin.endpoint is None:
        raise _refuse(
            run, Drifted(f"{option.model}/{option.config} is no longer paused on {option.device}")
        )
    return twin


def _check_victim_units(run: Run, victims: Iterable[Resident]) -> None:
    unitless = [v.signature for v in victims if not v.unit or not valid_unit_name(v.unit)]
    if unitless:
        raise _refuse(
            run,
            Failed(
                f"{', '.join(unitless)} run without a systemd unit: enforcement cannot "
                "stop them (no unit is a distinct state, never zero cost: "
                "docs/placement-rules.md §8)"
            ),
        )


def _refuse(run: Run, err: Exception) -> Exception:
    run.record(REVALIDATE, False, str(err))
    return err
