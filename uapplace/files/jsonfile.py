"""JSON files read and written safely: size and nesting caps, finite numbers, atomic replace.

Every file uapplace reads (the repo and machine-local registries, the capacity and
auto policies, the enforcement timeouts file, the ledger, the simulated GPU state)
goes through :func:`read_json` (or :func:`read_capped` + :func:`parse_json`), so a
hostile or broken file is a named :class:`ConfigFileError` (file, JSON path, reason),
never a traceback:

- **Size.** At most :data:`CONFIG_MAX_BYTES` (4 MiB) for a configuration file and
  :data:`LEDGER_MAX_BYTES` (16 MiB) for the ledger. The ledger holds at most
  1,024 pending entries (:mod:`uapplace.core.admission`) with ids cut to a few hundred
  characters; a full one is about 2 MiB, so 16 MiB is far beyond anything uapplaced
  writes and still cheap to read. The file is read through an ``O_NONBLOCK`` descriptor
  that must be a regular file (a FIFO, a directory or ``/dev/zero`` is refused) and
  never more than cap + 1 bytes are read.
- **Nesting.** At most :data:`MAX_DEPTH` (64) levels of arrays and objects; no file of
  ours needs more than 8. Python's C decoder guards its own recursion and raises
  ``RecursionError`` past roughly 1,000 levels: that is caught here (it is the check
  "before" our models ever see the data), and an iterative walk of the parsed value
  then enforces 64 and names the JSON path where it was exceeded. A string-aware byte
  pre-scan was not used: written in Python it costs about a microsecond per token,
  seconds for a 16 MiB ledger, with the GIL held against the loop that answers Admit.
- **Numbers.** ``NaN``, ``Infinity`` and ``-Infinity`` literals, and numbers that
  overflow a float (``1e999``), are refused by default with the path of the first one
  (``allow_non_finite=True`` keeps them as floats for a caller, the ledger, that
  checks item by item and drops only the bad item). Integers past Python's 4,300
  digit limit are refused too.
- **Duplicate keys** in one object are refused (in a hand-edited file the second one
  is a typo that would otherwise silently win).
- **Owner and mode** (``trusted=True``: the registries, the capacity, auto and timeouts
  policies, the ledger, the enforcement journal; docs/placement-rules.md §4.7). A file
  uapplaced takes orders from must be owned by the user it runs as (or root) and not
  writable by group or others, as
  ``ssh`` requires of ``authorized_keys``: anyone else who can write it could make
  uapplaced stop models. Such a file is refused whole, :class:`UntrustedFile` naming the
  file, its owner and its mode; it is checked on the descriptor that is read, so a
  rename between the check and the read cannot slip another file in.

:func:`loads_text` applies the same depth, number and duplicate-key rules to JSON that
arrives over the bus (``SetAutoPolicy``), raising :class:`JsonTextError` with the path.

Writing: :func:`atomic_write` (tmp + fsync + rename + fsync of the directory; every
file uapplace replaces goes through it) and
:func:`dumps`, which never emits a bare ``NaN``: a non-finite number becomes ``null``
and is logged with its path (one bad figure must not stop every ledger write).
:func:`move_aside` renames a broken file to ``<name>.corrupt-<UTC stamp>[.n]``, never
overwriting an earlier one. :func:`exclusive_lock` is the advisory ``flock`` with a
timeout that the read-modify-write of the ledger and the simulated GPU state hold.

Everything here blocks on file I/O: the daemon calls it in a thread.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import pwd
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MAX_DEPTH = 64
"""Arrays and objects nested deeper than this are refused in every file."""
CONFIG_MAX_BYTES = 4 * 1024 * 1024
"""Registries, policies, the timeouts file, the simulated GPU state."""
LEDGER_MAX_BYTES = 16 * 1024 * 1024
"""``placement.json``: bounded state keeps it near 2 MiB at worst (see the module docstring)."""

_KEY_SHOWN = 40

log = logging.getLogger(__name__)


TRUSTED_WRITE_BITS = 0o022
"""Group- or other-writable: refused on a trusted file (``ssh``'s ``StrictModes`` rule)."""


class ConfigFileError(Exception):
    """A configuration file is unreadable or says something invalid.

    ``str()`` is ``"<file>: <json_path>: <message>"``, e.g.
    ``config/model-registry.json: $.models.qwen3.8-27b.configs.llama-mtp.resident_gpu_mib:
    Input should be a valid number``.
    """

    def __init__(
        self,
        file: Path,
        json_path: str,
        message: str,
        others: tuple[ConfigFileError, ...] = (),
    ) -> None:
        super().__init__(f"{file}: {json_path}: {message}")
        self.file = file
        self.json_path = json_path
        self.message = message
        self.others = others
        """Further problems found in the same pass (a file rarely has only one typo)."""

    def every(self) -> tuple[ConfigFileError, ...]:
        """This error followed by :attr:`others`."""
        return (self, *self.others)


class UntrustedFile(ConfigFileError):
    """A file uapplaced trusts is owned by another user or writable by group or others
    (docs/placement-rules.md §4.7): refused whole, like a file that does not parse."""

    def __init__(self, file: Path, owner: int, mode: int) -> None:
        self.owner = owner
        self.mode = mode
        super().__init__(file, "$", untrusted_reason(owner, mode))


def trusted_owners() -> frozenset[int]:
    """Who may own a trusted file: the user uapplaced runs as, and root."""
    return frozenset({os.geteuid(), 0})


def untrusted_reason(owner: int, mode: int) -> str:
    """Why a file with this owner and mode is refused (the fix included)."""
    problems = []
    if owner not in trusted_owners():
        problems.append(f"it is owned by {_user_text(owner)}, not by {_user_text(os.geteuid())}")
    if mode & TRUSTED_WRITE_BITS:
        who = " and ".join(w for bit, w in ((0o020, "group"), (0o002, "others")) if mode & bit)
        problems.append(f"mode {mode:04o} lets {who} write it")
    return (
        f"refused: {'; '.join(problems)} (owner uid {owner}, mode {mode:04o}). A file "
        f"uapplaced takes orders from must be owned by {_user_text(os.geteuid())} or root and "
        "writable by no one else (as ssh requires): check who wrote it, then chown it and "
        "chmod go-w it"
    )


def _user_text(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def is_trusted(info: os.stat_result) -> bool:
    return info.st_uid in trusted_owners() and not info.st_mode & TRUSTED_WRITE_BITS


def check_trusted(path: Path) -> None:
    """Raise :class:`UntrustedFile` for an existing ``path`` that is not trusted (a missing
    file is not an error here)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigFileError(path, "$", f"cannot read: {exc.strerror or exc}") from None
    if not is_trusted(info):
        raise UntrustedFile(path, info.st_uid, stat.S_IMODE(info.st_mode))


# --------------------------------------------------------------------------- reading


def read_capped(path: Path, max_bytes: int = CONFIG_MAX_BYTES, *, trusted: bool = False) -> bytes:
    """The file's bytes, refusing a file over ``max_bytes`` or one that is not a regular file.

    Raises :class:`ConfigFileError` (``file not found`` for a missing file: callers
    that treat a missing file as normal test for it first or catch
    :class:`FileNotFoundError` via :func:`read_capped_or_none`).
    """
    raw = read_capped_or_none(path, max_bytes, trusted=trusted)
    if raw is None:
        raise ConfigFileError(path, "$", "file not found")
    return raw


def read_capped_or_none(
    path: Path, max_bytes: int = CONFIG_MAX_BYTES, *, trusted: bool = False
) -> bytes | None:
    """Like :func:`read_capped`, but ``None`` for a file that does not exist.

    With ``trusted``, a file owned by another user or writable by group or others is
    :class:`UntrustedFile` (checked on the descriptor that is then read)."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigFileError(path, "$", f"cannot read: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigFileError(path, "$", "not a regular file")
        if trusted and not is_trusted(info):
            raise UntrustedFile(path, info.st_uid, stat.S_IMODE(info.st_mode))
        if info.st_size > max_bytes:
            raise ConfigFileError(path, "$", _too_large(info.st_size, max_bytes))
        with os.fdopen(fd, "rb", closefd=False) as handle:
            raw = handle.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigFileError(path, "$", f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) > max_bytes:  # it grew between fstat and read
        raise ConfigFileError(path, "$", _too_large(len(raw), max_bytes))
    return raw


def _too_large(size: int, max_bytes: int) -> str:
    return f"file is {size:,} bytes, over the {_size_text(max_bytes)} limit for this file"


def _size_text(count: int) -> str:
    mib = count / (1024 * 1024)
    return f"{mib:g} MiB" if mib >= 1 else f"{count:,} bytes"


def read_json(
    path: Path,
    *,
    max_bytes: int = CONFIG_MAX_BYTES,
    max_depth: int = MAX_DEPTH,
    allow_non_finite: bool = False,
    trusted: bool = False,
) -> Any:
    """Read and parse a JSON file; every failure is a :class:`ConfigFileError` naming it."""
    raw = read_capped(path, max_bytes, trusted=trusted)
    return parse_json(raw, path, max_depth=max_depth, allow_non_finite=allow_non_finite)


def parse_json(
    raw: bytes | str,
    file: Path,
    *,
    max_depth: int = MAX_DEPTH,
    allow_non_finite: bool = False,
    item_checks: bool = False,
) -> Any:
    """Parse ``raw`` (UTF-8) under the depth, number and duplicate-key rules.

    Raises :class:`ConfigFileError` with ``file``, the JSON path and the reason.
    With ``item_checks`` the caller runs :func:`first_problem` on each item itself (to
    drop a bad item alone): refused literals and duplicate keys are left as markers
    that fail any schema, and only nesting past the decoder's own guard is refused here.
    """
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigFileError(file, "$", f"not UTF-8 text: {exc}") from None
    else:
        text = raw
    try:
        value = json.loads(
            text,
            object_pairs_hook=_pairs,
            parse_constant=_constant if not allow_non_finite else float,
            parse_float=_float if not allow_non_finite else float,
        )
    except RecursionError:
        raise ConfigFileError(file, "$", _too_deep(max_depth)) from None
    except json.JSONDecodeError as exc:
        raise ConfigFileError(
            file, "$", f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except ValueError as exc:  # an integer past Python's digit limit
        raise ConfigFileError(file, "$", f"invalid JSON number: {exc}") from None
    problem = None if item_checks else first_problem(value, max_depth, not allow_non_finite)
    if problem is not None:
        where, reason = problem
        raise ConfigFileError(file, where, reason)
    return value


class JsonTextError(ValueError):
    """JSON text (not a file: a bus argument) that :func:`loads_text` refuses.

    ``str()`` is ``"<json_path>: <message>"``."""

    def __init__(self, json_path: str, message: str) -> None:
        super().__init__(f"{json_path}: {message}")
        self.json_path = json_path
        self.message = message


def loads_text(text: str, *, max_chars: int, max_depth: int = MAX_DEPTH) -> Any:
    """``text`` parsed under the rules files get (depth, finite numbers, Python's integer
    digit limit, duplicate keys) and a size cap; :class:`JsonTextError` otherwise."""
    if len(text) > max_chars:
        raise JsonTextError("$", f"{len(text):,} characters, over the {max_chars:,} limit")
    try:
        return parse_json(text, Path("(text)"), max_depth=max_depth)
    except ConfigFileError as err:
        raise JsonTextError(err.json_path, err.message) from None


def _too_deep(max_depth: int) -> str:
    return f"nested deeper than {max_depth} levels of arrays and objects"


class _Marker:
    """Stands where the parser met something refused; :func:`first_problem` names its path."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<refused: {self.reason}>"


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any] | _Marker:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            return _Marker(f"duplicate key {_shown_key(key)!r} in one JSON object")
        out[key] = value
    return out


def _constant(text: str) -> _Marker:
    return _Marker(f"{text} is not a finite number")


def _float(text: str) -> float | _Marker:
    number = float(text)
    if not math.isfinite(number):
        return _Marker(f"{_shown_key(text)} is not a finite number (it overflows a float)")
    return number


def first_problem(
    value: Any, max_depth: int = MAX_DEPTH, finite: bool = True
) -> tuple[str, str] | None:
    """``(json_path, reason)`` of the first refused thing in ``value``, or ``None``.

    Refused: nesting deeper than ``max_depth``, a non-finite float (with ``finite``),
    and the markers :func:`parse_json` leaves for refused literals and duplicate keys.
    Iterative, so it works on values nested arbitrarily deep.
    """
    for path, item, depth in _walk(value):
        if isinstance(item, _Marker):
            return path_text(path), item.reason
        if finite and isinstance(item, float) and not math.isfinite(item):
            return path_text(path), f"{item!r} is not a finite number"
        if depth > max_depth and isinstance(item, dict | list):
            return path_text(path), _too_deep(max_depth)
    return None


def non_finite_path(value: Any) -> str | None:
    """The JSON path of the first non-finite float in ``value`` (no depth limit), or ``None``."""
    for path, item, _depth in _walk(value):
        if isinstance(item, float) and not math.isfinite(item):
            return path_text(path)
    return None


def _walk(value: Any) -> Iterator[tuple[tuple[str | int, ...], Any, int]]:
    """Every node depth-first: ``(path, node, depth)``; a container at the top is depth 1."""
    stack: list[tuple[tuple[str | int, ...], Any, int]] = [((), value, 1)]
    while stack:
        path, item, depth = stack.pop()
        yield path, item, depth
        if isinstance(item, dict):
            children = [((*path, k), v, depth + 1) for k, v in item.items()]
        elif isinstance(item, list):
            children = [((*path, i), v, depth + 1) for i, v in enumerate(item)]
        else:
            continue
        stack.extend(reversed(children))


def path_text(parts: tuple[str | int, ...]) -> str:
    """``("models", "m", "configs", 0)`` → ``$.models.m.configs[0]``; odd keys are quoted."""
    out = "$"
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part and all(c.isalnum() or c in "_-." for c in part) and len(part) <= _KEY_SHOWN:
            out += f".{part}"
        else:
            out += f"[{json.dumps(_shown_key(part), ensure_ascii=False)}]"
    return out


def _shown_key(key: str) -> str:
    return key if len(key) <= _KEY_SHOWN else key[:_KEY_SHOWN] + "…"


# --------------------------------------------------------------------------- locking


class LockTimeout(TimeoutError):
    """The advisory lock stayed held by someone else for the whole timeout."""

    def __init__(self, lock_path: Path, timeout: float) -> None:
        super().__init__(
            f"timed out after {timeout:g}s waiting for the lock {lock_path} "
            "(another process holds it)"
        )
        self.lock_path = lock_path
        self.timeout = timeout


@contextmanager
def exclusive_lock(
    lock_path: Path, timeout: float, error: type[LockTimeout] = LockTimeout
) -> Iterator[None]:
    """Hold ``fcntl.flock(LOCK_EX)`` on ``lock_path`` (created 0600), or raise ``error``.

    flock cannot wait with a timeout, so this polls with a short backoff.
    """
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise error(lock_path, timeout) from None
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.01)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


# --------------------------------------------------------------------------- writing


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` that never writes a bare ``NaN``/``Infinity``.

    A non-finite float is written as ``null`` and logged with its path: refusing the
    whole document would stop every later ledger write over one bad figure.
    """
    try:
        return json.dumps(value, allow_nan=False, **kwargs)
    except ValueError:
        where = non_finite_path(value) or "$"
        log.error("writing JSON: %s is not a finite number; written as null", where)
        return json.dumps(finite_copy(value), allow_nan=False, **kwargs)


def finite_copy(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (recursive on dicts, lists)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_copy(v) for v in value]
    return value


def atomic_write(path: Path, text: str, mode: int = 0o600, sync: bool = True) -> None:
    """Replace ``path`` with ``text`` so that a reader sees the old or the new file, whole.

    The one atomic write of the program (the ledger, the journal, the auto policy, the
    simulated GPU, the local registry, the unit drop-ins, the installed unit files).
    Writes a temporary file of its own (``.<name>.<random>.tmp`` beside ``path``, so two
    writers never share one) with permission bits ``mode``; with ``sync``, fsyncs it
    before the rename and the directory after, so a crash leaves one of the two versions
    on disk too. A failure removes the temporary file and raises the ``OSError``.
    """
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), mode)
            out.write(text)
            out.flush()
            if sync:
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync:
        fsync_directory(path.parent)


def mode_of(path: Path, default: int) -> int:
    """``path``'s permission bits, or ``default`` when it does not exist (a rewrite keeps
    the mode an operator gave the file)."""
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        return default


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def move_aside(path: Path, target: Path | None = None) -> Path:
    """Rename a broken file out of the way, durably (the directory is fsynced); returns
    where it went.

    By default to ``<name>.corrupt-<UTC stamp>`` (``.1``, ``.2`` … if taken): the
    evidence is kept for the operator, never overwritten and never deleted here (the
    ledger keeps its newest three: :func:`uapplace.files.ledger.prune_corrupt_copies`). A caller
    with a fixed place for it (the enforcement journal's ``….broken``) names ``target``,
    which is replaced.
    """
    if target is None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        target = path.with_name(f"{path.name}.corrupt-{stamp}")
        serial = 1
        while target.exists():
            target = path.with_name(f"{path.name}.corrupt-{stamp}.{serial}")
            serial += 1
    os.replace(path, target)
    fsync_directory(path.parent)
    return target
