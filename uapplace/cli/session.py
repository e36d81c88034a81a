"""The CLI's plumbing: its two consoles, exit codes, and one bus conversation per command.

Owns how a failure becomes an exit code and a ``uapplace: …`` line (:func:`fail`,
:func:`call`), and telling "uapplaced is not running" (exit 3) apart from "running but
silent" (:func:`session`). :mod:`uapplace.cli.app` (the commands), :mod:`uapplace.cli.enforce`,
:mod:`uapplace.cli.files` and :mod:`uapplace.cli.render` build on it; it imports none of them.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

from dbus_fast import MessageType
from dbus_fast.aio import MessageBus
from rich.console import Console

from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.bus.util import MatchRefused, add_match, bus_daemon_message, user_bus_address
from uapplace.core import textsafe
from uapplace.files.paths import BUS_NAME

T = TypeVar("T")

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_NOT_AUTHORIZED = 4
EXIT_DRIFTED = 5
EXIT_BUSY = 6
EXIT_NOT_FOUND = 7

EXIT_CODES_HELP = """\b
Exit codes:
  0  ok
  1  refused or failed: validation errors, a failed or rolled-back enforcement,
     a consent flag, or apply/load/unload that would stop something, without --yes
  2  bad usage or an invalid argument
  3  uapplaced not reachable (status/pending/validate read the files instead;
     writes never fall back)
  4  not authorized (polkit, or not the daemon's user)
  5  drifted: the victim set changed since it was shown
  6  busy: another enforcement is running, or the daemon is stopping
  7  not found: unknown placement id, hold cookie, model or config
"""

APP_HELP = (
    "Operator-directed placement of local AI model backends. Talks to uapplaced "
    "(org.uap.Placement1 on the user bus)."
)
"""The ``uapplace`` app's help: the light app (click, :mod:`uapplace.cli.app`) and the local
one it hands over to (typer, :mod:`uapplace.cli.typer_app`) show the same, with
:data:`EXIT_CODES_HELP` as the epilog."""


_EXIT_BY_ERROR = {
    "NotAuthorized": EXIT_NOT_AUTHORIZED,
    "Drifted": EXIT_DRIFTED,
    "Busy": EXIT_BUSY,
    "NotFound": EXIT_NOT_FOUND,
    "UnknownModel": EXIT_NOT_FOUND,
    "InvalidArgument": EXIT_USAGE,
    "org.freedesktop.DBus.Error.InvalidArgs": EXIT_USAGE,
    "Failed": EXIT_REFUSED,
    "Unavailable": EXIT_REFUSED,
}
_UNREACHABLE_ERRORS = frozenset(
    {
        "org.freedesktop.DBus.Error.ServiceUnknown",
        "org.freedesktop.DBus.Error.NameHasNoOwner",
        "org.freedesktop.DBus.Error.NoReply",
        "org.freedesktop.DBus.Error.Timeout",
        "org.freedesktop.DBus.Error.Disconnected",
        "org.freedesktop.DBus.Error.NoServer",
        "org.freedesktop.DBus.Error.Spawn.ChildExited",
        "org.freedesktop.DBus.Error.Spawn.ExecFailed",
        "org.freedesktop.DBus.Error.Spawn.Failed",
        "org.freedesktop.systemd1.NoSuchUnit",
    }
)

# Piped output (scripts, tests) gets wide lines rather than tables folded at 80 columns.
# textsafe: client, model and session names come from any Admit caller; every line these
# consoles print is stripped of escape sequences and control characters.
# emoji=False: a name with ``:fire:`` in it prints as written, not as an emoji.
out = textsafe.install(
    Console(
        highlight=False, emoji=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200
    )
)
err = textsafe.install(Console(stderr=True, highlight=False, emoji=False, soft_wrap=True))


class Unreachable(Exception):
    """No bus, or nobody owns org.uap.Placement1 on it."""


def fail(code: int, message: str) -> NoReturn:
    """Print ``uapplace: message`` and end with ``code``: a plain ``SystemExit``, which the
    light app (click) and the local one (typer) both let through to the process's end."""
    err.print(f"uapplace: {message}", markup=False)
    raise SystemExit(code)


def exit_for(error: PlacementError) -> int:
    return _EXIT_BY_ERROR.get(error.short, EXIT_REFUSED)


def fail_on(error: PlacementError) -> NoReturn:
    """The daemon's error reply as the command's last line and exit code."""
    fail(exit_for(error), f"{error.short}: {error.message}")


async def session(work: Callable[[PlacementClient], Awaitable[T]]) -> T:
    """One connection for ``work``; a missing daemon becomes :class:`Unreachable`."""
    address = user_bus_address()
    try:
        client = await PlacementClient.connect(address)
    except Exception as error:
        raise Unreachable(f"cannot reach the user bus at {address}: {error}") from None
    try:
        return await work(client)
    except PlacementError as error:
        if error.name in _UNREACHABLE_ERRORS:
            if await _daemon_on_bus(client):
                # Up but silent (a timeout, a dropped reply): never call that "not running".
                raise PlacementError(
                    "org.uap.Placement1.Error.Failed",
                    f"uapplaced is running ({BUS_NAME} is owned on {address}) but did not "
                    f"answer: {error.message}; `uapplace status` shows what it is doing",
                ) from None
            raise Unreachable(
                f"uapplaced is not running ({BUS_NAME} has no owner on {address}): {error.message}"
            ) from None
        raise
    finally:
        client.disconnect()


async def _daemon_on_bus(client: PlacementClient) -> bool:
    """Whether org.uap.Placement1 has an owner now (``NameHasOwner``); False if unsure."""
    if not client.bus.connected:
        return False
    try:
        async with asyncio.timeout(5.0):
            reply = await client.bus.call(bus_daemon_message("NameHasOwner", "s", [BUS_NAME]))
    except Exception:  # no answer from the bus itself: unsure, so "not running" stands
        return False
    if reply is None or reply.message_type is not MessageType.METHOD_RETURN:
        return False
    return bool(reply.body[0])


def call(work: Callable[[PlacementClient], Awaitable[T]]) -> T:
    """Run one bus conversation; map failures to the documented exit codes."""
    return call_or(work, _unreachable)


def call_or(
    work: Callable[[PlacementClient], Awaitable[T]], offline: Callable[[Unreachable], T]
) -> T:
    """:func:`call`, but with no daemon to answer, ``offline``'s answer (read from the files)."""
    try:
        return asyncio.run(session(work))
    except Unreachable as error:
        return offline(error)
    except PlacementError as error:
        fail_on(error)


def _unreachable(error: Unreachable) -> NoReturn:
    fail(EXIT_UNREACHABLE, str(error))


def exit_status(done: SystemExit) -> int:
    """The process exit status Python gives ``done`` (``None`` 0; a message: printed, 1)."""
    if done.code is None:
        return EXIT_OK
    if isinstance(done.code, int):
        return done.code
    sys.stderr.write(f"{done.code}\n")
    return EXIT_REFUSED


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2) + "\n")
    sys.stdout.flush()


async def subscribe(bus: MessageBus, rule: str) -> None:
    """``AddMatch`` for ``rule`` (add the handler first); a refusal is :class:`Unreachable`."""
    try:
        await add_match(bus, rule)
    except MatchRefused as error:
        raise Unreachable(str(error)) from None


async def until_stopped(bus: MessageBus) -> bool:
    """Wait for Ctrl-C or SIGTERM, or the bus connection ending; ``True`` if it ended."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(number, stop.set)
    lost = asyncio.ensure_future(bus.wait_for_disconnect())  # type: ignore[no-untyped-call]
    waiting = asyncio.ensure_future(stop.wait())
    await asyncio.wait({lost, waiting}, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    ended = lost.done()
    lost.cancel()
    return ended
