"""A fake llama.cpp router (``llama-server --models-dir DIR``) for tests and the demo.

Where it and the real router answer differently, the real one is right (the facts it
copies were read from llama.cpp's ``tools/server`` and checked against the binary)::

    python -m uapplace.sim.router --port P [--host H] [--models-dir DIR]
        [--models-preset FILE] [--models-max N] [--no-models-autoload]
        [--stop-timeout S] [CHILD ARGS ...]

Models: every ``*.gguf`` file under ``--models-dir`` is a model whose id is the file's
stem (the content is never read); every section of the ``--models-preset`` INI file
(``[id]``, with ``model = PATH`` and ``alias = a,b``) merges into the model of that id
or adds one; its other ``key = value`` lines become the child's ``--key value`` (``true``:
a bare ``--key``), after the ``[*]`` section's. Arguments the router does not know are
passed to every child, as the real router passes ``-c``, ``--parallel`` and the rest.

Each loaded model is a **child process**, ``python -m uapplace.sim.router --child --host
127.0.0.1 --port P --alias ID --model PATH [ARGS]``: the fake engine
(:mod:`uapplace.sim.engine`, so ``--mib``/``--gpu-uuid`` claim on the simulated GPU,
``--load-secs``, ``--fail-at-start``, ``--never-healthy`` … work per model) on a port the
router picked, with the id as its alias. Like a real child it ignores SIGTERM and
leaves when the router closes its stdin (an unload); ``--hang-on-unload`` makes it
ignore that too, and the router kills it after ``--stop-timeout`` (10 s, as llama.cpp).

Routes, as the real router:

- ``GET /health``: ``{"status": "ok"}`` always (it ignores ``?model=``).
- ``GET /models`` and ``/v1/models``: ``{"data": [...], "object": "list"}``, one entry per
  model, loaded or not: ``id``, ``aliases``, ``status`` (``value``: ``unloaded``,
  ``loading``, ``loaded``, ``sleeping``; ``args``: the child's command line; after a child
  that ended with a non-zero code, ``failed: true`` and ``exit_code``), ``source``; a
  running one also carries the child's ``meta``.
- ``POST /models/load {"model": ID}``: 200 ``{"success": true}`` at once with the status
  ``loading`` (after unloading the least recently used model when ``--models-max`` is
  reached); 400 ``model is already running``; 404 for an unknown id.
  ``POST /models/unload``: 200 at once, the status follows; 400 ``model is not running``.
- ``GET /props`` without ``?model=``: the router's own (``role: router``,
  ``max_instances``, ``models_autoload``, ``build_info``). ``GET /props``, ``/slots`` and
  ``/metrics`` with ``?model=ID`` go to that child; without it ``/slots`` and ``/metrics``
  answer 400 ``model name is missing from the request``. A model that is not running is
  **loaded first** (and the request waits) unless ``&autoload=false`` (or
  ``--no-models-autoload``): then 400 ``model is not loaded``.
- ``POST /v1/chat/completions`` and ``/v1/completions``: to the child the
  body's ``model`` names (400 without one, 400 ``model 'x' not found`` for an unknown
  one), loading it first likewise; streams are passed through as they come.

The children are started by a :class:`ChildLauncher`: :class:`ProcessLauncher` (real
processes, the default) or, for the unit tier, :class:`InProcessLauncher` (the fake
engine served in this process's loop, each "child" a task).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from uapplace.sim import engine as sim_engine
from uapplace.sim.gpu import SimGpu, SimGpuError

READY_PREFIX = "uapplace-sim-router listening on "
DEFAULT_MODELS_MAX = 4
DEFAULT_STOP_TIMEOUT_S = 10.0
CHILD_FLAG = "--child"
IGNORED_CHILD_FLAGS = frozenset({"--metrics"})
"""Flags a real child takes that the fake engine has no use for (it always serves
``/metrics``): dropped, so a router command line written for llama.cpp works here."""
STATUS_POLL_S = 0.05


# --------------------------------------------------------------------------- the models


@dataclass(frozen=True)
class ModelSpec:
    """One model the router knows: its id, aliases, file and the child's own arguments."""

    id: str
    path: str
    aliases: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    source: str = "models_dir"


@dataclass(frozen=True)
class RouterOptions:
    port: int
    host: str = "127.0.0.1"
    models_dir: Path | None = None
    preset: Path | None = None
    models_max: int = DEFAULT_MODELS_MAX
    """0: no limit."""
    autoload: bool = True
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S
    child_args: tuple[str, ...] = ()
    """Passed to every child, before its preset arguments."""


