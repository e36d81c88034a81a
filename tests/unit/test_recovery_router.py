"""The start-up repair of a llama.cpp router run (issue 19), row by row, over the router fakes.

One router unit hosts ``ra`` and ``rb`` (they never fit gpu0 together) and the small
sibling ``rs``, which serves throughout. A swap ``ra`` → ``rb`` unloads ``ra`` (paused or
stopped alike, its router unloads it) and loads ``rb`` in the running router; uapplaced is
killed at one of its steps and :func:`~uapplace.recovery.recover.recover` repairs it with
the router's own lever: asleep ⇔ the router says ``unloaded``, put back to sleep and
"stop new" ⇔ unload, wake ⇔ load. Every test asserts what the router was asked
(``routers.calls``), that no unit job touched the router while a sibling serves
(``units.jobs``), that no vLLM lever was pulled (``engines.levers``) and what was
published. The rows are the table of :mod:`uapplace.recovery.recover`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from enforce_fakes import ListHost
from router_fakes import ROUTER, ROUTER_UNIT, RouterWorld, router_resident

from uapplace.core.alerts import AlertKind, Severity
from uapplace.core.model import Resident, ResidentState
from uapplace.files.journal import RunRecord
from uapplace.files.timeouts import Timeouts
from uapplace.recovery.recover import recover
from uapplace.recovery.repair import Outcome, RecoveryReport

FAST = Timeouts(
    verify_up_s=0.3,
    verify_free_s=0.2,
    verify_free_poll_s=0.01,
    rollback_up_s=0.3,
    stop_s=0.3,
    start_s=1.0,
    http_s=0.1,
)
SIBLING_MIB = 2000.0
RA = router_resident("ra")
RB = router_resident("rb")
RS = router_resident("rs", mib=SIBLING_MIB)
DRAINING_RA = replace(RA, state=ResidentState.DRAINING)
PAUSED_RB = router_resident("rb", ResidentState.PAUSED)


@dataclass
class RecoveringHost(ListHost):
    """The enforcement fakes' host, with the one call the repair adds."""

    replans: int = 0

    async def replan_pending(self) -> None:
        self.replans += 1


class Scene:
    """The router world after a crash: the journal written, the router as the run left it."""

    def __init__(
        self, tmp_path: Path, record: RunRecord, live: Sequence[Resident], loaded: Sequence[str]
    ) -> None:
        self.world = RouterWorld(tmp_path, [RS], siblings={"rs": SIBLING_MIB})
        self.host = RecoveringHost(
            reg=self.world.host.reg, live=list(live), readings=self.world.readings
        )
        self.world.host = self.host
        routers = self.world.routers
        for model_id in loaded:
            routers.status[model_id] = "loaded"
            routers.child[model_id] = next(routers._pids)
        self.world.journal.write(record)
        self.routers = routers
        self.units = self.world.units

    async def recovered(self, outcome: Outcome) -> RecoveryReport:
        world = self.world
        report = await recover(
            world.journal,
            self.host,
            world.units,
            timeouts=FAST,
            probe=world.engines,
            routers=world.routers,
        )
        assert report is not None
        assert report.outcome is outcome, report.message
        assert world.journal.read() is None
        assert world.engines.levers == [], "a router model has no /sleep nor /wake_up"
        return report

    def states(self) -> dict[str, str]:
        return {r.model: r.state.value for r in self.host.live}

    def only_alert(self) -> tuple[AlertKind, Severity, str, str]:
        alerts = self.host.alerts
        assert len(alerts) == 1, alerts
        return alerts[0]

    def assert_sibling_serves(self) -> None:
        """The router unit was never stopped and ``rs`` still runs and stays ``hot``."""
        assert ROUTER_UNIT not in " ".join(self.units.jobs), self.units.jobs
        assert self.routers.status["rs"] == "loaded"
        assert self.states()["rs"] == "hot"


def record(
    step: str,
    *,
    kind: str = "apply",
    victims: Sequence[Resident] = (RA,),
    new: Resident | None = RB,
    pausing: Sequence[Resident] = (),
    unloaded: Sequence[Resident] = (),
    wake: Resident | None = None,
    started_unit: str | None = None,
) -> RunRecord:
    """The journal of a run on the router cut short at ``step``; ``unloaded``: the victims
    the run had unloaded (or was unloading) so far (the journal's ``paused``)."""
    return RunRecord(
        run_id="run-router",
        kind=kind,  # type: ignore[arg-type]
        requested=(new or wake or victims[0]).model,
        device="gpu0",
        placement_id="plc-router" if kind == "apply" else None,
        victims=tuple(victims),
        new=new,
        accepted_ids=(new.model, new.config) if new is not None else (),
        step=step,
        started_at=1_790_000_000.0,
        updated_at=1_790_000_001.0,
        started_unit=started_unit,
        detail="verify-up: rb not loaded" if "rollback" in step else "",
        victim_actions={v.signature: "pause" if v in pausing else "stop" for v in victims},
        paused=tuple(v.signature for v in unloaded),
        wake=wake,
    )


