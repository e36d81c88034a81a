"""The proxy side of the admission gate (docs/http-contract.md §1, §2), for Python proxies.

A proxy that fronts local models asks the placement controller (our shim) before
it sends a request upstream, and answers a park with a ``409`` in the client's
dialect. This module is that gate, so such a proxy needs no copy of the rules:

- :class:`GateClient` posts the admit body of docs/http-contract.md §1 and turns the answer into a
  :class:`GateDecision`. Anything but a well-formed ``200`` answer (non-200,
  non-object body, unknown ``decision``, timeout, any exception) counts as *no
  answer* and the gate falls back to read-only admission from the proxy's
  cached upstream ids: a served id forwards, an unserved id parks with reason
  ``no_controller``, an unprobed cache (``None``) forwards (docs/placement-rules.md §4.3: the same
  fail-open direction as the proxy's wire-model reconcile). A 5 s burst map on
  ``(client, model)`` (and ``("__auto__", model)`` for ``auto_loading``)
  re-parks a burst without asking again. For a plain ``http://`` controller the POST
  goes through :class:`AdmitLink`, a small keep-alive HTTP/1.1 client on asyncio
  streams (half the proxy's CPU per admit of an aiohttp round; docs/performance.md,
  "Second pass"); other URLs and the rails read use aiohttp.
- :class:`TargetSemaphores` is the per-target semaphore map of docs/placement-rules.md §4.3
  (per-target concurrency): one budget per ``target_id``, sized from the rails
  the controller reports (``GET /api/placement/targets``, read with
  :meth:`GateClient.target_rails`), so a two-slot llama.cpp takes two requests at
  once and a one-rail server one, and the wire-model decision and the
  concurrency gate read the same target.
- :func:`anthropic_409`, :func:`openai_409`, :func:`ollama_409` build the exact
  bodies; :func:`park_409` picks one by request path (:func:`dialect_for_path`).
  Every park answer carries ``Retry-After: 2``, whatever the dialect
  (docs/http-contract.md §2).

Usage in a proxy::

    gate = GateClient("http://127.0.0.1:3847", upstream_ids=lambda: cached_ids)
    decision = await gate.admit(model_id, client_id, session_id, cells)
    if decision.decision == "park":
        status, headers, body = park_409(request.path, model_id,
                                         decision.placement_id, decision.reason)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp

Dialect = Literal["anthropic", "openai", "ollama"]
DecisionSource = Literal["controller", "fallback", "burst"]

BURST_WINDOW_S = 5.0
AUTO_BURST_CLIENT = "__auto__"
RETRY_AFTER_S = 2
RETRY_AFTER_MS = 2000
RESOLVE_WITH = "uapplace pending | uapplace apply <placement_id> <option>"
"""The commands that resolve a park (docs/http-contract.md §2): human text, no stability
promise; machines key on ``type``, ``placement_id`` and ``reason``."""
NO_CONTROLLER = "no_controller"
FALLBACK_TARGET = "default"
"""The target key the proxy uses when no controller answer named one (docs/http-contract.md §3)."""

TARGET_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]+:\S+$")
PLACEMENT_ID_RE = re.compile(r"^plc-[0-9a-f]{6}$")
REASON_RE = re.compile(r"^[a-z_]+$")

_DIALECT_BY_PATH: dict[str, Dialect] = {
    "/v1/messages": "anthropic",
    "/anthropic/v1/messages": "anthropic",
    "/v1/chat/completions": "openai",
    "/api/chat": "ollama",
    "/api/generate": "ollama",
}


@dataclass(frozen=True)
class GateDecision:
    """What the gate decided for one request, and where the answer came from."""

    decision: Literal["forward", "park"]
    target_id: str | None = None
    """Set on forward: the controller's ``<device>:<endpoint>``, or ``default`` on fallback."""
    placement_id: str | None = None
    reason: str | None = None
    source: DecisionSource = "controller"

    @property
    def parked(self) -> bool:
        return self.decision == "park"


