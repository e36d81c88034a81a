"""Issue 23, "Swap at the shell's pace": what a run no longer waits for, and what it still does.

Over :mod:`enforce_fakes` (a real :class:`~uapplace.enforce.enforcer.Enforcer` and a real
journal file): the records that only announce progress (``verify-free``, ``verify-up``) are
written while the read-only step they announce goes on, yet stay in order and fail that
step when they cannot be written; the records that guard an act (``stop``, ``start``) are
still durable before it; the journal is gone before the reply, and only the directory
fsync that makes its removal durable is left to the journal's next user; preflight's reads
start while revalidate runs, and nothing acts before preflight passed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from enforce_fakes import Scene, ok, resident, steps, swap_registry

from tests.worlds.steps import APPLY_STEPS
from uapplace.core.errors import NotFound
from uapplace.files.journal import Journal, RunRecord
from uapplace.io.units import UnitState

FORWARD = APPLY_STEPS[: APPLY_STEPS.index("verify-up") + 1]


@pytest.fixture
def swap(tmp_path: Path) -> Scene:
    """alpha runs on gpu0; beta only fits once alpha stops (``enforce_fakes.swap_registry``)."""
    return Scene(tmp_path, swap_registry(), [resident("alpha", "a1")])


def slow_records(journal: Journal, monkeypatch: pytest.MonkeyPatch, log: list[str]) -> None:
    """Every record takes 20 ms to become durable; ``log`` gets ``durable <step>`` then."""
    record = journal.record

    async def slow(entry: RunRecord) -> None:
        await asyncio.sleep(0.02)
        await record(entry)
        log.append(f"durable {entry.step}")

    monkeypatch.setattr(journal, "record", slow)


async def test_progress_records_overlap_their_step_yet_land_in_order(
    swap: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[str] = []
    slow_records(swap.journal, monkeypatch, log)
    probed = swap.engines.health

    async def health(endpoint: str, timeout_s: float) -> bool:
        log.append("health")
        return await probed(endpoint, timeout_s)

    monkeypatch.setattr(swap.engines, "health", health)

    result = await swap.enforcer.apply(swap.park("beta"), 1, ["alpha/a1"])

    assert steps(result) == ok(*APPLY_STEPS)
    durable = [entry for entry in log if entry.startswith("durable")]
    assert durable == ["durable stop", "durable verify-free", "durable start", "durable verify-up"]
    # verify-up's health check ran while its record was still being written …
    assert log.index("health") < log.index("durable verify-up")
    # … while each act still came after the record that guards it.
    assert swap.units.journaled == [("stop alpha.service", "stop"), ("start beta.service", "start")]
    swap.assert_ended_cleanly()


async def test_a_progress_record_that_cannot_be_written_fails_its_step(
    swap: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = swap.journal.record

    async def refuse_verify_free(entry: RunRecord) -> None:
        if entry.step == "verify-free":
            raise OSError(28, "No space left on device")
        await record(entry)

    monkeypatch.setattr(swap.journal, "record", refuse_verify_free)

    result = await swap.enforcer.apply(swap.park("beta"), 1, ["alpha/a1"])

    assert result["rolledBack"] is True
    assert steps(result)[:6] == [*ok(*FORWARD[:5]), ("verify-free", False)]
    failed = next(s for s in result["steps"] if s["name"] == "verify-free")
    assert "cannot write the enforcement journal" in failed["detail"]
    assert "No space left on device" in failed["detail"]
    # Nothing started: the victim is back, as when the record was awaited in place.
    assert [job for job, _ in swap.units.journaled] == [
        "stop alpha.service",
        "start alpha.service",
    ]
    assert swap.units.running() == {"alpha.service": "active"}
    swap.assert_ended_cleanly()


async def test_the_reply_leaves_only_the_directory_fsync_to_the_next_run(
    swap: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = asyncio.Event()
    synced: list[str] = []

    async def slow_sync() -> None:
        await release.wait()
        synced.append("directory")

    monkeypatch.setattr(swap.journal, "sync_directory", slow_sync)

    result = await swap.enforcer.apply(swap.park("beta"), 1, ["alpha/a1"])

    assert result["ok"] is True
    assert not swap.journal.path.exists()  # gone before the reply …
    assert synced == []  # … its removal made durable after it
    idle = asyncio.ensure_future(swap.enforcer.wait_idle())
    await asyncio.sleep(0.02)
    assert not idle.done()  # the journal's next user waits for that fsync
    release.set()
    await asyncio.wait_for(idle, 1)
    assert synced == ["directory"]


async def test_preflight_reads_start_while_revalidate_runs_and_count_only_after_it(
    swap: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[str] = []
    state = swap.units.state

    async def recorded(name: str) -> UnitState:
        read.append(name)
        return await state(name)

    monkeypatch.setattr(swap.units, "state", recorded)
    swap.host.gate = asyncio.Event()  # revalidate's plan waits for it
    run = asyncio.ensure_future(swap.enforcer.apply(swap.park("beta"), 1, ["alpha/a1"]))
    await asyncio.sleep(0.02)

    assert read == ["beta.service"]  # preflight's read of the new unit is under way …
    assert swap.units.jobs == [] and not run.done()  # … nothing else has happened yet
    swap.host.gate.set()
    result = await asyncio.wait_for(run, 5)

    assert steps(result) == ok(*APPLY_STEPS)
    # Preflight used that read: next come the stop's two of alpha (its stop timeout, how
    # it stopped), then verify-up's own of beta.
    assert read == ["beta.service", "alpha.service", "alpha.service", "beta.service"]
    assert "beta.service" in next(s for s in result["steps"] if s["name"] == "preflight")["detail"]


async def test_a_run_refused_at_revalidate_leaves_its_early_reads_unused(
    swap: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = swap.park("beta")

    result = await swap.enforcer.apply(entry, 1, ["alpha/a1"])
    assert result["ok"] is True
    with pytest.raises(NotFound):  # resolved: nothing to apply any more
        await swap.enforcer.apply(entry, 1, ["alpha/a1"])
    await asyncio.sleep(0.01)  # the early reads end; nothing waits on them, nothing leaks

    assert swap.units.jobs == ["stop alpha.service", "start beta.service"]
