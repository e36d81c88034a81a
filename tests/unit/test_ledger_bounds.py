"""The ledger never outgrows the cap it is read back with, and its corrupt copies are
bounded (issue 20: 300 holds made ``placement.json`` outgrow the 16 MiB read cap, so every
write moved it aside: 2.1 GB of ``placement.json.corrupt-*``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from controller_fixtures import alpha_resident, registry, registry_paths

from tests.worlds.seed_docs import alpha_model, beta_model
from uapplace.controller.controller import Controller
from uapplace.core.alerts import AlertKind, Severity
from uapplace.core.errors import Busy
from uapplace.files import jsonfile
from uapplace.files.ledger import (
    KEEP_CORRUPT,
    Ledger,
    LedgerDoc,
    LedgerTooLarge,
    prune_corrupt_copies,
)

SMALL_CAP = 64 * 1024
"""A cap the tests can outgrow in a few kilobytes (the real one is 16 MiB)."""
REGISTRY = registry({"alpha": alpha_model(rails=1), "beta": beta_model()})
ALPHA = alpha_resident()


@pytest.fixture
def small_cap(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(jsonfile, "LEDGER_MAX_BYTES", SMALL_CAP)
    return SMALL_CAP


def read_bytes(path: Path) -> bytes:
    return path.read_bytes()


def corrupt_copies(directory: Path) -> list[Path]:
    return sorted(directory.glob("placement.json.corrupt-*"))


def test_a_write_over_the_read_cap_is_refused_and_the_file_stays(
    tmp_path: Path, small_cap: int
) -> None:
    ledger = Ledger(tmp_path / "placement.json")
    ledger.update(lambda doc: doc.usage.update(small=1.0))
    before = ledger.path.read_bytes()

    def grow(doc: LedgerDoc) -> None:
        doc.usage.update({f"model-{i:05d}": float(i) for i in range(small_cap // 16)})

    with pytest.raises(LedgerTooLarge) as caught:
        ledger.update(grow)
    assert "over the 65,536 bytes uapplaced reads back; not written" in str(caught.value)
    assert str(ledger.path) in str(caught.value) and caught.value.size > small_cap
    assert ledger.path.read_bytes() == before
    assert ledger.read().usage == {"small": 1.0}
    assert corrupt_copies(tmp_path) == []
    assert not list(tmp_path.glob(".placement.json.*.tmp"))


def test_only_the_newest_corrupt_copies_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "placement.json"
    for serial in ("", ".1", ".2", ".9", ".10"):
        (tmp_path / f"placement.json.corrupt-20260101T000000Z{serial}").write_text(serial)
    (tmp_path / "placement.json.corrupt-20250101T000000Z").write_text("oldest")
    path.write_text("{ not json")
    ledger = Ledger(path)
    assert ledger.read() == LedgerDoc()
    kept = corrupt_copies(tmp_path)
    assert len(kept) == KEEP_CORRUPT == 3
    texts = {p.read_text() for p in kept}
    assert texts == {".9", ".10", "{ not json"}, texts  # the one just moved aside is kept
    assert ledger.last_error is not None and "moved it aside" in ledger.last_error


def test_pruning_with_nothing_to_prune_deletes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "placement.json"
    (tmp_path / "placement.json.corrupt-20260101T000000Z").write_text("x")
    (tmp_path / "other.json.corrupt-20200101T000000Z").write_text("y")
    assert prune_corrupt_copies(path) == []
    assert len(list(tmp_path.iterdir())) == 2


async def test_the_daemon_refuses_the_write_with_one_alert_and_writes_again_later(
    tmp_path: Path, small_cap: int
) -> None:
    controller = Controller.open(registry_paths(tmp_path, REGISTRY))
    controller.upsert_resident(ALPHA)
    await controller.flush()
    ledger = Path(controller.paths.ledger)
    fitting = read_bytes(ledger)
    cookies = [
        await controller.hold("alpha", "r" * 1000, f"app-{i}", f":1.{i}") for i in range(120)
    ]
    await controller.flush()
    await controller.flush()  # the alert changed the document: still refused, no second alert
    assert read_bytes(ledger) == fitting
    (alert,) = [a for a in controller.alerts.active() if a.kind is AlertKind.CONFIG_ERROR]
    assert alert.severity is Severity.CRITICAL and alert.subject == str(ledger)
    assert "over the 65,536 bytes uapplaced reads back; not written" in alert.message
    assert alert.count == 1
    assert corrupt_copies(ledger.parent) == []
    with pytest.raises(Busy, match=r"Hold: no new hold while the ledger cannot be written: "):
        await controller.hold("alpha", "one more", "late", ":2.1")
    for index, cookie in enumerate(cookies):
        controller.release(cookie, f":1.{index}")
    await controller.flush()
    written = json.loads(read_bytes(ledger))
    assert written["residents"][0]["holders"] == []
    assert len(read_bytes(ledger)) <= small_cap
    assert await controller.hold("alpha", "fits again", "late", ":2.1") > 0
