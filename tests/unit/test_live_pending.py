"""Live pending views (issue 13): ``ListPending`` reads holders and in-flight work at
call time, and entries parked while a swap runs are re-planned once it settles.

The controller runs without a bus on real registry files, a real ledger and the
simulated GPU. The in-flight source here is a small in-process
:class:`~uapplace.controller.ports.InflightSource` (the real proxy over HTTP is in
tests/bus/test_live_pending.py); the planner is the real one, wrapped where a
test must hold one plan back to force an interleaving.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from controller_fixtures import registry, registry_paths

from tests.worlds.seed_docs import ALPHA_ENDPOINT, alpha_model, beta_model
from uapplace.controller import controller as controller_module
from uapplace.controller import views
from uapplace.controller.controller import Controller
from uapplace.core.model import DEFAULT_CELLS, Holder, Plan, Resident, ResidentState
from uapplace.core.planner import PlanInput, plan
from uapplace.files.paths import Paths

REGISTRY = registry({"alpha": alpha_model(rails=1), "beta": beta_model()})
ALPHA_TARGET = f"gpu0:{ALPHA_ENDPOINT}"
HANG_GUARD_S = 10.0
"""Only a bound on a hang: every wait below ends on a condition, never on a clock."""


class Inflight:
    """What the proxy lists now; ``None`` = the proxy does not answer (unknown)."""

    def __init__(self) -> None:
        self.targets: dict[str, list[Holder]] | None = None

    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        return self.targets

    async def check(self) -> tuple[str, str] | None:
        return None


class HeldBackPlanner:
    """The real planner, except that its first call waits until :meth:`let_go`.

    Holds a park's own planning after it read the residents and the readings, so
    the swap can finish and the re-plan the swap asks for can land first.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.first_call_waiting = threading.Event()
        self._gate = threading.Event()

    def __call__(self, inp: PlanInput, requested: str, cells: int = DEFAULT_CELLS) -> Plan:
        self.calls += 1
        if self.calls == 1:
            self.first_call_waiting.set()
            self._gate.wait(HANG_GUARD_S)
        return plan(inp, requested, cells)

    def let_go(self) -> None:
        self._gate.set()


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return registry_paths(tmp_path, REGISTRY)


@pytest.fixture
def proxy() -> Inflight:
    """The proxy's in-flight list; unknown (no answer) until a test says otherwise."""
    return Inflight()


@pytest.fixture
async def controller(paths: Paths, proxy: Inflight) -> AsyncIterator[Controller]:
    """A controller with its background tasks (ledger writer, re-planner) running."""
    made = Controller.open(paths, proxy=proxy)
    made.start_background()
    try:
        yield made
    finally:
        await made.shutdown(wait_s=1)


def resident(model: str, state: ResidentState) -> Resident:
    config, gpu_mib, port = {
        "alpha": ("alpha-q4", 8000, 18080),
        "beta": ("beta-q8", 20000, 18081),
    }[model]
    return Resident(
        model=model,
        config=config,
        device="gpu0",
        engine="llama.cpp",
        endpoint=f"http://127.0.0.1:{port}",
        unit=f"uap-{model}",
        state=state,
        gpu_mib=gpu_mib,
        host_rss_mib=2000,
        since="2026-01-01T00:00:00Z",
    )


async def settle(controller: Controller) -> None:
    """Let the work scheduled after a park's answer (planning it) run to completion."""
    await asyncio.sleep(0)
    await controller.background_done()


async def listed_entry(controller: Controller, placement_id: str) -> dict[str, Any]:
    listed = await views.pending_live_json(controller)
    entry: dict[str, Any] = next(e for e in listed["pending"] if e["id"] == placement_id)
    return entry


async def options_once_replanned(controller: Controller, placement_id: str) -> list[Any]:
    """The entry's options once a re-plan has given it some (the re-planner runs
    ``REPLAN_DEBOUNCE_S`` after a change; this waits on the result, not a clock)."""

    async def some() -> list[Any]:
        while True:
            options: list[Any] = (await listed_entry(controller, placement_id))["options"]
            if options:
                return options
            await asyncio.sleep(0.02)

    return await asyncio.wait_for(some(), HANG_GUARD_S)


async def replanner_idle(controller: Controller) -> None:
    """Until the background re-planner has taken every request so far and finished."""

    async def idle() -> None:
        while True:
            if controller.planning.idle:
                return
            await asyncio.sleep(0.02)

    await asyncio.wait_for(idle(), HANG_GUARD_S)


def only_victim(entry: dict[str, Any]) -> dict[str, Any]:
    (option,) = entry["options"]
    assert option["kind"] == "displace"
    (victim,) = option["victims"]
    assert (victim["model"], victim["config"]) == ("alpha", "alpha-q4")
    return victim  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- live holders


