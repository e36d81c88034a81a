"""A fake llama.cpp-like engine for tests and ``uapplace demo``.

docs/architecture.md ("Simulated GPU and fake engine"). Where it and the real
``llama-server`` answer a probe differently, the real one is right: the engine-contract
suite (``tests/engines/test_contract.py``) runs the same checks against both.

::

    python -m uapplace.sim.engine --port P --model-id ID [--advertise ID2 ...]
        [--gpu-uuid U --mib N] [--host-mib N] [--load-secs S]
        [-c N] [--parallel N] [--kv int8] [--max-context 131072] [--no-slots]
        [--token-secs S] [--sleep-idle-seconds S]
        [--fail-route slots|props|metrics ...]
        [--fail-at-start] [--never-healthy] [--wrong-id]
        [--orphan --orphan-pidfile PATH [--orphan-lifetime 120]]
        [--sleep-mode [--sleep-delay S] [--wake-delay S] [--offload-mib N] [--fail-wake]]

HTTP, like ``llama-server`` (as if started with ``--metrics``): while loading, every
route, ``/health`` included, answers 503
``{"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}``;
then ``/health`` is 200 ``{"status": "ok"}``.

- ``GET /v1/models`` (and ``/models``): ``data`` holds one entry per served id
  (``--model-id`` then each ``--advertise``; with ``--wrong-id`` only
  ``wrong-<model-id>``), each with ``meta.n_ctx`` (one slot's context), as llama.cpp
  serves its ``--alias``.
- ``GET /slots``: one object per slot (``--parallel N``, llama.cpp's ``-np``; ``--slots``
  is the same flag): ``id``, ``n_ctx`` (the pool ``-c`` divided by the slots, as llama.cpp
  splits it), ``speculative``, ``is_processing``; a slot that has run a task also carries
  ``id_task``, ``n_prompt_tokens``, ``params`` and ``next_token``, as in llama.cpp. With
  ``--no-slots`` it answers 501 ``not_supported_error``, as llama-server started with
  ``--no-slots`` does.
- ``GET /props``: ``default_generation_settings.n_ctx`` (per slot), ``total_slots``,
  ``model_alias``, ``model_path``, ``build_info`` (``--build-info``, else
  ``$UAPPLACE_SIM_BUILD_INFO``, else :data:`BUILD_INFO`), ``is_sleeping``,
  ``endpoint_slots``, ``endpoint_metrics``.
- ``GET /metrics``: Prometheus text with llama.cpp's own names (``llamacpp:prompt_tokens_total``,
  ``llamacpp:tokens_predicted_total``, ``llamacpp:requests_processing``,
  ``llamacpp:requests_deferred``, …). llama.cpp exports no context size and no settings;
  only a Strata-like engine does, so only with ``--kv`` or ``--max-context`` given does
  the fake add ``llamacpp:max_context`` (the context pool in cells), the ``llamacpp:slots``
  gauge and the info gauge ``llamacpp:engine_info{kv="int8",model="<id>",engine="uapplace-sim"} 1``
  (``kv`` ``f16`` unless given). :func:`uapplace.io.engines.metrics` turns these into
  ``max_context → 131072.0`` and ``kv → "int8"``: the keys of ``metricsMustMatch``.
- ``POST /v1/chat/completions`` and ``POST /v1/completions``: a canned reply whose text
  names the model (``Hello from <id>.``); ``"stream": true`` sends llama.cpp's SSE chunks
  (``chat.completion.chunk`` / ``text_completion``) and ``data: [DONE]``. A request with
  ``"ignore_eos": true`` and ``max_tokens`` (or ``n_predict``) N generates N tokens (up to
  the slot's context, then ``finish_reason`` ``length``), one every ``--token-secs``: a
  generation that lasts, during which its slot ``is_processing`` and
  ``llamacpp:requests_processing`` counts it. A request waits for a free slot (counted in
  ``llamacpp:requests_deferred``).

Idle sleep, llama.cpp's (``--sleep-idle-seconds S``): after S seconds with no task (a
completion or a ``GET /slots``; ``/metrics`` is no task) the engine sleeps: it gives its
GPU claim and host memory back and ``/props`` says ``is_sleeping: true``. ``/health``,
``/props``, ``/v1/models`` and ``/metrics`` answer without waking it; ``GET /slots`` and a
completion wake it (after ``--wake-delay``, taking the memory again; a claim that no
longer fits ends the process with 134, as llama-server aborts when its reload fails).

Memory: after the port is bound it claims ``--mib`` on ``--gpu-uuid`` of the
simulated GPU named by ``UAPPLACE_SIM_GPU`` (nothing when that is unset) and
releases it at exit (SIGTERM and SIGINT exit cleanly with 0). A claim that does
not fit exits 1, as a failed ``cudaMalloc`` would. ``--host-mib`` touches that
much host memory so the process RSS shows it.

Sleep mode (``--sleep-mode``, vLLM's ``--enable-sleep-mode`` with
``VLLM_SERVER_DEV_MODE=1``), vLLM's API against the simulated GPU; not with
``--sleep-idle-seconds``:

- ``POST /sleep?level=1``: releases the GPU claim; the weights go to host RAM, so
  the host memory stays (``--host-mib``) and ``--offload-mib`` more is touched
  (the weights' copy). ``level=2``: releases the GPU claim and drops the host
  memory too (weights discarded). Answers 200 with an empty body after
  ``--sleep-delay`` seconds, once the memory is released; 400 for another level,
  503 while loading. Sleeping again is a no-op (2 after 1 drops the host copy).
- ``POST /wake_up``: after ``--wake-delay`` seconds claims ``--mib`` again (and
  re-touches the host memory level 2 dropped), then answers 200. With
  ``--fail-wake``, or when the claim does not fit, it answers 500 and stays
  asleep. Waking an engine that is awake is a no-op 200.
- ``GET /is_sleeping``: ``{"is_sleeping": bool}``; ``/props`` then carries no
  ``is_sleeping`` (vLLM has no ``/props``; llama.cpp's ``/props`` ``is_sleeping`` is its
  idle sleep, which wakes on a request, and uapplace keeps serving to that one).
- While sleeping (and waking) ``/health`` stays 200 and ``/v1/models`` still
  lists the model, as vLLM does; completions answer 503.
- Without ``--sleep-mode`` the three routes answer 404, like vLLM without them.

Failure injection: ``--fail-at-start`` exits 1 before claiming anything;
``--never-healthy`` stays 503; ``--wrong-id`` serves a wrong id;
``--fail-route R`` (``slots``, ``props`` or ``metrics``, repeatable) makes that
route answer 500 with a non-JSON body, a probe that fails rather than one the
engine does not support.

``--orphan`` reproduces docs/placement-rules.md §4.6 step 4 (a server started outside systemd left
an orphaned ``llama-server`` holding VRAM with no listening socket): before
binding, the engine forks a child into its own session; the child claims the
``--mib`` under its own PID (the parent claims nothing), writes its PID to
``--orphan-pidfile`` and outlives the parent's stop. It holds no socket and
exits by itself after ``--orphan-lifetime`` seconds (default 120) so nothing
leaks; SIGTERM/SIGKILL end it earlier. Under systemd the unit needs
``KillMode=process``: the default ``control-group`` kill would end the child
with the unit, which is exactly what a unit-managed server does *not* leak.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from uapplace.files.jsonfile import atomic_write
from uapplace.sim.completions import (
    Generation,
    Reply,
    Slot,
    plan_generation,
    prompt_tokens,
)
from uapplace.sim.gpu import SimGpu, SimGpuError

ENGINE_NAME = "uapplace-sim"
BUILD_INFO = "b0-uapplace-sim"
"""``/props`` ``build_info``: llama.cpp's is ``b<build>-<commit>`` (``b1-0c1e570``)."""
SIM_GPU_ENV = "UAPPLACE_SIM_GPU"
BUILD_INFO_ENV = "UAPPLACE_SIM_BUILD_INFO"
"""The default of ``--build-info``: an engine "upgraded" under the same ``ExecStart`` (a
unit drop-in's ``Environment=``), as a new binary at the same path would be."""
READY_PREFIX = "uapplace-sim-engine listening on "
FAILABLE_ROUTES = ("slots", "props", "metrics")
MIB = 1024 * 1024
DEFAULT_CTX = 32768
"""The context pool (llama.cpp's ``-c``) when neither ``-c`` nor ``--max-context`` is given."""
WAKE_FAILED_EXIT = 134
"""llama-server aborts (SIGABRT) when it cannot reload its model after sleeping."""


