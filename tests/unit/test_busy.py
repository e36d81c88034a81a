"""What an engine says of its own work (``uapplace.io.busy``), and how a stop ended (``units``).

:func:`uapplace.io.busy.ask` over scripted replies shaped like llama-server's and vLLM's
(``/props``, ``/slots``, ``/metrics`` bodies as those engines serve them), one branch
each; then over real HTTP through :func:`uapplace.io.engines.get_reply`. Last,
:func:`uapplace.io.units.forced_stop_text` on the properties systemd leaves after a stop.
The drain that uses these: ``test_enforce_engine_truth.py``.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web
from http_fixtures import closed_port_url, serving

from uapplace.io import busy, engines
from uapplace.io.busy import Verdict
from uapplace.io.units import (
    CLD_EXITED,
    CLD_KILLED,
    STOP_MARGIN_S,
    UnitState,
    forced_stop_text,
    stop_wait_s,
)

Reply = tuple[int | None, str]


def slots(*processing: bool) -> Reply:
    return 200, json.dumps(
        [
            {"id": i, "n_ctx": 256, "speculative": False, "is_processing": p}
            for i, p in enumerate(processing)
        ]
    )


def props(sleeping: bool | None) -> Reply:
    body: dict[str, Any] = {"total_slots": 2, "build_info": "b1-0c1e570"}
    if sleeping is not None:
        body["is_sleeping"] = sleeping
    return 200, json.dumps(body)


def llama_metrics(processing: int, deferred: int = 0) -> Reply:
    return 200, (
        "# HELP llamacpp:requests_processing Number of requests processing.\n"
        "# TYPE llamacpp:requests_processing gauge\n"
        f"llamacpp:requests_processing {processing}\n"
        f"llamacpp:requests_deferred {deferred}\n"
        "llamacpp:prompt_tokens_total 14\n"
    )


NOT_FOUND: Reply = (404, '{"error":{"code":404,"message":"File Not Found"}}')
NOT_SUPPORTED: Reply = (501, '{"error":{"code":501,"type":"not_supported_error"}}')
REFUSED: Reply = (None, "Cannot connect to host 127.0.0.1:9 [Connection refused]")


class Engine:
    """Scripted replies per route; ``asked`` lists the routes in the order asked."""

    def __init__(self, replies: Mapping[str, Reply]) -> None:
        self.replies = dict(replies)
        self.asked: list[str] = []

    async def fetch(self, route: str) -> Reply:
        self.asked.append(route)
        return self.replies.get(route, NOT_FOUND)


async def ask(replies: Mapping[str, Reply]) -> tuple[busy.EngineWork, list[str]]:
    engine = Engine(replies)
    work = await busy.ask(engine.fetch)
    return work, engine.asked


# --------------------------------------------------------------------------- the order of asking


async def test_a_processing_slot_is_busy_and_metrics_are_not_asked() -> None:
    work, asked = await ask({"/props": props(False), "/slots": slots(False, True)})
    assert work.verdict is Verdict.BUSY and work.blocks_drain
    assert asked == ["/props", "/slots"]
    assert work.text() == "busy (/props is_sleeping false, /slots 1 of 2 slots processing)"


async def test_all_slots_idle_is_idle() -> None:
    work, _ = await ask({"/props": props(False), "/slots": slots(False, False)})
    assert work.verdict is Verdict.IDLE and not work.blocks_drain
    assert work.text() == "idle (/props is_sleeping false, /slots 0 of 2 slots processing)"


async def test_a_sleeping_server_is_idle_and_its_slots_are_never_asked() -> None:
    # GET /slots is a task to llama-server: it would wake the sleeping server.
    work, asked = await ask({"/props": props(True), "/slots": slots(True, True)})
    assert work.verdict is Verdict.ASLEEP and not work.blocks_drain
    assert asked == ["/props"]
    assert work.text() == "asleep (/props is_sleeping true: nothing in flight)"


async def test_no_slots_falls_back_to_llama_metrics() -> None:
    replies = {"/props": props(False), "/slots": NOT_SUPPORTED, "/metrics": llama_metrics(1)}
    work, asked = await ask(replies)
    assert asked == ["/props", "/slots", "/metrics"]
    assert work.verdict is Verdict.BUSY
    assert work.text() == (
        "busy (/props is_sleeping false, /slots HTTP 501, "
        "/metrics llamacpp:requests_processing 1, llamacpp:requests_deferred 0)"
    )


async def test_a_deferred_request_is_busy_too() -> None:
    replies = {"/props": props(False), "/slots": NOT_SUPPORTED, "/metrics": llama_metrics(0, 2)}
    work, _ = await ask(replies)
    assert work.verdict is Verdict.BUSY


async def test_idle_metrics_are_idle() -> None:
    replies = {"/props": props(False), "/slots": NOT_SUPPORTED, "/metrics": llama_metrics(0)}
    work, _ = await ask(replies)
    assert work.verdict is Verdict.IDLE


async def test_vllm_gauges_are_summed_over_their_labels() -> None:
    text = (
        'vllm:num_requests_running{model_name="m",engine="0"} 0.0\n'
        'vllm:num_requests_running{model_name="m",engine="1"} 1.0\n'
        'vllm:num_requests_waiting{model_name="m"} 0.0\n'
    )
    work, asked = await ask({"/metrics": (200, text)})
    assert asked == ["/props", "/slots", "/metrics"]  # vLLM: no /props, no /slots (404)
    assert work.verdict is Verdict.BUSY
    assert work.said[-1].said == "vllm:num_requests_running 1, vllm:num_requests_waiting 0"


# --------------------------------------------------------------------------- nothing decides


async def test_an_engine_answering_without_any_signal_is_no_signal_and_does_not_block() -> None:
    replies = {
        "/props": props(None),
        "/slots": NOT_SUPPORTED,
        "/metrics": (200, "llamacpp:prompt_tokens_total 3\n"),
    }
    work, _ = await ask(replies)
    assert work.verdict is Verdict.NO_SIGNAL and not work.blocks_drain
    assert work.text() == (
        "no signal (/props no is_sleeping, /slots HTTP 501, /metrics no requests gauge)"
    )


@pytest.mark.parametrize(
    ("slots_reply", "said"),
    [
        ((200, "[]"), "not a list of slots"),
        ((200, '{"slots": 2}'), "not a list of slots"),
        ((200, '[{"id": 0}]'), "no is_processing"),
        ((200, "<html>"), "not a list of slots"),
        ((400, '{"error": "model name is missing from the request"}'), "HTTP 400"),
    ],
)
async def test_a_slots_body_without_the_flag_decides_nothing(slots_reply: Reply, said: str) -> None:
    work, _ = await ask({"/props": props(False), "/slots": slots_reply, "/metrics": NOT_SUPPORTED})
    assert work.verdict is Verdict.NO_SIGNAL
    assert work.said[1].said == said


async def test_bad_prometheus_text_decides_nothing() -> None:
    work, _ = await ask({"/metrics": (200, "llamacpp:requests_processing one\n")})
    assert work.verdict is Verdict.NO_SIGNAL
    assert work.said[-1].said == "not Prometheus text"


async def test_an_engine_that_does_not_answer_is_unreachable_and_blocks() -> None:
    work, asked = await ask({"/props": REFUSED})
    assert asked == ["/props"]  # nothing more is asked of an engine that answers nothing
    assert work.verdict is Verdict.UNREACHABLE and work.blocks_drain
    assert work.text() == (
        "unreachable (/props no answer (Cannot connect to host 127.0.0.1:9 [Connection refused]))"
    )


async def test_a_route_timing_out_after_props_answered_is_unreachable_when_nothing_decides() -> (
    None
):
    replies = {"/props": props(False), "/slots": (None, "timed out"), "/metrics": NOT_SUPPORTED}
    work, _ = await ask(replies)
    assert work.verdict is Verdict.UNREACHABLE and work.blocks_drain


async def test_a_later_route_that_decides_wins_over_one_that_timed_out() -> None:
    replies = {"/props": props(False), "/slots": (None, "timed out"), "/metrics": llama_metrics(0)}
    work, _ = await ask(replies)
    assert work.verdict is Verdict.IDLE


# --------------------------------------------------------------------------- over real HTTP


def llama_like(processing: int) -> web.Application:
    async def props_route(request: web.Request) -> web.Response:
        return web.json_response({"total_slots": 2, "is_sleeping": False})

    async def slots_route(request: web.Request) -> web.Response:
        return web.json_response([{"id": i, "is_processing": i < processing} for i in range(2)])

    app = web.Application()
    app.router.add_get("/props", props_route)
    app.router.add_get("/slots", slots_route)
    return app


async def test_get_reply_returns_status_and_body_and_never_raises() -> None:
    async with serving(llama_like(1)) as url:
        status, body = await engines.get_reply(f"{url}/v1/", "/slots", 2.0)
        assert status == 200 and json.loads(body)[0]["is_processing"] is True
        assert (await engines.get_reply(url, "/metrics", 2.0))[0] == 404

        async def fetch(route: str) -> Reply:
            return await engines.get_reply(url, route, 2.0)

        work = await busy.ask(fetch)
        assert work.verdict is Verdict.BUSY
    status, why = await engines.get_reply(closed_port_url(), "/props", 2.0)
    assert status is None and why


# --------------------------------------------------------------------------- how a stop ended


def ended(result: str, code: int, status: int) -> UnitState:
    return UnitState(
        "failed" if result != "success" else "inactive",
        "failed" if result != "success" else "dead",
        "loaded",
        0,
        "/usr/bin/llama-server",
        result=result,
        exec_main_code=code,
        exec_main_status=status,
    )


def test_a_clean_stop_is_not_forced() -> None:
    assert forced_stop_text(ended("success", CLD_EXITED, 0)) is None
    # A SIGTERM death is a clean stop to systemd (Result=success).
    assert forced_stop_text(ended("success", CLD_KILLED, signal.SIGTERM)) is None


def test_sigkill_after_the_stop_timeout_is_forced() -> None:
    assert forced_stop_text(ended("timeout", CLD_KILLED, signal.SIGKILL)) == (
        "stopped by SIGKILL after the stop timeout (unit result timeout): "
        "in-flight work may have been cut"
    )


def test_a_timeout_that_killed_only_what_was_left_is_forced() -> None:
    # The main process exited, a child in the cgroup ignored SIGTERM and was killed.
    assert forced_stop_text(ended("timeout", CLD_EXITED, 0)) == (
        "stopped by force (SIGKILL to what was left) after the stop timeout "
        "(unit result timeout): in-flight work may have been cut"
    )


def test_a_main_process_killed_without_a_timeout_is_forced() -> None:
    assert forced_stop_text(ended("signal", CLD_KILLED, signal.SIGKILL)) == (
        "stopped by SIGKILL (unit result signal): in-flight work may have been cut"
    )


def test_a_stop_is_awaited_past_the_units_own_stop_timeout() -> None:
    running = replace(ended("success", 0, 0), active_state="active", timeout_stop_s=90.0)
    assert stop_wait_s(running, 90.0) == 90.0 + STOP_MARGIN_S  # systemd's SIGKILL comes first
    assert stop_wait_s(replace(running, timeout_stop_s=1.0), 90.0) == 90.0
    assert stop_wait_s(replace(running, timeout_stop_s=None), 90.0) == 90.0  # infinity
    assert stop_wait_s(None, 12.0) == 12.0  # the state could not be read
