"""The serving re-check's decisions (issue 20, "Serving means serving, continuously").

A ``hot`` resident is looked at on a cadence (docs/placement-rules.md §4.2, "Serving is
re-checked"): asleep the way no request undoes (vLLM ``/is_sleeping``), gone (twice) or
serving another id → unpublished (``warming``), a ``not_serving`` alert, handed back to
its publisher; asleep on its own (llama.cpp ``/props``) → shown asleep, still ``hot``;
a memory collapse in the probe → unpublished only when the engine cannot say it sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from http_fixtures import closed_port_url, serving
from sink_fakes import ListSink
from test_engine_sleep import sleepy_engine

from tests.worlds.builders import MEASURED_AT, gpu, gpu_reading, measured
from uapplace.core.alerts import AlertKind, Severity
from uapplace.core.model import (
    DeviceReading,
    Model,
    ProbeSource,
    ProcessUsage,
    Registry,
    Resident,
    ResidentState,
)
from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.timeouts import Timeouts
from uapplace.io import engines
from uapplace.publish.publication import (
    NotServing,
    ServingLook,
    SleepWatch,
    decide_serving,
    held_mib,
    look_serving,
    memory_collapsed,
    verify_until_ok,
)
from uapplace.sim.gpu import SimGpu

GPU = gpu()


def model(key: str, **fields: Any) -> Model:
    config = replace(measured(f"{key}-c", 4_000.0), **fields)
    return Model(key, key, "vllm", {config.key: config}, unit=f"uap-{key}")


def registry(*models: Model) -> Registry:
    return Registry({GPU.key: GPU}, {m.key: m for m in models})


def resident(
    key: str,
    *,
    endpoint: str | None = None,
    state: ResidentState = ResidentState.HOT,
    asleep: bool = False,
    pid: int | None = None,
) -> Resident:
    return Resident(
        model=key,
        config=f"{key}-c",
        device="gpu0",
        engine="vllm",
        endpoint=endpoint,
        unit=f"uap-{key}.service",
        state=state,
        gpu_mib=4_000.0,
        host_rss_mib=1_000.0,
        since=MEASURED_AT,
        main_pid=pid,
        asleep=asleep,
    )


class Host(ListSink):
    """A ResidentSink over a list, with a probe reading that tests set."""

    def __init__(self, reg: Registry, residents: Sequence[Resident]) -> None:
        super().__init__(reg, residents)
        self.processes: tuple[ProcessUsage, ...] = ()

    async def read_devices(self) -> Mapping[str, DeviceReading]:
        used = sum(p.used_mib for p in self.processes)
        reading = gpu_reading(
            24_576, 24_576 - used, source=ProbeSource.NVML, processes=self.processes
        )
        return {"gpu0": reading}

    def by_model(self) -> dict[str, Resident]:
        return {r.model: r for r in self.list}


def scripted(looks: dict[str, list[ServingLook]], asked: list[str]) -> Any:
    """A look that answers each model's scripted looks in turn (the last one repeats)."""

    async def look(reg: Registry, res: Resident, http_s: float) -> ServingLook:
        asked.append(res.model)
        queue = looks[res.model]
        return queue.pop(0) if len(queue) > 1 else queue[0]

    return look


# --------------------------------------------------------------------------- decisions


def test_every_problem_the_engine_shows_unpublishes_it() -> None:
    hot = resident("alpha")
    for problem in NotServing:
        decision = decide_serving(hot, ServingLook(problem=problem, detail="x"), False)
        assert (decision.unpublish, decision.detail) == (problem, "x")


def test_a_memory_collapse_unpublishes_only_an_engine_that_cannot_say_it_sleeps() -> None:
    hot = resident("alpha")
    assert decide_serving(hot, ServingLook(), True).unpublish is NotServing.MEMORY_GONE
    awake = decide_serving(hot, ServingLook(asleep=False), True)
    assert (awake.unpublish, awake.asleep) == (None, False)
    asleep = decide_serving(hot, ServingLook(asleep=True), True)
    assert (asleep.unpublish, asleep.asleep) == (None, True), "llama.cpp idle sleep"
    assert decide_serving(hot, ServingLook(), False).unpublish is None