@dataclass(frozen=True)
class _BurstPark:
    placement_id: str
    reason: str
    expires_at: float


def new_placement_id() -> str:
    """``plc-`` + 6 lowercase hex digits (docs/http-contract.md §1)."""
    return f"plc-{secrets.token_hex(3)}"


def admit_body(
    model_id: str, client: str, session: str | None, cells: int | None
) -> dict[str, Any]:
    """The request body of docs/http-contract.md §1; ``cells`` only when it is a positive integer.

    ``client`` and ``session`` go as they are: truncating them is the controller's job.
    """
    body: dict[str, Any] = {"model_id": model_id, "client": client, "session": session}
    if isinstance(cells, int) and not isinstance(cells, bool) and cells > 0:
        body["cells"] = cells
    return body


def parse_answer(status: int, payload: object) -> GateDecision | None:
    """A controller answer as a decision, or ``None`` when it counts as *no answer*."""
    if status != 200 or not isinstance(payload, dict):
        return None
    decision = payload.get("decision")
    if decision == "forward":
        target = payload.get("target_id")
        if isinstance(target, str) and TARGET_ID_RE.match(target):
            return GateDecision("forward", target_id=target)
        return None
    if decision == "park":
        placement_id = payload.get("placement_id")
        reason = payload.get("reason")
        if (
            isinstance(placement_id, str)
            and PLACEMENT_ID_RE.match(placement_id)
            and isinstance(reason, str)
            and REASON_RE.match(reason)
        ):
            return GateDecision("park", placement_id=placement_id, reason=reason)
    return None


