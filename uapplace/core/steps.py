"""The names of the enforcement steps: the one definition.

A run reports its steps by these names (``EnforcementStep`` signals, the result's
``steps``), the journal records the unit-changing ones (:mod:`uapplace.files.journal`)
and the start-up repair reads them back; :mod:`uapplace.enforce` takes them in this
order (docs/placement-rules.md, "Enforcement").
"""

from __future__ import annotations

from typing import Literal, get_args

REVALIDATE = "revalidate"
PREFLIGHT = "preflight"
MARK_DRAINING = "mark-draining"
DRAIN = "drain"
STOP = "stop"
VERIFY_FREE = "verify-free"
START = "start"
VERIFY_UP = "verify-up"
REFRESH_PROXY = "refresh-proxy"
RESOLVE = "resolve"
ROLLBACK_STOP = "rollback-stop"
ROLLBACK_START = "rollback-start"
ROLLBACK_VERIFY = "rollback-verify"
ROLLBACK_CLEAR = "rollback-clear"
PAUSE = "pause"
"""A victim's engine put to sleep (vLLM ``POST /sleep``) instead of its unit stopped."""
WAKE = "wake"
"""A paused resident's engine woken (``POST /wake_up``) instead of a unit started."""
ROLLBACK_SLEEP = "rollback-sleep"
ROLLBACK_WAKE = "rollback-wake"
UNEXPECTED = "unexpected-error"
"""The step recorded when something raised mid-run outside any step's own checks."""

ROLLBACK_STEPS = frozenset({ROLLBACK_STOP, ROLLBACK_START, ROLLBACK_SLEEP, ROLLBACK_WAKE})
"""The undoing steps the journal records: a journal that cannot be written never holds
them back (:func:`uapplace.enforce.journaling.journal_step`)."""

JournaledStep = Literal[
    "stop",
    "verify-free",
    "start",
    "verify-up",
    "rollback-stop",
    "rollback-start",
    "pause",
    "wake",
    "rollback-sleep",
    "rollback-wake",
]
"""The steps the journal records, before each unit change (the journal file's ``step``;
a type needs the strings written out, so the import-time check below ties them to the
names above)."""

if set(get_args(JournaledStep)) != {
    STOP,
    VERIFY_FREE,
    START,
    VERIFY_UP,
    PAUSE,
    WAKE,
    *ROLLBACK_STEPS,
}:  # pragma: no cover - a step renamed on one side only
    raise ImportError("JournaledStep and the step names above disagree")


def split_last_lines(text: str) -> tuple[str, str]:
    """``(first line, the rest)`` of a step's detail that carries a unit's last lines
    (:meth:`uapplace.io.unitlogs.LogTail.appended_to` makes it): the rest is "" or the
    block of lines, starting with its newline (the first line then loses the ``:`` that
    introduced it). Whoever adds words after a step's detail puts them on the first line
    and the block last."""
    head, newline, rest = text.partition("\n")
    return (head.removesuffix(":") if newline else head), newline + rest
