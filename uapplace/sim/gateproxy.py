"""A small proxy in front of local engines, gated by the placement controller.

It is the proxy side of docs/http-contract.md built only from :mod:`uapplace.gate`, for
tests, ``uapplace demo`` and anyone who wants to see the whole path: a client
request is admitted through :class:`~uapplace.gate.GateClient` (pointed at the
shim), then either forwarded to the admitted target's endpoint or answered with
the dialect's ``409`` (:func:`~uapplace.gate.park_409`).

Client routes:

- ``POST /v1/chat/completions`` (OpenAI): the body goes upstream unchanged, to
  ``<endpoint>/v1/chat/completions``, and the answer comes back as it is
  (streamed, so ``"stream": true`` works).
- ``POST /v1/messages``, ``POST /anthropic/v1/messages`` (Anthropic): text-only
  Messages requests are translated to an OpenAI chat completion upstream and the
  answer back to an Anthropic ``message``. Content blocks other than ``text``,
  and ``"stream": true``, are refused with a 400 naming them.

Who asks: ``x-uap-client-id: <id>`` makes the client ``x-uap-client-id:<id>``,
else ``remote:<peer address>``; ``x-uap-session-id`` is the session.

Routing, two topologies:

- **per-target** (the default, docs/placement-rules.md §6 "Phase 1.5"): a forward's ``target_id``
  is ``<device>:<endpoint>``; the endpoint is the upstream base URL. The proxy
  remembers which endpoint served each model id (its *cached upstream ids*, what
  the gate falls back on when the controller does not answer). A fallback
  forward (``target_id`` ``default``) goes to the remembered endpoint, else
  ``--default-upstream``, else it is parked with reason ``unroutable_target``.
- **single upstream** (``--single-upstream URL``): what the stock UAP proxy does
  today with its one ``LLAMA_CPP_BASE``. Every forward goes to that URL; the
  ``target_id`` only keys the concurrency slot and the in-flight bucket. Behind
  such a proxy only the engine listening on that address is reachable, so the
  registry must say so (``single_upstream``) for placement to stay honest.

Concurrency: each forward holds a rail of its target in a
:class:`~uapplace.gate.TargetSemaphores` map sized from the controller's
``GET /api/placement/targets`` (read at start and after every refresh, in the
background); a target the controller gave no rails for is not limited (the
proxy's behaviour before rails existed). A request is listed in flight from the
moment it is admitted, while it waits for its rail too: a drain must wait for it.

Controller routes (docs/http-contract.md §3), with ``Authorization: Bearer <token>`` required
when the proxy has a token:

- ``GET /internal/placement/inflight``: every request being forwarded, by target;
  a target once seen stays with an empty list.
- ``POST /internal/placement/refresh``: forgets the cached upstream ids and the
  gate's 5 s burst map (a client retrying after the swap is asked about again,
  not re-parked from before it); answers ``{"ok": true, "cleared":
  ["upstream_model_ids", "park_bursts"]}`` and is counted in
  :attr:`GateProxy.refreshes`.

Command line: ``python -m uapplace.sim.gateproxy --controller URL [--port P]``
(the token is ``PROXY_AUTH_TOKEN`` as :meth:`uapplace.files.paths.Paths.proxy_token`
finds it); prints ``uapplace-gateproxy listening on http://127.0.0.1:P``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import secrets
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import aiohttp
from aiohttp import web
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from uapplace.core.model import iso
from uapplace.core.validation import first_error_text
from uapplace.files.paths import Paths
from uapplace.gate import (
    FALLBACK_TARGET,
    GateClient,
    GateDecision,
    TargetSemaphores,
    new_placement_id,
    park_409,
)
from uapplace.sim import serving

READY_PREFIX = "uapplace-gateproxy listening on "
UNROUTABLE = "unroutable_target"
CLIENT_HEADER = "x-uap-client-id"
SESSION_HEADER = "x-uap-session-id"
OPENAI_ROUTE = "/v1/chat/completions"
ANTHROPIC_ROUTES = ("/v1/messages", "/anthropic/v1/messages")
INFLIGHT_ROUTE = "/internal/placement/inflight"
REFRESH_ROUTE = "/internal/placement/refresh"
UPSTREAM_CONNECT_S = 5.0
UPSTREAM_READ_S = 300.0
REFRESH_CLEARS = ("upstream_model_ids", "park_bursts")
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}
)

Dialect = Literal["openai", "anthropic"]


class UpstreamError(Exception):
    """The upstream engine could not be reached or answered something unusable."""


# --------------------------------------------------------------------------- Anthropic bodies


class _TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


def _as_blocks(value: Any) -> Any:
    """A plain string is one text block (the Messages API allows both forms)."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