class GateClient:
    """Admission through the placement controller, with the proxy's read-only fallback.

    ``upstream_ids`` returns the proxy's cached upstream model ids, or ``None``
    while the cache is unprobed. ``clock`` (monotonic seconds) drives the burst
    map; tests inject their own.
    """

    def __init__(
        self,
        controller_url: str,
        timeout: float = 2.0,
        *,
        upstream_ids: Callable[[], Collection[str] | None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        burst_window: float = BURST_WINDOW_S,
    ) -> None:
        self.admit_url = controller_url.rstrip("/") + "/api/placement/admit"
        self.timeout = timeout
        self.upstream_ids = upstream_ids
        self.clock = clock
        self.burst_window = burst_window
        self._bursts: dict[tuple[str, str], _BurstPark] = {}
        self._session: aiohttp.ClientSession | None = None
        self._link = AdmitLink.for_url(self.admit_url)
        """Admit's own keep-alive link for a plain ``http://`` controller; ``None``: aiohttp."""

    async def __aenter__(self) -> GateClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._link is not None:
            await self._link.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def admit(
        self, model_id: str, client: str, session: str | None, cells: int | None = None
    ) -> GateDecision:
        """Forward or park ``model_id``; never raises, never waits much past ``timeout``."""
        burst = self._burst_hit(client, model_id)
        if burst is not None:
            return burst
        answer = await self.ask_controller(model_id, client, session, cells)
        decision = answer if answer is not None else self.fallback(model_id)
        if decision.parked:
            self._remember_park(client, model_id, decision)
        return decision

    async def ask_controller(
        self, model_id: str, client: str, session: str | None, cells: int | None
    ) -> GateDecision | None:
        """One admit POST; ``None`` for every kind of *no answer*."""
        body = admit_body(model_id, client, session, cells)
        try:
            async with asyncio.timeout(self.timeout):
                if self._link is not None:
                    status, raw = await self._link.post(_ENCODE_BODY(body).encode())
                    payload = json.loads(raw) if status == 200 else None
                else:
                    async with self._http().post(self.admit_url, json=body) as response:
                        status = response.status
                        payload = await response.json(content_type=None) if status == 200 else None
        except Exception:  # the contract: any exception is "no answer"
            return None
        return parse_answer(status, payload)

    async def target_rails(self) -> dict[str, int | None] | None:
        """``target_id → rails`` from ``GET /api/placement/targets``; ``None`` when the
        controller did not answer usably (keep the sizes you have)."""
        url = self.admit_url.removesuffix("/admit") + "/targets"
        try:
            async with asyncio.timeout(self.timeout):
                async with self._http().get(url) as response:
                    if response.status != 200:
                        return None
                    payload = await response.json(content_type=None)
        except Exception:  # same contract as admit: any failure is "no answer"
            return None
        return rails_map(payload)

    def forget_parks(self) -> int:
        """Drop the burst map (after a swap, a retry must ask again); how many were dropped."""
        dropped = len(self._bursts)
        self._bursts = {}
        return dropped

    def fallback(self, model_id: str) -> GateDecision:
        """Read-only admission from the proxy's cached upstream ids (no controller answer)."""
        try:
            served = self.upstream_ids()
        except Exception:  # a broken cache reads as unprobed
            served = None
        if served is None or model_id in served:
            return GateDecision("forward", target_id=FALLBACK_TARGET, source="fallback")
        return GateDecision(
            "park", placement_id=new_placement_id(), reason=NO_CONTROLLER, source="fallback"
        )

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    def _burst_hit(self, client: str, model_id: str) -> GateDecision | None:
        now = self.clock()
        for key in ((client, model_id), (AUTO_BURST_CLIENT, model_id)):
            park = self._bursts.get(key)
            if park is None:
                continue
            if now >= park.expires_at:
                del self._bursts[key]
                continue
            return GateDecision(
                "park", placement_id=park.placement_id, reason=park.reason, source="burst"
            )
        return None

    def _remember_park(self, client: str, model_id: str, decision: GateDecision) -> None:
        now = self.clock()
        self._bursts = {k: v for k, v in self._bursts.items() if v.expires_at > now}
        park = _BurstPark(
            decision.placement_id or "", decision.reason or "", now + self.burst_window
        )
        self._bursts[(client, model_id)] = park
        if decision.reason == "auto_loading":
            # Rotating the client id must not re-ask the controller during an auto load.
            self._bursts[(AUTO_BURST_CLIENT, model_id)] = park


# --------------------------------------------------------------------------- admit's link

_ENCODE_BODY = json.JSONEncoder(separators=(",", ":")).encode
"""One encoder for every admit body (``json.dumps`` builds one per call with separators)."""
HEAD_LIMIT = 16 * 1024
"""The most bytes an answer's status line and headers may take."""
BODY_LIMIT = 64 * 1024
"""The most bytes an answer's body may take: an admit answer is under 200."""
IDLE_REUSE_S = 5.0
"""An idle connection older than this is closed, not reused: the shim closes one that sends
no headers for 10 s (docs/http-contract.md §5), and a reused connection must still be open."""
MAX_IDLE = 64
"""Idle connections kept; more at once are closed when they finish."""


class UnexpectedAnswer(Exception):
    """An answer :class:`AdmitLink` does not read (framing, size, status line)."""


class _StaleConnection(Exception):
    """A reused connection closed before any answer byte came: the server dropped it idle."""


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0

    def close(self) -> None:
        self.writer.close()


READ_SIZE = 16 * 1024
"""What one read of an admit answer asks the kernel for (asyncio's default: 256 KiB)."""


def _small_reads(transport: asyncio.BaseTransport) -> None:
    """Have asyncio read this connection in :data:`READ_SIZE` pieces: its socket transport
    reads with ``recv(max_size)``, 256 KiB, and allocating that much for a 100-byte answer
    cost 44 µs against 9 µs at 16 KiB on the machine this was measured on (uapplace's
    docs/performance.md, "Reads of 256 KiB"). A transport without ``max_size`` is left as is."""
    if getattr(transport, "max_size", 0) > READ_SIZE:
        transport.max_size = READ_SIZE  # type: ignore[attr-defined]


class AdmitLink:
    """Keep-alive HTTP/1.1 ``POST``s of JSON to one ``http://`` URL, over asyncio streams.

    Admit is on every request a proxy forwards (docs/http-contract.md §1); an aiohttp
    ``ClientSession`` round costs the proxy twice the CPU (docs/performance.md), so the
    one POST the gate makes on that path goes through this small client instead. It reads
    only what a well-behaved server sends (a ``1.x`` status line, headers within
    :data:`HEAD_LIMIT`, a body framed by ``Content-Length``, chunks or the connection's
    close, within :data:`BODY_LIMIT`) and raises on anything else; a connection is
    pooled again only after a complete, length-framed, keep-alive answer. A pooled
    connection the server closed before answering is retried once on a new one. The
    caller bounds the time (the gate's 2 s).
    """

    def __init__(self, host: str, port: int, host_header: str, path: str) -> None:
        self.host = host
        self.port = port
        self._head = (
            f"POST {path} HTTP/1.1\r\nHost: {host_header}\r\n"
            "Content-Type: application/json\r\nAccept: */*\r\nContent-Length: "
        ).encode("ascii")
        self._idle: list[_Connection] = []

    @classmethod
    def for_url(cls, url: str) -> AdmitLink | None:
        """A link for a plain ``http://host[:port]/path`` URL; ``None`` for any other
        (https, credentials, a query: those keep aiohttp's full client)."""
        try:
            parts = urlsplit(url)
            port = parts.port or 80
        except ValueError:
            return None
        plain = parts.scheme == "http" and not (parts.username or parts.query or parts.fragment)
        if not plain or not parts.hostname or not parts.path.isascii():
            return None
        return cls(parts.hostname, port, parts.netloc, parts.path or "/")

    async def post(self, body: bytes) -> tuple[int, bytes]:
        """``(status, body)`` of one POST of ``body``; raises on any failure."""
        request = b"%s%d\r\n\r\n%s" % (self._head, len(body), body)
        pooled = self._take_idle()
        if pooled is not None:
            try:
                return await self._exchange(pooled, request, reused=True)
            except _StaleConnection:
                pass
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=HEAD_LIMIT)
        _small_reads(writer.transport)
        return await self._exchange(_Connection(reader, writer), request, reused=False)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()
        for connection in idle:
            with contextlib.suppress(Exception):  # a dead connection: nothing to keep
                await connection.writer.wait_closed()

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()  # the most recently used is the likeliest alive
            fresh = now - connection.idle_since < IDLE_REUSE_S
            if fresh and not connection.reader.at_eof() and not connection.writer.is_closing():
                return connection
            connection.close()
        return None

    async def _exchange(
        self, connection: _Connection, request: bytes, *, reused: bool
    ) -> tuple[int, bytes]:
        try:
            connection.writer.write(request)
            try:
                head = await connection.reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError) as error:
                partial = getattr(error, "partial", b"")
                if reused and not partial:
                    raise _StaleConnection from error
                raise
            status, keep_alive, length, chunked = _read_head(head)
            body = await _read_body(connection.reader, status, length, chunked)
        except BaseException:
            connection.close()
            raise
        if keep_alive and (length is not None or chunked) and len(self._idle) < MAX_IDLE:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            connection.close()
        return status, body


