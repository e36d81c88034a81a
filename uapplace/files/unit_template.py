"""A backend's user unit from a tracked template (``systemd/templates/<engine>.service``).

One renderer for every unit uapplace writes for an engine: ``uapplace unit add``
(:mod:`uapplace.cli.unit`) and the demo's sandbox (:mod:`uapplace.demo.sandbox`) both
fill a template here, so the demo's engines run with the hardening an operator's get.

A template is a unit file with placeholders, each on its own or inside a line:
``@MARKER@`` (the first line's comment: who wrote the file), ``@NAME@`` and ``@MODEL@``
(the ``Description=``), ``@EXEC_START@`` (the command, every word quoted for systemd),
``@ENVIRONMENT@`` (a line of its own: one ``Environment=`` per pair, or no line at all)
and ``@START_TIMEOUT@``. The templates are the shipped ``systemd/templates``
(:mod:`uapplace.files.shipped`: the checkout's, or the copy installed with the package),
as ``uapplace install`` reads the shipped ``systemd/*.service``.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from uapplace.files import shipped

TEMPLATE_DIR = shipped.path("systemd/templates")
ENGINES = ("llama.cpp", "vllm", "fake")
"""The templates: llama.cpp's ``llama-server``, vLLM, and uapplace's simulated engine."""
START_TIMEOUT = {"llama.cpp": "300s", "vllm": "900s", "fake": "60s"}
"""``TimeoutStartSec=`` per template: vLLM captures CUDA graphs before it listens."""


class TemplateError(Exception):
    """A template that cannot be read or names no engine; the message names it."""


@dataclass(frozen=True)
class EngineUnit:
    """What fills a template: the engine's command and what the unit says about it."""

    engine: str
    """The template: one of :data:`ENGINES`."""
    name: str
    """The model key the unit serves (its ``Description=``)."""
    model: str
    """The weights it serves (its ``Description=``)."""
    argv: tuple[str, ...]
    """``ExecStart=``, word by word, as the program receives it."""
    marker: str
    """The first line's comment: who wrote the file (``uapplace unit`` finds its own by it)."""
    env: tuple[tuple[str, str], ...] = ()
    """``Environment=`` pairs; a value holds no double quote, backslash or newline."""


def systemd_word(text: str) -> str:
    """One word of ``ExecStart=``: quoted for systemd's own splitting, ``%`` and ``$``
    doubled so neither a specifier nor a variable is expanded."""
    return shlex.quote(text.replace("%", "%%").replace("$", "$$"))


def template_path(engine: str) -> Path:
    if engine not in ENGINES:
        raise TemplateError(f"{engine!r} names no unit template (one of {', '.join(ENGINES)})")
    return TEMPLATE_DIR / f"{engine}.service"


def render_unit(unit: EngineUnit) -> str:
    """The unit file: ``unit.engine``'s template filled with ``unit``'s values."""
    path = template_path(unit.engine)
    try:
        template = path.read_text(encoding="utf-8")
    except OSError as err:
        raise TemplateError(f"cannot read the unit template {path}: {err}") from None
    environment = environment_lines(unit.env)
    values = {
        "@MARKER@": unit.marker,
        "@NAME@": unit.name.replace("%", "%%"),
        "@MODEL@": unit.model.replace("%", "%%"),
        "@EXEC_START@": " ".join(systemd_word(word) for word in unit.argv),
        "@ENVIRONMENT@": environment,
        "@START_TIMEOUT@": START_TIMEOUT[unit.engine],
    }
    text = template if environment else template.replace("@ENVIRONMENT@\n", "")
    for placeholder, value in values.items():
        text = text.replace(placeholder, value)
    return text


def environment_lines(env: Sequence[tuple[str, str]]) -> str:
    """One quoted ``Environment=`` line per pair (``%`` doubled: no specifier expands)."""
    return "\n".join(f'Environment="{key}={value.replace("%", "%%")}"' for key, value in env)
