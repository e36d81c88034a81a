"""``uapplace-shim``: the loopback HTTP face of ``uapplaced`` (CONTRACT.md §1 and §4).

The UAP proxy asks a *placement controller* over HTTP; pointing its
``PROXY_PLACEMENT_CONTROLLER`` at this shim makes ``uapplaced`` that controller.
Each route is one call on the ``org.uap.Placement1`` bus API over one persistent
bus connection (reconnected on loss). The shim holds no placement state. Admit,
the hot path, goes over uapplaced's Admit-only peer-to-peer socket
(``$XDG_RUNTIME_DIR/uapplace/bus``, :mod:`uapplace.peer`) once the shim has
checked that the process listening there owns ``org.uap.Placement1`` on its bus;
otherwise (or with ``--no-peer``) over the bus too (see :class:`BusGateway`).

Routes (``GET /openapi.json`` describes each one with its schemas), each with
its bus call and who may call it:

- ``POST /api/placement/admit`` → ``Admit``: loopback peers, no token;
- ``GET /api/placement/state`` → ``GetState``, ``GET /api/placement/pending`` →
  ``ListPending``, ``GET /api/placement/preview?model=<id>[&cells=N]`` →
  ``Preview``: open;
- ``POST /api/placement/resolve`` → ``Apply``, ``dismiss`` → ``Dismiss``,
  ``load`` → ``Load``, ``unload`` → ``Unload``, ``auto`` → ``GetAutoPolicy``
  (``{}``) or ``SetAutoPolicy(changes, consent=yes)``: token. ``resolve``,
  ``load`` and ``unload`` take ``expected_victims`` (the approval signature,
  sent as the bus ``as expected``); it is required whenever the call would stop
  something (see :func:`signature_of`);
- ``GET /metrics`` (Prometheus text; gauges from ``GetState``, see
  :mod:`uapplace.metrics`), ``GET /openapi.json``: open.

Access. The shim binds loopback addresses only (``127.0.0.1``, ``::1``,
``localhost``) and refuses to start on anything else. Every request must also
come from a loopback peer (``127.0.0.1``, ``::1``, ``::ffff:127.0.0.1``); admit
answers anything else ``403 {"error": "placement admit is loopback-only"}``
before its body is read. Routes other than admit also require a loopback
``Host`` header (or none), so a web page that rebinds a DNS name to 127.0.0.1
cannot read them. Writes need ``x-uap-dashboard-token`` equal to the token in
``$XDG_RUNTIME_DIR/uapplace/token`` (created 0600 on first start).

Bodies. At most 10240 bytes (``413``); JSON objects only; a wrong type or an
unknown field is a ``400`` naming the field. Every error is ``{"error": "…"}``.
JSON the shim writes is compact (``separators=(",", ":")``, UTF-8, no ASCII
escaping) like the published controller's ``JSON.stringify``. The daemon's JSON
for state, pending, preview and the auto policy passes through byte for byte;
Apply/Load/Unload results are parsed (the metrics count their outcome) and sent
compact, unchanged in content.

Limits (issue 11; the shipped unit adds ``LimitNOFILE=``). A request's headers
must arrive within ``--header-timeout`` (10 s) of the connection opening or of
its previous response, and an idle keep-alive connection is closed after as
long (the proxy's httpx pool drops idle ones after 5 s, so it is never surprised);
a body within ``--body-timeout`` (10 s), else ``408`` and the connection closed.
At most ``--max-connections`` (512, lowered to fit ``RLIMIT_NOFILE``) connections
are served at once; one over that gets ``503`` at once, unread, and is closed,
with one warning per 10 s, not one per connection. Admit takes
``application/json`` only (``415``), and any request whose ``Origin`` is not a
loopback page is ``403``: browsers cannot send JSON cross-site without a
preflight, nor drop ``Origin``, so a web page cannot create parks. A client that
hangs up mid-body is a debug line, not an error.

Status mapping of the daemon's answers:

- Admit: always ``200`` with exactly ``{"decision":"forward","target_id":…}`` or
  ``{"decision":"park","placement_id":…,"reason":…}``.
- An enforcement the daemon ran and reports as failed (rolled back or not) is a
  normal reply: ``200`` with ``"ok": false`` in the Apply JSON.
- Bus errors: ``NotFound`` and ``UnknownModel`` → 404, ``Drifted`` → 409 with an
  Apply-style body (``ok: false``, ``error``: "victim set changed: …"),
  ``Busy`` → 409, ``InvalidArgument`` → 400, ``NotAuthorized`` → 403,
  ``Failed`` → 500 (the daemon could not even produce a result), any other
  error name → 502. One ``Failed`` is a 503 instead: "<Method> is not
  available: …" (the daemon is up but has no systemd user manager to enforce
  with, or has not wired it yet): the daemon did not fail, the machinery is
  missing, and the 503 carries the daemon's message.
- The daemon unreachable or slower than the deadline (admit 1.5 s, well inside
  the proxy's 2 s; reads 10 s; enforcements 900 s) → 503
  ``{"error": "placement daemon unavailable: …"}``: the proxy then falls back to
  read-only admission instead of hanging.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import resource
import secrets
import signal
import socket
import stat
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from dbus_fast import MessageType
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from uapplace.admission import MAX_MODEL_ID_CHARS
from uapplace.client import PlacementClient, PlacementError, bus_daemon_message, user_bus_address
from uapplace.events import EventError, EventLog
from uapplace.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from uapplace.metrics import ShimMetrics
from uapplace.model import DEFAULT_CELLS, PAUSE_SUFFIX
from uapplace.paths import BUS_NAME, Paths
from uapplace.peer import connect_peer
from uapplace.shim_events import EventFeed, stream_events
from uapplace.shim_openapi import openapi_document

log = logging.getLogger("uapplace.shim")

T = TypeVar("T")

BODY_LIMIT = 10240
FIELD_LIMIT = 128
U32_MAX = 2**32 - 1
TOKEN_HEADER = "x-uap-dashboard-token"
ADMIT_LOOPBACK_ONLY = "placement admit is loopback-only"
LOOPBACK_PEERS = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})
LOOPBACK_BIND_HOSTS = {
    "127.0.0.1": ("127.0.0.1",),
    "::1": ("::1",),
    "localhost": ("127.0.0.1", "::1"),
}
LOOPBACK_HOST_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
JSON_CONTENT_TYPE = "application/json"

ADMIT_DEADLINE_S = 1.5
READ_DEADLINE_S = 10.0
ADMIT_REPLY_MARGIN_S = 0.25
"""Of the admit deadline, what the daemon leaves for its reply to reach us (``AdmitBy``)."""
DEADLINE_PASSED = "deadline_passed"
ENFORCEMENT_DEADLINE_S = 900.0
SCRAPE_DEADLINE_S = 2.0
PEER_RETRY_S = 5.0
"""How often the shim tries the daemon's peer socket again while it cannot be used."""
PEER_CONNECT_S = 0.25
"""The most one attempt at the peer socket may take out of an admit's deadline."""
HEADER_TIMEOUT_S = 10.0
"""A connection must deliver a request's complete headers within this long of connecting
(or of its previous response); it is also how long an idle keep-alive connection lives."""
BODY_TIMEOUT_S = 10.0
"""The most reading one request body may take (a 10 KiB body is milliseconds on loopback)."""
MAX_CONNECTIONS = 512
"""Open HTTP connections served at once; more are answered 503 and closed at once."""
ACCEPT_BACKLOG = 128
FD_HEADROOM = 64
"""Descriptors kept free beside the connections (bus, peer socket, logs, listeners)."""
OVERLOAD_LOG_EVERY_S = 10.0
BUS_CALLS_IN_FLIGHT = 96
"""Calls the shim keeps outstanding on its one bus connection; more wait (inside their
deadline). dbus-daemon refuses a connection's 129th pending call with ``LimitsExceeded``
under its built-in limits (system bus, private buses); the user bus allows 50,000."""

