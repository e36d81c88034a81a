"""What the CLI reads from the files itself, when uapplaced is not there to ask.

``status`` and ``pending`` fall back to the ledger (read-only, never moved aside:
that is the daemon's job), ``validate`` checks the registry and policy files
directly, and ``measure --envelope`` lists its steps from the registry before it
asks for consent. The ledger, registry and capacity modules build pydantic schemas
at import (~0.3 s), so only :mod:`uapplace.cli.local` imports this module: the light
app asks the bus first and execs that one when nobody answers (docs/architecture.md,
"The command line: light and local").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from uapplace.cli.session import EXIT_REFUSED, EXIT_UNREACHABLE, err, fail, out
from uapplace.files.capacity import has_errors, load_capacity_policy, timeouts_findings
from uapplace.files.capacity import validate as validate_files
from uapplace.files.jsonfile import LEDGER_MAX_BYTES, ConfigFileError, read_capped_or_none
from uapplace.files.ledger import LedgerFormatError, doc_to_json, parse_ledger_text
from uapplace.files.paths import Paths
from uapplace.files.registry import gate_on_devices, load_registry, provenance_rows
from uapplace.io.devices import make_probe

if TYPE_CHECKING:
    from uapplace.files.jsonfile import ConfigFileError


def _read_ledger(paths: Paths) -> dict[str, Any]:
    """The ledger file, read-only (never moved aside: that is the daemon's job)."""

    try:
        raw = read_capped_or_none(paths.ledger, LEDGER_MAX_BYTES)
    except ConfigFileError as error:
        fail(EXIT_UNREACHABLE, f"uapplaced is not running, and {error}")
    if raw is None:
        return {"version": 1, "devices": {}, "residents": [], "pending": [], "usage": {}}
    try:
        doc = parse_ledger_text(raw, paths.ledger)
    except LedgerFormatError as error:
        fail(
            EXIT_REFUSED,
            f"uapplaced is not running, and {paths.ledger} is corrupt ({error}); "
            "uapplaced moves it aside when it starts",
        )
    return doc_to_json(doc)


def _offline_note(paths: Paths, as_json: bool) -> str:
    note = f"uapplaced is not running; read from {paths.ledger}"
    (err if as_json else out).print(note, markup=False)
    return note


def offline_state(as_json: bool) -> dict[str, Any]:
    """What ``status`` shows without a daemon: the ledger file marked ``daemon: false``."""
    paths = Paths.from_env()
    _offline_note(paths, as_json)
    doc = _read_ledger(paths)
    doc["daemon"] = False
    doc["ledger_path"] = str(paths.ledger)
    return doc


def offline_pending(as_json: bool) -> dict[str, Any]:
    """What ``pending`` shows without a daemon: the ledger's pending list, with a note."""
    paths = Paths.from_env()
    note = _offline_note(paths, as_json)
    return {"pending": _read_ledger(paths)["pending"], "daemon": False, "note": note}


def validate_offline(as_json: bool) -> dict[str, Any]:
    """What ``validate`` shows without a daemon: the report computed here from the files."""
    (err if as_json else out).print(
        "uapplaced is not running; validated the files directly", markup=False
    )
    return validate_locally()


def _error_findings(error: ConfigFileError) -> list[dict[str, Any]]:
    return [
        {
            "severity": "error",
            "file": str(e.file),
            "json_path": e.json_path,
            "message": e.message,
        }
        for e in error.every()
    ]


def validate_locally() -> dict[str, Any]:
    """The ``Validate`` report from the files, as the daemon would compute it."""

    paths = Paths.from_env()
    try:
        loaded = load_registry(
            paths.repo_registry, paths.local_registry, proxy_env=paths.proxy_env_file
        )
        # As the daemon does: a measurement taken on another card than the probe sees is unknown.
        loaded = gate_on_devices(loaded, make_probe(paths, loaded.registry).read())
    except ConfigFileError as error:
        findings = _error_findings(error)
        return {
            "ok": False,
            "errors": len(findings),
            "warnings": 0,
            "findings": findings,
            "provenance": [],
            "daemon": False,
        }
    try:
        policy = load_capacity_policy(paths.capacity_policy)
        problems = []
    except ConfigFileError as error:
        policy = None
        problems = _error_findings(error)
    checked = validate_files(loaded, policy) + timeouts_findings(paths.enforcement_timeouts)
    findings = problems + [f.to_json() for f in checked]
    return {
        "ok": not problems and not has_errors(checked),
        "errors": sum(1 for f in findings if f["severity"] == "error"),
        "warnings": sum(1 for f in findings if f["severity"] == "warning"),
        "findings": findings,
        "provenance": provenance_rows(loaded),
        "daemon": False,
    }


def envelope_steps(model: str, config: str) -> list[str]:
    """What ``measure --envelope`` will do, from the registry files (no daemon needed)."""

    paths = Paths.from_env()
    try:
        registry = load_registry(paths.repo_registry, paths.local_registry).registry
    except ConfigFileError:
        registry = None
    resolved = registry.lookup(model) if registry is not None else None
    found = resolved[0] if resolved else None
    chosen = found.configs.get(config) if found is not None and config else None
    unit = (found.unit_for(chosen) if chosen else found.unit) if found else None
    what = f"{model}/{config}" if config else model
    steps = [
        f"drain {what}: new requests for it park, the ones in flight finish first (refused "
        "if it is held, or if they outlast the drain bound)",
        f"stop {unit or 'its unit'}: {what} goes down, requests for it wait or fail",
        "wait until the device probe shows its memory back",
        "start it (cold start) and wait until it is healthy and serves its id",
        "stop it and start it again (warm start)",
    ]
    if chosen is not None and chosen.sleep_level is not None:
        steps.append(f"sleep it (vLLM level {chosen.sleep_level}), read the memory freed, wake it")
    elif chosen is None:
        steps.append("if the config has a pause lever: sleep it, read the memory freed, wake it")
    steps.append("leave it running and record the envelope in the machine-local registry")
    return steps
