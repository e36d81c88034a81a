"""The model registry: repo + machine-local merge, provenance, which figures count here
(docs/placement-rules.md §4.1, §9.1).

Two files describe the machine. ``config/model-registry.json`` (the repo) carries the
shape: devices, models, config names, advertised ids, units. ``$UAP_HOME/model-registry.json``
(the machine-local file) carries this box's measurements. The loader deep-merges the
local file over the repo file:

- per device, **per field** (a local ``reserved_mib`` replaces the repo's, the rest stays);
- per model, per field, and **per config whole** (a local config entry replaces the
  repo's config entry outright; a config only the repo names keeps the repo's content).

Every config and every device field records which file it came from, so
``uapplace validate`` can attribute a wrong number.

A broken repo file raises :class:`ConfigFileError`. A broken local file does not: the
error travels in :attr:`RegistryLoad.errors` and, when the caller hands in the local
document it last took (``last_good``: the daemon's reload does, as it does for the capacity
policy), that version stays merged over the repo (:attr:`RegistryLoad.local_kept`);
otherwise (the CLI, the daemon's first read) the repo defaults load and everything the
local file would have measured stays unmeasured and fails closed.

The files' schema is :mod:`uapplace.files.registry_schema`; ``uapplace measure`` writes the
machine-local file through :mod:`uapplace.files.registry_write`; unit names are checked by
:mod:`uapplace.core.unitnames`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from uapplace.core.model import (
    Config,
    ConfigStatus,
    Device,
    DeviceIdentity,
    DeviceKind,
    DeviceReading,
    Envelope,
    Model,
    ProbeSource,
    Provenance,
    Registry,
    parse_iso,
)
from uapplace.files import jsonfile
from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.proxyenv import ProxyUpstream, read_proxy_upstream
from uapplace.files.registry_schema import (
    DeviceDoc,
    EnvelopeDoc,
    LocalRegistryDoc,
    MeasuredConfigDoc,
    MeasuredDeviceDoc,
    ModelDoc,
    RegistryDoc,
    UnmeasuredConfigDoc,
    config_tag,
    json_path,
    parse_doc,
    raise_all,
)

# --------------------------------------------------------------------------- merge


@dataclass(frozen=True)
class RegistryLoad:
    """The merged registry and how it was made."""

    registry: Registry
    errors: tuple[ConfigFileError, ...]
    """Problems with the local file as it is now; when not empty, that file was not taken
    (whole): the last good version stays in force when :attr:`local_kept`, else nothing."""
    repo_path: Path
    local_path: Path | None
    model_provenance: Mapping[str, Mapping[str, Provenance]] = field(default_factory=dict)
    """Per model, per top-level field (``configs`` excluded): which file it came from."""
    device_mismatches: tuple[ConfigFileError, ...] = ()
    """Local measurements whose recorded device is not the device the probe sees now
    (:func:`gate_on_devices`); each such config is untrusted in :attr:`registry`."""
    local_doc: LocalRegistryDoc | None = None
    """The machine-local document merged in (``None``: repo defaults only); the
    ``last_good`` of the next :func:`load_registry`."""
    local_kept: bool = False
    """The local file is broken (:attr:`errors`) and :attr:`local_doc` is the last good
    version read before, still in force."""
    proxy_stated: bool = False
    """``proxy.single_upstream`` is written in the repo file or the local document in force
    (a URL, or ``null``: the operator says the proxy routes by ``target_id``)."""
    proxy_upstream: ProxyUpstream | None = None
    """The stock proxy's one upstream as its environment file names it
    (:mod:`uapplace.files.proxyenv`), when the loader was given that file."""

    @property
    def local_state(self) -> str:
        """``loaded`` (the local file as it is now), ``last-good`` (broken; the version read
        before stays), ``ignored`` (broken, nothing good before: repo defaults) or ``none``."""
        if self.local_kept:
            return "last-good"
        if self.errors:
            return "ignored"
        return "loaded" if self.local_doc is not None else "none"

    def file_for(self, provenance: Provenance) -> Path:
        """The file an entry with this provenance came from."""
        if provenance == "local" and self.local_path is not None:
            return self.local_path
        return self.repo_path


@dataclass(frozen=True)
class _Sources:
    repo: RegistryDoc
    local: LocalRegistryDoc | None
    repo_path: Path
    local_path: Path | None

    def file(self, provenance: Provenance) -> Path:
        if provenance == "local" and self.local_path is not None:
            return self.local_path
        return self.repo_path


def _origin(name: str, overlay: Mapping[str, Any]) -> Provenance:
    return "local" if name in overlay else "repo"


def _merge_device(src: _Sources, key: str) -> Device:
    base = src.repo.devices[key].model_dump(exclude_unset=True) if key in src.repo.devices else {}
    local_devices = src.local.devices if src.local else {}
    over = local_devices[key].model_dump(exclude_unset=True) if key in local_devices else {}
    merged = {**base, **over}
    doc = parse_doc(DeviceDoc, merged, src.file("local"), ("devices", key))
    return Device(
        key=key,
        kind=DeviceKind(doc.kind),
        total_mib=doc.total_mib,
        reserved_mib=doc.reserved_mib,
        name=doc.name,
        uuid=doc.uuid,
        reserve_reason=doc.reserve_reason,
        provenance={name: _origin(name, over) for name in merged},
    )


def _config(
    key: str,
    doc: MeasuredConfigDoc | UnmeasuredConfigDoc,
    origin: Provenance,
    src: _Sources,
    model_build: str | None,
) -> Config:
    if isinstance(doc, UnmeasuredConfigDoc):
        return Config(
            key=key,
            status=ConfigStatus.UNMEASURED,
            unit=doc.unit,
            endpoint=doc.endpoint,
            provenance=origin,
            start_timeout_s=doc.start_timeout_s,
            pause_lever=doc.pause_lever,
        )
    return Config(
        key=key,
        status=ConfigStatus.MEASURED,
        resident_gpu_mib=doc.resident_gpu_mib,
        host_rss_mib=doc.host_rss_mib,
        context_pool_cells=doc.context_pool_cells,
        per_session_cap_cells=doc.per_session_cap_cells,
        kv_resident_cells=doc.kv_resident_cells,
        kv_mib_per_1k_cells=doc.kv_mib_per_1k_cells,
        kv=doc.kv,
        measured_at=doc.measured_at,
        measured_on=doc.measured_on,
        flags=tuple(doc.flags),
        unit=doc.unit,
        endpoint=doc.endpoint,
        provenance=origin,
        measured_device=_identity(doc.measured_device),
        engine_build=doc.engine_build,
        exec_start_sha256=doc.exec_start_sha256,
        measured_build=doc.measured_build,
        untrusted=_untrusted(doc, origin, src, model_build),
        start_s=doc.start_s,
        envelope=_envelope(doc.envelope),
        start_timeout_s=doc.start_timeout_s,
        pause_lever=doc.pause_lever,
    )


def _envelope(doc: EnvelopeDoc | None) -> Envelope | None:
    if doc is None:
        return None
    return Envelope(**doc.model_dump())


def _identity(doc: MeasuredDeviceDoc | None) -> DeviceIdentity | None:
    if doc is None:
        return None
    return DeviceIdentity(name=doc.name, uuid=doc.uuid, total_mib=doc.total_mib)


def _untrusted(
    doc: MeasuredConfigDoc, origin: Provenance, src: _Sources, model_build: str | None
) -> str:
    """Why a measured entry's figures do not count here (docs/placement-rules.md §4.1), or ``""``.

    Figures in the repo file describe some machine, not necessarily this one: only the
    machine-local file (written by ``uapplace measure`` or the operator) is a measurement
    of this box. A figure taken with another engine build than the one the registry says
    is installed (``engine_build`` on the model) is stale.
    """
    if origin == "repo":
        local = src.local_path if src.local_path is not None else "$UAP_HOME/model-registry.json"
        return (
            f"measured only in the repo file {src.repo_path}: its figures are descriptive; "
            f"measured figures count only from the machine-local file {local} "
            "(`uapplace measure` writes it)"
        )
    if doc.engine_build is not None and doc.engine_build != model_build:
        current = f"engine build {model_build!r}" if model_build else "no engine_build"
        return (
            f"measured with engine build {doc.engine_build!r} but the registry declares "
            f"{current} for the model: the figures are stale"
        )
    return ""


INHERITED_CONFIG_FIELDS = ("pause_lever", "start_timeout_s", "unit", "endpoint")
"""What a config declares rather than measures: a machine-local entry for the same config
(a measurement) that does not set one keeps the repo's (issue 21 item 6: a local
measurement no longer hides the repo's ``pause_lever``). Figures are never mixed."""


