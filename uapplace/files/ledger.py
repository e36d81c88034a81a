"""The placement ledger, ``~/.uap/placement.json`` (docs/placement-rules.md §4.2).

The ledger records intent; the probe records fact. Every writer goes through
:meth:`Ledger.update`: an exclusive ``fcntl.flock`` on ``placement.json.lock``,
a fresh re-read of the file, the change, then a temporary file + ``fsync`` +
``os.replace`` + ``fsync`` of the directory (:func:`uapplace.files.jsonfile.atomic_write`).
A reader therefore always sees a whole file and needs no lock; a stale view can
never clobber a newer one. The file's schema is :mod:`uapplace.files.ledger_schema`.

A file that is not valid JSON or not the docs/placement-rules.md §4.2 shape is moved aside to
``placement.json.corrupt-<UTC timestamp>`` (never overwritten; only the newest
:data:`KEEP_CORRUPT` such copies are kept, older ones are deleted so a file broken over and
over cannot fill the disk), :attr:`Ledger.last_error` says where it went, and work
continues from an empty document.

A write never makes a file this module would refuse to read back: one whose text is over
:data:`~uapplace.files.jsonfile.LEDGER_MAX_BYTES` is refused whole with
:class:`LedgerTooLarge` and the file on disk stays as it was (issue 20: a ledger that
outgrew the cap was moved aside as corrupt at every write, 2.1 GB of copies).

"The file as a whole" is judged strictly (:class:`LedgerFileError`): over
16 MiB, nested deeper than 64 levels, not JSON, not an object, a wrong ``version``
or ``updated_at`` (:mod:`uapplace.files.jsonfile`), or owned by another user or writable
by group or others (:class:`~uapplace.files.jsonfile.UntrustedFile`: its residents and
pending entries are never restored; the daemon's next write replaces it with its own).
Over :data:`~uapplace.core.admission.MAX_PENDING` pending entries, the ones that expire
first are dropped with one line in :attr:`LedgerDoc.dropped`. Everything below that is
judged item by item: a pending entry with an unknown field, a resident with a NaN ``gpu_mib``, a
device, alert, usage or cooldown that does not validate is dropped alone, logged and
listed in :attr:`LedgerDoc.dropped`; the rest is kept (:func:`doc_from_file_json`).
Numbers that are not finite are refused everywhere; nothing writes a bare ``NaN``.

All calls here block on file I/O and the lock: the daemon runs them in a thread
(``asyncio.to_thread``), never on the loop that answers ``Admit``.

Times in the file are ISO-8601 UTC strings with whole seconds (``model.iso``),
so a time read back is the written one truncated to the second.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from uapplace.core.admission import MAX_PENDING
from uapplace.core.alerts import Alert
from uapplace.core.model import (
    DeviceReading,
    Option,
    PendingEntry,
    Resident,
    holder_json,
    iso,
)
from uapplace.files import jsonfile
from uapplace.files.jsonfile import ConfigFileError, LockTimeout, exclusive_lock
from uapplace.files.ledger_schema import (
    AlertJson,
    DeviceJson,
    IsoSeconds,
    LedgerHeadJson,
    LedgerJson,
    OptionJson,
    PendingJson,
    ResidentJson,
    StrictJson,
    alert_from,
    option_from,
    pending_from,
    reading_from,
    resident_from,
)

T = TypeVar("T")

LEDGER_VERSION = 1
DEFAULT_LOCK_TIMEOUT_S = 5.0
_MAX_ERRORS_SHOWN = 5

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- errors


class LedgerLockTimeout(LockTimeout):
    """The ledger lock stayed held (another uapplaced or uapplace command is writing)."""


def describe_validation_error(err: ValidationError, prefix: Sequence[int | str] = ()) -> str:
    """``residents[0].state: Input should be 'hot', …; usage.m: …`` (at most five).

    ``prefix`` roots the paths when the validated value sits inside a larger document.
    """
    problems = [
        f"{json_path((*prefix, *e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
        for e in err.errors()
    ]
    shown = problems[:_MAX_ERRORS_SHOWN]
    if len(problems) > len(shown):
        shown.append(f"and {len(problems) - len(shown)} more")
    return "; ".join(shown)


def json_path(loc: Sequence[int | str]) -> str:
    """``("residents", 0, "state")`` → ``residents[0].state``; ``()`` → ``(document)``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() or part.replace("-", "").replace(".", "").isalnum():
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out or "(document)"