def parse_preset(text: str, origin: str = "preset") -> dict[str, dict[str, str]]:
    """An INI preset → section → key → value (``[*]`` included; keys before any section,
    like ``version = 1``, are the file's own and dropped). Raises ``ValueError`` naming
    the line."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        if line.startswith("[") and line.endswith("]"):
            name = line[1:-1].strip()
            if not name:
                raise ValueError(f"{origin} line {number}: an empty section name")
            current = sections.setdefault(name, {})
            continue
        key, eq, value = line.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{origin} line {number}: not `key = value`: {line[:80]!r}")
        if current is not None:
            current[key.strip()] = value.strip()
    return sections


def preset_args(values: Mapping[str, str]) -> tuple[str, ...]:
    """``{"mib": "100", "fail-at-start": "true"}`` → ``("--mib", "100", "--fail-at-start")``."""
    out: list[str] = []
    for key, value in values.items():
        if key in ("model", "alias"):
            continue
        flag = f"--{key}"
        if value.lower() == "true":
            out.append(flag)
        elif value.lower() != "false":
            out += [flag, value]
    return tuple(out)


def discover(
    models_dir: Path | None, preset: Mapping[str, Mapping[str, str]]
) -> dict[str, ModelSpec]:
    """The models of ``--models-dir`` (``*.gguf`` stems) merged with the preset's sections."""
    found: dict[str, ModelSpec] = {}
    if models_dir is not None:
        for file in sorted(models_dir.glob("*.gguf")):
            found[file.stem] = ModelSpec(file.stem, str(file))
    common = preset_args(preset.get("*", {}))
    for name, values in preset.items():
        if name == "*":
            continue
        base = found.get(name)
        path = values.get("model") or (base.path if base is not None else "")
        if not path:
            raise ValueError(f"preset section [{name}]: no `model = PATH` and no such file")
        aliases = tuple(a.strip() for a in values.get("alias", "").split(",") if a.strip())
        found[name] = ModelSpec(name, path, aliases, preset_args(values), "preset")
    return {key: replace(spec, args=(*common, *spec.args)) for key, spec in sorted(found.items())}


# --------------------------------------------------------------------------- children


class Child(Protocol):
    """One started model: its process (or stand-in) and how to end it."""

    pid: int

    async def wait(self) -> int:
        """Its exit code once it has ended (a kill reads as 1, as llama.cpp reports it)."""
        ...

    def request_exit(self) -> None:
        """Ask it to leave (the router's exit command: its stdin closes)."""
        ...

    def kill(self) -> None: ...


class ChildLauncher(Protocol):
    async def launch(self, argv: Sequence[str], env: Mapping[str, str]) -> Child: ...


def child_argv(spec: ModelSpec, port: int, options: RouterOptions) -> list[str]:
    """The child's command line, shaped as the real router renders it (``status.args``)."""
    return [
        sys.executable,
        "-m",
        "uapplace.sim.router",
        CHILD_FLAG,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--alias",
        spec.id,
        "--model",
        spec.path,
        *options.child_args,
        *spec.args,
    ]


class _ProcessChild:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.pid = process.pid

    async def wait(self) -> int:
        code = await self.process.wait()
        return 1 if code < 0 else code

    def request_exit(self) -> None:
        stdin = self.process.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.close()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()


class ProcessLauncher:
    """Real child processes (stdin a pipe the router holds; output to the router's)."""

    async def launch(self, argv: Sequence[str], env: Mapping[str, str]) -> Child:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, env={**os.environ, **env}
        )
        return _ProcessChild(process)


@dataclass
class _TaskChild:
    task: asyncio.Task[int]
    exit: asyncio.Event
    pid: int = field(default_factory=os.getpid)

    async def wait(self) -> int:
        try:
            return await asyncio.shield(self.task)
        except asyncio.CancelledError:
            if self.task.cancelled():
                return 1
            raise

    def request_exit(self) -> None:
        self.exit.set()

    def kill(self) -> None:
        self.task.cancel()


