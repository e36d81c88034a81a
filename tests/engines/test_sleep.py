"""A llama-server that sleeps on its own, under uapplace: shown asleep, never woken by
us, never counted as free memory (issue 19, "Idle sleep is invisible and undone by us").

The world: ``sleepy`` (tiny-c) runs with ``--sleep-idle-seconds 1`` and is adopted as a
resident; ``beta`` (tiny-a) is stopped. Both are recorded at 100 MiB measured
(``host_rss_mib``), and ``cpu0``'s budget is the reserve plus 150 MiB: the two do not fit
side by side by their measured footprints, although asleep, sleepy's process holds about
20 MiB, so by its live RSS (or the host's free memory) beta would fit beside it.

- ``test_an_asleep_resident_is_shown_asleep_and_nothing_of_ours_wakes_it``: the
  ``SleepWatch`` (``GET /props`` ``is_sleeping`` every 5 s) shows it ``asleep: true`` in
  ``GetState`` and ``hot (asleep)`` in ``uapplace status``, still ``hot``; a minute's worth
  of uapplace activity compressed into a few seconds (``status``, ``GetState``, the shim's
  ``/metrics`` and ``/api/placement/targets``, a Preview of beta, and a whole period of
  the watch's own polls) leaves it asleep: its log never says ``exiting sleeping state``
  and its RSS stays low. Admission still forwards to it; a client's completions wake it
  (llama.cpp does that itself), and ``asleep`` clears within the watch's period.
- ``test_the_memory_an_asleep_resident_gave_back_is_not_offered_as_free``: a request for
  beta is offered only the displacement of sleepy, never ``load_alongside``; the
  preview and the impact shown before consent count host RAM (``100 MiB of host RAM``),
  not ``0 MiB``; looking at the impact does not wake sleepy either.

docs/placement-rules.md §4.2 ("Asleep is not paused"), §4.4 (the host's room), §4.5
(host MiB on the CPU tier). A wake is seen in the engine's own log rather than only in
``/props``: a server woken by a stray ``GET /slots`` falls asleep again a second later,
which polling ``/props`` could miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from tests.worlds.llama import LlamaModel, LlamaWorld, rss_mib
from uapplace.publish.publication import SLEEP_CHECK_S

RESERVED_MIB = 256
BUDGET_MIB = 150
"""``cpu0`` above its reserve: one 100 MiB model, not two."""
MODEL_MIB = 100.0
SLEEPY = LlamaModel("sleepy", "tiny-c", sleep_idle_s=1, started=True, host_rss_mib=MODEL_MIB)
BETA = LlamaModel("beta", "tiny-a", host_rss_mib=MODEL_MIB)
WORLD = (SLEEPY, BETA)
WAKES = "server is exiting sleeping state"
"""What llama-server logs once each time it wakes (``handle_sleep``)."""
SLEEPS = "server is entering sleeping state"
AWAKE_MARGIN_MIB = 20.0
"""tiny-c awake holds its weights (70-78 MiB RSS here), asleep about 20 MiB."""
CLEAR_SLACK_S = 2.5
"""Beyond one watch period: the probe's own time and the poll of GetState, on a loaded host."""

pytestmark = [pytest.mark.engines, pytest.mark.parametrize("world_models", [WORLD], indirect=True)]


@pytest.fixture
def world_options() -> dict[str, Any]:
    return {"cpu_total_mib": RESERVED_MIB + BUDGET_MIB, "cpu_reserved_mib": RESERVED_MIB}


async def resident_row(world: LlamaWorld, key: str) -> dict[str, Any]:
    """``key``'s resident as ``GetState`` shows it."""
    rows = [row for row in (await world.state())["residents"] if row["model"] == key]
    assert len(rows) == 1, rows
    row: dict[str, Any] = rows[0]
    return row


async def wait_shown_asleep(world: LlamaWorld, key: str, asleep: bool = True) -> float:
    """Until ``GetState`` shows ``key`` asleep (or not); the seconds it took."""
    started = time.monotonic()

    async def shown() -> bool:
        return (await resident_row(world, key)).get("asleep", False) is asleep

    await world.until(f"GetState to show {key} {'asleep' if asleep else 'awake'}", shown)
    return time.monotonic() - started