# --------------------------------------------------------------------------- the document


@dataclass
class LedgerDoc:
    """The whole ledger: mutable, handed to the function given to :meth:`Ledger.update`."""

    version: int = LEDGER_VERSION
    updated_at: float = 0.0
    devices: dict[str, DeviceReading] = field(default_factory=dict)
    residents: list[Resident] = field(default_factory=list)
    pending: list[PendingEntry] = field(default_factory=list)
    usage: dict[str, float] = field(default_factory=dict)
    """Model → POSIX seconds of the last gated forward (docs/placement-rules.md §4.4.2)."""
    cooldowns: dict[str, float] = field(default_factory=dict)
    """Model → POSIX seconds until which auto-load / idle-unload leave it alone."""
    alerts: list[Alert] = field(default_factory=list)
    """Open alerts (:mod:`uapplace.core.alerts`), kept until acknowledged."""
    dropped: list[str] = field(default_factory=list, compare=False)
    """Read from a file: one line per item that was invalid and dropped alone (a pending
    entry, a resident, a device, an alert, a usage or cooldown key, an unknown top-level
    field). Never written."""


class LedgerFormatError(ValueError):
    """JSON that is not the docs/placement-rules.md §4.2 shape; the message names the JSON path."""


class LedgerFileError(ConfigFileError, LedgerFormatError):
    """The ledger file as a whole cannot be used: too large, nested too deep, not JSON,
    not an object, a bad ``version`` or ``updated_at``. The file is moved aside."""


# ----------------------------------------------------------------- to JSON


def reading_to_json(reading: DeviceReading) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": reading.kind.value,
        "total_mib": reading.total_mib,
        "free_mib": reading.free_mib,
        "source": reading.source.value,
        "processes": [
            {"pid": p.pid, "used_mib": p.used_mib, "command": p.command} for p in reading.processes
        ],
    }
    if reading.uuid is not None:
        out["uuid"] = reading.uuid
    if reading.error is not None:
        out["error"] = reading.error
    return out


def resident_to_json(resident: Resident) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": resident.model,
        "config": resident.config,
        "device": resident.device,
        "engine": resident.engine,
        "endpoint": resident.endpoint,
        "unit": resident.unit,
        "state": resident.state.value,
        "gpu_mib": resident.gpu_mib,
        "host_rss_mib": resident.host_rss_mib,
        "holders": [holder_json(h) for h in resident.holders],
        "since": resident.since,
    }
    if resident.main_pid is not None:
        out["main_pid"] = resident.main_pid
    if resident.asleep:
        out["asleep"] = True
    return out


def pending_to_json(entry: PendingEntry) -> dict[str, Any]:
    """The docs/placement-rules.md §4.2 pending entry (ListPending adds ``recommended`` to it)."""
    return {
        "id": entry.id,
        "requested_model": entry.requested_model,
        "client": entry.client,
        "session": entry.session,
        "pid": entry.pid,
        "created_at": iso(entry.created_at),
        "expires_at": iso(entry.expires_at),
        "reason": entry.reason.value,
        "cells": entry.cells,
        "options": [o.to_json() for o in entry.options],
    }


def doc_to_json(doc: LedgerDoc) -> dict[str, Any]:
    """The docs/placement-rules.md §4.2 document."""
    return {
        "version": doc.version,
        "updated_at": iso(doc.updated_at),
        "devices": {key: reading_to_json(r) for key, r in doc.devices.items()},
        "residents": [resident_to_json(r) for r in doc.residents],
        "pending": [pending_to_json(p) for p in doc.pending],
        "usage": {model: iso(ts) for model, ts in doc.usage.items()},
        "cooldowns": {model: iso(ts) for model, ts in doc.cooldowns.items()},
        "alerts": [a.to_json() for a in doc.alerts],
    }


