"""The stale-measurement rule's facts and verdicts (issue 21 item 3; uapplace.core.staleness,
uapplace.measure.launch): the build each engine kind reports, and which recorded field a
changed launch is held against. The same on real units: tests/systemd/test_measure_stale.py.
"""

from __future__ import annotations

from dataclasses import replace

from aiohttp import web
from http_fixtures import closed_port_url, serving

from uapplace.core.model import Config, ConfigStatus
from uapplace.core.staleness import LiveLaunch, exec_start_digest, stale_reason
from uapplace.measure.launch import engine_build

LAUNCH = "/usr/bin/llama-server -m /m/a.gguf --port 8080 -c 4096"
MEASURED = Config(
    "c1",
    ConfigStatus.MEASURED,
    resident_gpu_mib=100.0,
    host_rss_mib=50.0,
    measured_at="2026-12-01T10:00:00Z",
    measured_on="gpu0",
    flags=tuple(LAUNCH.split()[1:]),
    provenance="local",
    exec_start_sha256=exec_start_digest(LAUNCH),
    measured_build="b100-abc",
)


def app(routes: dict[str, object]) -> web.Application:
    application = web.Application()
    for path, body in routes.items():

        async def answer(request: web.Request, body: object = body) -> web.Response:
            return web.json_response(body)

        application.router.add_get(path, answer)
    return application


async def test_llama_cpp_build_comes_from_props() -> None:
    async with serving(app({"/props": {"build_info": "b6000-0c1e570"}})) as url:
        assert await engine_build(url, 1.0) == "b6000-0c1e570"


async def test_vllm_build_comes_from_version() -> None:
    async with serving(app({"/version": {"version": "0.6.3"}})) as url:
        assert await engine_build(url, 1.0) == "0.6.3"


async def test_an_engine_that_says_neither_or_is_down_has_no_build() -> None:
    async with serving(app({"/health": {}})) as url:
        assert await engine_build(url, 1.0) is None
    assert await engine_build(closed_port_url(), 0.5) is None


def field_of(live: LiveLaunch) -> str | None:
    """The recorded field ``live`` makes :data:`MEASURED` stale by, if any."""
    reason = stale_reason(MEASURED, live)
    return reason[0] if reason is not None else None


def test_the_same_launch_and_build_is_not_stale() -> None:
    assert stale_reason(MEASURED, LiveLaunch("a.service", LAUNCH, "b100-abc")) is None


def test_other_flags_other_program_and_another_build_each_name_their_field() -> None:
    flags = LAUNCH.replace("-c 4096", "-c 8192")
    program = LAUNCH.replace("/usr/bin/", "/opt/new/")
    assert field_of(LiveLaunch("a.service", flags)) == "flags"
    assert field_of(LiveLaunch("a.service", program)) == "exec_start_sha256"
    build = stale_reason(MEASURED, LiveLaunch("a.service", LAUNCH, "b200-def"))
    assert build is not None and build[0] == "measured_build"
    assert "'b100-abc'" in build[1] and "'b200-def'" in build[1]


def test_what_cannot_be_compared_is_not_held_against_it() -> None:
    unread = LiveLaunch("a.service", None, None)
    assert stale_reason(MEASURED, unread) is None
    by_hand = replace(MEASURED, exec_start_sha256=None, measured_build=None)
    assert stale_reason(by_hand, LiveLaunch("a.service", "/x --other", "b9")) is None
    repo = replace(MEASURED, provenance="repo")
    assert stale_reason(repo, LiveLaunch("a.service", "/x --other", "b9")) is None
