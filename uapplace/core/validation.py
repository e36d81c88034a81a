"""The first problem of a pydantic ``ValidationError``, as the one line an edge shows.

Every edge that answers with only the first problem reads it here: bus arguments
(``service``), engine replies (``engines``), HTTP bodies (``shim.bodies``,
``sim.gateproxy``), the timeouts file (``timeouts``) and each auto-policy knob
(``auto``). Each keeps its own wording, which tests assert byte for byte: how the
path is written, what stands for an empty one and what follows the message are
parameters of :meth:`FirstError.where` and of the caller's line, not copies of the
extraction. Files that list every problem (``registry``, ``capacity``, ``ledger``)
do not use this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError


@dataclass(frozen=True)
class FirstError:
    """The first of the problems pydantic found, and how many follow it."""

    loc: tuple[int | str, ...]
    msg: str
    input: Any
    more: int

    def where(self, root: str = "", *, part: str = "{}", sep: str = ".") -> str:
        """The path of the problem, each part written as ``part`` and joined by ``sep``
        (``a.0.b`` by default, ``[a][0][b]`` with ``part="[{}]", sep=""``); ``root``
        when the problem is the whole value."""
        return sep.join(part.format(p) for p in self.loc) or root


def first_error(err: ValidationError) -> FirstError:
    """The first problem of ``err`` (a ``ValidationError`` always carries one)."""
    problems = err.errors(include_url=False)
    first = problems[0]
    return FirstError(tuple(first["loc"]), str(first["msg"]), first.get("input"), len(problems) - 1)


def first_error_text(err: ValidationError, root: str) -> str:
    """``where: message`` with a dotted path, ``root`` for the whole value."""
    first = first_error(err)
    return f"{first.where(root)}: {first.msg}"
