"""The project's documents are cited by file and section, and every citation resolves.

The code, the tests and the text files cite ``docs/<name>.md``, optionally with a
section (``docs/placement-rules.md §4.3``, ``§4.1, §9.1``), a quoted heading
(``docs/architecture.md ("Layers")``, ``docs/bus-api.md, "Errors"``) or an invariant
(``docs/invariants.md (invariant 2)``). This test scans the repository's code and text
files for them and checks that each named file exists, that each cited ``§`` number is
a heading of that file (``## §4.3 Admission``), that each quoted heading is one (with
or without its ``§`` number), and that each cited invariant has its heading
(``## Invariant 2: Publication``).

It also checks that nothing cites the documents this project was built from by their
outside names (the design notes, the wire contract, the source specification): the
project's account of them is ``docs/``, and only that may be cited. The first tests
prove the scanner on small samples, so that a clean result on the repository means
something.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
THIS_FILE = Path(__file__).resolve()

SCANNED_DIRS = (
    "uapplace",
    "tests",
    "bench",
    "scripts",
    "systemd",
    "dbus",
    "polkit",
    "config",
    "contrib",
    "docs",
)
SCANNED_ROOT_FILES = ("README.md", "HACKING.md", "Makefile", "pyproject.toml")
TEXT_SUFFIXES = frozenset(
    {
        ".py",
        ".md",
        ".toml",
        ".xml",
        ".service",
        ".policy",
        ".json",
        ".sh",
        ".example",
        ".txt",
        ".cfg",
        ".ini",
        ".yml",
        ".yaml",
        ".rules",
    }
)
SKIPPED_DIRS = frozenset({"__pycache__", ".venv", ".git", ".mypy_cache", ".ruff_cache"})

EXPECTED_DOCS = frozenset(
    {"architecture", "bus-api", "http-contract", "invariants", "placement-rules"}
)

_SECTION = r"§(\d+(?:\.\d+)*)"
CITATION = re.compile(r"docs/(?P<name>[A-Za-z0-9_-]+)\.md(?=(?P<rest>[^\n]*))")
FIRST_SECTION = re.compile(r"[ \t]+" + _SECTION)
MORE_SECTIONS = re.compile(r"[ \t]*(?:,|and)[ \t]*" + _SECTION)
QUOTED_HEADING = re.compile(r'(?:[ \t]+|[ \t]*[,(:][ \t]*)\\?"(?P<heading>[^"\\\n]+)\\?"')
INVARIANTS = re.compile(
    r"[ \t]*[,(]?[ \t]*invariants?[ \t]+(?P<first>\d+)(?P<more>(?:[ \t]*(?:,|and)[ \t]*\d+)*)"
)
HEADING = re.compile(r"^#{1,6}[ \t]+(?P<text>.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
HEADING_SECTION = re.compile(r"^" + _SECTION + r"(?:[ \t]+(?P<title>.*))?$")
HEADING_INVARIANT = re.compile(r"^Invariant (\d+)\b")

# The outside names are spelled from pieces, so that a grep of the repository for them
# (the check this test automates) finds real citations only, never this file.
_NOTES = "DES" + "IGN"
_WIRE = "CON" + "TRACT"
_SPEC = "sp" + "ec"
_SPEC_FILE = "operator-model" + "-placement"
_SHARED = "sha" + "red"

OUTSIDE_NAMES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("the design notes by file name", re.compile(rf"\b{_NOTES}\.md\b")),
    ("the design notes by section", re.compile(rf"\b{_NOTES}\b")),
    ("the wire contract by file name", re.compile(rf"\b{_WIRE}\.md\b")),
    ("the wire contract by section", re.compile(rf"\b{_WIRE}[ \t]*§")),
    ("the source specification by file name", re.compile(_SPEC_FILE)),
    ("the source specification by section", re.compile(rf"\b[Ss]{_SPEC[1:]}(?:'s)?[ \t]+§")),
    ("the source specification", re.compile(rf"\bthe {_SPEC}(?:'s)?\b")),
    (
        "a path outside the repository",
        re.compile(rf"\.\./{_SHARED}\b|\b{_SHARED}/(?:{_SPEC}|{_NOTES}|{_WIRE})"),
    ),
)


@dataclass(frozen=True)
class Citation:
    """One ``docs/<name>.md`` citation, where it was found and what it names."""

    where: str
    name: str
    sections: tuple[str, ...] = ()
    heading: str | None = None
    invariants: tuple[int, ...] = ()

    @property
    def path(self) -> Path:
        return DOCS / f"{self.name}.md"


@dataclass(frozen=True)
class DocHeadings:
    """What a document offers to be cited: its ``§`` numbers, heading texts, invariants."""

    sections: frozenset[str]
    texts: frozenset[str]
    invariants: frozenset[int]


# --------------------------------------------------------------------------- the scanner


def citations_in(text: str, where: str) -> list[Citation]:
    """Every ``docs/<name>.md`` citation in ``text`` (``where`` names the file for messages)."""
    found: list[Citation] = []
    for match in CITATION.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        rest = match.group("rest")
        sections: list[str] = []
        first = FIRST_SECTION.match(rest)
        if first is not None:
            sections.append(first.group(1))
            rest = rest[first.end() :]
            more = MORE_SECTIONS.match(rest)
            while more is not None:
                sections.append(more.group(1))
                rest = rest[more.end() :]
                more = MORE_SECTIONS.match(rest)
        quoted = QUOTED_HEADING.match(rest)
        invariants = INVARIANTS.match(rest)
        numbers: tuple[int, ...] = ()
        if invariants is not None:
            extra = re.findall(r"\d+", invariants.group("more"))
            numbers = (int(invariants.group("first")), *(int(n) for n in extra))
        found.append(
            Citation(
                where=f"{where}:{line}",
                name=match.group("name"),
                sections=tuple(sections),
                heading=quoted.group("heading") if quoted is not None else None,
                invariants=numbers,
            )
        )
    return found


def headings_of(text: str) -> DocHeadings:
    """The ``§`` numbers, heading texts (with and without their number) and invariants."""
    sections: set[str] = set()
    texts: set[str] = set()
    invariants: set[int] = set()
    for match in HEADING.finditer(text):
        heading = match.group("text").strip()
        texts.add(heading)
        numbered = HEADING_SECTION.match(heading)
        if numbered is not None:
            sections.add(numbered.group(1))
            if numbered.group("title"):
                texts.add(numbered.group("title").strip())
        invariant = HEADING_INVARIANT.match(heading)
        if invariant is not None:
            invariants.add(int(invariant.group(1)))
    return DocHeadings(frozenset(sections), frozenset(texts), frozenset(invariants))


def problems_of(citation: Citation, docs: dict[str, DocHeadings]) -> list[str]:
    """What does not resolve in one citation; empty when all of it does."""
    target = docs.get(citation.name)
    if target is None:
        return [f"{citation.where}: docs/{citation.name}.md does not exist"]
    problems = [
        f"{citation.where}: docs/{citation.name}.md has no heading for §{section}"
        for section in citation.sections
        if section not in target.sections
    ]
    if citation.heading is not None and citation.heading not in target.texts:
        problems.append(
            f'{citation.where}: docs/{citation.name}.md has no heading "{citation.heading}"'
        )
    problems.extend(
        f"{citation.where}: docs/{citation.name}.md has no heading for invariant {number}"
        for number in citation.invariants
        if number not in target.invariants
    )
    return problems


def outside_names_in(text: str, where: str) -> list[str]:
    """Each place ``text`` cites a source document by its outside name."""
    found: list[str] = []
    for what, pattern in OUTSIDE_NAMES:
        for match in pattern.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{where}:{line}: cites {what} ({match.group(0)!r})")
    return found


# --------------------------------------------------------------------------- the repository


def scanned_files() -> Iterator[Path]:
    """The repository's code and text files (this test excepted: it names what it forbids)."""
    for name in SCANNED_ROOT_FILES:
        path = ROOT / name
        if path.is_file():
            yield path
    for top in SCANNED_DIRS:
        base = ROOT / top
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            relative = path.relative_to(ROOT)
            if any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in relative.parts):
                continue
            if not path.is_file() or path.resolve() == THIS_FILE:
                continue
            if path.suffix in TEXT_SUFFIXES or path.name == "Makefile":
                yield path


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def repository_texts() -> list[tuple[str, str]]:
    texts: list[tuple[str, str]] = []
    for path in scanned_files():
        text = read_text(path)
        if text is not None:
            texts.append((str(path.relative_to(ROOT)), text))
    return texts


