"""Enforcement safety without systemd: the preflight decision, timeouts from facts, alerts.

:func:`~uapplace.enforce.preflight.preflight_problems` is pure (facts in, named problems out),
so every refusal reason is shown here on plain values. The enforcer-level cases
drive a real :class:`~uapplace.enforce.enforcer.Enforcer` over the in-memory host of
``enforce_fakes`` with a :class:`~uapplace.io.units.UnitManager` that is never
connected: the preflight then cannot read the new unit, which must refuse the run
before anything is touched.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from enforce_fakes import ListHost, static_readings

from uapplace.core.alerts import AlertKind, Severity
from uapplace.core.model import (
    Config,
    ConfigStatus,
    Device,
    DeviceKind,
    DeviceReading,
    ParkReason,
    PendingEntry,
    ProbeSource,
    Resident,
    ResidentState,
)
from uapplace.core.planner import PlanInput, plan
from uapplace.enforce.enforcer import Enforcer
from uapplace.enforce.preflight import (
    PreflightFacts,
    executable_problems,
    preflight_problems,
    preflight_summary,
)
from uapplace.enforce.run import EnforcementResult, RunningAfter, StepRecord
from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.registry import load_registry
from uapplace.files.timeouts import Timeouts
from uapplace.io.units import UnitManager, UnitState

MEASURED_AT = "2026-10-08T14:02:00Z"


# --------------------------------------------------------------------------- timeouts


def config(**kw: Any) -> Config:
    values: dict[str, Any] = {
        "key": "b1",
        "status": ConfigStatus.MEASURED,
        "resident_gpu_mib": 16000.0,
        "host_rss_mib": 2048.0,
        "measured_at": MEASURED_AT,
        "measured_on": "gpu0",
    }
    values.update(kw)
    return Config(**values)


@pytest.mark.parametrize(
    ("start_s", "expected"),
    [(1.0, 10.0), (2.0, 11.0), (20.0, 65.0), (150.0, 455.0)],
    ids=["floor", "just-over-floor", "typical", "slow-model"],
)
def test_a_measured_start_gives_max_floor_three_times_plus_margin(
    start_s: float, expected: float
) -> None:
    timeouts = Timeouts()
    bound = timeouts.verify_up_bound("beta/b1", config(start_s=start_s), timeouts.verify_up_s)

    formula = max(
        timeouts.measured_start_floor_s,
        timeouts.measured_start_multiple * start_s + timeouts.measured_start_margin_s,
    )
    assert bound.seconds == formula == expected
    assert f"beta/b1 measured start {start_s:g}s" in bound.source
    assert bound.text().startswith(f"bound {expected:g}s (")


def test_a_measured_start_wins_over_the_operators_bound_and_the_global_value() -> None:
    timeouts = Timeouts(verify_up_s=900.0)
    facts = config(start_s=4.0, start_timeout_s=300.0)

    assert timeouts.verify_up_bound("beta/b1", facts, timeouts.verify_up_s).seconds == 17.0


def test_the_operators_start_timeout_applies_without_a_measured_start() -> None:
    timeouts = Timeouts()
    bound = timeouts.verify_up_bound("beta/b1", config(start_timeout_s=45.0), 120.0)

    assert bound.seconds == 45.0
    assert bound.source == "start_timeout_s of beta/b1"


def test_a_start_measured_elsewhere_does_not_count() -> None:
    untrusted = config(start_s=1.0, start_timeout_s=30.0, untrusted="measured only in the repo")

    bound = Timeouts().verify_up_bound("beta/b1", untrusted, 120.0)

    assert bound.seconds == 30.0


def test_without_facts_the_fallback_is_used_and_the_defaults_are_well_under_600s() -> None:
    timeouts = Timeouts()
    assert timeouts.verify_up_s <= 120.0 and timeouts.rollback_up_s <= 120.0

    bound = timeouts.verify_up_bound("beta/b1", config(), timeouts.verify_up_s)
    assert bound.seconds == timeouts.verify_up_s
    assert "records no start_s or start_timeout_s" in bound.source
    assert timeouts.verify_up_bound("gone", None, 7.0).seconds == 7.0


def test_the_overrides_file_changes_the_default_and_the_formula_not_a_configs_facts(
    tmp_path: Path,
) -> None:
    path = tmp_path / "enforcement-timeouts.json"
    doc = {"verify_up_s": 300, "measured_start_multiple": 2, "measured_start_floor_s": 5}
    path.write_text(json.dumps(doc), encoding="utf-8")

    timeouts = Timeouts.load(path)

    assert timeouts.verify_up_bound("b", config(), timeouts.verify_up_s).seconds == 300.0
    assert timeouts.verify_up_bound("b", config(start_s=1.0), 300.0).seconds == 7.0
    assert timeouts.verify_up_bound("b", config(start_timeout_s=20.0), 300.0).seconds == 20.0


def test_a_start_multiple_under_one_is_refused_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "enforcement-timeouts.json"
    path.write_text(json.dumps({"measured_start_multiple": 0.5}), encoding="utf-8")

    with pytest.raises(ConfigFileError) as caught:
        Timeouts.load(path)
    assert caught.value.json_path == "$.measured_start_multiple"


# --------------------------------------------------------------------------- registry fields


def registry_doc(b1: dict[str, Any]) -> dict[str, Any]:
    return {
        "version": 1,
        "devices": {
            "gpu0": {"kind": "gpu", "total_mib": 24576, "reserved_mib": 0},
            "cpu0": {"kind": "cpu", "total_mib": 65536, "reserved_mib": 1024},
        },
        "models": {
            "beta": {
                "display": "Beta",
                "engine": "llama.cpp",
                "unit": "beta",
                "configs": {"b1": b1, "b2": {"status": "unmeasured", "start_timeout_s": 60}},
            }
        },
    }


def test_registry_start_facts_are_read_from_the_local_file(tmp_path: Path) -> None:
    b1 = {
        "resident_gpu_mib": 16000,
        "host_rss_mib": 64,
        "measured_at": MEASURED_AT,
        "measured_on": "gpu0",
        "start_s": 1.5,
        "start_timeout_s": 90,
    }
    repo = tmp_path / "repo.json"
    local = tmp_path / "local.json"
    repo.write_text(json.dumps(registry_doc(b1)), encoding="utf-8")
    local_doc = {"version": 1, "models": {"beta": {"configs": {"b1": b1}}}}
    local.write_text(json.dumps(local_doc), encoding="utf-8")

    loaded = load_registry(repo, local).registry.models["beta"]

    assert (loaded.configs["b1"].start_s, loaded.configs["b1"].start_timeout_s) == (1.5, 90.0)
    assert loaded.configs["b2"].start_timeout_s == 60.0


@pytest.mark.parametrize(("field_name", "value"), [("start_s", 0), ("start_timeout_s", "30")])
def test_a_bad_start_fact_names_the_file_and_field(
    tmp_path: Path, field_name: str, value: object
) -> None:
    b1 = {"resident_gpu_mib": 16000, "host_rss_mib": 64, field_name: value}
    repo = tmp_path / "repo.json"
    repo.write_text(json.dumps(registry_doc(b1)), encoding="utf-8")

    with pytest.raises(ConfigFileError) as caught:
        load_registry(repo, None)
    assert caught.value.file == repo
    assert caught.value.json_path == f"$.models.beta.configs.b1.{field_name}"


# --------------------------------------------------------------------------- preflight


def unit_state(**kw: Any) -> UnitState:
    values: dict[str, Any] = {
        "active_state": "inactive",
        "sub_state": "dead",
        "load_state": "loaded",
        "main_pid": 0,
        "exec_start": f"{sys.executable} -m engine",
        "exec_paths": (sys.executable,),
    }
    values.update(kw)
    return UnitState(**values)


def resident(model: str = "alpha", cfg: str = "a1", **kw: Any) -> Resident:
    values: dict[str, Any] = {
        "model": model,
        "config": cfg,
        "device": "gpu0",
        "engine": "llama.cpp",
        "endpoint": "http://127.0.0.1:8081",
        "unit": f"{model}.service",
        "state": ResidentState.HOT,
        "gpu_mib": 14000.0,
        "host_rss_mib": 1024.0,
        "since": MEASURED_AT,
    }
    values.update(kw)
    return Resident(**values)


HOST = Device("cpu0", DeviceKind.CPU, 65536, 1024)


def host_reading(free_mib: float = 60000.0, **kw: Any) -> DeviceReading:
    values: dict[str, Any] = {"source": ProbeSource.MEMAVAILABLE}
    values.update(kw)
    return DeviceReading("cpu0", DeviceKind.CPU, 65536, free_mib, **values)


def facts(**kw: Any) -> PreflightFacts:
    state = kw.pop("state", unit_state())
    values: dict[str, Any] = {
        "unit": "beta.service",
        "state": state,
        "unit_error": "",
        "binaries": executable_problems(state.exec_paths) if state is not None else {},
        "label": "beta/b1",
        "config": config(),
        "device": "gpu0",
        "host": HOST,
        "host_reading": host_reading(),
        "victims": (resident(),),
    }
    values.update(kw)
    return PreflightFacts(**values)


def test_a_loaded_unit_with_an_executable_measured_config_and_room_passes() -> None:
    passing = facts()

    assert preflight_problems(passing) == []
    summary = preflight_summary(passing)
    assert f"beta.service loaded, ExecStart {sys.executable} executable" in summary
    assert "beta/b1 measured on gpu0" in summary
    assert "host RAM: needs 2,048 MiB, 60,000 MiB available once the victims stop" in summary


def test_a_unit_that_does_not_exist_is_named_with_its_load_state() -> None:
    missing = unit_state(
        load_state="not-found", exec_paths=(), load_error="Unit beta.service not found."
    )

    problems = preflight_problems(facts(state=missing))

    assert problems == [
        "unit beta.service: LoadState is 'not-found', not 'loaded': Unit beta.service not "
        "found. (no unit file: install it in the user unit directory, then daemon-reload)"
    ]


@pytest.mark.parametrize("load_state", ["bad-setting", "error", "masked"])
def test_a_unit_that_did_not_load_is_refused(load_state: str) -> None:
    problems = preflight_problems(facts(state=unit_state(load_state=load_state)))

    assert problems == [f"unit beta.service: LoadState is {load_state!r}, not 'loaded'"]


def test_an_unreadable_unit_state_is_refused_with_the_managers_error() -> None:
    problems = preflight_problems(facts(state=None, unit_error="UnitManager is not connected"))

    assert problems == [
        "unit beta.service: its state cannot be read from the user manager "
        "(UnitManager is not connected)"
    ]


def test_a_new_unit_already_running_outside_any_resident_is_refused() -> None:
    running = unit_state(active_state="active", sub_state="running", main_pid=4242)

    problems = preflight_problems(facts(state=running))

    assert problems == [
        "unit beta.service: already active/running, MainPID 4242 but not a verified "
        "resident; stop it, or let the unit sync verify it, before placing it"
    ]
    # The same unit run by a victim (another config of the model) stops first: fine.
    shared = facts(state=running, victims=(resident("beta", "b0", unit="beta.service"),))
    assert preflight_problems(shared) == []


def test_a_unit_without_exec_start_is_refused() -> None:
    problems = preflight_problems(facts(state=unit_state(exec_paths=(), exec_start="")))

    assert problems == ["unit beta.service: no ExecStart= command, so nothing would start"]


def test_each_bad_exec_start_binary_is_named(tmp_path: Path) -> None:
    plain = tmp_path / "not-executable"
    plain.write_text("#!/bin/sh\n", encoding="utf-8")
    plain.chmod(0o644)
    missing = tmp_path / "missing" / "llama-server"
    paths = (str(missing), str(plain), str(tmp_path), "relative/engine", sys.executable)

    problems = preflight_problems(facts(state=unit_state(exec_paths=paths)))

    assert problems == [
        f"unit beta.service: ExecStart binary {missing} does not exist",
        f"unit beta.service: ExecStart binary {plain} is not executable",
        f"unit beta.service: ExecStart binary {tmp_path} is not a regular file",
        "unit beta.service: ExecStart binary relative/engine is not an absolute path",
    ]


def test_a_binary_path_that_cannot_be_looked_up_is_named(tmp_path: Path) -> None:
    a_file = tmp_path / "engine"
    a_file.write_text("", encoding="utf-8")

    found = executable_problems([str(a_file / "llama-server")])

    assert found == {str(a_file / "llama-server"): "cannot be read (Not a directory)"}


def test_a_config_not_measured_for_this_machine_is_refused_with_the_registrys_reason() -> None:
    repo_only = config(untrusted="measured only in the repo file config/model-registry.json")

    problems = preflight_problems(facts(config=repo_only))

    assert problems == [
        "beta/b1: not measured for this machine "
        "(measured only in the repo file config/model-registry.json)"
    ]


def test_an_unmeasured_config_and_one_without_a_timestamp_are_refused() -> None:
    unmeasured = Config("b1", ConfigStatus.UNMEASURED)
    undated = config(measured_at=None)

    assert preflight_problems(facts(config=unmeasured)) == [
        "beta/b1: not measured for this machine (status is unmeasured)"
    ]
    assert preflight_problems(facts(config=undated)) == [
        "beta/b1: not measured for this machine (no measured_at)"
    ]


def test_a_config_measured_on_another_device_is_refused() -> None:
    problems = preflight_problems(facts(config=config(measured_on="gpu1")))

    assert problems == ["beta/b1: measured_on is gpu1, not gpu0: its cost on gpu0 is unknown"]


def test_the_host_ram_gate_counts_what_the_victims_free_and_the_reserve() -> None:
    # 1,500 available + 1,024 freed by alpha − 1,024 reserve = 1,500 < 2,048 needed.
    short = facts(host_reading=host_reading(free_mib=1500.0))
    # 2,100 + 1,024 − 1,024 = 2,100 ≥ 2,048: the victim's RAM makes it fit.
    fits = facts(host_reading=host_reading(free_mib=2100.0))

    assert preflight_problems(short) == [
        "host RAM gate: beta/b1 needs 2,048 MiB host RAM; cpu0 has 1,500 MiB available "
        "+ 1,024 MiB the victims free − 1,024 MiB reserve = 1,500 MiB"
    ]
    assert preflight_problems(fits) == []
    assert preflight_problems(replace(fits, victims=())) != []


def test_the_host_ram_gate_fails_closed_without_a_host_device_or_reading() -> None:
    absent = host_reading(source=ProbeSource.ABSENT, error="/proc/meminfo unreadable")

    assert preflight_problems(facts(host=None)) == [
        "host RAM gate: the registry has no cpu device, so beta/b1 is unchecked"
    ]
    assert preflight_problems(facts(host_reading=absent)) == [
        "host RAM gate: no reading of cpu0 (/proc/meminfo unreadable)"
    ]
    assert preflight_problems(facts(host_reading=None)) == [
        "host RAM gate: no reading of cpu0 (absent)"
    ]
    probe_failed = facts(host_reading=None, host_error="the probe failed: OSError: boom")
    assert preflight_problems(probe_failed) == [
        "host RAM gate: no reading of cpu0 (the probe failed: OSError: boom)"
    ]


def test_every_problem_is_reported_at_once() -> None:
    everything = facts(
        state=unit_state(exec_paths=("/nonexistent/llama-server",)),
        config=config(measured_on="gpu1"),
        host_reading=host_reading(free_mib=0.0),
    )

    problems = preflight_problems(everything)

    assert [p.split(":")[0] for p in problems] == [
        "unit beta.service",
        "beta/b1",
        "host RAM gate",
    ]


# --------------------------------------------------------------------------- the enforcer


@pytest.fixture
async def units() -> AsyncIterator[UnitManager]:
    manager = UnitManager("unix:path=/nonexistent/bus")  # never connected: every read fails
    yield manager
    manager.close()


@pytest.fixture
def host() -> ListHost:
    return ListHost(live=[resident(host_rss_mib=64.0, unit="alpha.service")])


def park(host: ListHost) -> PendingEntry:
    options = plan(PlanInput(host.reg, host.live, static_readings()), "beta").options
    entry = PendingEntry(
        "plc-000001", "beta", "client", None, 0.0, 1e12, ParkReason.NOT_RESIDENT, options=options
    )
    host.entries[entry.id] = entry
    return entry


async def test_a_run_whose_new_unit_cannot_be_read_is_refused_before_anything_is_touched(
    host: ListHost, units: UnitManager
) -> None:
    entry = park(host)

    result = await Enforcer(host, units).apply(entry, 1, ["alpha/a1"])

    assert result["ok"] is False and "rolledBack" not in result
    assert [(s["name"], s["ok"]) for s in result["steps"]] == [
        ("revalidate", True),
        ("preflight", False),
    ]
    assert result["error"].startswith("preflight: unit beta.service: its state cannot be read")
    assert result["error"].endswith("; nothing was stopped")
    # alpha was never marked, drained or stopped; its state is honestly "unknown" here.
    assert [r.state for r in host.live] == [ResidentState.HOT]
    # Units whose state cannot be read are listed as such, never assumed gone.
    assert [(r["model"], r["unit"], r["state"]) for r in result["runningAfter"]] == [
        ("alpha", "alpha.service", "state unknown"),
        ("beta", "beta.service", "state unknown"),
    ]
    assert entry.id in host.entries  # still pending: nothing happened
    assert host.alerts == []  # an operator's own call: the result is the report


async def test_an_unattended_refused_run_raises_an_enforcement_failed_alert(
    host: ListHost, units: UnitManager
) -> None:
    entry = park(host)

    queued = await Enforcer(host, units).apply(entry, 1, ["alpha/a1"], wait=True)
    clicked = await Enforcer(host, units).apply(entry, 1, ["alpha/a1"], origin="notification click")

    assert queued["ok"] is False and clicked["ok"] is False
    assert [(kind, severity, subject) for kind, severity, subject, _ in host.alerts] == [
        (AlertKind.ENFORCEMENT_FAILED, Severity.WARNING, "beta"),
        (AlertKind.ENFORCEMENT_FAILED, Severity.WARNING, "beta"),
    ]
    first, second = (message for *_, message in host.alerts)
    assert first.startswith(f"auto-load: apply {entry.id} option 1 (displace beta/b1 on gpu0")
    assert "was refused before anything stopped: preflight: unit beta.service" in first
    assert second.startswith("notification click: ")
    assert host.resolved == []


def test_result_json_names_what_runs_at_the_end() -> None:
    running = (RunningAfter("alpha", "a1", "gpu0", "alpha.service", "active/running"),)
    result = EnforcementResult(
        False,
        "run-1",
        "plc-1",
        (StepRecord("rollback-clear", True, "x"),),
        rolled_back=True,
        error="verify-up: x; rolled back",
        running_after=running,
    )

    assert result.to_json()["runningAfter"] == [
        {
            "model": "alpha",
            "config": "a1",
            "device": "gpu0",
            "unit": "alpha.service",
            "state": "active/running",
        }
    ]
    assert running[0].text() == "alpha/a1 on gpu0, alpha.service active/running"
    assert "runningAfter" not in EnforcementResult(True, "run-2", None, ()).to_json()
