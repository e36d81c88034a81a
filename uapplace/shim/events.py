"""The shim's event routes: ``GET /api/placement/events`` (SSE) and its bus feed.

:class:`EventFeed` keeps one bus connection of its own subscribed to the
daemon's signals (:class:`uapplace.bus.events.SignalRelay`) and feeds a bounded
:class:`uapplace.bus.events.EventLog`, reconnecting after a loss. It runs whether or
not anyone is reading, so a client that reconnects with ``Last-Event-ID`` finds
what happened while it was away (within the log's capacity; beyond it, an
``EventsLost`` notice). The match rule names the daemon's well-known bus name,
which ``dbus-daemon`` follows across owner changes, so a daemon restart needs no
resubscription. Signals sent while the feed itself had no bus connection (the
user bus restarting) are not seen by anyone; the feed logs the loss and its
recovery.

:func:`stream_events` is the route handler's body: ``text/event-stream``, a
``retry:`` line, then each event as ``id``/``event``/``data`` (one JSON line:
:meth:`uapplace.bus.events.Event.to_json`), a comment every ``keepalive_s`` while
idle so the connection and any proxy between stay open. The resume point is the
``Last-Event-ID`` header (what ``EventSource`` sends on reconnect), or a
``last_event_id`` query parameter for clients that cannot set headers.

Bounded (docs/http-contract.md §5, "Events"): each stream reads its own
:class:`~uapplace.bus.events.Subscription` (at most ``queue`` unread events) and
writes what has queued in one write, at most every :data:`SSE_BATCH_S`, so a busy
feed costs each subscriber a few writes a second whatever the event rate, and
admits keep the loop. A reader whose queue overflows, or whose write waits
``write_timeout`` for it to read, is dropped: its stream gets a final
``StreamClosed`` event (``reason: slow_reader``, the newest id it was given) and is
closed; a shim shutting down sends ``reason: shutdown``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass

from aiohttp import web
from dbus_fast import BusType
from dbus_fast.aio import MessageBus

from uapplace.bus.events import (
    DEFAULT_SUBSCRIBER_QUEUE,
    EventLog,
    SignalRelay,
    Subscription,
    format_closed,
    format_sse,
    parse_last_event_id,
    sse_keepalive,
    sse_preamble,
)

log = logging.getLogger(__name__)

KEEPALIVE_S = 15.0
SSE_BATCH_S = 0.05
"""The least time between two writes to one stream: events meanwhile go out together."""
CLOSE_GRACE_S = 10.0
"""After the final event, how long a dropped reader has to read up to it before its
connection is cut (a reader that never reads cannot get it; one that is only slow can)."""
SEND_BUFFER_BYTES = 64 * 1024
"""The kernel send buffer of an SSE connection (``SO_SNDBUF``): loopback autotuning would
let a reader that never reads hold megabytes before the shim even notices."""
FEED_RETRY_S = 1.0
FEED_WARN_AFTER_S = 30.0
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class EventFeed:
    """The daemon's signals into ``log``, over a bus connection of the feed's own."""

    def __init__(self, address: str, log_: EventLog, retry_s: float = FEED_RETRY_S) -> None:
        self.address = address
        self.log = log_
        self.retry_s = retry_s
        self.relay = SignalRelay(log_)
        self.connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._bus: MessageBus | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="event-feed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._disconnect()
        self.log.close()

    def _disconnect(self) -> None:
        self.connected.clear()
        if self._bus is not None:
            self.relay.detach(self._bus)
            self._bus.disconnect()
            self._bus = None

    async def _run(self) -> None:
        """Connect, subscribe, wait for the loss, again; a failure waits ``retry_s``.

        A failure is logged at INFO (the first of an outage at DEBUG: the shim may
        start before the bus is up); one lasting :data:`FEED_WARN_AFTER_S` is a
        WARNING, once per outage."""
        noted = ""
        failing_since: float | None = None
        warned = False
        while True:
            try:
                bus = await MessageBus(bus_address=self.address, bus_type=BusType.SESSION).connect()
                self._bus = bus
                await self.relay.attach(bus)
                self.connected.set()
                if noted:
                    log.info("event feed: following the daemon's signals again")
                noted, failing_since, warned = "", None, False
                await bus.wait_for_disconnect()  # type: ignore[no-untyped-call]
                why = "bus connection lost"
            except asyncio.CancelledError:
                raise
            except Exception as err:  # every failure (connect, subscribe): retry later
                why = str(err) or type(err).__name__
            self._disconnect()
            now = time.monotonic()
            failing_since = now if failing_since is None else failing_since
            if why != noted:
                # Quiet at first: the shim may start before the bus (the warning below
                # still comes if it lasts).
                level = logging.DEBUG if not noted and failing_since == now else logging.INFO
                log.log(level, "event feed: %s; retrying every %gs", why, self.retry_s)
                noted = why
            if not warned and now - failing_since >= FEED_WARN_AFTER_S:
                log.warning(
                    "event feed: no bus for %.0fs (%s); still retrying", now - failing_since, why
                )
                warned = True
            await asyncio.sleep(self.retry_s)


def resume_point(request: web.Request) -> int | None:
    """``Last-Event-ID`` (header, else ``last_event_id`` query); :class:`EventError` if bad."""
    header = request.headers.get("Last-Event-ID")
    if header is not None and header.strip():
        return parse_last_event_id(header)
    return parse_last_event_id(request.query.get("last_event_id"))


@dataclass(frozen=True)
class StreamLimits:
    """What one SSE stream may cost (:class:`~uapplace.shim.settings.ShimSettings`)."""

    queue: int = DEFAULT_SUBSCRIBER_QUEUE
    write_timeout: float = 10.0
    keepalive_s: float = KEEPALIVE_S
    batch_s: float = SSE_BATCH_S


async def stream_events(
    request: web.Request, events: EventLog, limits: StreamLimits | None = None
) -> web.StreamResponse:
    """Serve ``events`` as SSE until the client leaves, is dropped, or the log closes.

    Raises :class:`EventError` (before anything is sent) for a bad resume point.
    """
    limits = limits or StreamLimits()
    last_id = resume_point(request)
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    subscription = events.subscribe(last_id, limits.queue)
    try:
        await response.write(sse_preamble())
        await _relay(response, subscription, limits)
        await _close(request, response, subscription, events)
    except ConnectionError:
        pass  # the client left
    finally:
        events.unsubscribe(subscription)
    return response


async def _relay(
    response: web.StreamResponse, subscription: Subscription, limits: StreamLimits
) -> None:
    """Write batches until the subscription ends (dropped, or the log closed)."""
    while True:
        batch = await subscription.take(limits.keepalive_s)
        if batch is None:
            return
        data = b"".join(format_sse(item) for item in batch) if batch else sse_keepalive()
        try:
            async with asyncio.timeout(limits.write_timeout):
                await response.write(data)
        except TimeoutError:
            subscription.drop(
                f"slow reader: a write waited {limits.write_timeout:g}s for the client to read"
            )
            return
        if batch:
            await asyncio.sleep(limits.batch_s)


async def _close(
    request: web.Request,
    response: web.StreamResponse,
    subscription: Subscription,
    events: EventLog,
) -> None:
    """The final ``StreamClosed`` event, then the connection closed (bounded: a reader
    that does not read is cut after :data:`CLOSE_GRACE_S`)."""
    if subscription.dropped is not None:
        reason, message = "slow_reader", subscription.dropped
        log.info("event stream dropped: %s", message)
    else:
        reason, message = "shutdown", "uapplace-shim is stopping"
    last = subscription.delivered_id
    text = f"{message}; resume with Last-Event-ID {last}" if last else message
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(1.0):  # the transport's buffer is drained or not: bounded
            await response.write(format_closed(reason, text, last))
    transport = request.transport
    if transport is not None and not transport.is_closing():
        transport.close()
        asyncio.get_running_loop().call_later(CLOSE_GRACE_S, transport.abort)