class InProcessLauncher:
    """The unit tier's children: each the fake engine served by a task of this loop, on
    the port the router chose, ending when asked (no process, so no PID of its own)."""

    def __init__(self, gpu: SimGpu | None = None) -> None:
        self.gpu = gpu

    async def launch(self, argv: Sequence[str], env: Mapping[str, str]) -> Child:
        child = parse_child(list(argv[argv.index(CHILD_FLAG) + 1 :]))
        exit_asked = asyncio.Event()
        task = asyncio.create_task(serve_child(child, exit_asked, self.gpu))
        return _TaskChild(task, exit_asked)


# --------------------------------------------------------------------------- the router


@dataclass
class Instance:
    """One model as the router tracks it."""

    spec: ModelSpec
    status: str = "unloaded"
    port: int = 0
    args: tuple[str, ...] = ()
    child: Child | None = None
    exit_code: int | None = None
    failed: bool = False
    meta: dict[str, Any] | None = None
    last_used: float = 0.0
    stopping: bool = False
    monitor: asyncio.Task[None] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return self.status in ("loading", "loaded", "sleeping")

    def set(self, status: str) -> None:
        self.status = status
        self.changed.set()
        self.changed = asyncio.Event()

    def to_json(self) -> dict[str, Any]:
        status: dict[str, Any] = {"value": self.status, "args": list(self.args)}
        if self.failed:
            status["exit_code"] = self.exit_code
            status["failed"] = True
        entry: dict[str, Any] = {
            "id": self.spec.id,
            "aliases": list(self.spec.aliases),
            "tags": [],
            "object": "model",
            "owned_by": "llamacpp",
            "created": int(time.time()),
            "status": status,
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
            "source": self.spec.source,
            "can_remove": False,
        }
        if self.running and self.meta is not None:
            entry["meta"] = self.meta
        return entry


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(
        {"error": {"code": status, "message": message, "type": kind}}, status=status
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class FakeRouter:
    """The router's HTTP side and its children; :func:`serve` runs it as a process."""

    def __init__(
        self,
        options: RouterOptions,
        specs: Mapping[str, ModelSpec],
        launcher: ChildLauncher | None = None,
    ) -> None:
        self.options = options
        self.instances = {key: Instance(spec) for key, spec in specs.items()}
        for instance in self.instances.values():
            instance.args = tuple(child_argv(instance.spec, 0, options))
        self.launcher = launcher or ProcessLauncher()
        self._lock = asyncio.Lock()
        self._http: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/health", self.health)
        app.router.add_get("/models", self.models)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/models/load", self.load)
        app.router.add_post("/models/unload", self.unload)
        app.router.add_get("/props", self.props)
        app.router.add_get("/slots", self.proxy_get)
        app.router.add_get("/metrics", self.proxy_get)
        for path in ("/v1/chat/completions", "/v1/completions"):
            app.router.add_post(path, self.proxy_post)
        app.cleanup_ctx.append(self._session)
        return app

    async def _session(self, app: web.Application) -> AsyncIterator[None]:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        yield
        await self.unload_all()
        await self._http.close()

    @property
    def http(self) -> aiohttp.ClientSession:
        assert self._http is not None, "the router's app is not running"
        return self._http

    def lookup(self, name: str) -> Instance | None:
        if name in self.instances:
            return self.instances[name]
        return next((i for i in self.instances.values() if name in i.spec.aliases), None)

    # ----------------------------------------------------------------- load / unload

    async def start_load(self, instance: Instance) -> None:
        """Spawn the child (after making room under ``--models-max``); returns with the
        status ``loading`` (or ``unloaded`` + failed when it could not be spawned)."""
        async with self._lock:
            if instance.running:
                return
            await self._make_room(instance)
            port = _free_port()
            argv = child_argv(instance.spec, port, self.options)
            instance.port, instance.args = port, tuple(argv)
            instance.failed, instance.exit_code, instance.meta = False, None, None
            instance.stopping = False
            instance.last_used = time.monotonic()
            instance.set("loading")
            try:
                instance.child = await self.launcher.launch(argv, {})
            except OSError as err:
                print(f"uapplace.sim.router: cannot spawn {instance.spec.id}: {err}", flush=True)
                instance.failed, instance.exit_code = True, 1
                instance.set("unloaded")
                return
            instance.monitor = asyncio.create_task(self._monitor(instance, instance.child))

    async def _make_room(self, loading: Instance) -> None:
        limit = self.options.models_max
        running = [i for i in self.instances.values() if i.running and i is not loading]
        if limit <= 0 or len(running) < limit:
            return
        victim = min(running, key=lambda i: i.last_used)
        print(f"uapplace.sim.router: models_max reached, unloading {victim.spec.id}", flush=True)
        self.request_unload(victim)
        while victim.running:
            await victim.changed.wait()

    def request_unload(self, instance: Instance) -> None:
        if instance.child is None or instance.stopping:
            return
        instance.stopping = True
        instance.child.request_exit()
        child = instance.child
        asyncio.get_running_loop().call_later(
            self.options.stop_timeout_s, lambda: child.kill() if instance.child is child else None
        )

    async def _monitor(self, instance: Instance, child: Child) -> None:
        """Follow one child: ``loaded`` once its ``/health`` is 200, ``sleeping`` while its
        ``/props`` says so, ``unloaded`` (``failed`` on a non-zero code) when it ends."""
        ended = asyncio.create_task(child.wait())
        try:
            while not ended.done():
                await asyncio.wait({ended}, timeout=STATUS_POLL_S)
                if ended.done():
                    break
                await self._observe(instance)
            code = ended.result()
        finally:
            if not ended.done():
                ended.cancel()
        if instance.child is child:
            instance.child = None
            instance.exit_code = code
            instance.failed = code != 0
            instance.stopping = False
            instance.set("unloaded")

    async def _observe(self, instance: Instance) -> None:
        base = f"http://127.0.0.1:{instance.port}"
        timeout = aiohttp.ClientTimeout(total=1.0)
        try:
            if instance.status == "loading":
                async with self.http.get(f"{base}/health", timeout=timeout) as response:
                    if response.status == 200:
                        instance.meta = await self._meta(base)
                        instance.set("loaded")
                return
            async with self.http.get(f"{base}/props", timeout=timeout) as response:
                props = await response.json() if response.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return
        asleep = bool(props.get("is_sleeping")) if isinstance(props, dict) else False
        wanted = "sleeping" if asleep else "loaded"
        if instance.status != wanted and not instance.stopping:
            instance.set(wanted)

    async def _meta(self, base: str) -> dict[str, Any] | None:
        try:
            async with self.http.get(f"{base}/v1/models") as response:
                body = await response.json()
            meta = body["data"][0].get("meta")
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
            return None
        return meta if isinstance(meta, dict) else None

    async def ensure_ready(self, instance: Instance) -> Instance | web.Response:
        """The instance loaded (loading it first when it is not running), or the error."""
        if not instance.running:
            await self.start_load(instance)
        while instance.status == "loading":
            await instance.changed.wait()
        if not instance.running:
            return _error(500, f"model name={instance.spec.id} failed to load", "server_error")
        return instance

    async def unload_all(self) -> None:
        for instance in self.instances.values():
            self.request_unload(instance)
        for instance in self.instances.values():
            if instance.monitor is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await instance.monitor

    # ----------------------------------------------------------------- routes

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        data = [instance.to_json() for instance in self.instances.values()]
        return web.json_response({"data": data, "object": "list"})

    async def _body_model(self, request: web.Request) -> str:
        try:
            body = await request.json()
        except ValueError:
            return ""
        model = body.get("model") if isinstance(body, dict) else None
        return model if isinstance(model, str) else ""

    async def load(self, request: web.Request) -> web.Response:
        instance = self.lookup(await self._body_model(request))
        if instance is None:
            return _error(404, "File Not Found", "not_found_error")
        if instance.running:
            return _error(400, "model is already running")
        await self.start_load(instance)
        return web.json_response({"success": True})

    async def unload(self, request: web.Request) -> web.Response:
        instance = self.lookup(await self._body_model(request))
        if instance is None:
            return _error(400, "model is not found")
        if not instance.running:
            return _error(400, "model is not running")
        if instance.status == "loading" and instance.child is not None:
            instance.child.kill()  # as llama.cpp: unloading a loading model force-kills it
        self.request_unload(instance)
        return web.json_response({"success": True})

    def _router_props(self) -> web.Response:
        return web.json_response(
            {
                "role": "router",
                "max_instances": self.options.models_max,
                "models_autoload": self.options.autoload,
                "model_alias": "llama-server",
                "model_path": "none",
                "default_generation_settings": {"params": None, "n_ctx": 0},
                "ui_settings": {},
                "build_info": sim_engine.BUILD_INFO,
                "cors_proxy_enabled": False,
            }
        )

    def _autoload(self, request: web.Request) -> bool:
        value = request.query.get("autoload", "")
        return self.options.autoload if not value else value in ("true", "1")

    async def _route(self, name: str, autoload: bool) -> Instance | web.Response:
        if not name:
            return _error(400, "model name is missing from the request")
        instance = self.lookup(name)
        if instance is None:
            return _error(400, f"model '{name}' not found")
        if not autoload and not instance.running:
            return _error(400, "model is not loaded")
        if autoload:
            return await self.ensure_ready(instance)
        return instance

    async def props(self, request: web.Request) -> web.Response:
        if not request.query.get("model"):
            return self._router_props()
        return await self.proxy_get(request)

    async def proxy_get(self, request: web.Request) -> web.Response:
        routed = await self._route(request.query.get("model", ""), self._autoload(request))
        if isinstance(routed, web.Response):
            return routed
        query = {k: v for k, v in request.query.items() if k not in ("model", "autoload")}
        url = f"http://127.0.0.1:{routed.port}{request.path}"
        try:
            async with self.http.get(url, params=query) as response:
                body = await response.read()
                return web.Response(
                    status=response.status, body=body, content_type=response.content_type
                )
        except aiohttp.ClientError as err:
            return _error(500, f"proxy to {routed.spec.id} failed: {err}", "server_error")

    async def proxy_post(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "invalid JSON body")
        name = body.get("model") if isinstance(body, dict) else None
        routed = await self._route(name if isinstance(name, str) else "", self._autoload(request))
        if isinstance(routed, web.Response):
            return routed
        routed.last_used = time.monotonic()
        url = f"http://127.0.0.1:{routed.port}{request.path}"
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        try:
            async with self.http.post(url, data=raw, headers=headers) as upstream:
                response = web.StreamResponse(status=upstream.status)
                response.content_type = upstream.content_type
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientError as err:
            return _error(500, f"proxy to {routed.spec.id} failed: {err}", "server_error")


# --------------------------------------------------------------------------- child mode


@dataclass(frozen=True)
class ChildOptions:
    engine: sim_engine.EngineOptions
    hang_on_unload: bool = False


def parse_child(argv: Sequence[str]) -> ChildOptions:
    """``--host H --port P --alias ID --model PATH [engine args]`` → the fake engine's
    options with ``--model-id ID``; ``--hang-on-unload`` is the child's own fault flag."""
    parser = argparse.ArgumentParser(prog="python -m uapplace.sim.router --child")
    parser.add_argument("--alias", required=True)
    parser.add_argument("--model", default="")
    parser.add_argument("--hang-on-unload", action="store_true")
    known, rest = parser.parse_known_args(list(argv))
    rest = [arg for arg in rest if arg not in IGNORED_CHILD_FLAGS]
    options = sim_engine.parse_options([*rest, "--model-id", known.alias])
    return ChildOptions(options, known.hang_on_unload)


async def serve_child(child: ChildOptions, exit_asked: asyncio.Event, gpu: SimGpu | None) -> int:
    """The fake engine as a router's child: serve until ``exit_asked`` (0), or until the
    engine stops itself (its exit code); 1 when the port or the claim fails."""
    options = child.engine
    if options.fail_at_start:
        print(f"uapplace.sim.router child {options.model_id}: failing at start", flush=True)
        return 1
    memory = sim_engine.EngineMemory(options, gpu, os.getpid())
    memory.hold_host()
    engine = sim_engine.FakeEngine(options, memory)
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, options.host, options.port).start()
        except OSError as err:
            print(f"uapplace.sim.router child: cannot bind port {options.port}: {err}", flush=True)
            return 1
        try:
            memory.claim_gpu()
        except SimGpuError as err:
            print(f"uapplace.sim.router child: GPU allocation failed: {err}", flush=True)
            return 1
        loading = asyncio.create_task(engine.finish_loading())
        asked = asyncio.create_task(_exit_when(exit_asked, child.hang_on_unload))
        stopped = asyncio.create_task(engine.stopping.wait())
        try:
            await asyncio.wait({asked, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (loading, asked, stopped):
                task.cancel()
        return engine.exit_code
    finally:
        memory.release_gpu()
        memory.drop_host()
        await runner.cleanup()


async def _exit_when(exit_asked: asyncio.Event, hang: bool) -> None:
    await exit_asked.wait()
    if hang:
        print("uapplace.sim.router child: ignoring the exit command (--hang-on-unload)", flush=True)
        await asyncio.Event().wait()


async def _stdin_closed(exit_asked: asyncio.Event) -> None:
    """Set ``exit_asked`` when stdin reaches EOF (the router closed its pipe, or died).
    Read through the loop, never a thread: a thread blocked on stdin would hold the
    process open after the engine ended by itself."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.read(4096):
        pass
    exit_asked.set()


async def _child_main(child: ChildOptions) -> int:
    loop = asyncio.get_running_loop()
    alias = child.engine.model_id
    for signum in (signal.SIGTERM, signal.SIGINT):
        # As a real child: it logs and waits for the router's exit command.
        loop.add_signal_handler(
            signum,
            lambda: print(
                f"uapplace.sim.router child {alias}: cleaning up before exit...", flush=True
            ),
        )
    exit_asked = asyncio.Event()
    watcher = asyncio.create_task(_stdin_closed(exit_asked))
    gpu_path = os.environ.get(sim_engine.SIM_GPU_ENV)
    try:
        return await serve_child(child, exit_asked, SimGpu(Path(gpu_path)) if gpu_path else None)
    finally:
        watcher.cancel()


# --------------------------------------------------------------------------- router process


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m uapplace.sim.router", description="A fake llama.cpp router."
    )
    parser.add_argument("--port", type=int, required=True, help="TCP port; 0 picks a free one")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--models-dir", type=Path, help="models: the stems of its *.gguf files")
    parser.add_argument("--models-preset", type=Path, help="an INI file of model sections")
    parser.add_argument("--models-max", type=int, default=DEFAULT_MODELS_MAX, help="0: no limit")
    parser.add_argument("--no-models-autoload", action="store_true")
    parser.add_argument("--stop-timeout", type=float, default=DEFAULT_STOP_TIMEOUT_S)
    return parser


def parse_router(argv: Sequence[str]) -> tuple[RouterOptions, dict[str, ModelSpec]]:
    parser = _parser()
    args, rest = parser.parse_known_args(list(argv))
    if not 0 <= args.port <= 65535:
        parser.error("--port: out of range")
    if args.models_max < 0:
        parser.error("--models-max: must be 0 (no limit) or more")
    if args.stop_timeout <= 0:
        parser.error("--stop-timeout: must be positive")
    if args.models_dir is None and args.models_preset is None:
        parser.error("a router needs --models-dir or --models-preset")
    if args.models_dir is not None and not args.models_dir.is_dir():
        parser.error(f"--models-dir {args.models_dir}: not a directory")
    preset: dict[str, dict[str, str]] = {}
    if args.models_preset is not None:
        try:
            text = args.models_preset.read_text(encoding="utf-8")
            preset = parse_preset(text, str(args.models_preset))
            specs = discover(args.models_dir, preset)
        except (OSError, ValueError) as err:
            parser.error(f"--models-preset {args.models_preset}: {err}")
    else:
        specs = discover(args.models_dir, preset)
    options = RouterOptions(
        port=args.port,
        host=args.host,
        models_dir=args.models_dir,
        preset=args.models_preset,
        models_max=args.models_max,
        autoload=not args.no_models_autoload,
        stop_timeout_s=args.stop_timeout,
        child_args=tuple(rest),
    )
    return options, specs


async def serve(options: RouterOptions, specs: Mapping[str, ModelSpec]) -> int:
    """Serve until SIGTERM/SIGINT; then unload every child (as the real router) and exit 0."""
    router = FakeRouter(options, specs)
    runner = web.AppRunner(router.app(), access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, options.host, options.port).start()
        except OSError as err:
            print(f"uapplace.sim.router: cannot bind {options.host}:{options.port}: {err}")
            return 1
        host, port = runner.addresses[0][:2]
        print(f"{READY_PREFIX}http://{host}:{port} models: {', '.join(specs)}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        return 0
    finally:
        await runner.cleanup()  # the app's cleanup unloads every child first


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [CHILD_FLAG]:
        return asyncio.run(_child_main(parse_child(args[1:])))
    options, specs = parse_router(args)
    return asyncio.run(serve(options, specs))


def models_in(names: Iterable[str], folder: Path) -> Path:
    """Write an empty ``<name>.gguf`` per name into ``folder`` (the fake never reads them)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / f"{name}.gguf").write_bytes(b"")
    return folder


if __name__ == "__main__":
    sys.exit(main())
