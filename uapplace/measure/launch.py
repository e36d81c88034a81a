"""What each registry unit would run now, for the stale-measurement rule
(:mod:`uapplace.core.staleness`; docs/placement-rules.md §4.1.1, "A measurement goes stale").

:func:`read_live_launch` asks systemd for the ``ExecStart`` of every unit a machine-local
measurement names (loaded or not: systemd loads a unit to answer) and, for the ones
running, the engine for its build (:func:`engine_build`). ``measure`` records the same
two facts at measure time (:mod:`uapplace.measure.measurer`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Collection
from typing import Any

import aiohttp

from uapplace.core.model import Registry
from uapplace.core.staleness import LiveLaunch
from uapplace.core.unitnames import unit_file_name
from uapplace.io import engines
from uapplace.io.seams import UnitControl
from uapplace.io.units import UnitError

VERSION_ROUTE = "/version"
"""vLLM's ``GET /version`` → ``{"version": "0.6.3"}``."""


async def engine_build(endpoint: str | None, http_s: float) -> str | None:
    """The build the engine reports: llama.cpp's ``/props`` ``build_info``, else vLLM's
    ``/version`` ``version``; ``None`` when it says neither (or does not answer). Neither
    route wakes a sleeping engine."""
    if endpoint is None:
        return None
    try:
        build = (await engines.props(endpoint, timeout_s=http_s)).get("build_info")
    except engines.EngineError:
        build = None
    if isinstance(build, str) and build:
        return build
    return await _vllm_version(endpoint, http_s)


async def _vllm_version(endpoint: str, http_s: float) -> str | None:
    url = f"{engines.engine_root(endpoint)}{VERSION_ROUTE}"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=http_s)) as session,
            session.get(url) as response,
        ):
            if response.status != 200:
                return None
            body: Any = json.loads(await response.text())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    version = body.get("version") if isinstance(body, dict) else None
    return version if isinstance(version, str) and version else None


async def read_live_launch(
    registry: Registry,
    units: UnitControl,
    http_s: float = engines.PROBE_TIMEOUT_S,
    only: Collection[str] | None = None,
) -> dict[str, LiveLaunch]:
    """Unit file name → :class:`LiveLaunch` for every unit of a machine-local measured
    config (only the unit files ``only`` names, when given); a unit systemd cannot read is
    left out (not compared)."""
    wanted: dict[str, str | None] = {}
    for model in registry.models.values():
        for config in model.configs.values():
            unit = model.unit_for(config)
            if only is not None and (not unit or unit_file_name(unit) not in only):
                continue
            if unit and config.provenance == "local" and config.measured_at is not None:
                wanted.setdefault(unit_file_name(unit), model.endpoint_for(config))
    found = await asyncio.gather(*(_one(u, e, units, http_s) for u, e in wanted.items()))
    return {live.unit: live for live in found if live is not None}


async def _one(
    unit: str, endpoint: str | None, units: UnitControl, http_s: float
) -> LiveLaunch | None:
    try:
        state = await units.state(unit)
    except UnitError:
        return None
    if state.load_state not in ("loaded", "") or not state.exec_start:
        return None
    build = await engine_build(endpoint, http_s) if state.active_state == "active" else None
    return LiveLaunch(unit, state.exec_start, build)
