"""Where the real llama-server is (``uapplace.sim.llamacpp``): one pin, the script's path.

The build script (``scripts/build-llama-server.sh --print-path``) and the package compute
the same cache path from the same pin file under every environment; nothing is run but
the script's ``--print-path``, which builds nothing.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from uapplace.sim.llamacpp import (
    LlamaCppPin,
    PinError,
    engine_cache_root,
    llama_server_path,
    missing_binary,
    read_pin,
    server_argv,
)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "build-llama-server.sh"


def script_path(env: dict[str, str]) -> Path:
    done = subprocess.run(
        ["bash", str(SCRIPT), "--print-path"],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return Path(done.stdout.strip())


@pytest.mark.parametrize(
    "env",
    [
        {"HOME": "/home/u"},
        {"HOME": "/home/u", "XDG_CACHE_HOME": "/var/cache/u"},
        {"HOME": "/home/u", "XDG_CACHE_HOME": "", "UAPPLACE_ENGINE_CACHE": ""},
        {"HOME": "/home/u", "XDG_CACHE_HOME": "/x", "UAPPLACE_ENGINE_CACHE": "/engines"},
    ],
    ids=["home", "xdg", "empty-is-unset", "engine-cache-wins"],
)
def test_the_package_and_the_script_agree_on_the_path(env: dict[str, str]) -> None:
    assert llama_server_path(env) == script_path(env)


def test_the_path_is_keyed_by_the_pinned_version() -> None:
    pin = read_pin()
    assert llama_server_path({"UAPPLACE_ENGINE_CACHE": "/e"}) == Path(
        f"/e/llama.cpp-{pin.version}/bin/llama-server"
    )
    assert engine_cache_root({"HOME": "/h"}) == Path("/h/.cache/uapplace/engines")


def test_the_pin_is_written_once() -> None:
    """The script reads the package's pin file and states no version of its own."""
    pin = read_pin()
    script = SCRIPT.read_text(encoding="utf-8")
    assert "uapplace/sim/llama-cpp.pin" in script
    assert pin.version not in script and pin.sha256 not in script


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("LLAMA_CPP_PYTHON_SHA256=" + "a" * 64 + "\n", "LLAMA_CPP_PYTHON_VERSION must be"),
        ("LLAMA_CPP_PYTHON_VERSION=0.3.36\nLLAMA_CPP_PYTHON_SHA256=zz\n", "64 hex digits"),
        ("# a comment\nnot a pair\n", ":2: expected KEY=value"),
    ],
)
def test_a_bad_pin_file_is_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "llama-cpp.pin"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PinError, match=message) as caught:
        read_pin(path)
    assert str(path) in str(caught.value)


def test_a_missing_or_unrunnable_binary_names_the_build_command(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    assert missing_binary(binary) == f"llama-server is not built at {binary}: run `make engine`"
    binary.write_text("#!/bin/sh\n", encoding="utf-8")
    binary.chmod(0o644)
    assert "is not executable: run `make engine`" in (missing_binary(binary) or "")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    assert missing_binary(binary) is None


def test_server_argv_is_a_single_model_server_on_loopback() -> None:
    argv = server_argv(
        Path("/b/llama-server"),
        Path("/m/tiny-a.gguf"),
        port=8080,
        alias="alpha",
        extra=["--sleep-idle-seconds", "5"],
    )
    assert argv == [
        "/b/llama-server",
        "-m",
        "/m/tiny-a.gguf",
        "--alias",
        "alpha",
        "--host",
        "127.0.0.1",
        "--port",
        "8080",
        "-c",
        "512",
        "--parallel",
        "2",
        "--metrics",
        "--sse-ping-interval",
        "1",
        "--sleep-idle-seconds",
        "5",
    ]
    assert "--alias" not in server_argv(Path("b"), Path("m"), port=1, alias=None)


def test_the_entry_name_is_the_cache_folder() -> None:
    assert LlamaCppPin("0.3.36", "0" * 64).entry_name == "llama.cpp-0.3.36"
