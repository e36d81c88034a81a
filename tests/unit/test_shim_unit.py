"""uapplace-shim without a daemon: access checks, bodies, errors, token, OpenAPI, metrics, CLI.

Everything here runs the real aiohttp app over real HTTP on 127.0.0.1 with a bus
address where nothing listens, so every bus call is "daemon unavailable"; the
contract tests against the real daemon live in ``tests/bus/test_shim.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer, make_mocked_request

from tests.worlds.commands import shim_argv
from tests.worlds.exposition import sample
from uapplace.bus.client import PlacementError
from uapplace.core.errors import Failed, unavailable
from uapplace.core.model import DEFAULT_CELLS
from uapplace.files.token import load_or_create_token
from uapplace.shim import main
from uapplace.shim.access import (
    ADMIT_LOOPBACK_ONLY,
    TOKEN_HEADER,
    check_access,
    host_header_is_loopback,
    token_matches,
)
from uapplace.shim.app import SHIM_KEY, create_app
from uapplace.shim.bodies import BODY_LIMIT, U32_MAX, parse_admit
from uapplace.shim.gateway import BusGateway
from uapplace.shim.handlers import STATUS_BY_BUS_ERROR, Shim, apply_outcome, drifted_body
from uapplace.shim.metrics import ShimMetrics, state_families
from uapplace.shim.responses import HttpError, encode_json
from uapplace.shim.routes import ROUTES
from uapplace.shim.server import bind_sockets
from uapplace.shim.settings import ShimSettings

TOKEN = "test-token-0123456789"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def dead_bus(tmp_path: Path) -> str:
    return f"unix:path={tmp_path}/no-bus-here"


@pytest.fixture
async def shim(dead_bus: str) -> AsyncIterator[tuple[str, web.Application]]:
    app = create_app(ShimSettings(token=TOKEN, bus_address=dead_bus))
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")), app
    await server.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def call(
    http: aiohttp.ClientSession,
    base: str,
    method: str,
    path: str,
    *,
    body: Any = None,
    data: bytes | None = None,
    token: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, Any]:
    sent = dict(headers or {})
    if token is not None:
        sent[TOKEN_HEADER] = token
    if body is not None:
        data = json.dumps(body).encode()
    if data is not None:  # as the proxy sends it (admit takes application/json only)
        sent.setdefault("Content-Type", "application/json")
    async with http.request(method, base + path, data=data, headers=sent) as response:
        raw = await response.read()
        assert response.content_type in ("application/json", "text/plain")
        parsed = json.loads(raw) if response.content_type == "application/json" else raw.decode()
        return response.status, raw, parsed


# --------------------------------------------------------------------------- peer check


class CraftedTransport:
    """Just enough of an asyncio transport for aiohttp to read the peer from."""

    def __init__(self, peer: tuple[str, int] | None) -> None:
        self.peer = peer

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.peer if name == "peername" else default

    def is_closing(self) -> bool:
        return False


class UnreadableBody:
    """A request body that fails the test if anything reads it."""

    async def read(self, n: int = -1) -> bytes:
        raise AssertionError("the body was read before the peer check")

    async def readany(self) -> bytes:
        raise AssertionError("the body was read before the peer check")


def crafted_admit(peer: tuple[str, int] | None, app: web.Application) -> web.Request:
    return make_mocked_request(
        "POST",
        ROUTES["admit"],
        headers={"Host": "127.0.0.1:3847", "Content-Type": "application/json"},
        transport=CraftedTransport(peer),
        payload=UnreadableBody(),  # type: ignore[arg-type]
        app=app,
    )


@pytest.mark.parametrize(
    "peer",
    [
        ("10.0.0.5", 40000),
        ("192.168.1.20", 40000),
        ("203.0.113.7", 40000),
        ("::ffff:10.0.0.1", 40000),
        ("fe80::1", 40000),
        ("2001:db8::1", 40000),
        ("127.0.0.2", 40000),
        None,
    ],
)
async def test_admit_refuses_non_loopback_peers_before_reading_the_body(
    peer: tuple[str, int] | None, dead_bus: str
) -> None:
    app = create_app(ShimSettings(token=TOKEN, bus_address=dead_bus))
    request = crafted_admit(peer, app)
    with pytest.raises(HttpError) as refused:
        check_access(request)
    assert (refused.value.status, refused.value.message) == (403, ADMIT_LOOPBACK_ONLY)
    with pytest.raises(HttpError) as refused_by_handler:
        await app[SHIM_KEY].admit(request)
    assert refused_by_handler.value.status == 403
    assert refused_by_handler.value.message == ADMIT_LOOPBACK_ONLY


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "::ffff:127.0.0.1"])
def test_loopback_peers_pass_the_check(host: str, dead_bus: str) -> None:
    app = create_app(ShimSettings(token=TOKEN, bus_address=dead_bus))
    check_access(crafted_admit((host, 40000), app))


def test_other_routes_refuse_non_loopback_peers_with_their_own_message(dead_bus: str) -> None:
    request = make_mocked_request(
        "GET", ROUTES["state"], transport=CraftedTransport(("10.0.0.5", 1))
    )
    with pytest.raises(HttpError) as refused:
        check_access(request)
    assert refused.value.status == 403
    assert refused.value.message == "the uapplace shim is loopback-only"


async def test_a_real_peer_outside_the_contract_list_gets_403(
    shim: tuple[str, web.Application],
) -> None:
    """127.0.0.2 is loopback to the kernel but not one of the three of docs/http-contract.md §1."""
    base, _ = shim
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
    async with aiohttp.ClientSession(connector=connector) as other_peer:
        status, raw, _ = await call(
            other_peer, base, "POST", ROUTES["admit"], body={"model_id": "m"}
        )
    assert (status, raw) == (403, b'{"error":"placement admit is loopback-only"}')


NETNS_PROBE = textwrap.dedent(
    """
    import asyncio, json, subprocess, sys
    import aiohttp
    from aiohttp import web
    from uapplace.shim.app import create_app
    from uapplace.shim.settings import ShimSettings

    async def run() -> None:
        runner = web.AppRunner(create_app(ShimSettings(token="t", bus_address=sys.argv[1])))
        await runner.setup()
        site = web.TCPSite(runner, "0.0.0.0", 0)
        await site.start()
        port = runner.addresses[0][1]
        results = {}
        async with aiohttp.ClientSession() as http:
            for name, host in (("outside", "10.200.0.1"), ("loopback", "127.0.0.1")):
                url = f"http://{host}:{port}/api/placement/admit"
                async with http.post(url, json={"model_id": "m"}) as response:
                    results[name] = [response.status, (await response.read()).decode()]
        await runner.cleanup()
        print(json.dumps(results))

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "addr", "add", "10.200.0.1/32", "dev", "lo"], check=True)
    asyncio.run(run())
    """
)


def test_non_loopback_peer_in_a_private_network_namespace(dead_bus: str, tmp_path: Path) -> None:
    """A real TCP peer with a non-loopback address, inside a throwaway network namespace.

    ``unshare --net`` gives the child its own namespace (only ``lo``, which gets
    10.200.0.1); it disappears with the child, so nothing outside is touched.
    """
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip to make a private network namespace")
    probe = tmp_path / "probe.py"
    probe.write_text(NETNS_PROBE)
    done = subprocess.run(
        [unshare, "--net", sys.executable, str(probe), dead_bus],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.skip(f"cannot create a network namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert results["outside"] == [403, '{"error":"placement admit is loopback-only"}']
    assert results["loopback"][0] == 503


# --------------------------------------------------------------------------- admit body


async def test_admit_missing_or_empty_model_id_is_400(shim: tuple[str, web.Application]) -> None:
    base, _ = shim
    async with aiohttp.ClientSession() as http:
        for body in ({}, {"model_id": ""}, {"model_id": None, "client": "c"}):
            status, raw, _ = await call(http, base, "POST", ROUTES["admit"], body=body)
            assert (status, raw) == (400, b'{"error":"missing model_id"}')
        status, raw, _ = await call(http, base, "POST", ROUTES["admit"], data=b"")
        assert (status, raw) == (400, b'{"error":"missing model_id"}')


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"{not json", "request body is not valid JSON"),
        (b"\xff\xfe", "request body is not valid JSON"),
        (b"[1, 2]", "request body must be a JSON object, got list"),
        (b'"model"', "request body must be a JSON object, got str"),
        (b'{"model_id": 7}', "model_id must be a string, got int"),
        (b'{"model_id": "m", "client": ["x"]}', "client must be a string, got list"),
        (b'{"model_id": "m", "session": 5}', "session must be a string, got int"),
        (b'{"model_id": "a\\u0000b"}', "model_id must not contain NUL characters"),
        (b'{"model_id": "\\ud800"}', "model_id must be valid Unicode text"),
        (b"[" * 5000 + b"]" * 5000, "request body is not valid JSON"),
    ],
)
async def test_admit_bad_bodies_are_400_naming_the_problem(
    shim: tuple[str, web.Application], http: aiohttp.ClientSession, data: bytes, message: str
) -> None:
    base, _ = shim
    status, _, parsed = await call(http, base, "POST", ROUTES["admit"], data=data)
    assert status == 400
    assert parsed["error"].startswith(message)


def test_parse_admit_truncates_and_defaults() -> None:
    long = "x" * 300
    parsed = parse_admit({"model_id": "m", "client": long, "session": long})
    assert (len(parsed.client), len(parsed.session)) == (128, 128)
    assert parsed.cells == DEFAULT_CELLS
    no_session = parse_admit({"model_id": "m", "session": None})
    assert (no_session.client, no_session.session) == ("", "")


@pytest.mark.parametrize(
    ("cells", "used"),
    [
        (40000, 40000),
        (1, 1),
        (0, DEFAULT_CELLS),
        (-3, DEFAULT_CELLS),
        (True, DEFAULT_CELLS),
        (False, DEFAULT_CELLS),
        (1.5, DEFAULT_CELLS),
        (4096.0, DEFAULT_CELLS),
        ("4096", DEFAULT_CELLS),
        (None, DEFAULT_CELLS),
        ([4096], DEFAULT_CELLS),
        (2**40, U32_MAX),
    ],
)
def test_cells_used_only_when_a_positive_integer(cells: Any, used: int) -> None:
    assert parse_admit({"model_id": "m", "cells": cells}).cells == used


async def test_admit_with_no_daemon_is_503_not_a_hang(
    shim: tuple[str, web.Application], http: aiohttp.ClientSession
) -> None:
    base, _ = shim
    status, _, parsed = await call(http, base, "POST", ROUTES["admit"], body={"model_id": "m"})
    assert status == 503
    assert parsed["error"].startswith("placement daemon unavailable: cannot connect to the bus")


# --------------------------------------------------------------------------- body limit


async def test_body_over_10_kib_is_413(
    shim: tuple[str, web.Application], http: aiohttp.ClientSession
) -> None:
    base, _ = shim
    big = json.dumps({"model_id": "m", "client": "x" * BODY_LIMIT}).encode()
    status, raw, _ = await call(http, base, "POST", ROUTES["admit"], data=big)
    assert (status, raw) == (413, b'{"error":"request body over 10240 bytes"}')
    status, raw, _ = await call(http, base, "POST", ROUTES["load"], data=big, token=TOKEN)
    assert (status, raw) == (413, b'{"error":"request body over 10240 bytes"}')


async def test_chunked_body_over_10_kib_is_413(
    shim: tuple[str, web.Application], http: aiohttp.ClientSession
) -> None:
    base, _ = shim

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model_id": "m", "client": "'
        for _ in range(11):
            yield b"x" * 1024
        yield b'"}'

    json_type = {"Content-Type": "application/json"}
    async with http.post(base + ROUTES["admit"], data=chunks(), headers=json_type) as response:
        assert response.status == 413
        assert await response.read() == b'{"error":"request body over 10240 bytes"}'


async def test_body_of_exactly_10240_bytes_is_read(
    shim: tuple[str, web.Application], http: aiohttp.ClientSession
) -> None:
    base, _ = shim
    head = b'{"model_id": "", "client": "'
    data = head + b"x" * (BODY_LIMIT - len(head) - 2) + b'"}'
    assert len(data) == BODY_LIMIT
    status, raw, _ = await call(http, base, "POST", ROUTES["admit"], data=data)
    assert (status, raw) == (400, b'{"error":"missing model_id"}')


# --------------------------------------------------------------------------- token


WRITE_ROUTES = ("resolve", "dismiss", "load", "unload", "auto")


@pytest.mark.parametrize("route", WRITE_ROUTES)
async def test_writes_need_the_token(
    shim: tuple[str, web.Application], http: aiohttp.ClientSession, route: str
) -> None:
    base, _ = shim
    status, raw, _ = await call(http, base, "POST", ROUTES[route], body={})
    assert (status, raw) == (401, b'{"error":"missing x-uap-dashboard-token header"}')
    for wrong in ("nope", TOKEN + "x", "", "tökén"):
        status, raw, _ = await call(http, base, "POST", ROUTES[route], body={}, token=wrong)
        assert (status, raw) == (401, b'{"error":"wrong x-uap-dashboard-token header"}')


async def test_token_is_checked_before_the_body_is_read(
    shim: tuple[str, web.Application], http: aiohttp.ClientSession
) -> None:
    base, _ = shim
    status, _, _ = await call(http, base, "POST", ROUTES["load"], data=b"x" * 20000)
    assert status == 401


async def test_right_token_reaches_the_bus(
    shim: tuple[str, web.Application], http: aiohttp.ClientSession
) -> None:
    base, _ = shim
    status, _, parsed = await call(http, base, "POST", ROUTES["auto"], body={}, token=TOKEN)
    assert status == 503
    assert parsed["error"].startswith("placement daemon unavailable")


def test_token_matches_is_exact_and_never_raises() -> None:
    assert token_matches(TOKEN, TOKEN)
    assert not token_matches(None, TOKEN)
    assert not token_matches("", TOKEN)
    assert not token_matches("\ud800", TOKEN)
    assert not token_matches(TOKEN.upper(), TOKEN)


def test_token_file_is_created_0600_in_a_0700_directory(tmp_path: Path) -> None:
    path = tmp_path / "runtime" / "uapplace" / "token"
    token = load_or_create_token(path)
    assert len(token) >= 40
    assert re.fullmatch(r"[A-Za-z0-9_-]+", token)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_or_create_token(path) == token


def test_token_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "uapplace" / "token"
    load_or_create_token(path)
    path.chmod(0o644)
    with pytest.raises(ValueError, match="mode 0600"):
        load_or_create_token(path)


def test_token_directory_open_to_others_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "uapplace"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    with pytest.raises(ValueError, match="mode 0700"):
        load_or_create_token(directory / "token")


def test_empty_token_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "uapplace" / "token"
    load_or_create_token(path)
    path.write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_or_create_token(path)


# --------------------------------------------------------------------------- write bodies


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("resolve", {"option": 1}, "invalid field placement_id: Field required"),
        ("resolve", {"placement_id": "plc-000001"}, "invalid field option: Field required"),
        ("resolve", {"placement_id": "plc-000001", "option": "1"}, "invalid field option"),
        ("resolve", {"placement_id": "plc-000001", "option": True}, "invalid field option"),
        ("resolve", {"placement_id": "plc-000001", "option": 0}, "invalid field option"),
        ("resolve", {"placement_id": "plc-000001", "option": 2**32}, "invalid field option"),
        ("resolve", {"placement_id": 5, "option": 1}, "invalid field placement_id"),
        (
            "resolve",
            {"placement_id": "plc-000001", "option": 1, "expected_victims": {"model": "a"}},
            "invalid field expected_victims",
        ),
        (
            "resolve",
            {"placement_id": "plc-000001", "option": 1, "expected_victims": [{"model": "a"}]},
            "invalid field expected_victims.0.config: Field required",
        ),
        (
            "resolve",
            {
                "placement_id": "plc-000001",
                "option": 1,
                "expected_victims": [{"model": "a", "config": "q"}],
            },
            "invalid field expected_victims.0.action: Field required",
        ),
        (
            "resolve",
            {"placement_id": "plc-000001", "option": 1, "extra": 1},
            "invalid field extra: Extra inputs are not permitted",
        ),
        ("dismiss", {}, "invalid field placement_id: Field required"),
        ("dismiss", {"placement_id": "a\u0000b"}, "invalid field placement_id"),
        ("load", {"model": ""}, "invalid field model"),
        ("load", {"model": ["m"]}, "invalid field model"),
        ("unload", {"models": "m"}, "invalid field model: Field required"),
        ("auto", {"enable": "yes"}, "invalid field enable"),
        ("auto", {"allow_displace": "m"}, "invalid field allow_displace"),
        ("auto", {"allow_displace": [1]}, "invalid field allow_displace.0"),
        ("auto", {"unload_idle_after_secs": -1}, "invalid field unload_idle_after_secs"),
        ("auto", {"yes": 1}, "invalid field yes"),
        ("auto", {"allow": ["m"]}, "invalid field allow: Extra inputs are not permitted"),
    ],
)
async def test_write_bodies_are_validated_naming_the_field(
    shim: tuple[str, web.Application],
    http: aiohttp.ClientSession,
    route: str,
    body: dict[str, Any],
    message: str,
) -> None:
    base, _ = shim
    status, _, parsed = await call(http, base, "POST", ROUTES[route], body=body, token=TOKEN)
    assert status == 400
    assert parsed["error"].startswith(message)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("", "missing query parameter model"),
        ("?model=", "missing query parameter model"),
        ("?model=m&cells=abc", "query parameter cells must be an integer from 1 to 4294967295"),
        ("?model=m&cells=0", "query parameter cells must be an integer"),
        ("?model=m&cells=-4", "query parameter cells must be an integer"),
        ("?model=m&cells=4294967296", "query parameter cells must be an integer"),
        ("?model=m&cells=%D9%A3", "query parameter cells must be an integer"),
        ("?model=a%00b", "query parameter model must not contain NUL"),
    ],
)
async def test_preview_query_is_validated(
    shim: tuple[str, web.Application], http: aiohttp.ClientSession, query: str, message: str
) -> None:
    base, _ = shim
    status, _, parsed = await call(http, base, "GET", ROUTES["preview"] + query)
    assert status == 400
    assert parsed["error"].startswith(message)


# --------------------------------------------------------------------------- routing, Host


async def test_unknown_route_is_json_404(
    shim: tuple[str, web.Application], http: aiohttp.ClientSession
) -> None:
    base, _ = shim
    status, raw, _ = await call(http, base, "GET", "/api/placement/nope")
    assert (status, raw) == (404, b'{"error":"no route GET \'/api/placement/nope\'"}')


async def test_wrong_method_is_json_405_with_allow(
    shim: tuple[str, web.Application], http: aiohttp.ClientSession
) -> None:
    base, _ = shim
    async with http.get(base + ROUTES["admit"]) as response:
        assert response.status == 405
        assert response.headers["Allow"] == "POST"
        assert await response.json() == {
            "error": "method GET is not allowed on /api/placement/admit; allowed: POST"
        }
    status, _, parsed = await call(http, base, "DELETE", ROUTES["state"])
    assert status == 405
    assert parsed["error"].endswith("allowed: GET, HEAD")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1:3847", True),
        ("localhost:3847", True),
        ("LOCALHOST", True),
        ("[::1]:3847", True),
        ("127.0.0.1", True),
        (None, True),
        ("evil.example:3847", False),
        ("10.0.0.1:3847", False),
        ("127.0.0.1.evil.example", False),
        ("[::2]:80", False),
    ],
)
def test_host_header_check(host: str | None, loopback: bool) -> None:
    assert host_header_is_loopback(host) is loopback


async def test_foreign_host_header_is_refused_except_on_admit(
    shim: tuple[str, web.Application], http: aiohttp.ClientSession
) -> None:
    base, _ = shim
    rebinding = {"Host": "evil.example:3847"}
    status, raw, _ = await call(http, base, "GET", ROUTES["state"], headers=rebinding)
    assert (status, raw) == (
        403,
        b'{"error":"Host header \'evil.example:3847\' is not a loopback name"}',
    )
    status, _, _ = await call(
        http, base, "POST", ROUTES["admit"], body={"model_id": "m"}, headers=rebinding
    )
    assert status == 503


# --------------------------------------------------------------------------- OpenAPI


async def test_openapi_describes_every_route_and_every_ref_resolves(
    shim: tuple[str, web.Application], http: aiohttp.ClientSession
) -> None:
    base, app = shim
    status, _, document = await call(http, base, "GET", ROUTES["openapi"])
    assert status == 200
    assert document["openapi"] == "3.1.0"
    served = {
        (route.resource.canonical, route.method.lower())
        for route in app.router.routes()
        if route.resource is not None and route.method not in ("HEAD", "*")
    }
    described = {(path, method) for path, item in document["paths"].items() for method in item}
    assert described == served
    for path, item in document["paths"].items():
        for method, operation in item.items():
            assert "200" in operation["responses"], (path, method)
            is_write = method == "post" and path != ROUTES["admit"]
            assert ("security" in operation) is is_write, (path, method)
            if method == "post":
                assert "requestBody" in operation
    for ref in re.findall(r'"\$ref": "([^"]+)"', json.dumps(document)):
        node: Any = document
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]
        assert isinstance(node, dict)


# --------------------------------------------------------------------------- metrics


async def test_metrics_without_a_daemon(
    shim: tuple[str, web.Application], http: aiohttp.ClientSession
) -> None:
    base, _ = shim
    await call(http, base, "POST", ROUTES["admit"], body={"model_id": "m"})
    async with http.get(base + ROUTES["metrics"]) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = await response.text()
    assert sample(text, "uapplace_daemon_up") == 0
    assert sample(text, "uapplace_shim_bus_errors_total", method="Admit", error="Unreachable") == 1
    responses = "uapplace_shim_http_responses_total"
    assert sample(text, responses, route="/api/placement/admit", status="503") == 1
    assert sample(text, "uapplace_shim_bus_call_duration_seconds_count", method="Admit") == 1
    assert_exposition_well_formed(text)


def assert_exposition_well_formed(text: str) -> None:
    sample = re.compile(r'^[a-z_:][a-z0-9_:]*(\{([a-z_]+="([^"\\]|\\.)*",?)*\})? \S+$')
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("# HELP "):
            continue
        assert sample.match(line), line
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        assert any(name == t or name.startswith(t + "_") for t in typed), line


def test_counter_and_histogram_exposition() -> None:
    metrics = ShimMetrics()
    awkward = 'quote " and \\ and\nnewline'
    metrics.admits.labels("park", awkward).inc()
    for seconds in (0.0003, 0.004, 5.0):
        metrics.bus_seconds.labels("Admit").observe(seconds)
    text = metrics.exposition(None).decode()
    assert 'reason="quote \\" and \\\\ and\\nnewline"} 1.0' in text
    assert sample(text, "uapplace_shim_admits_total", decision="park", reason=awkward) == 1
    bucket = "uapplace_shim_bus_call_duration_seconds_bucket"
    assert sample(text, bucket, method="Admit", le="0.0005") == 1
    assert sample(text, bucket, method="Admit", le="0.005") == 2
    assert sample(text, bucket, method="Admit", le="2.5") == 2
    assert sample(text, bucket, method="Admit", le="+Inf") == 3
    total = sample(text, "uapplace_shim_bus_call_duration_seconds_sum", method="Admit")
    assert total is not None and abs(total - 5.0043) < 1e-9
    assert sample(text, "uapplace_shim_bus_call_duration_seconds_count", method="Admit") == 3
    assert_exposition_well_formed(text)


def test_each_shim_has_its_own_registry() -> None:
    first, second = ShimMetrics(), ShimMetrics()
    first.admits.labels("forward", "").inc()
    assert first.value("uapplace_shim_admits_total", decision="forward", reason="") == 1
    assert second.value("uapplace_shim_admits_total", decision="forward", reason="") == 0
    assert first.registry is not second.registry


def test_state_gauges_read_the_ledger_document() -> None:
    state = {
        "pending": [{"id": "plc-000001"}, {"id": "plc-000002"}],
        "residents": [{"state": "hot"}, {"state": "hot"}, {"state": "draining"}],
        "devices": {"gpu0": {"total_mib": 24576, "free_mib": 1016.5}, "cpu0": {"kind": "cpu"}},
    }
    text = ShimMetrics().exposition(state).decode()
    for name, labels, value in (
        ("uapplace_daemon_up", {}, 1),
        ("uapplace_pending", {}, 2),
        ("uapplace_residents", {"state": "hot"}, 2),
        ("uapplace_residents", {"state": "warming"}, 0),
        ("uapplace_residents", {"state": "draining"}, 1),
        ("uapplace_device_total_mib", {"device": "gpu0"}, 24576),
        ("uapplace_device_free_mib", {"device": "gpu0"}, 1016.5),
    ):
        assert sample(text, name, **labels) == value, (name, labels)
    assert not any("cpu0" in line for line in text.splitlines())
    assert [f.name for f in state_families(None)] == ["uapplace_daemon_up"]
    assert_exposition_well_formed(text)


# --------------------------------------------------------------------------- bytes


def test_json_is_compact_utf8_and_survives_lone_surrogates() -> None:
    assert encode_json({"decision": "forward", "target_id": "gpu0:default"}) == (
        b'{"decision":"forward","target_id":"gpu0:default"}'
    )
    assert encode_json({"error": "modèle"}) == '{"error":"modèle"}'.encode()
    assert encode_json({"error": "\ud800"}) == b'{"error":"\\ud800"}'


# --------------------------------------------------------------------------- the command


def test_refuses_to_bind_a_non_loopback_host(capsys: pytest.CaptureFixture[str]) -> None:
    for host in ("0.0.0.0", "::", "10.0.0.1", "example.com", "127.0.0.2"):
        with pytest.raises(SystemExit) as exited:
            main(["--host", host])
        assert exited.value.code == 2
        assert f"refusing to bind '{host}'" in capsys.readouterr().err


@pytest.fixture
def runtime_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    yield {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "PYTHONUNBUFFERED": "1"}


async def test_the_command_serves_on_loopback_and_stops_on_sigterm(
    runtime_env: dict[str, str], dead_bus: str
) -> None:
    process = await asyncio.create_subprocess_exec(
        *shim_argv(dead_bus),
        env=runtime_env,
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        line = (await asyncio.wait_for(process.stderr.readline(), 30)).decode()
        match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        assert match, line
        token = (Path(runtime_env["XDG_RUNTIME_DIR"]) / "uapplace" / "token").read_text().strip()
        async with aiohttp.ClientSession() as http:
            status, _, _ = await call(
                http, match.group(1), "POST", ROUTES["admit"], body={"model_id": "m"}
            )
            assert status == 503
            status, _, _ = await call(
                http, match.group(1), "POST", ROUTES["auto"], body={}, token=token
            )
            assert status == 503
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


# --------------------------------------------------------------------------- bus errors → HTTP


class ScriptedGateway(BusGateway):
    """The bus boundary replaced by a scripted daemon reply (error mapping only)."""

    def __init__(self, outcome: PlacementError | Any) -> None:
        super().__init__("unix:path=/nonexistent", ShimMetrics())
        self.outcome = outcome

    async def call(self, method: str, deadline: float, work: Any, *, peer_work: Any = None) -> Any:
        if isinstance(self.outcome, PlacementError):
            raise self.outcome
        return self.outcome


def scripted_shim(outcome: PlacementError | Any) -> Shim:
    settings = ShimSettings(token=TOKEN, bus_address="unix:path=/nonexistent")
    return Shim(settings, ScriptedGateway(outcome))


def bus_error(short: str, message: str) -> PlacementError:
    return PlacementError(f"org.uap.Placement1.Error.{short}", message)


@pytest.mark.parametrize(
    ("short", "status"),
    [
        ("NotFound", 404),
        ("UnknownModel", 404),
        ("Busy", 409),
        ("InvalidArgument", 400),
        ("NotAuthorized", 403),
        ("Failed", 500),
        ("SomethingNew", 502),
    ],
)
async def test_bus_errors_map_to_statuses(short: str, status: int) -> None:
    shim = scripted_shim(bus_error(short, "what went wrong"))
    with pytest.raises(HttpError) as answered:
        await shim.bus("Load", 1.0, lambda client: client.load("m", []))
    assert answered.value.status == status
    assert answered.value.bus_error == short
    expected = "what went wrong" if status != 502 else "SomethingNew: what went wrong"
    assert answered.value.message == expected


class ServiceUnknownGateway(BusGateway):
    """The real call path, with a bus on which nobody owns org.uap.Placement1."""

    def __init__(self) -> None:
        super().__init__("unix:path=/nonexistent", ShimMetrics())

    async def _connected(self) -> Any:
        raise PlacementError("org.freedesktop.DBus.Error.ServiceUnknown", "no uapplaced")


async def test_unavailable_bus_errors_are_503_and_counted() -> None:
    settings = ShimSettings(token=TOKEN, bus_address="unix:path=/nonexistent")
    shim = Shim(settings, ServiceUnknownGateway())
    with pytest.raises(HttpError) as answered:
        await shim.bus("Admit", 1.0, lambda client: client.admit("m", "c", "", 1))
    assert answered.value.status == 503
    assert answered.value.message == "placement daemon unavailable: Admit: no uapplaced"
    errors = "uapplace_shim_bus_errors_total"
    unknown = "org.freedesktop.DBus.Error.ServiceUnknown"
    assert shim.gateway.metrics.value(errors, method="Admit", error=unknown) == 1


def enforcements(shim: Shim, verb: str, outcome: str) -> float:
    return shim.metrics.value("uapplace_shim_enforcements_total", verb=verb, outcome=outcome)


async def test_drifted_resolve_is_409_with_an_apply_style_body() -> None:
    message = "victim set changed: approved [alpha/alpha-q4], now [beta/beta-q8]"
    shim = scripted_shim(bus_error("Drifted", message))
    with pytest.raises(HttpError) as answered:
        await shim.enforcement("resolve", "Apply", "plc-0a1b2c", lambda c: c.apply("x", 1, []))
    assert answered.value.status == 409
    assert answered.value.body == {
        "ok": False,
        "placementId": "plc-0a1b2c",
        "steps": [],
        "error": message,
    }
    assert enforcements(shim, "resolve", "drifted") == 1


@pytest.mark.parametrize(
    "failure",
    [
        unavailable("Apply", "it needs the systemd user manager, and it is not on this bus"),
        unavailable("Load", "uapplaced has not wired it (it is still starting)"),
    ],
)
async def test_missing_machinery_is_503_with_the_daemons_message(failure: Failed) -> None:
    """The daemon is up but cannot enforce here: not a failure of the request (500)."""
    shim = scripted_shim(PlacementError(failure.bus_name, str(failure)))
    with pytest.raises(HttpError) as answered:
        await shim.enforcement("resolve", "Apply", "plc-0a1b2c", lambda c: c.apply("x", 1, []))
    assert (answered.value.status, answered.value.message) == (503, str(failure))
    assert enforcements(shim, "resolve", "unavailable") == 1


def test_missing_machinery_is_its_own_bus_error_and_a_503() -> None:
    err = unavailable("Measure", "why")
    assert err.bus_name == "org.uap.Placement1.Error.Unavailable"
    assert STATUS_BY_BUS_ERROR[err.short] == 503
    assert STATUS_BY_BUS_ERROR["Failed"] == 500


def test_drifted_wording_always_says_victim_set_changed() -> None:
    assert drifted_body("plc-000001", "a victim is no longer resident")["error"] == (
        "victim set changed: a victim is no longer resident"
    )


@pytest.mark.parametrize(
    ("result", "outcome"),
    [
        ({"ok": True, "placementId": "p", "steps": []}, "ok"),
        ({"ok": False, "placementId": "p", "steps": [], "rolledBack": True}, "rolled_back"),
        ({"ok": False, "placementId": "p", "steps": [], "error": "x"}, "failed"),
    ],
)
async def test_enforcement_results_pass_through_as_200_and_are_counted(
    result: dict[str, Any], outcome: str
) -> None:
    shim = scripted_shim(result)
    response = await shim.enforcement("load", "Load", "", lambda c: c.load("m", []))
    assert response.status == 200
    assert json.loads(response.body) == result  # type: ignore[arg-type]
    assert apply_outcome(result) == outcome
    assert enforcements(shim, "load", outcome) == 1
    timed = "uapplace_shim_enforcement_duration_seconds_count"
    assert shim.metrics.value(timed, verb="load", outcome=outcome) == 1


def test_localhost_binds_both_loopbacks_on_one_port() -> None:
    sockets = bind_sockets(("127.0.0.1", "::1"), 0)
    try:
        ports = {s.getsockname()[1] for s in sockets}
        hosts = [s.getsockname()[0] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()
    assert len(ports) == 1
    assert hosts[0] == "127.0.0.1"
