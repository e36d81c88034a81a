"""A stand-in answering with the exact JSON of a real ``llama-server`` (llama.cpp 0.5.0-dev,
commit 0c1e570, the build ``scripts/build-llama-server.sh`` makes), for the unit tier.

The bodies are copied from the real server started as
``llama-server -m tiny-a.gguf --alias tiny-a -c 512 --parallel 2 --sleep-idle-seconds 5
[--metrics]``, with the same sleep rule: ``/health``, ``/props``, ``/v1/models`` and
``/metrics`` answer without waking it, ``GET /slots`` wakes it. Every ``GET`` is
counted per route (``hits``), so a test can prove that no probe asked ``/slots``.
Imported as ``from llama_shapes import ...`` (tests/unit is no package).
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

BUILD_INFO = "b1-0c1e570"

PROPS: dict[str, Any] = {
    "default_generation_settings": {
        "params": {
            "seed": 4294967295,
            "temperature": 0.8,
            "top_k": 40,
            "top_p": 0.95,
            "min_p": 0.05,
            "n_predict": -1,
            "max_tokens": -1,
            "ignore_eos": False,
            "stream": False,
            "chat_format": "Content-only",
            "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p"],
            "lora": [],
        },
        "n_ctx": 256,
    },
    "total_slots": 2,
    "model_alias": "tiny-a",
    "model_ftype": "all F32",
    "model_path": "/tmp/tiny/tiny-a.gguf",
    "modalities": {"vision": False, "video": False, "audio": False},
    "media_marker": "<__media_E9u5ObWB2i1ud7DElB5uWNhWjzJ4IIUQ__>",
    "endpoint_slots": True,
    "endpoint_props": False,
    "endpoint_metrics": False,
    "ui": True,
    "ui_settings": {},
    "chat_template": "{%- for message in messages -%}<|im_start|>{{ message.role }}",
    "chat_template_caps": {"supports_system_role": True, "supports_tools": False},
    "bos_token": "<s>",
    "eos_token": "</s>",
    "build_info": BUILD_INFO,
    "is_sleeping": False,
    "cors_proxy_enabled": False,
}
"""``GET /props`` of a single-model server with ``-c 512 --parallel 2``."""

ROUTER_PROPS: dict[str, Any] = {
    "role": "router",
    "max_instances": 1,
    "models_autoload": True,
    "model_alias": "llama-server",
    "model_path": "none",
    "default_generation_settings": {"params": None, "n_ctx": 0},
    "ui_settings": {},
    "build_info": BUILD_INFO,
    "cors_proxy_enabled": False,
}
"""``GET /props`` of a router (``--models-dir``) itself, without ``?model=``."""

METRICS_TEXT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 8
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 0.004
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 248
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 249
# HELP llamacpp:n_tokens_max Largest observed n_tokens.
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 256
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 2000
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""
"""``GET /metrics`` with ``--metrics``: counters and gauges only, no settings."""

NO_METRICS = {
    "error": {
        "code": 501,
        "message": "This server does not support metrics endpoint. Start it with `--metrics`",
        "type": "not_supported_error",
    }
}


def slot(index: int, n_ctx: int) -> dict[str, Any]:
    """One idle ``GET /slots`` entry, before any task."""
    return {"id": index, "n_ctx": n_ctx, "speculative": False, "is_processing": False}


@dataclass
class LlamaShapes:
    """The stand-in's state: change it between requests to shape the next answers."""

    alias: str = "tiny-a"
    n_ctx: int = 256
    """One slot's context (``default_generation_settings.n_ctx``)."""
    total_slots: int = 2
    asleep: bool = False
    metrics_enabled: bool = True
    props_override: dict[str, Any] | None = None
    """Serve this ``/props`` body instead (a router's, one without ``total_slots``)."""
    no_props_route: bool = False
    """``/props`` answers 404 (a server without the route)."""
    router: bool = False
    """A router (``--models-dir``) asked without ``?model=``: ``/props`` is the router's own
    (:data:`ROUTER_PROPS`), ``/slots`` and ``/metrics`` answer 400."""
    hits: Counter[str] = field(default_factory=Counter)
    queries: list[str] = field(default_factory=list)
    """The query string of each ``GET /props`` (a router's ``model=ID&autoload=false``)."""

    def props_body(self) -> dict[str, Any]:
        if self.router:
            return copy.deepcopy(ROUTER_PROPS)
        if self.props_override is not None:
            return copy.deepcopy(self.props_override)
        body = copy.deepcopy(PROPS)
        body["default_generation_settings"]["n_ctx"] = self.n_ctx
        body["total_slots"] = self.total_slots
        body["model_alias"] = self.alias
        body["is_sleeping"] = self.asleep
        return body

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/props", self._props)
        app.router.add_get("/slots", self._slots)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        self.hits["/health"] += 1
        return web.json_response({"status": "ok"})

    async def _props(self, request: web.Request) -> web.Response:
        self.hits["/props"] += 1
        self.queries.append(request.query_string)
        if self.no_props_route:
            error = {"code": 404, "message": "File Not Found", "type": "not_found_error"}
            return web.json_response({"error": error}, status=404)
        return web.json_response(self.props_body())

    async def _slots(self, request: web.Request) -> web.Response:
        self.hits["/slots"] += 1
        if self.router:
            return _no_model()
        self.asleep = False  # a task: the real server reloads its model to answer
        return web.json_response([slot(i, self.n_ctx) for i in range(self.total_slots)])

    async def _metrics(self, request: web.Request) -> web.Response:
        self.hits["/metrics"] += 1
        if self.router:
            return _no_model()
        if not self.metrics_enabled:
            return web.json_response(NO_METRICS, status=501)
        return web.Response(text=METRICS_TEXT, content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        self.hits["/v1/models"] += 1
        meta = {"vocab_type": 1, "n_vocab": 302, "n_ctx": self.n_ctx, "n_ctx_train": 2048}
        entry = {
            "id": self.alias,
            "object": "model",
            "created": 1796290582,
            "owned_by": "llamacpp",
            "meta": meta,
        }
        return web.json_response({"object": "list", "data": [entry]})


def _no_model() -> web.Response:
    error = {
        "code": 400,
        "message": "model name is missing from the request",
        "type": "invalid_request_error",
    }
    return web.json_response({"error": error}, status=400)
