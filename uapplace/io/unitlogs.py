"""A unit's own last lines: what its engine wrote, read from the journal or its log file.

docs/placement-rules.md §4.6 ("Failed start"). A llama-server that cannot load its model
says why on stderr (``failed to load model``, ``couldn't bind HTTP server socket``) and
exits; systemd only says ``failed (result exit-code)``. So when a run's new unit fails,
its step detail, the run's error, the alerts and the notification carry the unit's last
lines (:func:`with_last_lines`), and ``uapplace logs MODEL`` prints them (:func:`last_lines`,
:func:`follow`).

Where the lines are comes from the user manager (:class:`~uapplace.io.units.LogFacts`,
read with the unit's state): it names the *kind* of ``StandardError=`` and
``StandardOutput=`` (``journal``, ``append``, ``file``, ``truncate``, ``inherit`` …) but
never the file, so a file's path is read from the unit file and its drop-ins, the last
assignment winning, as systemd applies them (:func:`log_places`). Looked at in order:

1. the file stderr goes to (``StandardError=append:|file:|truncate:PATH``, or stdout's
   with ``StandardError=inherit``): its last lines; a file is not split by run;
2. the user journal, when stderr or stdout goes there: ``journalctl --user -u UNIT
   _SYSTEMD_INVOCATION_ID=<the latest run> -n N -o cat --no-pager -q``, so an earlier
   run's lines are never mixed in (a journal that does not record the invocation:
   ``--since`` that run's start instead);
3. the file stdout goes to, when it is another one;

else ``no log available (no journal, no log file)``, with what was tried. Bounded: at
most N lines (:data:`MAX_LINES`), each cut to :data:`MAX_LINE_CHARS` and stripped of
escape sequences and control characters (:func:`uapplace.core.textsafe.printable`); a
bounded window of a file and of ``journalctl``'s output is read. Never blocks the loop:
files are read in a thread, ``journalctl`` runs as an argument list (never a shell) in
an asyncio subprocess with a timeout, and is killed (by its own PID) when it outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from pathlib import Path

# Re-exported: it splits what LogTail.appended_to makes; it lives in core so that the
# light CLI (issue 23) reads a failed step's detail without importing pystemd.
from uapplace.core.steps import split_last_lines as split_last_lines
from uapplace.core.textsafe import printable
from uapplace.io.units import LogFacts, UnitState, unit_name

DEFAULT_LINES = 10
"""Lines a failed start's step detail, error and alert carry."""
MAX_LINES = 1000
"""The most lines one read returns (``uapplace logs --lines``)."""
MAX_LINE_CHARS = 300
"""A longer line is cut here (and ends in ``…``)."""
JOURNAL_TIMEOUT_S = 3.0
"""How long one ``journalctl`` may take before it is killed."""
READ_BUDGET_S = 8.0
"""The most a failed run waits for its unit's lines, all sources together."""
FOLLOW_POLL_S = 0.25
"""How often a followed log file is looked at."""
BLOCK_INDENT = "    | "
"""How each of the lines starts, below the line of text they belong to."""
NO_JOURNAL = "no journal"
NO_FILE = "no log file"

_JOURNAL_KINDS = frozenset(
    {"journal", "journal+console", "kmsg", "kmsg+console", "syslog", "syslog+console"}
)
"""Output kinds that end in the journal."""
_FILE_KINDS = frozenset({"file", "append", "truncate"})
_FILE_SETTINGS = {"stdout": "StandardOutput", "stderr": "StandardError"}
_UNIT_FILE_MAX_BYTES = 1 << 20
_WINDOW_PER_LINE = 4096
"""Bytes of a file's end read per line asked (long lines are cut anyway)."""
_WINDOW_MIN = 64 << 10
_WINDOW_MAX = 8 << 20


def journalctl_path() -> str | None:
    """The ``journalctl`` on ``PATH``, or ``None``."""
    return shutil.which("journalctl")


def clean_line(raw: str) -> str:
    """One line as it may be shown: no escapes or control characters, at most
    :data:`MAX_LINE_CHARS`, no surrounding blanks."""
    line = printable(raw).strip()
    if len(line) > MAX_LINE_CHARS:
        return line[: MAX_LINE_CHARS - 1] + "…"
    return line