def test_the_asleep_flag_follows_the_engine_and_stays_when_it_cannot_say() -> None:
    shown = resident("alpha", asleep=True)
    assert decide_serving(shown, ServingLook(), False).asleep is True
    assert decide_serving(shown, ServingLook(asleep=False), False).asleep is False


def test_memory_collapse_needs_a_real_figure_before() -> None:
    assert memory_collapsed(4_000.0, 1_000.0)
    assert memory_collapsed(4_000.0, 0.0)
    assert not memory_collapsed(4_000.0, 1_001.0)
    assert not memory_collapsed(None, 0.0)
    assert not memory_collapsed(8.0, 0.0), "below MIN_TRACKED_MIB: noise"
    assert not memory_collapsed(4_000.0, None)


def test_held_mib_counts_only_the_residents_pids() -> None:
    processes = (ProcessUsage(10, 3_000.0), ProcessUsage(11, 500.0), ProcessUsage(99, 7.0))
    reading = gpu_reading(24_576, 0, source=ProbeSource.NVML, processes=processes)
    assert held_mib({"gpu0": reading}, "gpu0", [10, 11]) == 3_500.0
    assert held_mib({"gpu0": reading}, "gpu0", [12]) == 0.0
    assert held_mib({"gpu0": reading}, "gpu0", []) is None
    assert held_mib({"gpu0": reading}, "gpu1", [10]) is None
    absent = replace(reading, source=ProbeSource.ABSENT)
    assert held_mib({"gpu0": absent}, "gpu0", [10]) is None


def test_the_bound_is_one_period_and_two_looks() -> None:
    timeouts = Timeouts(serving_check_s=1.0, http_s=0.5)
    assert timeouts.serving_bound_s() == 1.0 + 1.5 + 0.5 + 1.5


def test_the_cadence_is_read_from_the_timeouts_file_within_its_range(tmp_path: Path) -> None:
    path = tmp_path / "enforcement-timeouts.json"
    path.write_text('{"serving_check_s": 0.5}', encoding="utf-8")
    path.chmod(0o600)
    assert Timeouts.load(path).serving_check_s == 0.5
    path.write_text('{"serving_check_s": 600}', encoding="utf-8")
    with pytest.raises(ConfigFileError) as raised:
        Timeouts.load(path)
    assert "serving_check_s" in str(raised.value)


# --------------------------------------------------------------------------- the watch


async def test_an_engine_asleep_for_good_is_unpublished_alerted_and_handed_back() -> None:
    host = Host(registry(model("alpha"), model("beta")), [resident("alpha"), resident("beta")])
    asked: list[str] = []
    looks = {
        "alpha": [ServingLook(problem=NotServing.ASLEEP, detail="/is_sleeping true")],
        "beta": [ServingLook(asleep=False)],
    }
    handed: list[Resident] = []
    watch = SleepWatch(host, look=scripted(looks, asked), on_unpublished=handed.append)
    (changed,) = await watch.check_once()
    alpha = host.by_model()["alpha"]
    assert (changed, alpha.state) == (alpha, ResidentState.WARMING)
    assert host.by_model()["beta"].state is ResidentState.HOT
    assert handed == [alpha]
    (alert,) = host.alert_board.active()
    assert (alert.kind, alert.severity, alert.subject) == (
        AlertKind.NOT_SERVING,
        Severity.WARNING,
        "uap-alpha.service",
    )
    assert "does not wake on a request (/is_sleeping true)" in alert.message
    assert "park `warming`" in alert.message
    assert alert.detail["problem"] == "asleep"

    asked.clear()
    await watch.check_once()
    assert asked == ["beta"], "a warming resident is not looked at"
    host.put_resident(replace(alpha, state=ResidentState.HOT))  # its publisher verified it
    looks["alpha"] = [ServingLook(asleep=False)]
    assert await watch.check_once() == []
    (again,) = host.alert_board.active()
    assert (again.severity, again.detail["published"]) == (Severity.INFO, True)
    assert "serves again: re-published hot" in again.message


