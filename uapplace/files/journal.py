"""The enforcement journal: what a run intends and how far it got, on disk before each step.

A run that changes units (stop victims, start the new unit, and the rollback's
stop and restarts) can be cut short by a crash of uapplaced. The ledger cannot
say what was half done: it is written *behind* by the controller (debounced),
so a SIGKILL right after a stop leaves a ledger that still shows the victim
``draining``, or even ``hot``. The journal is the run's own record, written
**synchronously and fsynced before** each unit-changing step, so after any
crash the start-up repair (:mod:`uapplace.recovery.recover`) knows

- which run it was (id, kind, placement id, requested id),
- the victims as they were before the run (the residents to restore),
- the resident that finishing the run would publish (model/config/device/unit),
- the ids the new engine may serve (for the served-ids check of verify-up),
- the step reached and the units stopped/started so far.

Why a separate file and not a field of the ledger: the ledger is shared with the
write-behind, taken under a lock and rewritten whole; the journal is one small
file (``$UAP_HOME/enforcement-journal.json``) replaced with
:func:`uapplace.files.jsonfile.atomic_write` (``sync=True``: fsync of the file, rename,
fsync of the directory) in a worker thread, a few milliseconds per step. The
file exists only while a run is in progress: :meth:`Journal.clear` removes it
(and fsyncs the directory; the enforcer lets its reply go before that fsync, issue 23)
when the run ends, whatever the outcome.

Steps recorded (:data:`uapplace.core.steps.JournaledStep`, the enforcement steps of
:mod:`uapplace.enforce.enforcer`):

==================  ============================================================
``stop``            about to stop the victims (nothing changed yet)
``verify-free``     the victims' stop jobs are done
``start``           about to start the new unit
``verify-up``       the new unit's start job is done; verifying it
``rollback-stop``   the run failed; about to stop the unit it started
``rollback-start``  about to restart the victims it stopped
``pause``           about to put the paused victims' engines to sleep (issue 12)
``wake``            about to wake the paused resident a ``wake`` run serves
``rollback-sleep``  the wake run failed; about to put that resident back to sleep
``rollback-wake``   about to wake the victims the run paused
==================  ============================================================

Pause runs (issue 12) add three fields, each optional so a journal written before
them still reads (as "every victim stopped, nothing woken"):
``victim_actions`` (victim ``model/config`` → ``stop`` or ``pause``), ``paused``
(the victims whose sleep was attempted so far) and ``wake`` (the paused resident a
wake run is waking, as it was before the run).

Test hook: when built with ``crash_at`` (``UAPPLACE_TEST_CRASH_AT``, see
:class:`uapplace.files.paths.Paths`), :meth:`Journal.record` SIGKILLs this process
right after the record for that step is durable. Unset, it does nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from uapplace.core.model import Resident, ResidentState, VictimAction, iso
from uapplace.core.steps import ROLLBACK_STEPS, JournaledStep
from uapplace.core.unitnames import valid_unit_name
from uapplace.files.jsonfile import (
    ConfigFileError,
    atomic_write,
    fsync_directory,
    move_aside,
    parse_json,
    read_capped_or_none,
)
from uapplace.files.ledger import describe_validation_error, resident_to_json
from uapplace.files.ledger_schema import fields_of

log = logging.getLogger(__name__)

JOURNAL_VERSION = 1
MAX_JOURNAL_BYTES = 1 << 20
"""A journal is a few KiB; anything over 1 MiB is not one of ours."""

RunKind = Literal["apply", "load", "unload", "measure"]
"""``measure``: a ``measure --envelope`` run (it stops and starts one model; the repair
restarts it, never finishes it as an unload: :mod:`uapplace.enforce.measuring`)."""


class JournalError(Exception):
    """The journal file exists but is not a journal; the message names the file and field."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


