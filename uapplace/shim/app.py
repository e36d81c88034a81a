"""The shim's aiohttp application: the route table wired to the handlers, each behind the guard
that checks access and turns every failure into a JSON answer (:func:`guarded`), and the app's
lifecycle (the event feed started with it, the bus connection closed after it).

Called by :func:`uapplace.shim.server.serve` (and by tests, which serve the app
themselves). One app is one :class:`uapplace.shim.handlers.Shim` with its
:class:`uapplace.shim.gateway.BusGateway` and
:class:`uapplace.shim.events.EventFeed`; all of it hangs off the app, nothing off
the module.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from uapplace.shim.access import check_access
from uapplace.shim.events import EventFeed
from uapplace.shim.gateway import BusGateway
from uapplace.shim.handlers import Shim
from uapplace.shim.responses import ClientGone, HttpError, error_response, json_response, shown
from uapplace.shim.routes import ROUTES
from uapplace.shim.settings import ShimSettings

log = logging.getLogger(__name__)

SHIM_KEY = web.AppKey("uapplace_shim", Shim)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


UNMATCHED = "unmatched"
"""The route label of a request no route took (404, 405)."""
FALLBACK_PATH = "/{unmatched:.*}"
"""Registered last, for every method: what the router found no route for."""


async def no_route(request: web.Request) -> web.Response:
    """What aiohttp's router would refuse: ``405`` when the path has other methods, else ``404``.

    The same sets aiohttp computes (each resource's allowed methods for this path),
    raised as its own exceptions so :func:`http_exception_response` words them."""
    fallback = request.match_info.route.resource
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not fallback:
            _match, methods = await resource.resolve(request)
            allowed |= methods
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    raise web.HTTPNotFound()


def http_exception_response(request: web.Request, err: web.HTTPException) -> web.Response:
    """The router's 404/405 (and any other aiohttp HTTP error) as JSON."""
    if isinstance(err, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(err.allowed_methods))
        return error_response(
            405,
            f"method {request.method} is not allowed on {request.path}; allowed: {allowed}",
            {"Allow": allowed},
        )
    if isinstance(err, web.HTTPNotFound):
        return error_response(404, f"no route {request.method} {shown(request.path, 200)}")
    return error_response(err.status, err.reason)


READ_SIZE = 16 * 1024
"""What one read of a client connection asks the kernel for (asyncio's default: 256 KiB)."""


def small_reads(transport: asyncio.BaseTransport | None) -> None:
    """Have asyncio read this connection in :data:`READ_SIZE` pieces.

    asyncio's socket transport reads with ``recv(max_size)``, 256 KiB, and every such
    call allocates that much: on this machine's glibc a 300-byte read then costs 44 µs
    against 9 µs at 16 KiB (issue 23, docs/performance.md "Reads of 256 KiB"). ``max_size``
    is a plain attribute of the transport (asyncio ``selector_events``); a transport
    without one is left as it is."""
    if transport is not None and getattr(transport, "max_size", 0) > READ_SIZE:
        transport.max_size = READ_SIZE  # type: ignore[attr-defined]


def guarded(shim: Shim, handler: Handler, label: str) -> Handler:
    """``handler`` behind the access checks, every failure a JSON answer, every answer counted.

    What an aiohttp middleware would do, wrapped around each route once at start-up
    instead: a middleware costs every request two more coroutine layers (ours and
    aiohttp's ``_fix_request_current_app``), about 10 to 30 µs of a 0.3 ms admit on
    this machine (issue 23, docs/performance.md)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        small_reads(request.transport)  # from this connection's next request on
        try:
            check_access(request)
            response = await handler(request)
        except HttpError as err:
            response = json_response(err.body or {"error": err.message}, err.status)
            if err.status == 408:
                response.force_close()  # a client this slow does not keep the connection
        except web.HTTPException as err:
            response = http_exception_response(request, err)
        except ClientGone as err:  # routine: a client timed out or hung up mid-body
            log.debug("%s %s: the client went away (%s)", request.method, request.path, err)
            response = error_response(400, "the client closed the connection mid-request")
        except Exception:  # one bad request must never take the shim down
            log.exception("unexpected error answering %s %s", request.method, request.path)
            response = error_response(500, "internal error in uapplace-shim (see its log)")
        shim.metrics.count_response(label, response.status)
        return response

    return answer


def add_routes(router: web.UrlDispatcher, shim: Shim) -> None:
    def post(name: str, handler: Handler) -> None:
        router.add_post(ROUTES[name], guarded(shim, handler, ROUTES[name]))

    def get(name: str, handler: Handler) -> None:
        router.add_get(ROUTES[name], guarded(shim, handler, ROUTES[name]))

    post("admit", shim.admit)
    get("state", shim.state)
    get("pending", shim.pending)
    get("preview", shim.preview)
    post("resolve", shim.resolve)
    post("dismiss", shim.dismiss)
    post("load", shim.load)
    post("unload", shim.unload)
    post("auto", shim.auto)
    get("targets", shim.targets)
    get("events", shim.event_stream)
    get("metrics", shim.metrics_page)
    get("openapi", shim.openapi)
    router.add_route("*", FALLBACK_PATH, guarded(shim, no_route, UNMATCHED))


def create_app(settings: ShimSettings) -> web.Application:
    gateway = BusGateway(settings.bus_address, settings.metrics, settings.peer_socket)
    shim = Shim(settings, gateway)
    app = web.Application()
    app[SHIM_KEY] = shim

    async def close_bus(_: web.Application) -> None:
        await gateway.close()

    feed = EventFeed(settings.bus_address, shim.events)

    async def start_feed(_: web.Application) -> None:
        feed.start()

    async def stop_feed(_: web.Application) -> None:
        await feed.close()  # ends every event stream, so shutdown does not wait on them

    app.on_startup.append(start_feed)
    app.on_shutdown.append(stop_feed)
    app.on_cleanup.append(close_bus)
    add_routes(app.router, shim)
    return app
