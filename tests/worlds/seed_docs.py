"""The JSON documents the tiers and the benchmarks seed their worlds with.

What a measured config carries (:data:`MEASURED`), the two small models most worlds
hold (:func:`alpha_model`, :func:`beta_model`) and a ledger with ``alpha`` hot
(:func:`alpha_ledger`), written once for the unit tier's controller world
(``tests/unit/controller_fixtures.py``), the bus tier (``tests/bus/conftest.py``,
``shim_fixtures.py`` and the tests that seed their own daemons) and the daemon
benchmarks (``bench/bench_bus.py``, ``bench/flood_rss.py``), so that they cannot drift
apart. Each caller still writes its own devices and registry document; every call
returns a fresh document, so a test may change its copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

ALPHA_ENDPOINT = "http://127.0.0.1:18080"
BETA_ENDPOINT = "http://127.0.0.1:18081"
MEASURED: Mapping[str, Any] = MappingProxyType(
    {
        "host_rss_mib": 2000,
        "kv_resident_cells": 32768,
        "kv_mib_per_1k_cells": 10,
        "measured_at": "2026-01-01T00:00:00Z",
        "measured_on": "gpu0",
    }
)
"""The figures that make a config measured (machine-local only: docs/placement-rules.md §4.1)."""


def alpha_model(endpoint: str = ALPHA_ENDPOINT, **extra: Any) -> dict[str, Any]:
    """Alpha: one measured 8,000 MiB config, ``alpha-q4``; ``extra`` adds entry keys
    (``rails``, ``advertises``)."""
    return {
        "display": "Alpha",
        "engine": "llama.cpp",
        "unit": "uap-alpha",
        "endpoint": endpoint,
        **extra,
        "configs": {"alpha-q4": {"resident_gpu_mib": 8000, **MEASURED}},
    }


def beta_model() -> dict[str, Any]:
    """Beta: one measured 20,000 MiB config, ``beta-q8``: too big to sit beside alpha."""
    return {
        "display": "Beta",
        "engine": "llama.cpp",
        "unit": "uap-beta",
        "endpoint": BETA_ENDPOINT,
        "rails": 1,
        "configs": {"beta-q8": {"resident_gpu_mib": 20000, **MEASURED}},
    }


def alpha_resident(endpoint: str = ALPHA_ENDPOINT) -> dict[str, Any]:
    """A ledger row: ``alpha/alpha-q4`` hot on gpu0 at ``endpoint``, holding nothing."""
    return {
        "model": "alpha",
        "config": "alpha-q4",
        "device": "gpu0",
        "engine": "llama.cpp",
        "endpoint": endpoint,
        "unit": "uap-alpha",
        "state": "hot",
        "gpu_mib": 8000,
        "host_rss_mib": 2000,
        "holders": [],
        "since": "2026-01-01T00:00:00Z",
    }


def alpha_ledger(endpoint: str = ALPHA_ENDPOINT) -> dict[str, Any]:
    """A ledger whose one resident is :func:`alpha_resident`: what a daemon seeded with a
    hot model starts from (it forwards to it once the engine there answers)."""
    return {
        "version": 1,
        "updated_at": "2026-01-01T00:00:00Z",
        "residents": [alpha_resident(endpoint)],
        "pending": [],
        "usage": {},
    }