def swap(
    tmp_path: Path, step: str, loaded: Sequence[str], *, pausing: bool = False, **kw: object
) -> Scene:
    """``ra`` gives way to ``rb`` in the router (``ra`` paused when ``pausing``), cut short
    at ``step`` with ``loaded`` (besides ``rs``) loaded."""
    victims = (RA,)
    rec = record(step, victims=victims, pausing=victims if pausing else (), **kw)  # type: ignore[arg-type]
    return Scene(tmp_path, rec, [DRAINING_RA, RS], loaded)


# --------------------------------------------------------------------------- forward (rows 2-3)


async def test_row2_a_loaded_and_verified_new_model_is_published_and_the_router_kept(
    tmp_path: Path,
) -> None:
    s = swap(tmp_path, "verify-up", ["rb"], unloaded=(RA,))

    report = await s.recovered(Outcome.FINISHED)

    assert s.routers.calls == [], "nothing to change: rb loaded, ra unloaded"
    assert s.states() == {"rs": "hot", "rb": "hot"}
    assert s.host.resolved == [("plc-router", "applied")]
    assert "published rb/rb-q4 hot on gpu0 (verified)" in report.message
    s.assert_sibling_serves()


async def test_row2_a_paused_router_victim_seen_unloaded_is_kept_paused(tmp_path: Path) -> None:
    s = swap(tmp_path, "verify-up", ["rb"], pausing=True, unloaded=(RA,))

    await s.recovered(Outcome.FINISHED)

    assert s.routers.calls == []
    assert s.states() == {"rs": "hot", "ra": "paused", "rb": "hot"}
    paused = next(r for r in s.host.live if r.model == "ra")
    assert (paused.gpu_mib, paused.host_rss_mib) == (0.0, 0.0), "unloaded: holds nothing"
    s.assert_sibling_serves()


async def test_row3_a_new_model_that_never_loads_is_unloaded_not_its_router_stopped(
    tmp_path: Path,
) -> None:
    s = swap(tmp_path, "verify-up", [], unloaded=(RA,))
    s.routers.status["rb"] = "loading"  # its load never ends
    s.routers.child["rb"] = 7999

    report = await s.recovered(Outcome.ROLLED_BACK)

    assert s.routers.calls == ["unload rb", "load ra"], "rb seen gone before ra loads again"
    assert s.routers.loaded_ids() == ["ra", "rs"]
    assert s.states() == {"rs": "hot", "ra": "hot"}
    assert "unloaded rb, which the run had loaded, from the router router.service" in (
        report.message
    )
    s.assert_sibling_serves()


async def test_row3_a_victim_still_loaded_beside_the_new_model_keeps_the_device(
    tmp_path: Path,
) -> None:
    s = swap(tmp_path, "verify-up", ["ra", "rb"])

    report = await s.recovered(Outcome.ROLLED_BACK)

    assert s.routers.calls == ["unload rb"], "ra was never unloaded: verified, not reloaded"
    assert s.states() == {"rs": "hot", "ra": "hot"}
    assert "victim ra/ra-q4 is running too" in report.message
    s.assert_sibling_serves()


# --------------------------------------------------------------------------- rollback (rows 4-5)


async def test_row4_a_run_rolling_back_unloads_the_new_model_and_loads_the_victim(
    tmp_path: Path,
) -> None:
    s = swap(tmp_path, "rollback-stop", ["rb"], unloaded=(RA,))

    await s.recovered(Outcome.ROLLED_BACK)

    assert s.routers.calls == ["unload rb", "load ra"]
    assert s.states() == {"rs": "hot", "ra": "hot"}
    s.assert_sibling_serves()


async def test_row5_a_new_model_that_will_not_unload_leaves_the_victim_unloaded(
    tmp_path: Path,
) -> None:
    s = swap(tmp_path, "rollback-stop", ["rb"], pausing=True, unloaded=(RA,))
    s.routers.ignores_unload.add("rb")

    report = await s.recovered(Outcome.NEEDS_HUMAN)

    assert s.routers.calls == ["unload rb"], "ra never loaded beside rb"
    assert s.states() == {"rs": "hot", "ra": "paused"}, "never hot; rb out of the ledger"
    kind, severity, _, message = s.only_alert()
    assert (kind, severity) == (AlertKind.RECOVERY_NEEDED, Severity.CRITICAL)
    assert "the victims were not restored" in message
    assert report.problems
    s.assert_sibling_serves()


async def test_row5_a_router_the_run_started_is_stopped_as_the_runs_rollback_would(
    tmp_path: Path,
) -> None:
    rec = record("rollback-stop", kind="load", victims=(), started_unit=ROUTER_UNIT)
    s = Scene(tmp_path, rec, [], ["rb"])
    s.routers.status["rs"] = "unloaded"  # the router was down before the run: empty

    report = await s.recovered(Outcome.ROLLED_BACK)

    assert s.units.jobs == [f"stop {ROUTER_UNIT}"]
    assert s.routers.calls == []
    assert s.states() == {}
    assert f"stopped {ROUTER_UNIT}, which the run had started" in report.message


async def test_row5_a_router_the_run_started_that_now_hosts_a_resident_is_not_stopped(
    tmp_path: Path,
) -> None:
    rec = record("rollback-stop", kind="load", victims=(), started_unit=ROUTER_UNIT)
    s = Scene(tmp_path, rec, [RS], ["rb"])

    await s.recovered(Outcome.ROLLED_BACK)

    assert s.routers.calls == ["unload rb"]
    assert s.states() == {"rs": "hot"}
    s.assert_sibling_serves()


# --------------------------------------------------------------------------- victims (rows 6-12)


async def test_row7_a_new_model_whose_load_failed_is_down_and_the_victim_loads_again(
    tmp_path: Path,
) -> None:
    s = swap(tmp_path, "verify-up", [], unloaded=(RA,))
    s.routers.failed["rb"] = 1  # unloaded, failed: its child exited

    report = await s.recovered(Outcome.ROLLED_BACK)

    assert s.routers.calls == ["load ra"]
    assert s.states() == {"rs": "hot", "ra": "hot"}
    assert "asked the router router.service (http://127.0.0.1:18080) to load ra again" in (
        report.message
    )
    assert "ra/ra-q4 verified serving, published hot" in report.message
    s.assert_sibling_serves()


async def test_row8_a_victim_whose_load_fails_stays_paused_and_needs_a_human(
    tmp_path: Path,
) -> None:
    s = swap(tmp_path, "verify-free", [], unloaded=(RA,))
    s.routers.fail_load.add("ra")

    report = await s.recovered(Outcome.NEEDS_HUMAN)

    assert s.routers.calls == ["load ra"]
    assert s.states() == {"rs": "hot", "ra": "paused"}
    assert "ra/ra-q4 not published" in report.message
    s.assert_sibling_serves()


async def test_row9_an_unload_whose_router_victim_is_unloaded_is_finished(tmp_path: Path) -> None:
    s = swap(tmp_path, "verify-free", [], kind="unload", new=None, unloaded=(RA,))

    await s.recovered(Outcome.FINISHED)

    assert s.routers.calls == []
    assert s.states() == {"rs": "hot"}
    s.assert_sibling_serves()


async def test_row10_a_victim_whose_router_went_down_is_loaded_in_it_once_restarted(
    tmp_path: Path,
) -> None:
    s = swap(tmp_path, "verify-free", [], unloaded=(RA,))
    rec = s.world.journal.read()
    assert rec is not None
    s.world.journal.write(replace(rec, victims=(RA, RS)))  # rs was a victim too
    await s.units.stop_unit(ROUTER_UNIT, 1.0)  # the router died since: empty
    s.units.jobs.clear()

    await s.recovered(Outcome.ROLLED_BACK)

    assert s.units.jobs == [f"start {ROUTER_UNIT}", f"start {ROUTER_UNIT}"]
    assert s.routers.calls == ["load ra", "load rs"]
    assert s.states() == {"rs": "hot", "ra": "hot"}


# --------------------------------------------------------------------------- wake runs (13-15)


def wake_scene(tmp_path: Path, step: str, loaded: Sequence[str]) -> Scene:
    """A wake run for the paused ``rb`` that unloaded ``ra`` to make room."""
    rec = record(step, new=None, wake=PAUSED_RB, unloaded=(RA,))
    return Scene(tmp_path, rec, [DRAINING_RA, PAUSED_RB, RS], loaded)


async def test_row13_a_wake_run_whose_model_loaded_is_finished(tmp_path: Path) -> None:
    s = wake_scene(tmp_path, "wake", ["rb"])

    report = await s.recovered(Outcome.FINISHED)

    assert s.routers.calls == []
    assert s.states() == {"rs": "hot", "rb": "hot"}
    assert "rb/rb-q4's wake may have been in flight" in report.message
    s.assert_sibling_serves()