@dataclass(frozen=True)
class EngineOptions:
    port: int
    model_id: str
    host: str = "127.0.0.1"
    advertise: tuple[str, ...] = ()
    gpu_uuid: str | None = None
    mib: float = 0.0
    host_mib: int = 0
    load_secs: float = 0.0
    kv: str | None = None
    """``--kv``: served as the ``kv`` label of ``llamacpp:engine_info`` (Strata-like)."""
    max_context: int | None = None
    """``--max-context``: the pool, served as ``llamacpp:max_context`` (Strata-like)."""
    ctx_size: int = DEFAULT_CTX
    """``-c``: the pool when ``--max-context`` is not given (llama.cpp exports it nowhere)."""
    slots: int = 1
    no_slots: bool = False
    token_secs: float = 0.0
    sleep_idle_seconds: float | None = None
    fail_routes: frozenset[str] = frozenset()
    fail_at_start: bool = False
    never_healthy: bool = False
    wrong_id: bool = False
    orphan: bool = False
    orphan_pidfile: Path | None = None
    orphan_lifetime: float = 120.0
    sleep_mode: bool = False
    sleep_delay: float = 0.0
    wake_delay: float = 0.0
    offload_mib: int = 0
    fail_wake: bool = False
    build_info: str = BUILD_INFO
    """``--build-info``: the ``/props`` ``build_info`` (an engine "upgraded" in place)."""

    @property
    def served_ids(self) -> list[str]:
        if self.wrong_id:
            return [f"wrong-{self.model_id}"]
        return [self.model_id, *(a for a in self.advertise if a != self.model_id)]

    @property
    def label(self) -> str:
        return f"uapplace.sim.engine {self.model_id}"

    @property
    def context_pool(self) -> int:
        """The whole KV pool in cells, split across the slots."""
        return self.max_context if self.max_context is not None else self.ctx_size

    @property
    def slot_ctx(self) -> int:
        """One slot's context (llama.cpp's ``n_ctx`` in ``/slots``, ``/props``, ``/v1/models``)."""
        return self.context_pool // self.slots

    @property
    def strata_metrics(self) -> bool:
        """Serve the Strata-like gauges (``max_context``, ``slots``, ``engine_info``)?"""
        return self.kv is not None or self.max_context is not None


