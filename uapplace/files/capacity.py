"""``config/capacity-policy.json`` and the ``uapplace validate`` cross-checks.

docs/placement-rules.md §4.1.

The capacity policy is owned by the operator's health tooling; the registry only
*references* it (a model's ``service`` names a ``services[]`` entry) and must never
contradict it. The policy file may carry fields other tools read, so unknown keys are
ignored here; the four this module reads are type-checked.

Severities in :func:`validate`:

- **error**: the files contradict each other or themselves, or an entry that claims to
  be measured cannot be trusted (it would fail closed without the operator knowing
  why, or be placed on numbers taken under different launch flags). ``uapplace
  validate`` exits 1 on any error.
- **warning**: legal, but something is unknown or will surprise the operator: a check
  that cannot be made because a number is missing, a floor that can never be met or
  that is smaller than the device's measured reserve, a config too big to ever fit,
  rails unknown.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from uapplace.core.model import Config, ConfigStatus, Device, DeviceKind, Model, Provenance
from uapplace.core.topology import single_upstream_problems
from uapplace.core.unitnames import unit_file_name, valid_unit_name
from uapplace.files import jsonfile
from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.proxyenv import several_ports_problems
from uapplace.files.registry import RegistryLoad, envelope_staleness
from uapplace.files.registry_schema import (
    MAX_LIST_ITEMS,
    MAX_TEXT_CHARS,
    NonEmpty,
    Text,
    UnitName,
    WholeMib,
    combined,
    json_path,
    validation_errors,
)
from uapplace.files.timeouts import Timeouts

MetricValue = (
    Annotated[StrictStr, Field(max_length=MAX_TEXT_CHARS)]
    | Annotated[StrictInt, Field(ge=-(2**53), le=2**53)]
    | StrictFloat
)
"""A ``metricsMustMatch`` value; an integer beyond 2**53 could not equal any metric."""

# --------------------------------------------------------------------------- policy file


class _ServiceDoc(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)

    name: NonEmpty
    unit: UnitName | None = None
    metrics_must_match: Annotated[dict[NonEmpty, MetricValue], Field(max_length=256)] = Field(
        default={}, alias="metricsMustMatch"
    )
    exec_start_must_contain: Annotated[
        list[Annotated[Text, Field(min_length=1)]], Field(max_length=MAX_LIST_ITEMS)
    ] = Field(default=[], alias="execStartMustContain")
    gpu_min_free_mib: WholeMib | None = Field(default=None, alias="gpuMinFreeMiB")


class _PolicyDoc(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    services: Annotated[list[_ServiceDoc], Field(max_length=MAX_LIST_ITEMS)]


@dataclass(frozen=True)
class ServicePolicy:
    name: str
    unit: str | None
    metrics_must_match: Mapping[str, str | int | float]
    exec_start_must_contain: tuple[str, ...]
    gpu_min_free_mib: int | None
    index: int = 0
    """Position in the file's ``services`` list, for ``$.services[i]`` paths."""

    @property
    def json_path(self) -> str:
        return json_path(("services", self.index))


@dataclass(frozen=True)
class CapacityPolicy:
    services: Mapping[str, ServicePolicy]
    path: Path | None = None


NO_POLICY_METRIC = "capacity_policy"
"""The ``metricsMustMatch`` key of :func:`refusing_policy`: no engine exports it."""


def refusing_policy(reason: str) -> ServicePolicy:
    """The service policy in force when no good capacity policy was ever loaded.

    Fail closed, never silently off: every verify-up path (enforcement, rollback,
    publication of units found running) checks ``metricsMustMatch`` against the engine's
    ``/metrics``, and this policy wants a metric no engine has, so each refuses with
    ``reason`` in its message. A policy that loaded once stays in force when its file
    later breaks (see ``Controller.policy_state``), so this is only the start-up case.
    """
    return ServicePolicy(
        name=f"(none: {reason})",
        unit=None,
        metrics_must_match={NO_POLICY_METRIC: "loaded"},
        exec_start_must_contain=(),
        gpu_min_free_mib=None,
    )