UNAVAILABLE_ERRORS = frozenset(
    {
        "org.freedesktop.DBus.Error.ServiceUnknown",
        "org.freedesktop.DBus.Error.NameHasNoOwner",
        "org.freedesktop.DBus.Error.NoReply",
        "org.freedesktop.DBus.Error.Timeout",
        "org.freedesktop.DBus.Error.TimedOut",
        "org.freedesktop.DBus.Error.Disconnected",
        "org.freedesktop.DBus.Error.NoServer",
        "org.freedesktop.DBus.Error.LimitsExceeded",
    }
)
STATUS_BY_BUS_ERROR = {
    "NotFound": 404,
    "UnknownModel": 404,
    "Drifted": 409,
    "Busy": 409,
    "InvalidArgument": 400,
    "NotAuthorized": 403,
    "Failed": 500,
    "Unavailable": 503,
}
ROUTES = {
    "admit": "/api/placement/admit",
    "state": "/api/placement/state",
    "pending": "/api/placement/pending",
    "preview": "/api/placement/preview",
    "resolve": "/api/placement/resolve",
    "dismiss": "/api/placement/dismiss",
    "load": "/api/placement/load",
    "unload": "/api/placement/unload",
    "auto": "/api/placement/auto",
    "targets": "/api/placement/targets",
    "events": "/api/placement/events",
    "metrics": "/metrics",
    "openapi": "/openapi.json",
}


# --------------------------------------------------------------------------- errors and JSON


