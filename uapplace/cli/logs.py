"""``uapplace logs MODEL``: the last lines MODEL's unit wrote, or each new one (``--follow``).

docs/placement-rules.md §4.6 ("Failed start"). MODEL (a model key, a config key or an
advertised id) is resolved to its unit as the daemon sees it (:func:`resolve_unit`): the
unit of the resident serving it (``GetState``), else the registry's unit for it, read
from the files the daemon names in ``GetState`` (without a daemon, from this
environment's files, as ``status`` and ``validate`` fall back). The user manager then
says where that unit writes and which run is its latest
(:class:`~uapplace.io.units.LogFacts`), and :mod:`uapplace.io.unitlogs` reads the lines
from the same places a failed start's step detail does. The lines go to stdout (one per
line, stripped of escape sequences and control characters), the header to stderr.

Called by :mod:`uapplace.cli.app`; ``uapplace top`` may call :func:`resolve_unit` and
:func:`unit_state` for its own view of a model's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from uapplace.bus.util import user_bus_address
from uapplace.cli.session import (
    EXIT_NOT_FOUND,
    EXIT_REFUSED,
    EXIT_USAGE,
    Unreachable,
    call_or,
    err,
    fail,
)
from uapplace.core.model import Model, Registry
from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.paths import Paths
from uapplace.files.registry import load_registry
from uapplace.io import unitlogs
from uapplace.io.units import UnitError, UnitManager, UnitState, unit_name

DEFAULT_LINES = 50
"""Lines ``uapplace logs`` prints unless ``--lines`` says otherwise."""


@dataclass(frozen=True)
class ModelUnit:
    """The unit a model's lines are read from, and how it was found."""

    model: str
    """The registry's model key."""
    unit: str
    """``<name>.service``."""
    how: str
    """``its resident alpha/alpha-f32`` or ``the registry``."""


def resolve_unit(model_id: str) -> ModelUnit:
    """MODEL's unit (module doc); exits 7 for an unknown model or one without a unit."""
    state: dict[str, Any] | None = call_or(lambda c: c.get_state(), _no_daemon)
    repo, local = _registry_files(state)
    try:
        registry = load_registry(repo, local).registry
    except ConfigFileError as error:
        fail(EXIT_REFUSED, f"cannot read the registry to find {model_id!r}'s unit: {error}")
    found = registry.lookup(model_id)
    if found is None:
        files = ", ".join(str(p) for p in (repo, local) if p is not None)
        fail(
            EXIT_NOT_FOUND,
            f"unknown model {model_id!r}: no model, config or advertised id of the "
            f"registry ({files})",
        )
    model, config = found
    resident = _resident_unit(state, model.key, config.key if config is not None else None)
    if resident is not None:
        unit, how = resident
    else:
        unit, how = _registry_unit(registry, model, config.key if config else None), "the registry"
    try:
        return ModelUnit(model.key, unit_name(unit), how)
    except ValueError as error:
        fail(EXIT_USAGE, f"model {model.key}: {error}")


def _no_daemon(_: Unreachable) -> None:
    return None


def _registry_files(state: dict[str, Any] | None) -> tuple[Path, Path | None]:
    """The registry files the daemon reads (``GetState``), else this environment's."""
    named = (state or {}).get("registry") or {}
    if isinstance(named.get("repo"), str):
        local = named.get("local")
        return Path(named["repo"]), Path(local) if isinstance(local, str) else None
    paths = Paths.from_env()
    return paths.repo_registry, paths.local_registry


def _resident_unit(
    state: dict[str, Any] | None, model: str, config: str | None
) -> tuple[str, str] | None:
    """The unit of the resident serving ``model`` (``config`` when one is named)."""
    for row in (state or {}).get("residents") or []:
        if row.get("model") != model or (config is not None and row.get("config") != config):
            continue
        if isinstance(row.get("unit"), str) and row["unit"]:
            return row["unit"], f"its resident {model}/{row.get('config')}"
    return None