def repository_docs() -> dict[str, DocHeadings]:
    return {path.stem: headings_of(path.read_text(encoding="utf-8")) for path in DOCS.glob("*.md")}


# --------------------------------------------------------------------------- the scanner, proven

SAMPLE_DOC = """\
# Rules

## §4.1 Model registry

### §4.1.1 What a measurement records

## §4.3 Admission

### Per-target concurrency

## §9 Decisions

### §9.1 Registry location

## Invariant 2: Publication
"""


def test_scanner_reads_sections_headings_and_invariants() -> None:
    text = (
        "a (docs/rules.md §4.1, §9.1) b\n"
        'c docs/rules.md §4.3 ("Per-target concurrency")\n'
        'd (docs/rules.md, "Model registry")\n'
        "e (docs/rules.md, invariants 2 and 5)\n"
        "f the docs/rules.md §4.1.1 step 4 g\n"
    )
    found = citations_in(text, "sample")
    assert [(c.where, c.sections, c.heading, c.invariants) for c in found] == [
        ("sample:1", ("4.1", "9.1"), None, ()),
        ("sample:2", ("4.3",), "Per-target concurrency", ()),
        ("sample:3", (), "Model registry", ()),
        ("sample:4", (), None, (2, 5)),
        ("sample:5", ("4.1.1",), None, ()),
    ]


