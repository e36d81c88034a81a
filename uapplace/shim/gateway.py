"""The shim's way to ``uapplaced``: one persistent bus connection, the Admit-only peer socket,
a cap on calls in flight, and one deadline per call.

Owned by the app (:func:`uapplace.shim.app.create_app` builds one
:class:`BusGateway` and closes it at cleanup); the handlers call
:meth:`BusGateway.call`. What the gateway decides: whether the daemon is
*unavailable* (:class:`DaemonUnavailable`: no bus, no daemon on it, no answer in
time, a lost connection), which the handlers answer ``503``. The daemon's own
error replies pass through as :class:`uapplace.bus.client.PlacementError`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeAlias, TypeVar

from dbus_fast import MessageType

from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.bus.peerlink import PeerAdmitLink
from uapplace.bus.util import bus_daemon_message
from uapplace.files.paths import BUS_NAME
from uapplace.shim.metrics import ShimMetrics
from uapplace.shim.responses import HttpError

log = logging.getLogger(__name__)

T = TypeVar("T")

BusWork: TypeAlias = Callable[[PlacementClient], Awaitable[T]]
"""What one call does with a connected client, e.g. ``lambda c: c.call("GetState")``."""
PeerWork: TypeAlias = Callable[[PeerAdmitLink], Awaitable[T]]
"""The same call on the peer link (``AdmitBy`` only), e.g. ``lambda p: p.admit(…)``."""

PEER_RETRY_S = 5.0
"""How often the shim tries the daemon's peer socket again while it cannot be used."""
PEER_CONNECT_S = 0.25
"""The most one attempt at the peer socket may take out of an admit's deadline."""
BUS_CALLS_IN_FLIGHT = 96
"""Calls the shim keeps outstanding on its one bus connection; more wait (inside their
deadline). dbus-daemon refuses a connection's 129th pending call with ``LimitsExceeded``
under its built-in limits (system bus, private buses); the user bus allows 50,000."""

UNAVAILABLE_ERRORS = frozenset(
    {
        "org.freedesktop.DBus.Error.ServiceUnknown",
        "org.freedesktop.DBus.Error.NameHasNoOwner",
        "org.freedesktop.DBus.Error.NoReply",
        "org.freedesktop.DBus.Error.Timeout",
        "org.freedesktop.DBus.Error.TimedOut",
        "org.freedesktop.DBus.Error.Disconnected",
        "org.freedesktop.DBus.Error.NoServer",
        "org.freedesktop.DBus.Error.LimitsExceeded",
    }
)
"""Bus errors that say the daemon cannot be reached, not that it refused."""


class DaemonUnavailable(Exception):
    """No bus, no daemon on it, or no answer before the deadline."""


