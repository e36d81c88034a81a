"""The ledger: concurrent writers, corrupt files, atomic replace, docs/placement-rules.md §4.2."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import multiprocessing
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from uapplace.core.alerts import Alert
from uapplace.core.model import (
    DeviceKind,
    DeviceReading,
    Holder,
    Option,
    OptionKind,
    ParkReason,
    PendingEntry,
    ProbeSource,
    ProcessUsage,
    Resident,
    ResidentState,
    Victim,
    parse_iso,
)
from uapplace.files import ledger_schema
from uapplace.files.ledger import (
    Ledger,
    LedgerDoc,
    LedgerFormatError,
    LedgerLockTimeout,
    doc_from_json,
    doc_to_json,
    option_from_json,
    pending_from_json,
    pending_to_json,
)

T0 = parse_iso("2026-10-08T14:02:00Z")


def _victim() -> Victim:
    return Victim(
        model="qwen3.8-flash",
        config="strata-iq3_s",
        state=ResidentState.HOT,
        device="gpu0",
        holders=(Holder("claude-code", "inflight", "sess-1", "2026-10-08T14:01:00Z"),),
        in_flight=None,
        frees_mib=21812.0,
        consequence="kill: reload from disk takes ~90 s",
        reload_mib=21812.0,
    )


def _options() -> tuple[Option, ...]:
    return (
        Option(OptionKind.REUSE, "qwen3.8-27b", "q4", "gpu1", 0.0),
        Option(
            OptionKind.LOAD_ALONGSIDE, "qwen3.8-27b", "q4", "gpu1", 18000.5, affinity_match=True
        ),
        Option(OptionKind.DISPLACE, "qwen3.8-27b", "q4", "gpu0", 19999.125, victims=(_victim(),)),
    )


def full_doc() -> LedgerDoc:
    return LedgerDoc(
        updated_at=T0 + 11,
        devices={
            "gpu0": DeviceReading(
                "gpu0",
                DeviceKind.GPU,
                24576.0,
                1016.25,
                ProbeSource.NVML,
                (ProcessUsage(4242, 21812.0, "strata-server --port 8080"),),
                uuid="GPU-5c1e",
            ),
            "gpu1": DeviceReading(
                "gpu1", DeviceKind.GPU, 0.0, 0.0, ProbeSource.ABSENT, error="NVML: Not Found"
            ),
            "cpu0": DeviceReading(
                "cpu0", DeviceKind.CPU, 126944.0, 30424.0, ProbeSource.MEMAVAILABLE
            ),
        },
        residents=[
            Resident(
                model="qwen3.8-flash",
                config="strata-iq3_s",
                device="gpu0",
                engine="strata",
                endpoint="http://127.0.0.1:8080",
                unit="uap-strata-server.service",
                state=ResidentState.HOT,
                gpu_mib=21812.0,
                host_rss_mib=52857.0,
                since="2026-10-08T09:14:02Z",
                holders=(Holder("ide", "hold", "pinned for a demo", cookie=7),),
                main_pid=4242,
            ),
            Resident(
                model="small",
                config="cpu",
                device="cpu0",
                engine="llama.cpp",
                endpoint=None,
                unit=None,
                state=ResidentState.WARMING,
                gpu_mib=None,
                host_rss_mib=None,
                since="2026-10-08T14:00:00Z",
            ),
        ],
        pending=[
            PendingEntry(
                id="plc-7f2a",
                requested_model="qwen3.8-27b",
                client="claude-code",
                session="sess-1",
                created_at=T0,
                expires_at=T0 + 120,
                reason=ParkReason.NOT_RESIDENT,
                cells=65536,
                pid=41122,
                options=_options(),
            ),
            PendingEntry(
                id="plc-0001",
                requested_model="mystery",
                client="curl",
                session=None,
                created_at=T0,
                expires_at=T0 + 120,
                reason=ParkReason.UNKNOWN_MODEL,
            ),
        ],
        usage={"qwen3.8-flash": T0 - 30},
        cooldowns={"small": T0 + 600},
    )


# --------------------------------------------------------------------------- shape and round trip


def test_full_document_round_trips_through_json() -> None:
    doc = full_doc()
    data = doc_to_json(doc)
    assert doc_from_json(json.loads(json.dumps(data))) == doc


def test_json_is_the_spec_document() -> None:
    data = doc_to_json(full_doc())
    assert list(data) == [
        "version",
        "updated_at",
        "devices",
        "residents",
        "pending",
        "usage",
        "cooldowns",
        "alerts",
    ]
    assert data["version"] == 1
    assert data["updated_at"] == "2026-10-08T14:02:11Z"
    assert data["devices"]["gpu0"] == {
        "kind": "gpu",
        "total_mib": 24576.0,
        "free_mib": 1016.25,
        "source": "nvml",
        "processes": [{"pid": 4242, "used_mib": 21812.0, "command": "strata-server --port 8080"}],
        "uuid": "GPU-5c1e",
    }
    assert data["devices"]["cpu0"]["source"] == "MemAvailable"
    assert data["devices"]["gpu1"]["error"] == "NVML: Not Found"
    resident = data["residents"][0]
    assert resident["state"] == "hot"
    assert resident["since"] == "2026-10-08T09:14:02Z"
    assert resident["holders"] == [
        {"client": "ide", "kind": "hold", "detail": "pinned for a demo", "cookie": 7}
    ]
    pending = data["pending"][0]
    assert pending["created_at"] == "2026-10-08T14:02:00Z"
    assert pending["expires_at"] == "2026-10-08T14:04:00Z"
    assert pending["reason"] == "not_resident"
    assert pending["options"][2]["signature"] == ["qwen3.8-flash/strata-iq3_s"]
    assert data["usage"] == {"qwen3.8-flash": "2026-10-08T14:01:30Z"}
    assert data["cooldowns"] == {"small": "2026-10-08T14:12:00Z"}


@pytest.mark.parametrize("index", [0, 1, 2])
def test_option_from_json_inverts_to_json(index: int) -> None:
    option = _options()[index]
    assert option_from_json(option.to_json()) == option


def test_pending_entry_round_trips_and_tolerates_list_pending_extras() -> None:
    entry = full_doc().pending[0]
    data = pending_to_json(entry) | {"recommended": 1}
    assert pending_from_json(data) == entry


def test_spec_example_shape_is_accepted() -> None:
    doc = doc_from_json(
        {
            "version": 1,
            "updated_at": "2026-10-08T14:02:11Z",
            "devices": {
                "gpu0": {
                    "kind": "gpu",
                    "total_mib": 24576,
                    "free_mib": 1016,
                    "reserved_mib": 1293,
                    "source": "nvml",
                },
                "cpu0": {
                    "kind": "cpu",
                    "total_mib": 126944,
                    "free_mib": 30424,
                    "headroom_mib": 8192,
                    "source": "MemAvailable",
                },
            },
            "residents": [
                {
                    "model": "qwen3.8-flash-next-iq3_s",
                    "config": "strata-iq3_s",
                    "device": "gpu0",
                    "engine": "strata",
                    "endpoint": "http://127.0.0.1:8080",
                    "unit": "uap-strata-server",
                    "state": "hot",
                    "gpu_mib": 21812,
                    "host_rss_mib": 52857,
                    "holders": [],
                    "since": "2026-10-08T09:14:02Z",
                }
            ],
            "pending": [],
        }
    )
    assert doc.devices["gpu0"].free_mib == 1016
    assert doc.residents[0].state is ResidentState.HOT
    assert doc.usage == {}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["residents"][0].update(state="asleep"), r"residents\[0\]\.state"),
        (lambda d: d["pending"][0].update(expires_at="soon"), r"pending\[0\]\.expires_at"),
        (
            lambda d: d["pending"][0].update(created_at="2026-10-08T14:02:00"),
            r"pending\[0\]\.created_at: .*zone",
        ),
        (lambda d: d["devices"]["gpu0"].update(source="nvidia-smi"), r"devices\.gpu0\.source"),
        (lambda d: d.update(version=2), r"version"),
        (lambda d: d["usage"].update(m=5), r"usage\.m"),
        (
            lambda d: d["pending"][0]["options"][2]["victims"][0].pop("consequence"),
            r"pending\[0\]\.options\[2\]\.victims\[0\]\.consequence",
        ),
    ],
)
def test_bad_documents_name_the_json_path(mutate: Any, message: str) -> None:
    data = json.loads(json.dumps(doc_to_json(full_doc())))
    mutate(data)
    with pytest.raises(LedgerFormatError, match=message):
        doc_from_json(data)


# --------------------------------------------------------------------------- the file


def test_update_creates_private_directory_and_file(tmp_path: Path) -> None:
    path = tmp_path / "home" / ".uap" / "placement.json"
    ledger = Ledger(path)
    assert ledger.read() == LedgerDoc()
    assert not path.exists()

    result = ledger.update(lambda doc: doc.usage.setdefault("m", T0))
    assert result == T0
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    doc = ledger.read()
    assert doc.usage == {"m": T0}
    assert doc.updated_at > T0
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "placement.json",
        "placement.json.lock",
    ]


def test_full_document_round_trips_through_the_file(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "placement.json")
    original = full_doc()

    def replace_all(doc: LedgerDoc) -> None:
        doc.devices = dict(original.devices)
        doc.residents = list(original.residents)
        doc.pending = list(original.pending)
        doc.usage = dict(original.usage)
        doc.cooldowns = dict(original.cooldowns)

    ledger.update(replace_all)
    read_back = ledger.read()
    read_back.updated_at = original.updated_at
    assert read_back == original


def test_failing_change_leaves_the_file_untouched(tmp_path: Path) -> None:
    path = tmp_path / "placement.json"
    ledger = Ledger(path)
    ledger.update(lambda doc: doc.usage.update(m=T0))
    before = path.read_bytes()

    def crash_mid_change(doc: LedgerDoc) -> None:
        doc.usage.clear()
        doc.residents.append(full_doc().residents[0])
        raise RuntimeError("crashed mid-write")

    with pytest.raises(RuntimeError, match="crashed mid-write"):
        ledger.update(crash_mid_change)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["placement.json", "placement.json.lock"]
    # The lock was released: the next writer goes through.
    ledger.update(lambda doc: doc.usage.update(n=T0), lock_timeout=0.5)
    assert set(ledger.read().usage) == {"m", "n"}


def test_lock_timeout_names_the_lock_file(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "placement.json")
    ledger.update(lambda doc: None)
    fd = os.open(ledger.lock_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(LedgerLockTimeout, match=r"placement\.json\.lock") as caught:
            ledger.update(lambda doc: doc.usage.update(m=T0), lock_timeout=0.05)
        assert caught.value.lock_path == ledger.lock_path
        assert isinstance(caught.value, TimeoutError)
    finally:
        os.close(fd)
    assert ledger.read().usage == {}


def test_corrupt_file_is_moved_aside_and_reads_continue(tmp_path: Path) -> None:
    path = tmp_path / "placement.json"
    path.write_text("{ this is not json")
    ledger = Ledger(path)

    assert ledger.read() == LedgerDoc()
    aside = list(tmp_path.glob("placement.json.corrupt-*"))
    assert len(aside) == 1
    assert aside[0].read_text() == "{ this is not json"
    assert not path.exists()
    assert ledger.last_error is not None
    assert str(aside[0]) in ledger.last_error
    assert "invalid JSON" in ledger.last_error

    ledger.update(lambda doc: doc.usage.update(m=T0))
    assert ledger.read().usage == {"m": T0}


def test_update_over_a_schema_corrupt_file_starts_empty_and_keeps_the_old_one(
    tmp_path: Path,
) -> None:
    # The document as a whole is wrong (a bad item alone is dropped alone: see
    # tests/unit/test_hostile_files.py).
    path = tmp_path / "placement.json"
    bad = json.dumps({"version": 1, "updated_at": "yesterday", "residents": []})
    path.write_text(bad)
    ledger = Ledger(path)

    ledger.update(lambda doc: doc.cooldowns.update(m=T0))
    assert ledger.read().cooldowns == {"m": T0}
    aside = list(tmp_path.glob("placement.json.corrupt-*"))
    assert [p.read_text() for p in aside] == [bad]
    assert ledger.last_error is not None
    assert "updated_at" in ledger.last_error
    assert str(aside[0]) in ledger.last_error


def test_corrupt_files_are_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "placement.json"
    ledger = Ledger(path)
    for text in ("first", "second", "third"):
        path.write_text(text)
        ledger.read()
    kept = sorted(p.read_text() for p in tmp_path.glob("placement.json.corrupt-*"))
    assert kept == ["first", "second", "third"]


# --------------------------------------------------------------------------- concurrency


def _increment(path: str, name: str, times: int) -> None:
    ledger = Ledger(Path(path))

    def bump(doc: LedgerDoc) -> None:
        doc.usage["total"] = doc.usage.get("total", 0.0) + 1
        doc.usage[name] = doc.usage.get(name, 0.0) + 1

    for _ in range(times):
        ledger.update(bump, lock_timeout=60)


def test_two_processes_500_writes_each_lose_no_update(tmp_path: Path) -> None:
    path = tmp_path / "placement.json"
    context = multiprocessing.get_context("fork")
    writers = [
        context.Process(target=_increment, args=(str(path), name, 500)) for name in ("a", "b")
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert [w.exitcode for w in writers] == [0, 0]
    usage = Ledger(path).read().usage
    assert usage == {"total": 1000.0, "a": 500.0, "b": 500.0}


def test_readers_never_see_a_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "placement.json"
    ledger = Ledger(path)
    ledger.update(lambda doc: doc.residents.extend(full_doc().residents))
    writer = multiprocessing.get_context("fork").Process(
        target=_increment, args=(str(path), "w", 200)
    )
    writer.start()
    try:
        while writer.is_alive():
            doc = ledger.read()
            assert ledger.last_error is None
            assert len(doc.residents) == 2
    finally:
        writer.join()
    assert writer.exitcode == 0
    assert ledger.read().usage["total"] == 200.0
    assert not list(tmp_path.glob("*.corrupt-*"))


def test_alerts_round_trip_through_the_ledger() -> None:
    from uapplace.core.alerts import AlertBoard, AlertKind, Severity

    board = AlertBoard(lambda: T0)
    board.raise_alert(
        AlertKind.ROLLBACK_INCOMPLETE, Severity.CRITICAL, "gpu0", "empty", {"run": "r1"}
    )
    doc = full_doc()
    doc.alerts = board.active()
    back = doc_from_json(json.loads(json.dumps(doc_to_json(doc))))
    assert back.alerts == doc.alerts
    assert back.alerts[0].detail == {"run": "r1"}


@pytest.mark.parametrize(
    ("schema", "inside", "derived"),
    [
        (ledger_schema.ProcessJson, ProcessUsage, set()),
        (ledger_schema.DeviceJson, DeviceReading, {"reserved_mib", "headroom_mib"}),
        (ledger_schema.HolderJson, Holder, set()),
        (ledger_schema.VictimJson, Victim, set()),
        (ledger_schema.OptionJson, Option, {"signature", "frees_mib", "frees_host_mib"}),
        (ledger_schema.PendingJson, PendingEntry, {"recommended"}),
        (ledger_schema.AlertJson, Alert, set()),
    ],
)
def test_each_file_item_names_its_fields_as_the_inside_type(
    schema: type[BaseModel], inside: type[Any], derived: set[str]
) -> None:
    """The converters of ``ledger_schema`` pass fields on by name: a field the file model
    adds must exist on the inside type, or be one the inside type derives (dropped)."""
    inside_fields = {f.name for f in dataclasses.fields(inside)}
    assert set(schema.model_fields) - derived <= inside_fields


def test_the_resident_schema_is_built_from_the_resident_dataclass() -> None:
    """``ResidentJson`` has no field list of its own: ``Resident``'s, in its order; a file
    spelling for a field the dataclass does not have is refused when the module loads."""
    assert list(ledger_schema.ResidentJson.model_fields) == [
        f.name for f in dataclasses.fields(Resident)
    ]
    with pytest.raises(TypeError, match=r"\['sinse'\] are not fields of Resident"):
        ledger_schema.schema_of(Resident, "Typo", {"sinse": (str, ...)})
