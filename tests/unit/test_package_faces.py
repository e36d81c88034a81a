"""The floor plan keeps its shape: packages with faces, none too large without a reason.

docs/architecture.md ("Package map"): ``uapplace/`` holds packages and the two face
modules ``__init__`` and ``gate``; each package's ``__init__`` docstring says what it owns
and what it may import; a package of more than ``MAX_MODULES`` modules says why in its
face with a line ``Why N modules:`` whose N is the count it has now, so a face that
fell behind its package fails here rather than misleading a reader.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "uapplace"
MAX_MODULES = 12
TOP_LEVEL_MODULES = frozenset({"__init__.py", "gate.py"})
WHY = re.compile(r"Why (\d+) modules:")


def packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.glob("*/__init__.py"))


def modules_of(package: Path) -> list[str]:
    """The package's modules; ``__init__`` and ``__main__`` are its face and its entry."""
    return sorted(p.name for p in package.glob("*.py") if not p.name.startswith("__"))


def face_of(package: Path) -> str:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text("utf-8")))
    return docstring or ""


def test_the_top_level_holds_only_packages_and_its_face_modules() -> None:
    loose = {p.name for p in PACKAGE.glob("*.py")} - TOP_LEVEL_MODULES
    assert not loose, f"modules outside a package: {sorted(loose)}"
    assert len(packages()) >= 10


@pytest.mark.parametrize("package", packages(), ids=lambda p: p.name)
def test_each_package_face_says_what_it_owns_and_may_import(package: Path) -> None:
    face = face_of(package)
    assert face, f"{package.name}/__init__.py has no docstring"
    assert "May import" in face, f"{package.name}'s face does not say what it may import"


@pytest.mark.parametrize("package", packages(), ids=lambda p: p.name)
def test_a_large_package_says_why_with_its_current_count(package: Path) -> None:
    count = len(modules_of(package))
    stated = WHY.search(face_of(package))
    if count <= MAX_MODULES:
        assert stated is None or int(stated.group(1)) == count, (
            f"{package.name}'s face says {stated.group(1) if stated else ''} modules, "
            f"it has {count}"
        )
        return
    assert stated is not None, (
        f"{package.name} has {count} modules (over {MAX_MODULES}) and its face "
        f"does not say why (a line 'Why {count} modules: …')"
    )
    assert int(stated.group(1)) == count, (
        f"{package.name}'s face says {stated.group(1)} modules, "
        f"it has {count}: {modules_of(package)}"
    )


def test_the_checks_see_a_face_that_fell_behind(tmp_path: Path) -> None:
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "__init__.py").write_text('"""Owns x.\n\nWhy 13 modules: one per y.\n"""\n')
    for n in range(14):
        (stale / f"m{n}.py").write_text("")
    stated = WHY.search(face_of(stale))
    assert stated is not None and int(stated.group(1)) != len(modules_of(stale))