class EngineMemory:
    """What the engine process holds: its claim on the simulated GPU and its host memory.

    Sleep mode moves these: level 1 gives the GPU claim back and keeps (plus
    ``--offload-mib``) host memory, level 2 gives both back, waking takes them again.
    ``gpu`` is ``None`` when no simulated GPU is configured (nothing to claim).
    """

    def __init__(self, options: EngineOptions, gpu: SimGpu | None, pid: int) -> None:
        self.options = options
        self.gpu = gpu
        self.pid = pid
        self.gpu_claimed = False
        self._host: bytearray | None = None
        self._offloaded: bytearray | None = None

    @property
    def host_held_mib(self) -> int:
        """Host MiB this object keeps resident (the ``--host-mib`` figure plus the offload)."""
        return sum(len(b) for b in (self._host, self._offloaded) if b is not None) // MIB

    def claim_gpu(self) -> None:
        """Take ``--mib`` on ``--gpu-uuid``. Raises :class:`SimGpuError` when it does not fit."""
        opts = self.options
        if self.gpu is None or opts.gpu_uuid is None or opts.mib <= 0 or self.gpu_claimed:
            return
        self.gpu.claim(opts.gpu_uuid, self.pid, opts.mib, opts.label)
        self.gpu_claimed = True

    def release_gpu(self) -> None:
        if self.gpu is not None:
            self.gpu.release(self.pid)
        self.gpu_claimed = False

    def hold_host(self) -> None:
        if self._host is None and self.options.host_mib > 0:
            self._host = _touch_host_memory(self.options.host_mib)

    def offload(self) -> None:
        """Level 1: the weights' copy in host RAM."""
        if self._offloaded is None and self.options.offload_mib > 0:
            self._offloaded = _touch_host_memory(self.options.offload_mib)

    def drop_host(self) -> None:
        self._host = None
        self._offloaded = None

    def drop_offload(self) -> None:
        self._offloaded = None


