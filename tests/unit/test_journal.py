"""The enforcement journal file: round trip, absence, hostile content, the crash hook."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from uapplace.core.model import Resident, ResidentState
from uapplace.files.journal import MAX_JOURNAL_BYTES, Journal, JournalError, RunRecord
from uapplace.files.paths import Paths


def resident(model: str, config: str, unit: str, state: ResidentState) -> Resident:
    return Resident(
        model=model,
        config=config,
        device="gpu0",
        engine="llama.cpp",
        endpoint=f"http://127.0.0.1:1{len(model)}00",
        unit=unit,
        state=state,
        gpu_mib=14000.0,
        host_rss_mib=64.0,
        since="2026-10-08T14:02:00Z",
        main_pid=4242,
    )


def record(step: str = "verify-free") -> RunRecord:
    return RunRecord(
        run_id="run-0001",
        kind="apply",
        requested="beta-latest",
        device="gpu0",
        placement_id="plc-000001",
        victims=(resident("alpha", "a1", "alpha.service", ResidentState.HOT),),
        new=resident("beta", "b1", "beta.service", ResidentState.HOT),
        accepted_ids=("beta-latest", "beta", "b1"),
        step=step,
        started_at=1_790_000_000.0,
        updated_at=1_790_000_001.5,
        stopped_units=("alpha.service",),
        started_unit=None,
        history=("revalidate", "mark-draining", "drain", "stop"),
    )


def test_a_record_reads_back_as_written(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "enforcement-journal.json")
    written = record()

    journal.write(written)

    assert journal.read() == written
    assert (journal.path.stat().st_mode & 0o777) == 0o600


def test_no_file_means_no_run_in_progress_and_clear_is_idempotent(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "enforcement-journal.json")
    assert journal.read() is None
    journal.write(record())

    journal.remove()
    journal.remove()

    assert journal.read() is None
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind either


async def test_a_clear_without_sync_leaves_the_directory_fsync_for_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Path] = []
    monkeypatch.setattr("uapplace.files.journal.fsync_directory", synced.append)
    journal = Journal(tmp_path / "enforcement-journal.json")
    journal.write(record())

    await journal.clear(sync=False)

    assert journal.read() is None and synced == []  # gone at once, not yet durable
    await journal.sync_directory()
    assert synced == [tmp_path]
    journal.write(record())
    await journal.clear()
    assert synced == [tmp_path, tmp_path]  # the default still fsyncs before it returns


def test_the_path_is_under_uap_home(tmp_path: Path) -> None:
    paths = Paths.from_env({"HOME": str(tmp_path), "UAP_HOME": str(tmp_path / "uap")})
    assert paths.enforcement_journal == tmp_path / "uap" / "enforcement-journal.json"
    assert paths.test_crash_at is None
    crashing = Paths.from_env({"HOME": str(tmp_path), "UAPPLACE_TEST_CRASH_AT": "stop"})
    assert crashing.test_crash_at == "stop"


def test_describe_names_the_kind_the_new_resident_the_placement_and_the_victims() -> None:
    text = record().describe()
    assert text == "apply beta/b1 on gpu0 (placement plc-000001), stopping alpha/a1"


def valid_document() -> dict[str, Any]:
    return record().to_json()


@pytest.mark.parametrize(
    ("change", "names"),
    [
        (lambda d: d.update(step="dance"), "step"),
        (lambda d: d.update(kind="reboot"), "kind"),
        (lambda d: d.update(surprise=1), "surprise"),
        (lambda d: d.pop("run_id"), "run_id"),
        (lambda d: d["victims"][0].update(gpu_mib=float("nan")), "victims[0].gpu_mib"),
        (lambda d: d["new"].update(state="sleeping"), "new.state"),
        (lambda d: d.update(version=9), "version"),
        (lambda d: d["victims"][0].update(unit="../../etc/x.service"), "victims[0].unit"),
        (lambda d: d.update(stopped_units=["a b.service"]), "stopped_units"),
    ],
)
def test_a_wrong_field_is_a_journal_error_naming_it(
    tmp_path: Path, change: Any, names: str
) -> None:
    journal = Journal(tmp_path / "enforcement-journal.json")
    document = valid_document()
    change(document)
    journal.path.write_text(json.dumps(document), encoding="utf-8")

    with pytest.raises(JournalError) as caught:
        journal.read()

    assert names in str(caught.value)
    assert str(journal.path) in str(caught.value)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"{not json", "invalid JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested deeper than"),
        (b" " * (MAX_JOURNAL_BYTES + 1), "over the 1 MiB limit"),
        (b"[]", "(document)"),
        (b'{"version": 1, "version": 1}', "duplicate key 'version'"),
        (b'{"version": NaN}', "NaN is not a finite number"),
    ],
)
def test_hostile_content_is_a_journal_error_not_a_traceback(
    tmp_path: Path, content: bytes, says: str
) -> None:
    journal = Journal(tmp_path / "enforcement-journal.json")
    journal.path.write_bytes(content)

    with pytest.raises(JournalError) as caught:
        journal.read()

    assert says in str(caught.value)


def test_an_unreadable_journal_is_moved_aside_for_a_human(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "enforcement-journal.json")
    journal.path.write_text("{broken", encoding="utf-8")

    moved = journal.move_aside()

    assert moved.read_text(encoding="utf-8") == "{broken"
    assert journal.read() is None


def test_a_nan_is_never_written(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "enforcement-journal.json")
    bad = record()
    victim = bad.victims[0]
    with pytest.raises(ValueError):
        journal.write(replace(bad, victims=(replace(victim, gpu_mib=float("inf")),)))
    assert journal.read() is None


def test_the_crash_hook_kills_the_process_only_after_the_record_is_durable(
    tmp_path: Path,
) -> None:
    """``crash_at`` (tests only) SIGKILLs right after the named step is on disk."""
    path = tmp_path / "enforcement-journal.json"
    script = textwrap.dedent(
        f"""
        import asyncio, dataclasses, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from tests.unit.test_journal import record
        from uapplace.files.journal import Journal
        journal = Journal(__import__("pathlib").Path({str(path)!r}), crash_at="start")
        asyncio.run(journal.record(record("verify-free")))
        print("survived verify-free", flush=True)
        asyncio.run(journal.record(record("start")))
        print("survived start", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )

    assert done.returncode == -signal.SIGKILL, done.stderr
    assert done.stdout.splitlines() == ["survived verify-free"]
    found = Journal(path).read()
    assert found is not None and found.step == "start"
