"""Small helpers for talking to a message bus itself, shared by everything that opens one.

Owns where the user bus is (:func:`user_bus_address`), how a call to
``org.freedesktop.DBus`` is spelled (:func:`bus_daemon_message`) and the one signal
subscription check (:func:`add_match`). They live here, not in :mod:`uapplace.bus.client`,
so that the daemon's parts (``daemon``, ``authz``, ``notify``, ``units``, ``events``),
``install``, the demo and the shim reach the bus without importing the CLI's client:
only the CLI, the shim and tests import :mod:`uapplace.bus.client`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

BUS_DAEMON = "org.freedesktop.DBus"
BUS_DAEMON_PATH = "/org/freedesktop/DBus"


class MatchRefused(Exception):
    """The bus answered ``AddMatch`` with an error, or not at all."""


def user_bus_address(env: Mapping[str, str] | None = None) -> str:
    """``DBUS_SESSION_BUS_ADDRESS``, else the user bus at ``$XDG_RUNTIME_DIR/bus``."""
    env = os.environ if env is None else env
    address = env.get("DBUS_SESSION_BUS_ADDRESS")
    if address:
        return address
    runtime = env.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    return f"unix:path={runtime}/bus"


def method_call(
    destination: str,
    path: str,
    interface: str,
    member: str,
    signature: str = "",
    body: list[Any] | None = None,
) -> Message:
    """A method call message (sent raw: no introspection round trip)."""
    return Message(
        destination=destination,
        path=path,
        interface=interface,
        member=member,
        signature=signature,
        body=body or [],
    )


def bus_daemon_message(member: str, signature: str = "", body: list[Any] | None = None) -> Message:
    """A method call to the message bus itself (``org.freedesktop.DBus``)."""
    return method_call(BUS_DAEMON, BUS_DAEMON_PATH, BUS_DAEMON, member, signature, body)


async def add_match(bus: MessageBus, rule: str) -> None:
    """Ask the bus to route signals matching ``rule`` to ``bus``; :class:`MatchRefused` if not.

    Add the message handler first: a signal sent right after the reply is then not missed.
    """
    reply = await bus.call(bus_daemon_message("AddMatch", "s", [rule]))
    if reply is None or reply.message_type is MessageType.ERROR:
        raise MatchRefused(f"the bus refused the signal subscription: {reply and reply.body}")
