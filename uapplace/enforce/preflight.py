"""The preflight check: what is about to start can start, before anything stops.

Pure: :func:`preflight_problems` takes the facts (:class:`PreflightFacts`: the
unit's state and ``ExecStart=`` binaries, the config's provenance, a fresh host
reading) and names every problem at once. The enforcement step that gathers the
facts and records the ``preflight`` step is :func:`uapplace.enforce.steps.preflight`.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from uapplace.core.model import (
    Config,
    ConfigStatus,
    Device,
    DeviceReading,
    ProbeSource,
    Resident,
)
from uapplace.io.units import (
    DOWN_STATES,
    UnitState,
    state_text,
    units_of,
)

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- preflight


@dataclass(frozen=True)
class PreflightFacts:
    """What the preflight looked at for the unit a run is about to start."""

    unit: str
    state: UnitState | None
    """``None`` when the user manager could not be asked (``unit_error`` says why)."""
    unit_error: str
    binaries: Mapping[str, str]
    """Each ``ExecStart=`` binary → what is wrong with it ("" when it is executable)."""
    label: str
    """``model/config`` of what starts."""
    config: Config
    device: str
    host: Device | None
    """The registry's ``cpu`` device (the host-RAM gate), ``None`` when it has none."""
    host_reading: DeviceReading | None
    victims: tuple[Resident, ...]
    host_error: str = ""
    """Why there is no host reading at all (the probe raised), else ""."""


def preflight_problems(facts: PreflightFacts) -> list[str]:
    """Every reason the run must not stop anything, each naming unit/field and why.

    Empty when the new unit is ``loaded`` with executable ``ExecStart=`` binaries,
    its config is measured for this machine on the target device, and its
    ``host_rss_mib`` fits the host's available RAM plus what the victims free,
    minus the host reserve (the planner's host-RAM gate, on a fresh reading).
    """
    return [*_unit_problems(facts), *_measured_problems(facts), *_host_ram_problems(facts)]


def preflight_summary(facts: PreflightFacts) -> str:
    """The passing preflight's detail: the facts it checked."""
    binaries = ", ".join(facts.binaries) or "none"
    config = facts.config
    parts = [
        f"{facts.unit} loaded, ExecStart {binaries} executable",
        f"{facts.label} measured on {config.measured_on} ({config.measured_at})",
    ]
    room = _host_room(facts)
    if room is not None:
        parts.append(
            f"host RAM: needs {config.host_rss_mib or 0:,.0f} MiB, "
            f"{room:,.0f} MiB available once the victims stop"
        )
    return "; ".join(parts)


def _unit_problems(facts: PreflightFacts) -> list[str]:
    unit, state = facts.unit, facts.state
    if state is None:
        return [f"unit {unit}: its state cannot be read from the user manager ({facts.unit_error})"]
    if state.load_state != "loaded":
        why = f": {state.load_error}" if state.load_error else ""
        hint = (
            " (no unit file: install it in the user unit directory, then daemon-reload)"
            if state.load_state == "not-found"
            else ""
        )
        return [
            f"unit {unit}: LoadState is {state.load_state or 'unknown'!r}, not 'loaded'{why}{hint}"
        ]
    if not state.exec_paths:
        return [f"unit {unit}: no ExecStart= command, so nothing would start"]
    problems = [
        f"unit {unit}: ExecStart binary {path} {problem}"
        for path, problem in facts.binaries.items()
        if problem
    ]
    running = state.active_state not in DOWN_STATES
    if running and unit not in units_of(facts.victims) and not facts.config.is_router_model:
        # Not a published resident (the planner would have offered reuse), not a victim
        # that stops first: an engine nobody verified. Starting it is a no-op, and the
        # rollback would stop what ran before this run: refuse instead. (A llama.cpp
        # router's unit runs for its other models: a router model is loaded in it, and
        # its rollback unloads it, never stops the unit: docs/placement-rules.md §4.2.)
        pid = f", MainPID {state.main_pid}" if state.main_pid else ""
        problems.append(
            f"unit {unit}: already {state_text(state)}{pid} but not a verified resident; "
            "stop it, or let the unit sync verify it, before placing it"
        )
    return problems


def _measured_problems(facts: PreflightFacts) -> list[str]:
    config, label, device = facts.config, facts.label, facts.device
    if not config.is_measured:
        return [f"{label}: not measured for this machine ({_unmeasured_why(config)})"]
    if config.measured_on != device:
        where = config.measured_on or "no named device"
        return [f"{label}: measured_on is {where}, not {device}: its cost on {device} is unknown"]
    return []


def _unmeasured_why(config: Config) -> str:
    if config.untrusted:
        return config.untrusted
    if config.status is not ConfigStatus.MEASURED:
        return f"status is {config.status.value}"
    missing = [
        name
        for name, value in (
            ("measured_at", config.measured_at),
            ("resident_gpu_mib", config.resident_gpu_mib),
            ("host_rss_mib", config.host_rss_mib),
        )
        if value is None
    ]
    return f"no {', '.join(missing)}" if missing else "not placeable"


def _host_room(facts: PreflightFacts) -> float | None:
    """Host MiB available to the new config once the victims stop; ``None``: unknown."""
    host, reading = facts.host, facts.host_reading
    if host is None or reading is None or reading.source is ProbeSource.ABSENT:
        return None
    freed = sum(v.host_rss_mib or 0.0 for v in facts.victims)
    return reading.free_mib + freed - host.reserved_mib


def _host_ram_problems(facts: PreflightFacts) -> list[str]:
    need = facts.config.host_rss_mib
    if need is None:
        return []  # unmeasured: already named by the measured check
    if facts.host is None:
        return [f"host RAM gate: the registry has no cpu device, so {facts.label} is unchecked"]
    room = _host_room(facts)
    if room is None:
        why = facts.host_reading.error if facts.host_reading is not None else facts.host_error
        return [f"host RAM gate: no reading of {facts.host.key} ({why or 'absent'})"]
    if need > room + 1e-6:
        reading = facts.host_reading
        assert reading is not None
        freed = sum(v.host_rss_mib or 0.0 for v in facts.victims)
        return [
            f"host RAM gate: {facts.label} needs {need:,.0f} MiB host RAM; {facts.host.key} has "
            f"{reading.free_mib:,.0f} MiB available + {freed:,.0f} MiB the victims free − "
            f"{facts.host.reserved_mib:,} MiB reserve = {room:,.0f} MiB"
        ]
    return []


def executable_problems(paths: Iterable[str]) -> dict[str, str]:
    """Each path → "" when it is an executable regular file, else what is wrong (blocking)."""
    out: dict[str, str] = {}
    for path in paths:
        out[path] = _executable_problem(path)
    return out


def _executable_problem(path: str) -> str:
    if not os.path.isabs(path):
        return "is not an absolute path"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    if not stat.S_ISREG(mode):
        return "is not a regular file"
    if not os.access(path, os.X_OK):
        return "is not executable"
    return ""
