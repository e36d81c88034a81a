"""A run's intent and progress, made durable before each unit change (crash recovery).

The enforcement journal itself (the file, its schema, fsync) is
:mod:`uapplace.files.journal`; this module turns a run's :class:`~uapplace.enforce.run.Run`
and :class:`~uapplace.enforce.run.Target` into the record the start-up repair
(:mod:`uapplace.recovery.recover`) reads, and decides what a journal that cannot be
written means for the run. Called by the step modules before each step that
changes a unit or an engine, and by :mod:`uapplace.enforce.enforcer` to clear it at the end.
"""

from __future__ import annotations

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
    try:
        await ctx.journal.record(run_record(ctx, run, target, step, stopping))
    except (OSError, ValueError, JournalError) as err:
        why = f"cannot write the enforcement journal {ctx.journal.path}: {err}"
        if step in ROLLBACK_STEPS:
            log.error("%s %s: %s", run.run_id, step, why)
            return
        raise run.fail(step, why) from None


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


async def journal_clear(ctx: RunContext, run: Run) -> None:
    """Remove the journal: the run ended (whatever its outcome), nothing to repair."""
    if ctx.journal is None:
        return
    try:
        await ctx.journal.clear()
    except OSError as err:  # recovery at the next start finds an ended run: no harm
        log.error("%s: cannot clear the enforcement journal: %s", run.run_id, err)