def _registry_unit(registry: Registry, model: Model, config: str | None) -> str:
    """The registry's unit for ``model`` (its ``config``'s when named); exits 7 when it
    names none, or several and no config says which."""
    if config is not None:
        unit = model.unit_for(model.configs[config])
        if unit is None:
            fail(EXIT_NOT_FOUND, f"{model.key}/{config} has no unit in the registry: no log")
        return unit
    if model.unit is not None:
        return model.unit
    units = {key: c.unit for key, c in model.configs.items() if c.unit}
    if len(set(units.values())) == 1:
        return next(iter(units.values()))
    if not units:
        fail(EXIT_NOT_FOUND, f"model {model.key} has no unit in the registry: no log to read")
    listed = ", ".join(f"{key}: {unit}" for key, unit in sorted(units.items()))
    fail(
        EXIT_USAGE,
        f"model {model.key} runs under several units ({listed}) and none is resident: "
        "name the config (uapplace logs CONFIG)",
    )


async def unit_state(unit: str) -> UnitState:
    """``unit`` as the user manager reports it (``LogFacts`` included)."""
    async with UnitManager(user_bus_address(), in_process=True) as units:
        return await units.state(unit)


def _read_state(found: ModelUnit) -> UnitState:
    try:
        state = asyncio.run(unit_state(found.unit))
    except UnitError as error:
        fail(EXIT_REFUSED, f"cannot ask the user manager about {found.unit}: {error}")
    except Exception as error:  # pystemd's own, when no user manager answers on the bus
        first = (str(error) or type(error).__name__).splitlines()[0]
        fail(EXIT_REFUSED, f"no systemd user manager answers about {found.unit}: {first}")
    if state.load_state == "not-found":
        fail(
            EXIT_NOT_FOUND,
            f"{found.unit} (model {found.model}, from {found.how}) is not a unit the user "
            f"manager knows: {state.load_error or 'not-found'}",
        )
    return state


def show(model_id: str, lines: int, follow: bool, as_json: bool) -> None:
    """``uapplace logs``: print the lines (module doc); exit 1 when there are none."""
    found = resolve_unit(model_id)
    state = _read_state(found)
    if follow:
        _follow(found, state, lines, as_json)
        return
    tail = asyncio.run(unitlogs.last_lines(found.unit, state.log_facts, lines))
    if as_json:
        _write_line(json.dumps(_tail_json(found, tail), indent=2))
    elif tail.lines:
        err.print(f"{tail.header()}, model {found.model} (unit from {found.how}):", markup=False)
        for line in tail.lines:
            _write_line(line)
    if not tail.lines:
        fail(EXIT_REFUSED, f"{found.unit} (model {found.model}): {tail.missing}")


def _tail_json(found: ModelUnit, tail: unitlogs.LogTail) -> dict[str, Any]:
    return {
        "model": found.model,
        "unit": found.unit,
        "unit_from": found.how,
        "source": tail.source or None,
        "lines": list(tail.lines),
        "missing": tail.missing or None,
    }


def _follow(found: ModelUnit, state: UnitState, lines: int, as_json: bool) -> None:
    try:
        asyncio.run(_follow_until_stopped(found, state, lines, as_json))
    except unitlogs.NoLog as error:
        fail(EXIT_REFUSED, f"{found.unit} (model {found.model}): {error}")


async def _follow_until_stopped(
    found: ModelUnit, state: UnitState, lines: int, as_json: bool
) -> None:
    """Print each line as it comes until Ctrl-C or SIGTERM (then exit 0)."""
    followed = await unitlogs.follow(found.unit, state.log_facts, lines)
    err.print(
        f"following {found.unit} (model {found.model}) from {followed.source}; Ctrl-C stops",
        markup=False,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(number, stop.set)

    async def pump() -> None:
        async for line in followed.lines:
            _write_line(json.dumps({"unit": found.unit, "line": line}) if as_json else line)

    pumping = asyncio.ensure_future(pump())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({pumping, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        pumping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pumping
        await followed.lines.aclose()


def _write_line(line: str) -> None:
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `uapplace logs … | head`: the reader has what it wanted
        with contextlib.suppress(OSError):
            sys.stdout.close()
        raise SystemExit(0) from None