async def test_a_silent_engine_is_asked_twice_before_it_is_unpublished() -> None:
    host = Host(registry(model("alpha")), [resident("alpha")])
    asked: list[str] = []
    gone = ServingLook(problem=NotServing.GONE, detail="/health is not 200 yet")
    looks = {"alpha": [gone, ServingLook(asleep=False)]}
    watch = SleepWatch(host, look=scripted(looks, asked), confirm_s=0.01)
    assert await watch.check_once() == []
    assert (asked, host.by_model()["alpha"].state) == (["alpha", "alpha"], ResidentState.HOT)
    looks["alpha"] = [gone]
    (changed,) = await watch.check_once()
    assert changed.state is ResidentState.WARMING
    assert host.alert_board.active()[0].detail["problem"] == "gone"


async def test_a_memory_collapse_unpublishes_an_engine_that_cannot_say() -> None:
    host = Host(registry(model("alpha")), [resident("alpha", pid=10)])
    host.processes = (ProcessUsage(10, 4_000.0),)
    looks = {"alpha": [ServingLook()]}
    watch = SleepWatch(host, look=scripted(looks, []))
    assert await watch.check_once() == []  # the first figure is only remembered
    host.processes = (ProcessUsage(10, 200.0),)
    (changed,) = await watch.check_once()
    assert changed.state is ResidentState.WARMING
    assert host.alert_board.active()[0].detail["problem"] == "memory_gone"


async def test_an_engine_that_sleeps_on_its_own_stays_hot_and_is_shown_asleep() -> None:
    host = Host(registry(model("alpha")), [resident("alpha", pid=10)])
    host.processes = (ProcessUsage(10, 4_000.0),)
    looks = {"alpha": [ServingLook(asleep=False)]}
    watch = SleepWatch(host, look=scripted(looks, []))
    await watch.check_once()
    host.processes = (ProcessUsage(10, 20.0),)
    looks["alpha"] = [ServingLook(asleep=True)]
    (changed,) = await watch.check_once()
    assert (changed.state, changed.asleep) == (ResidentState.HOT, True)
    assert host.alert_board.active() == []


async def test_a_poke_re_checks_before_the_period() -> None:
    host = Host(registry(model("alpha")), [resident("alpha")])
    asked: list[str] = []
    watch = SleepWatch(host, every_s=60.0, look=scripted({"alpha": [ServingLook()]}, asked))
    watch.start()
    try:
        watch.poke()
        for _ in range(100):
            if asked:
                break
            await asyncio.sleep(0.01)
        assert asked == ["alpha"]
    finally:
        await watch.close()


async def test_a_memory_collapse_between_two_rounds_is_a_sign_that_re_checks_at_once() -> None:
    host = Host(registry(model("alpha")), [resident("alpha", pid=10)])
    host.processes = (ProcessUsage(10, 4_000.0),)
    asked: list[str] = []
    watch = SleepWatch(
        host, every_s=60.0, look=scripted({"alpha": [ServingLook()]}, asked), memory_tick_s=0.02
    )
    assert await watch.memory_sign() is False, "no baseline before a first round"
    await watch.check_once()
    assert await watch.memory_sign() is False
    host.processes = (ProcessUsage(10, 100.0),)
    assert await watch.memory_sign() is True
    watch.start()
    try:
        for _ in range(200):
            if host.by_model()["alpha"].state is ResidentState.WARMING:
                break
            await asyncio.sleep(0.01)
        assert asked == ["alpha", "alpha"], "one round, at once, not after the 60 s period"
        assert host.by_model()["alpha"].state is ResidentState.WARMING
    finally:
        await watch.close()


# --------------------------------------------------------------------------- looking at engines


class Engine:
    """``/health``, ``/v1/models``, ``/props`` and vLLM's ``/is_sleeping``, as set."""

    def __init__(self, served: str) -> None:
        self.served = served
        self.props_asleep: bool | None = False
        self.vllm_asleep: bool | None = None
        self.hits: dict[str, int] = {}
        self.app = web.Application()
        for path, handler in (
            ("/health", self.health),
            ("/v1/models", self.models),
            ("/props", self.props),
            ("/is_sleeping", self.is_sleeping),
            ("/slots", self.slots),
        ):
            self.app.router.add_get(path, handler)

    def _hit(self, request: web.Request) -> None:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1

    async def health(self, request: web.Request) -> web.Response:
        self._hit(request)
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        self._hit(request)
        return web.json_response({"object": "list", "data": [{"id": self.served}]})

    async def props(self, request: web.Request) -> web.Response:
        self._hit(request)
        body: dict[str, Any] = {"total_slots": 1}
        if self.props_asleep is not None:
            body["is_sleeping"] = self.props_asleep
        return web.json_response(body)

    async def is_sleeping(self, request: web.Request) -> web.Response:
        self._hit(request)
        if self.vllm_asleep is None:
            return web.json_response({"error": "not found"}, status=404)
        return web.json_response({"is_sleeping": self.vllm_asleep})

    async def slots(self, request: web.Request) -> web.Response:
        self._hit(request)
        return web.json_response([])


