"""One engine as a plain subprocess, the fake or the real ``llama-server``, started alike.

For the engine-contract suite (``test_contract.py``): the same llama.cpp flags become
either ``llama-server -m <tiny GGUF> --alias ID …`` (:func:`uapplace.sim.llamacpp.server_argv`)
or ``python -m uapplace.sim.engine --model-id ID …`` with the fake's equivalents
(``-c``, ``--parallel``, ``--sleep-idle-seconds``; a load that lasts and a generation that
lasts are the fake's ``--load-secs`` and ``--token-secs``). Both get a free port and
:func:`spawn` returns once it accepts connections: llama-server binds before it loads the
model but logs ``listening on`` only after, so the log cannot say when it first answers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from uapplace.sim.llamacpp import LLAMA_CACHE_ENV, server_argv

Kind = Literal["fake", "real"]
KINDS: tuple[Kind, ...] = ("fake", "real")
START_GUARD_S = 20.0
STOP_GUARD_S = 15.0


@dataclass(frozen=True)
class Shape:
    """The llama.cpp settings an engine is started with."""

    alias: str = "tiny"
    preset: str = "tiny-a"
    """The real server's tiny model (the fake has none); ``slow_tokens`` takes ``tiny-c``."""
    ctx_size: int = 512
    parallel: int = 2
    sleep_idle_s: int | None = None
    slow_load: bool = False
    """A load long enough to be seen (the fake: ``--load-secs 2``; the real: ``-c`` large
    enough that zeroing its KV cache takes a while)."""
    slow_tokens: bool = False
    """A generation long enough to be seen (the fake: ``--token-secs``; the real: a slot
    context of 2048 cells at a few hundred tokens a second)."""


@dataclass
class EngineProcess:
    kind: Kind
    process: subprocess.Popen[bytes]
    log_path: Path
    url: str

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def stop(self) -> int:
        """SIGTERM by PID; SIGKILL past :data:`STOP_GUARD_S` (and fail loudly then)."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_GUARD_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"the {self.kind} engine ignored SIGTERM:\n{self.log()}") from None


def argv_for(
    kind: Kind, shape: Shape, port: int, binary: Path | None, model: Path | None
) -> list[str]:
    if kind == "real":
        assert binary is not None and model is not None
        extra = ["--sleep-idle-seconds", str(shape.sleep_idle_s)] if shape.sleep_idle_s else []
        ctx, parallel = shape.ctx_size, shape.parallel
        if shape.slow_load:
            ctx, parallel = 32768, 1
        if shape.slow_tokens:
            ctx = 2048 * parallel  # the tiny models' training context, per slot
        return server_argv(
            binary,
            model,
            port=port,
            alias=shape.alias,
            ctx_size=ctx,
            parallel=parallel,
            extra=extra,
        )
    argv = [sys.executable, "-m", "uapplace.sim.engine", "--port", str(port)]
    argv += ["--model-id", shape.alias]
    argv += ["-c", str(shape.ctx_size), "--parallel", str(shape.parallel)]
    if shape.sleep_idle_s:
        argv += ["--sleep-idle-seconds", str(shape.sleep_idle_s)]
    if shape.slow_load:
        argv += ["--load-secs", "2"]
    if shape.slow_tokens:
        argv += ["--token-secs", "0.01"]
    return argv


def spawn(
    kind: Kind, shape: Shape, folder: Path, binary: Path | None, model: Path | None
) -> EngineProcess:
    """Start the engine on a free port; return once that port accepts connections."""
    folder.mkdir(parents=True, exist_ok=True)
    cache = folder / "llama-cache"
    cache.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "UAPPLACE_SIM_GPU"}
    env[LLAMA_CACHE_ENV] = str(cache)
    log_path = folder / f"{kind}-{time.monotonic_ns()}.log"
    port = free_port()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv_for(kind, shape, port, binary, model),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    engine = EngineProcess(kind, process, log_path, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + START_GUARD_S
    while not accepts(port):
        if process.poll() is not None or time.monotonic() > deadline:
            engine.stop()
            raise AssertionError(f"the {kind} engine did not listen:\n{engine.log()}")
        time.sleep(0.002)
    return engine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