class HttpError(Exception):
    """An answer other than success: becomes ``status`` with ``{"error": message}``."""

    def __init__(
        self,
        status: int,
        message: str,
        body: Mapping[str, Any] | None = None,
        *,
        bus_error: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.body = body
        """Sent instead of ``{"error": message}`` when set."""
        self.bus_error = bus_error
        """The daemon's error (short name) this answer stands for, if any."""


class DaemonUnavailable(Exception):
    """No bus, no daemon on it, or no answer before the deadline."""


class ClientGone(Exception):
    """The client hung up before its request body arrived: nobody to answer, nothing wrong."""


def encode_json(value: Any) -> bytes:
    """Compact UTF-8 JSON; ASCII escapes only when a string holds a lone surrogate."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":")).encode("ascii")


def json_response(
    value: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=encode_json(value),
        status=status,
        content_type=JSON_CONTENT_TYPE,
        charset="utf-8",
        headers=headers,
    )


def raw_json_response(text: str, status: int = 200) -> web.Response:
    """JSON text from the bus, passed through unchanged."""
    return web.Response(
        body=text.encode("utf-8"), status=status, content_type=JSON_CONTENT_TYPE, charset="utf-8"
    )


def error_response(
    status: int, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    return json_response({"error": message}, status, headers)


def shown(value: str, limit: int = 64) -> str:
    """A user-supplied string quoted for an error message, cut to ``limit`` characters."""
    cut = value if len(value) <= limit else value[:limit] + "…"
    return ascii(cut)


# --------------------------------------------------------------------------- request bodies


def check_bus_text(value: str) -> str:
    """A string the bus can carry: valid Unicode (no lone surrogates) and no NUL."""
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
    return value


BusText = Annotated[str, Field(min_length=1, max_length=1024), AfterValidator(check_bus_text)]
IdList = Annotated[list[BusText], Field(max_length=256)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class VictimRefBody(BaseModel):
    """One victim the operator approved; other fields a preview victim carries are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: BusText
    config: BusText
    action: Literal["stop", "pause"] = "stop"
    """A preview victim's ``action`` (issue 12): approving a pause is not approving a stop."""


class ResolveBody(_Body):
    placement_id: BusText
    option: int = Field(ge=1, le=U32_MAX, description="1-based index into the entry's options")
    expected_victims: list[VictimRefBody] | None = Field(
        default=None,
        max_length=256,
        description="the approval signature; the enforcement refuses if the victim set changed",
    )


class DismissBody(_Body):
    placement_id: BusText


class ModelBody(_Body):
    model: BusText
    expected_victims: list[VictimRefBody] | None = Field(
        default=None,
        max_length=256,
        description=(
            "the approval signature (load: the victims of the preview's first option; unload: "
            "the residents that stop); required whenever something would stop"
        ),
    )


MISSING_SIGNATURE = (
    "expected_victims is required when the call would stop something: send the victims "
    "the operator approved ([{model, config}], as preview/pending show them)"
)


def signature_of(refs: list[VictimRefBody] | None) -> list[str]:
    """CONTRACT §4 ``expected_victims`` → the bus signature (``model/config`` strings).

    Omitted means "approve stopping nothing" (``[]``), never "skip the check": a
    call that would stop something then comes back ``Drifted`` (409), and the
    error says ``expected_victims`` is required (:data:`MISSING_SIGNATURE`).
    """
    if refs is None:
        return []
    suffix = {"stop": "", "pause": PAUSE_SUFFIX}
    return sorted(f"{v.model}/{v.config}{suffix[v.action]}" for v in refs)


class AutoBody(_Body):
    """``{}`` reads the policy; any other field is a change (``yes`` is the consent)."""

    enable: bool | None = None
    disable: bool | None = None
    allow_displace: IdList | None = None
    disallow_displace: IdList | None = None
    allow_unload: IdList | None = None
    disallow_unload: IdList | None = None
    unload_idle_after_secs: int | None = Field(default=None, ge=0, le=U32_MAX)
    yes: bool = False

    def changes(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, exclude={"yes"})


@dataclass(frozen=True)
class AdmitRequest:
    model_id: str
    client: str
    session: str
    cells: int


def parse_admit(payload: Mapping[str, Any]) -> AdmitRequest:
    """CONTRACT §1's body, leniently where the contract is lenient (``cells``)."""
    model_id = payload.get("model_id")
    if model_id is None or model_id == "":
        raise HttpError(400, "missing model_id")
    text_fields = {
        "model_id": model_id,
        "client": payload.get("client"),
        "session": payload.get("session"),
    }
    for name, value in text_fields.items():
        if value is not None and not isinstance(value, str):
            raise HttpError(400, f"{name} must be a string, got {type(value).__name__}")
        if isinstance(value, str):
            try:
                check_bus_text(value)
            except ValueError as err:
                raise HttpError(400, f"{name} {err}") from None
    if len(model_id) > MAX_MODEL_ID_CHARS:  # the daemon parks these invalid_request, no entry
        raise HttpError(400, f"model_id longer than {MAX_MODEL_ID_CHARS} characters")
    cells = payload.get("cells")
    if isinstance(cells, int) and not isinstance(cells, bool) and cells > 0:
        cells_used = min(cells, U32_MAX)
    else:
        cells_used = DEFAULT_CELLS
    return AdmitRequest(
        model_id=model_id,
        client=(payload.get("client") or "")[:FIELD_LIMIT],
        session=(payload.get("session") or "")[:FIELD_LIMIT],
        cells=cells_used,
    )


def validation_message(err: ValidationError) -> str:
    problems = err.errors(include_url=False)
    first = problems[0]
    where = ".".join(str(part) for part in first["loc"]) or "body"
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"invalid field {where}: {first['msg']}{more}"


async def read_body(request: web.Request) -> bytes:
    """The request body, refusing more than :data:`BODY_LIMIT` bytes without reading it all.

    Bounded in time too (``body_timeout``, a slow-body client holds a connection
    no longer than that: ``408``); a client that hangs up mid-body is
    :class:`ClientGone`, not an error of ours.
    """
    declared = request.content_length
    if declared is not None and declared > BODY_LIMIT:
        raise HttpError(413, f"request body over {BODY_LIMIT} bytes")
    limit_s = body_timeout(request)
    try:
        async with asyncio.timeout(limit_s):
            return await _read_body_within_limit(request)
    except TimeoutError:
        raise HttpError(408, f"request body not received within {limit_s:g} s") from None
    except (ConnectionError, HttpProcessingError) as err:
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ClientGone(f"{type(err).__name__}: {err}") from None
        raise HttpError(400, f"request body could not be read: {err}") from None


def body_timeout(request: web.Request) -> float:
    shim = request.app.get(SHIM_KEY)
    return shim.settings.body_timeout if shim is not None else BODY_TIMEOUT_S


async def _read_body_within_limit(request: web.Request) -> bytes:
    data = bytearray()
    while True:
        chunk = await request.content.read(BODY_LIMIT + 1 - len(data))
        if not chunk:
            return bytes(data)
        data += chunk
        if len(data) > BODY_LIMIT:
            raise HttpError(413, f"request body over {BODY_LIMIT} bytes")


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; an empty body is ``{}``."""
    raw = await read_body(request)
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HttpError(400, f"request body is not valid JSON: {err}") from None
    except RecursionError:
        raise HttpError(400, "request body is not valid JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise HttpError(400, f"request body must be a JSON object, got {type(value).__name__}")
    return value


ModelT = TypeVar("ModelT", bound=BaseModel)


async def read_model(request: web.Request, model: type[ModelT]) -> ModelT:
    payload = await read_json_object(request)
    try:
        return model.model_validate(payload)
    except ValidationError as err:
        raise HttpError(400, validation_message(err)) from None


# --------------------------------------------------------------------------- access checks


def peer_host(request: web.Request) -> str | None:
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    if isinstance(peer, tuple | list) and peer:
        return str(peer[0])
    return None


def is_loopback_peer(request: web.Request) -> bool:
    return peer_host(request) in LOOPBACK_PEERS


def host_header_is_loopback(host: str | None) -> bool:
    """``Host`` names this machine's loopback (any port), or is absent (HTTP/1.0)."""
    if not host:
        return True
    name = host
    if name.startswith("["):
        name = name[1 : name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    return name.lower() in LOOPBACK_HOST_NAMES


def load_or_create_token(path: Path) -> str:
    """The dashboard token, created (0600, directory 0700) when missing.

    Refuses (``ValueError`` naming the path) a token file or directory that other
    users could read, one owned by someone else, or an empty one.
    """
    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    dir_info = directory.stat()
    if dir_info.st_uid != os.getuid() or dir_info.st_mode & 0o077:
        raise ValueError(
            f"{directory}: must be a directory owned by uid {os.getuid()} with mode 0700 "
            f"(it is uid {dir_info.st_uid}, mode {stat.S_IMODE(dir_info.st_mode):04o})"
        )
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _read_token(path)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        token = secrets.token_urlsafe(32)
        handle.write(token + "\n")
    return token


def _read_token(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, encoding="utf-8") as handle:
        info = os.fstat(handle.fileno())
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise ValueError(
                f"{path}: the token file must be owned by uid {os.getuid()} with mode 0600 "
                f"(it is uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})"
            )
        token = handle.read().strip()
    if not token:
        raise ValueError(f"{path}: the token file is empty; delete it to get a new token")
    return token


def token_matches(given: str | None, token: str) -> bool:
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "replace"), token.encode("utf-8"))