def _config_fields(
    repo: MeasuredConfigDoc | UnmeasuredConfigDoc | None,
    chosen: MeasuredConfigDoc | UnmeasuredConfigDoc,
) -> dict[str, Any]:
    fields = chosen.model_dump(exclude_unset=True)
    if repo is None or repo is chosen:
        return fields
    declared = repo.model_dump(exclude_unset=True)
    for name in INHERITED_CONFIG_FIELDS:
        if name in declared and name not in fields:
            fields[name] = declared[name]
    return fields


def _merge_model(src: _Sources, key: str) -> tuple[Model, dict[str, Provenance]]:
    repo_doc = src.repo.models.get(key)
    over_doc = src.local.models.get(key) if src.local else None
    base = repo_doc.model_dump(exclude_unset=True, exclude={"configs"}) if repo_doc else {}
    over = over_doc.model_dump(exclude_unset=True, exclude={"configs"}) if over_doc else {}
    repo_configs = dict(repo_doc.configs) if repo_doc else {}
    local_configs = dict(over_doc.configs) if over_doc else {}
    configs = {**repo_configs, **local_configs}
    merged = {
        **base,
        **over,
        "configs": {k: _config_fields(repo_configs.get(k), c) for k, c in configs.items()},
    }
    doc = parse_doc(ModelDoc, merged, src.file("local"), ("models", key))
    model = Model(
        key=key,
        display=doc.display,
        engine=doc.engine,
        configs={
            name: _config(name, config, _origin(name, local_configs), src, doc.engine_build)
            for name, config in doc.configs.items()
        },
        unit=doc.unit,
        endpoint=doc.endpoint,
        launch=doc.launch,
        profile=doc.profile,
        service=doc.service,
        rails=doc.rails,
        rails_source=doc.rails_source,
        task_affinity=tuple(doc.task_affinity),
        affinity_devices=tuple(doc.affinity.device) if doc.affinity else (),
        advertises=tuple(doc.advertises),
        engine_build=doc.engine_build,
    )
    return model, {name: _origin(name, over) for name in {**base, **over}}