TextContent = Annotated[list[_TextBlock], BeforeValidator(_as_blocks)]


class _AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: TextContent


class AnthropicRequest(BaseModel):
    """The Messages request fields this proxy can translate; others are refused by name."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[_AnthropicMessage] = Field(min_length=1)
    system: TextContent | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop_sequences: list[str] | None = None
    stream: Literal[False] = False
    metadata: dict[str, Any] | None = None


def _text_of(content: list[_TextBlock]) -> str:
    return "".join(block.text for block in content)


def to_openai(body: AnthropicRequest) -> dict[str, Any]:
    """An Anthropic Messages request as an OpenAI chat completion request."""
    messages: list[dict[str, str]] = []
    if body.system is not None:
        messages.append({"role": "system", "content": _text_of(body.system)})
    messages += [{"role": m.role, "content": _text_of(m.content)} for m in body.messages]
    request: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_tokens,
    }
    optional = {"temperature": body.temperature, "top_p": body.top_p, "stop": body.stop_sequences}
    request.update({k: v for k, v in optional.items() if v is not None})
    return request


def to_anthropic(model: str, completion: Any) -> dict[str, Any]:
    """An OpenAI chat completion as an Anthropic ``message``; ``UpstreamError`` if malformed."""
    try:
        choice = completion["choices"][0]
        text = choice["message"]["content"] or ""
        finish = choice.get("finish_reason")
        usage = completion.get("usage") or {}
    except (KeyError, IndexError, TypeError) as err:
        raise UpstreamError(f"the upstream answer is not a chat completion ({err!r})") from None
    return {
        "id": f"msg_{secrets.token_hex(12)}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": str(text)}],
        "stop_reason": "max_tokens" if finish == "length" else "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": int(usage.get("prompt_tokens", 0)),
            "output_tokens": int(usage.get("completion_tokens", 0)),
        },
    }


def error_answer(dialect: Dialect, status: int, message: str, kind: str) -> web.Response:
    """An error in the client's dialect (``kind``: Anthropic's ``error.type``)."""
    if dialect == "anthropic":
        body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": kind}}
    return web.json_response(body, status=status)


# --------------------------------------------------------------------------- the proxy


@dataclass(frozen=True)
class Admitted:
    """A request the gate let through, and where it goes."""

    target_id: str
    upstream: str


@dataclass
class GateProxy:
    """The proxy's state: the gate, the cached routes, the in-flight table."""

    controller_url: str
    token: str | None = None
    default_upstream: str | None = None
    single_upstream: str | None = None
    """Set: every forward goes here, whatever its target (the stock proxy's topology)."""
    refreshes: int = 0
    routes: dict[str, str] = field(default_factory=dict)
    """Model id → upstream endpoint that served it (the cached upstream ids)."""
    inflight: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    """Target → request id → ``{id, client, started_at}``."""
    gate: GateClient | None = None
    http: aiohttp.ClientSession | None = None
    slots: TargetSemaphores = field(default_factory=lambda: TargetSemaphores(unknown=None))
    """Per-target concurrency, sized from the controller's rails."""
    _rails_reads: set[asyncio.Task[None]] = field(default_factory=set)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post(OPENAI_ROUTE, self.openai)
        for route in ANTHROPIC_ROUTES:
            app.router.add_post(route, self.anthropic)
        app.router.add_get(INFLIGHT_ROUTE, self.inflight_page)
        app.router.add_post(REFRESH_ROUTE, self.refresh)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _: web.Application) -> None:
        self.gate = GateClient(self.controller_url, upstream_ids=self.cached_ids)
        timeout = aiohttp.ClientTimeout(sock_connect=UPSTREAM_CONNECT_S, sock_read=UPSTREAM_READ_S)
        self.http = aiohttp.ClientSession(timeout=timeout)
        self.read_rails_soon()

    def read_rails_soon(self) -> None:
        """Re-size the per-target slots from the controller, in the background."""
        task = asyncio.create_task(self.read_rails())
        self._rails_reads.add(task)
        task.add_done_callback(self._rails_reads.discard)

    async def read_rails(self) -> None:
        """One read of the controller's rails; no answer keeps the sizes there are."""
        if self.gate is None:
            return
        rails = await self.gate.target_rails()
        if rails is not None:
            self.slots.resize(rails)

    async def _close(self, _: web.Application) -> None:
        for task in list(self._rails_reads):
            task.cancel()
        await asyncio.gather(*self._rails_reads, return_exceptions=True)
        if self.gate is not None:
            await self.gate.close()
        if self.http is not None:
            await self.http.close()

    def cached_ids(self) -> set[str] | None:
        """What the gate falls back on; ``None`` (unprobed) until something was served."""
        return set(self.routes) or None

    # ------------------------------------------------------------- client routes

    async def openai(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        model = _model_of(raw)
        if model is None:
            return error_answer(
                "openai",
                400,
                "body must be a JSON object with a model string",
                "invalid_request_error",
            )
        admitted = await self._admit(request, model)
        if isinstance(admitted, web.Response):
            return admitted
        with self._in_flight(admitted.target_id, request):
            try:
                async with self.slots.slot(admitted.target_id):
                    return await self._relay(request, admitted.upstream, raw)
            except UpstreamError as err:
                return error_answer("openai", 502, str(err), "upstream_error")

    async def anthropic(self, request: web.Request) -> web.Response:
        try:
            body = AnthropicRequest.model_validate_json(await request.read())
        except ValidationError as err:
            text = first_error_text(err, "body")
            return error_answer("anthropic", 400, text, "invalid_request_error")
        admitted = await self._admit(request, body.model)
        if isinstance(admitted, web.Response):
            return admitted
        with self._in_flight(admitted.target_id, request):
            try:
                async with self.slots.slot(admitted.target_id):
                    completion = await self._complete(admitted.upstream, to_openai(body))
                return web.json_response(to_anthropic(body.model, completion))
            except UpstreamError as err:
                return error_answer("anthropic", 502, str(err), "api_error")

    async def _admit(self, request: web.Request, model: str) -> Admitted | web.Response:
        """The gate's decision as a route, or the 409 the client gets."""
        assert self.gate is not None
        decision = await self.gate.admit(
            model, client_of(request), request.headers.get(SESSION_HEADER)
        )
        if decision.parked:
            return self._park(request, model, decision.placement_id or "", decision.reason or "")
        upstream = self._upstream_for(model, decision)
        if upstream is None:
            return self._park(request, model, new_placement_id(), UNROUTABLE)
        if decision.source == "controller":
            self.routes[model] = upstream
        return Admitted(decision.target_id or FALLBACK_TARGET, upstream)

    def _upstream_for(self, model: str, decision: GateDecision) -> str | None:
        if self.single_upstream is not None:
            return self.single_upstream.rstrip("/")
        target = decision.target_id or FALLBACK_TARGET
        _, _, endpoint = target.partition(":")
        if endpoint.startswith(("http://", "https://")):
            return endpoint.rstrip("/")
        return self.routes.get(model) or self.default_upstream

    @staticmethod
    def _park(request: web.Request, model: str, placement_id: str, reason: str) -> web.Response:
        status, headers, body = park_409(request.path, model, placement_id, reason)
        return web.json_response(body, status=status, headers=headers)

    async def _relay(self, request: web.Request, upstream: str, raw: bytes) -> web.StreamResponse:
        """POST ``raw`` upstream and stream the answer back as it comes.

        A failure before the upstream answered is an :class:`UpstreamError` (the
        client gets a 502); one mid-stream propagates, so aiohttp cuts the
        connection and the client sees a truncated answer rather than a clean end.
        """
        assert self.http is not None
        url = upstream + OPENAI_ROUTE
        try:
            answer = await self.http.post(
                url, data=raw, headers={"Content-Type": "application/json"}
            )
        except (aiohttp.ClientError, TimeoutError) as err:
            raise UpstreamError(f"POST {url}: {type(err).__name__}: {err}") from None
        try:
            response = web.StreamResponse(status=answer.status)
            for name, value in answer.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    response.headers[name] = value
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
        finally:
            answer.release()

    async def _complete(self, upstream: str, body: dict[str, Any]) -> Any:
        """One non-streaming chat completion upstream; its JSON answer."""
        assert self.http is not None
        url = upstream + OPENAI_ROUTE
        try:
            async with self.http.post(url, json=body) as answer:
                text = await answer.text()
                if answer.status != 200:
                    raise UpstreamError(f"POST {url}: HTTP {answer.status}: {text[:200]}")
        except (aiohttp.ClientError, TimeoutError) as err:
            raise UpstreamError(f"POST {url}: {type(err).__name__}: {err}") from None
        try:
            return json.loads(text)
        except ValueError:
            raise UpstreamError(f"POST {url}: the answer is not JSON") from None

    def _in_flight(self, target_id: str, request: web.Request) -> _InFlight:
        return _InFlight(self.inflight.setdefault(target_id, {}), client_of(request))

    # ------------------------------------------------------------- controller routes

    def _authorized(self, request: web.Request) -> bool:
        if self.token is None:
            return True
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    async def inflight_page(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        targets = {target: list(requests.values()) for target, requests in self.inflight.items()}
        return web.json_response({"targets": targets})

    async def refresh(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        self.refreshes += 1
        self.routes.clear()
        if self.gate is not None:
            self.gate.forget_parks()
        self.read_rails_soon()
        return web.json_response({"ok": True, "cleared": list(REFRESH_CLEARS)})


class _InFlight:
    """Lists one forwarded request under its target for as long as it runs."""

    def __init__(self, requests: dict[str, dict[str, str]], client: str) -> None:
        self.requests = requests
        self.entry = {
            "id": f"req-{secrets.token_hex(4)}",
            "client": client,
            "started_at": iso(time.time()),
        }

    def __enter__(self) -> None:
        self.requests[self.entry["id"]] = self.entry

    def __exit__(self, *exc: object) -> None:
        self.requests.pop(self.entry["id"], None)


def client_of(request: web.Request) -> str:
    """The client identity of docs/http-contract.md §1 for this request."""
    named = request.headers.get(CLIENT_HEADER)
    if named:
        return f"{CLIENT_HEADER}:{named}"
    return f"remote:{request.remote or 'unknown'}"


def _model_of(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None


# --------------------------------------------------------------------------- serving


async def start(
    proxy: GateProxy, port: int = 0, *, sock: socket.socket | None = None
) -> tuple[web.AppRunner, str]:
    """Serve ``proxy`` on ``sock`` (:func:`uapplace.sim.serving.bind_loopback`), else on
    127.0.0.1:``port``; the runner and base URL."""
    return await serving.start(proxy.app(), port, sock=sock)


def main(argv: Sequence[str] | None = None) -> int:
    paths = Paths.from_env()
    parser = argparse.ArgumentParser(
        prog="python -m uapplace.sim.gateproxy",
        description="A small Anthropic/OpenAI proxy gated by the placement controller.",
    )
    parser.add_argument(
        "--controller",
        default=f"http://127.0.0.1:{paths.shim_port}",
        help="the placement controller (the shim), default http://127.0.0.1:<shim port>",
    )
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1; 0 picks one")
    parser.add_argument(
        "--default-upstream", default=None, help="where a fallback forward goes (base URL)"
    )
    parser.add_argument(
        "--single-upstream",
        default=None,
        metavar="URL",
        help="send every forward here, target_id only keys slots (the stock UAP proxy's way)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: not a TCP port (0-65535)")
    for flag, url in (
        ("--default-upstream", args.default_upstream),
        ("--single-upstream", args.single_upstream),
    ):
        if url is not None and not url.startswith(("http://", "https://")):
            parser.error(f"{flag} {url!r}: not an http:// or https:// base URL")
    proxy = GateProxy(
        args.controller,
        paths.proxy_token(),
        args.default_upstream,
        single_upstream=args.single_upstream,
    )
    return asyncio.run(serving.serve_until_signalled(proxy.app(), args.port, READY_PREFIX))


if __name__ == "__main__":
    sys.exit(main())
