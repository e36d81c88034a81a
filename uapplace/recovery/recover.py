"""Start-up repair of an enforcement run that a crash cut short.

Entry point: :func:`recover` (``await recover(journal, host, units, timeouts=…)``).
uapplaced calls it once at start, from :func:`uapplace.daemon.wiring.attach_enforcement`,
after the controller restored the ledger and the unit manager is connected, and
**before** the unit sync starts and before the controller gets its enforcer: so
no ``Apply``/``Load``/``Unload`` runs while a half-done one is repaired, and the
unit sync never publishes a unit the repair has not verified. A harness (the
chaos test) can call it the same way on any :class:`RecoveryHost`.

This module is the entry point and the table; the rows are carried out by
:class:`~uapplace.recovery.repair.Repair` (the actions), which asks
:class:`~uapplace.recovery.checks.RunChecks` what the units, engines and probe
show (the observations).

It reads the enforcement journal (:mod:`uapplace.files.journal`). No journal: no run
was in progress, nothing to repair (the pending entries are still re-planned).
Otherwise it reconciles the journal with the units (systemd's states), the
engines (``/health``, ``/v1/models``, ``/metrics`` as verify-up checks them) and
the probe (free memory before a victim is restarted), acts by the table below,
raises one alert naming the run and what was done, removes the journal, and
re-plans every pending entry (no option computed before the crash survives).

Principles (docs/invariants.md): never leave a device emptier than before the run when a
victim can be restarted; never publish the new unit before it passed verify-up;
never two residents on one device over its budget (the new unit must be seen
down before a victim starts, a victim seen up means the new unit stops).

The table (``new`` = the unit the run starts, or the paused resident a wake run
wakes; ``victims`` = the residents it stops or pauses; "up" = active, activating or
reloading; "down" = inactive or failed; "asleep" = unit up and ``/is_sleeping``
true; "verify" = :func:`uapplace.publish.verify.check`, the one publication check: health,
served id, not asleep, ``metricsMustMatch``, polled within the config's own bound
:meth:`~uapplace.files.timeouts.Timeouts.verify_up_bound`
(:meth:`~uapplace.files.timeouts.Timeouts.wake_bound`
for a wake); a llama.cpp router model reads these words through its router, see
"Router models" below). Rows are tried in order, the first that matches decides; the outcome
is the alert's (``recovery_done`` warning, or ``recovery_needed`` critical for HUMAN).
**No row publishes a resident ``hot`` that has not just passed verify.**

==  ==============  ========  ==============  ==============================  ===========
#   journal step    new       victims         action                          outcome
==  ==============  ========  ==============  ==============================  ===========
0   none            —         —               none (pending re-planned)       no alert
1   unreadable      —         —               moved aside to ``….broken``     HUMAN
2   forward         up        stopped: down,  verify new: passes → publish    finished
                              paused: asleep  it ``hot``, drop the stopped
                                              victims, keep the paused ones
                                              ``paused`` (not woken), resolve
                                              the entry ``applied``
3   forward         up        any             fails verify, or a victim is    → row 6
                                              up and awake (two residents):
                                              stop new
4   rollback-*      up        any             stop new (the run had failed)   → row 6
5   any             stop of new fails         victims NOT restored; asleep    HUMAN
                                              ones kept ``paused``, none
                                              ``hot``
6   any             down      unit up         verify each: passes → ``hot``   nothing /
                                                                              rolled back
7   any             down      unit up,        the run paused it: wake         rolled back
                              asleep          (``/wake_up``), then verify →
                                              ``hot``; paused before the run:
                                              stays ``paused``
8   any             down      up, fails       not published: asleep →         HUMAN
                              verify or       ``paused``, else out of the
                              wake fails      ledger (the unit sync re-checks)
9   unload          none      all down        drop the victims: the unload    finished
                                              had done its unit work
10  any             down      some down       wait (verify_free_s) for the    rolled back
                                              probe to show their memory
                                              free, start each, verify
11  any             down      some down       memory not free in time         HUMAN
                                              (orphan?): victims NOT started
12  any             down      some down       a start job or verify fails     HUMAN
                                              (the others are restarted)
13  wake, …         woken:    stopped: down,  verify the woken engine         finished
                    verifies  paused: asleep  (``/is_sleeping`` false):
                                              publish it ``hot``, as row 2
14  wake, …         fails     any             put it back to sleep, seen      → row 6
                    verify                    asleep → kept ``paused``; roll
                                              back the victims
15  wake, …         cannot    any             victims NOT restored; it is     HUMAN
                    be put                    taken out of the ledger
                    to sleep
16  pause           down      paused: its     send the same sleep again (it   rolled back
                              sleep may be    is idempotent; the engine
                              in flight       answers once asleep), seen
                                              asleep → row 7
17  pause           down      paused: the     not published: asleep →         HUMAN
                              sleep cannot    ``paused``, else out of the
                              be sent         ledger
18  rollback-wake   down      paused: the     still asleep → row 7 (woken     rolled back /
                              rollback's      again); awake → verify →        nothing
                              wake in flight  ``hot``
==  ==============  ========  ==============  ==============================  ===========

Rows 13-15 are tried first for a wake run (the journal's ``wake`` names the paused
resident); its unit found down, it is dropped and the victims are rolled back. A
wake run cut short before its ``wake`` step (``pause``/``stop``/``verify-free``)
never sent the wake: row 14 at once, without waiting a wake bound. One cut short at
``wake`` may have its wake in flight: row 13's verify polls within the wake bound.
Rows 16-18 are the pause and wake rows of the rollback (issue 20): a request outlives
the daemon that sent it (an engine keeps serving a ``/sleep`` whose client died), so a
victim seen awake at step ``pause`` may fall asleep a second after a repair published
it; its sleep is settled first. The alert's text says what the repair found (a sleep
or wake in flight, a unit the run had stopped that is up again, each victim verified)
besides what it did.

Router models (issue 19; :mod:`uapplace.recovery.routed`). A resident whose config's
``pause_lever`` is ``llamacpp-router`` shares its unit and endpoint with the router's
other models, so the table reads its words through the router's ``GET /models``
(:meth:`~uapplace.recovery.checks.RunChecks.slot_of`), never through the unit:
"up" = the router unit up and the model ``loading``/``loaded``/``sleeping`` (or the
router not answering: unknown counts as up); "down" = ``unloaded``, or the router unit
down; "asleep" = the router answers ``unloaded`` (a stopped router victim too: its
router unloaded it); "stop new" and "put back to sleep" = ``POST /models/unload`` seen
``unloaded`` with its child gone (row 5 when it is not, within ``stop_s``); "wake" =
``POST /models/load``; "verify" = the router says ``loaded`` (waited for; a load that
ended shows ``unloaded`` at once), then the publication check through the router.
**The router's unit is never stopped** for one of its models, except one the run itself
started (journal ``started_unit``) that hosts no other resident: that is stopped as the
run's own rollback would. Rows 16-17 cover a router victim's unload as well: at step
``pause`` (a paused victim) or ``stop`` (a stopped one) a victim its router still says
runs may have its unload in flight (the router answers at once and unloads whatever
became of the client; the status stays ``loaded`` until the child exits), so the same
unload is sent again and seen done first; then an apply run loads it again (row 7) and
an unload run is finished (row 9). A router victim whose router unit is down is row
10: the router is started (memory-gated) and the model loaded in it.

Decisions where docs/invariants.md is silent:

- A run cut short before the new unit started (journal ``stop``/``verify-free``/
  ``start`` with the new unit down) is rolled back, not finished: the operator's
  approval was for a switch that would have been seen through by this daemon,
  and their pending entry is kept (re-planned) so applying again is one click.
- A run cut short after the new unit's start job (``verify-up``) is finished
  when the new unit now passes the same checks verify-up makes
  (:func:`uapplace.publish.verify.check`), waiting up to the config's own bound
  (``Timeouts.verify_up_bound``: measured start, else ``start_timeout_s``, else
  ``verify_up_s``; a restarted victim falls back to ``rollback_up_s``).
- A victim the run paused and found asleep beside a verified new model is kept
  ``paused``, not woken: the operator approved that pause, and waking it would
  need the memory the new model now holds.
- A sleeping engine is polled like a loading one up to the wake bound: a wake the
  crashed daemon had sent may still be in progress in the engine.
- A waking victim is not gated on the probe's free memory (its unit never
  stopped; the new unit is seen down first): a wake that finds no room fails and
  the victim stays ``paused`` (row 8).
- A router victim loads again without waiting on the probe's free memory, as a waking
  one (its router never stopped; the new model is seen unloaded first): a load that
  finds no room ends ``unloaded``, ``failed``, and the victim stays ``paused`` (row 8).
- A router victim whose unload may have been in flight is unloaded again even if the
  crash came before the request left: the repair cannot tell, and an unload seen done
  is the only state it can decide on (the apply run then loads it back).
- The journal is removed after every repair, including one that needs a human:
  the alert's ``detail.journal`` holds the whole record, and a journal kept
  would make every restart try the same repair again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from uapplace.core.alerts import Severity
from uapplace.files.journal import Journal, JournalError, RunRecord
from uapplace.io.router import HTTP_ROUTER, RouterProbe
from uapplace.io.seams import HTTP_ENGINES, EngineProbe, UnitControl
from uapplace.io.units import UnitError
from uapplace.recovery.checks import RecoveryHost, RunChecks
from uapplace.recovery.repair import Outcome, RecoveryReport, Repair

if TYPE_CHECKING:
    from uapplace.files.timeouts import Timeouts

log = logging.getLogger(__name__)

JOURNAL_SUBJECT = "enforcement-journal"


# --------------------------------------------------------------------------- entry point


async def recover(
    journal: Journal,
    host: RecoveryHost,
    units: UnitControl,
    *,
    timeouts: Timeouts,
    probe: EngineProbe | None = None,
    routers: RouterProbe | None = None,
) -> RecoveryReport | None:
    """Repair the run the journal names (if any), alert, clear the journal, re-plan.

    Returns the report, or ``None`` when no run was in progress. Never raises for
    what it finds: a unit manager error mid-repair becomes a ``needs human`` alert.
    """
    try:
        record = await asyncio.to_thread(journal.read)
    except JournalError as err:
        report = await _unreadable(journal, err)
        _alert(host, report, None)
        await host.replan_pending()
        return report
    if record is None:
        await host.replan_pending()
        return None
    log.warning(
        "recovering %s (%s) cut short at step %s", record.run_id, record.describe(), record.step
    )
    checks = RunChecks(record, host, units, timeouts, probe or HTTP_ENGINES, routers or HTTP_ROUTER)
    repair = Repair(checks)
    try:
        report = await repair.run()
    except (UnitError, OSError, ValueError) as err:
        report = repair.report(Outcome.NEEDS_HUMAN, f"the repair itself failed: {err}")
    _alert(host, report, record)
    try:
        await journal.clear()
    except OSError as err:
        log.error("cannot remove the enforcement journal %s: %s", journal.path, err)
    await host.replan_pending()
    return report


async def _unreadable(journal: Journal, err: JournalError) -> RecoveryReport:
    try:
        moved = await asyncio.to_thread(journal.move_aside)
        where = f"moved aside to {moved}"
    except OSError as move_err:
        where = f"could not be moved aside ({move_err})"
    message = (
        f"the enforcement journal is unreadable ({err.message}); {where}. A run may have "
        "been cut short: check `uapplace status` and the units of the registry"
    )
    return RecoveryReport(JOURNAL_SUBJECT, Outcome.NEEDS_HUMAN, message, problems=(str(err),))


def _alert(host: RecoveryHost, report: RecoveryReport, record: RunRecord | None) -> None:
    severity = Severity.CRITICAL if report.outcome is Outcome.NEEDS_HUMAN else Severity.WARNING
    detail: dict[str, Any] = {
        "run_id": report.run_id,
        "outcome": report.outcome.value,
        "actions": list(report.actions),
        "problems": list(report.problems),
    }
    if record is not None:
        detail["step"] = record.step
        detail["journal"] = record.to_json()
    host.alert_board.raise_alert(report.alert_kind, severity, report.run_id, report.message, detail)
