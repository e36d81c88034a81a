"""Publication (docs/invariants.md, invariant 2): only a verified engine is forwarded to.

The admission rule (only ``hot`` forwards, ``warming`` parks ``warming``), the
controller's restore (a ledger's ``hot`` comes back ``warming``), the debounced
re-plan of pending entries, and the one check of :mod:`uapplace.publish.verify` against
the real fake engine served over real HTTP on loopback, and ``metricsMustMatch`` against
the exact answers of a real llama-server (tests/unit/llama_shapes.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from controller_fixtures import registry, registry_paths
from http_fixtures import serving
from llama_shapes import BUILD_INFO, LlamaShapes

from tests.worlds.builders import gpu, measured
from uapplace.controller.controller import Controller
from uapplace.core.admission import Admission
from uapplace.core.alerts import Alert, AlertBoard, AlertKind, Severity
from uapplace.core.model import (
    DeviceReading,
    Model,
    ParkReason,
    Registry,
    Resident,
    ResidentState,
)
from uapplace.files.capacity import ServicePolicy
from uapplace.files.ledger import LedgerDoc
from uapplace.io.engines import EngineError
from uapplace.io.router import RouterModel
from uapplace.publish import verify
from uapplace.publish.publication import WRONG_ENGINE_FIRST_S, WRONG_ENGINE_MAX_S, verify_until_ok
from uapplace.sim.engine import EngineOptions, FakeEngine

NOW = 1_800_000_000.0
A1 = measured("a1", 8000, host_mib=64)
ALPHA = Model(
    "alpha", "Alpha", "llama.cpp", {"a1": A1}, unit="a.service", advertises=("alpha-latest",)
)
REGISTRY = Registry({"gpu0": gpu(reserved=0)}, {"alpha": ALPHA})
POLICY = ServicePolicy("alpha-server", None, {"kv": "int8"}, (), None)


def resident(state: ResidentState, endpoint: str | None = "http://127.0.0.1:9") -> Resident:
    return Resident(
        model="alpha",
        config="a1",
        device="gpu0",
        engine="llama.cpp",
        endpoint=endpoint,
        unit="a.service",
        state=state,
        gpu_mib=8000,
        host_rss_mib=64,
        since="2026-10-08T09:14:02Z",
    )


# --------------------------------------------------------------------------- admission


@pytest.mark.parametrize("requested", ["alpha", "a1", "alpha-latest"])
def test_a_warming_resident_is_never_forwarded_to(requested: str) -> None:
    admission = Admission(REGISTRY)
    admission.set_residents([resident(ResidentState.WARMING)])
    decision, entry = admission.decide(requested, "client", None, None, NOW)
    assert (decision.decision, decision.reason) == ("park", "warming")
    assert entry is not None and entry.reason is ParkReason.WARMING
    assert admission.resolved_by(resident(ResidentState.WARMING)) == []


def test_a_parked_entry_follows_the_warming_resident_until_it_is_published() -> None:
    admission = Admission(REGISTRY)
    first, entry = admission.decide("alpha", "client", None, None, NOW)
    assert first.reason == "not_resident" and entry is not None

    admission.set_residents([resident(ResidentState.WARMING)])
    again, _ = admission.decide("alpha", "client", None, None, NOW)
    assert (again.placement_id, again.reason) == (first.placement_id, "warming")
    assert admission.pending[entry.id].reason is ParkReason.WARMING

    admission.set_residents([])  # stopped before it was ever verified
    assert admission.pending[entry.id].reason is ParkReason.NOT_RESIDENT

    admission.set_residents([resident(ResidentState.WARMING)])
    hot = resident(ResidentState.HOT)
    admission.set_residents([hot])
    assert [e.id for e in admission.resolved_by(hot)] == [entry.id]
    forwarded, _ = admission.decide("alpha-latest", "other", None, None, NOW)
    assert (forwarded.decision, forwarded.target_id) == ("forward", hot.target_id)


def test_a_hot_resident_on_one_device_forwards_while_another_warms() -> None:
    admission = Admission(REGISTRY)
    warming = replace(resident(ResidentState.WARMING), device="gpu1")
    admission.set_residents([warming, resident(ResidentState.HOT)])
    decision, _ = admission.decide("alpha", "client", None, None, NOW)
    assert decision.target_id == "gpu0:http://127.0.0.1:9"


# --------------------------------------------------------------------------- controller

CONTROLLER_REGISTRY = registry(
    {
        "alpha": {
            "display": "Alpha",
            "engine": "llama.cpp",
            "unit": "a.service",
            "endpoint": "http://127.0.0.1:9",
            "configs": {
                "a1": {
                    "resident_gpu_mib": 8000,
                    "host_rss_mib": 64,
                    "kv_resident_cells": 32768,
                    "measured_at": "2026-01-01T00:00:00Z",
                    "measured_on": "gpu0",
                }
            },
        }
    }
)


@pytest.fixture
def controller(tmp_path: Path) -> Controller:
    return Controller.open(registry_paths(tmp_path, CONTROLLER_REGISTRY))


async def test_a_restored_hot_resident_parks_warming_until_verified(
    controller: Controller,
) -> None:
    doc = LedgerDoc(residents=[resident(ResidentState.HOT), resident(ResidentState.PAUSED)])
    controller.restore(doc)
    assert [r.state for r in controller.residents] == [
        ResidentState.WARMING,
        ResidentState.PAUSED,
    ]
    decision = controller.admit("alpha", "client", "", 0)
    assert (decision.decision, decision.reason) == ("park", "warming")

    await settle(controller)
    controller.upsert_resident(resident(ResidentState.HOT))  # what a passed verify-up does
    assert controller.admit("alpha", "client", "", 0).decision == "forward"
    assert controller.pending_count == 0  # the park was resolved "forwarded"


async def settle(controller: Controller) -> None:
    """Let the work scheduled after a park's answer (planning it) run to completion."""
    await asyncio.sleep(0)
    await controller.background_done()