def load_capacity_policy(path: Path) -> CapacityPolicy:
    """Read and check the policy. Raises :class:`ConfigFileError` naming file and path."""
    raw = jsonfile.read_json(path, trusted=True)
    try:
        doc = _PolicyDoc.model_validate(raw)
    except ValidationError as exc:
        raise combined(validation_errors(exc, path)) from None
    services: dict[str, ServicePolicy] = {}
    for index, service in enumerate(doc.services):
        if service.name in services:
            raise ConfigFileError(
                path,
                json_path(("services", index, "name")),
                f"duplicate service name {service.name!r} "
                f"(first at {services[service.name].json_path})",
            )
        services[service.name] = ServicePolicy(
            name=service.name,
            unit=service.unit,
            metrics_must_match=dict(service.metrics_must_match),
            exec_start_must_contain=tuple(service.exec_start_must_contain),
            gpu_min_free_mib=service.gpu_min_free_mib,
            index=index,
        )
    return CapacityPolicy(services=services, path=path)


# --------------------------------------------------------------------------- findings

Severity = Literal["error", "warning"]

_KV_FLAGS = ("--kv", "--cache-type-k", "-ctk")


@dataclass(frozen=True)
class Finding:
    severity: Severity
    file: str
    json_path: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {
            "severity": self.severity,
            "file": self.file,
            "json_path": self.json_path,
            "message": self.message,
        }

    def __str__(self) -> str:
        return f"{self.severity}: {self.file}: {self.json_path}: {self.message}"


def has_errors(findings: list[Finding]) -> bool:
    """``uapplace validate`` exits 1 exactly when this is true."""
    return any(f.severity == "error" for f in findings)


@dataclass(frozen=True)
class _Checker:
    """Knows which file each registry entry came from, and where the policy lives."""

    load: RegistryLoad
    policy: CapacityPolicy | None

    def config_finding(
        self, severity: Severity, model: Model, config: Config, field: str, message: str
    ) -> Finding:
        path = json_path(("models", model.key, "configs", config.key, field))
        return Finding(severity, self._file(config.provenance), path, message)

    def model_finding(
        self, severity: Severity, model: Model, loc: tuple[str | int, ...], message: str
    ) -> Finding:
        field = str(loc[0]) if loc else ""
        origin = self.load.model_provenance.get(model.key, {}).get(field, "repo")
        return Finding(
            severity, self._file(origin), json_path(("models", model.key, *loc)), message
        )

    def device_finding(
        self, severity: Severity, device: Device, field: str, message: str
    ) -> Finding:
        origin = device.provenance.get(field, "repo")
        path = json_path(("devices", device.key, field))
        return Finding(severity, self._file(origin), path, message)

    def policy_finding(
        self, severity: Severity, service: ServicePolicy, field: str, message: str
    ) -> Finding:
        return Finding(severity, self.policy_file, f"{service.json_path}.{field}", message)

    @property
    def policy_file(self) -> str:
        if self.policy is None or self.policy.path is None:
            return "capacity-policy.json"
        return str(self.policy.path)

    def policy_ref(self, service: ServicePolicy, field: str) -> str:
        return f"{self.policy_file} {service.json_path}.{field}"

    def _file(self, origin: Provenance) -> str:
        return str(self.load.file_for(origin))