# --------------------------------------------------------------------------- the bus side


class BusGateway:
    """One persistent bus connection to ``uapplaced``, reconnected on loss; and, for
    ``Admit``, the daemon's peer-to-peer socket when it may be used.

    Every call runs under a deadline covering the (re)connect and the call, and
    its latency lands in the metrics whatever the outcome.

    The peer socket (:mod:`uapplace.peer`) skips ``dbus-daemon``'s two hops on the
    hot path. It is used only once :func:`uapplace.peer.connect_peer` has checked
    that its listener is the process owning ``org.uap.Placement1`` on this bus;
    until then, after a failed attempt (retried at most every
    :data:`PEER_RETRY_S`), or with ``peer_socket=None``, admits take the bus.
    A peer link lost mid-call is dropped and that call retried on the bus.
    At most :data:`BUS_CALLS_IN_FLIGHT` calls are outstanding on the bus
    connection at once (a burst queues here instead of being refused by
    ``dbus-daemon``); a ``LimitsExceeded`` that comes anyway is a ``503``.
    """

    def __init__(self, address: str, metrics: ShimMetrics, peer_socket: Path | None = None) -> None:
        self.address = address
        self.metrics = metrics
        self.peer_socket = peer_socket
        self._client: PlacementClient | None = None
        self._connecting = asyncio.Lock()
        self._peer: PlacementClient | None = None
        self._peer_retry_at = 0.0
        self._peer_note = ""
        self._bus_slots = asyncio.Semaphore(BUS_CALLS_IN_FLIGHT)

    async def close(self) -> None:
        self._drop_peer()
        if self._client is not None:
            self._client.disconnect()
            self._client = None

    @property
    def on_peer(self) -> bool:
        """Whether admits currently go over the peer socket."""
        return self._peer is not None and self._peer.bus.connected

    def _drop_peer(self) -> None:
        if self._peer is not None:
            self._peer.disconnect()
            self._peer = None

    def _note_peer(self, note: str) -> None:
        """Log how admits travel, once per change."""
        if note != self._peer_note:
            self._peer_note = note
            log.info("%s", note)

    async def _peer_client(self) -> PlacementClient | None:
        """The peer link, (re)made when allowed; ``None``: use the bus."""
        if self.on_peer:
            return self._peer
        self._drop_peer()
        now = time.monotonic()
        if self.peer_socket is None or now < self._peer_retry_at:
            return None
        self._peer_retry_at = now + PEER_RETRY_S
        try:
            # Bounded on its own, so a peer socket that hangs costs this admit little.
            async with asyncio.timeout(PEER_CONNECT_S):
                owner = await self._owner_pid(await self._connected())
                bus = await connect_peer(self.peer_socket, owner)
        except Exception as err:  # every failure means "stay on the bus"
            why = str(err) or type(err).__name__
            self._note_peer(f"admits go over the bus (peer socket {self.peer_socket}: {why})")
            return None
        self._peer = PlacementClient(bus, call_timeout=None)
        self._note_peer(
            f"admits go over the peer socket {self.peer_socket} (uapplaced pid {owner})"
        )
        return self._peer

    @staticmethod
    async def _owner_pid(client: PlacementClient) -> int:
        reply = await client.bus.call(
            bus_daemon_message("GetConnectionUnixProcessID", "s", [BUS_NAME])
        )
        if reply is None or reply.message_type is not MessageType.METHOD_RETURN:
            raise DaemonUnavailable(f"no pid for {BUS_NAME}: {reply.body if reply else 'no reply'}")
        return int(reply.body[0])

    async def _connected(self) -> PlacementClient:
        client = self._client
        if client is not None and client.bus.connected:
            return client
        async with self._connecting:
            if self._client is not None and self._client.bus.connected:
                return self._client
            await self.close()
            try:
                # Every call runs under its own deadline (call() below), so no second one.
                self._client = await PlacementClient.connect(self.address, call_timeout=None)
            except Exception as err:  # every connect failure means "unavailable"
                raise DaemonUnavailable(
                    f"cannot connect to the bus at {self.address}: {err}"
                ) from None
            return self._client

    async def call(
        self,
        method: str,
        deadline: float,
        work: Callable[[PlacementClient], Awaitable[T]],
        *,
        via_peer: bool = False,
    ) -> T:
        started = time.perf_counter()
        outcome = "ok"
        try:
            async with asyncio.timeout(deadline):
                peer = await self._peer_client() if via_peer else None
                if peer is not None:
                    try:
                        return await work(peer)
                    except PlacementError:
                        raise  # the daemon's own answer
                    except Exception as err:
                        if peer.bus.connected:
                            raise
                        self._drop_peer()
                        why = str(err) or type(err).__name__
                        self._note_peer(f"peer socket lost ({why}); admits go over the bus")
                async with self._bus_slots:
                    client = await self._connected()
                    return await work(client)
        except TimeoutError:
            outcome = "Timeout"
            raise DaemonUnavailable(f"{method}: no answer within {deadline:g} s") from None
        except PlacementError as err:
            outcome = err.short
            if err.name in UNAVAILABLE_ERRORS:
                raise DaemonUnavailable(f"{method}: {err.message}") from None
            raise
        except DaemonUnavailable:
            outcome = "Unreachable"
            raise
        except Exception as err:  # a lost connection surfaces as many types
            outcome = type(err).__name__
            if self._client is not None and not self._client.bus.connected:
                await self.close()
                raise DaemonUnavailable(f"{method}: bus connection lost ({err})") from None
            raise HttpError(502, f"bus call {method} failed: {type(err).__name__}: {err}") from None
        finally:
            self.metrics.bus_seconds.observe(time.perf_counter() - started, method)
            if outcome != "ok":
                self.metrics.bus_errors.inc(method, outcome)


# --------------------------------------------------------------------------- the app


@dataclass
class ShimSettings:
    token: str
    bus_address: str
    peer_socket: Path | None = None
    """uapplaced's Admit-only peer socket; ``None``: admit over the bus only."""
    admit_deadline: float = ADMIT_DEADLINE_S
    read_deadline: float = READ_DEADLINE_S
    enforcement_deadline: float = ENFORCEMENT_DEADLINE_S
    metrics: ShimMetrics = field(default_factory=ShimMetrics)
    header_timeout: float = HEADER_TIMEOUT_S
    body_timeout: float = BODY_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS


@dataclass
class Shim:
    settings: ShimSettings
    gateway: BusGateway
    events: EventLog = field(default_factory=EventLog)
    """The daemon's signals, numbered, for ``GET /api/placement/events`` (fed by
    :class:`uapplace.shim_events.EventFeed`, started with the app)."""

    @property
    def metrics(self) -> ShimMetrics:
        return self.settings.metrics

    # ------------------------------------------------------------- helpers

    def require_token(self, request: web.Request) -> None:
        given = request.headers.get(TOKEN_HEADER)
        if given is None:
            raise HttpError(401, f"missing {TOKEN_HEADER} header")
        if not token_matches(given, self.settings.token):
            raise HttpError(401, f"wrong {TOKEN_HEADER} header")

    async def bus(
        self,
        method: str,
        deadline: float,
        work: Callable[[PlacementClient], Awaitable[T]],
        *,
        via_peer: bool = False,
    ) -> T:
        """A bus call with the daemon's errors turned into HTTP answers."""
        try:
            return await self.gateway.call(method, deadline, work, via_peer=via_peer)
        except DaemonUnavailable as err:
            raise HttpError(503, f"placement daemon unavailable: {err}") from None
        except PlacementError as err:
            status = STATUS_BY_BUS_ERROR.get(err.short, 502)
            message = err.message if err.short in STATUS_BY_BUS_ERROR else str(err)
            raise HttpError(status, message, bus_error=err.short) from None

    # ------------------------------------------------------------- admit

    async def admit(self, request: web.Request) -> web.Response:
        if not is_loopback_peer(request):
            raise HttpError(403, ADMIT_LOOPBACK_ONLY)
        require_json(request)
        admit = parse_admit(await read_json_object(request))
        # The daemon gets our deadline less a margin for the reply's way back: an admit it
        # handles later leaves no pending entry whose id nobody would receive (issue 13).
        budget_s = max(0.0, self.settings.admit_deadline - ADMIT_REPLY_MARGIN_S)
        deadline_us = time.monotonic_ns() // 1000 + int(budget_s * 1_000_000)
        answer = await self.bus(
            "Admit",
            self.settings.admit_deadline,
            lambda c: c.admit(
                admit.model_id, admit.client, admit.session, admit.cells, deadline_us=deadline_us
            ),
            via_peer=True,
        )
        if answer.get("reason") == DEADLINE_PASSED and not answer.get("placement_id"):
            raise HttpError(503, "placement daemon unavailable: it answered after the deadline")
        decision = answer.get("decision")
        if decision == "forward":
            body = {"decision": "forward", "target_id": answer["target_id"]}
        elif decision == "park":
            body = {
                "decision": "park",
                "placement_id": answer["placement_id"],
                "reason": answer["reason"],
            }
        else:
            raise HttpError(502, f"the daemon answered an unknown decision {shown(str(decision))}")
        self.metrics.admits.inc(body["decision"], body.get("reason", ""))
        return json_response(body)

    # ------------------------------------------------------------- reads

    async def event_stream(self, request: web.Request) -> web.StreamResponse:
        """Server-Sent Events: the bus signals (and alerts), resumable (issue 13)."""
        try:
            return await stream_events(request, self.events)
        except EventError as err:
            raise HttpError(400, str(err)) from None

    async def targets(self, request: web.Request) -> web.Response:
        """Per-target rails (``GetState.targets``): what a proxy sizes its slots from."""
        text = await self.bus("GetState", self.settings.read_deadline, lambda c: c.call("GetState"))
        try:
            state = json.loads(text[0])
        except ValueError:
            raise HttpError(502, "the daemon's GetState is not JSON") from None
        targets = state.get("targets") if isinstance(state, dict) else None
        return json_response({"targets": targets if isinstance(targets, list) else []})

    async def state(self, request: web.Request) -> web.Response:
        text = await self.bus("GetState", self.settings.read_deadline, lambda c: c.call("GetState"))
        return raw_json_response(text[0])

    async def pending(self, request: web.Request) -> web.Response:
        text = await self.bus(
            "ListPending", self.settings.read_deadline, lambda c: c.call("ListPending")
        )
        return raw_json_response(text[0])

    async def preview(self, request: web.Request) -> web.Response:
        model = request.query.get("model", "")
        if not model:
            raise HttpError(400, "missing query parameter model")
        try:
            check_bus_text(model)
        except ValueError as err:
            raise HttpError(400, f"query parameter model {err}") from None
        cells = parse_cells_query(request.query.get("cells"))
        text = await self.bus(
            "Preview",
            self.settings.read_deadline,
            lambda c: c.call("Preview", "su", [model, cells]),
        )
        return raw_json_response(text[0])

    # ------------------------------------------------------------- writes

    async def resolve(self, request: web.Request) -> web.Response:
        self.require_token(request)
        body = await read_model(request, ResolveBody)
        expected = signature_of(body.expected_victims)
        return await self.enforcement(
            "resolve",
            "Apply",
            body.placement_id,
            lambda c: c.apply(body.placement_id, body.option, expected),
            signed=body.expected_victims is not None,
        )

    async def load(self, request: web.Request) -> web.Response:
        self.require_token(request)
        body = await read_model(request, ModelBody)
        expected = signature_of(body.expected_victims)
        return await self.enforcement(
            "load",
            "Load",
            "",
            lambda c: c.load(body.model, expected),
            signed=body.expected_victims is not None,
        )

    async def unload(self, request: web.Request) -> web.Response:
        self.require_token(request)
        body = await read_model(request, ModelBody)
        expected = signature_of(body.expected_victims)
        return await self.enforcement(
            "unload",
            "Unload",
            "",
            lambda c: c.unload(body.model, expected),
            signed=body.expected_victims is not None,
        )

    async def enforcement(
        self,
        verb: str,
        method: str,
        placement_id: str,
        work: Callable[[PlacementClient], Awaitable[Any]],
        *,
        signed: bool = True,
    ) -> web.Response:
        """One Apply/Load/Unload, counted in the enforcement metrics by outcome.

        ``signed`` is false when the body omitted ``expected_victims``: a ``Drifted``
        then means the call would stop something nobody approved, and says so."""
        started = time.perf_counter()
        outcome = "error"
        try:
            result = await self.bus(method, self.settings.enforcement_deadline, work)
            outcome = apply_outcome(result)
            return json_response(result)
        except HttpError as err:
            outcome = "unavailable" if err.status == 503 else "refused"
            if err.bus_error == "Drifted":
                outcome = "drifted"
                message = err.message if signed else f"{MISSING_SIGNATURE}; {err.message}"
                body = drifted_body(placement_id, message)
                raise HttpError(409, body["error"], body, bus_error="Drifted") from None
            raise
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.enforcements.inc(verb, outcome)
            self.metrics.enforcement_seconds.observe(elapsed, verb, outcome)

    async def dismiss(self, request: web.Request) -> web.Response:
        self.require_token(request)
        body = await read_model(request, DismissBody)
        dismissed = await self.bus(
            "Dismiss", self.settings.read_deadline, lambda c: c.dismiss(body.placement_id)
        )
        return json_response({"dismissed": dismissed})

    async def auto(self, request: web.Request) -> web.Response:
        self.require_token(request)
        body = await read_model(request, AutoBody)
        changes = body.changes()
        if not changes:
            text = await self.bus(
                "GetAutoPolicy", self.settings.read_deadline, lambda c: c.call("GetAutoPolicy")
            )
        else:
            text = await self.bus(
                "SetAutoPolicy",
                self.settings.read_deadline,
                lambda c: c.call(
                    "SetAutoPolicy", "sb", [json.dumps(changes, separators=(",", ":")), body.yes]
                ),
            )
        return raw_json_response(text[0])

    # ------------------------------------------------------------- metrics, OpenAPI

    async def metrics_page(self, request: web.Request) -> web.Response:
        state: Mapping[str, Any] | None = None
        try:
            reply = await self.gateway.call(
                "GetState", SCRAPE_DEADLINE_S, lambda c: c.call("GetState")
            )
            parsed = json.loads(reply[0])
            state = parsed if isinstance(parsed, dict) else None
        except (DaemonUnavailable, PlacementError, HttpError, ValueError):
            state = None
        text = self.metrics.render(state)
        return web.Response(text=text, headers={"Content-Type": METRICS_CONTENT_TYPE}, charset=None)

    async def openapi(self, request: web.Request) -> web.Response:
        return json_response(
            openapi_document(ROUTES, [ResolveBody, DismissBody, ModelBody, AutoBody])
        )


def parse_cells_query(text: str | None) -> int:
    if text is None or text == "":
        return DEFAULT_CELLS
    if not text.isascii() or not text.isdigit() or int(text) < 1 or int(text) > U32_MAX:
        raise HttpError(
            400, f"query parameter cells must be an integer from 1 to {U32_MAX}, got {shown(text)}"
        )
    return int(text)


def apply_outcome(result: Any) -> str:
    """``ok``, ``rolled_back`` or ``failed`` from an Apply/Load/Unload result."""
    if isinstance(result, dict) and result.get("ok") is True:
        return "ok"
    if isinstance(result, dict) and result.get("rolledBack"):
        return "rolled_back"
    return "failed"


def drifted_body(placement_id: str, message: str) -> dict[str, Any]:
    """The Apply-style body of a ``Drifted`` refusal (nothing ran, so no steps)."""
    wording = (
        message if "victim set changed" in message.lower() else f"victim set changed: {message}"
    )
    return {"ok": False, "placementId": placement_id, "steps": [], "error": wording}


# --------------------------------------------------------------------------- app assembly


SHIM_KEY = web.AppKey("uapplace_shim", Shim)


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
    async def answer(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
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
        shim.metrics.responses.inc(route_label(request), str(response.status))
        return response

    return answer


def origin_is_loopback(origin: str) -> bool:
    """An ``Origin`` header naming a page on this machine's loopback (any port).

    Browsers add ``Origin`` to every cross-origin POST (and scripts cannot remove
    it); the proxy and the CLI send none. ``null`` (sandboxed frames, ``file:``
    pages) is not loopback: any site can produce it.
    """
    try:
        parts = urlsplit(origin.strip())
        host = parts.hostname
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and (host or "").lower() in LOOPBACK_HOST_NAMES


def require_json(request: web.Request) -> None:
    """Admit takes ``application/json`` only (CONTRACT §1: the proxy sends JSON).

    A browser can send ``text/plain``, form types or no type at all cross-site
    without a CORS preflight; ``application/json`` it cannot, so this and the
    ``Origin`` check keep web pages the operator visits from creating parks.
    """
    if request.content_type.lower() != JSON_CONTENT_TYPE:
        given = request.headers.get("Content-Type")
        what = "no Content-Type" if given is None else f"Content-Type {shown(given)}"
        raise HttpError(415, f"admit takes {JSON_CONTENT_TYPE}, got {what}")


def check_access(request: web.Request) -> None:
    """Loopback peers only; no foreign ``Origin``; and, except on admit, a loopback
    ``Host`` (DNS rebinding)."""
    is_admit = request.path == ROUTES["admit"]
    if not is_loopback_peer(request):
        # Admit's exact refusal is part of the contract; it comes before the body is read.
        raise HttpError(
            403, ADMIT_LOOPBACK_ONLY if is_admit else "the uapplace shim is loopback-only"
        )
    origin = request.headers.get("Origin")
    if origin is not None and not origin_is_loopback(origin):
        raise HttpError(
            403,
            f"Origin {shown(origin)} is not a loopback origin: the shim takes no requests "
            "from web pages",
        )
    if not is_admit and not host_header_is_loopback(request.headers.get("Host")):
        raise HttpError(
            403, f"Host header {shown(request.headers.get('Host', ''))} is not a loopback name"
        )


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
    app.router.add_post(ROUTES["admit"], shim.admit)
    app.router.add_get(ROUTES["state"], shim.state)
    app.router.add_get(ROUTES["pending"], shim.pending)
    app.router.add_get(ROUTES["preview"], shim.preview)
    app.router.add_post(ROUTES["resolve"], shim.resolve)
    app.router.add_post(ROUTES["dismiss"], shim.dismiss)
    app.router.add_post(ROUTES["load"], shim.load)
    app.router.add_post(ROUTES["unload"], shim.unload)
    app.router.add_post(ROUTES["auto"], shim.auto)
    app.router.add_get(ROUTES["targets"], shim.targets)
    app.router.add_get(ROUTES["events"], shim.event_stream)
    app.router.add_get(ROUTES["metrics"], shim.metrics_page)
    app.router.add_get(ROUTES["openapi"], shim.openapi)
    return app


# --------------------------------------------------------------------------- main


def bind_sockets(hosts: Sequence[str], port: int) -> list[socket.socket]:
    """Listening-ready sockets on each loopback host, all on one port (``0`` picks one)."""
    bound: list[socket.socket] = []
    for host in hosts:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
        except OSError as err:
            sock.close()
            if bound and len(hosts) > 1:
                log.warning("not listening on %s: %s", host, err)
                continue
            for other in bound:
                other.close()
            raise OSError(
                err.errno, f"cannot listen on {host} port {port}: {err.strerror}"
            ) from None
        sock.setblocking(False)
        bound.append(sock)
        port = sock.getsockname()[1]
    return bound


# --------------------------------------------------------------------------- overload guards

_OVERLOAD_BODY = encode_json({"error": "uapplace-shim is at its connection limit; retry"})
OVERLOAD_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/json; charset=utf-8\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n"
    + f"Content-Length: {len(_OVERLOAD_BODY)}\r\n\r\n".encode()
    + _OVERLOAD_BODY
)
"""What a connection over the cap gets, without a byte of its request being read."""
ACCEPT_EXHAUSTED = "socket.accept() out of system resource"


class _Refusal(asyncio.Protocol):
    """A connection over the cap: the 503 is written and the connection closed at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(OVERLOAD_RESPONSE)
        transport.close()

    def data_received(self, data: bytes) -> None:
        pass


class RateLimitedWarning:
    """One warning per :data:`OVERLOAD_LOG_EVERY_S` for a condition that repeats, with a count."""

    def __init__(self) -> None:
        self.logged_at = -OVERLOAD_LOG_EVERY_S
        self.unreported = 0

    def __call__(self, message: str, *args: object) -> None:
        self.unreported += 1
        now = time.monotonic()
        if now - self.logged_at < OVERLOAD_LOG_EVERY_S:
            return
        log.warning(message + " (%d time(s) since the last report)", *args, self.unreported)
        self.logged_at = now
        self.unreported = 0


class ConnectionCap:
    """At most ``limit`` open HTTP connections; the rest get a 503 at once and are closed.

    The count is aiohttp's own list of open connections, read as each new one is
    accepted. Connections accepted in one loop turn join that list only when
    they start, so the count can overshoot ``limit`` by at most the accept
    backlog; :func:`connection_cap` leaves that much room below the descriptor
    limit, so ``accept()`` itself does not run out of descriptors.
    """

    def __init__(self, server: web.Server, limit: int) -> None:
        self.server = server
        self.limit = limit
        self.refused = 0
        self._warn = RateLimitedWarning()

    def protocol(self) -> asyncio.BaseProtocol:
        """The protocol factory handed to ``loop.create_server``."""
        if len(self.server.connections) >= self.limit:
            self.refused += 1
            self._warn("%d connections open: new ones are answered 503", self.limit)
            return _Refusal()
        return self.server()


class GuardedSite(web.SockSite):
    """aiohttp's ``SockSite`` accepting through a :class:`ConnectionCap`."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, cap: ConnectionCap) -> None:
        super().__init__(runner, sock, backlog=ACCEPT_BACKLOG)
        self.cap = cap

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.cap.protocol, sock=self._sock, backlog=self._backlog
        )


