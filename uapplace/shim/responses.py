"""The shim's HTTP answers: compact JSON bodies, the ``{"error": …}`` shape, and :class:`HttpError`.

Every module of :mod:`uapplace.shim` that answers a request builds its response
here, so all of them write JSON the same way: compact (``separators=(",", ":")``),
UTF-8, no ASCII escaping, like the published controller's ``JSON.stringify``.
The handlers raise :class:`HttpError`; the guard around every route
(:func:`uapplace.shim.app.guarded`) turns it into the response.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

JSON_CONTENT_TYPE = "application/json"
_JSON_HEADERS = {"Content-Type": f"{JSON_CONTENT_TYPE}; charset=utf-8"}
"""What ``content_type=JSON_CONTENT_TYPE, charset="utf-8"`` makes aiohttp write, built once."""
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_COMPACT_ASCII = json.JSONEncoder(separators=(",", ":"))
"""``json.dumps`` with these arguments builds an encoder per call; the hot path keeps two."""


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


class ClientGone(Exception):
    """The client hung up before its request body arrived: nobody to answer, nothing wrong."""


def encode_json(value: Any) -> bytes:
    """Compact UTF-8 JSON; ASCII escapes only when a string holds a lone surrogate."""
    text = _COMPACT.encode(value)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _COMPACT_ASCII.encode(value).encode("ascii")


def json_response(
    value: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    if headers is None:  # every answer but a 405: the same header bytes, built once
        return web.Response(body=encode_json(value), status=status, headers=_JSON_HEADERS)
    return web.Response(
        body=encode_json(value),
        status=status,
        content_type=JSON_CONTENT_TYPE,
        charset="utf-8",
        headers=headers,
    )


def raw_json_response(text: str, status: int = 200) -> web.Response:
    """JSON text from the bus, passed through unchanged."""
    return encoded_json_response(text.encode("utf-8"), status)


def encoded_json_response(body: bytes, status: int = 200) -> web.Response:
    """JSON already encoded (:func:`encode_json`, or the daemon's text)."""
    return web.Response(body=body, status=status, headers=_JSON_HEADERS)


def error_response(
    status: int, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    return json_response({"error": message}, status, headers)


def shown(value: str, limit: int = 64) -> str:
    """A user-supplied string quoted for an error message, cut to ``limit`` characters."""
    cut = value if len(value) <= limit else value[:limit] + "…"
    return ascii(cut)
