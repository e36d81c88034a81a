"""The event stream's bus side and its SSE route over the real daemon on a private bus.

:class:`uapplace.shim.events.EventFeed` follows the real ``uapplaced``'s signals
into an :class:`uapplace.bus.events.EventLog`; :func:`uapplace.shim.events.stream_events`
serves that log over real HTTP; a plain SSE client reads it, leaves, and resumes
with ``Last-Event-ID``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.bus.conftest import DaemonProcess, call, call_json
from uapplace.bus.events import EventLog, parse_sse
from uapplace.shim.events import EventFeed, StreamLimits, stream_events

pytestmark = pytest.mark.bus

GUARD_S = 20.0


@pytest.fixture
async def served(daemon: DaemonProcess) -> AsyncIterator[tuple[EventFeed, str]]:
    """The feed on the daemon's bus, and the SSE route serving its log."""
    log = EventLog(capacity=50)
    feed = EventFeed(daemon.uap.bus_address, log, retry_s=0.2)
    feed.start()

    async def events(request: web.Request) -> web.StreamResponse:
        return await stream_events(request, log, StreamLimits(keepalive_s=0.5))

    app = web.Application()
    app.router.add_get("/api/placement/events", events)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        async with asyncio.timeout(GUARD_S):
            await feed.connected.wait()
        yield feed, f"http://{host}:{port}/api/placement/events"
    finally:
        await feed.close()  # ends every stream
        await runner.cleanup()


async def read_events(
    url: str, count: int, last_event_id: str | None = None
) -> list[tuple[str, str | None, Any]]:
    """Read ``count`` SSE messages (keepalives skipped), then disconnect."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    seen: list[tuple[str, str | None, Any]] = []
    buffer = ""
    async with (
        asyncio.timeout(GUARD_S),
        aiohttp.ClientSession() as http,
        http.get(url, headers=headers) as reply,
    ):
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        async for chunk in reply.content.iter_any():
            buffer += chunk.decode()
            complete, _, rest = buffer.rpartition("\n\n")
            if not complete:
                continue
            buffer = rest
            for message in parse_sse(complete + "\n\n"):
                seen.append((message.event, message.id, json.loads(message.data)))
            if len(seen) >= count:
                return seen[:count]
    return seen


def admit(daemon: DaemonProcess, model: str, client: str) -> str:
    decision, _, placement_id, reason = call_json(
        daemon.uap.bus_address, "Admit", "sssu", model, client, "", "0"
    )
    assert (decision, reason) == ("park", "not_resident")
    return str(placement_id)


async def test_a_park_and_its_dismissal_arrive_in_order(
    daemon: DaemonProcess, served: tuple[EventFeed, str]
) -> None:
    feed, url = served
    # Resuming from the log's head: whenever the reader connects, it misses nothing after.
    reader = asyncio.ensure_future(read_events(url, 2, last_event_id=str(feed.log.last_id)))
    placement_id = await asyncio.to_thread(admit, daemon, "beta", "events-order")
    done = await asyncio.to_thread(call, daemon.uap.bus_address, "Dismiss", "s", placement_id)
    assert done.returncode == 0, done.stderr
    (parked, resolved) = await reader
    assert parked[0] == "Parked" and parked[2]["data"]["placement_id"] == placement_id
    assert parked[2]["data"]["client"] == "events-order"
    assert resolved[0] == "Resolved"
    assert resolved[2]["data"] == {"placement_id": placement_id, "outcome": "dismissed"}
    assert int(resolved[1] or 0) > int(parked[1] or 0)


async def test_a_reader_resumes_with_last_event_id_without_loss(
    daemon: DaemonProcess, served: tuple[EventFeed, str]
) -> None:
    feed, url = served
    first = asyncio.ensure_future(read_events(url, 1, last_event_id=str(feed.log.last_id)))
    one = await asyncio.to_thread(admit, daemon, "beta", "events-resume-1")
    (seen,) = await first  # the reader disconnects here
    while_away = [
        await asyncio.to_thread(admit, daemon, "beta", f"events-resume-{n}") for n in (2, 3)
    ]
    async with asyncio.timeout(GUARD_S):  # the feed has them before the reader comes back
        while True:
            if feed.log.last_id >= int(seen[1] or 0) + 2:
                break
            await asyncio.sleep(0.05)
    resumed = await read_events(url, 2, last_event_id=seen[1])
    assert seen[2]["data"]["placement_id"] == one
    assert [r[2]["data"]["placement_id"] for r in resumed] == while_away
    assert [int(r[1] or 0) for r in resumed] == [int(seen[1] or 0) + 1, int(seen[1] or 0) + 2]