@dataclass(frozen=True)
class RunRecord:
    """One run in progress, as the journal holds it."""

    run_id: str
    kind: RunKind
    requested: str
    """The id the run was for (``beta``, ``beta-latest``): the served-ids check accepts it."""
    device: str
    placement_id: str | None
    victims: tuple[Resident, ...]
    """The residents the run stops, as they were before it (state as published then)."""
    new: Resident | None
    """What finishing the run publishes (``hot``); ``None`` for an unload."""
    accepted_ids: tuple[str, ...]
    """Any of these in the new engine's ``/v1/models`` passes the served-ids check."""
    step: str
    started_at: float
    updated_at: float
    stopped_units: tuple[str, ...] = ()
    started_unit: str | None = None
    detail: str = ""
    """Why the run is rolling back (the failed step's detail), for the alert."""
    history: tuple[str, ...] = field(default=())
    """Every step recorded so far, in order."""
    victim_actions: dict[str, VictimAction] = field(default_factory=dict)
    """Victim ``model/config`` → ``stop`` or ``pause``; a victim not named was stopped."""
    paused: tuple[str, ...] = ()
    """``model/config`` of every victim whose sleep the run attempted."""
    wake: Resident | None = None
    """The paused resident a wake run is waking (as it was before the run), else ``None``."""

    def action_of(self, victim: Resident) -> VictimAction:
        return self.victim_actions.get(victim.signature, "stop")

    @property
    def pausing(self) -> tuple[Resident, ...]:
        return tuple(v for v in self.victims if self.action_of(v) == "pause")

    @property
    def new_unit(self) -> str | None:
        return self.new.unit if self.new is not None else None

    @property
    def rolling_back(self) -> bool:
        return self.step in ROLLBACK_STEPS

    def describe(self) -> str:
        """``apply beta/b1 on gpu0 (placement plc-…), stopping alpha/a1, pausing gamma/g1``."""
        what = f"{self.kind} "
        what += f"{self.new.signature} on {self.device}" if self.new else self.requested
        if self.placement_id:
            what += f" (placement {self.placement_id})"
        stopping = [v.signature for v in self.victims if self.action_of(v) == "stop"]
        if stopping:
            what += f", stopping {', '.join(stopping)}"
        if self.pausing:
            what += f", pausing {', '.join(v.signature for v in self.pausing)}"
        if self.wake is not None:
            what += f", waking paused {self.wake.signature}"
        return what

    def to_json(self) -> dict[str, Any]:
        return {
            "version": JOURNAL_VERSION,
            "run_id": self.run_id,
            "kind": self.kind,
            "requested": self.requested,
            "device": self.device,
            "placement_id": self.placement_id,
            "victims": [resident_to_json(v) for v in self.victims],
            "new": resident_to_json(self.new) if self.new is not None else None,
            "accepted_ids": list(self.accepted_ids),
            "step": self.step,
            "started_at": iso(self.started_at),
            "started_at_s": self.started_at,
            "updated_at_s": self.updated_at,
            "stopped_units": list(self.stopped_units),
            "started_unit": self.started_unit,
            "detail": self.detail,
            "history": list(self.history),
            "victim_actions": dict(self.victim_actions),
            "paused": list(self.paused),
            "wake": resident_to_json(self.wake) if self.wake is not None else None,
        }


# --------------------------------------------------------------------------- schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _ResidentJson(_Strict):
    model: str = Field(min_length=1)
    config: str = Field(min_length=1)
    device: str = Field(min_length=1)
    engine: str
    endpoint: str | None
    unit: str | None
    state: ResidentState = Field(strict=False)
    gpu_mib: float | None = Field(default=None, allow_inf_nan=False)
    host_rss_mib: float | None = Field(default=None, allow_inf_nan=False)
    holders: list[Any] = []
    since: str
    main_pid: int | None = None

    @field_validator("unit")
    @classmethod
    def _unit_name(cls, unit: str | None) -> str | None:
        # The repair starts and stops these units: never a name systemd could misread.
        if unit is not None and not valid_unit_name(unit):
            raise ValueError(f"not a valid unit name: {unit!r}")
        return unit

    def resident(self) -> Resident:
        """The resident, without its holders (a repair never restores a hold)."""
        return Resident(**fields_of(self, leave_out=frozenset({"holders"})))


class _RecordJson(_Strict):
    version: Literal[1]
    run_id: str = Field(min_length=1)
    kind: RunKind
    requested: str
    device: str = Field(min_length=1)
    placement_id: str | None
    victims: list[_ResidentJson]
    new: _ResidentJson | None
    accepted_ids: list[str]
    step: JournaledStep
    started_at: str
    started_at_s: float = Field(allow_inf_nan=False)
    updated_at_s: float = Field(allow_inf_nan=False)
    stopped_units: list[str] = []
    started_unit: str | None = None
    detail: str = ""
    history: list[str] = []
    victim_actions: dict[str, VictimAction] = {}
    paused: list[str] = []
    wake: _ResidentJson | None = None

    @field_validator("stopped_units")
    @classmethod
    def _unit_names(cls, units: list[str]) -> list[str]:
        bad = [u for u in units if not valid_unit_name(u)]
        if bad:
            raise ValueError(f"not a valid unit name: {bad[0]!r}")
        return units

    @field_validator("started_unit")
    @classmethod
    def _started_name(cls, unit: str | None) -> str | None:
        if unit is not None and not valid_unit_name(unit):
            raise ValueError(f"not a valid unit name: {unit!r}")
        return unit