async def test_look_serving_tells_each_case_apart_and_never_asks_slots() -> None:
    reg = registry(model("alpha"))
    engine = Engine("alpha")
    async with serving(engine.app) as url:
        hot = resident("alpha", endpoint=url)
        assert await look_serving(reg, hot, 2.0) == ServingLook(asleep=False)
        engine.props_asleep = True  # llama.cpp idle sleep: shown, still serving
        assert await look_serving(reg, hot, 2.0) == ServingLook(asleep=True)
        engine.props_asleep, engine.vllm_asleep = None, True  # vLLM POST /sleep
        look = await look_serving(reg, hot, 2.0)
        assert look.problem is NotServing.ASLEEP
        assert "does not wake on a request" in look.detail
        engine.vllm_asleep = None  # an engine that cannot say
        assert await look_serving(reg, hot, 2.0) == ServingLook(asleep=None)
        engine.served = "other"
        assert (await look_serving(reg, hot, 2.0)).problem is NotServing.WRONG_ID
    assert engine.hits.get("/slots", 0) == 0
    gone = resident("alpha", endpoint=closed_port_url())
    assert (await look_serving(reg, gone, 0.5)).problem is NotServing.GONE
    assert await look_serving(reg, resident("alpha"), 0.5) == ServingLook()


async def test_reverification_after_an_unpublish_waits_until_the_engine_is_awake() -> None:
    reg = registry(model("alpha"))  # no pause lever declared: only ask_sleep looks
    engine = Engine("alpha")
    engine.props_asleep, engine.vllm_asleep = None, True
    host = Host(reg, [])
    slept: list[float] = []

    async def pause(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 3:
            engine.vllm_asleep = False

    async with serving(engine.app) as url:
        warming = resident("alpha", endpoint=url, state=ResidentState.WARMING)
        host.put_resident(warming)

        async def verify(*, ask_sleep: bool) -> Resident | None:
            return await verify_until_ok(
                host,
                warming,
                "uap-alpha.service",
                lambda: host.by_model().get("alpha"),
                first_poll_s=0.01,
                max_poll_s=0.02,
                http_s=2.0,
                sleep=pause,
                ask_sleep=ask_sleep,
            )

        verified = await verify(ask_sleep=True)
        assert verified is not None and len(slept) == 3
        engine.vllm_asleep = True  # without ask_sleep a config with no lever is not asked
        plain = await verify(ask_sleep=False)
        assert plain is not None and len(slept) == 3


async def test_the_fake_engine_in_sleep_mode_stands_for_vllm(tmp_path: Path) -> None:
    """Its ``POST /sleep`` shows in ``/is_sleeping`` only: a ``/props`` ``is_sleeping``
    would pass it off as llama.cpp's idle sleep, which a request undoes."""
    gpu = SimGpu(tmp_path / "gpu.json")
    gpu.create([("", 4096)])
    reg = registry(model("qwen"))
    async with sleepy_engine(gpu) as (url, _engine):
        assert "is_sleeping" not in await engines.props(url)
        hot = replace(resident("qwen", endpoint=url), config="qwen-c")
        assert await look_serving(reg, hot, 2.0) == ServingLook(asleep=False)
        await engines.sleep(url, 1, timeout=5)
        assert "is_sleeping" not in await engines.props(url)
        state = await engines.sleep_state(url)
        assert state is not None and (state.asleep, state.source) == (True, "is_sleeping")
        assert (await look_serving(reg, hot, 2.0)).problem is NotServing.ASLEEP