def _read_head(head: bytes) -> tuple[int, bool, int | None, bool]:
    """``(status, keep_alive, content_length, chunked)`` of an answer's head."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if version not in ("HTTP/1.1", "HTTP/1.0") or not code.isdigit() or int(code) < 200:
        raise UnexpectedAnswer(f"status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, colon, value = line.partition(":")
            if not colon:
                raise UnexpectedAnswer(f"header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep_alive = "keep-alive" in tokens if version == "HTTP/1.0" else "close" not in tokens
    encoding = headers.get("transfer-encoding")
    if encoding is not None:
        if encoding.lower() != "chunked":
            raise UnexpectedAnswer(f"transfer-encoding {encoding[:80]!r}")
        return int(code), keep_alive, None, True
    raw_length = headers.get("content-length")
    if raw_length is None:
        return int(code), False, None, False
    if not raw_length.isdigit() or len(raw_length) > 9 or int(raw_length) > BODY_LIMIT:
        raise UnexpectedAnswer(f"content-length {raw_length[:80]!r}")
    return int(code), keep_alive, int(raw_length), False


async def _read_body(
    reader: asyncio.StreamReader, status: int, length: int | None, chunked: bool
) -> bytes:
    if status in (204, 304):
        return b""
    if length is not None:
        return await reader.readexactly(length) if length else b""
    if chunked:
        return await _read_chunks(reader)
    body = await reader.read(BODY_LIMIT + 1)  # framed by the connection's close
    while len(body) <= BODY_LIMIT:
        more = await reader.read(BODY_LIMIT + 1 - len(body))
        if not more:
            return body
        body += more
    raise UnexpectedAnswer(f"body over {BODY_LIMIT} bytes")


async def _read_chunks(reader: asyncio.StreamReader) -> bytes:
    body = b""
    while True:
        size_field = (await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip()
        if not size_field or len(size_field) > 8:
            raise UnexpectedAnswer(f"chunk size {size_field[:80]!r}")
        size = int(size_field, 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, up to the blank line
                pass
            return body
        if len(body) + size > BODY_LIMIT:
            raise UnexpectedAnswer(f"body over {BODY_LIMIT} bytes")
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise UnexpectedAnswer("chunk not followed by CRLF")


# --------------------------------------------------------------------------- per-target rails


def rails_map(payload: object) -> dict[str, int | None] | None:
    """``{"targets": [{"target_id": …, "rails": n | null}, …]}`` as ``{target_id: rails}``;
    ``None`` for a body of another shape. A row whose rails are not a positive integer
    reads as ``None`` (unknown), never as a number."""
    if not isinstance(payload, dict) or not isinstance(payload.get("targets"), list):
        return None
    result: dict[str, int | None] = {}
    for row in payload["targets"]:
        if not isinstance(row, dict) or not isinstance(row.get("target_id"), str):
            continue
        rails = row.get("rails")
        valid = isinstance(rails, int) and not isinstance(rails, bool) and rails >= 1
        result[row["target_id"]] = rails if valid else None
    return result


@dataclass
class _Budget:
    """One target's semaphore; unlike ``asyncio.Semaphore`` its limit can change."""

    limit: int | None
    """``None``: no limit."""
    active: int = 0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)

    def has_room(self) -> bool:
        return self.limit is None or self.active < self.limit

    async def acquire(self) -> None:
        if self.has_room() and not self.waiters:
            self.active += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # granted, then cancelled before it could run
            elif waiter in self.waiters:
                self.waiters.remove(waiter)
            raise

    def release(self) -> None:
        self.active -= 1
        self.wake()

    def wake(self) -> None:
        """Hand free rails to the waiters, first come first served."""
        while self.waiters and self.has_room():
            waiter = self.waiters.popleft()
            if not waiter.done():
                self.active += 1
                waiter.set_result(None)


