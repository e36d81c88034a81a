"""The one renderer of backend units (:mod:`uapplace.files.unit_template`): every tracked
template fills completely, words reach systemd unexpanded, and the demo's engine units
come from the same templates as ``uapplace unit add``'s."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from uapplace.demo.sandbox import (
    CODER,
    DEMO_UNIT_MARKER,
    TINY_B,
    Sandbox,
    SandboxSpec,
    llamacpp_spec,
)
from uapplace.files.unit_template import (
    ENGINES,
    TEMPLATE_DIR,
    EngineUnit,
    TemplateError,
    render_unit,
    systemd_word,
)
from uapplace.sim.gpu import SimGpu


def _unit(engine: str, **changes: object) -> EngineUnit:
    values: dict[str, object] = {
        "engine": engine,
        "name": "tiny",
        "model": "/models/tiny.gguf",
        "argv": ("/usr/bin/llama-server", "--port", "8080"),
        "marker": "Written by a test.",
        "env": (("CUDA_VISIBLE_DEVICES", "0"),),
    }
    values.update(changes)
    return EngineUnit(**values)  # type: ignore[arg-type]


def _service(text: str) -> dict[str, list[str]]:
    """``[Service]`` key → values, in order (comments and other sections left out)."""
    section, keys = "", dict[str, list[str]]()
    for line in text.splitlines():
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            keys.setdefault(key, []).append(value)
    return keys


@pytest.mark.parametrize("engine", ENGINES)
def test_every_template_fills_completely(engine: str) -> None:
    assert (TEMPLATE_DIR / f"{engine}.service").is_file()
    text = render_unit(_unit(engine))
    assert "@" not in text.replace("@system-service", "")
    assert text.splitlines()[0] == "# Written by a test."
    service = _service(text)
    assert service["ExecStart"] == ["/usr/bin/llama-server --port 8080"]
    assert service["Environment"] == ['"CUDA_VISIBLE_DEVICES=0"']
    assert service["NoNewPrivileges"] == ["yes"]
    assert service["Restart"] == ["no"]
    assert "[Install]" not in text.splitlines()  # uapplaced starts it; nothing enables it


def test_no_environment_leaves_no_line() -> None:
    text = render_unit(_unit("fake", env=()))
    assert "Environment" not in _service(text)
    assert "\n\n\n" not in text


def test_specifiers_and_variables_reach_the_engine_unexpanded() -> None:
    text = render_unit(_unit("llama.cpp", argv=("/bin/x", "a%n$HOME b"), model="50%"))
    assert _service(text)["ExecStart"] == ["/bin/x 'a%%n$$HOME b'"]
    assert "serving 50%%" in text
    assert systemd_word("plain") == "plain"


def test_an_unknown_template_is_named() -> None:
    with pytest.raises(TemplateError, match="'ollama' names no unit template"):
        render_unit(_unit("ollama"))


def _box(tmp_path: Path, spec: SandboxSpec, sim: SimGpu | None) -> Sandbox:
    ports = {model.key: 8000 + i for i, model in enumerate(spec.models)}
    return Sandbox(spec, tmp_path, "unix:path=/nonexistent", tmp_path, True, sim, ports)


def test_the_demo_writes_its_fake_engines_from_the_fake_template(tmp_path: Path) -> None:
    box = _box(tmp_path, SandboxSpec(), SimGpu(tmp_path / "sim-gpu.json"))
    text = box._unit_text(CODER)
    expected = EngineUnit(
        "fake",
        CODER.key,
        CODER.display,
        tuple(box.unit_argv(CODER)),
        DEMO_UNIT_MARKER,
        (("UAPPLACE_SIM_GPU", str(tmp_path / "sim-gpu.json")),),
    )
    assert text == render_unit(expected)
    assert _service(text)["ExecStart"] == [shlex.join(box.unit_argv(CODER))]
    assert _service(text)["SystemCallFilter"] == ["@system-service"]


def test_the_demo_writes_its_llama_servers_from_the_llamacpp_template(tmp_path: Path) -> None:
    box = _box(tmp_path, llamacpp_spec(Path("/opt/llama-server")), None)
    text = box._unit_text(TINY_B)
    assert text.startswith(f"# {DEMO_UNIT_MARKER}\n# Template: systemd/templates/llama.cpp")
    assert _service(text)["ExecStart"] == [shlex.join(box.unit_argv(TINY_B))]
    assert f"serving {box.model_file(TINY_B)}" in text