class FakeEngine:
    """The HTTP side; :func:`serve` adds the process side (memory, signals)."""

    def __init__(self, options: EngineOptions, memory: EngineMemory | None = None) -> None:
        self.options = options
        self.memory = memory or EngineMemory(options, None, os.getpid())
        self.loaded = False
        self.prompt_tokens = 0
        self.predicted_tokens = 0
        self.decode_calls = 0
        self.tokens_max = 0
        self.deferred = 0
        self.started_at = int(time.time())
        self.sleep_level: int | None = None
        """``None`` while awake; the level of the last ``POST /sleep`` while asleep (vLLM)."""
        self.idle_asleep = False
        """Asleep after ``--sleep-idle-seconds`` without a task (llama.cpp)."""
        self.last_task = time.monotonic()
        self.slot_list = self._fresh_slots()
        self.exit_code = 0
        self.stopping = asyncio.Event()
        """Set when the process should exit with :attr:`exit_code` (a failed wake)."""
        self._task_ids = itertools.count()
        self._sleep_lock = asyncio.Lock()
        self._idle_lock = asyncio.Lock()
        self._slot_freed = asyncio.Condition()

    @property
    def processing(self) -> int:
        """Requests being generated (llama.cpp's ``requests_processing``)."""
        return sum(slot.processing for slot in self.slot_list)

    @property
    def asleep(self) -> bool:
        """Asleep either way: idle sleep (llama.cpp) or ``POST /sleep`` (vLLM)."""
        return self.idle_asleep or self.sleep_level is not None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/models", self.models)
        app.router.add_get("/slots", self.slots)
        app.router.add_get("/props", self.props)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/sleep", self.sleep)
        app.router.add_post("/wake_up", self.wake_up)
        app.router.add_get("/is_sleeping", self.is_sleeping)
        if self.options.sleep_idle_seconds is not None:
            app.cleanup_ctx.append(self._idle_watcher)
        return app

    def _fresh_slots(self) -> list[Slot]:
        return [Slot(index, self.options.slot_ctx) for index in range(self.options.slots)]

    # ----------------------------------------------------------------- idle sleep (llama.cpp)

    def touch(self) -> None:
        """A task ran: the idle timer starts again."""
        self.last_task = time.monotonic()

    async def _idle_watcher(self, app: web.Application) -> AsyncIterator[None]:
        watcher = asyncio.create_task(self.watch_idle())
        yield
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher

    async def watch_idle(self) -> None:
        """Fall asleep after ``--sleep-idle-seconds`` with no task and nothing generating."""
        idle_s = self.options.sleep_idle_seconds
        if idle_s is None:
            return
        while True:
            await asyncio.sleep(min(0.05, idle_s / 4))
            quiet = time.monotonic() - self.last_task >= idle_s
            if self.loaded and quiet and not self.asleep and not self.processing:
                self._fall_asleep()

    def _fall_asleep(self) -> None:
        print("uapplace.sim.engine: server is entering sleeping state", file=sys.stderr, flush=True)
        self.memory.release_gpu()
        self.memory.drop_host()
        self.slot_list = self._fresh_slots()
        self.idle_asleep = True

    async def _wake_from_idle(self) -> bool:
        """Reload after an idle sleep (``--wake-delay``); ``False`` when the claim no longer
        fits, and the process is then ended (:data:`WAKE_FAILED_EXIT`), as llama-server aborts."""
        async with self._idle_lock:
            if not self.idle_asleep:
                return True
            await asyncio.sleep(self.options.wake_delay)
            try:
                self.memory.claim_gpu()
            except SimGpuError as err:
                print(
                    f"uapplace.sim.engine: failed to reload model after sleeping: {err}",
                    file=sys.stderr,
                    flush=True,
                )
                self.exit_code = WAKE_FAILED_EXIT
                self.stopping.set()
                return False
            self.memory.hold_host()
            self.idle_asleep = False
            self.touch()
            print(
                "uapplace.sim.engine: server is exiting sleeping state", file=sys.stderr, flush=True
            )
            return True

    # ----------------------------------------------------------------- sleep mode (vLLM)

    def _no_sleep_mode(self) -> web.Response | None:
        if self.options.sleep_mode:
            return None
        return web.json_response({"detail": "Not Found"}, status=404)

    async def sleep(self, request: web.Request) -> web.Response:
        """``POST /sleep?level=1|2`` (vLLM): give the memory back, answer once it is."""
        if (missing := self._no_sleep_mode()) is not None:
            return missing
        if not self.loaded:
            return self._loading()
        raw = request.query.get("level", "1")
        if raw not in ("1", "2"):
            return _openai_error(400, f"level must be 1 or 2, got {raw!r}")
        level = int(raw)
        async with self._sleep_lock:
            await asyncio.sleep(self.options.sleep_delay)
            self.memory.release_gpu()
            if level == 1 and self.sleep_level != 2:
                self.memory.offload()
            else:
                self.memory.drop_host()
            self.sleep_level = max(level, self.sleep_level or 0)
        return web.Response(status=200)

    async def wake_up(self, request: web.Request) -> web.Response:
        """``POST /wake_up`` (vLLM): take the GPU memory again after ``--wake-delay``."""
        if (missing := self._no_sleep_mode()) is not None:
            return missing
        async with self._sleep_lock:
            if self.sleep_level is None:
                return web.Response(status=200)
            await asyncio.sleep(self.options.wake_delay)
            if self.options.fail_wake:
                return _openai_error(500, "simulated wake failure (--fail-wake)", "server_error")
            try:
                self.memory.claim_gpu()
            except SimGpuError as err:
                return _openai_error(500, f"wake_up failed: {err}", "server_error")
            self.memory.hold_host()
            self.memory.drop_offload()
            self.sleep_level = None
        return web.Response(status=200)

    async def is_sleeping(self, request: web.Request) -> web.Response:
        if (missing := self._no_sleep_mode()) is not None:
            return missing
        return web.json_response({"is_sleeping": self.sleep_level is not None})

    async def finish_loading(self) -> None:
        """Turn healthy after ``--load-secs`` (never with ``--never-healthy``)."""
        if self.options.never_healthy:
            return
        await asyncio.sleep(self.options.load_secs)
        self.loaded = True
        self.touch()

    # ----------------------------------------------------------------- probes

    def _failing(self, route: str) -> web.Response | None:
        """The 500 of ``--fail-route``, or ``None`` when ``route`` works."""
        if route not in self.options.fail_routes:
            return None
        return web.Response(status=500, text=f"simulated failure of /{route} (--fail-route)")

    def _loading(self) -> web.Response:
        return _openai_error(503, "Loading model", "unavailable_error")

    async def health(self, request: web.Request) -> web.Response:
        if not self.loaded:
            return self._loading()
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models`` (and ``/models``): answered asleep too, without waking."""
        if not self.loaded:
            return self._loading()
        served = self.options.served_ids
        listing = [
            {"name": model, "model": model, "type": "model", "details": {"format": "gguf"}}
            for model in served
        ]
        data = [
            {
                "id": model,
                "aliases": [model],
                "tags": [],
                "object": "model",
                "created": self.started_at,
                "owned_by": "llamacpp",
                "meta": self._model_meta(),
            }
            for model in served
        ]
        return web.json_response({"models": listing, "object": "list", "data": data})

    def _model_meta(self) -> dict[str, Any]:
        return {
            "vocab_type": 1,
            "n_vocab": 32000,
            "n_ctx": self.options.slot_ctx,
            "n_ctx_train": max(self.options.context_pool, DEFAULT_CTX),
            "n_embd": 4096,
            "n_params": 0,
            "size": int(self.options.mib * MIB),
            "ftype": ENGINE_NAME,
        }

    async def slots(self, request: web.Request) -> web.Response:
        """``GET /slots``: a task, so it wakes an idle-asleep engine and resets its timer."""
        if not self.loaded:
            return self._loading()
        if (failing := self._failing("slots")) is not None:
            return failing
        if self.options.no_slots:
            message = "This server does not support slots endpoint. Start it with `--slots`"
            return _openai_error(501, message, "not_supported_error")
        if not await self._wake_from_idle():
            return _openai_error(500, "failed to reload model after sleeping", "server_error")
        self.touch()
        return web.json_response([slot.to_json() for slot in self.slot_list])

    async def props(self, request: web.Request) -> web.Response:
        """``GET /props``: answered asleep too (``is_sleeping``), without waking."""
        if not self.loaded:
            return self._loading()
        if (failing := self._failing("props")) is not None:
            return failing
        opts = self.options
        settings = {"n_predict": -1, "max_tokens": -1, "stream": False, "temperature": 0.8}
        # In sleep mode the engine stands for vLLM, whose sleep is ``/is_sleeping``'s alone:
        # a ``/props`` ``is_sleeping`` would pass its sleep off as llama.cpp's idle sleep,
        # which wakes on a request (docs/placement-rules.md §4.2, "Asleep is not paused").
        sleeping = {} if opts.sleep_mode else {"is_sleeping": self.asleep}
        return web.json_response(
            {
                "default_generation_settings": {"params": settings, "n_ctx": opts.slot_ctx},
                "total_slots": opts.slots,
                "model_alias": opts.served_ids[0],
                "model_ftype": ENGINE_NAME,
                "model_path": f"/models/{opts.model_id}.gguf",
                "modalities": {"vision": False, "video": False, "audio": False},
                "endpoint_slots": not opts.no_slots,
                "endpoint_props": False,
                "endpoint_metrics": True,
                "build_info": opts.build_info,
                **sleeping,
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        """``GET /metrics``: no task (it neither wakes the engine nor resets the idle timer)."""
        if not self.loaded:
            return self._loading()
        if (failing := self._failing("metrics")) is not None:
            return failing
        headers = {
            "Content-Type": "text/plain; version=0.0.4",
            "Process-Start-Time-Unix": str(self.started_at),
        }
        return web.Response(body=self.metrics_text().encode(), headers=headers)

    def metrics_text(self) -> str:
        counters = [
            ("prompt_tokens_total", "Number of prompt tokens processed", self.prompt_tokens),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", 0),
            ("prompt_seconds_total", "Total time spent processing prompts", 0),
            (
                "tokens_predicted_total",
                "Number of generation tokens processed",
                self.predicted_tokens,
            ),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", 0),
            ("n_decode_total", "Total number of llama_decode() calls", self.decode_calls),
            ("n_tokens_max", "Largest observed sequence length", self.tokens_max),
        ]
        gauges = [
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", 0),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s", 0),
            ("requests_processing", "Number of requests processing", self.processing),
            ("requests_deferred", "Number of requests deferred", self.deferred),
            ("n_busy_slots_per_decode", "Average number of busy slots per decode call", 0),
        ]
        opts = self.options
        if opts.strata_metrics:
            gauges += [
                ("max_context", "Context pool in cells, all slots.", opts.context_pool),
                ("slots", "Parallel slots.", opts.slots),
            ]
        lines: list[str] = []
        for kind, rows in (("counter", counters), ("gauge", gauges)):
            for name, help_text, value in rows:
                lines += [
                    f"# HELP llamacpp:{name} {help_text}",
                    f"# TYPE llamacpp:{name} {kind}",
                    f"llamacpp:{name} {value:g}",
                ]
        if opts.strata_metrics:
            info = f'kv="{opts.kv or "f16"}",model="{opts.model_id}",engine="{ENGINE_NAME}"'
            lines += [
                "# HELP llamacpp:engine_info Engine settings as labels; the value is always 1.",
                "# TYPE llamacpp:engine_info gauge",
                f"llamacpp:engine_info{{{info}}} 1",
            ]
        return "\n".join(lines) + "\n"

    # ----------------------------------------------------------------- completions

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``."""
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``."""
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        if not self.loaded:
            return self._loading()
        if self.sleep_level is not None:
            return _openai_error(503, "the engine is sleeping (POST /wake_up)", "unavailable_error")
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _openai_error(400, "request body is not JSON")
        if not isinstance(body, dict):
            return _openai_error(400, "request body must be a JSON object")
        prompt = prompt_tokens(body, chat=chat)
        if prompt is None:
            what = "'messages' must be a list" if chat else "'prompt' must be a string or a list"
            return _openai_error(400, what)
        if not await self._wake_from_idle():
            return _openai_error(500, "failed to reload model after sleeping", "server_error")
        served = self.options.served_ids[0]
        generation = plan_generation(body, prompt, served, self.options.slot_ctx)
        slot = await self._take_slot(generation)

        async def decode(tokens: int) -> None:
            await self._decode(slot, tokens, generation.prompt_tokens)

        try:
            build = self.options.build_info
            reply = Reply(chat, generation, served, build, slot.task_id or 0, decode)
            if generation.stream:
                return await reply.stream(request)
            await reply.generate()
            return web.json_response(reply.whole())
        finally:
            await self._free_slot(slot)

    async def _take_slot(self, generation: Generation) -> Slot:
        """The first idle slot, waiting for one (a deferred request) when all are busy."""
        async with self._slot_freed:
            slot = self._idle_slot()
            if slot is None:
                self.deferred += 1
                try:
                    while (slot := self._idle_slot()) is None:
                        await self._slot_freed.wait()
                finally:
                    self.deferred -= 1
            slot.start(
                next(self._task_ids),
                generation.prompt_tokens,
                generation.n_predict,
                generation.stream,
            )
        self.prompt_tokens += generation.prompt_tokens
        self.touch()
        return slot

    def _idle_slot(self) -> Slot | None:
        return next((slot for slot in self.slot_list if not slot.processing), None)

    async def _free_slot(self, slot: Slot) -> None:
        slot.finish()
        self.touch()
        async with self._slot_freed:
            self._slot_freed.notify()

    async def _decode(self, slot: Slot, tokens: int, prompt_tokens: int) -> None:
        """Generate one piece (``tokens`` tokens), ``--token-secs`` after the last."""
        if self.options.token_secs > 0:
            await asyncio.sleep(self.options.token_secs)
        for _ in range(tokens):
            slot.decode()
        self.predicted_tokens += tokens
        self.decode_calls += 1
        self.tokens_max = max(self.tokens_max, prompt_tokens + slot.decoded)
        self.touch()


def _openai_error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(
        {"error": {"code": status, "message": message, "type": kind}},
        status=status,
    )


# --------------------------------------------------------------------------- process side


def _sim_gpu() -> SimGpu | None:
    path = os.environ.get(SIM_GPU_ENV)
    return SimGpu(Path(path)) if path else None


def _claim(options: EngineOptions, pid: int) -> None:
    gpu = _sim_gpu()
    if gpu is None or options.gpu_uuid is None or options.mib <= 0:
        return
    gpu.claim(options.gpu_uuid, pid, options.mib, options.label)


def _release(pid: int) -> None:
    gpu = _sim_gpu()
    if gpu is not None:
        try:
            gpu.release(pid)
        except SimGpuError as err:
            print(f"uapplace.sim.engine: release failed: {err}", file=sys.stderr)


def _touch_host_memory(mib: int) -> bytearray:
    # Repetition writes every byte, so the pages are resident (counted in RSS).
    return bytearray(b"\x01") * (mib * 1024 * 1024)


def _fork_orphan(options: EngineOptions) -> None:
    """Fork the child that outlives us holding its memory (docs/placement-rules.md §4.6 step 4)."""
    if os.fork() != 0:
        return
    code = 0
    try:
        os.setsid()
        pid = os.getpid()
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            _claim(options, pid)
            if options.orphan_pidfile is not None:
                atomic_write(options.orphan_pidfile, f"{pid}\n", mode=0o644, sync=False)
            time.sleep(options.orphan_lifetime)
        finally:
            _release(pid)
    except SystemExit:
        pass
    except BaseException as err:
        print(f"uapplace.sim.engine orphan: {err}", file=sys.stderr)
        code = 1
    os._exit(code)


async def serve(options: EngineOptions, memory: EngineMemory | None = None) -> int:
    """Bind, claim, load, serve until SIGTERM/SIGINT; release on the way out."""
    memory = memory or EngineMemory(options, _sim_gpu(), os.getpid())
    engine = FakeEngine(options, memory)
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, options.host, options.port)
        try:
            await site.start()
        except OSError as err:
            print(f"uapplace.sim.engine: cannot bind {options.host}:{options.port}: {err}")
            return 1
        host, port = runner.addresses[0][:2]
        print(f"{READY_PREFIX}http://{host}:{port}", flush=True)
        if not options.orphan:
            try:
                memory.claim_gpu()
            except SimGpuError as err:
                print(f"uapplace.sim.engine: GPU allocation failed: {err}", flush=True)
                return 1
        try:
            return await _run(engine)
        finally:
            _release(os.getpid())
    finally:
        await runner.cleanup()


async def _run(engine: FakeEngine) -> int:
    """Serve until SIGTERM/SIGINT (0) or until the engine stops itself (its exit code)."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, engine.stopping.set)
    loading = asyncio.create_task(engine.finish_loading())
    await engine.stopping.wait()
    loading.cancel()
    return engine.exit_code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m uapplace.sim.engine", description="A fake llama.cpp-like engine."
    )
    parser.add_argument("--port", type=int, required=True, help="TCP port; 0 picks a free one")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model-id", required=True)
    parser.add_argument("--advertise", action="append", default=[], metavar="ID")
    parser.add_argument("--gpu-uuid", help="simulated GPU device to claim on")
    parser.add_argument("--mib", type=float, default=0.0, help="GPU MiB to claim")
    parser.add_argument("--host-mib", type=int, default=0, help="host MiB to keep resident")
    parser.add_argument("--load-secs", type=float, default=0.0)
    parser.add_argument(
        "--kv", help="KV cache type, served in /metrics as Strata does (llama.cpp serves none)"
    )
    parser.add_argument(
        "--max-context",
        type=int,
        help="context pool in cells, served in /metrics as Strata does (llama.cpp serves none)",
    )
    parser.add_argument(
        "-c",
        "--ctx-size",
        dest="ctx_size",
        type=int,
        default=DEFAULT_CTX,
        help="context pool in cells (llama.cpp's -c), when --max-context is not given",
    )
    parser.add_argument(
        "--parallel",
        "--slots",
        "-np",
        dest="slots",
        type=int,
        default=1,
        help="parallel slots (llama.cpp's --parallel)",
    )
    parser.add_argument("--no-slots", action="store_true", help="/slots answers 501")
    parser.add_argument(
        "--token-secs", type=float, default=0.0, help="seconds between generated tokens"
    )
    parser.add_argument(
        "--sleep-idle-seconds",
        type=float,
        help="sleep after this long without a task, as llama-server does",
    )
    parser.add_argument(
        "--fail-route",
        action="append",
        default=[],
        choices=FAILABLE_ROUTES,
        help="this route answers 500 (repeatable)",
    )
    parser.add_argument("--fail-at-start", action="store_true")
    parser.add_argument("--never-healthy", action="store_true")
    parser.add_argument("--wrong-id", action="store_true")
    parser.add_argument("--orphan", action="store_true")
    parser.add_argument("--orphan-pidfile", type=Path)
    parser.add_argument("--orphan-lifetime", type=float, default=120.0)
    parser.add_argument(
        "--sleep-mode", action="store_true", help="serve vLLM's /sleep, /wake_up, /is_sleeping"
    )
    parser.add_argument("--sleep-delay", type=float, default=0.0, help="seconds a sleep takes")
    parser.add_argument("--wake-delay", type=float, default=0.0, help="seconds a wake takes")
    parser.add_argument(
        "--offload-mib", type=int, default=0, help="host MiB a level-1 sleep adds (the weights)"
    )
    parser.add_argument("--fail-wake", action="store_true", help="/wake_up answers 500")
    parser.add_argument(
        "--build-info",
        default=os.environ.get(BUILD_INFO_ENV) or BUILD_INFO,
        help=f"the build /props reports (build_info); default ${BUILD_INFO_ENV}, else {BUILD_INFO}",
    )
    return parser