def clean_lines(raw: Sequence[str], n: int) -> tuple[str, ...]:
    """The last ``n`` non-empty lines of ``raw``, each :func:`clean_line`."""
    kept = [line for line in (clean_line(r) for r in raw) if line]
    return tuple(kept[-n:]) if n > 0 else ()


# --------------------------------------------------------------------------- where it writes


@dataclass(frozen=True)
class LogPlaces:
    """Where a unit writes, from its :class:`~uapplace.io.units.LogFacts` and unit files."""

    stderr_file: Path | None
    stdout_file: Path | None
    journal: bool
    """stderr or stdout goes to the journal."""
    problems: tuple[str, ...] = ()
    """Why a file a kind names could not be found (an unreadable unit file, a specifier)."""


def log_places(unit: str, facts: LogFacts) -> LogPlaces:
    """Work out where ``unit`` writes (reads its unit files: call it in a thread)."""
    settings, problems = _output_settings(facts)
    files: dict[str, Path | None] = {}
    for stream, kind in (("stdout", facts.stdout), ("stderr", facts.stderr)):
        files[stream] = None
        if kind in _FILE_KINDS:
            path, problem = _setting_path(unit, settings.get(_FILE_SETTINGS[stream], ""), stream)
            files[stream] = path
            if problem:
                problems.append(problem)
    stderr_kind = facts.stderr
    stderr_file = files["stderr"]
    if stderr_kind == "inherit":  # stderr goes where stdout goes
        stderr_kind, stderr_file = facts.stdout, files["stdout"]
    journal = stderr_kind in _JOURNAL_KINDS or facts.stdout in _JOURNAL_KINDS
    return LogPlaces(stderr_file, files["stdout"], journal, tuple(problems))


def _output_settings(facts: LogFacts) -> tuple[dict[str, str], list[str]]:
    """``StandardOutput=``/``StandardError=`` as the unit files set them (last one wins)."""
    settings: dict[str, str] = {}
    problems: list[str] = []
    for name in (facts.fragment_path, *facts.dropin_paths):
        if not name:
            continue
        try:
            text = _read_small(Path(name))
        except OSError as err:
            problems.append(f"{name} cannot be read: {err.strerror or err}")
            continue
        for key, value in _service_assignments(text):
            if key in _FILE_SETTINGS.values():
                settings[key] = value
    return settings, problems


def _read_small(path: Path) -> str:
    with path.open("rb") as handle:
        return handle.read(_UNIT_FILE_MAX_BYTES).decode("utf-8", "replace")


def _service_assignments(text: str) -> list[tuple[str, str]]:
    """``(key, value)`` of every assignment in the ``[Service]`` sections of a unit file."""
    found: list[tuple[str, str]] = []
    section = ""
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):  # a continuation line
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            continue
        if section == "Service" and "=" in line:
            key, value = line.split("=", 1)
            found.append((key.strip(), value.strip()))
    return found


def _setting_path(unit: str, value: str, stream: str) -> tuple[Path | None, str]:
    """The file of a ``file:|append:|truncate:PATH`` value, or why there is none."""
    setting = _FILE_SETTINGS[stream]
    kind, sep, raw = value.partition(":")
    if not sep or kind not in _FILE_KINDS or not raw:
        return None, f"{setting}= names no file in the unit files (systemd says it writes one)"
    expanded, problem = _expand_specifiers(raw, unit)
    if expanded is None:
        return None, f"{setting}={value}: {problem}"
    if not expanded.startswith("/"):
        return None, f"{setting}={value}: not an absolute path"
    return Path(expanded), ""


