"""A correct write path for dbus-fast connections: a full send buffer is a wait, not an error.

dbus-fast writes with ``sock.send`` on a non-blocking socket and treats *every*
exception there as the end of the connection. A full kernel send buffer is not
an error, it is ``BlockingIOError`` (``EAGAIN``): under a burst (1,000
concurrent ``Admit`` calls over 10 connections) uapplaced's replies filled its
socket to ``dbus-daemon`` faster than the bus read them, dbus-fast finalised the
connection and the daemon exited. The same bug is python-dbus-next #153 ("Aio
write_callback terminates connection upon EAGAIN error"); dbus-fast 5.2.0, the
newest release when this was written, still has it, so there is no release to pin.

:class:`OrderedWriter` is dbus-fast's own writer (its queue, its futures, its
``loop.add_writer`` registration) with that one path corrected: on ``EAGAIN``
(or a partial write) the unsent remainder stays where it is and the writer
returns with the loop's writability callback installed, so the loop calls it
again exactly when the socket can take more. Messages leave strictly in the
order they were queued; nothing sleeps, nothing is retried on a timer, no byte
is sent twice. Any other ``OSError`` (the other end is gone) still ends the
connection as before, and then every message still queued has its future
failed rather than left pending forever.

:class:`Bus` is dbus-fast's ``MessageBus`` whose connections always use that
writer, and :func:`connect` (or ``Bus(...)`` itself) is how uapplace opens every
bus connection: the daemon's, its notifier's and polkit's, the shim's, the CLI's
(:class:`uapplace.bus.client.PlacementClient`), ``install``'s and the demo's, and both
ends of the peer socket (:mod:`uapplace.bus.peer`). It leans on two dbus-fast internals:
``_MessageWriter`` (subclassed) and the ``_writer`` slot that ``connect()``
assigns (intercepted below); ``pyproject.toml`` pins ``dbus-fast<6`` and
``tests/unit/test_busio.py`` checks both, so a change upstream fails a test
instead of silently bringing the bug back.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import socket
import types
from typing import Any

from dbus_fast import Message
from dbus_fast.aio import MessageBus
from dbus_fast.aio.message_bus import _MessageWriter
from dbus_fast.constants import BusType

__all__ = ["Bus", "BusClosed", "OrderedWriter", "connect", "is_hardened"]

_WRITER_SLOT: types.MemberDescriptorType = vars(MessageBus)["_writer"]
"""The slot descriptor dbus-fast's ``MessageBus`` keeps its writer in."""


class OrderedWriter(_MessageWriter):
    """dbus-fast's writer, but ``EAGAIN`` waits for writability instead of disconnecting.

    State is the base class's: ``messages`` (queued ``(bytes, fds, future)``),
    ``buf``/``offset`` (the message being written and how much of it left),
    ``unix_fds`` (sent with the first byte of ``buf`` only), ``fut``.
    """

    def write_callback(self, remove_writer: bool = True) -> None:
        """Write as much as the socket takes; return with the rest queued, in order.

        Called by the loop when the socket is writable (``remove_writer=True``)
        and directly by ``schedule_write`` for the first message of an idle
        queue. Returning with ``self.buf`` set keeps (or makes ``schedule_write``
        install) the loop's writer, which calls back when the socket drains.
        """
        try:
            while True:
                if self.buf is None and not self._take_next():
                    if remove_writer and self.fd is not None:
                        self.loop.remove_writer(self.fd)
                    return
                if not self.unix_fds and self.offset == 0 and self._sent_whole():
                    continue  # the usual case: one send took the whole message
                if not self._send_some():
                    return  # the kernel buffer is full: wait for writability
                if self.buf is not None and self.offset < len(self.buf):
                    return  # partial write: the remainder goes when writable
                self.buf = None
                _set_result(self.fut)
        except Exception as err:  # the connection is really gone
            self._fail_all(err)
            self.bus._finalize(err)

    def schedule_write(
        self, msg: Message | None = None, future: asyncio.Future[None] | None = None
    ) -> None:
        """Queue ``msg`` (if any) and write what the socket takes now; the loop's writer
        is installed only while bytes are left to send.

        dbus-fast's version also installs it whenever the last message had no future, so a
        frame nobody awaits (:meth:`send_frame`) would cost an ``epoll_ctl`` and a loop
        turn each; here "all sent" is ``buf is None`` and an empty queue."""
        idle = not self.messages and self.buf is None
        if msg is not None:
            self.buffer_message(msg, future)
        self._write_queued(idle)

    def send_frame(self, frame: bytes) -> None:
        """Queue a message already framed (:mod:`uapplace.bus.frames`) that nobody awaits."""
        idle = not self.messages and self.buf is None
        self.messages.append((frame, None, None))  # type: ignore[arg-type]  # bytes, not bytearray: a memoryview reads both
        self._write_queued(idle)

    def _write_queued(self, idle: bool) -> None:
        if not self.bus.unique_name:
            return  # before ``Hello``'s reply: connect() writes the queue itself
        if idle:
            self.write_callback(remove_writer=False)
        if (self.buf is not None or self.messages) and self.fd is not None:
            self.loop.add_writer(self.fd, self.write_callback)

    def _take_next(self) -> bool:
        """Make the oldest queued message the current one; ``False`` when none is left."""
        if not self.messages:
            return False
        data, unix_fds, fut = self.messages.popleft()
        self.buf = memoryview(data)
        self.offset = 0
        self.unix_fds = unix_fds
        self.fut = fut
        return True

    def _sent_whole(self) -> bool:
        """Send the current message (no descriptors, nothing sent yet) in one ``send`` if the
        kernel takes all of it, and finish it; ``False`` (nothing sent) otherwise.

        Every reply and call on the hot path goes this way: no ``memoryview`` slice and no
        ``sendmsg`` bookkeeping (issue 23); anything less than the whole message falls back
        to :meth:`_send_some`, which also sees ``EAGAIN`` again."""
        buf = self.buf
        sock = self.sock
        assert buf is not None and sock is not None
        try:
            sent = sock.send(buf)
        except (BlockingIOError, InterruptedError):
            return False
        if sent < len(buf):
            self.offset = sent
            return False
        self.buf = None
        _set_result(self.fut)
        return True

    def _send_some(self) -> bool:
        """One ``send``/``sendmsg`` of the rest of ``buf``; ``False`` if it would block."""
        sock = self.sock
        assert self.buf is not None and sock is not None
        rest = self.buf[self.offset :]
        try:
            if self.unix_fds and self.negotiate_unix_fd:
                fds = array.array("i", self.unix_fds)
                ancdata = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
                sent = sock.sendmsg([rest], ancdata)
                self.unix_fds = None  # the descriptors went with the first byte
            else:
                sent = sock.send(rest)
        except (BlockingIOError, InterruptedError):
            return False
        self.offset += sent
        return True

    def _fail_all(self, err: Exception) -> None:
        """End the current and every queued message's future (``None`` on a user disconnect)."""
        futures = [self.fut, *(fut for _data, _fds, fut in self.messages)]
        self.messages.clear()
        self.buf = None
        self.fut = None
        for fut in futures:
            if self.bus._user_disconnect:
                _set_result(fut)
            else:
                _set_exception(fut, err)


