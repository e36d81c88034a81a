"""The CPU tier's memory truth and what the operator is shown (issue 19).

- the planner counts every resident at its measured footprint, whatever the probe shows
  it using now (docs/placement-rules.md §4.4): an engine asleep lends its memory, it
  does not free it;
- an option and a victim on ``cpu0`` show host RAM, not "0 MiB" (§4.5);
- a resident whose engine sleeps on its own is shown asleep and stays ``hot`` (§4.2,
  "Asleep is not paused"), asked through ``/props``, never ``/slots``;
- the host going below its reserve is a ``below_reserve`` alert, once per crossing.
"""

from __future__ import annotations

import io
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web
from http_fixtures import closed_port_url, serving
from llama_shapes import LlamaShapes
from rich.console import Console
from sink_fakes import ListSink

from tests.worlds import builders
from tests.worlds.builders import MEASURED_AT, cpu, cpu_reading, measured
from uapplace.cli import render
from uapplace.controller.reserve import ReserveWatch, device_rooms
from uapplace.core.alerts import Alert, AlertBoard, AlertKind, Severity
from uapplace.core.model import (
    Device,
    DeviceKind,
    DeviceReading,
    Holder,
    Model,
    OptionKind,
    ProbeSource,
    Registry,
    Resident,
    ResidentState,
)
from uapplace.core.planner import PlanInput, host_room, plan, plan_unload
from uapplace.core.victims import victim_of
from uapplace.daemon.notify import recommendation_text
from uapplace.publish.publication import SleepWatch, engine_asleep

HOST = cpu(total=4_000, reserved=200)


def model(key: str, host_mib: float, **fields: Any) -> Model:
    config = measured(f"{key}-c", 0.0, host_mib=host_mib, on="cpu0")
    return Model(
        key,
        key,
        "llama.cpp",
        {config.key: replace(config, **fields)},
        unit=f"uap-{key}",
        endpoint=f"http://127.0.0.1:1{len(key)}00",
    )


def registry(*models: Model, host: Device = HOST) -> Registry:
    return Registry({host.key: host}, {m.key: m for m in models})


def resident(
    model_key: str,
    host_mib: float | None,
    *,
    state: ResidentState = ResidentState.HOT,
    asleep: bool = False,
    holders: tuple[Holder, ...] = (),
    endpoint: str | None = None,
) -> Resident:
    return Resident(
        model=model_key,
        config=f"{model_key}-c",
        device="cpu0",
        engine="llama.cpp",
        endpoint=endpoint,
        unit=f"uap-{model_key}.service",
        state=state,
        gpu_mib=0.0,
        host_rss_mib=host_mib,
        since=MEASURED_AT,
        holders=holders,
        asleep=asleep,
    )


def reading(free_mib: float, total_mib: float = 4_000) -> dict[str, DeviceReading]:
    return {"cpu0": cpu_reading(total_mib, free_mib)}


SLEEPER = model("sleeper", 833.0)
"""Measured at 833 MiB: a llama-server that sleeps down to ~20 MiB (issue 19)."""
BIG = model("big", 3_000.0)
FITS = model("fits", 2_900.0)
ASLEEP = resident("sleeper", 833.0, asleep=True)
"""Asleep, the sleeper holds ~20 MiB: the probe reads 3,700 MiB free of 4,000."""


# --------------------------------------------------------------------------- the planner


def test_an_engine_asleep_lends_its_memory_it_never_becomes_load_alongside() -> None:
    """The probe alone would offer ``load_alongside`` (3,700 − 200 = 3,500 ≥ 3,000);
    counted at its measured 833 MiB the sleeper leaves 2,967: big must displace it."""
    inp = PlanInput(registry(SLEEPER, BIG), [ASLEEP], reading(3_700))
    result = plan(inp, "big")
    assert [o.kind for o in result.options] == [OptionKind.DISPLACE]
    (option,) = result.options
    assert [v.signature for v in option.victims] == ["sleeper/sleeper-c"]
    assert (option.on_host, option.host_mib, option.cost_mib) == (True, 3_000.0, 0.0)
    assert option.frees_host_mib == 833.0