def record_from_json(path: Path, data: Any) -> RunRecord:
    """Parse one journal document; :class:`JournalError` names the field that is wrong."""
    try:
        parsed = _RecordJson.model_validate(data)
    except ValidationError as err:
        raise JournalError(path, describe_validation_error(err)) from None
    return RunRecord(
        run_id=parsed.run_id,
        kind=parsed.kind,
        requested=parsed.requested,
        device=parsed.device,
        placement_id=parsed.placement_id,
        victims=tuple(v.resident() for v in parsed.victims),
        new=parsed.new.resident() if parsed.new is not None else None,
        accepted_ids=tuple(parsed.accepted_ids),
        step=parsed.step,
        started_at=parsed.started_at_s,
        updated_at=parsed.updated_at_s,
        stopped_units=tuple(parsed.stopped_units),
        started_unit=parsed.started_unit,
        detail=parsed.detail,
        history=tuple(parsed.history),
        victim_actions=dict(parsed.victim_actions),
        paused=tuple(parsed.paused),
        wake=parsed.wake.resident() if parsed.wake is not None else None,
    )


# --------------------------------------------------------------------------- the file


class Journal:
    """The journal file. Blocking methods (``read``, ``write``, ``remove``, ``move_aside``)
    run in a thread; the enforcer awaits :meth:`record` and :meth:`clear`."""

    def __init__(self, path: Path, *, crash_at: str | None = None) -> None:
        self.path = path
        self.crash_at = crash_at

    # ---------------------------------------------------------------- async, for the loop

    async def record(self, record: RunRecord) -> None:
        """Make ``record`` durable (fsynced) before the caller takes its step."""
        await asyncio.to_thread(self.write, record)
        if self.crash_at is not None and self.crash_at == record.step:
            log.warning("UAPPLACE_TEST_CRASH_AT=%s: SIGKILL after journaling it", record.step)
            os.kill(os.getpid(), signal.SIGKILL)

    async def clear(self, *, sync: bool = True) -> None:
        """The run ended (applied, rolled back, or repaired): no run is in progress.

        ``sync=False`` leaves the directory's fsync to :meth:`sync_directory`: the file is
        gone for any process at once, and only a power cut before that fsync can bring it
        back (a run recovery finds ended: it verifies and changes nothing)."""
        await asyncio.to_thread(self.remove, sync=sync)

    async def sync_directory(self) -> None:
        """Make a :meth:`clear` with ``sync=False`` durable."""
        await asyncio.to_thread(fsync_directory, self.path.parent)

    # ---------------------------------------------------------------- blocking

    def write(self, record: RunRecord) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Refused, not nulled (``jsonfile.dumps`` would): a journal must say exactly
        # what the run intends, or the run does not take the step.
        text = json.dumps(record.to_json(), indent=1, allow_nan=False) + "\n"
        atomic_write(self.path, text, sync=True)

    def read(self) -> RunRecord | None:
        """The run in progress, ``None`` when there is none.

        Raises :class:`JournalError` for a file that is too large, not a regular
        file, owned by another user or writable by group or others (recovery would act
        on it: docs/placement-rules.md §4.7), not JSON, too deeply nested, with a
        ``NaN``/``Infinity`` or a duplicate key (:func:`uapplace.files.jsonfile.parse_json`,
        the checked parser every file of uapplace goes through), or not the schema (naming
        the field).
        """
        try:
            raw = read_capped_or_none(self.path, MAX_JOURNAL_BYTES, trusted=True)
            if raw is None:
                return None
            data = parse_json(raw, self.path)
        except ConfigFileError as err:
            where = "" if err.json_path == "$" else f"{err.json_path}: "
            raise JournalError(self.path, f"{where}{err.message}") from None
        return record_from_json(self.path, data)

    def remove(self, *, sync: bool = True) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            return
        if sync:
            fsync_directory(self.path.parent)

    def move_aside(self) -> Path:
        """Keep an unreadable journal for a human (``…json.broken``), out of the way."""
        return move_aside(self.path, self.path.with_name(self.path.name + ".broken"))