def _expand_specifiers(raw: str, unit: str) -> tuple[str | None, str]:
    """The unit-file specifiers a log path commonly uses; any other is reported."""
    prefix, _, instance_part = unit.removesuffix(".service").partition("@")
    known = {
        "%": "%",
        "n": unit,
        "N": unit.removesuffix(".service"),
        "p": prefix,
        "i": instance_part,
        "h": str(Path.home()),
        "t": os.environ.get("XDG_RUNTIME_DIR", ""),
    }
    out: list[str] = []
    index = 0
    while index < len(raw):
        char = raw[index]
        if char != "%":
            out.append(char)
            index += 1
            continue
        spec = raw[index + 1 : index + 2]
        if spec not in known or (spec == "t" and not known["t"]):
            return None, f"the specifier %{spec} is not one uapplace expands"
        out.append(known[spec])
        index += 2
    return "".join(out), ""


# --------------------------------------------------------------------------- the last lines


@dataclass(frozen=True)
class LogTail:
    """A unit's last lines and where they came from, or why there are none."""

    unit: str
    lines: tuple[str, ...]
    source: str
    """``the journal (this run, invocation 1a2b3c4d…)`` or ``/path/to/file.log``."""
    missing: str = ""
    """Why there are no lines (``no log available (…)``); "" when there are."""

    def header(self) -> str:
        """``last 3 lines of x.service (from …)``, or :attr:`missing`."""
        if not self.lines:
            return self.missing
        noun = "line" if len(self.lines) == 1 else "lines"
        return f"last {len(self.lines)} {noun} of {self.unit} (from {self.source})"

    def block(self) -> str:
        """The lines, each on a line of its own starting :data:`BLOCK_INDENT`."""
        return "".join(f"\n{BLOCK_INDENT}{line}" for line in self.lines)

    def appended_to(self, text: str) -> str:
        """``text; last N lines of …:`` and the lines below it (the one form every surface
        shows); ``text; no log available (…)`` when there are none."""
        if not self.lines:
            return f"{text}; {self.missing}"
        return f"{text}; {self.header()}:{self.block()}"


def block_lines(block: str) -> list[str]:
    """The lines of a block :meth:`LogTail.block` made (for an alert's ``detail``)."""
    return [line.removeprefix(BLOCK_INDENT) for line in block.split("\n") if line]


async def last_lines(
    unit: str, facts: LogFacts, n: int = DEFAULT_LINES, *, journalctl: str | None = None
) -> LogTail:
    """The last ``n`` lines ``unit`` wrote in its latest run (the module doc's order).

    ``journalctl``: the binary (default: the one on ``PATH``). Never raises for a log that
    cannot be read: that is what :attr:`LogTail.missing` says.
    """
    unit = unit_name(unit)
    n = max(1, min(n, MAX_LINES))
    places = await asyncio.to_thread(log_places, unit, facts)
    reasons: list[str] = []
    if places.stderr_file is not None:
        tail = await _file_tail(unit, places.stderr_file, n, reasons)
        if tail is not None:
            return tail
    if places.journal:
        tail = await _journal_tail(unit, facts, n, journalctl or journalctl_path(), reasons)
        if tail is not None:
            return tail
    else:
        reasons.append(NO_JOURNAL)
    if places.stdout_file is not None and places.stdout_file != places.stderr_file:
        tail = await _file_tail(unit, places.stdout_file, n, reasons)
        if tail is not None:
            return tail
    if places.stderr_file is None and places.stdout_file is None:
        reasons.append(NO_FILE)
    reasons.extend(places.problems)
    return LogTail(unit, (), "", f"no log available ({', '.join(reasons)})")


async def with_last_lines(
    text: str, unit: str, state: UnitState | None, n: int = DEFAULT_LINES
) -> str:
    """``text`` with ``unit``'s last lines (:meth:`LogTail.appended_to`), for a step that
    failed because the unit did. Unchanged when nothing is known of where it writes (no
    state, or a unit-tier fake's); never raises, never waits past :data:`READ_BUDGET_S`."""
    if state is None or not state.log_facts.known:
        return text
    try:
        async with asyncio.timeout(READ_BUDGET_S):
            tail = await last_lines(unit, state.log_facts, n)
    except TimeoutError:
        return f"{text}; its last lines were not read within {READ_BUDGET_S:g}s"
    except Exception as err:  # a log that cannot be read must never change the run
        return f"{text}; its last lines could not be read: {type(err).__name__}: {err}"
    return tail.appended_to(text)