def test_what_fits_by_measured_footprints_still_loads_alongside() -> None:
    inp = PlanInput(registry(SLEEPER, FITS), [ASLEEP], reading(3_700))
    (option,) = plan(inp, "fits").options
    assert (option.kind, option.host_mib, option.device_kind) == (
        OptionKind.LOAD_ALONGSIDE,
        2_900.0,
        DeviceKind.CPU,
    )
    assert option.to_json()["device_kind"] == "cpu"


def test_the_refusal_says_the_residents_footprints_are_what_limits_the_room() -> None:
    held = (Holder("eval", "hold", "nightly"),)
    inp = PlanInput(registry(SLEEPER, BIG), [replace(ASLEEP, holders=held)], reading(3_700))
    result = plan(inp, "big")
    assert result.options == ()
    (line,) = result.infeasible
    assert line.startswith("cpu0: host RAM 3000 MiB needed, 2967 MiB available above the 200")
    assert "residents counted at their measured footprints: 4000 total − 200 reserved" in line
    assert "833 held by 1 resident(s); the probe reads 3700 MiB free" in line
    assert "held by eval: nightly" in line


def test_the_room_is_the_lesser_of_the_probe_and_the_measured_footprints() -> None:
    # A shared host whose free memory swung down: the probe wins; it can only lower the room.
    swung = host_room(HOST, reading(1_000)["cpu0"], [ASLEEP])
    assert (swung.by_probe, swung.by_footprints, swung.mib) == (800, 2_967, 800)
    assert swung.text() == "800 MiB available above the 200 MiB reserve"
    # Asleep, the probe says 3,500; the footprints 2,967.
    asleep = host_room(HOST, reading(3_700)["cpu0"], [ASLEEP])
    assert asleep.mib == 2_967
    # A resident with no measured host figure counts 0 in the sum (the probe sees it).
    assert host_room(HOST, reading(3_700)["cpu0"], [resident("x", None)]).mib == 3_500
    inp = PlanInput(registry(SLEEPER, FITS), [ASLEEP], reading(1_000))
    result = plan(inp, "fits")  # 800 MiB, +833 if the sleeper goes, is not 2,900
    assert result.options == ()
    assert "800 MiB available above the 200 MiB reserve" in result.infeasible[0]


# --------------------------------------------------------------------------- what a preview shows


def test_a_cpu_victim_shows_the_host_ram_it_frees() -> None:
    inp = PlanInput(registry(SLEEPER, BIG), [ASLEEP], reading(3_700))
    (option,) = plan(inp, "big").options
    (victim,) = option.victims
    assert (victim.device_kind, victim.frees_mib, victim.frees_host_mib) == (
        DeviceKind.CPU,
        0.0,
        833.0,
    )
    assert victim.reload_mib == 833.0  # its host RAM, not its (absent) GPU figure
    shown = victim.to_json()
    assert (shown["frees_host_mib"], shown["device_kind"]) == (833.0, "cpu")
    as_json = option.to_json()
    assert (as_json["host_mib"], as_json["frees_host_mib"], as_json["cost_mib"]) == (
        3_000.0,
        833.0,
        0.0,
    )
    (unloaded,) = plan_unload(inp, "sleeper")
    assert unloaded.frees_host_mib == 833.0


def test_a_cpu_victims_consequence_names_host_ram() -> None:
    reg = registry(SLEEPER)
    warming = victim_of(reg, resident("sleeper", 833.0, state=ResidentState.WARMING), True)
    assert warming.consequence == "load wasted; host RAM returns on stop"
    unknown = victim_of(reg, resident("sleeper", None), True)
    assert unknown.consequence.endswith("; host RAM it frees is unknown (footprint not measured)")


