"""``uapplace top``'s pure view (:mod:`uapplace.cli.top_view`) and the generated
backend's registry entry (:mod:`uapplace.files.backend_entry`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.worlds.bus_forms import displace
from uapplace.cli.top_view import (
    FREE,
    FULL,
    RESERVED,
    USED_BY_OTHERS,
    RunSteps,
    device_bar,
    device_segments,
    inflight_text,
    option_impact,
    pending_rows,
)
from uapplace.files.backend_entry import remove_local_model, write_local_model
from uapplace.files.jsonfile import ConfigFileError

GPU: dict[str, Any] = {"total_mib": 24576, "free_mib": 8576, "reserved_mib": 1024}
ALPHA: dict[str, Any] = {"model": "alpha", "config": "q4", "device": "gpu0", "gpu_mib": 14000}


def test_segments_split_the_device_into_residents_others_free_and_reserved() -> None:
    segments = device_segments(GPU, [ALPHA], "gpu0")
    assert [(s.label, s.mib) for s in segments] == [
        ("alpha/q4", 14000),
        ("used by others", 2000),  # 24576 - 8576 free - 14000 alpha
        ("free", 7552),
        ("reserved", 1024),
    ]
    assert sum(s.mib for s in segments) == GPU["total_mib"]


def test_the_bar_is_as_wide_as_asked_and_every_stretch_shows() -> None:
    bar = device_bar("gpu0", GPU, [ALPHA], 40).plain
    first, legend = bar.split("\n")
    cells = first[first.index("[") + 1 : first.index("]")]
    assert len(cells) == 40
    assert cells.startswith(FULL) and USED_BY_OTHERS in cells and FREE in cells
    assert cells.endswith(RESERVED)
    assert "alpha/q4 14,000 MiB" in legend and "reserved 1,024 MiB" in legend


def test_a_resident_of_another_device_is_not_on_this_bar() -> None:
    elsewhere = {**ALPHA, "device": "gpu1"}
    labels = [s.label for s in device_segments(GPU, [elsewhere], "gpu0")]
    assert "alpha/q4" not in labels


def test_pending_rows_one_per_option_and_the_impact_names_the_victims() -> None:
    victim = {
        "model": "alpha",
        "config": "q4",
        "device": "gpu0",
        "state": "hot",
        "in_flight": None,
        "holders": [{"client": "eval", "kind": "hold"}],
        "consequence": "reload ≈ 38 s",
    }
    option = displace("beta", "b1", 16000, victim, frees_mib=14000)
    entry = {
        "id": "plc-1a2b3c",
        "requested_model": "beta",
        "client": "cli",
        "expires_at": "2999-01-01T00:00:00Z",
        "options": [option],
        "recommended": 1,
    }
    rows = pending_rows([entry, {**entry, "id": "plc-000000", "options": []}])
    assert [row.key for row, _ in rows] == ["plc-1a2b3c#1", "plc-000000#0"]
    assert rows[0][1][4] == "1 *"
    assert rows[0][1][5].endswith("stops alpha/q4, frees 14,000 MiB")
    assert "no options" in rows[1][1][5]
    impact = option_impact("header", [victim], 14000)
    assert "in flight unknown (counts as busy); holders eval (hold)" in impact
    assert impact.endswith("Frees 14,000 MiB in total.")


def test_inflight_is_the_engines_own_count_or_unknown() -> None:
    assert inflight_text({"requests_processing": 2.0, "requests_deferred": 1.0}) == (
        "2 (+1 waiting)"
    )
    assert inflight_text({"requests_processing": 0.0}) == "0"
    assert inflight_text({}) == "?"


def test_run_steps_start_over_on_a_new_run_id() -> None:
    run = RunSteps().with_step("r1", "revalidate", True, "", 10.0)
    run = run.with_step("r1", "stop", False, "timed out", 12.5)
    assert [(s.name, s.elapsed_s) for s in run.steps] == [("revalidate", 0.0), ("stop", 2.5)]
    assert "FAILED stop: timed out" in run.text().plain
    assert [s.name for s in run.with_step("r2", "revalidate", True, "", 20.0).steps] == [
        "revalidate"
    ]


def test_backend_entry_is_added_validated_and_removed_only_when_ours(tmp_path: Path) -> None:
    local = tmp_path / "model-registry.json"
    entry = {
        "display": "tiny",
        "engine": "llama.cpp",
        "unit": "uap-tiny",
        "endpoint": "http://127.0.0.1:8080",
        "configs": {"default": {"status": "unmeasured"}},
    }
    write_local_model(local, "tiny", entry, replace=False)
    assert json.loads(local.read_text())["models"]["tiny"] == entry
    with pytest.raises(ConfigFileError, match=r"\$\.models\.tiny: .*--force"):
        write_local_model(local, "tiny", entry, replace=False)
    with pytest.raises(ConfigFileError, match="endpoint"):
        write_local_model(local, "bad", {**entry, "endpoint": "not a url"}, replace=False)
    assert "bad" not in json.loads(local.read_text())["models"]  # nothing half-written
    assert remove_local_model(local, "tiny", "uap-other") is False
    assert remove_local_model(local, "tiny", "uap-tiny") is True
    assert json.loads(local.read_text())["models"] == {}
