"""Waiting for what nothing signals: poll a check until it holds, under a hang guard.

A test that waits on a real program (a daemon's replies over the bus, a unit's
state, a line in a log) polls. :data:`GUARD_S` is an upper bound that turns a hang
into a failure naming what was awaited, with the tail of the program's log; it is
never an assertion about speed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

GUARD_S = 30.0
"""Upper bound on any wait: a hang guard, never an assertion about speed."""
POLL_S = 0.05
LOG_TAIL = 4000
"""How much of the log's end a failure shows, in characters."""


def no_log() -> str:
    return ""


async def until(
    what: str,
    check: Callable[[], Awaitable[T | None]],
    log: Callable[[], str] = no_log,
    *,
    guard_s: float = GUARD_S,
    tail: int = LOG_TAIL,
) -> T:
    """Await ``check()`` every :data:`POLL_S` until it returns something truthy; return it.

    Past ``guard_s``: an :class:`AssertionError` naming ``what``, with the last ``tail``
    characters of ``log()`` (read then, not before).
    """
    try:
        async with asyncio.timeout(guard_s):
            while True:
                value = await check()
                if value:
                    return value
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        raise AssertionError(f"gave up waiting for {what}; log:\n{log()[-tail:]}") from None


async def until_sync(
    what: str,
    check: Callable[[], T | None],
    log: Callable[[], str] = no_log,
    *,
    guard_s: float = GUARD_S,
    tail: int = LOG_TAIL,
) -> T:
    """:func:`until` for a check that needs no awaiting (a mock's calls, a signal list)."""

    async def checked() -> T | None:
        return check()

    return await until(what, checked, log, guard_s=guard_s, tail=tail)
