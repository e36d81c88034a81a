"""Bounded state: pending caps, identity truncation on every path, expiry frees memory."""

from __future__ import annotations

import asyncio
import gc
import json
import tracemalloc
from pathlib import Path

import pytest

from uapplace.controller.controller import Controller
from uapplace.controller.ports import EventRelay, NoEvents
from uapplace.core.admission import (
    MAX_IDENTITY_CHARS,
    MAX_MODEL_ID_CHARS,
    MAX_PENDING,
    MAX_PENDING_PER_CLIENT,
    PLACEMENT_ID,
    Admission,
)
from uapplace.core.model import (
    Config,
    ConfigStatus,
    Device,
    DeviceKind,
    Model,
    ParkReason,
    PendingEntry,
    Registry,
)
from uapplace.files.paths import Paths

NOW = 1_800_000_000.0
TTL = 120.0
FLOOD = 10_000

MEASURED = Config(
    "m-q4",
    ConfigStatus.MEASURED,
    resident_gpu_mib=8_000,
    host_rss_mib=2_000,
    kv_resident_cells=32_768,
    kv_mib_per_1k_cells=10,
    measured_at="2026-01-01T00:00:00Z",
    measured_on="gpu0",
)
LONG_KEY = "k" * (MAX_MODEL_ID_CHARS + 10)
REGISTRY = Registry(
    {"gpu0": Device("gpu0", DeviceKind.GPU, 24_576, 1_024)},
    {
        "m": Model("m", "M", "llama.cpp", {MEASURED.key: MEASURED}),
        LONG_KEY: Model(LONG_KEY, "Long", "llama.cpp", {"long-q4": MEASURED}),
    },
)


def admission() -> Admission:
    return Admission(REGISTRY, ttl=TTL)


def assert_consistent(adm: Admission) -> None:
    """Every index agrees with the pending map (nothing left behind)."""
    entries = list(adm.pending.values())
    assert len(adm._by_key) == len(entries)
    assert sum(len(ids) for ids in adm._by_client.values()) == len(entries)
    assert all(ids for ids in adm._by_client.values())
    for entry in entries:
        assert adm._by_key[(entry.client, entry.requested_model)] == entry.id
        assert entry.id in adm._by_client[entry.client]


def test_a_flood_of_distinct_admits_keeps_pending_under_the_total_cap() -> None:
    adm = admission()
    answered = []
    for n in range(FLOOD):
        decision, entry = adm.decide(f"model-{n}", f"client-{n}", f"s-{n}", None, NOW + n * 0.001)
        assert decision.decision == "park" and entry is not None
        assert PLACEMENT_ID.match(decision.placement_id)
        assert decision.reason == ParkReason.UNKNOWN_MODEL.value
        answered.append(decision.placement_id)
        assert len(adm.pending) <= MAX_PENDING
    assert len(adm.pending) == MAX_PENDING
    evicted = adm.take_evicted()
    assert len(evicted) == FLOOD - MAX_PENDING
    assert adm.take_evicted() == []
    # the newest survive, the oldest were pushed out, in order
    assert list(adm.pending) == answered[-MAX_PENDING:]
    assert [e.id for e in evicted] == answered[: FLOOD - MAX_PENDING]
    assert_consistent(adm)


def test_one_client_flooding_is_held_to_its_own_cap_and_spares_the_others() -> None:
    adm = admission()
    _, bystander = adm.decide("m", "bystander", None, None, NOW)
    assert bystander is not None
    for n in range(FLOOD):
        decision, entry = adm.decide(f"model-{n}", "flooder", None, None, NOW)
        assert decision.decision == "park" and entry is not None
    flooder = [e for e in adm.pending.values() if e.client == "flooder"]
    assert len(flooder) == MAX_PENDING_PER_CLIENT
    assert [e.requested_model for e in flooder] == [
        f"model-{n}" for n in range(FLOOD - MAX_PENDING_PER_CLIENT, FLOOD)
    ]
    assert adm.get(bystander.id) == bystander
    assert len(adm.take_evicted()) == FLOOD - MAX_PENDING_PER_CLIENT
    assert_consistent(adm)


def test_a_repeat_admit_at_the_cap_answers_the_same_entry_without_evicting() -> None:
    adm = admission()
    ids = [adm.decide(f"model-{n}", "c", None, None, NOW)[0].placement_id for n in range(32)]
    again, created = adm.decide("model-0", "c", None, None, NOW + 1)
    assert created is None and again.placement_id == ids[0]
    assert adm.take_evicted() == []


