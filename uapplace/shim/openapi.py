"""The OpenAPI 3.1 document of ``uapplace-shim`` (served at ``GET /openapi.json``).

Request schemas of the operator routes come from the shim's own pydantic body
models, so the document and the validation cannot drift apart; admit's body is
written out because its rules are deliberately lenient (docs/http-contract.md §1).
Built on request by :meth:`uapplace.shim.handlers.Shim.openapi` from the route
table and :data:`uapplace.shim.bodies.OPERATOR_BODIES`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from uapplace.shim.access import TOKEN_HEADER
from uapplace.shim.bodies import BODY_LIMIT, U32_MAX


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_content(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": dict(schema)}}


def _errors(*statuses: int) -> dict[str, Any]:
    meaning = {
        400: "Invalid JSON, a wrong field type or an unknown field (the message names it)",
        401: f"Missing or wrong {TOKEN_HEADER}",
        403: "Not a loopback peer / Host, or the daemon's authorization said no",
        404: "Unknown placement id or model",
        409: "Busy (another enforcement or a held victim)",
        413: f"Request body over {BODY_LIMIT} bytes",
        500: "The daemon failed without producing a result",
        502: "The daemon answered with an unexpected error",
        503: "The placement daemon is unreachable or did not answer in time, or it cannot "
        "do this here (no systemd user manager to enforce with; the message says so)",
    }
    return {
        str(code): {"description": meaning[code], "content": _json_content(_ref("Error"))}
        for code in statuses
    }


def _pydantic_schemas(models: Sequence[type[BaseModel]]) -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas


_APPLY_RESULT = {
    "type": "object",
    "required": ["ok", "placementId", "steps"],
    "properties": {
        "ok": {"type": "boolean"},
        "placementId": {"type": "string"},
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "ok"],
                "properties": {
                    "name": {"type": "string"},
                    "ok": {"type": "boolean"},
                    "detail": {"type": "string"},
                },
            },
        },
        "rolledBack": {"type": "boolean"},
        "error": {"type": "string"},
        "runningAfter": {
            "type": "array",
            "description": "what runs on the run's device(s) when it ended",
            "items": {
                "type": "object",
                "required": ["model", "config", "device", "unit", "state"],
                "properties": {
                    "model": {"type": "string"},
                    "config": {"type": "string"},
                    "device": {"type": "string"},
                    "unit": {"type": ["string", "null"]},
                    "state": {"type": "string"},
                },
            },
        },
    },
}
_ADMIT_REQUEST = {
    "type": "object",
    "required": ["model_id"],
    "properties": {
        "model_id": {
            "type": "string",
            "minLength": 1,
            "description": "the id the client asked for",
        },
        "client": {"type": "string", "description": "client identity; cut to 128 characters"},
        "session": {"type": ["string", "null"], "description": "cut to 128 characters"},
        "cells": {
            "type": "integer",
            "description": "context needed; used only when a positive integer, else 32768",
        },
    },
}
_ADMIT_RESPONSE = {
    "oneOf": [
        {
            "type": "object",
            "required": ["decision", "target_id"],
            "additionalProperties": False,
            "properties": {
                "decision": {"const": "forward"},
                "target_id": {"type": "string", "pattern": r"^[A-Za-z0-9_.\-]+:\S+$"},
            },
        },
        {
            "type": "object",
            "required": ["decision", "placement_id", "reason"],
            "additionalProperties": False,
            "properties": {
                "decision": {"const": "park"},
                "placement_id": {"type": "string", "pattern": "^plc-[0-9a-f]{6}$"},
                "reason": {"type": "string"},
            },
        },
    ]
}


def _post(
    summary: str, body: str, response: Mapping[str, Any], errors: Sequence[int], token: bool = True
) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "requestBody": {"required": True, "content": _json_content(_ref(body))},
        "responses": {
            "200": {"description": "OK", "content": _json_content(response)},
            **_errors(*errors),
        },
    }
    if token:
        operation["security"] = [{"dashboardToken": []}]
    return {"post": operation}


def _resolve_operation(errors: Sequence[int]) -> dict[str, Any]:
    """``resolve``: a Drifted refusal is a 409 carrying an Apply-style body, Busy a plain error."""
    item = _post(
        "Apply option N (1-based) of a parked placement (the operator's explicit yes)",
        "ResolveBody",
        _ref("ApplyResult"),
        errors,
    )
    item["post"]["responses"]["409"] = {
        "description": "Drifted: the victim set changed since the preview (Apply-style body, "
        "ok false, error 'victim set changed: …', nothing ran); or Busy ({error})",
        "content": _json_content({"oneOf": [_ref("ApplyResult"), _ref("Error")]}),
    }
    return item


_TARGET: dict[str, Any] = {
    "type": "object",
    "required": ["target_id", "model", "rails", "rails_source", "state"],
    "properties": {
        "target_id": {"type": "string"},
        "model": {"type": "string"},
        "engine": {"type": "string"},
        "endpoint": {"type": ["string", "null"]},
        "rails": {"type": ["integer", "null"], "minimum": 1},
        "rails_source": {"enum": ["registry", "slots", "props", "metrics", None]},
        "state": {"enum": ["ok", "disagree", "probe_failed", "unsupported", "not_probed"]},
        "declared": {"type": ["integer", "null"]},
        "declared_source": {"type": ["string", "null"]},
        "live": {"type": "object"},
        "agrees": {"type": ["boolean", "null"]},
    },
}


def _get(
    summary: str, response: Mapping[str, Any], errors: Sequence[int], **extra: Any
) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            **extra,
            "responses": {
                "200": {"description": "OK", "content": _json_content(response)},
                **_errors(*errors),
            },
        }
    }


def openapi_document(
    routes: Mapping[str, str], body_models: Sequence[type[BaseModel]]
) -> dict[str, Any]:
    """OpenAPI 3.1 description of every route; ``body_models`` are the write bodies."""
    writes = (400, 401, 403, 404, 409, 413, 500, 503)
    object_schema = {"type": "object"}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "uapplace shim",
            "version": "1",
            "description": "Loopback HTTP face of uapplaced: the UAP proxy's placement "
            'controller (admit) and the operator routes. Errors are {"error": "…"}.',
        },
        "servers": [{"url": "http://127.0.0.1:3847"}],
        "paths": {
            routes["admit"]: _post(
                "Forward or park one request (docs/http-contract.md §1); loopback peers only, "
                "no token",
                "AdmitRequest",
                _ref("AdmitResponse"),
                (400, 403, 413, 503),
                token=False,
            ),
            routes["state"]: _get(
                "The ledger: devices, residents, pending, usage", object_schema, (503,)
            ),
            routes["pending"]: _get(
                "Parked requests with their ranked options",
                {"type": "object", "properties": {"pending": {"type": "array"}}},
                (503,),
            ),
            routes["preview"]: _get(
                "Options for placing a model",
                {
                    "type": "object",
                    "properties": {
                        "model": {"type": "string"},
                        "reason": {
                            "enum": [
                                "ok",
                                "not_in_registry",
                                "no_measured_config",
                                "no_feasible_option",
                            ]
                        },
                        "options": {"type": "array"},
                        "infeasible": {"type": "array", "items": {"type": "string"}},
                    },
                },
                (400, 503),
                parameters=[
                    {
                        "name": "model",
                        "in": "query",
                        "required": True,
                        "schema": {"type": "string", "minLength": 1},
                    },
                    {
                        "name": "cells",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": U32_MAX},
                    },
                ],
            ),
            routes["resolve"]: _resolve_operation(writes),
            routes["dismiss"]: _post(
                "Dismiss a parked placement",
                "DismissBody",
                {
                    "type": "object",
                    "required": ["dismissed"],
                    "properties": {"dismissed": {"type": "boolean"}},
                },
                writes,
            ),
            routes["load"]: _post(
                "Load a model (operator-initiated)", "ModelBody", _ref("ApplyResult"), writes
            ),
            routes["unload"]: _post("Unload a model", "ModelBody", _ref("ApplyResult"), writes),
            routes["auto"]: _post(
                "Read ({}) or change the auto policy; consent-granting changes need yes: true",
                "AutoBody",
                object_schema,
                writes,
            ),
            routes["metrics"]: {
                "get": {
                    "summary": "Prometheus metrics (text exposition 0.0.4)",
                    "responses": {
                        "200": {
                            "description": "OK",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            routes["targets"]: _get(
                "Per-target rails (how many requests each target takes at once), from the "
                "registry cross-checked with the live engine; rails null = unknown",
                {"type": "object", "properties": {"targets": {"type": "array", "items": _TARGET}}},
                (503,),
            ),
            routes["events"]: {
                "get": {
                    "summary": "Server-Sent Events: Parked, Resolved, ResidentChanged, "
                    "EnforcementStep, AlertRaised (data: {id, event, at, data}); resume with "
                    "Last-Event-ID (or ?last_event_id=); EventsLost names ids no longer kept",
                    "parameters": [
                        {
                            "name": "last_event_id",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "integer", "minimum": 0},
                        },
                        {
                            "name": "Last-Event-ID",
                            "in": "header",
                            "required": False,
                            "schema": {"type": "integer", "minimum": 0},
                        },
                    ],
                    "responses": {
                        "200": {
                            "description": "OK",
                            "content": {"text/event-stream": {"schema": {"type": "string"}}},
                        },
                        **_errors(400),
                    },
                }
            },
            routes["openapi"]: _get("This document", object_schema, ()),
        },
        "components": {
            "securitySchemes": {
                "dashboardToken": {"type": "apiKey", "in": "header", "name": TOKEN_HEADER}
            },
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {"error": {"type": "string"}},
                },
                "AdmitRequest": _ADMIT_REQUEST,
                "AdmitResponse": _ADMIT_RESPONSE,
                "ApplyResult": _APPLY_RESULT,
                **_pydantic_schemas(body_models),
            },
        },
    }