class BusGateway:
    """One persistent bus connection to ``uapplaced``, reconnected on loss; and, for
    ``Admit``, the daemon's peer-to-peer socket when it may be used.

    Every call runs under a deadline covering the (re)connect and the call, and
    its latency lands in the metrics whatever the outcome.

    The peer socket (:mod:`uapplace.bus.peer`) skips ``dbus-daemon``'s two hops on the
    hot path, through the shim's own lean client (:class:`uapplace.bus.peerlink.PeerAdmitLink`).
    It is used only once :meth:`~uapplace.bus.peerlink.PeerAdmitLink.open` has checked
    that its listener is the process owning ``org.uap.Placement1`` on this bus;
    until then, after a failed attempt (retried at most every
    :data:`PEER_RETRY_S`), or with ``peer_socket=None``, admits take the bus.
    A peer link lost mid-call is dropped and that call retried on the bus.
    At most :data:`BUS_CALLS_IN_FLIGHT` calls are outstanding on the bus
    connection at once (a burst queues here instead of being refused by
    ``dbus-daemon``); a ``LimitsExceeded`` that comes anyway is a ``503``.
    """

    def __init__(self, address: str, metrics: ShimMetrics, peer_socket: Path | None = None) -> None:
        self.address = address
        self.metrics = metrics
        self.peer_socket = peer_socket
        self._client: PlacementClient | None = None
        self._connecting = asyncio.Lock()
        self._peer: PeerAdmitLink | None = None
        self._peer_retry_at = 0.0
        self._peer_note = ""
        self._bus_slots = asyncio.Semaphore(BUS_CALLS_IN_FLIGHT)

    async def close(self) -> None:
        self._drop_peer()
        if self._client is not None:
            self._client.disconnect()
            self._client = None

    @property
    def on_peer(self) -> bool:
        """Whether admits currently go over the peer socket."""
        return self._peer is not None and self._peer.connected

    def _drop_peer(self) -> None:
        if self._peer is not None:
            self._peer.close()
            self._peer = None

    def _note_peer(self, note: str) -> None:
        """Log how admits travel, once per change."""
        if note != self._peer_note:
            self._peer_note = note
            log.info("%s", note)

    async def _peer_client(self) -> PeerAdmitLink | None:
        """The peer link, (re)made when allowed; ``None``: use the bus."""
        if self.on_peer:
            return self._peer
        self._drop_peer()
        now = time.monotonic()
        if self.peer_socket is None or now < self._peer_retry_at:
            return None
        self._peer_retry_at = now + PEER_RETRY_S
        try:
            # Bounded on its own, so a peer socket that hangs costs this admit little.
            async with asyncio.timeout(PEER_CONNECT_S):
                owner = await self._owner_pid(await self._connected())
                link = await PeerAdmitLink.open(self.peer_socket, owner)
        except Exception as err:  # every failure means "stay on the bus"
            why = str(err) or type(err).__name__
            self._note_peer(f"admits go over the bus (peer socket {self.peer_socket}: {why})")
            return None
        self._peer = link
        self._note_peer(
            f"admits go over the peer socket {self.peer_socket} (uapplaced pid {owner})"
        )
        return self._peer

    @staticmethod
    async def _owner_pid(client: PlacementClient) -> int:
        reply = await client.bus.call(
            bus_daemon_message("GetConnectionUnixProcessID", "s", [BUS_NAME])
        )
        if reply is None or reply.message_type is not MessageType.METHOD_RETURN:
            raise DaemonUnavailable(f"no pid for {BUS_NAME}: {reply.body if reply else 'no reply'}")
        return int(reply.body[0])

    async def _connected(self) -> PlacementClient:
        client = self._client
        if client is not None and client.bus.connected:
            return client
        async with self._connecting:
            if self._client is not None and self._client.bus.connected:
                return self._client
            await self.close()
            try:
                # Every call runs under its own deadline (call() below), so no second one.
                self._client = await PlacementClient.connect(self.address, call_timeout=None)
            except Exception as err:  # every connect failure means "unavailable"
                raise DaemonUnavailable(
                    f"cannot connect to the bus at {self.address}: {err}"
                ) from None
            return self._client

    async def call(
        self,
        method: str,
        deadline: float,
        work: BusWork[T],
        *,
        peer_work: PeerWork[T] | None = None,
    ) -> T:
        """``peer_work`` on the peer link when given and usable, else ``work`` on the bus."""
        started = time.perf_counter()
        outcome = "ok"
        try:
            async with asyncio.timeout(deadline):
                peer = None
                if peer_work is not None:  # the usual case, an open peer link, no coroutine
                    peer = self._peer if self.on_peer else await self._peer_client()
                if peer is not None and peer_work is not None:
                    try:
                        return await peer_work(peer)
                    except PlacementError:
                        raise  # the daemon's own answer
                    except Exception as err:
                        if peer.connected:
                            raise
                        self._drop_peer()
                        why = str(err) or type(err).__name__
                        self._note_peer(f"peer socket lost ({why}); admits go over the bus")
                async with self._bus_slots:
                    client = await self._connected()
                    return await work(client)
        except TimeoutError:
            outcome = "Timeout"
            raise DaemonUnavailable(f"{method}: no answer within {deadline:g} s") from None
        except PlacementError as err:
            outcome = err.short
            if err.name in UNAVAILABLE_ERRORS:
                raise DaemonUnavailable(f"{method}: {err.message}") from None
            raise
        except DaemonUnavailable:
            outcome = "Unreachable"
            raise
        except Exception as err:  # a lost connection surfaces as many types
            outcome = type(err).__name__
            if self._client is not None and not self._client.bus.connected:
                await self.close()
                raise DaemonUnavailable(f"{method}: bus connection lost ({err})") from None
            raise HttpError(502, f"bus call {method} failed: {type(err).__name__}: {err}") from None
        finally:
            self.metrics.observe_bus_call(method, time.perf_counter() - started)
            if outcome != "ok":
                self.metrics.bus_errors.labels(method, outcome).inc()
