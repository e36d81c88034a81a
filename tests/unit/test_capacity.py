"""capacity-policy.json and every ``validate`` rule, each as its error or warning."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from uapplace.core.model import Config, Model
from uapplace.files.capacity import (
    CapacityPolicy,
    Finding,
    has_errors,
    load_capacity_policy,
    validate,
)
from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.registry import RegistryLoad, load_registry, local_measurements

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"
SHIPPED_REGISTRY: dict[str, Any] = json.loads((CONFIG_DIR / "model-registry.json").read_text())
SHIPPED_POLICY: dict[str, Any] = json.loads((CONFIG_DIR / "capacity-policy.json").read_text())

STRATA = ("qwen3.8-flash-next", "strata-iq3_s")
GEMMA = ("gemma4-26b-a4b", "gemma4-q4_k_m-mtp")


def registry_doc() -> dict[str, Any]:
    return copy.deepcopy(SHIPPED_REGISTRY)


def policy_doc() -> dict[str, Any]:
    return copy.deepcopy(SHIPPED_POLICY)


def config_of(doc: dict[str, Any], which: tuple[str, str]) -> dict[str, Any]:
    config: dict[str, Any] = doc["models"][which[0]]["configs"][which[1]]
    return config


def service_of(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in doc["services"] if s["name"] == name)


def write(path: Path, doc: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def run(
    tmp_path: Path,
    registry: dict[str, Any] | None = None,
    policy: dict[str, Any] | None = None,
    local: dict[str, Any] | None = None,
) -> list[Finding]:
    return validate(
        load(tmp_path, registry or registry_doc(), local),
        load_capacity_policy(
            write(tmp_path / "config" / "capacity-policy.json", policy or policy_doc())
        ),
    )


def load(
    tmp_path: Path, registry: dict[str, Any], local: dict[str, Any] | None = None
) -> RegistryLoad:
    local_path = tmp_path / "home" / "model-registry.json"
    # Measured figures count only from the machine-local file: by default this machine
    # has measured every config the document calls measured.
    write(local_path, local if local is not None else local_measurements(registry))
    return load_registry(write(tmp_path / "config" / "model-registry.json", registry), local_path)


def only(findings: list[Finding], path: str) -> Finding:
    """The one finding at ``path`` (anything else at that path is a test failure)."""
    matching = [f for f in findings if f.json_path == path]
    assert len(matching) == 1, findings
    return matching[0]


def with_model(loaded: RegistryLoad, key: str, **changes: Any) -> RegistryLoad:
    """The load with one model changed: for states the loader itself refuses."""
    models = dict(loaded.registry.models)
    models[key] = dataclasses.replace(models[key], **changes)
    registry = dataclasses.replace(loaded.registry, models=models)
    return dataclasses.replace(loaded, registry=registry)


def with_config(loaded: RegistryLoad, which: tuple[str, str], **changes: Any) -> RegistryLoad:
    model: Model = loaded.registry.models[which[0]]
    configs: dict[str, Config] = dict(model.configs)
    configs[which[1]] = dataclasses.replace(configs[which[1]], **changes)
    return with_model(loaded, which[0], configs=configs)


def shipped_policy() -> CapacityPolicy:
    return load_capacity_policy(CONFIG_DIR / "capacity-policy.json")


def config_path(which: tuple[str, str], field: str) -> str:
    return f"$.models.{which[0]}.configs.{which[1]}.{field}"


# --------------------------------------------------------------------------- policy file


def test_shipped_policy_loads_as_a_list_keyed_by_name() -> None:
    policy = shipped_policy()
    assert list(policy.services) == ["strata-server", "gsq-rco-server", "gemma-server"]
    strata = policy.services["strata-server"]
    assert strata.metrics_must_match == {"kv": "int8", "max_context": 131072}
    assert strata.gpu_min_free_mib == 200
    gsq = policy.services["gsq-rco-server"]
    assert gsq.exec_start_must_contain == (
        "-c 229376",
        "-np 2",
        "--vbr-vram 5120M",
        "--cache-ram 32768",
    )
    assert gsq.gpu_min_free_mib is None
    assert gsq.json_path == "$.services[1]"


def test_duplicate_service_name_is_an_error(tmp_path: Path) -> None:
    doc = policy_doc()
    doc["services"].append({"name": "strata-server"})
    with pytest.raises(ConfigFileError) as caught:
        load_capacity_policy(write(tmp_path / "capacity-policy.json", doc))
    assert caught.value.json_path == "$.services[3].name"
    assert "first at $.services[0]" in caught.value.message


def test_policy_wrong_type_names_the_path(tmp_path: Path) -> None:
    doc = policy_doc()
    service_of(doc, "strata-server")["gpuMinFreeMiB"] = "200"
    with pytest.raises(ConfigFileError) as caught:
        load_capacity_policy(write(tmp_path / "capacity-policy.json", doc))
    assert caught.value.json_path == "$.services[0].gpuMinFreeMiB"
    assert caught.value.file == tmp_path / "capacity-policy.json"


def test_policy_services_must_be_a_list(tmp_path: Path) -> None:
    doc = {"services": {"strata-server": {"gpuMinFreeMiB": 200}}}
    with pytest.raises(ConfigFileError) as caught:
        load_capacity_policy(write(tmp_path / "capacity-policy.json", doc))
    assert caught.value.json_path == "$.services"


def test_policy_fields_other_tools_own_are_ignored(tmp_path: Path) -> None:
    doc = policy_doc()
    doc["defaults"] = {"probeTimeoutMs": 2000}
    service_of(doc, "strata-server")["health"] = {"url": "http://127.0.0.1:8080/health"}
    assert (
        "strata-server"
        in load_capacity_policy(write(tmp_path / "capacity-policy.json", doc)).services
    )


def test_policy_bad_unit_name_is_an_error(tmp_path: Path) -> None:
    doc = policy_doc()
    service_of(doc, "gemma-server")["unit"] = "a/b"
    with pytest.raises(ConfigFileError) as caught:
        load_capacity_policy(write(tmp_path / "capacity-policy.json", doc))
    assert caught.value.json_path == "$.services[2].unit"


def test_policy_invalid_json_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "capacity-policy.json"
    path.write_text('{"services": [}', encoding="utf-8")
    with pytest.raises(ConfigFileError, match="line 1 column 15"):
        load_capacity_policy(path)


# --------------------------------------------------------------------------- the shipped files


def test_shipped_files_validate_with_only_the_documented_floor_warning(tmp_path: Path) -> None:
    findings = validate(load(tmp_path, SHIPPED_REGISTRY), shipped_policy())
    assert not has_errors(findings)
    # The shipped models listen on three ports and the registry does not say how the proxy
    # reaches them: the stock proxy's one upstream would 529 after a swap (issue 20).
    assert [(f.severity, f.json_path) for f in findings] == [
        ("warning", "$.services[0].gpuMinFreeMiB"),
        ("warning", "$.proxy"),
    ]


def test_shipped_figures_without_a_local_file_are_descriptive_warnings() -> None:
    """docs/placement-rules.md §4.1: a machine with no local file has no measured footprints."""
    loaded = load_registry(CONFIG_DIR / "model-registry.json", None)
    findings = validate(loaded, shipped_policy())
    assert not has_errors(findings)
    repo_only = [f for f in findings if "measured only in the repo file" in f.message]
    assert [f.json_path for f in repo_only] == [
        "$.models.qwen3.8-flash-next.configs.strata-iq3_s",
        "$.models.gemma4-26b-a4b.configs.gemma4-q4_k_m-mtp",
        "$.models.mistral-small-4.configs.mistral-q5_k_m",
    ]
    assert all(f.severity == "warning" and "no_measured_config" in f.message for f in repo_only)
    assert all(f.file == str(CONFIG_DIR / "model-registry.json") for f in repo_only)


def test_finding_to_json() -> None:
    finding = Finding("error", "/x/model-registry.json", "$.models.m.rails", "bad")
    assert finding.to_json() == {
        "severity": "error",
        "file": "/x/model-registry.json",
        "json_path": "$.models.m.rails",
        "message": "bad",
    }
    assert has_errors([finding])
    assert not has_errors([dataclasses.replace(finding, severity="warning")])


# --------------------------------------------------------------------------- one test per rule


def test_local_file_errors_are_reported_as_errors(tmp_path: Path) -> None:
    local = {"devices": {"gpu0": {"reserved_mib": "lots"}}}
    finding = only(run(tmp_path, local=local), "$.devices.gpu0.reserved_mib")
    assert finding.severity == "error"
    assert finding.file == str(tmp_path / "home" / "model-registry.json")
    assert "ignored" in finding.message


def test_metrics_kv_contradiction_is_an_error(tmp_path: Path) -> None:
    registry = registry_doc()
    config_of(registry, STRATA)["kv"] = "f16"
    finding = only(run(tmp_path, registry), config_path(STRATA, "kv"))
    assert finding.severity == "error"
    assert "'f16'" in finding.message and "metricsMustMatch.kv" in finding.message


def test_metrics_kv_is_read_from_the_launch_flags(tmp_path: Path) -> None:
    registry = registry_doc()
    flags = config_of(registry, STRATA)["flags"]
    flags[flags.index("int8")] = "q4"
    finding = only(run(tmp_path, registry), config_path(STRATA, "flags"))
    assert finding.severity == "error"
    assert "'q4'" in finding.message


def test_metrics_kv_unknown_is_a_warning(tmp_path: Path) -> None:
    registry = registry_doc()
    flags = config_of(registry, STRATA)["flags"]
    config_of(registry, STRATA)["flags"] = [f for f in flags if f not in ("--kv", "int8")]
    finding = only(run(tmp_path, registry), config_path(STRATA, "flags"))
    assert finding.severity == "warning"
    assert "cannot check" in finding.message


def test_metrics_max_context_contradiction_is_an_error(tmp_path: Path) -> None:
    registry = registry_doc()
    config_of(registry, STRATA)["context_pool_cells"] = 114688
    finding = only(run(tmp_path, registry), config_path(STRATA, "context_pool_cells"))
    assert finding.severity == "error"
    assert "131072" in finding.message


def test_metrics_max_context_unknown_is_a_warning(tmp_path: Path) -> None:
    registry = registry_doc()
    del config_of(registry, STRATA)["context_pool_cells"]
    finding = only(run(tmp_path, registry), config_path(STRATA, "context_pool_cells"))
    assert finding.severity == "warning"


def gsq_measured(flags: list[str]) -> dict[str, Any]:
    """qwen3.8-27b with its gsq-rco config measured under its own unit and service."""
    registry = registry_doc()
    model = registry["models"]["qwen3.8-27b"]
    model["service"] = "gsq-rco-server"
    model["configs"]["gsq-rco"] = {
        "resident_gpu_mib": 22000,
        "host_rss_mib": 9000,
        "context_pool_cells": 229376,
        "kv_resident_cells": 229376,
        "measured_at": "2026-10-09T10:00:00Z",
        "measured_on": "gpu0",
        "unit": "uap-gsq-rco-server",
        "flags": flags,
    }
    return registry


GSQ_FLAGS = ["-c", "229376", "-np", "2", "--vbr-vram", "5120M", "--cache-ram", "32768"]
GSQ_PATH = config_path(("qwen3.8-27b", "gsq-rco"), "flags")


def test_exec_start_entries_present_pass(tmp_path: Path) -> None:
    assert not [f for f in run(tmp_path, gsq_measured(GSQ_FLAGS)) if f.json_path == GSQ_PATH]


def test_exec_start_missing_entry_is_an_error(tmp_path: Path) -> None:
    finding = only(run(tmp_path, gsq_measured(GSQ_FLAGS[:-2])), GSQ_PATH)
    assert finding.severity == "error"
    assert "'--cache-ram 32768'" in finding.message
    assert "execStartMustContain[3]" in finding.message


def test_exec_start_matches_whole_tokens_not_substrings(tmp_path: Path) -> None:
    flags = ["-c", "2293760", *GSQ_FLAGS[2:]]
    finding = only(run(tmp_path, gsq_measured(flags)), GSQ_PATH)
    assert "'-c 229376'" in finding.message


def test_floor_above_the_free_budget_is_an_error(tmp_path: Path) -> None:
    """Issue 21 item 8: a floor that can never hold contradicts the registry: an error."""
    policy = policy_doc()
    service_of(policy, "strata-server")["gpuMinFreeMiB"] = 4096
    finding = only(run(tmp_path, policy=policy), "$.services[0].gpuMinFreeMiB")
    assert finding.severity == "error"
    assert finding.file == str(tmp_path / "config" / "capacity-policy.json")
    # 24,576 − 2,048 − 21,812
    assert "at most 716 MiB" in finding.message


def test_floor_below_the_device_reserve_is_a_warning(tmp_path: Path) -> None:
    finding = only(run(tmp_path), "$.services[0].gpuMinFreeMiB")
    assert finding.severity == "warning"
    assert "smaller than gpu0's reserved_mib 2048" in finding.message
    assert "never inherits" in finding.message


def test_floor_at_least_the_reserve_gives_no_warning(tmp_path: Path) -> None:
    policy = policy_doc()
    service_of(policy, "strata-server")["gpuMinFreeMiB"] = 1200
    registry = registry_doc()
    registry["devices"]["gpu0"]["reserved_mib"] = 1000  # 1,764 free: 24,576 − 1,000 − 21,812
    registry["proxy"] = {"single_upstream": None}  # a proxy that routes by target_id
    assert run(tmp_path, registry, policy) == []


def test_unknown_affinity_device_is_an_error(tmp_path: Path) -> None:
    loaded = with_model(
        load(tmp_path, registry_doc()), "gemma4-26b-a4b", affinity_devices=("gpu9",)
    )
    finding = only(validate(loaded, shipped_policy()), "$.models.gemma4-26b-a4b.affinity.device[0]")
    assert finding.severity == "error"


def test_measured_on_the_host_is_accepted(tmp_path: Path) -> None:
    """Issue 12's CPU tier: a CPU-only engine is measured on ``cpu0`` (host RAM only)."""
    registry = registry_doc()
    config_of(registry, GEMMA)["measured_on"] = "cpu0"
    config_of(registry, GEMMA)["resident_gpu_mib"] = 0
    findings = run(tmp_path, registry)
    assert not [f for f in findings if f.json_path == config_path(GEMMA, "measured_on")]


