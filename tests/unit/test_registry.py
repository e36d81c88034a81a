"""Registry schema, repo + local merge, provenance, cost math and local writes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from uapplace.core.model import DEFAULT_CELLS, Config, ConfigStatus, DeviceKind, cost_mib
from uapplace.core.unitnames import unit_file_name, valid_unit_name
from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.registry import RegistryLoad, load_registry, local_measurements, provenance_rows
from uapplace.files.registry_write import write_local_device, write_local_measurement

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"


def repo_doc() -> dict[str, Any]:
    """A small repo registry: two devices, one measured model, one unmeasured."""
    return {
        "version": 1,
        "devices": {
            "gpu0": {"kind": "gpu", "name": "Card", "total_mib": 24576, "reserved_mib": 2048},
            "cpu0": {"kind": "cpu", "total_mib": 126944, "reserved_mib": 8192},
        },
        "models": {
            "alpha": {
                "display": "Alpha",
                "engine": "llama.cpp",
                "unit": "uap-alpha-server",
                "endpoint": "http://127.0.0.1:8081",
                "rails": 2,
                "affinity": {"device": ["gpu0"]},
                "configs": {
                    "a-q4": {
                        "resident_gpu_mib": 12000,
                        "host_rss_mib": 2000,
                        "context_pool_cells": 65536,
                        "kv_resident_cells": 32768,
                        "kv_mib_per_1k_cells": 8.0,
                        "measured_at": "2026-10-08T14:02:00Z",
                        "measured_on": "gpu0",
                        "flags": ["-c", "65536"],
                    },
                    "a-q8": {"status": "unmeasured"},
                },
                "advertises": ["alpha-latest"],
            },
        },
    }


def write(path: Path, doc: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def load(tmp_path: Path, repo: Any, local: Any | None = None) -> RegistryLoad:
    repo_path = write(tmp_path / "config" / "model-registry.json", repo)
    local_path = tmp_path / "home" / "model-registry.json"
    if local is not None:
        write(local_path, local)
    return load_registry(repo_path, local_path)


def repo_error(tmp_path: Path, repo: Any) -> ConfigFileError:
    with pytest.raises(ConfigFileError) as caught:
        load(tmp_path, repo)
    return caught.value


# --------------------------------------------------------------------------- shipped file


def test_shipped_registry_loads_with_the_spec_figures() -> None:
    loaded = load_registry(CONFIG_DIR / "model-registry.json", None)
    registry = loaded.registry
    assert loaded.errors == ()
    assert [d.key for d in registry.gpus()] == ["gpu0", "gpu1"]
    host = registry.host()
    assert host is not None and host.total_mib == 126944
    strata = registry.models["qwen3.8-flash-next"].configs["strata-iq3_s"]
    # Figures in the repo file are descriptive: they do not count on this machine
    # (docs/placement-rules.md §4.1: with no local file, nothing is measured).
    assert strata.status is ConfigStatus.MEASURED and not strata.is_measured
    assert "measured only in the repo file" in strata.untrusted
    assert (strata.resident_gpu_mib, strata.host_rss_mib) == (21812, 52857)
    assert strata.flags[:2] == ("--max-context", "131072")
    qwen27 = registry.models["qwen3.8-27b"]
    assert set(qwen27.configs) == {"llama-mtp", "exl3-4bit", "gsq-rco"}
    assert all(c.status is ConfigStatus.UNMEASURED for c in qwen27.configs.values())
    assert not any(c.is_measured for m in registry.models.values() for c in m.configs.values())
    measured_on = {
        model.key: {
            c.measured_on for c in model.configs.values() if c.status is ConfigStatus.MEASURED
        }
        for model in registry.models.values()
    }
    assert measured_on["gemma4-26b-a4b"] == {"gpu1"}
    assert measured_on["mistral-small-4"] == {"gpu0"}


def test_missing_local_file_is_not_an_error(tmp_path: Path) -> None:
    loaded = load(tmp_path, repo_doc())
    assert loaded.errors == ()
    assert loaded.registry.models["alpha"].configs["a-q4"].provenance == "repo"


# --------------------------------------------------------------------------- merge


def test_local_config_replaces_the_repo_config_whole(tmp_path: Path) -> None:
    local = {
        "models": {
            "alpha": {
                "configs": {
                    "a-q4": {
                        "resident_gpu_mib": 12500,
                        "host_rss_mib": 2100,
                        "measured_at": "2026-10-09T10:00:00Z",
                        "measured_on": "gpu0",
                    }
                }
            }
        }
    }
    config = load(tmp_path, repo_doc(), local).registry.models["alpha"].configs["a-q4"]
    assert config.provenance == "local"
    assert config.resident_gpu_mib == 12500
    # Not merged field by field: the repo's KV geometry and flags do not leak through.
    assert config.kv_mib_per_1k_cells is None
    assert config.context_pool_cells is None
    assert config.flags == ()


def test_a_local_measurement_keeps_what_the_repo_declares_for_the_config(
    tmp_path: Path,
) -> None:
    """Issue 21 item 6: the repo's ``pause_lever`` (and the other declared fields) survive a
    machine-local measurement that does not set them; one the local entry sets wins."""
    repo = repo_doc()
    repo["models"]["alpha"]["configs"]["a-q8"] = {
        "status": "unmeasured",
        "pause_lever": "vllm-sleep-1",
        "start_timeout_s": 300,
        "unit": "uap-alpha-q8",
    }
    measured = {
        "resident_gpu_mib": 19000,
        "host_rss_mib": 2500,
        "measured_at": "2026-10-09T10:00:00Z",
        "measured_on": "gpu0",
    }
    local = {"models": {"alpha": {"configs": {"a-q8": measured}}}}
    config = load(tmp_path, repo, local).registry.models["alpha"].configs["a-q8"]
    assert config.is_measured and config.provenance == "local"
    assert config.pause_lever == "vllm-sleep-1"
    assert (config.start_timeout_s, config.unit) == (300, "uap-alpha-q8")
    local["models"]["alpha"]["configs"]["a-q8"] = {**measured, "pause_lever": "vllm-sleep-2"}
    config = load(tmp_path, repo, local).registry.models["alpha"].configs["a-q8"]
    assert config.pause_lever == "vllm-sleep-2"


def test_config_only_in_repo_keeps_repo_content(tmp_path: Path) -> None:
    local = {
        "models": {"alpha": {"configs": {"a-q4": repo_doc()["models"]["alpha"]["configs"]["a-q4"]}}}
    }
    configs = load(tmp_path, repo_doc(), local).registry.models["alpha"].configs
    assert configs["a-q8"].status is ConfigStatus.UNMEASURED
    assert configs["a-q8"].provenance == "repo"
    assert configs["a-q4"].provenance == "local"


def test_local_measurement_makes_an_unmeasured_config_placeable(tmp_path: Path) -> None:
    local = {
        "models": {
            "alpha": {
                "configs": {
                    "a-q8": {
                        "resident_gpu_mib": 19000,
                        "host_rss_mib": 2500,
                        "kv_resident_cells": 32768,
                        "measured_at": "2026-10-09T10:00:00Z",
                        "measured_on": "gpu0",
                    }
                }
            }
        }
    }
    config = load(tmp_path, repo_doc(), local).registry.models["alpha"].configs["a-q8"]
    assert config.is_measured
    assert config.provenance == "local"
    assert cost_mib(config, 1000) == 19000


def test_device_fields_merge_per_field_with_provenance(tmp_path: Path) -> None:
    local = {"devices": {"gpu0": {"reserved_mib": 1293, "uuid": "GPU-1234"}}}
    device = load(tmp_path, repo_doc(), local).registry.devices["gpu0"]
    assert (device.total_mib, device.reserved_mib, device.uuid) == (24576, 1293, "GPU-1234")
    assert device.name == "Card"
    assert device.provenance == {
        "kind": "repo",
        "name": "repo",
        "total_mib": "repo",
        "reserved_mib": "local",
        "uuid": "local",
    }


def test_local_only_device_is_added_when_complete(tmp_path: Path) -> None:
    local = {"devices": {"gpu1": {"kind": "gpu", "total_mib": 16384, "reserved_mib": 512}}}
    device = load(tmp_path, repo_doc(), local).registry.devices["gpu1"]
    assert device.kind is DeviceKind.GPU
    assert set(device.provenance.values()) == {"local"}


def test_model_fields_merge_per_field_with_provenance(tmp_path: Path) -> None:
    local = {"models": {"alpha": {"endpoint": "http://127.0.0.1:9999", "rails": 1}}}
    loaded = load(tmp_path, repo_doc(), local)
    model = loaded.registry.models["alpha"]
    assert model.endpoint == "http://127.0.0.1:9999"
    assert model.rails == 1
    assert model.unit == "uap-alpha-server"
    assert loaded.model_provenance["alpha"]["endpoint"] == "local"
    assert loaded.model_provenance["alpha"]["unit"] == "repo"


def test_provenance_rows_name_the_file_of_each_config_and_device_field(tmp_path: Path) -> None:
    local = {
        "devices": {"gpu0": {"reserved_mib": 1293}},
        "models": {"alpha": {"configs": {"a-q8": {"status": "unmeasured"}}}},
    }
    loaded = load(tmp_path, repo_doc(), local)
    rows = provenance_rows(loaded)
    by_key = {(r["kind"], r["entry"], r["field"]): r for r in rows}
    reserved = by_key[("device", "$.devices.gpu0", "reserved_mib")]
    assert (reserved["source"], reserved["file"]) == ("local", str(loaded.local_path))
    total = by_key[("device", "$.devices.gpu0", "total_mib")]
    assert (total["source"], total["file"]) == ("repo", str(loaded.repo_path))
    a_q4 = by_key[("config", "$.models.alpha.configs.a-q4", "*")]
    a_q8 = by_key[("config", "$.models.alpha.configs.a-q8", "*")]
    assert (a_q4["source"], a_q8["source"]) == ("repo", "local")
    assert a_q8["file"] == str(loaded.local_path)


# --------------------------------------------------------------------------- bad repo input


def test_wrong_type_names_file_and_json_path(tmp_path: Path) -> None:
    doc = repo_doc()
    doc["models"]["alpha"]["configs"]["a-q4"]["resident_gpu_mib"] = "12000"
    err = repo_error(tmp_path, doc)
    assert err.file == tmp_path / "config" / "model-registry.json"
    assert err.json_path == "$.models.alpha.configs.a-q4.resident_gpu_mib"
    assert str(err) == f"{err.file}: {err.json_path}: {err.message}"
    assert "number" in err.message


def test_string_for_an_integer_device_field_is_refused(tmp_path: Path) -> None:
    doc = repo_doc()
    doc["devices"]["gpu0"]["total_mib"] = "24576"
    assert repo_error(tmp_path, doc).json_path == "$.devices.gpu0.total_mib"


def test_misspelt_config_field_is_refused(tmp_path: Path) -> None:
    doc = repo_doc()
    doc["models"]["alpha"]["configs"]["a-q4"]["resident_gpu_mb"] = 1
    err = repo_error(tmp_path, doc)
    assert err.json_path == "$.models.alpha.configs.a-q4.resident_gpu_mb"
    assert "Extra inputs" in err.message


def test_unmeasured_config_carries_no_numbers(tmp_path: Path) -> None:
    doc = repo_doc()
    doc["models"]["alpha"]["configs"]["a-q8"]["resident_gpu_mib"] = 1
    assert repo_error(tmp_path, doc).json_path == "$.models.alpha.configs.a-q8.resident_gpu_mib"


def test_measured_config_needs_its_footprint(tmp_path: Path) -> None:
    doc = repo_doc()
    del doc["models"]["alpha"]["configs"]["a-q4"]["host_rss_mib"]
    err = repo_error(tmp_path, doc)
    assert err.json_path == "$.models.alpha.configs.a-q4.host_rss_mib"
    assert "required" in err.message


def test_unknown_affinity_device_names_the_path(tmp_path: Path) -> None:
    doc = repo_doc()
    doc["models"]["alpha"]["affinity"]["device"] = ["gpu0", "gpu7"]
    err = repo_error(tmp_path, doc)
    assert err.json_path == "$.models.alpha.affinity.device[1]"
    assert "gpu7" in err.message and "gpu0, cpu0" in err.message


def test_unknown_measured_on_device_names_the_path(tmp_path: Path) -> None:
    doc = repo_doc()
    doc["models"]["alpha"]["configs"]["a-q4"]["measured_on"] = "gpu3"
    err = repo_error(tmp_path, doc)
    assert err.json_path == "$.models.alpha.configs.a-q4.measured_on"


@pytest.mark.parametrize(
    ("where", "path"),
    [
        (("models", "alpha", "unit"), "$.models.alpha.unit"),
        (("models", "alpha", "configs", "a-q4", "unit"), "$.models.alpha.configs.a-q4.unit"),
    ],
)
def test_bad_unit_name_names_the_path(tmp_path: Path, where: tuple[str, ...], path: str) -> None:
    doc = repo_doc()
    target = doc
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = "../etc/evil.service"
    err = repo_error(tmp_path, doc)
    assert err.json_path == path
    assert "invalid unit name" in err.message


@pytest.mark.parametrize("unit", ["models.target", "engines.slice", "data.mount", "x.swap"])
def test_a_unit_kind_that_runs_no_engine_is_refused_naming_the_path(
    tmp_path: Path, unit: str
) -> None:
    doc = repo_doc()
    doc["models"]["alpha"]["unit"] = unit
    err = repo_error(tmp_path, doc)
    assert err.json_path == "$.models.alpha.unit"
    assert f"unit {unit!r} is a .{unit.rsplit('.', 1)[1]}, which runs no engine" in err.message


def test_bad_device_key_is_refused(tmp_path: Path) -> None:
    doc = repo_doc()
    doc["devices"]["gpu 2"] = {"kind": "gpu", "total_mib": 1, "reserved_mib": 0}
    err = repo_error(tmp_path, doc)
    assert err.json_path == "$.devices.gpu 2"
    assert err.message.startswith("bad key")


def test_bad_measured_at_is_refused(tmp_path: Path) -> None:
    doc = repo_doc()
    doc["models"]["alpha"]["configs"]["a-q4"]["measured_at"] = "yesterday"
    assert repo_error(tmp_path, doc).json_path == "$.models.alpha.configs.a-q4.measured_at"


def test_invalid_json_names_line_and_column(tmp_path: Path) -> None:
    repo_path = tmp_path / "model-registry.json"
    repo_path.write_text('{\n  "version": 1,\n  "devices": {,}\n}\n', encoding="utf-8")
    with pytest.raises(ConfigFileError) as caught:
        load_registry(repo_path, None)
    assert caught.value.file == repo_path
    assert caught.value.json_path == "$"
    assert "line 3 column 15" in caught.value.message


def test_duplicate_json_key_is_refused(tmp_path: Path) -> None:
    repo_path = tmp_path / "model-registry.json"
    repo_path.write_text('{"version": 1, "version": 1}', encoding="utf-8")
    with pytest.raises(ConfigFileError, match="duplicate key 'version'"):
        load_registry(repo_path, None)


def test_missing_repo_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match="file not found"):
        load_registry(tmp_path / "absent.json", None)


def test_wrong_version_is_refused(tmp_path: Path) -> None:
    doc = repo_doc()
    doc["version"] = 2
    assert repo_error(tmp_path, doc).json_path == "$.version"


def test_every_problem_in_a_file_is_reported(tmp_path: Path) -> None:
    doc = repo_doc()
    doc["devices"]["gpu0"]["total_mib"] = -1
    doc["models"]["alpha"]["rails"] = 0
    err = repo_error(tmp_path, doc)
    assert [e.json_path for e in err.every()] == [
        "$.devices.gpu0.total_mib",
        "$.models.alpha.rails",
    ]


# --------------------------------------------------------------------------- bad local input


def test_invalid_local_file_leaves_repo_defaults_and_reports(tmp_path: Path) -> None:
    local = {
        "devices": {"gpu0": {"reserved_mib": 100}},
        "models": {"alpha": {"configs": {"a-q8": {"resident_gpu_mib": "lots", "host_rss_mib": 1}}}},
    }
    loaded = load(tmp_path, repo_doc(), local)
    assert [(e.file, e.json_path) for e in loaded.errors] == [
        (tmp_path / "home" / "model-registry.json", "$.models.alpha.configs.a-q8.resident_gpu_mib")
    ]
    # Ignored whole: the valid device override is not half-applied either.
    assert loaded.registry.devices["gpu0"].reserved_mib == 2048
    assert loaded.registry.models["alpha"].configs["a-q8"].status is ConfigStatus.UNMEASURED


def test_local_file_with_invalid_json_is_reported(tmp_path: Path) -> None:
    local_path = tmp_path / "home" / "model-registry.json"
    local_path.parent.mkdir(parents=True)
    local_path.write_text('{"models": ', encoding="utf-8")
    repo_path = write(tmp_path / "config" / "model-registry.json", repo_doc())
    loaded = load_registry(repo_path, local_path)
    assert len(loaded.errors) == 1
    assert loaded.errors[0].file == local_path
    assert "invalid JSON at line 1" in loaded.errors[0].message
    # The repo defaults are in force, and their figures are descriptive: fail closed.
    config = loaded.registry.models["alpha"].configs["a-q4"]
    assert config.status is ConfigStatus.MEASURED and not config.is_measured


def test_local_reference_to_an_unknown_device_is_a_local_error(tmp_path: Path) -> None:
    local = {"models": {"alpha": {"affinity": {"device": ["gpu9"]}}}}
    loaded = load(tmp_path, repo_doc(), local)
    assert [(e.file.name, e.json_path) for e in loaded.errors] == [
        ("model-registry.json", "$.models.alpha.affinity.device[0]")
    ]
    assert loaded.errors[0].file.parent.name == "home"
    assert loaded.registry.models["alpha"].affinity_devices == ("gpu0",)


def test_local_only_device_missing_fields_is_a_local_error(tmp_path: Path) -> None:
    loaded = load(tmp_path, repo_doc(), {"devices": {"gpu1": {"reserved_mib": 512}}})
    assert {e.json_path for e in loaded.errors} == {
        "$.devices.gpu1.kind",
        "$.devices.gpu1.total_mib",
    }
    assert "gpu1" not in loaded.registry.devices


def test_local_device_declared_there_can_be_referenced_by_local_config(tmp_path: Path) -> None:
    local = {
        "devices": {"gpu1": {"kind": "gpu", "total_mib": 16384, "reserved_mib": 512}},
        "models": {
            "alpha": {
                "configs": {
                    "a-q8": {
                        "resident_gpu_mib": 9000,
                        "host_rss_mib": 900,
                        "measured_at": "2026-10-09T10:00:00Z",
                        "measured_on": "gpu1",
                    }
                }
            }
        },
    }
    loaded = load(tmp_path, repo_doc(), local)
    assert loaded.errors == ()
    assert loaded.registry.models["alpha"].configs["a-q8"].measured_on == "gpu1"


def test_repo_error_is_raised_even_with_a_valid_local_file(tmp_path: Path) -> None:
    doc = repo_doc()
    doc["models"]["alpha"]["affinity"]["device"] = ["gpu5"]
    with pytest.raises(ConfigFileError) as caught:
        load(tmp_path, doc, {"devices": {"gpu0": {"reserved_mib": 1000}}})
    assert caught.value.file.parent.name == "config"


# --------------------------------------------------------------------------- unit names


@pytest.mark.parametrize(
    "name",
    ["uap-strata-server", "uap-strata-server.service", "llama@gpu1.service", "_x", "a.b-c_d"],
)
def test_valid_unit_names(name: str) -> None:
    assert valid_unit_name(name)


@pytest.mark.parametrize(
    "name",
    ["", "-rf", ".hidden", "a/b", "a..service", "a b", "a;rm", "$(x)", "é", "x" * 256],
)
def test_invalid_unit_names(name: str) -> None:
    assert not valid_unit_name(name)


def test_unit_file_name_adds_service_only_without_a_suffix() -> None:
    assert unit_file_name("uap-strata-server") == "uap-strata-server.service"
    assert unit_file_name("uap-strata-server.service") == "uap-strata-server.service"
    assert unit_file_name("llama@gpu1.socket") == "llama@gpu1.socket"
    assert unit_file_name("model.v2") == "model.v2.service"


# --------------------------------------------------------------------------- cost math


def strata(**changes: Any) -> Config:
    fields: dict[str, Any] = {
        "key": "strata-iq3_s",
        "status": ConfigStatus.MEASURED,
        "resident_gpu_mib": 21812,
        "host_rss_mib": 52857,
        "context_pool_cells": 131072,
        "per_session_cap_cells": 114688,
        "kv_resident_cells": 32768,
        "kv_mib_per_1k_cells": 12.2,
        "measured_at": "2026-10-08T14:02:00Z",
        "measured_on": "gpu0",
    }
    fields.update(changes)
    return Config(**fields)


@pytest.mark.parametrize("cells", [1, DEFAULT_CELLS - 1, DEFAULT_CELLS])
def test_cost_within_the_resident_pool_is_the_resident_figure(cells: int) -> None:
    assert cost_mib(strata(), cells) == 21812


def test_cost_at_the_session_cap_adds_marginal_kv() -> None:
    # 21,812 + (114,688 − 32,768)/1000 × 12.2 = 21,812 + 999.424
    assert cost_mib(strata(), 114688) == pytest.approx(22811.424)
    assert cost_mib(strata(), DEFAULT_CELLS + 1000) == pytest.approx(21812 + 12.2)


def test_cost_of_the_shipped_config_matches_the_spec(tmp_path: Path) -> None:
    shipped = json.loads((CONFIG_DIR / "model-registry.json").read_text(encoding="utf-8"))
    local = write(tmp_path / "home" / "model-registry.json", local_measurements(shipped))
    registry = load_registry(CONFIG_DIR / "model-registry.json", local).registry
    config = registry.models["qwen3.8-flash-next"].configs["strata-iq3_s"]
    assert cost_mib(config, 32768) == 21812
    assert cost_mib(config, 114688) == pytest.approx(22811.424)
    repo_only = load_registry(CONFIG_DIR / "model-registry.json", None).registry
    assert cost_mib(repo_only.models["qwen3.8-flash-next"].configs["strata-iq3_s"], 1) is None


def test_cost_is_unknown_when_unmeasured() -> None:
    assert cost_mib(Config(key="x", status=ConfigStatus.UNMEASURED), 1) is None


def test_cost_is_unknown_without_measured_at() -> None:
    assert cost_mib(strata(measured_at=None), 1000) is None


def test_cost_is_unknown_past_the_pool_without_a_per_1k_rate() -> None:
    config = strata(kv_mib_per_1k_cells=None)
    assert cost_mib(config, 32768) == 21812
    assert cost_mib(config, 32769) is None


# --------------------------------------------------------------------------- local writes


MEASUREMENT = {
    "resident_gpu_mib": 18000,
    "host_rss_mib": 2400,
    "context_pool_cells": 65536,
    "kv_resident_cells": 65536,
    "kv": "q8_0",
    "measured_at": "2026-10-09T10:00:00Z",
    "measured_on": "gpu0",
    "flags": ["-c", "65536"],
    "host_free_mib": 30424,
}


def test_write_local_measurement_round_trip(tmp_path: Path) -> None:
    repo_path = write(tmp_path / "config" / "model-registry.json", repo_doc())
    local_path = tmp_path / "home" / "uap" / "model-registry.json"
    write_local_measurement(local_path, "alpha", "a-q8", MEASUREMENT)
    loaded = load_registry(repo_path, local_path)
    assert loaded.errors == ()
    config = loaded.registry.models["alpha"].configs["a-q8"]
    assert config.is_measured and config.provenance == "local"
    assert (config.resident_gpu_mib, config.kv, config.flags) == (18000, "q8_0", ("-c", "65536"))
    assert json.loads(local_path.read_text())["version"] == 1
    assert stat.S_IMODE(local_path.stat().st_mode) == 0o644


def test_write_local_measurement_keeps_the_rest_of_the_file(tmp_path: Path) -> None:
    local_path = write(
        tmp_path / "model-registry.json",
        {
            "version": 1,
            "devices": {"gpu0": {"reserved_mib": 1293}},
            "models": {"alpha": {"rails": 1, "configs": {"a-q4": {"status": "unmeasured"}}}},
        },
    )
    write_local_measurement(local_path, "alpha", "a-q8", MEASUREMENT)
    write_local_measurement(local_path, "alpha", "a-q8", {**MEASUREMENT, "resident_gpu_mib": 18100})
    doc = json.loads(local_path.read_text())
    assert doc["devices"] == {"gpu0": {"reserved_mib": 1293}}
    assert doc["models"]["alpha"]["rails"] == 1
    assert doc["models"]["alpha"]["configs"]["a-q4"] == {"status": "unmeasured"}
    assert doc["models"]["alpha"]["configs"]["a-q8"]["resident_gpu_mib"] == 18100


def test_write_local_measurement_replaces_the_config_whole(tmp_path: Path) -> None:
    local_path = tmp_path / "model-registry.json"
    write_local_measurement(local_path, "alpha", "a-q8", MEASUREMENT)
    smaller = {k: v for k, v in MEASUREMENT.items() if k != "kv"}
    write_local_measurement(local_path, "alpha", "a-q8", smaller)
    assert "kv" not in json.loads(local_path.read_text())["models"]["alpha"]["configs"]["a-q8"]


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp" in p.name)


def test_invalid_measurement_leaves_the_old_file_untouched(tmp_path: Path) -> None:
    local_path = tmp_path / "model-registry.json"
    write_local_measurement(local_path, "alpha", "a-q8", MEASUREMENT)
    before = local_path.read_bytes()
    with pytest.raises(ConfigFileError) as caught:
        write_local_measurement(local_path, "alpha", "a-q4", {**MEASUREMENT, "host_rss_mib": None})
    assert caught.value.file == local_path
    assert caught.value.json_path == "$.models.alpha.configs.a-q4.host_rss_mib"
    assert local_path.read_bytes() == before
    assert leftovers(tmp_path) == []


def test_non_finite_measurement_is_refused(tmp_path: Path) -> None:
    local_path = tmp_path / "model-registry.json"
    with pytest.raises(ConfigFileError):
        write_local_measurement(
            local_path, "alpha", "a-q8", {**MEASUREMENT, "resident_gpu_mib": float("nan")}
        )
    assert not local_path.exists()


def test_corrupt_local_file_is_not_overwritten(tmp_path: Path) -> None:
    local_path = tmp_path / "model-registry.json"
    local_path.write_text("{not json", encoding="utf-8")
    with pytest.raises(ConfigFileError, match="invalid JSON"):
        write_local_measurement(local_path, "alpha", "a-q8", MEASUREMENT)
    assert local_path.read_text(encoding="utf-8") == "{not json"


def test_failed_rename_leaves_the_old_file_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local_path = tmp_path / "model-registry.json"
    write_local_measurement(local_path, "alpha", "a-q8", MEASUREMENT)
    local_path.chmod(0o600)
    before = local_path.read_bytes()

    def refuse(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(ConfigFileError, match="cannot write"):
        write_local_measurement(local_path, "alpha", "a-q4", MEASUREMENT)
    monkeypatch.undo()
    assert local_path.read_bytes() == before
    assert leftovers(tmp_path) == []
    write_local_measurement(local_path, "alpha", "a-q4", MEASUREMENT)
    assert stat.S_IMODE(local_path.stat().st_mode) == 0o600


def test_write_local_device_merges_fields(tmp_path: Path) -> None:
    repo_path = write(tmp_path / "config" / "model-registry.json", repo_doc())
    local_path = tmp_path / "model-registry.json"
    write_local_device(local_path, "gpu0", {"reserved_mib": 1293})
    write_local_device(local_path, "gpu0", {"uuid": "GPU-abc"})
    device = load_registry(repo_path, local_path).registry.devices["gpu0"]
    assert (device.reserved_mib, device.uuid, device.total_mib) == (1293, "GPU-abc", 24576)
    assert device.provenance["reserved_mib"] == "local"


def test_write_local_device_refuses_a_bad_value(tmp_path: Path) -> None:
    local_path = tmp_path / "model-registry.json"
    write_local_device(local_path, "gpu0", {"reserved_mib": 1293})
    before = local_path.read_bytes()
    with pytest.raises(ConfigFileError) as caught:
        write_local_device(local_path, "gpu0", {"reserved_mib": -5})
    assert caught.value.json_path == "$.devices.gpu0.reserved_mib"
    assert local_path.read_bytes() == before


def test_write_refuses_when_the_model_entry_is_not_an_object(tmp_path: Path) -> None:
    local_path = write(tmp_path / "model-registry.json", {"version": 1, "models": {"alpha": []}})
    with pytest.raises(ConfigFileError) as caught:
        write_local_measurement(local_path, "alpha", "a-q8", MEASUREMENT)
    assert caught.value.json_path == "$.models.alpha"
