"""Only the controller writes its state (issue 14): what the language does not say itself.

:class:`~uapplace.controller.controller.Controller` keeps its state in private attributes
behind read-only properties, so ``controller.residents = …`` from outside fails (at run
time, and under mypy), and it hands the residents and the holds out as read-only types
(``Sequence``, ``Mapping``), so mypy refuses ``controller.residents.append(…)`` and
``controller.holds.take(…)``. Left to check here: that every public name stays a method
or a property without a setter (a new plain attribute would be settable again), that
the read-only types are what is handed out, and that no module but the controller's own
calls the writers of the admission table (the one part it hands out whose writers only it
may call: each write must come with its bookkeeping of signals, ledger and re-plan).
"""

from __future__ import annotations

import ast
import inspect
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from controller_fixtures import registry, registry_paths

from tests.worlds.seed_docs import alpha_model
from uapplace.controller.controller import Controller

PACKAGE = Path(__file__).resolve().parents[2] / "uapplace"
OWN_MODULE = PACKAGE / "controller" / "controller.py"
ADMISSION_WRITERS = frozenset(
    {"decide", "take_evicted", "remove", "expire", "replace", "restore"}
    | {"set_residents", "set_registry"}
)
"""What changes :class:`~uapplace.core.admission.Admission` (``get`` with ``now`` drops an
expired entry too: only the controller passes one)."""


def public_names() -> list[str]:
    return [name for name in dir(Controller) if not name.startswith("_")]


@pytest.mark.parametrize("name", public_names())
def test_every_public_name_is_a_method_or_a_read_only_property(name: str) -> None:
    member = inspect.getattr_static(Controller, name)
    if isinstance(member, property):
        assert member.fset is None and member.fdel is None, f"Controller.{name} can be set"
    else:
        assert inspect.isfunction(member) or isinstance(member, classmethod), name


def test_an_instance_holds_no_public_attribute(tmp_path: Path) -> None:
    paths = registry_paths(tmp_path, registry({"alpha": alpha_model()}))
    controller = Controller.open(paths)
    assert [name for name in vars(controller) if not name.startswith("_")] == []
    with pytest.raises(AttributeError):
        controller.residents = []  # type: ignore[misc]


def test_residents_and_holds_are_handed_out_as_read_only_types() -> None:
    hints = typing.get_type_hints(Controller.__dict__["residents"].fget)
    assert typing.get_origin(hints["return"]) is Sequence
    hints = typing.get_type_hints(Controller.__dict__["holds"].fget)
    assert typing.get_origin(hints["return"]) is Mapping


def admission_writes(source: str) -> list[str]:
    """``….admission.replace(…)`` and the like: calls of the table's writers."""
    return [
        ast.unparse(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ADMISSION_WRITERS
        and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr in {"admission", "_admission"}
    ]


def test_the_detector_finds_an_admission_write() -> None:
    assert admission_writes("x = host.controller.admission.replace(entry)") != []
    assert admission_writes("controller.admission.get(placement_id)") == []


def test_only_the_controller_writes_the_admission_table() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}: {call}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != OWN_MODULE
        for call in admission_writes(path.read_text(encoding="utf-8"))
    ]
    assert found == [], "the admission table written from outside the controller:\n" + "\n".join(
        found
    )
