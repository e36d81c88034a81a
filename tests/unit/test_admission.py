"""The admit decision table, pending dedupe and ids (docs/placement-rules.md §4.3)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from tests.worlds.builders import parked
from uapplace.core.admission import (
    MAX_REFUSED,
    REFUSED_WINDOW_S,
    Admission,
    new_placement_id,
)
from uapplace.core.model import (
    DEFAULT_CELLS,
    Config,
    ConfigStatus,
    Decision,
    Device,
    DeviceKind,
    Model,
    Option,
    OptionKind,
    ParkReason,
    PendingEntry,
    Registry,
    Resident,
    ResidentState,
)

NOW = 1_800_000_000.0
ENDPOINT = "http://127.0.0.1:8080"

STRATA = Config(
    "strata-iq3_s",
    ConfigStatus.MEASURED,
    resident_gpu_mib=21_812,
    host_rss_mib=52_857,
    kv_resident_cells=32_768,
    kv_mib_per_1k_cells=12.2,
    measured_at="2026-10-08T14:02:00Z",
    measured_on="gpu0",
)
FLASH = Model(
    "qwen3.8-flash-next",
    "Qwen3.8 Flash Next",
    "strata",
    {STRATA.key: STRATA},
    endpoint=ENDPOINT,
    advertises=("qwen3.8-flash-next-iq3_s", "gpt-5.1-codex"),
)
UNMEASURED = Model(
    "qwen3.8-27b",
    "Qwen3.8 27B",
    "llama.cpp",
    {k: Config(k, ConfigStatus.UNMEASURED) for k in ("llama-mtp", "exl3-4bit")},
)
MIXED = Model(
    "mixed",
    "Mixed",
    "llama.cpp",
    {
        "mixed-fast": replace(STRATA, key="mixed-fast"),
        "mixed-slow": Config("mixed-slow", ConfigStatus.UNMEASURED),
    },
)
REGISTRY = Registry(
    {"gpu0": Device("gpu0", DeviceKind.GPU, 24_576, 2_048)},
    {m.key: m for m in (FLASH, UNMEASURED, MIXED)},
)


def resident(
    model: str = FLASH.key,
    config: str = STRATA.key,
    state: ResidentState = ResidentState.HOT,
    device: str = "gpu0",
    endpoint: str | None = ENDPOINT,
) -> Resident:
    return Resident(
        model=model,
        config=config,
        device=device,
        engine="strata",
        endpoint=endpoint,
        unit="uap-strata-server",
        state=state,
        gpu_mib=21_812,
        host_rss_mib=52_857,
        since="2026-10-08T09:14:02Z",
    )


def counter_ids() -> Callable[[], str]:
    numbers: Iterator[int] = iter(range(1, 1 << 24))
    return lambda: f"plc-{next(numbers):06x}"


@pytest.fixture
def admission() -> Admission:
    return Admission(REGISTRY, new_id=counter_ids())


def park(admission: Admission, model: str, client: str = "claude-code") -> Decision:
    decision, _ = admission.decide(model, client, "sess-1", None, NOW)
    assert decision.decision == "park"
    return decision


# --------------------------------------------------------------------------- decision table


@pytest.mark.parametrize(
    "requested", [FLASH.key, STRATA.key, "gpt-5.1-codex", "qwen3.8-flash-next-iq3_s"]
)
@pytest.mark.parametrize("state", [ResidentState.HOT])  # warming: tests/unit/test_publication.py
def test_a_serving_resident_forwards(
    admission: Admission, requested: str, state: ResidentState
) -> None:
    admission.set_residents([resident(state=state)])
    decision, entry = admission.decide(requested, "claude-code", None, None, NOW)
    assert entry is None
    assert decision == Decision("forward", target_id="gpu0:http://127.0.0.1:8080")
    assert decision.to_json() == {"decision": "forward", "target_id": "gpu0:http://127.0.0.1:8080"}
    assert re.match(r"^[A-Za-z0-9_.\-]+:\S+$", decision.target_id)
    assert admission.pending == {}


def test_a_resident_is_forwarded_to_only_when_its_context_fits() -> None:
    """Issue 21 item 8: a stated ``cells`` past the config's per-session cap parks (a
    resident on another device that fits serves instead); unstated context forwards."""
    small = replace(STRATA, per_session_cap_cells=8_192)
    big = replace(STRATA, key="strata-big", per_session_cap_cells=65_536)
    model = replace(FLASH, configs={small.key: small, big.key: big})
    registry = replace(REGISTRY, models={**REGISTRY.models, FLASH.key: model})
    admission = Admission(registry, new_id=counter_ids())
    admission.set_residents([resident()])
    for cells in (None, 8_192, 32_768):  # 32,768: the contract's stand-in for "not said"
        decision, _ = admission.decide(FLASH.key, "c", None, cells, NOW)
        assert decision.decision == "forward", cells
    decision, entry = admission.decide(FLASH.key, "c", None, 8_193, NOW)
    assert (decision.decision, decision.reason) == ("park", "not_resident")
    assert entry is not None and entry.cells == 8_193
    admission.set_residents([resident(), resident(config=big.key, device="gpu1")])
    decision, _ = admission.decide(FLASH.key, "d", None, 40_000, NOW)
    assert decision == Decision("forward", target_id=f"gpu1:{ENDPOINT}")


def test_target_id_without_endpoint_is_default(admission: Admission) -> None:
    admission.set_residents([resident(endpoint=None, device="gpu1")])
    decision, _ = admission.decide(FLASH.key, "c", None, None, NOW)
    assert decision.target_id == "gpu1:default"


@pytest.mark.parametrize(
    ("state", "reason"),
    [(ResidentState.DRAINING, "not_resident"), (ResidentState.PAUSED, "paused")],
)
def test_draining_and_paused_never_forward(
    admission: Admission, state: ResidentState, reason: str
) -> None:
    admission.set_residents([resident(state=state)])
    decision = park(admission, FLASH.key)
    assert decision.reason == reason


def test_a_paused_park_follows_the_resident(admission: Admission) -> None:
    """Issue 21 item 6: ``paused`` while only a paused resident serves the id, then what
    the registry says once it is gone; a waiting entry follows a pause too."""
    waiting = park(admission, FLASH.key, client="early")
    assert waiting.reason == "not_resident"
    admission.set_residents([resident(state=ResidentState.PAUSED)])
    assert park(admission, FLASH.key, client="early").reason == "paused"
    assert park(admission, "gpt-5.1-codex", client="late").reason == "paused"
    admission.set_residents([])
    assert park(admission, FLASH.key, client="early").reason == "not_resident"
    assert park(admission, "gpt-5.1-codex", client="late").reason == "not_resident"


def test_a_hot_resident_wins_over_a_warming_one(admission: Admission) -> None:
    admission.set_residents(
        [resident(state=ResidentState.WARMING, device="gpu0"), resident(device="gpu1")]
    )
    decision, _ = admission.decide(FLASH.key, "c", None, None, NOW)
    assert decision.target_id == "gpu1:http://127.0.0.1:8080"


def test_residents_are_replaced_not_merged(admission: Admission) -> None:
    admission.set_residents([resident()])
    admission.set_residents([])
    assert park(admission, FLASH.key).reason == "not_resident"


def test_a_new_registry_reindexes_advertised_ids(admission: Admission) -> None:
    admission.set_residents([resident()])
    renamed = replace(FLASH, advertises=("claude-local",))
    admission.set_registry(replace(REGISTRY, models={**REGISTRY.models, FLASH.key: renamed}))
    assert admission.decide("claude-local", "c", None, None, NOW)[0].decision == "forward"
    assert park(admission, "gpt-5.1-codex").reason == "unknown_model"


@pytest.mark.parametrize(
    ("requested", "reason"),
    [
        ("not-a-model", ParkReason.UNKNOWN_MODEL),
        (UNMEASURED.key, ParkReason.NO_MEASURED_CONFIG),
        ("llama-mtp", ParkReason.NO_MEASURED_CONFIG),
        (FLASH.key, ParkReason.NOT_RESIDENT),
        ("gpt-5.1-codex", ParkReason.NOT_RESIDENT),
        (STRATA.key, ParkReason.NOT_RESIDENT),
        (MIXED.key, ParkReason.NOT_RESIDENT),
        ("mixed-slow", ParkReason.NO_MEASURED_CONFIG),
    ],
)
def test_park_reasons(admission: Admission, requested: str, reason: ParkReason) -> None:
    decision, entry = admission.decide(requested, "claude-code", "sess-1", None, NOW)
    assert entry is not None
    assert decision == Decision("park", placement_id=entry.id, reason=reason.value)
    assert decision.to_json() == {
        "decision": "park",
        "placement_id": entry.id,
        "reason": reason.value,
    }
    assert entry.reason is reason
    assert (entry.requested_model, entry.client, entry.session) == (
        requested,
        "claude-code",
        "sess-1",
    )
    assert (entry.created_at, entry.expires_at) == (NOW, NOW + 120.0)
    assert admission.pending == {entry.id: entry}


@pytest.mark.parametrize("model", ["", "   "])
def test_an_empty_model_is_an_invalid_request(admission: Admission, model: str) -> None:
    decision, entry = admission.decide(model, "bus:1.42", None, None, NOW)
    assert entry is None
    assert decision == Decision("park", placement_id="", reason="invalid_request")
    assert admission.pending == {}


# --------------------------------------------------------------------------- entry fields


@pytest.mark.parametrize(
    ("cells", "expected"),
    [(None, DEFAULT_CELLS), (0, DEFAULT_CELLS), (-5, DEFAULT_CELLS), (114_688, 114_688)],
)
def test_default_cells(admission: Admission, cells: int | None, expected: int) -> None:
    _, entry = admission.decide(FLASH.key, "c", None, cells, NOW)
    assert entry is not None and entry.cells == expected
    assert DEFAULT_CELLS == 32_768


def test_client_and_session_are_truncated_to_128(admission: Admission) -> None:
    client, session = "x-uap-client-id:" + "c" * 300, "s" * 300
    decision, entry = admission.decide(FLASH.key, client, session, None, NOW)
    assert entry is not None
    assert entry.client == client[:128] and len(entry.client) == 128
    assert entry.session == session[:128]
    # The truncated identity is the dedupe key: a client differing past 128 chars is the same.
    again, created = admission.decide(FLASH.key, client + "tail", None, None, NOW + 1)
    assert created is None and again.placement_id == decision.placement_id


def test_session_may_be_none(admission: Admission) -> None:
    _, entry = admission.decide(FLASH.key, "c", None, None, NOW)
    assert entry is not None and entry.session is None


def test_default_ids_are_plc_and_six_lowercase_hex() -> None:
    admission = Admission(REGISTRY)
    ids = {
        admission.decide(FLASH.key, f"client-{i}", None, None, NOW)[0].placement_id
        for i in range(200)
    }
    assert len(ids) == 200
    assert all(re.fullmatch(r"plc-[0-9a-f]{6}", i) for i in ids)
    assert re.fullmatch(r"plc-[0-9a-f]{6}", new_placement_id())


def test_an_id_colliding_with_a_live_one_is_retried() -> None:
    minted = iter(["plc-aaaaaa", "plc-aaaaaa", "plc-aaaaaa", "plc-bbbbbb"])
    admission = Admission(REGISTRY, new_id=lambda: next(minted))
    first = park(admission, FLASH.key, client="one")
    second = park(admission, FLASH.key, client="two")
    assert (first.placement_id, second.placement_id) == ("plc-aaaaaa", "plc-bbbbbb")


def test_a_malformed_injected_id_is_refused() -> None:
    admission = Admission(REGISTRY, new_id=lambda: "plc-XYZ")
    with pytest.raises(ValueError, match="new_id: 'plc-XYZ'"):
        admission.decide(FLASH.key, "c", None, None, NOW)


def test_an_id_source_that_only_collides_gives_up() -> None:
    admission = Admission(REGISTRY, new_id=lambda: "plc-000001")
    park(admission, FLASH.key, client="one")
    with pytest.raises(RuntimeError, match="no unused placement id"):
        admission.decide(FLASH.key, "two", None, None, NOW)


# --------------------------------------------------------------------------- dedupe and expiry


def test_dedupe_returns_the_same_id_for_the_entry_lifetime(admission: Admission) -> None:
    first, entry = admission.decide(FLASH.key, "claude-code", "s1", None, NOW)
    assert entry is not None
    for later in (NOW + 1, NOW + 119.9):
        again, created = admission.decide(FLASH.key, "claude-code", "s2", 99_999, later)
        assert created is None
        assert again == first
    assert len(admission.pending) == 1


def test_dedupe_is_per_client_and_model(admission: Admission) -> None:
    a = park(admission, FLASH.key, client="claude-code")
    b = park(admission, FLASH.key, client="codex")
    c = park(admission, UNMEASURED.key, client="claude-code")
    assert len({a.placement_id, b.placement_id, c.placement_id}) == 3


def test_dedupe_answers_the_stored_reason(admission: Admission) -> None:
    _, entry = admission.decide(FLASH.key, "claude-code", None, None, NOW)
    assert entry is not None
    admission.replace(replace(entry, reason=ParkReason.AUTO_LOADING))
    assert park(admission, FLASH.key).reason == "auto_loading"
    admission.replace(replace(entry, reason=ParkReason.AUTO_FAILED))
    assert park(admission, FLASH.key) == Decision(
        "park", placement_id=entry.id, reason="auto_failed"
    )


def test_an_expired_entry_refuses_until_swept_then_a_new_one_parks(
    admission: Admission,
) -> None:
    _, first = admission.decide(FLASH.key, "claude-code", None, None, NOW)
    assert first is not None
    decision, none = admission.decide(FLASH.key, "claude-code", None, None, NOW + 120.0)
    assert none is None
    assert decision == Decision("park", placement_id=first.id, reason="refused")
    assert admission.expire(NOW + 120.0) == [first]  # the tick; no refusal recorded here
    decision, second = admission.decide(FLASH.key, "claude-code", None, None, NOW + 121.0)
    assert second is not None
    assert decision.placement_id == second.id != first.id
    assert set(admission.pending) == {second.id}


def test_a_refused_client_is_answered_refused_for_the_window(admission: Admission) -> None:
    """Issue 21 item 2: after a dismissal (or expiry) the same client's retries get the
    refused id and reason ``refused``, with no new entry, for ``REFUSED_WINDOW_S``; other
    clients and other ids park as before."""
    _, entry = admission.decide(FLASH.key, "claude-code", None, None, NOW)
    assert entry is not None
    admission.remove(entry.id)
    admission.refuse(entry, NOW + 1)
    for later in (NOW + 2, NOW + REFUSED_WINDOW_S):
        decision, created = admission.decide(FLASH.key, "claude-code", None, None, later)
        assert (decision, created) == (
            Decision("park", placement_id=entry.id, reason="refused"),
            None,
        )
    assert admission.pending == {}
    assert park(admission, FLASH.key, client="codex").reason == "not_resident"
    assert park(admission, "gpt-5.1-codex").reason == "not_resident"  # another id
    after = NOW + 1 + REFUSED_WINDOW_S
    decision, fresh = admission.decide(FLASH.key, "claude-code", None, None, after)
    assert fresh is not None and decision.placement_id == fresh.id != entry.id
    assert decision.reason == "not_resident"


def test_refusals_are_bounded_and_lapse(admission: Admission) -> None:
    for n in range(MAX_REFUSED + 10):
        entry = PendingEntry(
            f"plc-{n:06x}", FLASH.key, f"c{n}", None, NOW, NOW + 120, ParkReason.NOT_RESIDENT
        )
        admission.refuse(entry, NOW)
    assert admission.refused_count == MAX_REFUSED
    oldest, _ = admission.decide(FLASH.key, "c0", None, None, NOW + 1)
    newest, _ = admission.decide(FLASH.key, f"c{MAX_REFUSED + 9}", None, None, NOW + 1)
    assert oldest.reason == "not_resident" and newest.reason == "refused"
    admission.forget_refusals(NOW + REFUSED_WINDOW_S)
    assert admission.refused_count == 0


def test_a_failed_entry_says_failed_until_it_is_resolved(admission: Admission) -> None:
    """Issue 21 item 2: a failed switch leaves the entry pending, reason ``failed``."""
    _, entry = admission.decide(FLASH.key, "claude-code", None, None, NOW)
    assert entry is not None
    failed = admission.mark_failed(entry.id)
    assert failed is not None and failed.reason is ParkReason.FAILED
    assert park(admission, FLASH.key) == Decision("park", placement_id=entry.id, reason="failed")
    admission.set_registry(REGISTRY)  # a reload does not turn it back into "waiting"
    assert park(admission, FLASH.key).reason == "failed"
    assert admission.mark_failed("plc-ffffff") is None


def test_expire_drops_and_returns_expired_entries(admission: Admission) -> None:
    _, old = admission.decide(FLASH.key, "a", None, None, NOW)
    _, young = admission.decide(FLASH.key, "b", None, None, NOW + 60)
    assert admission.expire(NOW + 119) == []
    assert admission.expire(NOW + 120) == [old]
    assert young is not None and set(admission.pending) == {young.id}
    # The dedupe key went with it.
    _, fresh = admission.decide(FLASH.key, "a", None, None, NOW + 121)
    assert fresh is not None and old is not None and fresh.id != old.id


def test_get_drops_an_expired_entry_lazily(admission: Admission) -> None:
    _, entry = admission.decide(FLASH.key, "a", None, None, NOW)
    assert entry is not None
    assert admission.get(entry.id) == entry
    assert admission.get(entry.id, now=NOW + 1) == entry
    assert admission.get(entry.id, now=NOW + 120) is None
    assert admission.pending == {}


def test_pending_is_read_only(admission: Admission) -> None:
    park(admission, FLASH.key)
    with pytest.raises(TypeError):
        admission.pending["plc-000000"] = next(iter(admission.pending.values()))  # type: ignore[index]


def test_remove(admission: Admission) -> None:
    _, entry = admission.decide(FLASH.key, "a", None, None, NOW)
    assert entry is not None
    assert admission.remove(entry.id) == entry
    assert admission.remove(entry.id) is None
    _, again = admission.decide(FLASH.key, "a", None, None, NOW)
    assert again is not None and again.id != entry.id


def test_replace_updates_options_and_expiry(admission: Admission) -> None:
    _, entry = admission.decide(FLASH.key, "a", None, None, NOW)
    assert entry is not None
    option = Option(OptionKind.LOAD_ALONGSIDE, FLASH.key, STRATA.key, "gpu0", 21_812.0)
    admission.replace(replace(entry, options=(option,), expires_at=NOW + 900))
    stored = admission.get(entry.id, now=NOW + 600)
    assert stored is not None and stored.options == (option,)


def test_replace_refuses_unknown_ids_and_identity_changes(admission: Admission) -> None:
    _, entry = admission.decide(FLASH.key, "a", None, None, NOW)
    assert entry is not None
    with pytest.raises(KeyError, match="plc-ffffff"):
        admission.replace(replace(entry, id="plc-ffffff"))
    with pytest.raises(ValueError, match="cannot change"):
        admission.replace(replace(entry, client="b"))


# --------------------------------------------------------------------------- restore, resolved_by


def entry(id: str, client: str, model: str, expires_at: float) -> PendingEntry:
    return parked(model, id=id, client=client, created_at=expires_at - 120, expires_at=expires_at)


def test_restore_drops_expired_entries(admission: Admission) -> None:
    live = entry("plc-000101", "a", FLASH.key, NOW + 30)
    dead = entry("plc-000102", "b", FLASH.key, NOW - 1)
    assert admission.restore([live, dead], now=NOW) == [dead]
    assert admission.pending == {live.id: live}
    # A restored entry dedupes like a fresh one.
    assert park(admission, FLASH.key, client="a").placement_id == live.id


def test_restore_keeps_the_later_of_two_entries_for_one_key(admission: Admission) -> None:
    early = entry("plc-000201", "a", FLASH.key, NOW + 10)
    late = entry("plc-000202", "a", FLASH.key, NOW + 90)
    assert admission.restore([late, early], now=NOW) == [early]
    assert set(admission.pending) == {late.id}


def test_restore_truncates_identities(admission: Admission) -> None:
    long = replace(entry("plc-000301", "x" * 200, FLASH.key, NOW + 30), session="s" * 200)
    admission.restore([long], now=NOW)
    stored = admission.get(long.id)
    assert stored is not None and len(stored.client) == 128 and stored.session == "s" * 128


def test_resolved_by_lists_entries_the_resident_serves(admission: Admission) -> None:
    by_key = park(admission, FLASH.key, client="a")
    by_advertised = park(admission, "gpt-5.1-codex", client="b")
    by_config = park(admission, STRATA.key, client="c")
    other = park(admission, UNMEASURED.key, client="d")
    resolved = {e.id for e in admission.resolved_by(resident())}
    assert resolved == {by_key.placement_id, by_advertised.placement_id, by_config.placement_id}
    assert other.placement_id not in resolved
    assert admission.resolved_by(resident(state=ResidentState.DRAINING)) == []
    # resolved_by only reports; the controller removes.
    assert len(admission.pending) == 4


def test_a_forward_removes_no_pending_entry(admission: Admission) -> None:
    parked = park(admission, FLASH.key)
    admission.set_residents([resident()])
    assert admission.decide(FLASH.key, "claude-code", None, None, NOW)[0].decision == "forward"
    assert parked.placement_id in admission.pending


def test_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ttl"):
        Admission(REGISTRY, ttl=0)
