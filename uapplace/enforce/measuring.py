"""Measuring under consent: the switch around ``measure --envelope`` (issue 21, item 1).

``measure --envelope`` stops and starts a model twice: for the people using it, it is a
switch like ``unload`` followed by a ``load``, so it takes the same consent and the
same care (docs/placement-rules.md §4.1.1, "Measuring is a switch"):

- the operator approved exactly who stops: the ``PreviewUnload`` signature of the
  model, checked here like ``Unload`` checks it (``Drifted`` otherwise);
- a model pinned by a bus ``Hold`` is refused (``Busy`` naming the holders), never
  taken down;
- a llama.cpp router model whose router unit also serves other resident models is
  refused: stopping the unit would stop them, and they are not in the approved impact;
- its in-flight work is drained first with the enforcer's own steps (``mark-draining``
  then ``drain``: admission parks new requests for it, the run waits for the proxy's
  list and the engine to be idle, ``Busy`` when the drain bound passes, nothing cut off);
- the run is journaled before the first stop as a ``measure`` run, so a crash mid-way
  is repaired at start-up like any run (:mod:`uapplace.recovery.repair`: the model's
  unit is started again and verified);
- it holds the enforcer's one-run lock throughout (:meth:`Enforcer.exclusive`).

:class:`EnvelopeWindow` is what wiring hands the envelope measurer
(:class:`uapplace.measure.envelope.EnvelopeMeasurer`, which cannot import this layer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any

from uapplace.core.errors import Busy, NotFound
from uapplace.core.model import resident_key
from uapplace.core.steps import REVALIDATE, STOP
from uapplace.enforce import revalidate, rollback
from uapplace.enforce import steps as enforce_steps
from uapplace.enforce.enforcer import Enforcer
from uapplace.enforce.journaling import journal_clear, run_record
from uapplace.enforce.run import Run, StepFailed, Target, normalize_signature
from uapplace.files.journal import JournalError, RunKind
from uapplace.io.units import unit_of, units_of

MEASURE_KIND: RunKind = "measure"
"""The journal's run kind for ``measure --envelope`` (recovery restarts the model)."""


class EnvelopeWindow:
    """Opens the consented, drained, journaled window ``measure --envelope`` works in."""

    def __init__(self, enforcer: Enforcer) -> None:
        self.enforcer = enforcer

    @contextlib.asynccontextmanager
    async def open(
        self, model: str, expected: Sequence[str]
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """Revalidate ``model``'s unload against ``expected``, drain it and journal the
        run; yields the steps so far (JSON rows) for the result. The marks, the lock and
        the journal are released when the body ends, whatever its outcome."""
        what = f"measure --envelope {model}"
        async with self.enforcer.exclusive(what):
            ctx = self.enforcer.ctx
            run = Run(run_id=f"run-{secrets.token_hex(4)}", what=what, host=ctx.host)
            try:
                target = await revalidate.unload_target(
                    ctx.host, run, model, normalize_signature(expected) or ()
                )
            except NotFound as err:
                raise NotFound(f"measure --envelope: {err}") from None
            self._refuse_siblings(run, target)
            try:
                enforce_steps.mark_draining(ctx, run, target)
                try:
                    await enforce_steps.drain(ctx, run, target)
                except StepFailed as failure:
                    raise Busy(f"{what}: {failure.detail}") from None
                await self._journal(run, target)
                yield [s.to_json() for s in run.steps]
            finally:
                rollback.release_marks(ctx, run)
                await journal_clear(ctx, run)

    def _refuse_siblings(self, run: Run, target: Target) -> None:
        """A router unit serving other residents is not stopped for one of them."""
        victims = {resident_key(v) for v in target.victims}
        units = set(units_of(target.victims))
        others = [
            r
            for r in self.enforcer.ctx.host.residents()
            if unit_of(r) in units and resident_key(r) not in victims
        ]
        if not others:
            return
        names = ", ".join(f"{r.signature} ({unit_of(r)})" for r in others)
        detail = (
            f"stopping the unit would also stop {names}, which share it (a llama.cpp router) "
            f"and are not in the approved impact: unload them first"
        )
        run.record(REVALIDATE, False, detail)
        raise Busy(f"{run.what}: {detail}")

    async def _journal(self, run: Run, target: Target) -> None:
        """The run's record before the first stop, kind ``measure`` (a crash mid-way
        restarts the model: :mod:`uapplace.recovery.repair`)."""
        ctx = self.enforcer.ctx
        if ctx.journal is None:
            return
        units = units_of(target.victims)
        record = dataclasses.replace(run_record(ctx, run, target, STOP, units), kind=MEASURE_KIND)
        try:
            await ctx.journal.record(record)
        except (OSError, ValueError, JournalError) as err:
            detail = f"cannot write the enforcement journal {ctx.journal.path}: {err}"
            run.record(STOP, False, detail)
            raise Busy(f"{run.what}: {detail}; nothing was stopped") from None