class TargetSemaphores:
    """The per-target semaphores of docs/placement-rules.md §4.3, sized from each target's rails.

    ``rails`` maps a target to its rails (``None``: unknown). A target with
    unknown rails, or one never named, gets ``unknown`` rails: 1 by default, the
    safe direction (docs/placement-rules.md §5 item 3: a failed probe must not hand a one-rail
    server two requests); ``unknown=None`` leaves such targets unlimited.
    :meth:`resize` changes limits in place: requests already inside keep their
    rail, a raised limit lets waiters in at once, a lowered one admits nobody
    new until enough have left.
    """

    def __init__(
        self, rails: Mapping[str, int | None] | None = None, *, unknown: int | None = 1
    ) -> None:
        if unknown is not None and unknown < 1:
            raise ValueError(f"unknown: {unknown} rails; give a positive number or None")
        self.unknown = unknown
        self._rails: dict[str, int | None] = {}
        self._budgets: dict[str, _Budget] = {}
        self.resize(rails or {})

    def limit(self, target_id: str) -> int | None:
        """The rails ``target_id`` is run with now (``None``: unlimited)."""
        rails = self._rails.get(target_id)
        return rails if rails is not None else self.unknown

    def resize(self, rails: Mapping[str, int | None]) -> None:
        """Take a new rails map (the controller's answer); targets it drops fall back
        to ``unknown``."""
        self._rails = {target: n if n is None or n >= 1 else None for target, n in rails.items()}
        for target, budget in self._budgets.items():
            budget.limit = self.limit(target)
            budget.wake()

    def _budget(self, target_id: str) -> _Budget:
        budget = self._budgets.get(target_id)
        if budget is None:
            budget = self._budgets[target_id] = _Budget(self.limit(target_id))
        return budget

    @asynccontextmanager
    async def slot(self, target_id: str) -> AsyncIterator[None]:
        """Hold one of ``target_id``'s rails for the body; waits while they are all taken."""
        budget = self._budget(target_id)
        await budget.acquire()
        try:
            yield
        finally:
            budget.release()

    def active(self, target_id: str) -> int:
        budget = self._budgets.get(target_id)
        return budget.active if budget is not None else 0

    def waiting(self, target_id: str) -> int:
        budget = self._budgets.get(target_id)
        return sum(not w.done() for w in budget.waiters) if budget is not None else 0

    def snapshot(self) -> dict[str, dict[str, int | None]]:
        """``{target: {rails, active, waiting}}`` for every target seen or sized."""
        targets = sorted(set(self._rails) | set(self._budgets))
        return {
            t: {"rails": self.limit(t), "active": self.active(t), "waiting": self.waiting(t)}
            for t in targets
        }


