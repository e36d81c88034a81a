"""What the shim accepts in a request: the body read within its size and time limits, and
the parsed shapes (pydantic models for the operator routes; admit's lenient parse,
docs/http-contract.md §1).

Used by :mod:`uapplace.shim.handlers` for every route that takes input, and by
:mod:`uapplace.shim.openapi` (the operator bodies' schemas come from these models,
so the document and the validation cannot drift apart). Bodies are at most
:data:`BODY_LIMIT` bytes (``413``), JSON objects only; a wrong type or an unknown
field is a ``400`` naming the field. Every string must be one the bus can carry.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from uapplace.core.admission import MAX_MODEL_ID_CHARS
from uapplace.core.model import DEFAULT_CELLS, PAUSE_SUFFIX, VictimAction
from uapplace.core.validation import first_error
from uapplace.shim.responses import ClientGone, HttpError, shown

BODY_LIMIT = 10240
FIELD_LIMIT = 128
U32_MAX = 2**32 - 1

ModelT = TypeVar("ModelT", bound=BaseModel)


# --------------------------------------------------------------------------- operator bodies


def check_bus_text(value: str) -> str:
    """A string the bus can carry: valid Unicode (no lone surrogates) and no NUL."""
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    if value.isascii():  # the usual id: ASCII always encodes, so no trial encoding
        return value
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
    action: VictimAction
    """A preview victim's ``action`` (issue 12): approving a pause is not approving a stop.
    Required (issue 20): a missing one is a 400 naming the field, never a default stop."""


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
    "the operator approved ([{model, config, action}], as preview/pending show them)"
)


def signature_of(refs: list[VictimRefBody] | None) -> list[str]:
    """``expected_victims`` (docs/http-contract.md §4) → the bus signature (``model/config``).

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


OPERATOR_BODIES: tuple[type[BaseModel], ...] = (ResolveBody, DismissBody, ModelBody, AutoBody)
"""The bodies the OpenAPI document describes from their models."""


def validation_message(err: ValidationError) -> str:
    first = first_error(err)
    more = f" (and {first.more} more)" if first.more else ""
    return f"invalid field {first.where('body')}: {first.msg}{more}"


# --------------------------------------------------------------------------- admit, query


@dataclass(frozen=True)
class AdmitRequest:
    model_id: str
    client: str
    session: str
    cells: int


def parse_admit(payload: Mapping[str, Any]) -> AdmitRequest:
    """The body of docs/http-contract.md §1, leniently where the contract is lenient (``cells``)."""
    model_id = payload.get("model_id")
    if model_id is None or model_id == "":
        raise HttpError(400, "missing model_id")
    client = payload.get("client")
    session = payload.get("session")
    for name, value in (("model_id", model_id), ("client", client), ("session", session)):
        if value is None:
            continue
        if not isinstance(value, str):
            raise HttpError(400, f"{name} must be a string, got {type(value).__name__}")
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
        client=(client or "")[:FIELD_LIMIT],
        session=(session or "")[:FIELD_LIMIT],
        cells=cells_used,
    )


def parse_model_query(text: str | None) -> str:
    """Preview's ``model`` query parameter: present, and text the bus can carry."""
    if not text:
        raise HttpError(400, "missing query parameter model")
    try:
        return check_bus_text(text)
    except ValueError as err:
        raise HttpError(400, f"query parameter model {err}") from None


def parse_cells_query(text: str | None) -> int:
    """Preview's ``cells``: 1 to 2**32 − 1; a 5,000-digit number is a 400 like any other
    out-of-range value (it is never handed to ``int``)."""
    if text is None or text == "":
        return DEFAULT_CELLS
    digits = len(str(U32_MAX))
    if (
        not text.isascii()
        or not text.isdigit()
        or len(text) > digits
        or not 1 <= int(text) <= U32_MAX
    ):
        raise HttpError(
            400, f"query parameter cells must be an integer from 1 to {U32_MAX}, got {shown(text)}"
        )
    return int(text)


# --------------------------------------------------------------------------- reading


async def read_body(request: web.Request, limit_s: float) -> bytes:
    """The request body, refusing more than :data:`BODY_LIMIT` bytes without reading it all.

    Bounded in time too (``limit_s``: a slow-body client holds a connection no
    longer than that, ``408``); a client that hangs up mid-body is
    :class:`ClientGone`, not an error of ours.
    """
    declared = request.content_length
    if declared is not None and declared > BODY_LIMIT:
        raise HttpError(413, f"request body over {BODY_LIMIT} bytes")
    content = request.content
    try:
        if declared is not None and content.is_eof():
            # All of it came with the head (the proxy's small admit always does): nothing
            # to wait for, so no timer to arm and cancel (issue 23).
            return content.read_nowait()
        async with asyncio.timeout(limit_s):
            return await _read_body_within_limit(request)
    except TimeoutError:
        raise HttpError(408, f"request body not received within {limit_s:g} s") from None
    except (ConnectionError, HttpProcessingError) as err:
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ClientGone(f"{type(err).__name__}: {err}") from None
        raise HttpError(400, f"request body could not be read: {err}") from None


async def _read_body_within_limit(request: web.Request) -> bytes:
    data = bytearray()
    while True:
        chunk = await request.content.read(BODY_LIMIT + 1 - len(data))
        if not chunk:
            return bytes(data)
        data += chunk
        if len(data) > BODY_LIMIT:
            raise HttpError(413, f"request body over {BODY_LIMIT} bytes")


async def read_json_object(request: web.Request, limit_s: float) -> dict[str, Any]:
    """The body as a JSON object; an empty body is ``{}``."""
    raw = await read_body(request, limit_s)
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HttpError(400, f"request body is not valid JSON: {err}") from None
    except RecursionError:
        raise HttpError(400, "request body is not valid JSON: nested too deeply") from None
    except ValueError as err:  # an integer past Python's 4,300-digit limit
        raise HttpError(400, f"request body is not valid JSON: {shown(str(err), 80)}") from None
    if not isinstance(value, dict):
        raise HttpError(400, f"request body must be a JSON object, got {type(value).__name__}")
    return value


async def read_model(request: web.Request, model: type[ModelT], limit_s: float) -> ModelT:
    payload = await read_json_object(request, limit_s)
    try:
        return model.model_validate(payload)
    except ValidationError as err:
        raise HttpError(400, validation_message(err)) from None