# ----------------------------------------------------------------- from JSON
def _validated(schema: type[StrictJson], data: Any) -> Any:
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise LedgerFormatError(describe_validation_error(err)) from None


def option_from_json(data: Any) -> Option:
    """The inverse of :meth:`Option.to_json`. Raises :class:`LedgerFormatError`."""
    parsed: OptionJson = _validated(OptionJson, data)
    return option_from(parsed)


def pending_from_json(data: Any) -> PendingEntry:
    """The inverse of :func:`pending_to_json`. Raises :class:`LedgerFormatError`."""
    parsed: PendingJson = _validated(PendingJson, data)
    return pending_from(parsed)


def doc_from_json(data: Any) -> LedgerDoc:
    """The inverse of :func:`doc_to_json`. Raises :class:`LedgerFormatError` naming the path."""
    if not isinstance(data, dict):
        raise LedgerFormatError(f"(document): expected a JSON object, got {type(data).__name__}")
    parsed: LedgerJson = _validated(LedgerJson, data)
    return LedgerDoc(
        version=parsed.version,
        updated_at=parsed.updated_at,
        devices={key: reading_from(key, d) for key, d in parsed.devices.items()},
        residents=[resident_from(r) for r in parsed.residents],
        pending=[pending_from(p) for p in parsed.pending],
        usage=dict(parsed.usage),
        cooldowns=dict(parsed.cooldowns),
        alerts=[alert_from(a) for a in parsed.alerts],
    )


_ITEM_SCHEMAS: dict[str, type[StrictJson]] = {
    "devices": DeviceJson,
    "residents": ResidentJson,
    "pending": PendingJson,
    "alerts": AlertJson,
}
_ITEM_NAMES = {
    "devices": "device",
    "residents": "resident",
    "pending": "pending entry",
    "usage": "usage time",
    "cooldowns": "cooldown",
    "alerts": "alert",
}
_ITEM_DEPTH = jsonfile.MAX_DEPTH - 2
"""An item sits two levels down (document → list or map → item)."""


def doc_from_file_json(data: Any, file: Path) -> LedgerDoc:
    """Like :func:`doc_from_json`, but an invalid item is dropped alone, with a line in
    :attr:`LedgerDoc.dropped`.

    A pending entry with an unknown field, a resident with a NaN ``gpu_mib``, a usage
    time that is not a time: each goes, the rest of the ledger stays. Raises
    :class:`LedgerFileError` only when the document itself is unusable (not an object,
    a wrong ``version`` or ``updated_at``).
    """
    if not isinstance(data, dict):
        problem = jsonfile.first_problem(data)
        reason = problem[1] if problem else f"expected a JSON object, got {type(data).__name__}"
        raise LedgerFileError(file, "$", reason)
    try:
        head = LedgerHeadJson.model_validate(
            {k: data[k] for k in ("version", "updated_at") if k in data}
        )
    except ValidationError as err:
        raise LedgerFileError(file, "$", describe_validation_error(err)) from None
    dropped = [
        f"{key}: unknown top-level field, ignored"
        for key in data
        if key not in LedgerJson.model_fields
    ]
    items = {
        name: _valid_items(name, data.get(name), dropped)
        for name in ("devices", "residents", "pending", "usage", "cooldowns", "alerts")
    }
    items["pending"] = _within_pending_cap(items["pending"], dropped)
    return LedgerDoc(
        version=head.version,
        updated_at=head.updated_at,
        devices={key: reading_from(key, d) for key, d in items["devices"]},
        residents=[resident_from(r) for _, r in items["residents"]],
        pending=[pending_from(p) for _, p in items["pending"]],
        usage=dict(items["usage"]),
        cooldowns=dict(items["cooldowns"]),
        alerts=[alert_from(a) for _, a in items["alerts"]],
        dropped=[f"{file}: {line}" for line in dropped],
    )


_ISO_SECONDS: TypeAdapter[float] = TypeAdapter(IsoSeconds)
_IDS_SHOWN = 5


