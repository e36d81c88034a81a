"""The shim's route handlers (:class:`Shim`): each route is one call on the bus API, its
answer mapped to HTTP.

Built by :func:`uapplace.shim.app.create_app`, which registers each method on its
path (:data:`uapplace.shim.routes.ROUTES`); access checks common to every route
have run by then (:func:`uapplace.shim.app.guarded`). The shim holds no placement state: the
daemon's JSON for state, pending, preview and the auto policy passes through
byte for byte; Apply/Load/Unload results are parsed (the metrics count their
outcome) and sent compact, unchanged in content.

Status mapping of the daemon's answers:

- Admit: always ``200`` with exactly ``{"decision":"forward","target_id":…}`` or
  ``{"decision":"park","placement_id":…,"reason":…}``.
- An enforcement the daemon ran and reports as failed (rolled back or not) is a
  normal reply: ``200`` with ``"ok": false`` in the Apply JSON.
- Bus errors, by name (:data:`STATUS_BY_BUS_ERROR`), never by message text:
  ``NotFound`` and ``UnknownModel`` → 404, ``Drifted`` → 409 with an Apply-style
  body (``ok: false``, ``error``: "victim set changed: …"), ``Busy`` → 409,
  ``InvalidArgument`` → 400, ``NotAuthorized`` → 403, ``Failed`` → 500 (the
  daemon could not even produce a result), ``Unavailable`` → 503 with the
  daemon's message (it is up but has no systemd user manager to enforce with, or
  has not wired it yet: the machinery is missing, the daemon did not fail), any
  other error name → 502.
- The daemon unreachable or slower than the deadline (admit 1.5 s, well inside
  the proxy's 2 s; reads 10 s; enforcements 900 s) → 503
  ``{"error": "placement daemon unavailable: …"}``: the proxy then falls back to
  read-only admission instead of hanging.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.bus.events import EventError, EventLog
from uapplace.shim.access import (
    ADMIT_LOOPBACK_ONLY,
    is_loopback_peer,
    require_json,
    require_token,
)
from uapplace.shim.bodies import (
    MISSING_SIGNATURE,
    OPERATOR_BODIES,
    AutoBody,
    DismissBody,
    ModelBody,
    ModelT,
    ResolveBody,
    parse_admit,
    parse_cells_query,
    parse_model_query,
    read_json_object,
    read_model,
    signature_of,
)
from uapplace.shim.events import StreamLimits, stream_events
from uapplace.shim.gateway import BusGateway, BusWork, DaemonUnavailable, PeerWork
from uapplace.shim.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from uapplace.shim.metrics import ShimMetrics
from uapplace.shim.openapi import openapi_document
from uapplace.shim.responses import (
    HttpError,
    encode_json,
    encoded_json_response,
    json_response,
    raw_json_response,
    shown,
)
from uapplace.shim.routes import ROUTES
from uapplace.shim.settings import ShimSettings

T = TypeVar("T")

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
ADMIT_REPLY_MARGIN_S = 0.25
"""Of the admit deadline, what the daemon leaves for its reply to reach us (``AdmitBy``)."""
DEADLINE_PASSED = "deadline_passed"
SCRAPE_DEADLINE_S = 2.0
FORWARD_ANSWERS_KEPT = 256
"""Forward answers kept encoded (one per target the daemon named); more start the set anew."""

ModelCall = Callable[[PlacementClient, str, Sequence[str]], Awaitable[Any]]
"""``PlacementClient.load`` or ``.unload``: (client, model, expected victims) → result."""


@dataclass
class Shim:
    settings: ShimSettings
    gateway: BusGateway
    events: EventLog = field(default_factory=EventLog)
    """The daemon's signals, numbered, for ``GET /api/placement/events`` (fed by
    :class:`uapplace.shim.events.EventFeed`, started with the app)."""
    _forward_answers: dict[str, bytes] = field(default_factory=dict, repr=False)

    @property
    def metrics(self) -> ShimMetrics:
        return self.settings.metrics

    # ------------------------------------------------------------- helpers

    async def operator_body(self, request: web.Request, model: type[ModelT]) -> ModelT:
        """A write's body, read only once its token checks out."""
        require_token(request, self.settings.token)
        return await read_model(request, model, self.settings.body_timeout)

    async def bus(
        self, method: str, deadline: float, work: BusWork[T], peer_work: PeerWork[T] | None = None
    ) -> T:
        """A bus call with the daemon's errors turned into HTTP answers."""
        try:
            return await self.gateway.call(method, deadline, work, peer_work=peer_work)
        except DaemonUnavailable as err:
            raise HttpError(503, f"placement daemon unavailable: {err}") from None
        except PlacementError as err:
            status = STATUS_BY_BUS_ERROR.get(err.short, 502)
            message = err.message if err.short in STATUS_BY_BUS_ERROR else str(err)
            raise HttpError(status, message, bus_error=err.short) from None

    async def json_call(
        self, method: str, signature: str = "", body: list[Any] | None = None
    ) -> str:
        """A call under the read deadline whose reply is the daemon's JSON text."""
        reply = await self.bus(
            method, self.settings.read_deadline, lambda c: c.call(method, signature, body)
        )
        return str(reply[0])

    # ------------------------------------------------------------- admit

    async def admit(self, request: web.Request) -> web.Response:
        if not is_loopback_peer(request):  # the guard checked; this handler stands alone
            raise HttpError(403, ADMIT_LOOPBACK_ONLY)
        require_json(request)
        admit = parse_admit(await read_json_object(request, self.settings.body_timeout))
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
            lambda p: p.admit(
                admit.model_id, admit.client, admit.session, admit.cells, deadline_us=deadline_us
            ),
        )
        if answer.get("reason") == DEADLINE_PASSED and not answer.get("placement_id"):
            raise HttpError(503, "placement daemon unavailable: it answered after the deadline")
        decision = answer.get("decision")
        if decision == "forward":  # nearly every admit: its bytes are kept per target
            self.metrics.count_admit("forward", "")
            return encoded_json_response(self.forward_answer(answer["target_id"]))
        if decision == "park":
            body = {
                "decision": "park",
                "placement_id": answer["placement_id"],
                "reason": answer["reason"],
            }
        else:
            raise HttpError(502, f"the daemon answered an unknown decision {shown(str(decision))}")
        self.metrics.count_admit("park", body["reason"])
        return json_response(body)

    def forward_answer(self, target_id: str) -> bytes:
        """``{"decision":"forward","target_id":…}`` as sent, encoded once per target."""
        encoded = self._forward_answers.get(target_id)
        if encoded is None:
            if len(self._forward_answers) >= FORWARD_ANSWERS_KEPT:
                self._forward_answers.clear()
            encoded = encode_json({"decision": "forward", "target_id": target_id})
            self._forward_answers[target_id] = encoded
        return encoded

    # ------------------------------------------------------------- reads

    async def event_stream(self, request: web.Request) -> web.StreamResponse:
        """Server-Sent Events: the bus signals (and alerts), resumable (issue 13)."""
        limits = StreamLimits(
            queue=self.settings.sse_queue, write_timeout=self.settings.sse_write_timeout
        )
        try:
            return await stream_events(request, self.events, limits)
        except EventError as err:
            raise HttpError(400, str(err)) from None

    async def targets(self, request: web.Request) -> web.Response:
        """Per-target rails (``GetState.targets``): what a proxy sizes its slots from."""
        text = await self.json_call("GetState")
        try:
            state = json.loads(text)
        except ValueError:
            raise HttpError(502, "the daemon's GetState is not JSON") from None
        targets = state.get("targets") if isinstance(state, dict) else None
        return json_response({"targets": targets if isinstance(targets, list) else []})

    async def state(self, request: web.Request) -> web.Response:
        return raw_json_response(await self.json_call("GetState"))

    async def pending(self, request: web.Request) -> web.Response:
        return raw_json_response(await self.json_call("ListPending"))

    async def preview(self, request: web.Request) -> web.Response:
        model = parse_model_query(request.query.get("model"))
        cells = parse_cells_query(request.query.get("cells"))
        return raw_json_response(await self.json_call("Preview", "su", [model, cells]))

    # ------------------------------------------------------------- writes

    async def resolve(self, request: web.Request) -> web.Response:
        body = await self.operator_body(request, ResolveBody)
        expected = signature_of(body.expected_victims)
        return await self.enforcement(
            "resolve",
            "Apply",
            body.placement_id,
            lambda c: c.apply(body.placement_id, body.option, expected),
            signed=body.expected_victims is not None,
        )

    async def load(self, request: web.Request) -> web.Response:
        return await self.model_enforcement(request, "load", "Load", PlacementClient.load)

    async def unload(self, request: web.Request) -> web.Response:
        return await self.model_enforcement(request, "unload", "Unload", PlacementClient.unload)

    async def model_enforcement(
        self, request: web.Request, verb: str, method: str, call: ModelCall
    ) -> web.Response:
        """Load or Unload of the body's ``model``, signed by its ``expected_victims``."""
        body = await self.operator_body(request, ModelBody)
        expected = signature_of(body.expected_victims)
        return await self.enforcement(
            verb,
            method,
            "",
            lambda c: call(c, body.model, expected),
            signed=body.expected_victims is not None,
        )

    async def enforcement(
        self,
        verb: str,
        method: str,
        placement_id: str,
        work: BusWork[Any],
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
            self.metrics.enforcements.labels(verb, outcome).inc()
            self.metrics.enforcement_seconds.labels(verb, outcome).observe(elapsed)

    async def dismiss(self, request: web.Request) -> web.Response:
        body = await self.operator_body(request, DismissBody)
        dismissed = await self.bus(
            "Dismiss", self.settings.read_deadline, lambda c: c.dismiss(body.placement_id)
        )
        return json_response({"dismissed": dismissed})

    async def auto(self, request: web.Request) -> web.Response:
        body = await self.operator_body(request, AutoBody)
        changes = body.changes()
        if not changes:
            return raw_json_response(await self.json_call("GetAutoPolicy"))
        change_text = json.dumps(changes, separators=(",", ":"))
        return raw_json_response(
            await self.json_call("SetAutoPolicy", "sb", [change_text, body.yes])
        )

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
        body = self.metrics.exposition(state)
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def openapi(self, request: web.Request) -> web.Response:
        return json_response(openapi_document(ROUTES, OPERATOR_BODIES))


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
