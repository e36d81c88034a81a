"""The pause and wake rows of the start-up repair (rows 16-18 of
:mod:`uapplace.recovery.recover`, issue 20), over the fakes of ``test_recovery``.

A request outlives the daemon that sent it: at journal step ``pause`` a victim that
answers awake may fall asleep a second after a repair published it, so its sleep is
settled (sent again, answered) before it is woken and verified; at ``rollback-wake`` the
rollback's wake may be in flight. The alert says what the repair found, never "nothing
had changed" when something was in flight. Live, with a real SIGKILL:
``tests/systemd/test_recovery_sleep.py``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from test_recovery import ALPHA, ALPHA_URL, VICTIM_UP, Scene, recovered, swap_scene

from uapplace.core.alerts import AlertKind, Severity
from uapplace.core.model import Config, ConfigStatus
from uapplace.recovery.repair import Outcome


def with_lever(s: Scene) -> Scene:
    """ALPHA's config declares vLLM's level-1 sleep (a pause the run can take)."""
    s.host.configs["alpha"] = Config("a1", ConfigStatus.MEASURED, pause_lever="vllm-sleep-1")
    return s


async def test_row16_a_sleep_in_flight_is_settled_then_woken_and_verified(tmp_path: Path) -> None:
    s = with_lever(swap_scene(tmp_path, "pause", VICTIM_UP, paused=(ALPHA,)))
    # The engine answers awake: the dead daemon's sleep has not taken effect yet.

    report = await recovered(s, Outcome.ROLLED_BACK)

    assert s.engines.levers == [f"sleep {ALPHA_URL}", f"wake {ALPHA_URL}"]
    assert ALPHA_URL not in s.engines.asleep
    assert s.host.states() == {"alpha": "hot"}
    assert "alpha/a1's sleep was in flight when uapplaced died (journal step pause)" in (
        report.message
    )
    assert "woke alpha/a1" in report.message
    assert "nothing to repair" not in report.message


async def test_row17_a_sleep_that_cannot_be_settled_is_never_published(tmp_path: Path) -> None:
    s = with_lever(swap_scene(tmp_path, "pause", VICTIM_UP, paused=(ALPHA,)))
    s.engines.refuse_sleep.add(ALPHA_URL)

    report = await recovered(s, Outcome.NEEDS_HUMAN)

    assert s.engines.levers == [f"sleep {ALPHA_URL}"]
    assert s.host.states() == {}, "awake but unsettled: out of the ledger, never hot"
    kind, severity, _, message, _ = s.only_alert()
    assert (kind, severity) == (AlertKind.RECOVERY_NEEDED, Severity.CRITICAL)
    assert "its sleep was in flight when uapplaced died and could not be settled" in message
    assert report.problems


async def test_row17_asleep_after_a_failed_settle_is_kept_paused(tmp_path: Path) -> None:
    s = with_lever(swap_scene(tmp_path, "pause", VICTIM_UP, paused=(ALPHA,)))
    s.engines.refuse_sleep.add(ALPHA_URL)
    s.engines.asleep.add(ALPHA_URL)  # the dead daemon's sleep did take effect

    await recovered(s, Outcome.NEEDS_HUMAN)

    assert s.host.states() == {"alpha": "paused"}


async def test_row16_without_a_lever_nothing_can_have_been_in_flight(tmp_path: Path) -> None:
    s = swap_scene(tmp_path, "pause", VICTIM_UP, paused=(ALPHA,))  # no pause_lever now

    report = await recovered(s, Outcome.NOTHING_CHANGED)

    assert s.engines.levers == []
    assert s.host.states() == {"alpha": "hot"}
    assert "alpha/a1 verified serving, published hot" in report.message


async def test_row18_a_rollback_wake_in_flight_found_done_says_so(tmp_path: Path) -> None:
    s = with_lever(swap_scene(tmp_path, "rollback-wake", VICTIM_UP, paused=(ALPHA,)))

    report = await recovered(s, Outcome.NOTHING_CHANGED)

    assert s.engines.levers == []
    assert s.host.states() == {"alpha": "hot"}
    assert "alpha/a1's wake (the rollback's) was in flight: found it awake" in report.message
    assert "no unit" not in report.message


async def test_row18_a_rollback_wake_in_flight_still_asleep_is_woken(tmp_path: Path) -> None:
    s = with_lever(swap_scene(tmp_path, "rollback-wake", VICTIM_UP, paused=(ALPHA,)))
    s.engines.asleep.add(ALPHA_URL)

    report = await recovered(s, Outcome.ROLLED_BACK)

    assert s.engines.levers == [f"wake {ALPHA_URL}"]
    assert s.host.states() == {"alpha": "hot"}
    assert "was in flight and it is still asleep" in report.message


async def test_a_run_cut_short_at_stop_names_the_stop_that_did_not_happen(tmp_path: Path) -> None:
    s = swap_scene(tmp_path, "stop", VICTIM_UP)
    record = s.journal.read()
    assert record is not None
    s.journal.write(replace(record, stopped_units=("alpha.service",)))

    report = await recovered(s, Outcome.NOTHING_CHANGED)

    assert "alpha.service, which the run was stopping (journal step stop), is running" in (
        report.message
    )