def wakes(world: LlamaWorld, key: str) -> int:
    return world.engine_log(key).count(WAKES)


async def still_asleep(world: LlamaWorld, key: str, pid: int, what: str) -> float:
    """After ``what``: the engine's ``/props`` says asleep; its RSS, read now."""
    props = await world.props(key)
    assert props["is_sleeping"] is True, f"{what} woke {key}"
    return rss_mib(pid)


async def uapplace_activity(world: LlamaWorld, pid: int) -> list[float]:
    """One round of what uapplace does to an asleep resident; sleepy's RSS after each."""
    rss: list[float] = []
    status = await world.cli("status")
    assert status.returncode == 0, status.stderr
    assert "hot (asleep)" in status.stdout, status.stdout
    rss.append(await still_asleep(world, "sleepy", pid, "uapplace status"))

    row = await resident_row(world, "sleepy")
    assert (row["state"], row.get("asleep")) == ("hot", True), row
    rss.append(await still_asleep(world, "sleepy", pid, "GetState"))

    async with world.http.get(world.shim.base_url + "/metrics") as reply:
        assert reply.status == 200, await reply.text()
        await reply.read()
    rss.append(await still_asleep(world, "sleepy", pid, "the shim's /metrics"))

    targets = (await world.shim_get("/api/placement/targets"))["targets"]
    [target] = [t for t in targets if t["model"] == "sleepy"]
    assert (target["rails"], target["live"]["source"]) == (2, "props"), target
    rss.append(await still_asleep(world, "sleepy", pid, "the shim's targets"))

    plan = await world.shim_get("/api/placement/preview?model=beta")
    assert plan["options"], plan
    rss.append(await still_asleep(world, "sleepy", pid, "a Preview of beta"))
    return rss


async def keep_using(world: LlamaWorld, key: str) -> None:
    """A client of ``key``: a short completion every 0.25 s, until cancelled."""
    while True:
        answer = await world.complete(key, {"prompt": "again", "max_tokens": 2})
        assert answer["usage"]["completion_tokens"] == 2, answer
        await asyncio.sleep(0.25)


async def test_an_asleep_resident_is_shown_asleep_and_nothing_of_ours_wakes_it(
    llama: LlamaWorld,
) -> None:
    sleepy = llama.engine("sleepy")
    shown_after = await wait_shown_asleep(llama, "sleepy")
    assert SLEEPS in llama.engine_log("sleepy")
    row = await resident_row(llama, "sleepy")
    assert (row["state"], row["asleep"]) == ("hot", True), row
    status = await llama.cli_json("status")
    [listed] = [r for r in status["residents"] if r["model"] == "sleepy"]
    assert (listed["state"], listed["asleep"]) == ("hot", True), listed
    pid = await llama.main_pid("sleepy")
    woken_before = wakes(llama, "sleepy")
    assert woken_before == 0, "adopting it, verifying it and seeing it asleep woke it"
    slept_before = llama.engine_log("sleepy").count(SLEEPS)

    # A minute of uapplace's attention in a few seconds, spanning a whole period of the
    # watch's own polls: none of it wakes the engine.
    started = time.monotonic()
    asleep_rss: list[float] = [await still_asleep(llama, "sleepy", pid, "nothing")]
    rounds = 0
    while time.monotonic() - started < SLEEP_CHECK_S + 0.5:
        asleep_rss += await uapplace_activity(llama, pid)
        rounds += 1
    window = time.monotonic() - started
    assert wakes(llama, "sleepy") == woken_before, llama.engine_log("sleepy")[-2000:]
    assert llama.engine_log("sleepy").count(SLEEPS) == slept_before
    assert (await resident_row(llama, "sleepy")).get("asleep") is True
    assert await llama.main_pid("sleepy") == pid

    # Admission forwards to it, asleep as it is: llama.cpp wakes on the request.
    decision = await llama.admit("sleepy", "sleep-client")
    assert decision == {"decision": "forward", "target_id": sleepy.target}, decision
    assert await still_asleep(llama, "sleepy", pid, "an admit") < max(asleep_rss) + 5
    woke = time.monotonic()
    answer = await llama.complete("sleepy", {"prompt": "hello", "max_tokens": 4})
    assert (answer["model"], answer["usage"]["completion_tokens"]) == ("sleepy", 4), answer
    awake_rss = rss_mib(pid)
    assert awake_rss > max(asleep_rss) + AWAKE_MARGIN_MIB, (awake_rss, max(asleep_rss))
    assert wakes(llama, "sleepy") == woken_before + 1

    # A client keeps using it (a request every 0.25 s, well inside its 1 s idle): the
    # watch sees it awake within one period and clears the flag.
    client = asyncio.create_task(keep_using(llama, "sleepy"))
    try:
        await wait_shown_asleep(llama, "sleepy", asleep=False)
        took = time.monotonic() - woke
        assert wakes(llama, "sleepy") == woken_before + 1, "it stayed awake while used"
    finally:
        client.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await client
    assert took <= SLEEP_CHECK_S + CLEAR_SLACK_S, took
    row = await resident_row(llama, "sleepy")
    assert row["state"] == "hot" and "asleep" not in row, row
    print(
        f"\nshown asleep {shown_after:.1f}s after the world was up; {rounds} rounds of "
        f"status/GetState/metrics/targets/preview in {window:.1f}s woke it 0 times "
        f"(RSS asleep {min(asleep_rss):.1f}-{max(asleep_rss):.1f} MiB, awake {awake_rss:.1f} "
        f"MiB); asleep cleared {took:.1f}s after a client woke it"
    )