def _ordered_keys(repo: Iterable[str], local: Iterable[str]) -> list[str]:
    keys = list(repo)
    keys += [k for k in local if k not in keys]
    return keys


def _reference_errors(
    src: _Sources,
    devices: Mapping[str, Device],
    models: Mapping[str, Model],
    model_provenance: Mapping[str, Mapping[str, Provenance]],
) -> list[ConfigFileError]:
    """Device names a model or config uses must be declared (in the merged devices)."""
    declared = ", ".join(devices) or "none"
    errors: list[ConfigFileError] = []
    for model in models.values():
        origin = model_provenance[model.key].get("affinity", "repo")
        for index, device in enumerate(model.affinity_devices):
            if device not in devices:
                errors.append(
                    ConfigFileError(
                        src.file(origin),
                        json_path(("models", model.key, "affinity", "device", index)),
                        f"unknown device {device!r} (declared: {declared})",
                    )
                )
        for config in model.configs.values():
            if config.measured_on is not None and config.measured_on not in devices:
                errors.append(
                    ConfigFileError(
                        src.file(config.provenance),
                        json_path(("models", model.key, "configs", config.key, "measured_on")),
                        f"unknown device {config.measured_on!r} (declared: {declared})",
                    )
                )
    # The repo's own mistakes first: they are fatal, the local file's are not.
    return sorted(errors, key=lambda err: err.file != src.repo_path)