async def test_victim_holders_and_in_flight_are_read_at_call_time(
    controller: Controller, proxy: Inflight
) -> None:
    proxy.targets = {}
    controller.upsert_resident(resident("alpha", ResidentState.HOT))
    placement_id = controller.admit("beta", "asker", "", 0).placement_id
    await settle(controller)
    planned = only_victim(await listed_entry(controller, placement_id))
    assert (planned["in_flight"], planned["holders"]) == (False, [])

    request = Holder("busy-client", "inflight", "req-1", "2026-06-01T12:00:00Z")
    proxy.targets = {ALPHA_TARGET: [request]}
    busy = only_victim(await listed_entry(controller, placement_id))
    assert busy["in_flight"] is True
    assert busy["holders"] == [
        {
            "client": "busy-client",
            "kind": "inflight",
            "detail": "req-1",
            "started_at": "2026-06-01T12:00:00Z",
        }
    ]
    assert busy["consequence"] == "active generation aborted; context lost"

    proxy.targets = None  # the proxy stops answering: unknown, counted as busy
    unknown = only_victim(await listed_entry(controller, placement_id))
    assert (unknown["in_flight"], unknown["holders"]) == (None, [])
    assert "counted as busy" in unknown["consequence"]

    proxy.targets = {}  # the request finished
    idle = only_victim(await listed_entry(controller, placement_id))
    assert (idle["in_flight"], idle["holders"]) == (False, [])
    assert idle["consequence"] == "session idle, context lost, reload needed"
    # The planned option itself (what Apply approves) is unchanged throughout.
    assert (await listed_entry(controller, placement_id))["options"][0]["signature"] == [
        "alpha/alpha-q4"
    ]


async def test_a_hold_taken_after_the_park_is_reflected_in_the_next_listing(
    controller: Controller, proxy: Inflight
) -> None:
    """A held resident is never a victim: the listing right after a hold (before the
    debounced re-planner has run) no longer offers to stop it, and offers it again
    right after the release."""
    proxy.targets = {}
    controller.upsert_resident(resident("alpha", ResidentState.HOT))
    placement_id = controller.admit("beta", "asker", "", 0).placement_id
    await settle(controller)
    only_victim(await listed_entry(controller, placement_id))

    cookie = await controller.hold("alpha", "demo on stage", "org.example.App", "")
    assert (await listed_entry(controller, placement_id))["options"] == []
    assert (await views.preview(controller, "beta", 0))["options"] == []

    controller.release(cookie, "")
    only_victim(await listed_entry(controller, placement_id))


# --------------------------------------------------------------------------- swaps


async def swap_alpha_for_beta(controller: Controller) -> None:
    """The resident changes a swap makes after its drain: alpha goes, beta warms, turns hot."""
    controller.drop_resident("alpha", "alpha-q4", "gpu0")
    controller.upsert_resident(resident("beta", ResidentState.WARMING))
    controller.upsert_resident(resident("beta", ResidentState.HOT))


async def test_an_entry_parked_during_a_swap_gets_the_options_a_preview_shows_after_it(
    controller: Controller,
) -> None:
    controller.upsert_resident(resident("alpha", ResidentState.HOT))
    controller.upsert_resident(resident("alpha", ResidentState.DRAINING))
    placement_id = controller.admit("alpha", "asker", "", 0).placement_id
    await settle(controller)
    # Planned mid-swap: alpha is still resident (draining), so nothing can be offered.
    assert (await listed_entry(controller, placement_id))["options"] == []

    await swap_alpha_for_beta(controller)
    options = await options_once_replanned(controller, placement_id)
    preview = await views.preview(controller, "alpha", 0)
    assert preview["reason"] == "ok" and preview["options"]
    assert options == preview["options"]
    assert options[0]["signature"] == ["beta/beta-q8"]


async def test_a_park_planned_across_the_end_of_a_swap_is_replanned_after_it(
    controller: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The park's own planning reads the residents mid-swap, the swap ends and its
    re-plan runs, and only then does the park's (stale) plan land: a further
    re-plan must follow, or "no options" would stand while a preview shows one."""
    controller.upsert_resident(resident("alpha", ResidentState.HOT))
    controller.upsert_resident(resident("alpha", ResidentState.DRAINING))
    await replanner_idle(controller)  # so the held-back plan is the park's own
    held = HeldBackPlanner()
    monkeypatch.setattr(controller_module, "plan", held)
    placement_id = controller.admit("alpha", "asker", "", 0).placement_id
    await asyncio.wait_for(asyncio.to_thread(held.first_call_waiting.wait), HANG_GUARD_S)

    await swap_alpha_for_beta(controller)
    await options_once_replanned(controller, placement_id)  # the swap's re-plan ran
    await replanner_idle(controller)  # and no other is still to come
    held.let_go()
    await settle(controller)  # the park's plan, made mid-swap, has landed now

    options = await options_once_replanned(controller, placement_id)
    preview = await views.preview(controller, "alpha", 0)
    assert options == preview["options"] and options[0]["signature"] == ["beta/beta-q8"]