def test_scanner_does_not_take_an_enclosing_quote_for_a_heading() -> None:
    found = citations_in('cite "docs/rules.md §4.3", "docs/rules.md (invariant 2)"', "s")
    assert [(c.sections, c.heading, c.invariants) for c in found] == [
        (("4.3",), None, ()),
        ((), None, (2,)),
    ]


def test_scanner_finds_what_does_not_resolve() -> None:
    docs = {"rules": headings_of(SAMPLE_DOC)}
    text = (
        'ok docs/rules.md §4.1, §9.1 and §4.3 ("Per-target concurrency")\n'
        'ok docs/rules.md ("Admission") and (docs/rules.md, invariant 2)\n'
        "bad docs/rules.md §4.2\n"
        'bad docs/rules.md ("Nowhere")\n'
        "bad (docs/rules.md, invariant 7)\n"
        "bad docs/other.md §1\n"
    )
    problems = [p for c in citations_in(text, "s") for p in problems_of(c, docs)]
    assert problems == [
        "s:3: docs/rules.md has no heading for §4.2",
        's:4: docs/rules.md has no heading "Nowhere"',
        "s:5: docs/rules.md has no heading for invariant 7",
        "s:6: docs/other.md does not exist",
    ]


def test_outside_names_are_found() -> None:
    text = (
        f"see {_NOTES}.md §6\n"
        f"the {_WIRE} §1 body\n"
        f"per {_SPEC} §4.3\n"
        f"as the {_SPEC} says\n"
        f"in ../{_SHARED}/{_SPEC}/x.md\n"
        f"{_WIRE} = Path('dbus/org.uap.Placement1.xml')\n"
        "a spectrum, the spectator, respect §4\n"
    )
    lines = [problem.split(":")[1] for problem in outside_names_in(text, "s")]
    assert sorted(set(lines)) == ["1", "2", "3", "4", "5"]


# --------------------------------------------------------------------------- the repository


def test_the_documents_exist() -> None:
    present = {path.stem for path in DOCS.glob("*.md")}
    assert present >= EXPECTED_DOCS, f"missing: {sorted(EXPECTED_DOCS - present)}"


def test_every_citation_resolves() -> None:
    docs = repository_docs()
    citations = [c for where, text in repository_texts() for c in citations_in(text, where)]
    assert len(citations) > 100, "the scanner found almost no citations: is it still working?"
    problems = [problem for citation in citations for problem in problems_of(citation, docs)]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("name", sorted(EXPECTED_DOCS))
def test_every_document_is_cited(name: str) -> None:
    cited = {c.name for where, text in repository_texts() for c in citations_in(text, where)}
    assert name in cited, f"docs/{name}.md is cited nowhere"


def test_nothing_cites_the_source_documents_by_their_outside_names() -> None:
    problems = [p for where, text in repository_texts() for p in outside_names_in(text, where)]
    assert problems == [], "\n".join(problems)