def test_stale_envelope_is_a_warning(tmp_path: Path) -> None:
    registry = registry_doc()
    config = config_of(registry, GEMMA)
    config["envelope"] = {
        "stop_s": 1.0,
        "free_s": 1.2,
        "cold_start_s": 9.0,
        "warm_start_s": 4.0,
        "measured_at": "2000-01-01T00:00:00Z",
        "measured_on": config["measured_on"],
    }
    finding = only(run(tmp_path, registry), config_path(GEMMA, "envelope"))
    assert finding.severity == "warning"
    assert "before the footprint" in finding.message


DELETED = None
"""A case's value that removes the field instead of setting it."""


@pytest.mark.parametrize(
    ("which", "field", "value", "severity", "says"),
    [
        pytest.param(GEMMA, "measured_on", DELETED, "error", "", id="measured_on-missing"),
        pytest.param(
            GEMMA, "kv_resident_cells", 70000, "error", "", id="kv_resident_cells-above-the-pool"
        ),
        pytest.param(
            STRATA, "per_session_cap_cells", 131073, "error", "", id="session-cap-above-the-pool"
        ),
        pytest.param(
            GEMMA,
            "kv_resident_cells",
            DELETED,
            "error",
            "never placeable",
            id="measured-without-kv_resident_cells",
        ),
        pytest.param(
            GEMMA,
            "measured_at",
            DELETED,
            "error",
            "fails closed",
            id="measured-without-measured_at",
        ),
        pytest.param(
            GEMMA,
            "resident_gpu_mib",
            24000,
            "warning",
            "can never be loaded",
            id="too-big-for-its-device",
        ),
        pytest.param(GEMMA, "host_rss_mib", 120000, "warning", "", id="too-big-for-the-host"),
    ],
)
def test_a_config_field_out_of_bounds_is_one_finding_at_its_path(
    tmp_path: Path, which: tuple[str, str], field: str, value: int | None, severity: str, says: str
) -> None:
    registry = registry_doc()
    config = config_of(registry, which)
    if value is DELETED:
        del config[field]
    else:
        config[field] = value
    finding = only(run(tmp_path, registry), config_path(which, field))
    assert finding.severity == severity
    assert says in finding.message


