"""The shim's aiohttp application: the route table wired to the handlers, the middleware that
checks access and turns every failure into a JSON answer, and the app's lifecycle (the event
feed started with it, the bus connection closed after it).

Called by :func:`uapplace.shim.server.serve` (and by tests, which serve the app
themselves). One app is one :class:`uapplace.shim.handlers.Shim` with its
:class:`uapplace.shim.gateway.BusGateway` and
:class:`uapplace.shim.events.EventFeed`; all of it hangs off the app, nothing off
the module.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

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


def route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return "unmatched" if resource is None else resource.canonical


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


def make_middleware(shim: Shim) -> Any:
    @web.middleware
    async def answer(request: web.Request, handler: Handler) -> web.StreamResponse:
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
        shim.metrics.responses.labels(route_label(request), str(response.status)).inc()
        return response

    return answer


def add_routes(router: web.UrlDispatcher, shim: Shim) -> None:
    router.add_post(ROUTES["admit"], shim.admit)
    router.add_get(ROUTES["state"], shim.state)
    router.add_get(ROUTES["pending"], shim.pending)
    router.add_get(ROUTES["preview"], shim.preview)
    router.add_post(ROUTES["resolve"], shim.resolve)
    router.add_post(ROUTES["dismiss"], shim.dismiss)
    router.add_post(ROUTES["load"], shim.load)
    router.add_post(ROUTES["unload"], shim.unload)
    router.add_post(ROUTES["auto"], shim.auto)
    router.add_get(ROUTES["targets"], shim.targets)
    router.add_get(ROUTES["events"], shim.event_stream)
    router.add_get(ROUTES["metrics"], shim.metrics_page)
    router.add_get(ROUTES["openapi"], shim.openapi)


def create_app(settings: ShimSettings) -> web.Application:
    gateway = BusGateway(settings.bus_address, settings.metrics, settings.peer_socket)
    shim = Shim(settings, gateway)
    app = web.Application(middlewares=[make_middleware(shim)])
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