def parse_options(argv: Sequence[str] | None = None) -> EngineOptions:
    parser = _parser()
    args = parser.parse_args(argv)
    problems = {
        "--port": not 0 <= args.port <= 65535,
        "--parallel/--slots": args.slots < 1,
        "--max-context": args.max_context is not None and args.max_context < 1,
        "-c/--ctx-size": args.ctx_size < 1,
        "--token-secs": args.token_secs < 0,
        "--sleep-idle-seconds": args.sleep_idle_seconds is not None
        and args.sleep_idle_seconds <= 0,
        "--mib": args.mib < 0,
        "--host-mib": args.host_mib < 0,
        "--load-secs": args.load_secs < 0,
        "--orphan-lifetime": args.orphan_lifetime <= 0,
        "--sleep-delay": args.sleep_delay < 0,
        "--wake-delay": args.wake_delay < 0,
        "--offload-mib": args.offload_mib < 0,
        "--build-info": not args.build_info.strip(),
    }
    for flag, bad in problems.items():
        if bad:
            parser.error(f"{flag}: out of range")
    if args.mib > 0 and args.gpu_uuid is None and os.environ.get(SIM_GPU_ENV):
        parser.error("--mib needs --gpu-uuid")
    if args.sleep_mode and args.orphan:
        parser.error("--sleep-mode: not with --orphan (the orphan child holds the claim)")
    if args.sleep_idle_seconds is not None and (args.sleep_mode or args.orphan):
        parser.error("--sleep-idle-seconds: not with --sleep-mode or --orphan (one way to sleep)")
    pool = args.max_context if args.max_context is not None else args.ctx_size
    if pool < args.slots:
        parser.error(f"the context pool ({pool} cells) is smaller than --parallel {args.slots}")
    return EngineOptions(
        port=args.port,
        host=args.host,
        model_id=args.model_id,
        advertise=tuple(args.advertise),
        gpu_uuid=args.gpu_uuid,
        mib=args.mib,
        host_mib=args.host_mib,
        load_secs=args.load_secs,
        kv=args.kv,
        max_context=args.max_context,
        ctx_size=args.ctx_size,
        slots=args.slots,
        no_slots=args.no_slots,
        token_secs=args.token_secs,
        sleep_idle_seconds=args.sleep_idle_seconds,
        fail_routes=frozenset(args.fail_route),
        fail_at_start=args.fail_at_start,
        never_healthy=args.never_healthy,
        wrong_id=args.wrong_id,
        orphan=args.orphan,
        orphan_pidfile=args.orphan_pidfile,
        orphan_lifetime=args.orphan_lifetime,
        sleep_mode=args.sleep_mode,
        sleep_delay=args.sleep_delay,
        wake_delay=args.wake_delay,
        offload_mib=args.offload_mib,
        fail_wake=args.fail_wake,
        build_info=args.build_info,
    )


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_options(argv)
    if options.fail_at_start:
        print("uapplace.sim.engine: failing at start (--fail-at-start)", file=sys.stderr)
        return 1
    if options.orphan:
        _fork_orphan(options)
    memory = EngineMemory(options, _sim_gpu(), os.getpid())
    memory.hold_host()
    try:
        return asyncio.run(serve(options, memory))
    finally:
        memory.drop_host()


if __name__ == "__main__":
    sys.exit(main())