def _within_pending_cap(
    pending: list[tuple[Any, PendingJson]], dropped: list[str]
) -> list[tuple[Any, PendingJson]]:
    """At most :data:`~uapplace.core.admission.MAX_PENDING` entries, the ones that expire
    last (admission keeps no more); the rest dropped with one line that says so."""
    if len(pending) <= MAX_PENDING:
        return pending
    by_expiry = sorted(pending, key=lambda item: item[1].expires_at)
    cut, kept = by_expiry[: len(pending) - MAX_PENDING], by_expiry[len(pending) - MAX_PENDING :]
    ids = ", ".join(str(entry.id) for _, entry in cut[:_IDS_SHOWN])
    more = f" and {len(cut) - _IDS_SHOWN:,} more" if len(cut) > _IDS_SHOWN else ""
    dropped.append(
        f"pending: {len(pending):,} entries, over the {MAX_PENDING:,} uapplaced keeps; kept "
        f"the {MAX_PENDING:,} that expire last and dropped {len(cut):,} ({ids}{more})"
    )
    kept_ids = {id(entry) for _, entry in kept}
    return [item for item in pending if id(item[1]) in kept_ids]


def _valid_items(name: str, raw: Any, dropped: list[str]) -> list[tuple[Any, Any]]:
    """``(key or index, parsed item)`` for each valid item of the list or map ``name``."""
    keyed = name in ("devices", "usage", "cooldowns")
    if raw is None:
        return []
    if not isinstance(raw, dict if keyed else list):
        problem = jsonfile.first_problem(raw)  # a duplicate key leaves a marker, say that
        expected = f"expected {'an object' if keyed else 'a list'}, got {type(raw).__name__}"
        dropped.append(f"{name}: {problem[1] if problem else expected}; ignored whole")
        return []
    pairs = list(raw.items()) if isinstance(raw, dict) else list(enumerate(raw))
    out: list[tuple[Any, Any]] = []
    for key, value in pairs:
        try:
            out.append((key, _valid_item(name, key, value)))
        except LedgerFormatError as err:
            dropped.append(f"{err}; dropped this {_ITEM_NAMES[name]} alone")
    return out


def _valid_item(name: str, key: str | int, value: Any) -> Any:
    problem = jsonfile.first_problem(value, _ITEM_DEPTH)
    if problem is not None:
        inner, reason = problem
        raise LedgerFormatError(f"{json_path((name, key))}{inner.removeprefix('$')}: {reason}")
    schema = _ITEM_SCHEMAS.get(name)
    try:
        if schema is None:
            return _ISO_SECONDS.validate_python(value)
        return schema.model_validate(value)
    except ValidationError as err:
        raise LedgerFormatError(describe_validation_error(err, (name, key))) from None


def parse_ledger_text(raw: bytes, file: Path = Path("placement.json")) -> LedgerDoc:
    """File bytes → document, dropping invalid items alone (see :func:`doc_from_file_json`).

    Raises :class:`LedgerFileError` (a :class:`LedgerFormatError` and a
    :class:`~uapplace.files.jsonfile.ConfigFileError`) for a file that is not JSON, nested
    deeper than 64 levels, or not a usable document. Non-finite numbers and duplicate
    keys are judged item by item (``first_problem`` on each), so they drop one item.
    """
    try:
        data = jsonfile.parse_json(raw, file, item_checks=True)
    except ConfigFileError as err:
        raise LedgerFileError(err.file, err.json_path, err.message) from None
    return doc_from_file_json(data, file)


# --------------------------------------------------------------------------- the file


KEEP_CORRUPT = 3
"""How many ``placement.json.corrupt-*`` copies are kept: the newest, the evidence of the
latest breakage; older ones are deleted."""


class LedgerTooLarge(Exception):
    """A write refused: the new text would be over the cap the ledger is read back with."""

    def __init__(self, path: Path, size: int) -> None:
        cap = jsonfile.LEDGER_MAX_BYTES
        mib, whole = divmod(cap, 1024 * 1024)
        cap_text = f"{mib} MiB" if mib and not whole else f"{cap:,} bytes"
        super().__init__(
            f"{path}: the new ledger would be {size:,} bytes, over the {cap_text} uapplaced "
            "reads back; not written (the file on disk is the last one that fit)"
        )
        self.path = path
        self.size = size