def test_expiry_frees_every_index_and_the_memory() -> None:
    """After expiry only the three index tables, sized for the cap, stay allocated
    (a dict never shrinks its table); a second and third flood add nothing."""
    adm = admission()
    gc.collect()
    tracemalloc.start()
    try:
        residue = []
        for round_ in range(3):
            start = NOW + round_ * 3 * TTL
            for n in range(FLOOD):
                adm.decide("m" + "x" * 1000 + str(n), str(n) + "c" * 200, "s" * 200, None, start)
            adm.take_evicted()
            flooded = tracemalloc.get_traced_memory()[0]
            gone = len(adm.expire(start + 2 * TTL))  # the count only: the list holds entries
            gc.collect()
            residue.append(tracemalloc.get_traced_memory()[0])
            assert gone == MAX_PENDING
            assert adm.pending == {} and adm._by_key == {} and adm._by_client == {}
            assert flooded > 1_500_000  # ~1,024 entries with 1 KB ids were held
    finally:
        tracemalloc.stop()
    assert residue[0] < 256 * 1024
    assert max(residue) - min(residue) < 4 * 1024


def test_client_and_session_are_cut_to_128_and_long_unknown_model_ids_hold_nothing() -> None:
    adm = admission()
    _, entry = adm.decide("m", "c" * 5000, "s" * 5000, None, NOW)
    assert entry is not None
    assert len(entry.client) == MAX_IDENTITY_CHARS and entry.session == "s" * MAX_IDENTITY_CHARS
    at_limit, kept = adm.decide("u" * MAX_MODEL_ID_CHARS, "c", None, None, NOW)
    assert at_limit.reason == ParkReason.UNKNOWN_MODEL.value and kept is not None
    decision, none = adm.decide("u" * (MAX_MODEL_ID_CHARS + 1), "c", None, None, NOW)
    assert none is None
    assert decision.decision == "park" and decision.reason == ParkReason.INVALID_REQUEST.value
    assert len(adm.pending) == 2


def test_a_registry_id_longer_than_the_limit_still_parks_normally() -> None:
    adm = admission()
    decision, entry = adm.decide(LONG_KEY, "c", None, None, NOW)
    assert entry is not None and decision.reason == ParkReason.NOT_RESIDENT.value


def test_restore_keeps_the_caps_and_drops_overlong_ids() -> None:
    adm = admission()
    entries = [
        PendingEntry(
            id=f"plc-{n:06x}",
            requested_model=f"model-{n}",
            client=f"client-{n % 3}",
            session=None,
            created_at=NOW,
            expires_at=NOW + TTL + n,
            reason=ParkReason.UNKNOWN_MODEL,
        )
        for n in range(200)
    ]
    overlong = PendingEntry(
        id="plc-ffffff",
        requested_model="z" * (MAX_MODEL_ID_CHARS + 1),
        client="other",
        session=None,
        created_at=NOW,
        expires_at=NOW + TTL,
        reason=ParkReason.UNKNOWN_MODEL,
    )
    dropped = adm.restore([*entries, overlong], NOW)
    assert len(adm.pending) == 3 * MAX_PENDING_PER_CLIENT
    assert len(dropped) == 200 + 1 - 3 * MAX_PENDING_PER_CLIENT
    assert "plc-ffffff" not in adm.pending
    assert_consistent(adm)


# --------------------------------------------------------------------------- the controller

REGISTRY_FILE = {
    "version": 1,
    "devices": {"gpu0": {"kind": "gpu", "total_mib": 24576, "reserved_mib": 1024}},
    "models": {
        "alpha": {
            "display": "Alpha",
            "engine": "llama.cpp",
            "configs": {"alpha-q4": {"status": "unmeasured"}},
        }
    },
}


@pytest.fixture
def controller(tmp_path: Path) -> Controller:
    config = tmp_path / "config"
    config.mkdir()
    (config / "model-registry.json").write_text(json.dumps(REGISTRY_FILE))
    (config / "capacity-policy.json").write_text(json.dumps({"services": []}))
    paths = Paths.from_env(
        {
            "HOME": str(tmp_path),
            "UAP_HOME": str(tmp_path / "home"),
            "UAPPLACE_CONFIG_DIR": str(config),
            "XDG_RUNTIME_DIR": str(tmp_path / "run"),
            "UAPPLACE_TEST_PENDING_TTL_S": "7",
        }
    )
    return Controller.open(paths, clock=lambda: NOW, events=EventRelay())


async def test_the_controller_resolves_pushed_out_entries_as_expired(
    controller: Controller,
) -> None:
    resolved: list[tuple[str, str]] = []

    class Events(NoEvents):
        def on_resolved(self, placement_id: str, outcome: str) -> None:
            resolved.append((placement_id, outcome))

    assert isinstance(controller.events, EventRelay)
    controller.events.attach(Events())
    ids = [controller.admit(f"m-{n}", "one", "", 0).placement_id for n in range(40)]
    await asyncio.sleep(0)
    await controller.background_done()
    assert len(controller.admission.pending) == MAX_PENDING_PER_CLIENT
    assert resolved == [(i, "expired") for i in ids[: 40 - MAX_PENDING_PER_CLIENT]]
    assert controller.admission.ttl == 7.0