async def test_the_memory_an_asleep_resident_gave_back_is_not_offered_as_free(
    llama: LlamaWorld,
) -> None:
    await llama.wait_asleep("sleepy")  # /props: shown asleep or not, it counts whole
    pid = await llama.main_pid("sleepy")
    woken_before = wakes(llama, "sleepy")
    asleep_rss = await still_asleep(llama, "sleepy", pid, "nothing")

    # By the live readings beta would fit beside sleepy; by the measured footprints not.
    state = await llama.state()
    cpu0 = state["devices"]["cpu0"]
    assert asleep_rss + MODEL_MIB <= BUDGET_MIB, asleep_rss
    assert cpu0["free_mib"] - RESERVED_MIB >= MODEL_MIB, cpu0
    assert cpu0["room_mib"] == BUDGET_MIB - MODEL_MIB, cpu0

    # The request is offered the displacement of sleepy, and nothing else.
    placement = await llama.park("beta", "sleep-client")
    options = await llama.options_of(placement)
    assert [o["kind"] for o in options] == ["displace"], options
    [option] = options
    assert [(v["model"], v["config"]) for v in option["victims"]] == [("sleepy", "sleepy-f32")]
    assert (option["device_kind"], option["host_mib"]) == ("cpu", MODEL_MIB), option
    [victim] = option["victims"]
    assert (victim["device_kind"], victim["frees_host_mib"]) == ("cpu", MODEL_MIB), victim
    plan = await llama.cli_json("preview", "beta")
    assert "load_alongside" not in {o["kind"] for o in plan["options"]}, plan

    # What the operator reads counts host RAM, not the 0 MiB of GPU memory.
    shown = await llama.cli("preview", "beta")
    assert shown.returncode == 0, shown.stderr
    assert "costs 100 MiB of host RAM" in shown.stdout, shown.stdout
    assert "frees 100 MiB of host RAM" in shown.stdout, shown.stdout
    assert "0 MiB" not in shown.stdout.replace("100 MiB", ""), shown.stdout
    impact = await llama.cli("apply", placement, "1")
    assert impact.returncode == 1, impact.stderr + impact.stdout  # no --yes: nothing stops
    assert "100 MiB of host RAM" in impact.stdout, impact.stdout
    assert "Frees 100 MiB of host RAM in total." in impact.stdout, impact.stdout

    # Looking stopped nothing and woke nothing.
    assert await still_asleep(llama, "sleepy", pid, "the preview and the impact") < (asleep_rss + 5)
    assert wakes(llama, "sleepy") == woken_before
    assert await llama.main_pid("sleepy") == pid
    assert (await resident_row(llama, "sleepy"))["state"] == "hot"
    assert await llama.pending_entry(placement) is not None
