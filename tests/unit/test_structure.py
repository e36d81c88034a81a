"""The controller's state is written only by the controller (issue 14).

An AST walk over every module in ``uapplace/``: outside ``controller.py``, nothing
assigns to an attribute of the controller (``controller.x = …``, ``controller.x[k] = …``,
``controller.x += …``, ``del controller.x[k]``, ``setattr(controller, …)``), nor calls a
mutating method on a container or table the controller owns (``controller.residents
.append(…)``, ``controller.admission.replace(…)``, ``controller.holds.take(…)``).
Changes go through the controller's methods and the state objects it hands out
(``usage``, ``cooldowns``, ``alerts``, ``enforcement``), which persist themselves.

"The controller" is any expression that names it: a name or attribute called
``controller``/``ctl``/``_controller`` (``self.controller``, ``host.controller``), a
parameter or variable annotated ``Controller`` or one of the narrow Protocols the
controller itself is handed over as (``AutoHost``, ``IdleHost``), any local name
assigned from one of those, and ``self.<attr>`` once a method of the class stored one
there (``self.host = host``). The first tests prove the detector on small samples,
so that a clean result on the package means something.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "uapplace"
OWN_MODULES = frozenset({"controller.py"})
"""The controller's own module: the one place its attributes are written."""
CONTROLLER_NAMES = frozenset({"controller", "ctl", "ctrl", "_controller"})
CONTROLLER_TYPES = frozenset({"Controller", "AutoHost", "IdleHost"})
"""The controller's class, and the Protocols it is passed as itself (no adapter between)."""
CONTAINER_MUTATORS = frozenset(
    {
        "append",
        "extend",
        "insert",
        "pop",
        "popitem",
        "remove",
        "clear",
        "update",
        "setdefault",
        "add",
        "discard",
        "sort",
        "reverse",
        "__setitem__",
        "__delitem__",
    }
)
OWNED_TABLE_WRITERS = {
    "admission": frozenset(
        {"decide", "replace", "remove", "expire", "restore", "set_residents", "set_registry"}
    ),
    "holds": frozenset({"take", "release", "drop_sender"}),
}
"""Tables the controller owns whose writes must come with its own bookkeeping (persist,
signal, re-plan): only its methods may call these."""


@dataclass(frozen=True)
class Write:
    module: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.text}"