def validate(load: RegistryLoad, policy: CapacityPolicy | None) -> list[Finding]:
    """Every cross-check of the merged registry, and of the registry against the policy.

    Errors (exit 1): an ignored local file (each of its problems); ``reserved_mib`` above
    ``total_mib``; an invalid unit name; an affinity naming an undeclared device; a
    measured config with no ``measured_at`` (it silently fails closed), or whose
    ``measured_on`` is missing or not a declared device (a GPU, or ``cpu0`` for a
    CPU-only engine), or with no ``kv_resident_cells``
    (its cost is unknown for every request); ``kv_resident_cells`` or
    ``per_session_cap_cells`` above ``context_pool_cells``; one id (model key or
    advertised id) claimed by two models; a model's ``service`` missing from the
    policy, or naming a service whose unit none of its configs runs under; a
    ``metricsMustMatch`` value (``kv``, ``max_context``, ``n_ctx``) the config contradicts; launch
    flags lacking an ``execStartMustContain`` entry; a ``gpuMinFreeMiB`` above what the
    device can ever have free with the config resident (it can never hold).

    Warnings: ``rails`` unknown; a config key shared by two models; a
    ``metricsMustMatch`` key the registry has no number for; a config that can never
    fit its device or the host; a ``gpuMinFreeMiB`` below the device's ``reserved_mib`` (the
    placement layer uses ``reserved_mib``, never that floor: docs/placement-rules.md §4.1.1); no
    policy at all.
    """
    check = _Checker(load, policy)
    registry = load.registry
    findings: list[Finding] = [_load_error(err, load.local_kept) for err in load.errors]
    for device in registry.devices.values():
        findings.extend(_device_rules(check, device))
    findings.extend(_identity_rules(check))
    for model in registry.models.values():
        findings.extend(_model_rules(check, model))
        for config in model.configs.values():
            findings.extend(_config_rules(check, model, config))
    findings.extend(_policy_rules(check))
    findings.extend(_trust_rules(check))
    findings.extend(topology_findings(load))
    return list(dict.fromkeys(findings))


def timeouts_findings(path: Path) -> list[Finding]:
    """``enforcement-timeouts.json`` checked as uapplaced reads it (:meth:`Timeouts.load`):
    each problem an error naming the file and key; none for a missing file (the defaults)."""
    try:
        Timeouts.load(path)
    except ConfigFileError as err:
        return [
            Finding(
                "error",
                str(e.file),
                e.json_path,
                f"{e.message} (uapplaced keeps the timeouts it has: the defaults at start, "
                "the last good file after a SIGHUP)",
            )
            for e in err.every()
        ]
    return []


def topology_findings(load: RegistryLoad) -> list[Finding]:
    """With ``proxy.single_upstream`` set, every model or config the proxy cannot reach
    after a switch is an error (:func:`uapplace.core.topology.single_upstream_problems`);
    then the registry's ports against the stock proxy's own upstream, or several ports
    with no word on how the proxy routes
    (:func:`uapplace.files.proxyenv.several_ports_problems`)."""
    findings = [
        Finding(p.severity, str(load.repo_path), json_path(p.where), p.message)
        for p in several_ports_problems(load.registry, load.proxy_stated, load.proxy_upstream)
    ]
    upstream = load.registry.single_upstream
    if upstream is None:
        return findings
    for problem in single_upstream_problems(load.registry, upstream):
        where: tuple[str, ...] = ("models", problem.model)
        if problem.config is not None:
            where += ("configs", problem.config)
        path = json_path((*where, "endpoint"))
        findings.append(Finding("error", str(load.repo_path), path, problem.message))
    return findings


def _trust_rules(check: _Checker) -> Iterator[Finding]:
    """Whether each config's figures count on this machine (docs/placement-rules.md §4.1).

    A config measured only in the repo file is a warning: legal, descriptive, and placed
    as unmeasured until ``uapplace measure`` records it locally. A local measurement
    taken on another device (``measured_device``) or another engine build is an error:
    the machine-local file says something false about this machine.
    """
    for err in check.load.device_mismatches:
        yield Finding("error", str(err.file), err.json_path, err.message)
    for model in check.load.registry.models.values():
        for config in model.configs.values():
            if config.status is not ConfigStatus.MEASURED or not config.untrusted:
                continue
            if config.provenance == "repo":
                entry = json_path(("models", model.key, "configs", config.key))
                message = f"{config.untrusted}; it is treated as unmeasured (no_measured_config)"
                yield Finding("warning", str(check.load.repo_path), entry, message)
            elif config.engine_build is not None and config.engine_build != model.engine_build:
                yield check.config_finding("error", model, config, "engine_build", config.untrusted)


