"""Per-target rails (uapplace/io/rails.py) against the fake engine and the real llama-server's
JSON shapes over real HTTP, and the gate's per-target semaphore map (uapplace/gate.py
``TargetSemaphores``) sized from them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
from aiohttp import web
from http_fixtures import closed_port_url, serving
from llama_shapes import LlamaShapes

from uapplace.core.model import Model, Resident, ResidentState
from uapplace.gate import TargetSemaphores, rails_map
from uapplace.io.rails import (
    EngineKind,
    ProbeState,
    RailsCache,
    RailsQuery,
    engine_kind,
    probe_rails,
    queries_for,
    target_rails,
)
from uapplace.sim.engine import FakeEngine, parse_options

TARGET = "gpu0:http://127.0.0.1:1"
_tasks: set[asyncio.Task[None]] = set()
"""Strong references to the request tasks of :func:`run_three`."""


@asynccontextmanager
async def engine(*flags: str) -> AsyncIterator[str]:
    """The fake engine, parsed from its own command line, served in-process and loaded."""
    fake = FakeEngine(parse_options(["--port", "0", "--model-id", "m", *flags]))
    await fake.finish_loading()
    async with serving(fake.app()) as url:
        yield url


@asynccontextmanager
async def metrics_server(text: str) -> AsyncIterator[str]:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with serving(app) as url:
        yield url


async def until(condition: Callable[[], bool], guard_s: float = 10) -> None:
    """Let other tasks run until ``condition`` holds; a guard, not a timing assertion."""
    async with asyncio.timeout(guard_s):
        while True:
            if condition():
                return
            await asyncio.sleep(0)


# --------------------------------------------------------------------------- live probes


@asynccontextmanager
async def llama(shapes: LlamaShapes) -> AsyncIterator[str]:
    """The real llama-server's answers (tests/unit/llama_shapes.py), served."""
    async with serving(shapes.app()) as url:
        yield url


async def test_parallel_2_gives_rails_2_from_props() -> None:
    async with engine("--parallel", "2") as url:
        live = await probe_rails(url, "llama.cpp")
        [target] = await target_rails([RailsQuery(TARGET, "m", "llama.cpp", url)])
    assert (live.state, live.rails, live.source) == (ProbeState.OK, 2, "props")
    assert (target.rails, target.rails_source, target.state) == (2, "props", "ok")
    assert target.to_json()["live"] == {
        "state": "ok",
        "rails": 2,
        "source": "props",
        "detail": "total_slots 2",
    }


async def test_real_props_gives_the_rails_and_slots_is_never_asked() -> None:
    shapes = LlamaShapes(total_slots=2)
    async with llama(shapes) as url:
        live = await probe_rails(url, "llama.cpp")
    assert (live.state, live.rails, live.source) == (ProbeState.OK, 2, "props")
    assert shapes.hits["/slots"] == 0


async def test_a_sleeping_llama_cpp_is_read_from_props_and_stays_asleep() -> None:
    shapes = LlamaShapes(total_slots=3, asleep=True)
    async with llama(shapes) as url:
        live = await probe_rails(url, "llama.cpp")
        other = await probe_rails(url, "something")
    assert (live.state, live.rails, live.source) == (ProbeState.OK, 3, "props")
    assert (other.state, other.rails, other.source) == (ProbeState.OK, 3, "props")
    assert shapes.hits["/slots"] == 0 and shapes.asleep


async def test_props_without_total_slots_asks_slots_only_while_awake() -> None:
    without = {k: v for k, v in LlamaShapes().props_body().items() if k != "total_slots"}
    awake = LlamaShapes(total_slots=2, props_override=without)
    async with llama(awake) as url:
        live = await probe_rails(url, "llama.cpp")
    assert (live.state, live.rails, live.source) == (ProbeState.OK, 2, "slots")
    assert awake.hits["/slots"] == 1

    asleep = LlamaShapes(
        total_slots=2, asleep=True, props_override={**without, "is_sleeping": True}
    )
    async with llama(asleep) as url:
        live = await probe_rails(url, "llama.cpp")
    assert (live.state, live.rails) == (ProbeState.NOT_PROBED, None)
    assert "asleep" in live.detail and "would wake" in live.detail
    assert asleep.hits["/slots"] == 0 and asleep.asleep