async def _file_tail(unit: str, path: Path, n: int, reasons: list[str]) -> LogTail | None:
    try:
        raw = await asyncio.to_thread(_read_file_end, path, _window(n))
    except FileNotFoundError:
        reasons.append(f"{path} does not exist")
        return None
    except OSError as err:
        reasons.append(f"{path} cannot be read: {err.strerror or err}")
        return None
    lines = clean_lines(raw, n)
    if not lines:
        reasons.append(f"{path} is empty")
        return None
    return LogTail(unit, lines, str(path))


def _window(n: int) -> int:
    return max(_WINDOW_MIN, min(_WINDOW_MAX, n * _WINDOW_PER_LINE))


def _read_file_end(path: Path, window: int) -> list[str]:
    """The lines in the last ``window`` bytes of a regular file (never a FIFO or a tty:
    opening one could block)."""
    return _file_end(path, window).lines


@dataclass(frozen=True)
class _FileEnd:
    lines: list[str]
    """The lines in the window (the first dropped when the window cut it)."""
    whole_to: int
    """The offset just after the window's last newline: where whole lines end."""
    inode: int


def _file_end(path: Path, window: int) -> _FileEnd:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        size = handle.seek(0, os.SEEK_END)
        start = max(0, size - window)
        handle.seek(start)
        data = handle.read(window)
    lines = data.decode("utf-8", "replace").split("\n")
    whole_to = start + data.rfind(b"\n") + 1 if b"\n" in data else start
    return _FileEnd(lines[1:] if start > 0 else lines, whole_to, info.st_ino)


async def _journal_tail(
    unit: str, facts: LogFacts, n: int, journalctl: str | None, reasons: list[str]
) -> LogTail | None:
    if journalctl is None:
        reasons.append(f"{NO_JOURNAL} (journalctl not found)")
        return None
    base = [journalctl, "--user", "-u", unit, "-n", str(n), "-o", "cat", "--no-pager", "-q"]
    tries: list[tuple[list[str], str]] = []
    if facts.invocation_id:
        this_run = f"this run, invocation {facts.invocation_id[:8]}"
        tries.append(([*base, f"_SYSTEMD_INVOCATION_ID={facts.invocation_id}"], this_run))
        if facts.started_usec:  # a journal that does not record the invocation
            since = f"@{facts.started_usec / 1e6:.6f}"
            tries.append(([*base, "--since", since], "since this run started"))
    else:
        tries.append((base, "every run"))
    for argv, which in tries:
        try:
            raw = await run_capped(argv, _window(n), JOURNAL_TIMEOUT_S)
        except TimeoutError:
            reasons.append(f"{NO_JOURNAL} (journalctl took over {JOURNAL_TIMEOUT_S:g}s)")
            return None
        except (OSError, JournalError) as err:
            reasons.append(f"{NO_JOURNAL} (journalctl: {err})")
            return None
        lines = clean_lines(raw.decode("utf-8", "replace").split("\n"), n)
        if lines:
            return LogTail(unit, lines, f"the journal ({which})")
    reasons.append(NO_JOURNAL)
    return None


class JournalError(Exception):
    """``journalctl`` ended with an exit status other than 0."""


async def run_capped(argv: Sequence[str], cap: int, timeout_s: float) -> bytes:
    """Run ``argv`` (no shell), return at most ``cap`` bytes of its stdout.

    Killed (by its own PID) when it outlives ``timeout_s`` (``TimeoutError``) or writes
    more than ``cap``; :class:`JournalError` for a non-zero exit status.
    """
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env=_quiet_env(),
    )
    try:
        async with asyncio.timeout(timeout_s):
            assert proc.stdout is not None
            data = await _read_up_to(proc.stdout, cap)
            if len(data) >= cap:
                proc.kill()
            code = await proc.wait()
    finally:
        await _reap(proc)
    if code != 0 and len(data) < cap:
        raise JournalError(f"exit status {code}")
    return data


