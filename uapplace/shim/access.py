"""Who may call the shim: loopback peers, loopback ``Host`` and ``Origin``, JSON-only admit,
and the dashboard token's comparison (its file: :mod:`uapplace.files.token`).

:func:`check_access` runs on every request before its handler (the guard around
each route, :func:`uapplace.shim.app.guarded`); the handlers add :func:`require_json`
(admit) and the token check (writes). Why each rule: a web page the operator visits
must not reach the shim — it cannot send ``application/json`` cross-site without a preflight, nor
drop ``Origin``, and a DNS name rebound to 127.0.0.1 still sends its own
``Host`` — and only the operator (who can read the token file) may change
placements.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from aiohttp import web

from uapplace.shim.responses import JSON_CONTENT_TYPE, HttpError, shown
from uapplace.shim.routes import ROUTES

TOKEN_HEADER = "x-uap-dashboard-token"
ADMIT_LOOPBACK_ONLY = "placement admit is loopback-only"
LOOPBACK_PEERS = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})
LOOPBACK_HOST_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


# --------------------------------------------------------------------------- the request


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
    """Admit takes ``application/json`` only (docs/http-contract.md §1: the proxy sends JSON).

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


def require_token(request: web.Request, token: str) -> None:
    """Writes carry :data:`TOKEN_HEADER` equal to the dashboard token, else ``401``."""
    given = request.headers.get(TOKEN_HEADER)
    if given is None:
        raise HttpError(401, f"missing {TOKEN_HEADER} header")
    if not token_matches(given, token):
        raise HttpError(401, f"wrong {TOKEN_HEADER} header")


def token_matches(given: str | None, token: str) -> bool:
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "replace"), token.encode("utf-8"))
