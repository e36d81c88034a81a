"""Which measured figures count on this machine (docs/placement-rules.md §4.1), and the policy that
stays in force when its file breaks (issue 10).

- Measured figures count only from the machine-local file (``$UAP_HOME/model-registry.json``,
  written by ``uapplace measure``): a machine with no local file has no measured footprints,
  so every config is ``no_measured_config`` and nothing is loaded or evicted by its figures.
- ``measured_on`` gates the device class: a local measurement recorded on another card (UUID,
  total memory, name) or with another engine build is unknown, and ``validate`` names the
  file and field.
- A truncated ``capacity-policy.json`` on reload keeps the last good policy, which still
  refuses an engine whose ``/metrics`` says ``kv f16`` when the policy wants ``int8``; with no
  good policy ever loaded, verify-up refuses every engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from http_fixtures import serving

from uapplace.controller import views
from uapplace.controller.controller import Controller
from uapplace.core.admission import Admission
from uapplace.core.model import (
    DeviceKind,
    DeviceReading,
    ParkReason,
    PreviewReason,
    ProbeSource,
    parse_iso,
)
from uapplace.core.planner import PlanInput, plan
from uapplace.enforce.host import ControllerHost
from uapplace.files.capacity import load_capacity_policy, validate
from uapplace.files.paths import Paths
from uapplace.files.registry import gate_on_devices, load_registry, local_measurements
from uapplace.publish import verify
from uapplace.sim.engine import EngineOptions, FakeEngine
from uapplace.sim.gpu import SimGpu, sim_uuid

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"
NOW = parse_iso("2026-11-01T12:00:00Z")
SIM_NAME = "Simulated 24 GiB GPU"

REGISTRY: dict[str, Any] = {
    "version": 1,
    "devices": {
        "gpu0": {"kind": "gpu", "total_mib": 24576, "reserved_mib": 0, "uuid": sim_uuid(0)},
        "cpu0": {"kind": "cpu", "total_mib": 65536, "reserved_mib": 1024},
    },
    "models": {
        "alpha": {
            "display": "Alpha",
            "engine": "llama.cpp",
            "unit": "uap-alpha",
            "endpoint": "http://127.0.0.1:9",
            "service": "alpha-server",
            "engine_build": "b4500",
            "configs": {
                "a1": {
                    "resident_gpu_mib": 8000,
                    "host_rss_mib": 500,
                    "kv_resident_cells": 32768,
                    "kv": "int8",
                    "measured_at": "2026-10-08T14:02:00Z",
                    "measured_on": "gpu0",
                    "measured_device": {
                        "name": SIM_NAME,
                        "uuid": sim_uuid(0),
                        "total_mib": 24576,
                    },
                    "engine_build": "b4500",
                }
            },
        },
    },
}
POLICY = {"services": [{"name": "alpha-server", "metricsMustMatch": {"kv": "int8"}}]}


def write(path: Path, doc: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def sim_reading(
    uuid: str = sim_uuid(0), total: float = 24576, name: str | None = SIM_NAME
) -> dict[str, DeviceReading]:
    return {
        "gpu0": DeviceReading(
            "gpu0", DeviceKind.GPU, total, total, ProbeSource.SIM, (), uuid, None, name
        ),
        "cpu0": DeviceReading("cpu0", DeviceKind.CPU, 65536, 60000, ProbeSource.MEMAVAILABLE),
    }


def with_config(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(json.dumps(REGISTRY))
    config = doc["models"]["alpha"]["configs"]["a1"]
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return doc


# --------------------------------------------------------------------------- repo-only figures


def test_repo_only_measurements_make_every_config_no_measured_config() -> None:
    """The shipped registry carries example figures; with no local file none counts."""
    loaded = load_registry(CONFIG_DIR / "model-registry.json", None)
    registry = loaded.registry
    admission = Admission(registry)
    readings = {
        key: DeviceReading(key, device.kind, device.total_mib, device.total_mib, ProbeSource.SIM)
        for key, device in registry.devices.items()
    }
    for model in registry.models.values():
        decision, _entry = admission.decide(model.key, "test", None, None, NOW)
        assert (decision.decision, decision.reason) == (
            "park",
            ParkReason.NO_MEASURED_CONFIG.value,
        ), model.key
        result = plan(PlanInput(registry, (), readings), model.key)
        assert result.reason is PreviewReason.NO_MEASURED_CONFIG, model.key
        assert result.options == ()
    strata = plan(PlanInput(registry, (), readings), "qwen3.8-flash-next")
    assert strata.infeasible == (
        "qwen3.8-flash-next/strata-iq3_s: no measurement counts on this machine: measured "
        f"only in the repo file {CONFIG_DIR / 'model-registry.json'}: its figures are "
        "descriptive; measured figures count only from the machine-local file "
        "$UAP_HOME/model-registry.json (`uapplace measure` writes it)",
    )


def test_the_same_figures_in_the_local_file_count(tmp_path: Path) -> None:
    repo = write(tmp_path / "config" / "model-registry.json", REGISTRY)
    local = write(tmp_path / "home" / "model-registry.json", local_measurements(REGISTRY))
    config = load_registry(repo, local).registry.models["alpha"].configs["a1"]
    assert config.provenance == "local" and config.is_measured and config.untrusted == ""
    repo_only = load_registry(repo, tmp_path / "absent.json").registry
    untrusted = repo_only.models["alpha"].configs["a1"]
    assert not untrusted.is_measured
    assert str(tmp_path / "absent.json") in untrusted.untrusted


def test_validate_shows_provenance_truthfully(tmp_path: Path) -> None:
    controller = open_controller(tmp_path, local=None)
    report = asyncio.run(views.validate(controller))
    row = next(r for r in report["provenance"] if r["entry"] == "$.models.alpha.configs.a1")
    assert row["source"] == "repo"
    assert row["measurement"].startswith("not counted: measured only in the repo file")
    warning = next(f for f in report["findings"] if f["json_path"] == row["entry"])
    assert warning["severity"] == "warning" and "no_measured_config" in warning["message"]
    assert warning["file"] == str(tmp_path / "config" / "model-registry.json")


# --------------------------------------------------------------------------- measured_on


@pytest.mark.parametrize(
    ("reading", "field", "says"),
    [
        (sim_reading(uuid="GPU-other"), "uuid", "is now GPU-other"),
        (sim_reading(total=49152), "total_mib", "now reads 49152 MiB"),
        (sim_reading(name="NVIDIA RTX 4090"), "name", "is now 'NVIDIA RTX 4090'"),
    ],
)
def test_a_measurement_from_another_device_is_unknown(
    tmp_path: Path, reading: dict[str, DeviceReading], field: str, says: str
) -> None:
    repo = write(tmp_path / "config" / "model-registry.json", REGISTRY)
    local = write(tmp_path / "home" / "model-registry.json", local_measurements(REGISTRY))
    gated = gate_on_devices(load_registry(repo, local), reading)
    config = gated.registry.models["alpha"].configs["a1"]
    assert not config.is_measured and says in config.untrusted
    (mismatch,) = gated.device_mismatches
    assert mismatch.file == local
    assert mismatch.json_path == f"$.models.alpha.configs.a1.measured_device.{field}"
    result = plan(PlanInput(gated.registry, (), reading), "alpha")
    assert result.reason is PreviewReason.NO_MEASURED_CONFIG
    decision, _ = Admission(gated.registry).decide("alpha", "t", None, None, NOW)
    assert decision.reason == ParkReason.NO_MEASURED_CONFIG.value
    findings = validate(gated, load_capacity_policy(write(tmp_path / "policy.json", POLICY)))
    error = next(f for f in findings if f.json_path == mismatch.json_path)
    assert error.severity == "error" and error.file == str(local)


def test_the_same_device_keeps_the_measurement(tmp_path: Path) -> None:
    repo = write(tmp_path / "config" / "model-registry.json", REGISTRY)
    local = write(tmp_path / "home" / "model-registry.json", local_measurements(REGISTRY))
    # NVML reports bytes: a fraction of a MiB of rounding is the same card.
    gated = gate_on_devices(load_registry(repo, local), sim_reading(total=24575.6))
    assert gated.device_mismatches == ()
    assert gated.registry.models["alpha"].configs["a1"].is_measured


def test_a_reading_without_a_name_is_compared_on_what_it_has(tmp_path: Path) -> None:
    repo = write(tmp_path / "config" / "model-registry.json", REGISTRY)
    local = write(tmp_path / "home" / "model-registry.json", local_measurements(REGISTRY))
    gated = gate_on_devices(load_registry(repo, local), sim_reading(name=None))
    assert gated.registry.models["alpha"].configs["a1"].is_measured


def test_a_legacy_local_measurement_without_identity_is_accepted(tmp_path: Path) -> None:
    """Decision: the local file is this machine's own statement; with no identity
    recorded there is nothing to disagree with, as long as the device key exists."""
    doc = with_config(measured_device=None)
    repo = write(tmp_path / "config" / "model-registry.json", doc)
    local = write(tmp_path / "home" / "model-registry.json", local_measurements(doc))
    gated = gate_on_devices(load_registry(repo, local), sim_reading(uuid="GPU-other"))
    assert gated.registry.models["alpha"].configs["a1"].is_measured


def test_an_absent_device_is_not_compared(tmp_path: Path) -> None:
    repo = write(tmp_path / "config" / "model-registry.json", REGISTRY)
    local = write(tmp_path / "home" / "model-registry.json", local_measurements(REGISTRY))
    absent = {"gpu0": DeviceReading("gpu0", DeviceKind.GPU, 0, 0, ProbeSource.ABSENT)}
    gated = gate_on_devices(load_registry(repo, local), absent)
    assert gated.device_mismatches == ()


def test_a_measurement_from_another_engine_build_is_unknown(tmp_path: Path) -> None:
    doc = with_config(engine_build="b4100")
    repo = write(tmp_path / "config" / "model-registry.json", doc)
    local = write(tmp_path / "home" / "model-registry.json", local_measurements(doc))
    loaded = load_registry(repo, local)
    config = loaded.registry.models["alpha"].configs["a1"]
    assert not config.is_measured
    assert "engine build 'b4100'" in config.untrusted and "'b4500'" in config.untrusted
    findings = validate(loaded, load_capacity_policy(write(tmp_path / "policy.json", POLICY)))
    error = next(f for f in findings if f.json_path == "$.models.alpha.configs.a1.engine_build")
    assert error.severity == "error" and error.file == str(local)


def test_the_daemon_gates_on_the_card_it_probes(tmp_path: Path) -> None:
    """Controller.open reads the simulated GPU: a recorded UUID of another card is unknown."""
    doc = with_config(measured_device={"uuid": "GPU-measured-elsewhere", "total_mib": 24576})
    controller = open_controller(tmp_path, local=local_measurements(doc), registry=doc)
    config = controller.registry.models["alpha"].configs["a1"]
    assert not config.is_measured and "GPU-measured-elsewhere" in config.untrusted
    report = asyncio.run(views.validate(controller))
    assert report["ok"] is False
    error = next(
        f
        for f in report["findings"]
        if f["json_path"] == "$.models.alpha.configs.a1.measured_device.uuid"
    )
    assert error["file"] == str(tmp_path / "home" / "model-registry.json")


# --------------------------------------------------------------------------- capacity policy


def open_controller(
    tmp_path: Path,
    *,
    local: dict[str, Any] | None,
    registry: dict[str, Any] | None = None,
    policy: str | None = None,
) -> Controller:
    doc = registry if registry is not None else REGISTRY
    write(tmp_path / "config" / "model-registry.json", doc)
    if local is not None:
        write(tmp_path / "home" / "model-registry.json", local)
    policy_path = tmp_path / "config" / "capacity-policy.json"
    policy_path.write_text(policy if policy is not None else json.dumps(POLICY), encoding="utf-8")
    SimGpu(tmp_path / "sim.json").create([(SIM_NAME, 24576)])
    paths = Paths.from_env(
        {
            "HOME": str(tmp_path),
            "UAP_HOME": str(tmp_path / "home"),
            "UAPPLACE_CONFIG_DIR": str(tmp_path / "config"),
            "UAPPLACE_SIM_GPU": str(tmp_path / "sim.json"),
            "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        }
    )
    return Controller.open(paths)


@asynccontextmanager
async def engine_reporting(kv: str) -> AsyncIterator[str]:
    """The fake llama.cpp-like engine over real HTTP, its ``/metrics`` saying ``kv``."""
    engine = FakeEngine(EngineOptions(port=0, model_id="alpha", kv=kv))
    await engine.finish_loading()
    async with serving(engine.app()) as url:
        yield url


async def metrics_verdict(controller: Controller, kv: str) -> str | None:
    """What verify-up's metrics check says of an engine reporting ``kv``."""
    policy = ControllerHost(controller).service_policy(controller.registry.models["alpha"])
    assert policy is not None
    async with engine_reporting(kv) as url:
        return await verify.metrics_problem(policy, url, http_s=2.0)


