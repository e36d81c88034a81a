"""A run's intent and progress, made durable before each unit change (crash recovery).

The enforcement journal itself (the file, its schema, fsync) is
:mod:`uapplace.files.journal`; this module turns a run's :class:`~uapplace.enforce.run.Run`
and :class:`~uapplace.enforce.run.Target` into the record the start-up repair
(:mod:`uapplace.recovery.recover`) reads, and decides what a journal that cannot be
written means for the run. Called by the step modules before each step that
changes a unit or an engine, and by :mod:`uapplace.enforce.enforcer` to clear it at the end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from uapplace.core.steps import PAUSE, ROLLBACK_STEPS
from uapplace.enforce.run import Run, RunContext, Target
from uapplace.files.journal import JournalError, RunRecord

log = logging.getLogger(__name__)


async def journal_step(
    ctx: RunContext, run: Run, target: Target, step: str, stopping: Sequence[str] = ()
) -> None:
    """Make the run's intent and progress durable before ``step`` changes units.

    A forward step that cannot be journaled fails (the run rolls back rather
    than change units a crash could not repair); a rollback step goes on
    regardless (undoing is never held back by the journal).
    """
    if ctx.journal is None:
        return
    earlier = await _settled(run)
    if earlier is not None:
        if step not in ROLLBACK_STEPS:
            raise run.fail(step, earlier)
        log.error("%s %s: %s", run.run_id, step, earlier)
    why = await _write(ctx, run_record(ctx, run, target, step, stopping))
    if why is None:
        return
    if step in ROLLBACK_STEPS:
        log.error("%s %s: %s", run.run_id, step, why)
        return
    raise run.fail(step, why)


def journal_progress(ctx: RunContext, run: Run, target: Target, step: str) -> None:
    """Start making ``step``'s record durable without waiting for it: ``step`` is
    read-only (``verify-free``, ``verify-up``) and awaits it with
    :func:`progress_journaled` before it records itself ok."""
    if ctx.journal is None:
        return
    record = run_record(ctx, run, target, step, ())
    previous = run.journal_pending

    async def write() -> str | None:
        earlier = await previous if previous is not None else None
        return earlier or await _write(ctx, record)

    run.journal_pending = asyncio.ensure_future(write())


async def progress_journaled(run: Run, step: str) -> None:
    """Raise ``step``'s failure when its :func:`journal_progress` record could not be
    written (the run rolls back, as when :func:`journal_step` fails)."""
    why = await _settled(run)
    if why is not None:
        raise run.fail(step, why)


async def _settled(run: Run) -> str | None:
    """Wait for the record in flight, if any; why it failed, or ``None``."""
    pending, run.journal_pending = run.journal_pending, None
    return await pending if pending is not None else None


async def _write(ctx: RunContext, record: RunRecord) -> str | None:
    assert ctx.journal is not None
    try:
        await ctx.journal.record(record)
    except (OSError, ValueError, JournalError) as err:
        return f"cannot write the enforcement journal {ctx.journal.path}: {err}"
    return None


def run_record(
    ctx: RunContext, run: Run, target: Target, step: str, stopping: Sequence[str]
) -> RunRecord:
    """The journal's record of ``run`` about to take ``step`` (``stopping``: the units
    the step is about to stop, not yet in ``run.stopped_units``)."""
    new = ctx.new_resident(target, target.config) if target.config is not None else None
    accepted = [target.requested, target.model.key, *target.model.advertises]
    if target.config is not None:
        accepted.append(target.config.key)
    failed = next((s for s in reversed(run.steps) if not s.ok), None)
    return RunRecord(
        run_id=run.run_id,
        kind=target.kind,
        requested=target.requested,
        device=target.device,
        placement_id=target.entry.id if target.entry is not None else None,
        victims=target.victims,
        new=new,
        accepted_ids=tuple(dict.fromkeys(accepted)),
        step=step,
        started_at=run.started_at,
        updated_at=ctx.clock(),
        stopped_units=tuple(dict.fromkeys([*run.stopped_units, *stopping])),
        started_unit=run.started_unit,
        detail=f"{failed.name}: {failed.detail}" if failed is not None else "",
        history=tuple(s.name for s in run.steps),
        victim_actions={
            v.signature: "pause" if v in target.pausing else "stop" for v in target.victims
        },
        paused=tuple(
            dict.fromkeys(
                v.signature for v in (*run.paused, *(target.pausing if step == PAUSE else ()))
            )
        ),
        wake=target.wake,
    )


async def journal_clear(ctx: RunContext, run: Run, *, sync: bool = True) -> None:
    """Remove the journal: the run ended (whatever its outcome), nothing to repair.
    ``sync=False``: the removal is made durable by :func:`journal_synced` later."""
    if ctx.journal is None:
        return
    earlier = await _settled(run)
    if earlier is not None:
        log.error("%s: %s", run.run_id, earlier)
    try:
        await ctx.journal.clear(sync=sync)
    except OSError as err:  # recovery at the next start finds an ended run: no harm
        log.error("%s: cannot clear the enforcement journal: %s", run.run_id, err)


def journal_synced(ctx: RunContext) -> asyncio.Future[None] | None:
    """Start making a ``sync=False`` :func:`journal_clear` durable (the directory's
    fsync); ``None`` without a journal. Never raises: a failure is logged."""
    journal = ctx.journal
    if journal is None:
        return None

    async def sync() -> None:
        try:
            await journal.sync_directory()
        except OSError as err:
            log.error("cannot fsync the enforcement journal's directory: %s", err)

    return asyncio.ensure_future(sync())
