"""The measured enforcement envelope: registry round trip, staleness, derived timeouts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from uapplace.core.model import Config, ConfigStatus, Envelope, parse_iso
from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.registry import ENVELOPE_MAX_AGE_DAYS, envelope_staleness, load_registry
from uapplace.files.registry_write import write_local_envelope, write_local_measurement
from uapplace.files.timeouts import Timeouts

ENVELOPE = Envelope(
    stop_s=2.0,
    free_s=2.5,
    cold_start_s=20.0,
    warm_start_s=8.0,
    measured_at="2026-10-08T14:00:00Z",
    measured_on="gpu0",
    sleep_s=0.5,
    sleep_freed_mib=5800.0,
    wake_s=1.5,
)


def measured(**changes: Any) -> Config:
    base = Config(
        key="q4",
        status=ConfigStatus.MEASURED,
        resident_gpu_mib=6000,
        host_rss_mib=100,
        measured_at="2026-10-08T13:00:00Z",
        measured_on="gpu0",
        envelope=ENVELOPE,
    )
    return replace(base, **changes)


# --------------------------------------------------------------------------- timeouts


def test_verify_up_derives_from_the_envelope_cold_start() -> None:
    bound = Timeouts().verify_up_bound("m/q4", measured(start_s=99.0), 120.0)
    assert bound.seconds == 3 * 20.0 + 5
    assert "envelope cold start 20s" in bound.source


def test_verify_up_has_a_floor() -> None:
    quick = replace(ENVELOPE, cold_start_s=0.5)
    assert Timeouts().verify_up_bound("m/q4", measured(envelope=quick), 120.0).seconds == 10.0


def test_untrusted_envelope_is_not_used() -> None:
    config = measured(untrusted="measured on another card")
    bound = Timeouts().verify_up_bound("m/q4", config, 120.0)
    assert bound.seconds == 120.0
    assert bound.source.startswith("default")
    assert Timeouts().verify_free_bound([("m/q4", config)]).seconds == Timeouts().verify_free_s


def test_verify_free_derives_from_the_slowest_release() -> None:
    slow = measured(envelope=replace(ENVELOPE, stop_s=1.0, free_s=5.0))
    bound = Timeouts().verify_free_bound([("a/q4", measured()), ("b/q4", slow)])
    assert bound.seconds == 3 * 4.0 + 2
    assert bound.source.startswith("b/q4 memory back 4s after its stop")
    assert Timeouts().verify_free_bound([("a/q4", measured())]).seconds == 5.0, "the floor"


def test_verify_free_without_every_envelope_is_the_default() -> None:
    bound = Timeouts(verify_free_s=15).verify_free_bound(
        [("a/q4", measured()), ("b/q4", measured(envelope=None))]
    )
    assert (bound.seconds, bound.source) == (15, "default: b/q4 has no measured envelope")
    assert Timeouts().verify_free_bound([]).source == "default: no victims"


def test_drain_derives_from_the_switch() -> None:
    victims = [("a/q4", measured()), ("b/q4", measured())]
    bound = Timeouts().drain_bound(("new/q8", measured()), victims)
    assert bound.seconds == 2 * (2.0 + 2.0 + 20.0)
    assert "stop a/q4 2s + stop b/q4 2s + start new/q8 20s" in bound.source
    small = replace(ENVELOPE, stop_s=0.1, cold_start_s=1.0)
    assert Timeouts().drain_bound(None, [("a/q4", measured(envelope=small))]).seconds == 30.0


def test_drain_without_the_starting_envelope_is_the_default() -> None:
    bound = Timeouts(drain_s=60).drain_bound(
        ("new/q8", measured(envelope=None)), [("a/q4", measured())]
    )
    assert bound.seconds == 60
    assert "new/q8 has no measured envelope" in bound.source


def test_wake_bound_from_the_measured_wake() -> None:
    assert Timeouts().wake_bound("m/q4", measured(), 120.0).seconds == 10.0
    slow = replace(ENVELOPE, wake_s=12.0)
    assert Timeouts().wake_bound("m/q4", measured(envelope=slow), 120.0).seconds == 41.0
    no_wake = replace(ENVELOPE, wake_s=None)
    assert Timeouts().wake_bound("m/q4", measured(envelope=no_wake), 120.0).seconds == 120.0


def test_timeouts_file_takes_the_new_knobs(tmp_path: Path) -> None:
    path = tmp_path / "enforcement-timeouts.json"
    path.write_text(json.dumps({"drain_multiple": 4, "verify_free_floor_s": 1.5}))
    loaded = Timeouts.load(path)
    assert (loaded.drain_multiple, loaded.verify_free_floor_s) == (4, 1.5)
    path.write_text(json.dumps({"drain_multiple": 0.5}))
    with pytest.raises(ConfigFileError, match="drain_multiple"):
        Timeouts.load(path)


# --------------------------------------------------------------------------- staleness


NOW = parse_iso("2026-10-09T00:00:00Z")


def test_fresh_envelope_is_not_stale() -> None:
    assert envelope_staleness(measured(), NOW) is None
    assert envelope_staleness(measured(envelope=None), NOW) is None


def test_envelope_older_than_the_footprint_is_stale() -> None:
    why = envelope_staleness(measured(measured_at="2026-10-08T15:00:00Z"), NOW)
    assert why is not None and "before the footprint (2026-10-08T15:00:00Z)" in why


def test_envelope_on_another_device_is_stale() -> None:
    why = envelope_staleness(measured(measured_on="gpu1"), NOW)
    assert why is not None and "measured on gpu0, the footprint on gpu1" in why


def test_old_envelope_is_stale() -> None:
    later = NOW + (ENVELOPE_MAX_AGE_DAYS + 1) * 86400
    why = envelope_staleness(measured(), later)
    assert why is not None and "31 days old" in why
    assert envelope_staleness(measured(), later, max_age_days=60) is None


# --------------------------------------------------------------------------- the local file


REPO = {
    "version": 1,
    "devices": {"gpu0": {"kind": "gpu", "total_mib": 24576, "reserved_mib": 0}},
    "models": {
        "m": {
            "display": "M",
            "engine": "vllm",
            "unit": "uap-m",
            "configs": {"q4": {"status": "unmeasured", "pause_lever": "vllm-sleep-1"}},
        }
    },
}


def test_envelope_round_trips_through_the_local_file(tmp_path: Path) -> None:
    repo = tmp_path / "repo.json"
    repo.write_text(json.dumps(REPO))
    local = tmp_path / "local.json"
    footprint = {
        "status": "measured",
        "resident_gpu_mib": 6000,
        "host_rss_mib": 100,
        "measured_at": "2026-10-08T13:00:00Z",
        "measured_on": "gpu0",
    }
    write_local_measurement(local, "m", "q4", footprint)
    write_local_envelope(local, "m", "q4", ENVELOPE.to_json())
    config = load_registry(repo, local).registry.models["m"].configs["q4"]
    assert config.envelope == ENVELOPE
    assert config.resident_gpu_mib == 6000


def test_envelope_needs_a_local_footprint(tmp_path: Path) -> None:
    local = tmp_path / "local.json"
    with pytest.raises(ConfigFileError, match=r"no machine-local footprint for m/q4"):
        write_local_envelope(local, "m", "q4", ENVELOPE.to_json())
    assert not local.exists()


def test_bad_envelope_names_the_field(tmp_path: Path) -> None:
    repo = tmp_path / "repo.json"
    repo.write_text(json.dumps(REPO))
    local = tmp_path / "local.json"
    entry = {
        "resident_gpu_mib": 6000,
        "host_rss_mib": 100,
        "envelope": {**ENVELOPE.to_json(), "stop_s": -1},
    }
    local.write_text(json.dumps({"version": 1, "models": {"m": {"configs": {"q4": entry}}}}))
    load = load_registry(repo, local)
    assert load.errors
    assert load.errors[0].json_path == "$.models.m.configs.q4.envelope.stop_s"
