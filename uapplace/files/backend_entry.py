"""A generated backend's model entry in the machine-local registry (``uapplace unit add``).

``uapplace unit add NAME`` writes the unit from a template and, here, the model ``NAME``
into ``$UAP_HOME/model-registry.json``: ``display``, ``engine``, ``unit``, ``endpoint``,
``advertises``, an affinity device when given, and one config with ``status:
"unmeasured"``: it places nothing until ``uapplace measure NAME`` records its footprint
(docs/placement-rules.md §4.1: only measured figures of this machine count).

The same discipline as :mod:`uapplace.files.registry_write`: re-read the file, change
one model, validate the whole document against the local schema, replace it atomically.
An entry is ours while its ``unit`` is the generated unit's name: :func:`remove_local_model`
leaves any other entry of that name alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.registry_schema import json_path
from uapplace.files.registry_write import read_local, replace_local


def _models(doc: dict[str, Any], path: Path) -> dict[str, Any]:
    models = doc.setdefault("models", {})
    if not isinstance(models, dict):
        raise ConfigFileError(path, "$.models", "expected a JSON object")
    return models


def write_local_model(path: Path, key: str, entry: Mapping[str, Any], replace: bool) -> None:
    """Add model ``key`` (replacing one of that name only with ``replace``)."""
    doc = read_local(path)
    models = _models(doc, path)
    if key in models and not replace:
        raise ConfigFileError(
            path,
            json_path(("models", key)),
            f"the local registry already has a model {key!r} (--force replaces it)",
        )
    models[key] = dict(entry)
    replace_local(path, doc)


def remove_local_model(path: Path, key: str, unit: str) -> bool:
    """Remove model ``key`` when its ``unit`` is ``unit``; whether it was removed."""
    doc = read_local(path)
    models = _models(doc, path)
    entry = models.get(key)
    if not isinstance(entry, dict) or entry.get("unit") != unit:
        return False
    del models[key]
    replace_local(path, doc)
    return True
