"""``uapplace measure`` of a llama.cpp (uapplace/measure/geometry.py, measurer.py, reading.py):
the KV geometry from ``/props`` and the unit's ``ExecStart``, a measured config that the
planner can place, and a sleeping server refused without being woken.

The pool rules are checked against what the real llama-server (the build of
``scripts/build-llama-server.sh``) reported for each flag set: ``/props`` ``n_ctx`` and
``total_slots``, and its log's ``kv_unified``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from controller_fixtures import registry, registry_paths
from http_fixtures import serving
from llama_shapes import PROPS, ROUTER_PROPS, LlamaShapes

from uapplace.core.model import (
    DEFAULT_CELLS,
    Config,
    ConfigStatus,
    DeviceKind,
    DeviceReading,
    Holder,
    ProbeSource,
    Registry,
    Resident,
    cost_mib,
)
from uapplace.core.planner import PlanInput, plan
from uapplace.files.capacity import CapacityPolicy, ServicePolicy, validate
from uapplace.files.registry import load_registry
from uapplace.io.units import JobOutcome, UnitState
from uapplace.measure.geometry import LaunchFlags, kv_geometry, launch_flags, llama_cpp_pool
from uapplace.measure.measurer import Measurer
from uapplace.measure.reading import MeasurementRefused

UNMEASURED = Config("c1", ConfigStatus.UNMEASURED)
SPLIT = "/usr/bin/llama-server -m /m/tiny-a.gguf --alias tiny-a -c 512 --parallel 2"


def props(n_ctx: int, total_slots: int) -> dict[str, Any]:
    return {**PROPS, "default_generation_settings": {"n_ctx": n_ctx}, "total_slots": total_slots}


# --------------------------------------------------------------------------- the pool


@pytest.mark.parametrize(
    ("flags", "n_ctx", "slots", "pool"),
    [
        # What the real llama-server allocated for each flag set (module doc).
        ("-c 512 --parallel 2", 256, 2, 512),  # split: 2 × 256
        ("-c 512", 512, 4, 512),  # automatic slots: 4, unified, each sees the pool
        ("-c 512 --parallel 2 -kvu", 512, 2, 512),
        ("-c 500 --parallel 3", 256, 3, 768),  # each share rounded up to 256 cells
        ("-c 256 --parallel 2", 256, 2, 512),
        ("-c 512 --parallel -1 --no-kv-unified", 512, 4, 512),  # auto slots stay unified
        ("-c 1024 --parallel 2 -kvu --kv-unified-per-slot 256", 256, 2, 1024),
        ("--parallel 2 --kv-unified-per-slot 256", 256, 2, 512),  # split
        ("--kv-unified-per-slot 256", 256, 4, 1024),  # auto, unified, sized n_parallel × N
        ("--parallel 2", 2048, 2, 4096),  # the model's own context, split
        ("--parallel 1", 2048, 1, 2048),
    ],
)
def test_the_pool_is_what_llama_cpp_allocated(
    flags: str, n_ctx: int, slots: int, pool: int
) -> None:
    found, why = llama_cpp_pool(n_ctx, slots, launch_flags(f"/bin/llama-server -m m.gguf {flags}"))
    assert found == pool, why


def test_without_an_exec_start_the_pool_is_one_slot_at_least() -> None:
    pool, why = llama_cpp_pool(256, 2, launch_flags(""))
    assert pool == 256 and "no ExecStart" in why


def test_launch_flags_last_one_wins_and_bad_numbers_are_unknown() -> None:
    flags = launch_flags("llama-server -c 512 -c 1024 -np x -kvu -no-kvu -ctk q8_0; /bin/true")
    assert flags == LaunchFlags(True, 1024, None, False, False, "q8_0")
    assert flags.unified  # -np unreadable: llama.cpp's automatic slot count
    assert launch_flags("llama-server --ctx-size=512").ctx_size is None  # not llama.cpp syntax


# --------------------------------------------------------------------------- the geometry


def test_llama_cpp_geometry_from_props_and_exec_start() -> None:
    geometry = kv_geometry(UNMEASURED, {}, props(256, 2), None, launch_flags(SPLIT))
    assert geometry.fields == {
        "per_session_cap_cells": 256,
        "context_pool_cells": 512,
        "kv_resident_cells": 512,
        "kv_mib_per_1k_cells": 0.0,
        "kv": "f16",
    }
    assert geometry.sources["per_session_cap_cells"] == "/props default_generation_settings.n_ctx"
    assert geometry.sources["slots"] == "2 (/props total_slots)"
    assert "2 slots × 256 cells per slot" in geometry.sources["context_pool_cells"]
    assert "--parallel 2" in geometry.sources["context_pool_cells"]
    assert "never grows" in geometry.sources["kv_mib_per_1k_cells"]
    assert geometry.sources["kv"].startswith("llama.cpp's default")


def test_cache_type_k_and_an_engine_reported_kv() -> None:
    flags = launch_flags(f"{SPLIT} --cache-type-k q8_0")
    assert kv_geometry(UNMEASURED, {}, props(256, 2), None, flags).fields["kv"] == "q8_0"
    reported = kv_geometry(UNMEASURED, {"kv": "int8"}, props(256, 2), None, flags)
    assert (reported.fields["kv"], reported.sources["kv"]) == ("int8", "/metrics kv label")


def test_a_strata_like_engine_keeps_its_metrics_path() -> None:
    metrics: dict[str, float | str] = {"max_context": 131072.0, "kv": "int8", "arena_mib": 12.0}
    geometry = kv_geometry(
        UNMEASURED, metrics, None, [{"id": 0, "n_ctx": 65536}], LaunchFlags(True)
    )
    assert geometry.fields == {
        "per_session_cap_cells": 65536,
        "context_pool_cells": 131072,
        "kv_resident_cells": 131072,
        "kv": "int8",
        "arena_mib": 12.0,
    }
    assert geometry.sources["context_pool_cells"] == "/metrics max_context"
    assert geometry.sources["per_session_cap_cells"] == "/slots n_ctx"


def test_the_registry_keeps_what_it_states() -> None:
    stated = Config("c1", ConfigStatus.UNMEASURED, kv_resident_cells=256, kv_mib_per_1k_cells=3.5)
    geometry = kv_geometry(stated, {}, props(256, 2), None, launch_flags(SPLIT))
    assert geometry.fields["kv_resident_cells"] == 256
    assert "kv_mib_per_1k_cells" not in geometry.fields  # the registry's 3.5 stays


def test_a_router_without_model_reports_no_geometry() -> None:
    geometry = kv_geometry(UNMEASURED, {}, ROUTER_PROPS, None, launch_flags(SPLIT))
    assert geometry.fields == {}


# --------------------------------------------------------------------------- measure, end to end


@dataclass
class Units:
    """A :class:`~uapplace.io.seams.UnitControl` with one running unit: this test process."""

    exec_start: str = SPLIT
    asked: list[str] = field(default_factory=list)

    async def state(self, name: str) -> UnitState:
        self.asked.append(name)
        return UnitState("active", "running", "loaded", os.getpid(), self.exec_start)

    async def pids(self, name: str) -> list[int]:
        return [os.getpid()]

    async def start_unit(self, name: str, timeout: float) -> JobOutcome:  # noqa: ASYNC109
        raise AssertionError("measure never starts a unit")

    async def stop_unit(self, name: str, timeout: float) -> JobOutcome:  # noqa: ASYNC109
        raise AssertionError("measure never stops a unit")

    def on_change(self, callback: Any) -> None:
        pass


READINGS = {
    "gpu0": DeviceReading("gpu0", DeviceKind.GPU, 24576, 24000, ProbeSource.SIM),
    "cpu0": DeviceReading("cpu0", DeviceKind.CPU, 65536, 40000, ProbeSource.MEMAVAILABLE),
}


@dataclass
class Host:
    """A :class:`~uapplace.measure.reading.MeasureHost` over the registry files."""

    repo: Path
    local: Path

    def registry(self) -> Registry:
        return load_registry(self.repo, self.local).registry

    def residents(self) -> Sequence[Resident]:
        return []

    async def read_devices(self) -> Mapping[str, DeviceReading]:
        return READINGS

    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        return {}


def tiny_world(tmp_path: Path, endpoint: str) -> tuple[Measurer, Host]:
    model = {
        "display": "Tiny A",
        "engine": "llama.cpp",
        "unit": "uap-tiny",
        "endpoint": endpoint,
        "advertises": ["tiny-a"],
        "service": "tiny-server",
        "configs": {"c1": {"status": "unmeasured"}},
    }
    paths = registry_paths(tmp_path, registry({"tiny": model}))
    host = Host(paths.repo_registry, paths.local_registry)
    return Measurer(paths, host, Units()), host


def policy(**wanted: str | int | float) -> CapacityPolicy:
    service = ServicePolicy("tiny-server", None, wanted, (), None)
    return CapacityPolicy({"tiny-server": service})


async def test_a_measured_llama_cpp_config_is_placeable(tmp_path: Path) -> None:
    shapes = LlamaShapes(n_ctx=256, total_slots=2)
    async with serving(shapes.app()) as url:
        measurer, host = tiny_world(tmp_path, url)
        result = await measurer.measure("tiny")
    written = result["measurement"]
    assert written["measured_on"] == "cpu0" and written["resident_gpu_mib"] == 0
    assert written["host_rss_mib"] > 0
    assert (written["per_session_cap_cells"], written["context_pool_cells"]) == (256, 512)
    assert (written["kv_resident_cells"], written["kv_mib_per_1k_cells"]) == (512, 0.0)
    assert written["kv"] == "f16"
    assert result["sources"]["host_rss_mib"].startswith(f"VmRSS of PIDs {os.getpid()}")
    # /props told the geometry everything; the one /slots is the idle check (issue 21
    # item 8: a footprint is read at rest), asked of an engine already seen awake.
    assert shapes.hits["/slots"] == 1
    assert not any("/slots" in source for source in result["sources"].values())

    load = load_registry(host.repo, host.local)
    config = load.registry.models["tiny"].configs["c1"]
    assert config.is_measured
    assert cost_mib(config, DEFAULT_CELLS) == 0.0  # known at the default context
    errors = [f.message for f in validate(load, policy(n_ctx=256)) if f.severity == "error"]
    assert errors == []
    [wrong] = [f.message for f in validate(load, policy(n_ctx=512)) if f.severity == "error"]
    assert "per_session_cap_cells is 256" in wrong and "metricsMustMatch.n_ctx" in wrong
    options = plan(PlanInput(load.registry, [], READINGS), "tiny").options
    assert [(o.config, o.device) for o in options] == [("c1", "cpu0")]


async def test_a_sleeping_llama_cpp_is_refused_and_not_woken(tmp_path: Path) -> None:
    shapes = LlamaShapes(asleep=True)
    async with serving(shapes.app()) as url:
        measurer, host = tiny_world(tmp_path, url)
        before = host.local.read_text(encoding="utf-8")
        with pytest.raises(MeasurementRefused) as refused:
            await measurer.measure("tiny")
    assert str(refused.value) == (
        f"{url}: engine is asleep (llama.cpp --sleep-idle-seconds): send it a request "
        "first, then measure while it is awake"
    )
    assert shapes.asleep and shapes.hits["/slots"] == 0
    assert host.local.read_text(encoding="utf-8") == before


async def test_the_launch_line_measured_under_is_recorded_and_validated(tmp_path: Path) -> None:
    """``flags`` = the live ``ExecStart`` after the program, so ``execStartMustContain`` is
    checked against what really ran, each missing entry named."""
    shapes = LlamaShapes(n_ctx=256, total_slots=2)
    async with serving(shapes.app()) as url:
        measurer, host = tiny_world(tmp_path, url)
        result = await measurer.measure("tiny")
    assert result["measurement"]["flags"] == SPLIT.split()[1:]
    assert result["sources"]["flags"].startswith("uap-tiny.service's live ExecStart")

    def errors(*must_contain: str) -> list[str]:
        service = ServicePolicy("tiny-server", None, {}, must_contain, None)
        found = validate(
            load_registry(host.repo, host.local), CapacityPolicy({"tiny-server": service})
        )
        return [f.message for f in found if f.severity == "error"]

    assert errors("--parallel 2", "-c 512") == []
    [lacking] = errors("--parallel 2", "--cache-type-k q8_0")
    assert "launch flags lack '--cache-type-k q8_0'" in lacking
    assert "execStartMustContain[1]" in lacking