async def test_a_server_without_props_is_counted_from_slots() -> None:
    shapes = LlamaShapes(total_slots=4, no_props_route=True)
    async with llama(shapes) as url:
        live = await probe_rails(url, "llama.cpp")
    assert (live.state, live.rails, live.source) == (ProbeState.OK, 4, "slots")


async def test_a_router_without_model_is_probe_failed_naming_its_answer() -> None:
    shapes = LlamaShapes(router=True)
    async with llama(shapes) as url:
        live = await probe_rails(url, "llama.cpp")
    # The router's own /props has neither total_slots nor is_sleeping, so /slots is asked,
    # and a router answers 400 there without ?model=: failed, never one rail.
    assert (live.state, live.rails) == (ProbeState.FAILED, None)
    assert "/slots: HTTP 400" in live.detail and "model name is missing" in live.detail


async def test_failing_props_is_probe_failed_never_one_rail() -> None:
    async with engine("--parallel", "2", "--fail-route", "props") as url:
        [target] = await target_rails([RailsQuery(TARGET, "m", "llama.cpp", url)])
    assert target.live.state is ProbeState.FAILED
    assert target.live.rails is None
    assert target.rails is None and target.rails_source is None
    assert target.state == "probe_failed"
    assert "HTTP 500" in target.live.detail and "/props" in target.live.detail
    assert target.to_json()["rails"] is None


async def test_failed_probe_keeps_the_declared_figure_and_says_so() -> None:
    async with engine("--fail-route", "props") as url:
        [target] = await target_rails([RailsQuery(TARGET, "m", "llama.cpp", url, 2, "flags:-np")])
    assert (target.rails, target.rails_source) == (2, "registry")
    assert target.state == "probe_failed"
    assert target.agrees is None


async def test_unreachable_engine_is_probe_failed() -> None:
    live = await probe_rails(closed_port_url(), "llama.cpp")
    assert live.state is ProbeState.FAILED and live.rails is None


async def test_no_slots_route_reads_props_total_slots() -> None:
    async with engine("--parallel", "3", "--no-slots") as url:
        live = await probe_rails(url, "llama.cpp")
    assert (live.state, live.rails, live.source) == (ProbeState.OK, 3, "props")


async def test_no_slots_and_failing_props_is_probe_failed() -> None:
    async with engine("--parallel", "3", "--no-slots", "--fail-route", "props") as url:
        live = await probe_rails(url, "llama.cpp")
    assert live.state is ProbeState.FAILED and "/props" in live.detail


async def test_disagreement_uses_the_smaller_figure_and_is_named() -> None:
    async with engine("--parallel", "2") as url:
        [target] = await target_rails([RailsQuery(TARGET, "m", "llama.cpp", url, 1, None)])
    assert (target.rails, target.rails_source, target.agrees, target.state) == (
        1,
        "registry",
        False,
        "disagree",
    )
    warning = target.disagreement()
    assert warning is not None and "declares rails 1" in warning and "reports 2" in warning


async def test_agreement_credits_the_live_source() -> None:
    async with engine("--parallel", "2") as url:
        [target] = await target_rails([RailsQuery(TARGET, "m", "llama.cpp", url, 2, None)])
    assert (target.rails, target.rails_source, target.agrees) == (2, "props", True)
    assert target.disagreement() is None


async def test_vllm_without_max_num_seqs_is_unsupported_not_a_number() -> None:
    text = "vllm:num_requests_running 3\nvllm:num_requests_waiting 0\n"
    async with metrics_server(text) as url:
        live = await probe_rails(url, "vLLM")
    assert live.state is ProbeState.UNSUPPORTED and live.rails is None


@pytest.mark.parametrize(
    "text",
    ["vllm:max_num_seqs 8\n", 'vllm:scheduler_config_info{max_num_seqs="8"} 1\n'],
)
async def test_vllm_max_num_seqs_from_metrics(text: str) -> None:
    async with metrics_server(text) as url:
        live = await probe_rails(url, "vllm")
    assert (live.state, live.rails, live.source) == (ProbeState.OK, 8, "metrics")


async def test_bad_metric_value_is_probe_failed() -> None:
    async with metrics_server("strata:rails 0\n") as url:
        live = await probe_rails(url, "strata")
    assert live.state is ProbeState.FAILED and "rails" in live.detail