async def test_a_burst_of_resident_changes_replans_the_pending_entries_once(
    controller: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    replanned = asyncio.Event()

    async def counting() -> None:
        calls.append(len(controller.residents))
        replanned.set()

    monkeypatch.setattr(controller.planning, "replan_pending", counting)
    controller.start_background()
    try:
        await asyncio.wait_for(replanned.wait(), 5)  # the start-up re-plan
        replanned.clear()
        for state in (ResidentState.WARMING, ResidentState.HOT, ResidentState.DRAINING):
            controller.upsert_resident(resident(state))
        controller.drop_resident("alpha", "a1", "gpu0")
        await asyncio.wait_for(replanned.wait(), 5)
        await asyncio.sleep(0.3)  # longer than the debounce: no second run comes
    finally:
        await controller.shutdown(wait_s=1)
    assert calls == [0, 0]


# --------------------------------------------------------------------------- verify


@dataclass
class Served:
    engine: FakeEngine
    endpoint: str


@pytest.fixture
async def engine() -> AsyncIterator[Served]:
    """The fake engine's HTTP side on a loopback port, loaded, serving ``alpha``."""
    fake = FakeEngine(EngineOptions(port=0, model_id="alpha", kv="int8"))
    fake.loaded = True
    runner = web.AppRunner(fake.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield Served(fake, f"http://{host}:{port}")
    finally:
        await runner.cleanup()


def with_options(served: Served, **changes: Any) -> None:
    served.engine.options = replace(served.engine.options, **changes)


async def test_check_passes_for_the_right_engine(engine: Served) -> None:
    expect = verify.expectation(ALPHA, A1, None, POLICY)
    verdict = await verify.check(engine.endpoint, expect, 2.0)
    assert verdict.ok, verdict
    assert verdict.served == ("alpha",)
    assert "metricsMustMatch kv as policy" in verdict.detail


async def test_an_advertised_id_is_enough(engine: Served) -> None:
    with_options(engine, model_id="alpha-latest")
    verdict = await verify.check(engine.endpoint, verify.expectation(ALPHA, A1), 2.0)
    assert verdict.ok, verdict


async def test_a_loading_engine_is_unhealthy(engine: Served) -> None:
    engine.engine.loaded = False
    verdict = await verify.check(engine.endpoint, verify.expectation(ALPHA, A1), 2.0)
    assert verdict.outcome is verify.Outcome.UNHEALTHY
    assert "/health is not 200" in verdict.detail


async def test_a_wrong_id_is_named(engine: Served) -> None:
    with_options(engine, wrong_id=True)
    verdict = await verify.check(engine.endpoint, verify.expectation(ALPHA, A1), 2.0)
    assert verdict.outcome is verify.Outcome.WRONG_ID and verdict.is_wrong_engine
    assert verdict.served == ("wrong-alpha",)
    assert verdict.detail == (
        f"{engine.endpoint} serves [wrong-alpha], not alpha (nor any id alpha advertises)"
    )


async def test_metrics_against_the_policy(engine: Served) -> None:
    with_options(engine, kv="f16")
    verdict = await verify.check(engine.endpoint, verify.expectation(ALPHA, A1, None, POLICY), 2.0)
    assert verdict.outcome is verify.Outcome.METRICS
    assert verdict.detail == (
        "metricsMustMatch of service alpha-server: kv is 'f16', policy wants 'int8' (from /metrics)"
    )


def llama_policy(**wanted: str | int | float) -> ServicePolicy:
    return ServicePolicy("tiny-server", None, wanted, (), None)


TINY = Model("tiny-a", "Tiny A", "llama.cpp", {"a1": A1}, unit="a.service")


async def test_llama_cpp_settings_are_checked_in_props() -> None:
    """The real /metrics has counters only: n_ctx, total_slots, build_info and model_alias
    come from /props, one GET, and /slots is never asked."""
    shapes = LlamaShapes(n_ctx=256, total_slots=2)
    wanted = llama_policy(
        n_ctx=256, total_slots=2, build_info=BUILD_INFO, model_alias="tiny-a", is_sleeping="false"
    )
    async with serving(shapes.app()) as url:
        verdict = await verify.check(url, verify.expectation(TINY, A1, None, wanted), 2.0)
        served = await verify.served_facts(["n_ctx", "total_slots", "requests_processing"], url, 2)
    assert verdict.ok, verdict
    assert "metricsMustMatch n_ctx, total_slots, build_info" in verdict.detail
    assert served.values == {"n_ctx": 256.0, "total_slots": 2.0, "requests_processing": 0.0}
    assert served.sources == {
        "n_ctx": "/props default_generation_settings.n_ctx",
        "total_slots": "/props total_slots",
        "requests_processing": "/metrics",
    }
    assert shapes.hits["/slots"] == 0


async def test_a_props_mismatch_names_key_values_and_source() -> None:
    shapes = LlamaShapes(n_ctx=256, total_slots=2)
    async with serving(shapes.app()) as url:
        problem = await verify.metrics_problem(llama_policy(n_ctx=512, total_slots=2), url, 2.0)
    assert problem == (
        "metricsMustMatch of service tiny-server: n_ctx is 256, policy wants 512 "
        "(from /props default_generation_settings.n_ctx)"
    )


async def test_props_is_asked_only_for_keys_metrics_lacks() -> None:
    shapes = LlamaShapes()
    async with serving(shapes.app()) as url:
        assert await verify.metrics_problem(llama_policy(requests_deferred=0), url, 2.0) is None
        assert shapes.hits["/props"] == 0
        assert await verify.metrics_problem(llama_policy(n_ctx=256), url, 2.0) is None
    assert (shapes.hits["/metrics"], shapes.hits["/props"], shapes.hits["/slots"]) == (2, 1, 0)


async def test_without_metrics_flag_props_still_answers_and_a_missing_key_says_why() -> None:
    shapes = LlamaShapes(metrics_enabled=False)
    async with serving(shapes.app()) as url:
        assert await verify.metrics_problem(llama_policy(n_ctx=256), url, 2.0) is None
        problem = await verify.metrics_problem(llama_policy(kv="q8_0"), url, 2.0)
    assert problem is not None
    assert problem.startswith(
        "metricsMustMatch of service tiny-server: kv is missing, policy wants 'q8_0' "
        "(in neither /metrics nor /props: GET "
    )
    assert "/metrics: HTTP 501" in problem and "Start it with `--metrics`" in problem


class ChildMetrics:
    """A :class:`~uapplace.io.router.RouterProbe` whose one model's child has no ``--metrics``."""

    async def models(self, endpoint: str, timeout_s: float) -> dict[str, RouterModel]:
        raise AssertionError("metricsMustMatch never lists the router's models")

    async def load(self, endpoint: str, model_id: str, timeout_s: float) -> None:
        raise AssertionError("metricsMustMatch never loads")

    async def unload(self, endpoint: str, model_id: str, timeout_s: float) -> None:
        raise AssertionError("metricsMustMatch never unloads")

    async def children(self, pids: Sequence[int], model_id: str) -> list[int]:
        raise AssertionError("metricsMustMatch reads no process")

    async def metrics(
        self, endpoint: str, model_id: str, timeout_s: float
    ) -> dict[str, float | str]:
        raise EngineError(f"GET {endpoint}/metrics?model={model_id}: HTTP 501")


async def test_a_router_model_is_checked_in_its_childs_props() -> None:
    shapes = LlamaShapes(n_ctx=512, total_slots=4)
    async with serving(shapes.app()) as url:
        served = await verify.served_facts(
            ["n_ctx", "total_slots"], url, 2.0, routed=(ChildMetrics(), "tiny-a")
        )
    assert served.values == {"n_ctx": 512.0, "total_slots": 4.0}
    assert shapes.queries == ["model=tiny-a&autoload=false"]  # never loads the model
    assert served.errors == (f"GET {url}/metrics?model=tiny-a: HTTP 501",)


async def test_a_sleeping_llama_cpp_is_checked_without_waking_it() -> None:
    shapes = LlamaShapes(asleep=True)
    async with serving(shapes.app()) as url:
        problem = await verify.metrics_problem(llama_policy(n_ctx=256, total_slots=2), url, 2.0)
    assert problem is None
    assert shapes.asleep and shapes.hits["/slots"] == 0


async def test_nothing_listening_is_unhealthy() -> None:
    verdict = await verify.check("http://127.0.0.1:9", verify.expectation(ALPHA, A1), 0.5)
    assert verdict.outcome is verify.Outcome.UNHEALTHY


# --------------------------------------------------------------------------- the re-check loop


class Host:
    """The unit sync's view of the controller (ResidentSink), over plain lists."""

    def __init__(self, residents: list[Resident]) -> None:
        self.list = residents
        self.alerts: list[tuple[AlertKind, Severity, str, str, Mapping[str, Any]]] = []
        self.alert_board = AlertBoard(lambda: 0.0, self._note_alert)

    def registry(self) -> Registry:
        return REGISTRY

    def residents(self) -> list[Resident]:
        return self.list

    def put_resident(self, resident: Resident) -> None:
        self.list = [resident]

    def drop_resident(self, resident: Resident) -> None:
        self.list = []

    def service_policy(self, model: Model) -> ServicePolicy | None:
        return None

    async def read_devices(self) -> Mapping[str, DeviceReading]:
        return {}

    def _note_alert(self, alert: Alert) -> None:
        self.alerts.append(
            (alert.kind, alert.severity, alert.subject, alert.message, dict(alert.detail))
        )

    async def recheck(
        self, warming: Resident, sleep: Callable[[float], Awaitable[None]]
    ) -> Resident | None:
        """:func:`verify_until_ok` on ``warming`` (unit ``a.service``), polling fast, with
        ``sleep`` for its pauses."""
        return await verify_until_ok(
            self,
            warming,
            "a.service",
            lambda: next(iter(self.list), None),
            first_poll_s=0.01,
            max_poll_s=0.02,
            http_s=2.0,
            sleep=sleep,
        )


async def test_a_wrong_engine_is_reported_once_and_rechecked_with_backoff(
    engine: Served,
) -> None:
    with_options(engine, wrong_id=True)
    warming = resident(ResidentState.WARMING, engine.endpoint)
    host = Host([warming])
    pauses: list[float] = []

    async def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 8:  # the operator swaps the engine to the right model
            with_options(engine, wrong_id=False)

    verified = await host.recheck(warming, sleep)
    assert verified == warming
    assert pauses == [min(WRONG_ENGINE_FIRST_S * 2**i, WRONG_ENGINE_MAX_S) for i in range(8)]
    assert len(host.alerts) == 1
    kind, severity, subject, message, detail = host.alerts[0]
    assert (kind, severity, subject) == (AlertKind.WRONG_MODEL, Severity.WARNING, "a.service")
    assert message.startswith("a.service serves the wrong model: ")
    assert detail["served"] == ["wrong-alpha"]
    assert detail["expected"] == ["a1", "alpha", "alpha-latest"]


async def test_the_recheck_ends_when_the_resident_goes(engine: Served) -> None:
    engine.engine.loaded = False
    warming = resident(ResidentState.WARMING, engine.endpoint)
    host = Host([warming])

    async def sleep(seconds: float) -> None:
        host.list = []  # its unit stopped

    verified = await host.recheck(warming, sleep)
    assert verified is None
    assert host.alerts == []