def _build(src: _Sources) -> tuple[Registry, dict[str, dict[str, Provenance]]]:
    local_devices = src.local.devices if src.local else {}
    local_models = src.local.models if src.local else {}
    devices = {
        key: _merge_device(src, key) for key in _ordered_keys(src.repo.devices, local_devices)
    }
    models: dict[str, Model] = {}
    model_provenance: dict[str, dict[str, Provenance]] = {}
    for key in _ordered_keys(src.repo.models, local_models):
        models[key], model_provenance[key] = _merge_model(src, key)
    raise_all(_reference_errors(src, devices, models, model_provenance))
    registry = Registry(devices=devices, models=models, single_upstream=_single_upstream(src))
    return registry, model_provenance


def _single_upstream(src: _Sources) -> str | None:
    """The local file's ``proxy.single_upstream`` when it names the key, else the repo's."""
    local = src.local.proxy if src.local is not None else None
    if local is not None and "single_upstream" in local.model_fields_set:
        return local.single_upstream
    return src.repo.proxy.single_upstream if src.repo.proxy is not None else None


def load_registry(
    repo_path: Path,
    local_path: Path | None,
    last_good: LocalRegistryDoc | None = None,
    proxy_env: Path | None = None,
) -> RegistryLoad:
    """Load the repo registry and merge the machine-local one over it.

    Raises :class:`ConfigFileError` only when the repo file is invalid. A local file
    that is unreadable or invalid is not taken whole (a half-applied measurement file is
    worse than none) and reported in :attr:`RegistryLoad.errors`; ``last_good`` (the
    local document a previous load took) is then merged instead, when it still fits the
    repo file, else the repo defaults load. A missing local file is normal: repo only.
    ``proxy_env``: the stock proxy's environment file, read for its one upstream
    (:attr:`RegistryLoad.proxy_upstream`).
    """
    repo = parse_doc(RegistryDoc, jsonfile.read_json(repo_path, trusted=True), repo_path)
    load = _merged(repo, repo_path, local_path, last_good)
    return replace(
        load,
        proxy_stated=_proxy_stated(repo, load.local_doc),
        proxy_upstream=read_proxy_upstream(proxy_env) if proxy_env is not None else None,
    )


def _proxy_stated(repo: RegistryDoc, local: LocalRegistryDoc | None) -> bool:
    return any(
        doc is not None
        and doc.proxy is not None
        and "single_upstream" in doc.proxy.model_fields_set
        for doc in (repo, local)
    )


def _merged(
    repo: RegistryDoc, repo_path: Path, local_path: Path | None, last_good: LocalRegistryDoc | None
) -> RegistryLoad:
    """The repo document with the local file (or ``last_good``) merged over it."""
    if local_path is None or not local_path.exists():
        registry, provenance = _build(_Sources(repo, None, repo_path, local_path))
        return RegistryLoad(registry, (), repo_path, local_path, provenance)
    try:
        local = parse_doc(
            LocalRegistryDoc, jsonfile.read_json(local_path, trusted=True), local_path
        )
        registry, provenance = _build(_Sources(repo, local, repo_path, local_path))
        return RegistryLoad(registry, (), repo_path, local_path, provenance, local_doc=local)
    except ConfigFileError as err:
        if err.file == repo_path:
            raise
        errors = err.every()
    if last_good is not None:
        try:
            registry, provenance = _build(_Sources(repo, last_good, repo_path, local_path))
        except ConfigFileError:
            pass  # the repo file changed under it: repo defaults, as with nothing kept
        else:
            return RegistryLoad(
                registry,
                errors,
                repo_path,
                local_path,
                provenance,
                local_doc=last_good,
                local_kept=True,
            )
    registry, provenance = _build(_Sources(repo, None, repo_path, local_path))
    return RegistryLoad(registry, errors, repo_path, local_path, provenance)


