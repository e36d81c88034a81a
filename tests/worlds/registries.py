"""Registry documents for worlds whose engines are real processes on one simulated GPU.

The systemd tier runs each model as a unit of the fake engine on the simulated
24 GiB ``gpu0`` (:mod:`uapplace.sim.gpu`'s device 0) and writes a registry naming
those units. What such a registry holds is written here once:

- :func:`sim_devices`: ``gpu0`` (the simulated card) and ``cpu0`` (this machine's
  memory, :func:`host_mib`);
- :func:`measured`: a config measured on ``gpu0`` (the figures the daemon accepts as
  this machine's own);
- :func:`unit_model`: a llama.cpp model served by a unit, its one config named
  after its initial (``alpha`` → ``a1``);
- :func:`unit_registry`: the whole document for a set of such models.

Each call returns a fresh document, so a test may change its copy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

from uapplace.sim.gpu import sim_uuid

MEASURED_AT = "2026-10-08T14:02:00Z"
SIM_GPU_MIB = 24576
"""The simulated card's size (the systemd tier's ``sim_gpu`` makes one of this size)."""


class Served(Protocol):
    """Where a model runs: a unit (its name) serving at an endpoint (``EngineUnit``)."""

    @property
    def name(self) -> str: ...

    @property
    def endpoint(self) -> str: ...


def host_mib() -> int:
    """This machine's physical memory, in MiB."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20)


def sim_devices() -> dict[str, Any]:
    """``gpu0``: the simulated card, nothing reserved; ``cpu0``: this machine's memory."""
    return {
        "gpu0": {
            "kind": "gpu",
            "name": "Simulated GPU 0",
            "total_mib": SIM_GPU_MIB,
            "reserved_mib": 0,
            "uuid": sim_uuid(0),
        },
        "cpu0": {"kind": "cpu", "total_mib": host_mib(), "reserved_mib": 256},
    }


def measured(mib: int, **extra: Any) -> dict[str, Any]:
    """A config measured on ``gpu0`` at :data:`MEASURED_AT`, holding ``mib`` resident;
    ``extra`` adds keys (``kv``, ``pause_lever``)."""
    return {
        "resident_gpu_mib": mib,
        "host_rss_mib": 64,
        "kv_resident_cells": 32768,
        "context_pool_cells": 32768,
        **extra,
        "measured_at": MEASURED_AT,
        "measured_on": "gpu0",
    }


def unit_model(model: str, unit: Served, config: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """``model`` on llama.cpp, served by ``unit``, with one config ``<initial>1`` (a
    :func:`measured` document); ``extra`` adds entry keys (``advertises``, ``service``)."""
    return {
        "display": model.title(),
        "engine": "llama.cpp",
        "unit": unit.name,
        "endpoint": unit.endpoint,
        **extra,
        "configs": {f"{model[0]}1": config},
    }


def unit_registry(
    engines: Mapping[str, Served], mib: Mapping[str, int], *, advertise: bool = False
) -> dict[str, Any]:
    """A registry of :func:`unit_model` entries on :func:`sim_devices`, one per engine,
    measured at its ``mib``; ``advertise``: each model also answers to ``<model>-latest``."""
    return {
        "version": 1,
        "devices": sim_devices(),
        "models": {
            model: unit_model(
                model,
                unit,
                measured(mib[model]),
                **({"advertises": [f"{model}-latest"]} if advertise else {}),
            )
            for model, unit in engines.items()
        },
    }