def _load_error(err: ConfigFileError, kept: bool) -> Finding:
    if kept:
        return Finding(
            "error",
            str(err.file),
            err.json_path,
            f"{err.message} (this file was not taken; uapplaced keeps the last good version "
            "it read before until it is fixed)",
        )
    return Finding(
        "error",
        str(err.file),
        err.json_path,
        f"{err.message} (this file was ignored; repo defaults are in use, and their figures "
        "are descriptive: no config counts as measured until it is fixed)",
    )


# --------------------------------------------------------------------------- registry rules


def _device_rules(check: _Checker, device: Device) -> Iterator[Finding]:
    if device.reserved_mib > device.total_mib:
        yield check.device_finding(
            "error",
            device,
            "reserved_mib",
            f"reserved_mib {device.reserved_mib} exceeds total_mib {device.total_mib}",
        )


def _identity_rules(check: _Checker) -> Iterator[Finding]:
    """An id the proxy may send must name one model; config keys are ids too."""
    claims: dict[str, list[tuple[Model, str]]] = {}
    for model in check.load.registry.models.values():
        claims.setdefault(model.key, []).append((model, "key"))
        for advertised in model.advertises:
            claims.setdefault(advertised, []).append((model, "advertises"))
        for config_key in model.configs:
            claims.setdefault(config_key, []).append((model, "configs"))
    for model_id, owners in claims.items():
        models = list(dict.fromkeys(m.key for m, _ in owners))
        if len(models) < 2:
            continue
        only_configs = all(kind == "configs" for _, kind in owners)
        last_model, last_kind = owners[-1]
        loc: tuple[str | int, ...] = (last_kind,) if last_kind != "key" else ()
        yield check.model_finding(
            "warning" if only_configs else "error",
            last_model,
            loc,
            f"id {model_id!r} is claimed by models {', '.join(models)}: "
            f"a request for it resolves to {models[0]} only",
        )


def _model_rules(check: _Checker, model: Model) -> Iterator[Finding]:
    devices = check.load.registry.devices
    if model.rails is None:
        yield check.model_finding(
            "warning", model, ("rails",), "rails unknown; concurrency not trusted"
        )
    if model.unit is not None and not valid_unit_name(model.unit):
        yield check.model_finding("error", model, ("unit",), f"invalid unit name {model.unit!r}")
    for index, device in enumerate(model.affinity_devices):
        if device not in devices:
            yield check.model_finding(
                "error",
                model,
                ("affinity", "device", index),
                f"unknown device {device!r} (declared: {', '.join(devices) or 'none'})",
            )


def _config_rules(check: _Checker, model: Model, config: Config) -> Iterator[Finding]:
    if config.unit is not None and not valid_unit_name(config.unit):
        yield check.config_finding(
            "error", model, config, "unit", f"invalid unit name {config.unit!r}"
        )
    if config.status is not ConfigStatus.MEASURED:
        return
    if config.measured_at is None:
        yield check.config_finding(
            "error",
            model,
            config,
            "measured_at",
            "measured config has no measured_at: it is not placeable and fails closed",
        )
    if config.kv_resident_cells is None:
        yield check.config_finding(
            "error",
            model,
            config,
            "kv_resident_cells",
            "measured config has no kv_resident_cells: its cost is unknown for every "
            "request, so it is never placeable",
        )
    yield from _measured_on_rule(check, model, config)
    yield from _envelope_rule(check, model, config)
    yield from _cell_rules(check, model, config)
    yield from _never_fits_rules(check, model, config)


def _envelope_rule(check: _Checker, model: Model, config: Config) -> Iterator[Finding]:
    """A stale envelope (:func:`uapplace.files.registry.envelope_staleness`) is a warning: it
    still bounds the waits, but it may no longer describe this engine."""
    why = envelope_staleness(config, time.time())
    if why is not None:
        yield check.config_finding("warning", model, config, "envelope", why)


def _measured_on_rule(check: _Checker, model: Model, config: Config) -> Iterator[Finding]:
    """``measured_on`` must be a declared device: a GPU, or the host device (``cpu0``) for
    a CPU-only engine whose footprint is host RAM alone (issue 12's CPU tier)."""
    devices = check.load.registry.devices
    if config.measured_on is not None and config.measured_on in devices:
        return
    declared = ", ".join(devices) or "none"
    if config.measured_on is None:
        problem = "measured config has no measured_on"
    else:
        problem = f"measured_on {config.measured_on!r} is not a declared device"
    yield check.config_finding(
        "error", model, config, "measured_on", f"{problem} (declared devices: {declared})"
    )


