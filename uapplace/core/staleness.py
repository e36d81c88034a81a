"""Stale measurements (docs/placement-rules.md §4.1.1, "A measurement goes stale"; issue 21
item 3): a footprint counts only while the engine runs as it was measured.

``uapplace measure`` records, beside the figures, the launch it read them under: the
arguments of the unit's live ``ExecStart`` (``flags``), the SHA-256 of the whole
``ExecStart`` (program included: ``exec_start_sha256``) and the build the engine itself
reported (``measured_build``: llama.cpp ``/props`` ``build_info``, vLLM ``/version``).
Compared with what systemd and the engine say *now* (:class:`LiveLaunch`), a config is
stale when

- the unit's ``ExecStart`` is another one (the unit file or a drop-in changed since the
  measurement: a different program, or other flags), or
- the engine reports another build than the one measured.

A stale config is unknown (``Config.untrusted``): never loaded, never a victim by its
figures, and ``validate`` reports an error naming the field (:func:`gate_on_launch`).
What cannot be read now (a unit systemd does not know, an engine that is not running or
does not say its build) is not compared: nothing is held against a fact nobody saw. Nor
is a measurement that recorded no digest (written by hand, or before the digest was
recorded): its ``flags`` may be a partial description, never the whole launch line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace

from uapplace.core.model import Config, Registry
from uapplace.core.unitnames import unit_file_name


@dataclass(frozen=True)
class LiveLaunch:
    """A unit as it would run now: its ``ExecStart`` and its engine's reported build."""

    unit: str
    exec_start: str | None
    """systemd's ``ExecStart`` (``UnitState.exec_start``); ``None``: not known now."""
    build: str | None = None
    """What the running engine reports as its build; ``None``: not running or silent."""


@dataclass(frozen=True)
class Staleness:
    """Why one measured config does not count now, and which recorded field says so."""

    model: str
    config: str
    field: str
    message: str


def exec_start_digest(exec_start: str) -> str:
    """The SHA-256 (hex) a measurement records of the unit's live ``ExecStart``."""
    return hashlib.sha256(exec_start.encode("utf-8")).hexdigest()


def exec_start_args(exec_start: str) -> tuple[str, ...]:
    """The arguments of each command of ``exec_start`` after its program (``flags``)."""
    return tuple(arg for command in exec_start.split("; ") for arg in command.split()[1:])


def stale_reason(config: Config, live: LiveLaunch) -> tuple[str, str] | None:
    """``(field, why)`` when ``config``'s measurement was taken under another launch than
    ``live``, else ``None``. Only machine-local measurements are compared."""
    if config.provenance != "local" or config.measured_at is None:
        return None
    when = f"measured at {config.measured_at}"
    recorded = config.exec_start_sha256
    if live.exec_start is not None and recorded and exec_start_digest(live.exec_start) != recorded:
        now = exec_start_args(live.exec_start)
        if tuple(config.flags) != now:
            return "flags", (
                f"{when} with flags `{' '.join(config.flags)}` but {live.unit}'s live "
                f"ExecStart runs `{' '.join(now)}` (the unit file or a drop-in changed "
                "since): the figures are stale, re-measure"
            )
        return "exec_start_sha256", (
            f"{when} under another ExecStart of {live.unit} than it has now (the unit "
            f"file or a drop-in changed since: `{live.exec_start}`): the figures are "
            "stale, re-measure"
        )
    if live.build is not None and config.measured_build and live.build != config.measured_build:
        return "measured_build", (
            f"{when} on engine build {config.measured_build!r} but the engine reports "
            f"{live.build!r} now: the figures are stale, re-measure"
        )
    return None


def gate_on_launch(
    registry: Registry, live: Mapping[str, LiveLaunch]
) -> tuple[Registry, tuple[Staleness, ...]]:
    """``registry`` with every stale config made unknown (``untrusted`` names why), and
    the stale configs. ``live`` is keyed by unit file name (``uap-alpha.service``)."""
    found: list[Staleness] = []
    models = dict(registry.models)
    for model in registry.models.values():
        configs: dict[str, Config] = {}
        for config in model.configs.values():
            unit = model.unit_for(config)
            seen = live.get(unit_file_name(unit)) if unit else None
            reason = stale_reason(config, seen) if seen is not None else None
            if reason is None or config.untrusted:
                configs[config.key] = config
                continue
            found.append(Staleness(model.key, config.key, *reason))
            configs[config.key] = replace(config, untrusted=reason[1])
        if configs != model.configs:
            models[model.key] = replace(model, configs=configs)
    if not found:
        return registry, ()
    return replace(registry, models=models), tuple(found)
