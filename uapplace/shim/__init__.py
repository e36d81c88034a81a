"""``uapplace-shim``: the loopback HTTP face of ``uapplaced`` (docs/http-contract.md §1, §4, §5).

The UAP proxy asks a *placement controller* over HTTP; pointing its
``PROXY_PLACEMENT_CONTROLLER`` at this shim makes ``uapplaced`` that controller.
Each route is one call on the ``org.uap.Placement1`` bus API over one persistent
bus connection (reconnected on loss). The shim holds no placement state. Admit,
the hot path, goes over uapplaced's Admit-only peer-to-peer socket
(``$XDG_RUNTIME_DIR/uapplace/bus``, :mod:`uapplace.bus.peer`) once the shim has
checked that the process listening there owns ``org.uap.Placement1`` on its bus;
otherwise (or with ``--no-peer``) over the bus too.

May import: ``core``, ``files``, ``bus``, ``io``. Never the daemon or its machinery
(the controller, enforcement, recovery, publication, measuring, consent), nor the
ledger, the journal or unit control: the shim holds no placement state.

Routes (``GET /openapi.json`` describes each one with its schemas), each with
its bus call and who may call it:

- ``POST /api/placement/admit`` → ``Admit``: loopback peers, no token;
- ``GET /api/placement/state`` → ``GetState``, ``GET /api/placement/pending`` →
  ``ListPending``, ``GET /api/placement/preview?model=<id>[&cells=N]`` →
  ``Preview``, ``GET /api/placement/targets`` (``GetState.targets``),
  ``GET /api/placement/events`` (SSE of the daemon's signals): open;
- ``POST /api/placement/resolve`` → ``Apply``, ``dismiss`` → ``Dismiss``,
  ``load`` → ``Load``, ``unload`` → ``Unload``, ``auto`` → ``GetAutoPolicy``
  (``{}``) or ``SetAutoPolicy(changes, consent=yes)``: token. ``resolve``,
  ``load`` and ``unload`` take ``expected_victims`` (the approval signature,
  sent as the bus ``as expected``); it is required whenever the call would stop
  something;
- ``GET /metrics`` (Prometheus text; gauges from ``GetState``), ``GET /openapi.json``: open.

Access. Only the shim's own user (and ``--allow-uid`` uids): each connection's peer
uid is asked of the kernel when it is accepted (:mod:`~uapplace.shim.peers`), and
another user's connection gets ``403`` naming its uid before any route, logged once per
10 s. Every request must come from a loopback peer (``127.0.0.1``, ``::1``,
``::ffff:127.0.0.1``); admit answers anything else ``403 {"error": "placement
admit is loopback-only"}`` before its body is read. Routes other than admit also
require a loopback ``Host`` header (or none), so a web page that rebinds a DNS
name to 127.0.0.1 cannot read them; any request whose ``Origin`` is not a
loopback page is ``403``, and admit takes ``application/json`` only (``415``).
Writes need ``x-uap-dashboard-token`` equal to the token in
``$XDG_RUNTIME_DIR/uapplace/token`` (created 0600 on first start).

Bodies. At most 10240 bytes (``413``); JSON objects only; a wrong type or an
unknown field is a ``400`` naming the field. Every error is ``{"error": "…"}``.

Limits (issue 11; the shipped unit adds ``LimitNOFILE=``). A request's headers
must arrive within ``--header-timeout`` (10 s) of the connection opening or of
its previous response, and an idle keep-alive connection is closed after as
long (the proxy's httpx pool drops idle ones after 5 s, so it is never surprised);
a body within ``--body-timeout`` (10 s), else ``408`` and the connection closed.
At most ``--max-connections`` (512, lowered to fit ``RLIMIT_NOFILE``) connections
are served at once; one over that gets ``503`` at once, unread, and is closed,
with one warning per 10 s, not one per connection. A client that hangs up
mid-body is a debug line, not an error; a request aiohttp cannot parse is one
INFO line, never a traceback. Each SSE subscriber reads its own bounded queue and a
slow one is dropped with a final ``StreamClosed`` event (docs/http-contract.md §5).

Why 14 modules: the shim is one process with its own command line, sockets, guard,
routes, bodies and exposition; each concern below is one module, and none of them is
used outside the shim.

The modules, each owning one concern:

- :mod:`~uapplace.shim.server`: the command line, the sockets, the serve loop (:func:`main`);
- :mod:`~uapplace.shim.overload`: the connection cap, descriptor limits, quiet bad requests;
- :mod:`~uapplace.shim.peers`: each connection's peer uid, the gate for other users;
- :mod:`~uapplace.shim.app`: the aiohttp app, the guard around every route, its lifecycle;
- :mod:`~uapplace.shim.routes`: the route table;
- :mod:`~uapplace.shim.access`: loopback, ``Host``/``Origin``, JSON-only admit, the token;
- :mod:`~uapplace.shim.handlers`: each route's bus call and the status mapping;
- :mod:`~uapplace.shim.gateway`: the bus connection, the peer socket, the deadlines;
- :mod:`~uapplace.shim.bodies`: request bodies (pydantic), admit's lenient parse, reading;
- :mod:`~uapplace.shim.responses`: JSON answers and :class:`~uapplace.shim.responses.HttpError`;
- :mod:`~uapplace.shim.settings`: :class:`~uapplace.shim.settings.ShimSettings` and defaults;
- :mod:`~uapplace.shim.events`, :mod:`~uapplace.shim.metrics`, :mod:`~uapplace.shim.openapi`:
  the event feed and SSE route, the Prometheus exposition, the OpenAPI document.
"""

from __future__ import annotations

from uapplace.shim.server import main

__all__ = ["main"]