class Bus(MessageBus):
    """dbus-fast's ``MessageBus`` whose connection writes through :class:`OrderedWriter`.

    ``MessageBus.connect()`` builds its writer with ``self._writer =
    _MessageWriter(self)`` once the socket is connected and before the first
    message is queued; this property sees that assignment and installs an
    :class:`OrderedWriter` on the same socket instead, so no message is ever
    queued on the faulty writer (no window, no state to move across).
    """

    _ordered: OrderedWriter | None = None
    """The writer installed by the setter below, kept where a plain attribute read finds it."""

    @property
    def _writer(self) -> _MessageWriter | None:
        writer: _MessageWriter | None = _WRITER_SLOT.__get__(self, type(self))
        return writer

    @_writer.setter
    def _writer(self, writer: _MessageWriter | None) -> None:
        if writer is not None and not isinstance(writer, OrderedWriter):
            writer = OrderedWriter(self)
        _WRITER_SLOT.__set__(self, writer)
        self._ordered = writer

    def send_frame(self, frame: bytes) -> None:
        """Queue ``frame``, a reply already framed (:mod:`uapplace.bus.frames`) that nobody
        awaits: no ``Message``, no marshalling, no future, which is what ``Admit``'s
        answer skips on every request (issue 23). A connection already gone drops it,
        as dbus-fast drops a reply to a caller that has left."""
        writer = self._ordered
        if not self._disconnected and writer is not None:
            writer.send_frame(frame)

    def send(self, msg: Message) -> asyncio.Future[None]:  # type: ignore[override]
        """Queue ``msg``; on a connection already gone, :class:`BusClosed` at once.

        dbus-fast would try to register the closed socket with the loop and raise
        ``OSError(EBADF)``, leaving a call's reply handler installed forever.
        """
        if self._disconnected:
            self._method_return_handlers.pop(msg.serial, None)
            raise BusClosed(f"the bus connection is closed; {msg.member or 'message'} not sent")
        future: asyncio.Future[None] = super().send(msg)
        return future


class BusClosed(ConnectionError):
    """A message sent on a connection that has already ended."""


def is_hardened(bus: MessageBus) -> bool:
    """Whether ``bus`` writes through :class:`OrderedWriter` (a test and log aid)."""
    return isinstance(getattr(bus, "_writer", None), OrderedWriter)


async def connect(address: str, bus_type: BusType = BusType.SESSION) -> Bus:
    """A connected :class:`Bus` at ``address`` (raises what ``MessageBus.connect`` raises)."""
    bus = Bus(bus_address=address, bus_type=bus_type)
    await bus.connect()
    return bus


def _set_result(fut: asyncio.Future[Any] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future[Any] | None, err: Exception) -> None:
    if fut is not None and not fut.done():
        fut.set_exception(err)
        # Most send() futures are never awaited (dbus-fast's own calls ignore them):
        # mark the error seen so it is not logged again at garbage collection.
        with contextlib.suppress(Exception):
            fut.exception()