# --------------------------------------------------------------------------- this machine


_TOTAL_MIB_SLACK = 1.0
"""NVML reports bytes; a MiB of rounding between a recorded and a live total is the same card."""


def gate_on_devices(load: RegistryLoad, readings: Mapping[str, DeviceReading]) -> RegistryLoad:
    """Mark every local measurement taken on another device class as unknown.

    docs/placement-rules.md §4.1: ``measured_on`` gates reuse of a figure.

    A config records the device it was measured on (``measured_device``: name, UUID,
    total MiB, as ``uapplace measure`` read them). When the probe now reads a different
    card under that key, the figures describe another machine: the config is untrusted
    (never loaded, never a victim by its figures) and a mismatch names the file and field.

    Decisions where docs/placement-rules.md is silent:

    - A device the probe cannot read now (absent) is not compared: nothing loads on it
      anyway, and the next reload compares again.
    - A local config with ``measured_on`` and no ``measured_device`` (written by hand, or
      before identities were recorded) is accepted when its device key exists: the local
      file is this machine's own statement, and there is nothing recorded to disagree with.
    - Only the fields both sides have are compared (the simulated GPU and NVML give UUID,
      total and name; a recorded field absent from the reading is not held against it).
    """
    mismatches: list[ConfigFileError] = []
    models: dict[str, Model] = {}
    for model in load.registry.models.values():
        configs: dict[str, Config] = {}
        for config in model.configs.values():
            problem = _device_problem(config, readings)
            if problem is None:
                configs[config.key] = config
                continue
            field_name, message = problem
            path = json_path(("models", model.key, "configs", config.key, *field_name))
            mismatches.append(ConfigFileError(load.file_for(config.provenance), path, message))
            configs[config.key] = replace(config, untrusted=message)
        models[model.key] = replace(model, configs=configs)
    registry = replace(load.registry, models=models)
    return replace(load, registry=registry, device_mismatches=tuple(mismatches))


def _device_problem(
    config: Config, readings: Mapping[str, DeviceReading]
) -> tuple[tuple[str, ...], str] | None:
    recorded = config.measured_device
    if config.untrusted or recorded is None or config.measured_on is None:
        return None
    reading = readings.get(config.measured_on)
    if reading is None or reading.source is ProbeSource.ABSENT:
        return None
    where = f"measured on {config.measured_on}"
    if recorded.uuid and reading.uuid and recorded.uuid != reading.uuid:
        return ("measured_device", "uuid"), (
            f"{where} = device {recorded.uuid}, but {config.measured_on} is now "
            f"{reading.uuid}: the figures are unknown for this device"
        )
    if recorded.total_mib is not None and abs(recorded.total_mib - reading.total_mib) > (
        _TOTAL_MIB_SLACK
    ):
        return ("measured_device", "total_mib"), (
            f"{where} with {recorded.total_mib} MiB total, but {config.measured_on} now "
            f"reads {reading.total_mib:.0f} MiB: another device class, the figures are unknown"
        )
    if recorded.name and reading.name and recorded.name != reading.name:
        return ("measured_device", "name"), (
            f"{where} = {recorded.name!r}, but {config.measured_on} is now {reading.name!r}: "
            "another device class, the figures are unknown"
        )
    return None


def measurement_status(config: Config) -> str:
    """For ``validate``: whether a config's figures count here, in a few words."""
    if config.status is ConfigStatus.UNMEASURED:
        return "unmeasured"
    if config.untrusted:
        return f"not counted: {config.untrusted}"
    if not config.is_measured:
        return "incomplete: no measured_at"
    return "measured here (machine-local)"