def test_measured_on_undeclared_is_an_error(tmp_path: Path) -> None:
    loaded = with_config(load(tmp_path, registry_doc()), GEMMA, measured_on="gpu4")
    finding = only(validate(loaded, shipped_policy()), config_path(GEMMA, "measured_on"))
    assert finding.severity == "error"
    assert "gpu0, gpu1" in finding.message


def test_reserved_above_total_is_an_error(tmp_path: Path) -> None:
    local = {"devices": {"gpu1": {"reserved_mib": 30000}}}
    finding = only(run(tmp_path, local=local), "$.devices.gpu1.reserved_mib")
    assert finding.severity == "error"
    assert finding.file == str(tmp_path / "home" / "model-registry.json")


@pytest.mark.parametrize(
    ("service", "says"),
    [
        pytest.param("mistral-server", "strata-server", id="missing-from-the-policy"),
        pytest.param("gemma-server", "uap-mistral-server", id="whose-unit-no-config-runs"),
    ],
)
def test_a_service_the_policy_does_not_run_for_the_model_is_an_error(
    tmp_path: Path, service: str, says: str
) -> None:
    registry = registry_doc()
    registry["models"]["mistral-small-4"]["service"] = service
    finding = only(run(tmp_path, registry), "$.models.mistral-small-4.service")
    assert finding.severity == "error"
    assert says in finding.message