async def test_a_truncated_policy_on_reload_keeps_the_last_good_one(tmp_path: Path) -> None:
    controller = open_controller(tmp_path, local=local_measurements(REGISTRY))
    assert controller.config.state.policy_state == "loaded"
    assert await metrics_verdict(controller, "int8") is None
    policy_file = tmp_path / "config" / "capacity-policy.json"
    text = policy_file.read_text(encoding="utf-8")
    policy_file.write_text(text[: len(text) // 2], encoding="utf-8")  # truncated mid-write

    assert await controller.reload()

    assert controller.config.state.policy_state == "last-good"
    refused = await metrics_verdict(controller, "f16")
    assert refused == (
        "metricsMustMatch of service alpha-server: kv is 'f16', policy wants 'int8' (from /metrics)"
    )
    assert await metrics_verdict(controller, "int8") is None
    report = await views.validate(controller)
    assert report["capacity_policy"]["state"] == "last-good"
    error = next(f for f in report["findings"] if f["file"] == str(policy_file))
    assert "invalid JSON" in error["message"]
    assert "the last good capacity policy, read at" in error["message"]
    assert "stays in force" in error["message"]


async def test_with_no_good_policy_ever_loaded_verify_up_fails_closed(tmp_path: Path) -> None:
    controller = open_controller(
        tmp_path, local=local_measurements(REGISTRY), policy='{"services": [{"name": '
    )
    assert controller.config.state.policy_state == "none"
    refusal = await metrics_verdict(controller, "int8")
    assert refusal is not None
    assert "no good capacity policy was ever loaded" in refusal
    assert "verify-up fails closed" in refusal
    report = await views.validate(controller)
    assert report["ok"] is False
    assert report["capacity_policy"]["state"] == "none"
    assert "every verify-up refuses" in " ".join(f["message"] for f in report["findings"])


async def test_a_fixed_policy_file_is_taken_on_the_next_reload(tmp_path: Path) -> None:
    controller = open_controller(tmp_path, local=local_measurements(REGISTRY), policy="{")
    assert controller.config.state.policy_state == "none"
    (tmp_path / "config" / "capacity-policy.json").write_text(json.dumps(POLICY))
    assert await controller.reload()
    assert controller.config.state.policy_state == "loaded"
    assert await metrics_verdict(controller, "int8") is None