def _cell_rules(check: _Checker, model: Model, config: Config) -> Iterator[Finding]:
    pool = config.context_pool_cells
    if pool is None:
        return
    for field, cells in (
        ("kv_resident_cells", config.kv_resident_cells),
        ("per_session_cap_cells", config.per_session_cap_cells),
    ):
        if cells is not None and cells > pool:
            yield check.config_finding(
                "error",
                model,
                config,
                field,
                f"{field} {cells} exceeds context_pool_cells {pool}",
            )


def _never_fits_rules(check: _Checker, model: Model, config: Config) -> Iterator[Finding]:
    registry = check.load.registry
    device = registry.devices.get(config.measured_on or "")
    if device is not None and config.resident_gpu_mib is not None:
        budget = device.total_mib - device.reserved_mib
        if config.resident_gpu_mib > budget:
            yield check.config_finding(
                "warning",
                model,
                config,
                "resident_gpu_mib",
                f"resident_gpu_mib {config.resident_gpu_mib:g} exceeds {device.key}'s "
                f"budget {budget} (total_mib − reserved_mib): it can never be loaded there",
            )
    host = registry.host()
    if host is not None and config.host_rss_mib is not None:
        budget = host.total_mib - host.reserved_mib
        if config.host_rss_mib > budget:
            yield check.config_finding(
                "warning",
                model,
                config,
                "host_rss_mib",
                f"host_rss_mib {config.host_rss_mib:g} exceeds {host.key}'s budget "
                f"{budget} (total_mib − reserved_mib): it can never be loaded",
            )


# --------------------------------------------------------------------------- policy rules


def _policy_rules(check: _Checker) -> Iterator[Finding]:
    if check.policy is None:
        yield Finding(
            "warning",
            check.policy_file,
            "$",
            "no capacity policy loaded: metricsMustMatch, execStartMustContain and "
            "gpuMinFreeMiB cross-checks skipped",
        )
        return
    for model in check.load.registry.models.values():
        if model.service is None:
            continue
        service = check.policy.services.get(model.service)
        if service is None:
            known = ", ".join(check.policy.services) or "none"
            yield check.model_finding(
                "error",
                model,
                ("service",),
                f"service {model.service!r} is not in {check.policy_file} (services: {known})",
            )
            continue
        yield from _service_rules(check, model, service)


def _runs_under(model: Model, config: Config, unit: str) -> bool:
    own = model.unit_for(config)
    return own is not None and unit_file_name(own) == unit_file_name(unit)


def _service_rules(check: _Checker, model: Model, service: ServicePolicy) -> Iterator[Finding]:
    configs = list(model.configs.values())
    if service.unit is not None:
        configs = [c for c in configs if _runs_under(model, c, service.unit)]
        if not configs:
            units = sorted({u for c in model.configs.values() if (u := model.unit_for(c))})
            yield check.model_finding(
                "error",
                model,
                ("service",),
                f"{check.policy_ref(service, 'unit')} is {service.unit!r}, but no config of "
                f"{model.key} runs under it (its units: {', '.join(units) or 'none'})",
            )
    measured = [c for c in configs if c.status is ConfigStatus.MEASURED]
    for config in measured:
        yield from _metrics_rules(check, model, config, service)
        yield from _exec_start_rules(check, model, config, service)
        yield from _floor_budget_rule(check, model, config, service)
    yield from _floor_below_reserve_rule(check, model, measured, service)


def _flag_value(flags: tuple[str, ...], names: tuple[str, ...]) -> str | None:
    for index, flag in enumerate(flags):
        name, eq, value = flag.partition("=")
        if name in names:
            if eq:
                return value
            if index + 1 < len(flags):
                return flags[index + 1]
    return None


