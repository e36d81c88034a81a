"""Bounded event streams (issue 20): each SSE subscriber has its own bounded queue, a slow
reader is dropped with a final ``StreamClosed`` event saying why, and no reader makes a
publish wait (docs/http-contract.md §5, "Events").

The queue itself (:class:`uapplace.bus.events.Subscription`) is tested alone; the
stream (:func:`uapplace.shim.events.stream_events`) over real HTTP on the loopback,
with a reader that never reads. The admit latency with 200 subscribers is
``bench/bench_sse_admit.py``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from http_fixtures import serving

from uapplace.bus.events import CLOSED_EVENT, Event, EventLog, Gap, parse_sse
from uapplace.shim.events import StreamLimits, stream_events

GUARD_S = 20.0
"""Only a bound on a hang: the waits below end on a condition."""


def publish(log: EventLog, count: int, detail: str = "") -> None:
    for index in range(count):
        log.publish_signal("EnforcementStep", ["run-1", f"step-{index}", True, detail])


def ids(items: list[Event | Gap] | None) -> list[int]:
    assert items is not None
    return [item.id for item in items if isinstance(item, Event)]


# --------------------------------------------------------------------------- the queue


async def test_a_subscriber_gets_everything_in_one_batch() -> None:
    log = EventLog()
    subscription = log.subscribe()
    publish(log, 5)
    assert ids(await subscription.take()) == [1, 2, 3, 4, 5]
    assert subscription.delivered_id == 5 and subscription.queued == 0
    assert await subscription.take(idle_s=0.01) == []  # nothing new: a keepalive's moment


async def test_a_full_queue_drops_its_subscriber_and_frees_it_at_once() -> None:
    log = EventLog()
    slow = log.subscribe(capacity=8)
    quick = log.subscribe(capacity=8)
    publish(log, 8)
    assert ids(await quick.take()) == list(range(1, 9))
    publish(log, 1)  # the ninth: over the slow one's queue
    assert slow.dropped == "slow reader: 8 events were waiting unread (the limit is 8)"
    assert slow.queued == 0 and await slow.take() is None
    assert log.subscribers == 1 and log.dropped_subscribers == 1
    assert ids(await quick.take()) == [9]


async def test_the_backlog_of_a_resuming_subscriber_does_not_count_against_its_queue() -> None:
    log = EventLog(capacity=100)
    publish(log, 50)
    subscription = log.subscribe(last_id=10, capacity=8)
    publish(log, 8)
    assert subscription.dropped is None
    assert ids(await subscription.take()) == list(range(11, 59))
    publish(log, 9)
    assert subscription.dropped is not None  # from now on the queue is 8 deep


async def test_a_resume_past_the_ring_starts_with_the_gap() -> None:
    log = EventLog(capacity=10)
    publish(log, 30)
    batch = await log.subscribe(last_id=5).take()
    assert batch is not None and batch[0] == Gap(6, 20)
    assert ids(batch) == list(range(21, 31))


async def test_closing_the_log_ends_every_subscription() -> None:
    log = EventLog()
    subscription = log.subscribe()
    waiting = asyncio.ensure_future(subscription.take())
    await asyncio.sleep(0)
    log.close()
    assert await asyncio.wait_for(waiting, GUARD_S) is None
    assert log.subscribe().closed


def test_a_publish_costs_an_append_per_subscriber_whatever_they_read() -> None:
    """200 subscribers, none reading: a thousand publishes stay cheap (each subscriber
    is dropped once its queue is full, and then costs nothing)."""
    log = EventLog()
    subscriptions = [log.subscribe(capacity=100) for _ in range(200)]
    started = time.perf_counter()
    publish(log, 1000)
    elapsed = time.perf_counter() - started
    assert all(s.dropped is not None for s in subscriptions)
    assert log.subscribers == 0 and log.dropped_subscribers == 200
    assert elapsed < 1.0, f"1,000 publishes to 200 subscribers took {elapsed:.2f} s"


# --------------------------------------------------------------------------- the stream

LIMITS = StreamLimits(queue=32, write_timeout=0.5, keepalive_s=0.2, batch_s=0.01)


@pytest.fixture
async def served() -> AsyncIterator[tuple[EventLog, int]]:
    log = EventLog(capacity=5000)

    async def events(request: web.Request) -> web.StreamResponse:
        return await stream_events(request, log, LIMITS)

    app = web.Application()
    app.router.add_get("/events", events)
    async with serving(app) as url:
        yield log, int(url.rsplit(":", 1)[1])
    log.close()


async def open_stream(port: int, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return sock


async def read_until_closed(sock: socket.socket) -> str:
    data = b""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(GUARD_S):
        while chunk := await loop.sock_recv(sock, 1 << 16):
            data += chunk
    return dechunk(data)


def dechunk(raw: bytes) -> str:
    """The body of a chunked HTTP/1.1 response (what the SSE parser reads)."""
    _head, _, rest = raw.partition(b"\r\n\r\n")
    body = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16) if size_line.strip() else 0
        if size == 0:
            break
        body, rest = body + rest[:size], rest[size + 2 :]
    return body.decode()


async def test_a_reader_that_never_reads_is_dropped_with_a_final_event(
    served: tuple[EventLog, int],
) -> None:
    log, port = served
    stalled = await open_stream(port, rcvbuf=4096)
    await asyncio.sleep(0.1)
    big = "x" * 2000  # fills the 64 KiB send buffer and the reader's 4 KiB quickly
    for _ in range(100):
        publish(log, 50, big)
        await asyncio.sleep(0.02)
        if log.subscribers == 0:
            break
    assert log.subscribers == 0 and log.dropped_subscribers == 1
    body = await read_until_closed(stalled)  # the shim closed it: the read ends
    stalled.close()
    messages = parse_sse(body)
    assert messages[-1].event == CLOSED_EVENT
    closed = json.loads(messages[-1].data)
    assert closed["reason"] == "slow_reader" and "slow reader" in closed["message"]
    delivered = [int(m.id) for m in messages if m.id is not None]
    assert closed["last_id"] == delivered[-1] if delivered else closed["last_id"] == 0


async def test_a_reader_that_reads_gets_every_event_in_order_while_another_is_dropped(
    served: tuple[EventLog, int],
) -> None:
    log, port = served
    stalled = await open_stream(port, rcvbuf=4096)
    reader = await open_stream(port)
    await asyncio.sleep(0.1)
    reading = asyncio.ensure_future(read_until_closed(reader))
    for _ in range(40):
        publish(log, 25, "y" * 1500)
        await asyncio.sleep(0.02)
    assert log.dropped_subscribers == 1 and log.subscribers == 1
    log.close()  # shutdown: the reader's stream ends with its own final event
    messages = parse_sse(await reading)
    assert [int(m.id) for m in messages if m.id is not None] == list(range(1, 1001))
    assert messages[-1].event == CLOSED_EVENT
    assert json.loads(messages[-1].data)["reason"] == "shutdown"
    reader.close()
    stalled.close()