def test_service_unit_matches_with_or_without_the_suffix(tmp_path: Path) -> None:
    policy = policy_doc()
    service_of(policy, "gemma-server")["unit"] = "uap-gemma-server.service"
    assert not has_errors(run(tmp_path, policy=policy))


def test_invalid_model_unit_name_is_an_error(tmp_path: Path) -> None:
    loaded = with_model(load(tmp_path, registry_doc()), "mistral-small-4", unit="x;reboot")
    finding = only(validate(loaded, shipped_policy()), "$.models.mistral-small-4.unit")
    assert finding.severity == "error"


def test_invalid_config_unit_name_is_an_error(tmp_path: Path) -> None:
    loaded = with_config(load(tmp_path, registry_doc()), GEMMA, unit="../x")
    finding = only(validate(loaded, shipped_policy()), config_path(GEMMA, "unit"))
    assert finding.severity == "error"


def test_rails_missing_is_a_warning(tmp_path: Path) -> None:
    registry = registry_doc()
    del registry["models"]["mistral-small-4"]["rails"]
    finding = only(run(tmp_path, registry), "$.models.mistral-small-4.rails")
    assert (finding.severity, finding.message) == (
        "warning",
        "rails unknown; concurrency not trusted",
    )


def test_an_id_claimed_by_two_models_is_an_error(tmp_path: Path) -> None:
    registry = registry_doc()
    registry["models"]["mistral-small-4"]["advertises"].append("gpt-5.1-codex")
    finding = only(run(tmp_path, registry), "$.models.mistral-small-4.advertises")
    assert finding.severity == "error"
    assert "qwen3.8-flash-next, mistral-small-4" in finding.message


def test_a_config_key_shared_by_two_models_is_a_warning(tmp_path: Path) -> None:
    registry = registry_doc()
    registry["models"]["mistral-small-4"]["configs"]["llama-mtp"] = {"status": "unmeasured"}
    finding = only(run(tmp_path, registry), "$.models.mistral-small-4.configs")
    assert finding.severity == "warning"


def test_no_policy_is_a_warning(tmp_path: Path) -> None:
    findings = validate(load(tmp_path, registry_doc()), None)
    assert [(f.severity, f.json_path) for f in findings] == [
        ("warning", "$"),
        ("warning", "$.proxy"),
    ]
    assert "cross-checks skipped" in findings[0].message


def test_findings_on_local_entries_name_the_local_file(tmp_path: Path) -> None:
    local = {
        "models": {
            "gemma4-26b-a4b": {
                "configs": {
                    GEMMA[1]: {**config_of(registry_doc(), GEMMA), "kv_resident_cells": 99999}
                }
            }
        }
    }
    finding = only(run(tmp_path, local=local), config_path(GEMMA, "kv_resident_cells"))
    assert finding.file == str(tmp_path / "home" / "model-registry.json")