def _annotated_controller(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    text = ast.unparse(annotation).strip("'\"")
    return text.split(".")[-1].split("|")[0].strip() in CONTROLLER_TYPES


class _Scope(ast.NodeVisitor):
    """Finds controller writes in one module, tracking names bound to the controller."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.bound: set[str] = set()
        self.bound_attrs: set[str] = set()
        """``self.<attr>`` that hold the controller, in the class being visited."""
        self.writes: list[Write] = []

    # ---------------------------------------------------------------- binding

    def is_controller(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in CONTROLLER_NAMES or node.id in self.bound
        if isinstance(node, ast.Attribute):
            held = isinstance(node.value, ast.Name) and node.value.id == "self"
            return node.attr in CONTROLLER_NAMES or (held and node.attr in self.bound_attrs)
        return False

    def owned_path(self, node: ast.expr) -> list[str] | None:
        """``controller.a.b`` → ``["a", "b"]``; ``None`` when not rooted at the controller
        through at least one attribute."""
        steps: list[str] = []
        while isinstance(node, ast.Attribute | ast.Subscript):
            if isinstance(node, ast.Attribute):
                if self.is_controller(node.value):
                    return [node.attr, *reversed(steps)]
                steps.append(node.attr)
            node = node.value
        return None

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        saved = set(self.bound)
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            if _annotated_controller(arg.annotation):
                self.bound.add(arg.arg)
        self.generic_visit(node)
        self.bound = saved

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function
    visit_Lambda = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        saved = set(self.bound_attrs)
        self.bound_attrs = set()
        self.generic_visit(node)
        self.bound_attrs = saved

    # ---------------------------------------------------------------- writes

    def _target(self, target: ast.expr, node: ast.stmt) -> None:
        if isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                self._target(element, node)
        elif isinstance(target, ast.Starred):
            self._target(target.value, node)
        elif isinstance(target, ast.Attribute | ast.Subscript) and self.owned_path(target):
            self.writes.append(Write(self.module, node.lineno, ast.unparse(node)))

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._target(target, node)
            if self.is_controller(node.value):
                self._bind(target)
        self.generic_visit(node)

    def _bind(self, target: ast.expr) -> None:
        if isinstance(target, ast.Name):
            self.bound.add(target.id)
        elif (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id == "self"
        ):
            self.bound_attrs.add(target.attr)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._target(node.target, node)
        if isinstance(node.target, ast.Name) and (
            _annotated_controller(node.annotation)
            or (node.value is not None and self.is_controller(node.value))
        ):
            self.bound.add(node.target.id)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._target(node.target, node)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._target(target, node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (
            isinstance(func, ast.Name)
            and func.id in {"setattr", "delattr"}
            and node.args
            and (self.is_controller(node.args[0]) or self.owned_path(node.args[0]))
        ):
            self.writes.append(Write(self.module, node.lineno, ast.unparse(node)))
        if isinstance(func, ast.Attribute):
            path = self.owned_path(func.value)
            if path is not None and (
                func.attr in CONTAINER_MUTATORS
                or func.attr in OWNED_TABLE_WRITERS.get(path[0], frozenset())
            ):
                self.writes.append(Write(self.module, node.lineno, ast.unparse(node)))
        self.generic_visit(node)


def controller_writes(source: str, module: str = "<sample>") -> list[Write]:
    scope = _Scope(module)
    scope.visit(ast.parse(source))
    return scope.writes


def package_modules() -> Iterator[Path]:
    yield from sorted(PACKAGE.rglob("*.py"))


# --------------------------------------------------------------------------- the detector


@pytest.mark.parametrize(
    "source",
    [
        "controller.residents = []",
        "self.controller.usage['m'] = 1.0",
        "host.controller.cooldowns['m'] += 1",
        "del controller.residents[0]",
        "self._controller.events = sink",
        "controller.residents.append(r)",
        "controller.admission.replace(entry)",
        "controller.holds.take('m', 'r', '', ':1.1', 0.0)",
        "setattr(controller, 'enforcer', x)",
        "controller.config.state = s",
        "c = self.controller\nc.enforcer = x",
        "def f(c: Controller) -> None:\n    c.residents.clear()",
        "def f(c: 'Controller') -> None:\n    c.proxy = None",
        "def f() -> None:\n    c: Controller = make()\n    c.notifier = n",
        "ctl.residents, other = [], 1",
        "class A:\n    def __init__(self, host: AutoHost) -> None:\n        self.host = host\n"
        "    def f(self) -> None:\n        self.host.cooldowns['m'] = 1.0",
        "class A:\n    def __init__(self, host: IdleHost) -> None:\n        self.host = host\n"
        "    def f(self) -> None:\n        self.host.admission.replace(e)",
    ],
)
def test_the_detector_finds_a_write_from_outside(source: str) -> None:
    assert len(controller_writes(source)) == 1


@pytest.mark.parametrize(
    "source",
    [
        "self.controller = controller",
        "controller.upsert_resident(r)",
        "controller.replace_pending(entry)",
        "controller.usage.touch('m', 1.0)",
        "controller.cooldowns.start('m', 2.0)",
        "controller.enforcement.attach(parts)",
        "x = controller.residents[0]",
        "rows = list(controller.holds.values())",
        "self.alert_board = controller.alert_board",
        "other.residents = []",
        "class A:\n    def __init__(self, host: AutoHost) -> None:\n        self.host = host\n"
        "    def f(self) -> None:\n        self.host.cooldowns.start('m', 1.0)",
        "class A:\n    def f(self) -> None:\n        self.host.usage['m'] = 1.0",
        "def f(c: Controller) -> None:\n    d = {}\n    d['k'] = c.registry",
    ],
)
def test_the_detector_leaves_reads_and_method_calls_alone(source: str) -> None:
    assert controller_writes(source) == []


def test_a_binding_ends_with_its_function() -> None:
    source = "def f(c: Controller) -> None:\n    pass\n\nc = {}\nc.x = 1\n"
    assert controller_writes(source) == []


# --------------------------------------------------------------------------- the package


def test_the_package_has_modules_to_check() -> None:
    names = {p.name for p in package_modules()}
    assert {"controller.py", "auto.py", "idle.py", "host.py", "wiring.py"} <= names


def test_only_the_controller_writes_its_attributes() -> None:
    found: list[Write] = []
    for path in package_modules():
        if path.name in OWN_MODULES and path.parent == PACKAGE:
            continue
        module = str(path.relative_to(PACKAGE.parent))
        found.extend(controller_writes(path.read_text(encoding="utf-8"), module))
    assert found == [], "written from outside the controller:\n" + "\n".join(map(str, found))
