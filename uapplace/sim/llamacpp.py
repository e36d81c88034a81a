"""Where the real ``llama-server`` is, and how a test or the demo starts one; runs nothing.

docs/architecture.md ("Test tiers", tier 4). ``make engine``
(``scripts/build-llama-server.sh``) builds llama.cpp's ``llama-server`` from the
``llama-cpp-python`` sdist pinned in ``llama-cpp.pin`` (beside this module, the one
place the pin is written; the script reads the same file) and caches it at::

    ${UAPPLACE_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/uapplace/engines}/llama.cpp-<pin>/bin/llama-server

:func:`llama_server_path` computes that path from an environment exactly as the
script does (an empty variable counts as unset, as ``${VAR:-…}`` does);
:func:`missing_binary` says why it cannot be used (not built, not executable), with
the command that builds it. :func:`server_argv` is the command line a single-model
server is started with in a unit or a subprocess.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PIN_FILE = Path(__file__).with_name("llama-cpp.pin")
BUILD_COMMAND = "make engine"
"""What builds (or reuses) the cached binary: ``scripts/build-llama-server.sh``."""
LLAMA_CACHE_ENV = "LLAMA_CACHE"
"""llama.cpp's download cache; a test points it at an empty folder (a router lists it)."""


class PinError(ValueError):
    """``llama-cpp.pin`` is missing a key or holds a malformed one; the message names both."""


@dataclass(frozen=True)
class LlamaCppPin:
    """The ``llama-cpp-python`` sdist whose vendored llama.cpp is built."""

    version: str
    sha256: str

    @property
    def entry_name(self) -> str:
        """The cache entry's folder name, ``llama.cpp-<version>``."""
        return f"llama.cpp-{self.version}"


def read_pin(path: Path = PIN_FILE) -> LlamaCppPin:
    """The pin in ``path`` (``KEY=value`` lines; ``#`` comments and blank lines ignored)."""
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise PinError(f"{path}:{number}: expected KEY=value, got {line!r}")
        values[key.strip()] = value.strip()
    version = values.get("LLAMA_CPP_PYTHON_VERSION", "")
    sha256 = values.get("LLAMA_CPP_PYTHON_SHA256", "")
    if not version or any(c not in "0123456789." for c in version):
        raise PinError(f"{path}: LLAMA_CPP_PYTHON_VERSION must be a version, got {version!r}")
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise PinError(f"{path}: LLAMA_CPP_PYTHON_SHA256 must be 64 hex digits, got {sha256!r}")
    return LlamaCppPin(version, sha256)


def engine_cache_root(env: Mapping[str, str]) -> Path:
    """``${UAPPLACE_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/uapplace/engines}``."""
    if env.get("UAPPLACE_ENGINE_CACHE"):
        return Path(env["UAPPLACE_ENGINE_CACHE"])
    cache_home = env.get("XDG_CACHE_HOME") or f"{env.get('HOME', '')}/.cache"
    return Path(cache_home) / "uapplace" / "engines"


def llama_server_path(env: Mapping[str, str], pin: LlamaCppPin | None = None) -> Path:
    """Where ``make engine`` puts (or found) the pinned ``llama-server`` under ``env``."""
    entry = (pin or read_pin()).entry_name
    return engine_cache_root(env) / entry / "bin" / "llama-server"


def missing_binary(path: Path) -> str | None:
    """Why ``path`` cannot be run as ``llama-server`` (checked without running it), or ``None``."""
    if not path.is_file():
        return f"llama-server is not built at {path}: run `{BUILD_COMMAND}`"
    if not path.stat().st_mode & 0o111:
        return f"{path} is not executable: run `{BUILD_COMMAND}` to rebuild it"
    return None


def server_argv(
    binary: Path,
    model: Path,
    *,
    port: int,
    alias: str | None,
    ctx_size: int = 512,
    parallel: int = 2,
    sse_ping_s: int = 1,
    metrics: bool = True,
    extra: Sequence[str] = (),
) -> list[str]:
    """A single-model ``llama-server`` on 127.0.0.1:``port`` serving ``model`` as ``alias``.

    ``-c`` is the whole KV pool, split across the ``--parallel`` slots (``-c 512
    --parallel 2`` gives 256 cells per slot); ``--metrics`` turns ``/metrics`` on (it is
    501 without; ``metrics=False`` leaves it off: llama-server has no ``--no-metrics`` to
    undo it in ``extra``); a short ``--sse-ping-interval`` lets a stream end soon after
    SIGTERM (llama-server waits for the next ping). ``alias`` ``None``: no ``--alias`` (the
    id is then the model path as given).
    """
    argv = [str(binary), "-m", str(model)]
    if alias is not None:
        argv += ["--alias", alias]
    argv += ["--host", "127.0.0.1", "--port", str(port), "-c", str(ctx_size)]
    argv += ["--parallel", str(parallel), *(["--metrics"] if metrics else [])]
    argv += ["--sse-ping-interval", str(sse_ping_s)]
    return [*argv, *extra]