async def _read_up_to(stream: asyncio.StreamReader, cap: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < cap:
        chunk = await stream.read(min(65536, cap - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """End ``proc`` (ours) if it still runs, and collect it."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def _quiet_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": "", "SYSTEMD_LESS": ""})
    return env


# --------------------------------------------------------------------------- following


class NoLog(Exception):
    """Nothing to follow: the unit writes to no journal and no file (the message says)."""


@dataclass(frozen=True)
class Followed:
    """A log being followed: where from, and its lines as they come."""

    source: str
    """The file, or ``the journal (every run)``."""
    lines: AsyncGenerator[str, None]
    """The last lines, then each new one; close it (``aclose``) to stop following."""


async def follow(
    unit: str,
    facts: LogFacts,
    n: int = DEFAULT_LINES,
    *,
    journalctl: str | None = None,
    poll_s: float = FOLLOW_POLL_S,
) -> Followed:
    """The unit's last ``n`` lines, then every new one as it is written, for as long as the
    caller iterates (every run: a restarted unit goes on). Its stderr's file if it has one
    (followed across truncation and replacement), else the journal (``journalctl -f``),
    else its stdout's file; :class:`NoLog` when there is none of these."""
    unit = unit_name(unit)
    n = max(1, min(n, MAX_LINES))
    places = await asyncio.to_thread(log_places, unit, facts)
    binary = journalctl or journalctl_path()
    if places.stderr_file is not None:
        path = places.stderr_file
        return Followed(str(path), _follow_file(path, n, poll_s))
    if places.journal and binary is not None:
        return Followed("the journal (every run)", _follow_journal(binary, unit, n))
    if places.stdout_file is not None:
        path = places.stdout_file
        return Followed(str(path), _follow_file(path, n, poll_s))
    why = [NO_JOURNAL if binary is not None else f"{NO_JOURNAL} (journalctl not found)"]
    raise NoLog(f"no log available ({', '.join([*why, NO_FILE, *places.problems])})")


async def _follow_journal(journalctl: str, unit: str, n: int) -> AsyncGenerator[str, None]:
    argv = [journalctl, "--user", "-u", unit, "-f", "-n", str(n), "-o", "cat"]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        "--no-pager",
        "-q",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env=_quiet_env(),
    )
    try:
        assert proc.stdout is not None
        splitter = _LineSplitter()
        while True:
            chunk = await proc.stdout.read(65536)
            if not chunk:
                break
            for line in splitter.feed(chunk):
                yield line
    finally:
        await _reap(proc)


async def _follow_file(path: Path, n: int, poll_s: float) -> AsyncGenerator[str, None]:
    try:
        end = await asyncio.to_thread(_file_end, path, _window(n))
    except FileNotFoundError:
        end = _FileEnd([], 0, 0)
    # Whole lines now; a line still being written comes with the rest of it.
    offset, inode = end.whole_to, end.inode
    for line in clean_lines(end.lines[:-1], n):
        yield line
    splitter = _LineSplitter()
    while True:
        await asyncio.sleep(poll_s)
        size, now_inode = await asyncio.to_thread(_size_and_inode, path)
        if now_inode != inode or size < offset:  # replaced or truncated: from its start
            offset, inode = 0, now_inode
            splitter = _LineSplitter()
        if size <= offset:
            continue
        chunk = await asyncio.to_thread(_read_range, path, offset, min(size - offset, 1 << 20))
        offset += len(chunk)
        for line in splitter.feed(chunk):
            yield line


def _size_and_inode(path: Path) -> tuple[int, int]:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return 0, 0
    return (info.st_size, info.st_ino) if stat.S_ISREG(info.st_mode) else (0, 0)


def _read_range(path: Path, offset: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        handle.seek(offset)
        return handle.read(size)


class _LineSplitter:
    """Bytes in, whole cleaned lines out; a partial line waits (bounded) for its end."""

    _MAX_PENDING = 64 << 10

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[str]:
        data = self._pending + chunk
        *whole, self._pending = data.split(b"\n")
        if len(self._pending) > self._MAX_PENDING:  # no end in sight: show what there is
            whole.append(self._pending)
            self._pending = b""
        cleaned = (clean_line(raw.decode("utf-8", "replace")) for raw in whole)
        return [line for line in cleaned if line]