def prune_corrupt_copies(path: Path, keep: int = KEEP_CORRUPT) -> list[Path]:
    """Delete all but the newest ``keep`` ``<name>.corrupt-*`` copies beside ``path``;
    the ones deleted."""
    copies = sorted(path.parent.glob(f"{path.name}.corrupt-*"), key=_corrupt_order)
    gone = copies[: max(len(copies) - keep, 0)]
    for old in gone:
        old.unlink(missing_ok=True)
        log.info("deleted the old ledger copy %s (the newest %d are kept)", old, keep)
    return gone


def _corrupt_order(copy: Path) -> tuple[str, int]:
    """``….corrupt-<stamp>[.n]`` by stamp, then serial (``.10`` after ``.9``)."""
    stamp, _, serial = copy.name.rsplit(".corrupt-", 1)[1].partition(".")
    return stamp, int(serial) if serial.isdigit() else 0


class Ledger:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.last_error: str | None = None
        """The latest problem met (a corrupt file moved aside, and where to); kept until
        the next one, or until the owner sets it back to ``None``."""

    def read(self, lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S) -> LedgerDoc:
        """The current document; an empty one when there is no file yet.

        Takes no lock unless the file is corrupt: then, under the lock, it is moved
        aside (unless a writer fixed it meanwhile) and the empty document returned.
        """
        try:
            return self._load()
        except LedgerFormatError:
            pass
        try:
            with exclusive_lock(self.lock_path, lock_timeout, LedgerLockTimeout):
                return self._load_or_move_aside()
        except LedgerLockTimeout as err:
            self.last_error = f"{self.path} is corrupt and could not be moved aside: {err}"
            log.warning("%s", self.last_error)
            return LedgerDoc()

    def update(
        self, fn: Callable[[LedgerDoc], T], lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S
    ) -> T:
        """Apply ``fn`` to a fresh read of the file under the lock and commit it.

        ``fn`` changes the document in place; its return value is returned. If ``fn``
        raises, nothing is written. Raises :class:`LedgerLockTimeout`.
        """
        self._ensure_directory()
        with exclusive_lock(self.lock_path, lock_timeout, LedgerLockTimeout):
            doc = self._load_or_move_aside()
            result = fn(doc)
            doc.updated_at = time.time()
            text = jsonfile.dumps(doc_to_json(doc), indent=2) + "\n"
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > jsonfile.LEDGER_MAX_BYTES:
                raise LedgerTooLarge(self.path, size)
            jsonfile.atomic_write(self.path, text, mode=0o600, sync=True)
        return result

    # ----------------------------------------------------------------- internals

    def _load(self) -> LedgerDoc:
        """Raises :class:`LedgerFormatError` (a :class:`LedgerFileError` for the file as a
        whole: over :data:`~uapplace.files.jsonfile.LEDGER_MAX_BYTES`, too deep, not JSON)."""
        try:
            raw = jsonfile.read_capped_or_none(self.path, jsonfile.LEDGER_MAX_BYTES, trusted=True)
        except ConfigFileError as err:
            raise LedgerFileError(err.file, err.json_path, err.message) from None
        if raw is None:
            return LedgerDoc()
        doc = parse_ledger_text(raw, self.path)
        for line in doc.dropped:
            log.warning("ledger: %s", line)
        return doc

    def _load_or_move_aside(self) -> LedgerDoc:
        """Caller holds the lock."""
        try:
            return self._load()
        except LedgerFormatError as err:
            moved_to = jsonfile.move_aside(self.path)
            prune_corrupt_copies(self.path)
            self.last_error = (
                f"{self.path} was corrupt ({err}); moved it aside to {moved_to} "
                "and continued from an empty ledger"
            )
            log.warning("%s", self.last_error)
            return LedgerDoc()

    def _ensure_directory(self) -> None:
        directory = self.path.parent
        if not directory.is_dir():
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask
