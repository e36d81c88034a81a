"""Busy means busy, and one ``Resolved`` per placement (issue 20).

While a switch runs, a call that would change what it relies on is refused ``Busy`` naming
the run: ``Measure`` (it rewrites the machine-local registry the run plans from),
``Dismiss`` of the entry being applied (it answered ``true`` while the run went on and
resolved the entry ``applied`` anyway), ``WriteUnits`` (drop-ins and a manager reload under
the units the run stops and starts; ``refuse_while_running`` below), ``Hold`` of a model the
run has drained and is stopping (the hold would be ignored). ``MeasureEnvelope``
holds the one-run lock itself (:meth:`~uapplace.enforce.enforcer.Enforcer.exclusive`). An
apply queued behind a run (the auto runner's) whose entry was dismissed meanwhile runs nothing.

A run's ``resolve`` announces the entries it resolved only once the ledger without them is
on disk: a kill right after ``resolve`` then cannot make the start-up repair resolve them a
second time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from controller_fixtures import registry, registry_paths
from enforce_fakes import Scene, resident, swap_registry
from test_controller import Recorder
from test_door import ENTRY, Door
from test_door import Recorder as DoorRecorder

from tests.worlds.seed_docs import alpha_model
from uapplace.controller.controller import Controller
from uapplace.controller.ports import EnforcementParts
from uapplace.core.errors import Busy, NotFound
from uapplace.files.ledger import Ledger
from uapplace.files.paths import Paths

RUN = "run-0000abcd (apply plc-000001 option 1 (displace beta/b1 on gpu0, stopping alpha/a1))"


# --------------------------------------------------------------------------- the door


async def test_measure_is_busy_while_a_run_is_in_progress() -> None:
    made = Door()
    made.attach()
    made.recorder.running = RUN

    with pytest.raises(Busy, match=r"Measure: an enforcement is running \(run-0000abcd"):
        await made.door.measure("alpha", "a1")
    with pytest.raises(Busy, match=r"WriteUnits: an enforcement is running"):
        made.door.refuse_while_running("WriteUnits")
    assert made.recorder.calls == []

    made.recorder.running = None
    await made.door.measure("alpha", "a1")
    made.door.refuse_while_running("WriteUnits")
    assert made.recorder.calls == [("measure", "alpha", "a1")]


def test_dismiss_of_the_entry_being_applied_is_busy_and_of_another_is_not() -> None:
    made = Door()
    made.attach()
    made.recorder.running = RUN
    made.recorder.applying = ENTRY.id

    with pytest.raises(Busy, match=r"placement plc-000001 is being applied \(run-0000abcd"):
        made.door.refuse_dismiss_while_applied(ENTRY.id)
    made.door.refuse_dismiss_while_applied("plc-000002")


def test_a_hold_on_a_model_the_run_has_drained_is_busy() -> None:
    made = Door()
    made.attach()
    made.recorder.running = RUN
    made.recorder.drained = frozenset({"alpha"})

    with pytest.raises(Busy, match=r"Hold: alpha is being switched away \(run-0000abcd"):
        made.door.refuse_hold_while_drained("alpha")
    made.door.refuse_hold_while_drained("beta")


# --------------------------------------------------------------------------- the enforcer


async def test_the_enforcer_names_the_entry_it_applies_while_the_run_lasts(
    tmp_path: Path,
) -> None:
    scene = Scene(tmp_path, swap_registry(), [resident("alpha", "a1")])
    entry = scene.park("beta")
    scene.host.gate = asyncio.Event()  # holds the run in revalidation
    run = asyncio.create_task(scene.enforcer.apply(entry, 1, ["alpha/a1"]))
    await asyncio.sleep(0.01)

    assert scene.enforcer.applying == entry.id
    assert (scene.enforcer.running or "").startswith("run-")
    assert scene.enforcer.drained == frozenset()  # not drained yet
    drained_at_stop: list[frozenset[str]] = []
    scene.units.on_change(lambda unit, state: drained_at_stop.append(scene.enforcer.drained))
    scene.host.gate.set()
    assert (await run)["ok"] is True
    assert drained_at_stop[0] == frozenset({"alpha"})  # past the drain, at alpha's stop
    assert scene.enforcer.applying is None and scene.enforcer.running is None
    assert scene.enforcer.drained == frozenset()


async def test_a_queued_apply_of_an_entry_dismissed_while_it_waited_runs_nothing(
    tmp_path: Path,
) -> None:
    scene = Scene(tmp_path, swap_registry(), [resident("alpha", "a1")])
    entry = scene.park("beta")
    async with scene.enforcer.exclusive("a measurement"):
        queued = asyncio.create_task(scene.enforcer.apply(entry, 1, ["alpha/a1"], wait=True))
        await asyncio.sleep(0.01)
        del scene.host.entries[entry.id]  # dismissed while the apply waited its turn

    with pytest.raises(NotFound, match="plc-000001 is no longer pending"):
        await queued
    assert scene.units.jobs == [] and scene.host.states() == {"alpha/a1": "hot"}
    scene.assert_ended_cleanly()


# --------------------------------------------------------------------------- the controller


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return registry_paths(tmp_path, registry({"alpha": alpha_model(rails=1)}))


async def parked(controller: Controller) -> str:
    decision = controller.admit("alpha", "c1", "", 0)
    assert decision.decision == "park"
    await asyncio.sleep(0)
    await controller.background_done()
    return str(decision.placement_id)


async def test_the_controller_refuses_to_dismiss_the_entry_being_applied(paths: Paths) -> None:
    events = Recorder()
    controller = Controller.open(paths, events=events)
    placement_id = await parked(controller)
    other = controller.admit("alpha", "c2", "", 0).placement_id
    busy = DoorRecorder()  # an enforcer in the middle of applying placement_id
    busy.running, busy.applying = RUN, placement_id
    controller.enforcement.attach(EnforcementParts(busy, busy))

    with pytest.raises(Busy, match=f"placement {placement_id} is being applied"):
        controller.dismiss(placement_id)

    assert controller.live_pending_entry(placement_id) is not None
    assert events.of("resolved") == []
    assert controller.dismiss(other) is True
    assert events.of("resolved") == [(other, "dismissed")]
    await controller.background_done()


async def test_the_controller_refuses_a_hold_on_a_model_the_run_has_drained(
    paths: Paths,
) -> None:
    controller = Controller.open(paths)
    busy = DoorRecorder()  # an enforcer past alpha's drain, stopping it
    busy.running, busy.drained = RUN, frozenset({"alpha"})
    controller.enforcement.attach(EnforcementParts(busy, busy))

    with pytest.raises(Busy, match="Hold: alpha is being switched away"):
        await controller.hold("alpha", "an agent is mid-task", "agent", "")
    assert controller.holds == {}

    busy.running, busy.drained = None, frozenset()
    assert await controller.hold("alpha", "an agent is mid-task", "agent", "") > 0


class LedgerReader(Recorder):
    """Reads the ledger on disk at each ``Resolved``: what a crash right then would leave."""

    def __init__(self, ledger: Path) -> None:
        super().__init__()
        self.ledger = ledger
        self.pending_on_disk: list[list[str]] = []

    def on_resolved(self, placement_id: str, outcome: str) -> None:
        super().on_resolved(placement_id, outcome)
        self.pending_on_disk.append([e.id for e in Ledger(self.ledger).read().pending])


async def test_a_run_resolution_is_announced_only_once_the_ledger_is_on_disk(
    paths: Paths,
) -> None:
    events = LedgerReader(paths.ledger)
    controller = Controller.open(paths, events=events)
    placement_id = await parked(controller)
    await controller.flush()  # the park is durable, as the door makes it before a run

    async with controller.durable_resolutions():
        assert controller.resolve_pending_id(placement_id, "applied") is True
        assert events.of("resolved") == []  # nothing announced before the write

    assert events.of("resolved") == [(placement_id, "applied")]
    assert events.pending_on_disk == [[]]
    # A kill now: the restarted daemon finds no entry, so its repair resolves nothing.
    restarted_events = Recorder()
    restarted = Controller.open(paths, events=restarted_events)
    await restarted.restore_from_ledger()
    assert restarted.resolve_pending_id(placement_id, "applied") is False
    assert restarted_events.of("resolved") == []
    await controller.background_done()


async def test_without_the_durable_write_a_restart_would_resolve_it_again(paths: Paths) -> None:
    """The issue's two ``Resolved``: what the durable write prevents."""
    events = LedgerReader(paths.ledger)
    controller = Controller.open(paths, events=events)
    placement_id = await parked(controller)
    await controller.flush()

    controller.resolve_pending_id(placement_id, "applied")  # announced before any write

    assert events.pending_on_disk == [[placement_id]]
    restarted = Controller.open(paths, events=Recorder())
    await restarted.restore_from_ledger()
    assert restarted.resolve_pending_id(placement_id, "applied") is True
    await controller.background_done()