async def test_no_endpoint_is_not_probed() -> None:
    live = await probe_rails(None, "llama.cpp")
    assert live.state is ProbeState.NOT_PROBED


def test_engine_kinds() -> None:
    assert engine_kind("Llama.CPP") is EngineKind.LLAMA_CPP
    assert engine_kind("strata") is EngineKind.STRATA
    assert engine_kind("something") is EngineKind.OTHER


def test_queries_for_gives_one_per_target_with_declared_rails() -> None:
    def resident(model: str, endpoint: str) -> Resident:
        return Resident(
            model, "c", "gpu0", "llama.cpp", endpoint, "u", ResidentState.HOT, 1.0, 1.0, "t"
        )

    models = {"a": Model("a", "A", "llama.cpp", {}, rails=2, rails_source="flags")}
    queries = queries_for(
        [resident("a", "http://h:1"), resident("b", "http://h:1"), resident("b", "http://h:2")],
        models,
    )
    assert [(q.target_id, q.model, q.declared) for q in queries] == [
        ("gpu0:http://h:1", "a", 2),
        ("gpu0:http://h:2", "b", None),
    ]


def test_engine_flags_parse() -> None:
    options = parse_options(
        ["--port", "0", "--model-id", "m", "-np", "4", "--fail-route", "props", "--no-slots"]
    )
    assert (options.slots, options.fail_routes, options.no_slots) == (4, frozenset({"props"}), True)
    with pytest.raises(SystemExit):
        parse_options(["--port", "0", "--model-id", "m", "--fail-route", "health"])


# --------------------------------------------------------------------------- the gate's map


async def run_three(sems: TargetSemaphores, target: str) -> tuple[list[asyncio.Event], ...]:
    """Start three requests on ``target``; returns (entered, leave) events per request.

    The tasks end when their ``leave`` is set; every test sets them all."""
    entered = [asyncio.Event() for _ in range(3)]
    leave = [asyncio.Event() for _ in range(3)]

    async def request(index: int) -> None:
        async with sems.slot(target):
            entered[index].set()
            await leave[index].wait()

    for index in range(3):
        task = asyncio.create_task(request(index))
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)
    return entered, leave


def states(events: Sequence[asyncio.Event]) -> list[bool]:
    return [event.is_set() for event in events]


async def test_gate_sized_from_probed_rails_admits_two_and_the_third_waits() -> None:
    async with engine("--parallel", "2") as url:
        rows = await target_rails([RailsQuery(TARGET, "m", "llama.cpp", url)])
    sems = TargetSemaphores({row.target_id: row.rails for row in rows})
    assert sems.limit(TARGET) == 2
    entered, leave = await run_three(sems, TARGET)
    await until(lambda: sems.waiting(TARGET) == 1 and sems.active(TARGET) == 2)
    assert states(entered) == [True, True, False]
    leave[0].set()
    await until(lambda: entered[2].is_set())
    assert (sems.active(TARGET), sems.waiting(TARGET)) == (2, 0)
    leave[1].set()
    leave[2].set()
    await until(lambda: sems.active(TARGET) == 0)


async def test_gate_unknown_rails_run_one_at_a_time_and_targets_are_independent() -> None:
    sems = TargetSemaphores({TARGET: None})
    entered, leave = await run_three(sems, TARGET)
    other_entered, other_leave = await run_three(sems, "gpu1:http://127.0.0.1:2")
    await until(lambda: sems.waiting(TARGET) == 2 and sems.active("gpu1:http://127.0.0.1:2") == 1)
    assert states(entered) == [True, False, False]
    assert states(other_entered) == [True, False, False]
    sems.resize({TARGET: 3})  # the controller's answer arrives: waiters go in at once
    await until(lambda: all(states(entered)))
    for event in (*leave, *other_leave):
        event.set()
    await until(lambda: sems.active(TARGET) == 0 and sems.active("gpu1:http://127.0.0.1:2") == 0)


