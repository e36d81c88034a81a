"""Text from outside (client and model names, sessions, daemon messages) made safe to print.

Client ids, model ids and sessions come from whoever calls ``Admit``; a name such as
``"\\x1b]0;pwned\\x07"`` or ``"\\x1b[2J"`` printed raw would retitle or clear the
operator's terminal, and a C1 ``CSI`` (``\\x9b``) does the same on terminals that honour
8-bit controls. :func:`printable` removes:

- whole escape sequences first (CSI ``ESC [ … final``, OSC ``ESC ] … BEL|ST``, DCS/SOS/
  PM/APC strings, their 8-bit C1 forms, and any other ``ESC x`` pair), so no visible
  ``[31m`` debris is left behind (a string without its terminator loses only its
  ``ESC ]``: Rich drops a ``BEL`` before this layer sees the text, and guessing where
  the title ended could eat real text);
- then every remaining C0 control, ``DEL`` and C1 control (a tab becomes a space);
- and the Unicode bidirectional overrides and isolates (U+202A–U+202E,
  U+2066–U+2069), which can make a name display as something it is not.

A newline becomes a space unless ``keep_newlines`` (the console layer below needs the
line breaks Rich itself puts between lines).

:func:`install` applies it to everything a Rich :class:`~rich.console.Console` prints,
at the segment level: the text of tables, panels and plain lines is cleaned, while
Rich's own styling (colours, bold) is emitted after this step and is untouched. That is
one call per console in :mod:`uapplace.cli.app` instead of a wrapper at every print.
"""

from __future__ import annotations

import re

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, ConsoleRenderable, RenderHook, RenderResult
from rich.segment import Segment

_ESCAPE_SEQUENCES = re.compile(
    r"""
      (?:\x1b\[|\x9b) [\x30-\x3f]* [\x20-\x2f]* [\x40-\x7e]?         # CSI … final byte
    | (?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]) .*? (?:\x07|\x1b\\|\x9c)  # OSC, DCS, SOS, PM, APC
    | \x1b [\x20-\x2f]* [\x30-\x7e]?                                 # any other ESC sequence
    """,
    re.VERBOSE | re.DOTALL,
)
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` without escape sequences, control characters or bidi overrides."""
    if text.isprintable():  # the common case: nothing to do (str.isprintable is C-fast)
        return text
    cleaned = _ESCAPE_SEQUENCES.sub("", text).replace("\t", " ")
    if not keep_newlines:
        cleaned = cleaned.replace("\r\n", " ").replace("\n", " ")
    return _CONTROLS.sub("", cleaned)


class _Printable:
    """A renderable whose text segments pass through :func:`printable`."""

    def __init__(self, inner: ConsoleRenderable) -> None:
        self.inner = inner

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for segment in console.render(self.inner, options):
            if segment.control or segment.text.isprintable():
                yield segment
            else:
                clean = printable(segment.text, keep_newlines=True)
                # Pad to the width Rich measured, so table borders stay aligned.
                pad = 0 if "\n" in clean else cell_len(segment.text) - cell_len(clean)
                yield Segment(clean + " " * max(pad, 0), segment.style)


class _PrintableHook(RenderHook):
    def process_renderables(self, renderables: list[ConsoleRenderable]) -> list[ConsoleRenderable]:
        return [_Printable(r) for r in renderables]


def install(console: Console) -> Console:
    """Make everything ``console.print`` / ``console.log`` writes pass :func:`printable`."""
    console.push_render_hook(_PrintableHook())
    return console
