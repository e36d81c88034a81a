"""A fake llama.cpp-like engine for tests and ``uapplace demo``.

docs/architecture.md ("Simulated GPU and fake engine").

::

    python -m uapplace.sim.engine --port P --model-id ID [--advertise ID2 ...]
        [--gpu-uuid U --mib N] [--host-mib N] [--load-secs S]
        [--kv int8 --max-context 131072 --parallel 1] [--no-slots]
        [--fail-route slots|props|metrics ...]
        [--fail-at-start] [--never-healthy] [--wrong-id]
        [--orphan --orphan-pidfile PATH [--orphan-lifetime 120]]
        [--sleep-mode [--sleep-delay S] [--wake-delay S] [--offload-mib N] [--fail-wake]]

HTTP, like ``llama-server``: while loading, ``/health`` answers 503
``{"status": "loading model"}`` and every other route 503 too; then ``/health``
is 200 ``{"status": "ok"}``.

- ``GET /v1/models``: OpenAI list; ids ``--model-id`` then each ``--advertise``
  (with ``--wrong-id``: only ``wrong-<model-id>``).
- ``GET /slots``: one object per slot (``--parallel N``, llama.cpp's ``-np``;
  ``--slots N`` is the same flag): ``id``, ``id_task``, ``n_ctx`` (the pool
  divided by the slots, as llama.cpp splits it), ``is_processing``, ``params``.
  With ``--no-slots`` it answers 501 ``not_supported_error`` as llama-server
  does when started with ``--no-slots``.
- ``GET /props``: ``default_generation_settings.n_ctx``, ``total_slots``, ``model_path``.
- ``GET /metrics``: Prometheus text. ``llamacpp:prompt_tokens_total``,
  ``llamacpp:tokens_predicted_total`` (counters), ``llamacpp:requests_processing``,
  ``llamacpp:requests_deferred``, ``llamacpp:max_context`` (the context pool in
  cells), ``llamacpp:slots`` (gauges), and the info gauge
  ``llamacpp:engine_info{kv="int8",model="<id>",engine="uapplace-sim"} 1``.
  :func:`uapplace.io.engines.metrics` turns these into ``max_context → 131072.0``
  and ``kv → "int8"``: the keys of ``metricsMustMatch``.
- ``POST /v1/chat/completions``: a canned completion whose text names the
  model; ``"stream": true`` gets the same text as one SSE chunk and ``[DONE]``.

Memory: after the port is bound it claims ``--mib`` on ``--gpu-uuid`` of the
simulated GPU named by ``UAPPLACE_SIM_GPU`` (nothing when that is unset) and
releases it at exit (SIGTERM and SIGINT exit cleanly with 0). A claim that does
not fit exits 1, as a failed ``cudaMalloc`` would. ``--host-mib`` touches that
much host memory so the process RSS shows it.

Sleep mode (``--sleep-mode``, vLLM's ``--enable-sleep-mode`` with
``VLLM_SERVER_DEV_MODE=1``), vLLM's API against the simulated GPU:

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
- ``GET /is_sleeping``: ``{"is_sleeping": bool}``.
- While sleeping (and waking) ``/health`` stays 200 and ``/v1/models`` still
  lists the model, as vLLM does; ``/v1/chat/completions`` answers 503.
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
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from uapplace.files.jsonfile import atomic_write
from uapplace.sim.gpu import SimGpu, SimGpuError

ENGINE_NAME = "uapplace-sim"
SIM_GPU_ENV = "UAPPLACE_SIM_GPU"
READY_PREFIX = "uapplace-sim-engine listening on "
FAILABLE_ROUTES = ("slots", "props", "metrics")
MIB = 1024 * 1024


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
    kv: str = "f16"
    max_context: int = 32768
    slots: int = 1
    no_slots: bool = False
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

    @property
    def served_ids(self) -> list[str]:
        if self.wrong_id:
            return [f"wrong-{self.model_id}"]
        return [self.model_id, *(a for a in self.advertise if a != self.model_id)]

    @property
    def label(self) -> str:
        return f"uapplace.sim.engine {self.model_id}"


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
        self.processing = 0
        self.started_at = int(time.time())
        self.sleep_level: int | None = None
        """``None`` while awake; the level of the last ``POST /sleep`` while asleep."""
        self._sleep_lock = asyncio.Lock()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/slots", self.slots)
        app.router.add_get("/props", self.props)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/sleep", self.sleep)
        app.router.add_post("/wake_up", self.wake_up)
        app.router.add_get("/is_sleeping", self.is_sleeping)
        return app

    # ----------------------------------------------------------------- sleep mode

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

    def _failing(self, route: str) -> web.Response | None:
        """The 500 of ``--fail-route``, or ``None`` when ``route`` works."""
        if route not in self.options.fail_routes:
            return None
        return web.Response(status=500, text=f"simulated failure of /{route} (--fail-route)")

    def _loading(self) -> web.Response:
        return web.json_response(
            {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
            status=503,
        )

    async def health(self, request: web.Request) -> web.Response:
        if not self.loaded:
            return web.json_response({"status": "loading model"}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        if not self.loaded:
            return self._loading()
        data = [
            {"id": model, "object": "model", "created": self.started_at, "owned_by": "llamacpp"}
            for model in self.options.served_ids
        ]
        return web.json_response({"object": "list", "data": data})

    async def slots(self, request: web.Request) -> web.Response:
        if not self.loaded:
            return self._loading()
        if (failing := self._failing("slots")) is not None:
            return failing
        if self.options.no_slots:
            return web.json_response(
                {
                    "error": {
                        "code": 501,
                        "message": "This server does not support slots endpoint.",
                        "type": "not_supported_error",
                    }
                },
                status=501,
            )
        per_slot = self.options.max_context // self.options.slots
        return web.json_response(
            [
                {
                    "id": index,
                    "id_task": -1,
                    "n_ctx": per_slot,
                    "speculative": False,
                    "is_processing": False,
                    "params": {"cache_type_k": self.options.kv, "cache_type_v": self.options.kv},
                }
                for index in range(self.options.slots)
            ]
        )

    async def props(self, request: web.Request) -> web.Response:
        if not self.loaded:
            return self._loading()
        if (failing := self._failing("props")) is not None:
            return failing
        return web.json_response(
            {
                "default_generation_settings": {
                    "n_ctx": self.options.max_context // self.options.slots
                },
                "total_slots": self.options.slots,
                "model_path": f"/models/{self.options.model_id}.gguf",
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.loaded:
            return self._loading()
        if (failing := self._failing("metrics")) is not None:
            return failing
        return web.Response(text=self.metrics_text(), content_type="text/plain")

    def metrics_text(self) -> str:
        opts = self.options
        info = f'kv="{opts.kv}",model="{opts.model_id}",engine="{ENGINE_NAME}"'
        rows = [
            ("prompt_tokens_total", "counter", "Prompt tokens processed.", self.prompt_tokens),
            ("tokens_predicted_total", "counter", "Tokens generated.", self.predicted_tokens),
            ("requests_processing", "gauge", "Requests being processed.", self.processing),
            ("requests_deferred", "gauge", "Requests waiting for a slot.", 0),
            ("max_context", "gauge", "Context pool in cells, all slots.", opts.max_context),
            ("slots", "gauge", "Parallel slots.", opts.slots),
        ]
        lines: list[str] = []
        for name, kind, help_text, value in rows:
            lines += [
                f"# HELP llamacpp:{name} {help_text}",
                f"# TYPE llamacpp:{name} {kind}",
                f"llamacpp:{name} {value}",
            ]
        lines += [
            "# HELP llamacpp:engine_info Engine settings as labels; the value is always 1.",
            "# TYPE llamacpp:engine_info gauge",
            f"llamacpp:engine_info{{{info}}} 1",
        ]
        return "\n".join(lines) + "\n"

    async def chat(self, request: web.Request) -> web.StreamResponse:
        if not self.loaded:
            return self._loading()
        if self.sleep_level is not None:
            return _openai_error(503, "the engine is sleeping (POST /wake_up)", "unavailable_error")
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _openai_error(400, "request body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _openai_error(400, "'messages' must be a list")
        served = self.options.served_ids[0]
        text = f"Hello from {served}."
        prompt = sum(
            len(str(m.get("content", "")).split()) for m in body["messages"] if isinstance(m, dict)
        )
        self.prompt_tokens += prompt
        self.predicted_tokens += len(text.split())
        completion_id = f"chatcmpl-{os.getpid()}-{self.predicted_tokens}"
        if body.get("stream"):
            return await self._stream(request, completion_id, served, text)
        return web.json_response(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": served,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": len(text.split()),
                    "total_tokens": prompt + len(text.split()),
                },
            }
        )

    async def _stream(
        self, request: web.Request, completion_id: str, served: str, text: str
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": served,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None}
            ],
        }
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        chunk["choices"] = [{"index": 0, "delta": {}, "finish_reason": "stop"}]
        await response.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response


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
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loading = asyncio.create_task(engine.finish_loading())
    await stop.wait()
    loading.cancel()
    return 0


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
    parser.add_argument("--kv", default="f16", help="KV cache type reported in /metrics")
    parser.add_argument("--max-context", type=int, default=32768, help="context pool in cells")
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
    return parser


def parse_options(argv: Sequence[str] | None = None) -> EngineOptions:
    parser = _parser()
    args = parser.parse_args(argv)
    problems = {
        "--port": not 0 <= args.port <= 65535,
        "--parallel/--slots": args.slots < 1,
        "--max-context": args.max_context < 1,
        "--mib": args.mib < 0,
        "--host-mib": args.host_mib < 0,
        "--load-secs": args.load_secs < 0,
        "--orphan-lifetime": args.orphan_lifetime <= 0,
        "--sleep-delay": args.sleep_delay < 0,
        "--wake-delay": args.wake_delay < 0,
        "--offload-mib": args.offload_mib < 0,
    }
    for flag, bad in problems.items():
        if bad:
            parser.error(f"{flag}: out of range")
    if args.mib > 0 and args.gpu_uuid is None and os.environ.get(SIM_GPU_ENV):
        parser.error("--mib needs --gpu-uuid")
    if args.sleep_mode and args.orphan:
        parser.error("--sleep-mode: not with --orphan (the orphan child holds the claim)")
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
        slots=args.slots,
        no_slots=args.no_slots,
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