@pytest.fixture
def shown(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """What ``render`` prints to stdout, as text."""
    text = io.StringIO()
    console = Console(file=text, width=200, highlight=False, soft_wrap=True)
    monkeypatch.setattr(render, "out", console)
    yield text


def test_the_preview_and_the_impact_say_host_ram_on_cpu0(shown: io.StringIO) -> None:
    inp = PlanInput(registry(SLEEPER, BIG), [ASLEEP], reading(3_700))
    found = plan(inp, "big").to_json()
    render.print_preview(found)
    line = shown.getvalue().splitlines()[1]
    assert "displace big/big-c on cpu0, costs 3,000 MiB of host RAM" in line
    assert "frees 833 MiB of host RAM" in line
    assert "costs 0 MiB" not in line and "frees 0 MiB" not in line
    impact = io.StringIO()
    victims = found["options"][0]["victims"]
    console = Console(file=impact, width=200, highlight=False)
    render.show_impact(console, "apply", victims, found["options"][0]["frees_mib"])
    assert "833 MiB of host RAM" in impact.getvalue()
    assert "Frees 833 MiB of host RAM in total." in impact.getvalue()


def test_the_notification_says_host_ram_on_cpu0() -> None:
    displace = PlanInput(registry(SLEEPER, BIG), [ASLEEP], reading(3_700))
    (option,) = plan(displace, "big").options
    assert recommendation_text(option).startswith("load big/big-c on cpu0 — stops sleeper")
    assert "frees 833 MiB of host RAM" in recommendation_text(option)
    alongside = PlanInput(registry(SLEEPER, FITS), [ASLEEP], reading(3_700))
    (option,) = plan(alongside, "fits").options
    assert "nothing is stopped, needs 2,900 MiB of host RAM" in recommendation_text(option)


def test_status_shows_an_asleep_resident_and_each_devices_room(shown: io.StringIO) -> None:
    render.print_status(
        {
            "devices": {
                "cpu0": {
                    "kind": "cpu",
                    "total_mib": 4_000,
                    "free_mib": 3_700,
                    "reserved_mib": 200,
                    "room_mib": 2_967,
                    "source": "MemAvailable",
                }
            },
            "residents": [
                {
                    "model": "sleeper",
                    "config": "sleeper-c",
                    "device": "cpu0",
                    "state": "hot",
                    "asleep": True,
                    "gpu_mib": 0,
                    "host_rss_mib": 833,
                    "holders": [],
                }
            ],
        }
    )
    text = shown.getvalue()
    assert "hot (asleep)" in text
    assert "2,967 MiB" in text and "833 MiB" in text


# --------------------------------------------------------------------------- below the reserve


class Board:
    def __init__(self) -> None:
        self.raised: list[Alert] = []
        self.board = AlertBoard(lambda: 0.0, self.raised.append)


def test_the_host_below_its_reserve_raises_one_alert_per_crossing() -> None:
    board = Board()
    watch = ReserveWatch(board.board)
    reg = registry(SLEEPER)
    assert watch.check(reg, [ASLEEP], reading(3_700)) == frozenset()
    # It woke, and something else grew: 150 MiB free, under the 200 MiB reserve.
    assert watch.check(reg, [ASLEEP], reading(150)) == {"cpu0"}
    assert watch.check(reg, [ASLEEP], reading(120)) == {"cpu0"}  # still below: no new raise
    (alert,) = board.raised
    assert (alert.kind, alert.severity, alert.subject) == (
        AlertKind.BELOW_RESERVE,
        Severity.WARNING,
        "cpu0",
    )
    assert "the probe reads 150 MiB free, 50 MiB below the 200 MiB reserve" in alert.message
    assert alert.detail["held_mib"] == 833.0
    assert watch.check(reg, [ASLEEP], reading(3_700)) == frozenset()  # back above
    # A re-measure found it bigger than recorded: the footprints say it now.
    bigger = replace(ASLEEP, host_rss_mib=3_900.0)
    assert watch.check(reg, [bigger], reading(3_700)) == {"cpu0"}
    assert len(board.raised) == 2
    assert "at their measured footprints hold 3900 MiB of 4000" in board.raised[1].message
    unreadable = {"cpu0": replace(cpu_reading(0, 0), source=ProbeSource.ABSENT)}
    assert watch.check(reg, [bigger], unreadable) == {"cpu0"}  # left as it was


def test_each_devices_room_is_the_planners_count() -> None:
    gpu = builders.gpu(reserved=1_024)
    reg = Registry({"gpu0": gpu, "cpu0": HOST}, {})
    on_gpu = replace(ASLEEP, device="gpu0", gpu_mib=8_000.0)
    rooms = device_rooms(reg, [ASLEEP, on_gpu], reading(3_700))
    assert rooms == {"gpu0": 24_576 - 1_024 - 8_000, "cpu0": 4_000 - 200 - 2 * 833}
    unknown = replace(on_gpu, gpu_mib=None)
    assert "gpu0" not in device_rooms(reg, [unknown], reading(3_700))


# --------------------------------------------------------------------------- asleep is shown


def answering(
    answers: dict[str, bool | None],
) -> tuple[Callable[[Registry, Resident, float], Awaitable[bool | None]], list[str]]:
    asked: list[str] = []

    async def probe(reg: Registry, resident: Resident, http_s: float) -> bool | None:
        asked.append(resident.model)
        return answers.get(resident.model)

    return probe, asked


async def test_a_sleeping_engine_is_shown_asleep_and_stays_hot() -> None:
    reg = registry(SLEEPER, FITS, BIG)
    awake = resident("sleeper", 833.0)
    silent = resident("fits", 2_900.0)
    stale = resident("big", 3_000.0, state=ResidentState.WARMING, asleep=True)
    host = ListSink(reg, [awake, silent, stale])
    answers: dict[str, bool | None] = {"sleeper": True, "fits": None, "big": True}
    probe, asked = answering(answers)
    watch = SleepWatch(host, probe=probe)
    changed = await watch.check_once()
    assert sorted(asked) == ["fits", "sleeper"]  # only hot residents are asked
    by_model = {r.model: r for r in host.list}
    assert (by_model["sleeper"].state, by_model["sleeper"].asleep) == (ResidentState.HOT, True)
    assert by_model["fits"].asleep is False  # cannot say: left as shown
    assert by_model["big"].asleep is False  # a stale flag on a resident that is not hot
    assert sorted(r.model for r in changed) == ["big", "sleeper"]
    assert await watch.check_once() == []  # nothing new
    answers["sleeper"] = False
    (woke,) = await watch.check_once()
    assert (woke.model, woke.asleep, woke.state) == ("sleeper", False, ResidentState.HOT)


async def test_sleep_is_read_from_props_and_slots_is_never_asked() -> None:
    shapes = LlamaShapes(asleep=True)
    async with serving(shapes.app()) as url:
        sleeper = resident("sleeper", 833.0, endpoint=url)
        assert await engine_asleep(registry(SLEEPER), sleeper, 2.0) is True
        shapes.asleep = False
        assert await engine_asleep(registry(SLEEPER), sleeper, 2.0) is False
        shapes.no_props_route = True  # an engine without /props cannot say
        assert await engine_asleep(registry(SLEEPER), sleeper, 2.0) is None
    assert shapes.hits["/slots"] == 0
    assert shapes.hits["/props"] == 3
    gone = resident("sleeper", 833.0, endpoint=closed_port_url())
    assert await engine_asleep(registry(SLEEPER), gone, 0.5) is None
    assert await engine_asleep(registry(SLEEPER), resident("sleeper", 833.0), 0.5) is None


async def test_a_router_models_sleep_is_its_status_in_the_router() -> None:
    routed = model("tiny-a", 30.0, pause_lever="llamacpp-router")
    status = {"value": "sleeping"}
    asked: list[str] = []

    async def models(request: web.Request) -> web.Response:
        asked.append(request.path)
        entry = {"id": "tiny-a", "aliases": [], "status": dict(status)}
        return web.json_response({"data": [entry], "object": "list"})

    app = web.Application()
    app.router.add_get("/models", models)
    async with serving(app) as url:
        child = resident("tiny-a", 30.0, endpoint=url)
        assert await engine_asleep(registry(routed), child, 2.0) is True
        status["value"] = "loaded"
        assert await engine_asleep(registry(routed), child, 2.0) is False
    assert asked == ["/models", "/models"]  # never /slots or /props without autoload=false