# --------------------------------------------------------------------------- 409 bodies


def park_message(model: str, placement_id: str, reason: str) -> str:
    """The human text of a park, by reason (docs/http-contract.md §2, exact): it names
    the commands that resolve it, ``uapplace pending`` and ``uapplace apply``."""
    if reason == "auto_loading":
        return (
            f"model {model} is being loaded automatically; retrying is correct and it will "
            "forward when the load completes"
        )
    # The wire shape of the stock proxy's text is kept, "(placement ID)" last, since
    # clients read the id from it; only the command named is uapplace's real one.
    resolve = f"resolve with `uapplace pending` (placement {placement_id})"
    if reason == "auto_failed":
        return f"model {model} failed to load automatically; {resolve}"
    return f"model {model} is not loaded; {resolve}"


def _retry_headers() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


def anthropic_409(
    model: str, placement_id: str, reason: str
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """``409``, ``Retry-After: 2``, ``model_placement_pending`` (docs/http-contract.md §2)."""
    body = {
        "type": "error",
        "error": {
            "type": "model_placement_pending",
            "message": park_message(model, placement_id, reason),
            "placement_id": placement_id,
            "requested_model": model,
            "reason": reason,
            "retry_after_ms": RETRY_AFTER_MS,
            "resolve_with": RESOLVE_WITH,
        },
    }
    return 409, _retry_headers(), body


def openai_409(
    model: str, placement_id: str, reason: str
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """``409 {"error": {"message": …, "type": "upstream_error"}}``."""
    body = {
        "error": {"message": park_message(model, placement_id, reason), "type": "upstream_error"}
    }
    return 409, _retry_headers(), body


def ollama_409(
    model: str, placement_id: str, reason: str
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """``409 {"error": "<message>"}``."""
    return 409, _retry_headers(), {"error": park_message(model, placement_id, reason)}


def dialect_for_path(path: str) -> Dialect | None:
    """The error dialect of a gated route; ``None`` for a route the gate does not cover."""
    bare = path.split("?", 1)[0]
    if len(bare) > 1:
        bare = bare.rstrip("/")
    return _DIALECT_BY_PATH.get(bare)


def park_409(
    path: str, model: str, placement_id: str, reason: str
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """The 409 for ``path``'s dialect; Anthropic for any path the table does not name."""
    builders = {"anthropic": anthropic_409, "openai": openai_409, "ollama": ollama_409}
    return builders[dialect_for_path(path) or "anthropic"](model, placement_id, reason)
