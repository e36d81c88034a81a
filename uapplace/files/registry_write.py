"""Writing this machine's own figures into the machine-local registry file.

``uapplace measure`` (:mod:`uapplace.measure.measurer`) records a config's footprint
(:func:`write_local_measurement`), its enforcement envelope
(:func:`write_local_envelope`) and device overrides (:func:`write_local_device`) in
``$UAP_HOME/model-registry.json``. Each call re-reads the file, changes one entry,
validates the whole document against the local schema
(:class:`~uapplace.files.registry_schema.LocalRegistryDoc`) and replaces the file
atomically (:func:`uapplace.files.jsonfile.atomic_write`): a reader (the daemon's
registry reload) sees the old file or the new one, never half of either. Blocking
file I/O: callers in the daemon run it in a thread.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from uapplace.files import jsonfile
from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.registry_schema import LocalRegistryDoc, config_tag, json_path, parse_doc


def write_local_measurement(
    local_path: Path, model: str, config: str, fields: Mapping[str, Any]
) -> None:
    """Record one config's measurement in the machine-local file, replacing that config whole.

    Everything else in the file is kept. The result is validated before the file is
    replaced, and the replacement is atomic (temp file, fsync, rename): a reader sees
    the old file or the new one, never half of either.
    """
    doc = read_local(local_path)
    models = _object_at(doc, ("models",), local_path)
    _object_at(models, ("models", model), local_path)
    configs = _object_at(models[model], ("models", model, "configs"), local_path)
    configs[config] = dict(fields)
    replace_local(local_path, doc)


def write_local_envelope(
    local_path: Path, model: str, config: str, envelope: Mapping[str, Any]
) -> None:
    """Record one config's enforcement envelope in the machine-local file.

    The envelope sits inside the config's local entry, which must already hold this
    machine's footprint (``uapplace measure MODEL CONFIG`` first): an envelope without
    a footprint could not place anything, and writing a config entry here would replace
    the repo's entry whole. Same validation and atomicity as
    :func:`write_local_measurement`. Raises :class:`ConfigFileError` naming the entry.
    """
    doc = read_local(local_path)
    entry = ((doc.get("models") or {}).get(model) or {}).get("configs", {}).get(config)
    where = json_path(("models", model, "configs", config))
    if not isinstance(entry, dict) or config_tag(entry) != "measured":
        raise ConfigFileError(
            local_path,
            where,
            f"no machine-local footprint for {model}/{config}: run `uapplace measure "
            f"{model} {config}` while it runs, then measure its envelope",
        )
    entry["envelope"] = dict(envelope)
    replace_local(local_path, doc)


def write_local_device(local_path: Path, device: str, fields: Mapping[str, Any]) -> None:
    """Override device fields (``reserved_mib``, ``total_mib``, ``uuid`` …) in the local file.

    Field-wise: fields not named keep their value. Same validation and atomicity as
    :func:`write_local_measurement`.
    """
    doc = read_local(local_path)
    devices = _object_at(doc, ("devices",), local_path)
    entry = _object_at(devices, ("devices", device), local_path)
    entry.update(fields)
    replace_local(local_path, doc)


def read_local(path: Path) -> dict[str, Any]:
    """The local registry as a JSON object (``{"version": 1}`` when there is none)."""
    if not path.exists():
        return {"version": 1}
    raw = jsonfile.read_json(path, trusted=True)
    if not isinstance(raw, dict):
        raise ConfigFileError(path, "$", "expected a JSON object at the top level")
    return raw


def _object_at(parent: dict[str, Any], loc: tuple[str, ...], file: Path) -> dict[str, Any]:
    value = parent.setdefault(loc[-1], {})
    if not isinstance(value, dict):
        raise ConfigFileError(file, json_path(loc), "expected a JSON object")
    return value


def replace_local(path: Path, doc: dict[str, Any]) -> None:
    """Validate the whole document against the local schema, then replace it atomically."""
    parse_doc(LocalRegistryDoc, doc, path)
    text = json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        jsonfile.atomic_write(path, text, mode=jsonfile.mode_of(path, 0o644))
    except OSError as exc:
        raise ConfigFileError(path, "$", f"cannot write: {exc}") from None