async def test_row14_a_wake_run_whose_load_failed_keeps_it_paused_and_loads_the_victim(
    tmp_path: Path,
) -> None:
    s = wake_scene(tmp_path, "wake", [])
    s.routers.failed["rb"] = 1

    await s.recovered(Outcome.ROLLED_BACK)

    assert s.routers.calls == ["load ra"], "rb already unloaded: nothing to put back to sleep"
    assert s.states() == {"rs": "hot", "rb": "paused", "ra": "hot"}
    s.assert_sibling_serves()


async def test_row14_a_wake_run_cut_short_before_its_load_puts_it_back_by_unloading(
    tmp_path: Path,
) -> None:
    s = wake_scene(tmp_path, "verify-free", ["rb"])  # rb loaded behind the run's back

    await s.recovered(Outcome.ROLLED_BACK)

    assert s.routers.calls == ["unload rb", "load ra"]
    assert s.states() == {"rs": "hot", "rb": "paused", "ra": "hot"}
    s.assert_sibling_serves()


async def test_row15_a_woken_model_that_fails_its_check_and_will_not_unload_needs_a_human(
    tmp_path: Path,
) -> None:
    s = wake_scene(tmp_path, "verify-up", ["rb"])
    s.world.engines.served[ROUTER] = ["ra", "rs"]  # rb's id is not served: wrong engine
    s.routers.ignores_unload.add("rb")

    await s.recovered(Outcome.NEEDS_HUMAN)

    assert s.routers.calls == ["unload rb"], "ra never loaded beside rb"
    assert s.states() == {"rs": "hot", "ra": "paused"}
    s.assert_sibling_serves()


# --------------------------------------------------------------------------- in flight (16-18)


async def test_row16_an_unload_in_flight_is_settled_then_the_victim_loaded_again(
    tmp_path: Path,
) -> None:
    s = swap(tmp_path, "pause", ["ra"], pausing=True, unloaded=(RA,))

    report = await s.recovered(Outcome.ROLLED_BACK)

    assert s.routers.calls == ["unload ra", "load ra"]
    assert s.states() == {"rs": "hot", "ra": "hot"}
    assert "ra/ra-q4's unload may have been in flight when uapplaced died (journal step pause)" in (
        report.message
    )
    s.assert_sibling_serves()


async def test_row16_a_stopped_router_victims_unload_in_flight_finishes_an_unload_run(
    tmp_path: Path,
) -> None:
    s = swap(tmp_path, "stop", ["ra"], kind="unload", new=None)

    report = await s.recovered(Outcome.FINISHED)

    assert s.routers.calls == ["unload ra"]
    assert s.states() == {"rs": "hot"}
    assert "(journal step stop)" in report.message
    s.assert_sibling_serves()


async def test_row17_an_unload_in_flight_that_cannot_be_settled_is_never_published(
    tmp_path: Path,
) -> None:
    s = swap(tmp_path, "pause", ["ra"], pausing=True, unloaded=(RA,))
    s.routers.ignores_unload.add("ra")

    report = await s.recovered(Outcome.NEEDS_HUMAN)

    assert s.routers.calls == ["unload ra"]
    assert s.states() == {"rs": "hot"}, "still loaded but unsettled: out of the ledger"
    assert "its unload was in flight when uapplaced died and could not be settled" in (
        report.message
    )
    s.assert_sibling_serves()


async def test_row18_a_rollback_load_in_flight_is_waited_for_then_published(
    tmp_path: Path,
) -> None:
    s = swap(tmp_path, "rollback-wake", [], pausing=True, unloaded=(RA,))
    s.routers.status["ra"] = "loading"
    asyncio.get_running_loop().call_later(0.05, s.routers.status.__setitem__, "ra", "loaded")

    report = await s.recovered(Outcome.NOTHING_CHANGED)

    assert s.routers.calls == []
    assert s.states() == {"rs": "hot", "ra": "hot"}
    assert "ra/ra-q4's load (the rollback's) was in flight: found it awake" in report.message
    s.assert_sibling_serves()


async def test_row18_a_rollback_load_that_never_reached_the_router_is_sent_again(
    tmp_path: Path,
) -> None:
    s = swap(tmp_path, "rollback-wake", [], pausing=True, unloaded=(RA,))

    report = await s.recovered(Outcome.ROLLED_BACK)

    assert s.routers.calls == ["load ra"]
    assert s.states() == {"rs": "hot", "ra": "hot"}
    assert "was in flight and it is still asleep" in report.message
    s.assert_sibling_serves()