def _same(expected: str | int | float, actual: str | int | float) -> bool:
    if isinstance(expected, int | float) and isinstance(actual, int | float):
        return expected == actual
    return str(expected).strip().lower() == str(actual).strip().lower()


def _metrics_rules(
    check: _Checker, model: Model, config: Config, service: ServicePolicy
) -> Iterator[Finding]:
    """``kv`` against the config's KV dtype, ``max_context`` against its context pool,
    ``n_ctx`` (llama.cpp's ``/props``: one slot's context) against its per-session cap."""
    stated: dict[str, tuple[str, str | int | float | None]] = {
        "kv": ("kv", config.kv),
        "max_context": ("context_pool_cells", config.context_pool_cells),
        "n_ctx": ("per_session_cap_cells", config.per_session_cap_cells),
    }
    if config.kv is None:
        stated["kv"] = ("flags", _flag_value(config.flags, _KV_FLAGS))
    for key, expected in service.metrics_must_match.items():
        if key not in stated:
            continue  # a metric the registry holds no number for; the doctor checks it live
        field, actual = stated[key]
        ref = check.policy_ref(service, f"metricsMustMatch.{key}")
        if actual is None:
            yield check.config_finding(
                "warning",
                model,
                config,
                field,
                f"cannot check {ref} = {expected!r}: the config states no {key}",
            )
        elif not _same(expected, actual):
            yield check.config_finding(
                "error",
                model,
                config,
                field,
                f"{field} is {actual!r} but {ref} requires {expected!r}",
            )


def _contains_run(tokens: list[str], needle: list[str]) -> bool:
    width = len(needle)
    return any(tokens[i : i + width] == needle for i in range(len(tokens) - width + 1))


def _exec_start_rules(
    check: _Checker, model: Model, config: Config, service: ServicePolicy
) -> Iterator[Finding]:
    # Token runs, not substrings: "-c 2293760" must not satisfy "-c 229376".
    tokens = " ".join(config.flags).split()
    for index, entry in enumerate(service.exec_start_must_contain):
        if not _contains_run(tokens, entry.split()):
            ref = check.policy_ref(service, f"execStartMustContain[{index}]")
            yield check.config_finding(
                "error",
                model,
                config,
                "flags",
                f"launch flags lack {entry!r}, required by {ref}: the footprint was "
                "measured under a different launch line than the policy runs",
            )


def _floor_budget_rule(
    check: _Checker, model: Model, config: Config, service: ServicePolicy
) -> Iterator[Finding]:
    floor = service.gpu_min_free_mib
    device = check.load.registry.devices.get(config.measured_on or "")
    if floor is None or device is None or config.resident_gpu_mib is None:
        return
    free_budget = device.total_mib - device.reserved_mib - config.resident_gpu_mib
    if floor > free_budget:  # a contradiction, not a doubt: an error (issue 21 item 8)
        yield check.policy_finding(
            "error",
            service,
            "gpuMinFreeMiB",
            f"gpuMinFreeMiB {floor} can never hold with {model.key}/{config.key} resident on "
            f"{device.key}: at most {free_budget:g} MiB stays free ({device.total_mib} total "
            f"− {device.reserved_mib} reserved − {config.resident_gpu_mib:g} resident)",
        )


def _floor_below_reserve_rule(
    check: _Checker, model: Model, measured: list[Config], service: ServicePolicy
) -> Iterator[Finding]:
    floor = service.gpu_min_free_mib
    if floor is None:
        return
    registry = check.load.registry
    keys = [c.measured_on for c in measured if c.measured_on] or list(model.affinity_devices)
    for key in dict.fromkeys(keys):
        device = registry.devices.get(key)
        if device is None or device.kind is not DeviceKind.GPU:
            continue
        if floor < device.reserved_mib:
            yield check.policy_finding(
                "warning",
                service,
                "gpuMinFreeMiB",
                f"gpuMinFreeMiB {floor} is smaller than {device.key}'s reserved_mib "
                f"{device.reserved_mib}: the floor does not cover the permanent tenant; "
                "placement budgets with reserved_mib and never inherits this floor",
            )
