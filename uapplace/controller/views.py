"""What the controller shows: ``GetState``, ``ListPending``, ``Preview``,
``PreviewUnload`` and ``Validate`` as JSON.

Read-only functions over a :class:`~uapplace.controller.controller.Controller` (only ``validate``
asks it to reload first, through its API); the bus service (``service.py``) calls them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from uapplace.controller.configstate import reload_findings
from uapplace.controller.launchcheck import launch_findings
from uapplace.controller.pending import pending_listing
from uapplace.controller.reserve import device_rooms
from uapplace.core.errors import NotFound
from uapplace.core.model import DEFAULT_CELLS
from uapplace.core.planner import plan_unload
from uapplace.core.unitnames import unit_file_name
from uapplace.files.capacity import Finding, has_errors, timeouts_findings
from uapplace.files.capacity import validate as validate_capacity
from uapplace.files.ledger import doc_to_json
from uapplace.files.registry import provenance_rows
from uapplace.files.registry_schema import json_path

if TYPE_CHECKING:
    from uapplace.controller.controller import Controller


async def state_json(controller: Controller) -> dict[str, Any]:
    """The ledger document as it is now (fresh probe, live holders) plus daemon facts."""
    readings = await controller.read_devices()
    doc = controller.document(readings, controller.residents_with_holders(None))
    out = doc_to_json(doc)
    config = controller.config.state
    load = config.registry_load
    rooms = device_rooms(load.registry, controller.residents, readings)
    for key, device in out["devices"].items():
        configured = load.registry.devices.get(key)
        if configured is not None:
            device["reserved_mib"] = configured.reserved_mib
        if key in rooms:  # what placement may still use: the planner's own count (§4.4)
            device["room_mib"] = round(rooms[key], 3)
    out["daemon"] = True
    out["daemon_version"] = controller.version
    out["holds"] = [h.to_json() for h in controller.holds.values()]
    out["alerts"] = [a.to_json() for a in controller.alerts.active()]
    out["counters"] = controller.counters.to_json()
    targets = await controller.rails.current(controller.residents, load.registry.models)
    out["targets"] = [t.to_json() for t in targets]
    reload_error = controller.reload_error
    out["registry"] = {
        "repo": str(load.repo_path),
        "local": str(load.local_path) if load.local_path else None,
        "local_errors": [str(e) for e in load.errors],
        "local_state": load.local_state,
        "reload_error": str(reload_error) if reload_error else None,
        "device_mismatches": [str(e) for e in load.device_mismatches],
        "capacity_policy": config.policy_state,
    }
    out["ledger"] = {"path": str(controller.ledger.path), "error": controller.ledger.last_error}
    return out


async def pending_live_json(controller: Controller) -> dict[str, Any]:
    """``ListPending``: the stored options with their victims' holders, in-flight
    work and consequence as they are at the time of the call (issue 13).

    The option set and its signatures stay what was planned, so an ``Apply`` still
    approves exactly what was shown; only when the residents or holds changed since
    the last re-plan is the re-plan done first (:mod:`uapplace.controller.pending`).
    """
    await controller.planning.replan_if_stale()
    inflight = await controller.inflight()
    return pending_listing(
        controller.pending_entries(),
        controller.residents_with_holders(inflight),
        controller.registry,
        inflight is not None,
    )


async def preview(controller: Controller, model: str, cells: int) -> dict[str, Any]:
    found = await controller.plan_for(model, cells or DEFAULT_CELLS)
    return found.to_json()


async def preview_unload(controller: Controller, model: str) -> dict[str, Any]:
    """What ``Unload(model)`` would stop now: ``{model, victims, signature, frees_mib,
    frees_host_mib}``.

    The same residents the enforcer stops (every resident of the model's key),
    with holders, in-flight and consequence as a displace option shows them.
    """
    key = controller.model_named(model).key
    inp = await controller.plan_input()
    try:
        victims = plan_unload(inp, key)
    except KeyError:
        raise NotFound(f"{key} is not resident: nothing to unload") from None
    return {
        "model": key,
        "victims": [v.to_json() for v in victims],
        "signature": sorted(v.signature for v in victims),
        "frees_mib": round(sum(v.frees_mib for v in victims), 3),
        "frees_host_mib": round(sum(v.frees_host_mib for v in victims), 3),
    }


async def validate(controller: Controller) -> dict[str, Any]:
    """Re-read the config files (a bad one keeps the last good), then cross-check."""
    await controller.reload()
    config = controller.config.state
    findings = reload_findings(controller.reload_error) + config.policy_findings()
    findings.extend(validate_capacity(config.registry_load, config.policy))
    findings.extend(await asyncio.to_thread(timeouts_findings, config.paths.enforcement_timeouts))
    findings.extend(await live_findings(controller))
    findings.extend(launch_findings(controller.config))
    return {
        "ok": not has_errors(findings),
        "errors": sum(1 for f in findings if f.severity == "error"),
        "warnings": sum(1 for f in findings if f.severity == "warning"),
        "findings": [f.to_json() for f in findings],
        "provenance": provenance_rows(config.registry_load),
        "capacity_policy": config.policy_json(),
    }


async def live_findings(controller: Controller) -> list[Finding]:
    """What only the running system can tell ``validate`` (issue 13): the proxy
    refusing our token (error; unreachable is a warning: it may just be down),
    and rails the registry declares that a live engine contradicts (warning)."""
    findings: list[Finding] = []
    checked = await controller.collaborators.proxy.check()
    if checked is not None:
        url, problem = checked
        token = "HTTP 401" in problem
        findings.append(Finding("error" if token else "warning", url, "$", problem))
        if token:
            controller.alerts.token_rejected(url, problem)
    load = controller.config.state.registry_load
    targets = await controller.rails.current(controller.residents, load.registry.models)
    for target in targets:
        warning = target.disagreement()
        if warning is not None:
            path = f"$.models.{target.model}.rails"
            findings.append(Finding("warning", str(load.repo_path), path, warning))
    findings.extend(await missing_units(controller))
    return findings


async def missing_units(controller: Controller) -> list[Finding]:
    """Every registry unit the user manager does not know, an error at the entry naming
    it (issue 21 item 8: the first sign was a refused preflight). Nothing is said
    without a user manager (enforcement not attached): no unit can be read then."""
    load = controller.config.state.registry_load
    named: dict[str, tuple[str, str]] = {}
    for model in load.registry.models.values():
        for config in model.configs.values():
            unit = model.unit_for(config)
            if not unit:
                continue
            where = ("configs", config.key, "unit") if config.unit else ("unit",)
            model_origin = load.model_provenance.get(model.key, {}).get("unit", "repo")
            origin = config.provenance if config.unit else model_origin
            path = json_path(("models", model.key, *where))
            named.setdefault(unit_file_name(unit), (str(load.file_for(origin)), path))
    states = await controller.enforcement.unit_states(named)
    if states is None:
        return []
    findings = []
    for unit, (file, path) in named.items():
        state = states.get(unit)
        if state is not None and state.load_state == "not-found":
            why = f" ({state.load_error})" if state.load_error else ""
            findings.append(
                Finding(
                    "error",
                    file,
                    path,
                    f"unit {unit} does not exist: systemd's LoadState is 'not-found'{why}; "
                    "install its unit file in the user unit directory, then daemon-reload",
                )
            )
    return findings