def connection_cap(requested: int) -> int:
    """``requested``, lowered to fit under ``RLIMIT_NOFILE`` with the backlog and headroom."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    fits = max(1, soft - ACCEPT_BACKLOG - FD_HEADROOM)
    if fits < requested:
        log.warning(
            "serving at most %d connections, not %d: the descriptor limit is %d "
            "(raise LimitNOFILE= in the unit)",
            fits,
            requested,
            soft,
        )
    return min(requested, fits)


def raise_fd_limit() -> None:
    """Soft ``RLIMIT_NOFILE`` up to the hard one (asyncio uses epoll: no FD_SETSIZE issue)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def quiet_accept_errors(warn: RateLimitedWarning) -> Callable[[Any, dict[str, Any]], None]:
    """A loop exception handler that reports asyncio's EMFILE-on-accept once per interval.

    asyncio logs that error once per connection waiting in the backlog, and
    re-arms the listener once per failure: thousands of lines a second. The cap
    should keep it from happening; if the process runs out of descriptors anyway
    (other files), this keeps the journal readable.
    """

    def handler(loop: Any, context: dict[str, Any]) -> None:
        if context.get("message") == ACCEPT_EXHAUSTED:
            warn("accept() failed: %s; not accepting for 1 s", context.get("exception"))
            return
        loop.default_exception_handler(context)

    return handler


async def serve(settings: ShimSettings, hosts: Sequence[str], port: int) -> None:
    app = create_app(settings)
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        # aiohttp's keep-alive timer runs from the connection's start (and from each
        # response) until a complete request head arrives, and closes an idle one:
        # it is the header read timeout, so a slow-headers client is cut.
        keepalive_timeout=settings.header_timeout,
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(quiet_accept_errors(RateLimitedWarning()))
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    assert runner.server is not None
    cap = ConnectionCap(runner.server, connection_cap(settings.max_connections))
    try:
        for sock in bind_sockets(hosts, port):
            await GuardedSite(runner, sock, cap).start()
            host, bound_port = sock.getsockname()[:2]
            shown_host = f"[{host}]" if ":" in host else host
            log.info("listening on http://%s:%d", shown_host, bound_port)
        await stop.wait()
    finally:
        await runner.cleanup()


def build_parser(paths: Paths) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="uapplace-shim",
        description="Loopback HTTP shim in front of uapplaced (the proxy's placement controller).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="127.0.0.1 (default), ::1 or localhost")
    parser.add_argument(
        "--port", type=int, default=paths.shim_port, help=f"default {paths.shim_port}"
    )
    parser.add_argument(
        "--bus-address",
        default=None,
        help="D-Bus address of the bus uapplaced is on (default: the user bus)",
    )
    parser.add_argument(
        "--admit-timeout", type=float, default=ADMIT_DEADLINE_S, help="admit bus deadline, seconds"
    )
    parser.add_argument(
        "--no-peer",
        action="store_true",
        help=f"admit over the bus only, never over uapplaced's peer socket ({paths.peer_socket})",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help=f"HTTP connections served at once, more get a 503 (default {MAX_CONNECTIONS}; "
        "lowered to fit the descriptor limit)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_TIMEOUT_S,
        help=f"seconds a connection may take to send a request's headers, and idle "
        f"keep-alive (default {HEADER_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT_S,
        help=f"seconds a request body may take to arrive (default {BODY_TIMEOUT_S:g})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    paths = Paths.from_env()
    parser = build_parser(paths)
    args = parser.parse_args(argv)
    hosts = LOOPBACK_BIND_HOSTS.get(args.host)
    if hosts is None:
        parser.exit(
            2,
            f"uapplace-shim: refusing to bind {args.host!r}: the shim binds loopback only "
            "(127.0.0.1, ::1 or localhost)\n",
        )
    if not 0 <= args.port <= 65535:
        parser.exit(2, f"uapplace-shim: --port {args.port} is not a TCP port (0-65535)\n")
    if not 0 < args.admit_timeout < 2.0:
        parser.exit(2, "uapplace-shim: --admit-timeout must be above 0 and below the proxy's 2 s\n")
    if args.max_connections < 1:
        parser.exit(2, f"uapplace-shim: --max-connections {args.max_connections} is not >= 1\n")
    for name in ("header_timeout", "body_timeout"):
        if not 0 < getattr(args, name) <= 3600:
            flag = "--" + name.replace("_", "-")
            parser.exit(2, f"uapplace-shim: {flag} must be above 0 and at most 3600 seconds\n")
    try:
        token = load_or_create_token(paths.token_file)
    except (OSError, ValueError) as err:
        parser.exit(2, f"uapplace-shim: cannot set up the dashboard token: {err}\n")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    settings = ShimSettings(
        token=token,
        bus_address=args.bus_address or user_bus_address(),
        peer_socket=None if args.no_peer else paths.peer_socket,
        admit_deadline=args.admit_timeout,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
    )
    raise_fd_limit()
    try:
        asyncio.run(serve(settings, hosts, args.port))
    except OSError as err:
        print(f"uapplace-shim: {err.strerror or err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