def local_measurements(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A machine-local registry document holding every measured config of ``doc``.

    For sandboxes (the demo, the tests, the benchmarks) that describe a machine in one
    registry document: write ``doc`` as the repo file and this as
    ``$UAP_HOME/model-registry.json`` so the sandbox's figures are this machine's own,
    exactly as ``uapplace measure`` would have recorded them.
    """
    models: dict[str, Any] = {}
    for key, model in (doc.get("models") or {}).items():
        measured = {
            name: dict(config)
            for name, config in (model.get("configs") or {}).items()
            if config_tag(config) == "measured"
        }
        if measured:
            models[key] = {"configs": measured}
    return {"version": 1, "models": models}


def provenance_rows(load: RegistryLoad) -> list[dict[str, str]]:
    """Which file each device field, model field and config came from, for ``validate``.

    Each row: ``kind`` (``device`` | ``model`` | ``config``), ``entry`` (JSON path of the
    entry), ``field`` (``*`` for a whole config), ``source`` (``repo`` | ``local``),
    ``file``; config rows add ``measurement`` (:func:`measurement_status`: whether the
    figures count on this machine).
    """
    rows: list[dict[str, str]] = []

    def add(kind: str, entry: str, field_name: str, source: Provenance) -> None:
        rows.append(
            {
                "kind": kind,
                "entry": entry,
                "field": field_name,
                "source": source,
                "file": str(load.file_for(source)),
            }
        )

    for device in load.registry.devices.values():
        for field_name, source in device.provenance.items():
            add("device", json_path(("devices", device.key)), field_name, source)
    for model in load.registry.models.values():
        for field_name, source in load.model_provenance.get(model.key, {}).items():
            add("model", json_path(("models", model.key)), field_name, source)
        for config in model.configs.values():
            entry = json_path(("models", model.key, "configs", config.key))
            add("config", entry, "*", config.provenance)
            rows[-1]["measurement"] = measurement_status(config)
            if config.envelope is not None:
                rows[-1]["envelope"] = envelope_summary(config.envelope)
    return rows


ENVELOPE_MAX_AGE_DAYS = 30.0
"""An envelope older than this is flagged stale by ``validate``: a driver, engine or
disk change in a month moves start times, and re-measuring costs one planned downtime.
Still used (a stale envelope beats the blind defaults); the flag asks for a re-measure."""


def envelope_summary(envelope: Envelope) -> str:
    """One line for ``validate``: ``stop 2s · memory back 2.5s · cold start 20s · …``."""
    parts = [
        f"stop {envelope.stop_s:g}s",
        f"memory back {envelope.free_s:g}s",
        f"cold start {envelope.cold_start_s:g}s",
        f"warm start {envelope.warm_start_s:g}s",
    ]
    if envelope.sleep_s is not None:
        freed = envelope.sleep_freed_mib
        parts.append(f"sleep {envelope.sleep_s:g}s" + (f" frees {freed:,.0f} MiB" if freed else ""))
    if envelope.wake_s is not None:
        parts.append(f"wake {envelope.wake_s:g}s")
    return f"{' · '.join(parts)} (measured {envelope.measured_at} on {envelope.measured_on})"


def envelope_staleness(
    config: Config, now: float, max_age_days: float = ENVELOPE_MAX_AGE_DAYS
) -> str | None:
    """Why ``config``'s envelope is stale (for ``validate``), ``None`` when it is fresh or
    absent. Stale: measured before the config's footprint (the footprint was re-measured,
    so the engine or its flags may have changed since), on another device than the
    footprint, or more than ``max_age_days`` ago."""
    envelope = config.envelope
    if envelope is None:
        return None
    taken = parse_iso(envelope.measured_at)
    if config.measured_at is not None and taken < parse_iso(config.measured_at):
        return (
            f"envelope measured {envelope.measured_at}, before the footprint "
            f"({config.measured_at}): re-measure with `uapplace measure --envelope`"
        )
    if config.measured_on is not None and envelope.measured_on != config.measured_on:
        return (
            f"envelope measured on {envelope.measured_on}, the footprint on "
            f"{config.measured_on}: re-measure with `uapplace measure --envelope`"
        )
    age_days = (now - taken) / 86400
    if age_days > max_age_days:
        return (
            f"envelope is {age_days:.0f} days old (measured {envelope.measured_at}; stale "
            f"after {max_age_days:g}): re-measure with `uapplace measure --envelope`"
        )
    return None
