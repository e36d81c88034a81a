"""The world a controller opens in without a bus: registry files, a simulated GPU, paths.

Shared by the controller's tests (imported as ``from controller_fixtures import ...``:
tests/unit is no package, like ``enforce_fakes``). Each of them puts its own models (mostly
from :mod:`tests.worlds.seed_docs`, which the bus tier and the benchmarks share, or
:func:`tiny_model`) into :func:`registry` and opens it through :func:`registry_paths`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.worlds.seed_docs import ALPHA_ENDPOINT
from uapplace.core.model import Resident, ResidentState
from uapplace.files.paths import Paths
from uapplace.files.registry import local_measurements
from uapplace.sim.gpu import SimGpu, sim_uuid

SIM_GPU_MIB = 24576
TINY_ENDPOINT = "http://127.0.0.1:18090"
"""Where ``tiny`` (:func:`tiny_model`), a llama-server on the CPU tier, serves."""


def registry(models: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """A registry of ``models`` on the simulated GPU 0 and the host's CPU."""
    return {
        "version": 1,
        "devices": {
            "gpu0": {
                "kind": "gpu",
                "total_mib": SIM_GPU_MIB,
                "reserved_mib": 1024,
                "uuid": sim_uuid(0),
            },
            "cpu0": {"kind": "cpu", "total_mib": 65536, "reserved_mib": 1024},
        },
        "models": {key: dict(model) for key, model in models.items()},
    }


def registry_paths(tmp_path: Path, registry: Mapping[str, Any]) -> Paths:
    """Write ``registry`` (the repo file and its machine-local measurements), an empty
    capacity policy and one simulated GPU under ``tmp_path``; the paths that read them."""
    config = tmp_path / "config"
    config.mkdir()
    (config / "model-registry.json").write_text(json.dumps(registry))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "model-registry.json").write_text(json.dumps(local_measurements(registry)))
    (config / "capacity-policy.json").write_text(json.dumps({"services": []}))
    SimGpu(tmp_path / "sim.json").create([("sim", SIM_GPU_MIB)])
    return Paths.from_env(
        {
            "HOME": str(tmp_path),
            "UAP_HOME": str(tmp_path / "home"),
            "UAPPLACE_CONFIG_DIR": str(config),
            "UAPPLACE_SIM_GPU": str(tmp_path / "sim.json"),
            "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        }
    )


def alpha_resident(state: ResidentState = ResidentState.HOT) -> Resident:
    """``alpha/alpha-q4`` on gpu0 at :data:`~tests.worlds.seed_docs.ALPHA_ENDPOINT`, in
    ``state``, holding nothing: the ledger row of :func:`tests.worlds.seed_docs.alpha_resident`
    as the controller holds it."""
    return Resident(
        model="alpha",
        config="alpha-q4",
        device="gpu0",
        engine="llama.cpp",
        endpoint=ALPHA_ENDPOINT,
        unit="uap-alpha",
        state=state,
        gpu_mib=8000,
        host_rss_mib=2000,
        since="2026-01-01T00:00:00Z",
    )


def tiny_model(config: Mapping[str, Any]) -> dict[str, Any]:
    """``tiny``: a llama-server on the CPU tier at :data:`TINY_ENDPOINT` (unit ``uap-tiny``),
    with one config ``c1``."""
    return {
        "display": "Tiny",
        "engine": "llama.cpp",
        "unit": "uap-tiny",
        "endpoint": TINY_ENDPOINT,
        "configs": {"c1": dict(config)},
    }


def tiny_resident(host_rss_mib: float, since: str, **fields: Any) -> Resident:
    """``tiny/c1`` (:func:`tiny_model`) hot on ``cpu0`` since ``since``, holding no GPU
    memory and ``host_rss_mib`` of the host's; ``fields``: other :class:`Resident` fields."""
    values: dict[str, Any] = {
        "model": "tiny",
        "config": "c1",
        "device": "cpu0",
        "engine": "llama.cpp",
        "endpoint": TINY_ENDPOINT,
        "unit": "uap-tiny.service",
        "state": ResidentState.HOT,
        "gpu_mib": 0.0,
        "host_rss_mib": host_rss_mib,
        "since": since,
        **fields,
    }
    return Resident(**values)