async def test_gate_cancelled_waiter_gives_its_turn_away() -> None:
    sems = TargetSemaphores({TARGET: 1})
    entered, leave = await run_three(sems, TARGET)
    await until(lambda: sems.waiting(TARGET) == 2)
    blocked = asyncio.create_task(_hold(sems, TARGET))
    await until(lambda: sems.waiting(TARGET) == 3)
    blocked.cancel()
    await asyncio.gather(blocked, return_exceptions=True)
    assert sems.waiting(TARGET) == 2
    for index in range(3):
        leave[index].set()
        await until(entered[index].is_set)
    await until(lambda: sems.active(TARGET) == 0)
    assert sems.snapshot()[TARGET] == {"rails": 1, "active": 0, "waiting": 0}


async def _hold(sems: TargetSemaphores, target: str) -> None:
    async with sems.slot(target):
        await asyncio.Event().wait()


def test_gate_unlimited_unknown_and_bad_unknown() -> None:
    assert TargetSemaphores(unknown=None).limit("x") is None
    with pytest.raises(ValueError, match="unknown"):
        TargetSemaphores(unknown=0)


def test_rails_map_reads_the_targets_route() -> None:
    payload = {
        "targets": [
            {"target_id": "gpu0:http://a", "rails": 2},
            {"target_id": "gpu0:http://b", "rails": None},
            {"target_id": "gpu0:http://c", "rails": True},
            {"target_id": "gpu0:http://d", "rails": 0},
            {"rails": 3},
        ]
    }
    assert rails_map(payload) == {
        "gpu0:http://a": 2,
        "gpu0:http://b": None,
        "gpu0:http://c": None,
        "gpu0:http://d": None,
    }
    assert rails_map({"targets": {}}) is None
    assert rails_map([]) is None


# --------------------------------------------------------------------------- the read-path cache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_cache_reuses_a_probe_until_the_targets_change_or_it_ages() -> None:
    def resident(endpoint: str) -> Resident:
        return Resident(
            "m", "c", "gpu0", "llama.cpp", endpoint, "u", ResidentState.HOT, 1.0, 1.0, "t"
        )

    clock = Clock()
    cache = RailsCache(ttl_s=10, clock=clock)
    models = {"m": Model("m", "M", "llama.cpp", {})}
    async with engine("--parallel", "2") as two, engine("--parallel", "3") as three:
        first = await cache.current([resident(two)], models)
        assert [row.rails for row in first] == [2]
        assert await cache.current([resident(two)], models) is first
        changed = await cache.current([resident(three)], models)
        assert [row.rails for row in changed] == [3]
        clock.now = 11
        assert await cache.current([resident(three)], models) is not changed


async def test_cache_reads_a_sleeping_engine_without_waking_it() -> None:
    """The read path (status, the shim's /metrics and /targets, the proxy's refresh) goes
    through :class:`RailsCache`: a sleeping llama.cpp stays asleep."""
    resident = Resident("m", "c", "cpu0", "llama.cpp", "", "u", ResidentState.HOT, 1.0, 1.0, "t")
    shapes = LlamaShapes(total_slots=2, asleep=True)
    async with llama(shapes) as url:
        rows = await RailsCache().current(
            [replace(resident, endpoint=url)], {"m": Model("m", "M", "llama.cpp", {})}
        )
    assert [(row.rails, row.rails_source) for row in rows] == [(2, "props")]
    assert shapes.hits["/slots"] == 0 and shapes.asleep


async def test_a_paused_target_shows_no_usable_rails_and_is_not_probed() -> None:
    """Issue 21 item 6: a paused resident's target has no rails (not the declared figure),
    and its engine is not asked; a target shared with a hot model is probed as before."""
    paused = Resident("m", "c", "gpu0", "llama.cpp", "", "u", ResidentState.PAUSED, 0.0, 1.0, "t")
    models = {"m": Model("m", "M", "llama.cpp", {}, rails=2, rails_source="flags")}
    shapes = LlamaShapes(total_slots=2)
    async with llama(shapes) as url:
        [row] = await RailsCache().current([replace(paused, endpoint=url)], models)
        assert (row.rails, row.rails_source, row.state, row.agrees) == (
            None,
            None,
            "not_probed",
            None,
        )
        assert "paused" in row.live.detail and row.to_json()["rails"] is None
        assert sum(shapes.hits.values()) == 0
        hot = replace(paused, model="h", endpoint=url, state=ResidentState.HOT)
        rows = await RailsCache().current([replace(paused, endpoint=url), hot], models)
    assert [(r.model, r.rails) for r in rows] == [("h", 2)]
