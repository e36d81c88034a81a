"""pystemd's method calls in a worker process, so that they never stall the daemon's loop.

pystemd 0.15.3 holds Python's global interpreter lock for the whole of a blocking
``sd_bus_call`` (its Cython never releases it), so a call made on a thread still
freezes the event loop that answers ``Admit`` until systemd replies
(docs/architecture.md, "Decision: pystemd's calls in a worker process"). Here one small
process owns the calls connection to the user manager; the daemon sends it requests
over a private socketpair and awaits the replies on its loop.

- **Wire**: frames of a 4-byte big-endian length and a :mod:`marshal` payload (D-Bus
  values are bytes, ints, floats, bools, strings, lists, tuples and dicts, all of which
  :mod:`marshal` carries exactly; only the two ends of a socketpair the daemon made can
  write to it, and nothing received is ever executed). Request ``(id, calls)``: a
  sequence of :data:`Call` run in order, one round trip for a unit read (``LoadUnit``,
  then ``GetAll`` and ``Get`` on the path it returned); reply ``(id, True, bodies)`` or, at the
  first refusal, ``(id, False, (kind, name, message, method))``. The worker answers
  first with a hello, ``(0, True, None)`` once its bus is open, or the error and exits.
- **Life**: :class:`UnitWorker` starts the process on :meth:`UnitWorker.start` (or on
  the first call), starts a new one as soon as it saw it die (calls in flight fail with
  :class:`WorkerGone`; when that start fails, the next call tries again), and kills it
  on :meth:`UnitWorker.close`. The worker dies with
  its parent (``PR_SET_PDEATHSIG``: SIGKILL) and ends at end-of-file on its socket.

Signals (``JobRemoved``, ``PropertiesChanged``) stay on the daemon's loop
(:mod:`uapplace.io.units`): ``sd_bus_process`` never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import marshal
import os
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

from pystemd.dbuslib import DBusAddress, apply_signature

log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024
"""A frame longer than this is a broken peer, not a reply."""
START_S = 10.0
"""How long the worker may take to start and open its bus."""
_PR_SET_PDEATHSIG = 1
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


Call = tuple[bytes, bytes | None, bytes, bytes, bytes, list[Any]]
"""``(destination, path, interface, method, signature, args)``; a ``None`` path is the
body of the sequence's first call (the object path ``LoadUnit`` answered)."""


class WorkerCallError(Exception):
    """systemd (or pystemd) refused a call in the worker.

    ``kind`` is the pystemd exception's class name (``DBusNoSuchUnitError`` …), ``name``
    the D-Bus error name ("" when none), ``message`` its text, ``method`` the call's."""

    def __init__(self, kind: str, name: str, message: str, method: str = "") -> None:
        super().__init__(f"{name or kind}: {message}")
        self.kind = kind
        self.name = name
        self.message = message
        self.method = method


class WorkerGone(Exception):
    """The worker process ended (or could not start) before it answered."""


# ------------------------------------------------------------------ the wire


def encode_frame(value: Any) -> bytes:
    """One frame: the length, then ``value`` marshalled."""
    payload = marshal.dumps(value)
    return _LENGTH.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> Any:
    """The value of one frame's payload."""
    return marshal.loads(payload)


def _frame_length(header: bytes) -> int:
    (length,) = _LENGTH.unpack(header)
    if length > MAX_FRAME:
        raise WorkerGone(f"unit worker sent a {length}-byte frame (at most {MAX_FRAME})")
    return int(length)


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's value; :class:`asyncio.IncompleteReadError` at end of file."""
    length = _frame_length(await reader.readexactly(_LENGTH.size))
    return decode_payload(await reader.readexactly(length))


# --------------------------------------------------------------- worker side


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


def _recv_frame(sock: socket.socket) -> Any:
    header = _recv_exactly(sock, _LENGTH.size)
    if header is None:
        return None
    payload = _recv_exactly(sock, _frame_length(header))
    return None if payload is None else decode_payload(payload)


def _error_reply(request_id: int, err: BaseException, method: bytes = b"") -> tuple[Any, ...]:
    name = getattr(err, "err_name", None)
    message = getattr(err, "err_message", None)
    text = _text(message) if message else str(err)
    return (request_id, False, (type(err).__name__, _text(name or b""), text, _text(method)))


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def run_calls(bus: Any, calls: list[Call]) -> list[Any]:
    """Run ``calls`` in order on a pystemd ``bus``: their bodies. The first that raises
    stops the sequence; its exception gets ``uapplace_method`` (the method's name).
    The worker's answer and :class:`~uapplace.io.units.UnitManager` in process share it."""
    bodies: list[Any] = []
    for destination, path, interface, method, signature, args in calls:
        try:
            call_args = apply_signature(signature, args) if signature else []
            target = bodies[0] if path is None else path
            bodies.append(bus.call_method(destination, target, interface, method, call_args).body)
        except Exception as err:
            err.uapplace_method = method  # type: ignore[attr-defined]
            raise
    return bodies


def answer(bus: Any, request: tuple[Any, ...]) -> tuple[Any, ...]:
    """One request's reply: the bodies of its calls, or the first error."""
    request_id, calls = request
    try:
        reply = (request_id, True, run_calls(bus, calls))
        marshal.dumps(reply)  # an unmarshallable body is this call's error, not the worker's
    except Exception as err:
        return _error_reply(request_id, err, getattr(err, "uapplace_method", b""))
    return reply


def serve(sock: socket.socket, bus: Any) -> None:
    """Answer requests from ``sock`` on ``bus``, one at a time, until end of file."""
    while True:
        request = _recv_frame(sock)
        if request is None:
            return
        sock.sendall(encode_frame(answer(bus, request)))


def _die_with_parent(parent_pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def main(argv: list[str]) -> int:
    """``python -m uapplace.io.unitworker FD PARENT_PID BUS_ADDRESS``."""
    fd, parent_pid, address = int(argv[0]), int(argv[1]), argv[2]
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when we end
    with socket.socket(fileno=fd) as sock:
        bus = DBusAddress(address.encode(), False)
        try:
            bus.open()
        except Exception as err:
            sock.sendall(encode_frame(_error_reply(0, err)))
            return 1
        sock.sendall(encode_frame((0, True, None)))
        try:
            serve(sock, bus)
        finally:
            with contextlib.suppress(Exception):
                bus.close()
    return 0


# --------------------------------------------------------------- daemon side


class UnitWorker:
    """The daemon's end: starts, supervises and talks to one worker process.

    Calls are answered in the order sent (the worker is serial, as one sd-bus connection
    must be). Every method runs on the event loop.
    """

    def __init__(self, bus_address: str, *, start_s: float = START_S) -> None:
        self.bus_address = bus_address
        self.start_s = start_s
        self.starts = 0
        """How many worker processes this has started (a restart adds one)."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._restarting: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 0
        self._starting = asyncio.Lock()
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The running worker's pid; ``None`` while none runs."""
        return self._proc.pid if self._proc is not None and self._writer is not None else None

    async def start(self) -> None:
        """Start the worker unless it runs. Raises :class:`WorkerGone` when it cannot
        start, :class:`WorkerCallError` when it cannot open the bus."""
        async with self._starting:
            if self._closed:
                raise WorkerGone("the unit worker is closed")
            if self._writer is None:
                await self._spawn()

    async def calls(self, calls: list[Call]) -> list[Any]:
        """Method calls run in order in the worker (one round trip): their reply bodies.
        Raises :class:`WorkerCallError` for systemd's refusal (the rest are not made),
        :class:`WorkerGone` when the worker ended first."""
        await self.start()
        assert self._writer is not None
        self._next_id += 1
        request_id = self._next_id
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            self._writer.write(encode_frame((request_id, calls)))
            return await future
        finally:
            self._pending.pop(request_id, None)

    def stop(self) -> None:
        """Kill the worker and fail what waits on it; the next call starts a new one."""
        self._stop("the unit worker was stopped")

    def close(self) -> None:
        """Kill the worker and fail what waits on it, for good (idempotent)."""
        self._closed = True
        if self._restarting is not None:
            self._restarting.cancel()
            self._restarting = None
        self._stop("the unit worker is closed")

    async def _spawn(self) -> None:
        parent, child = socket.socketpair()
        try:
            self._proc = _launch(child, self.bus_address)
        except OSError as err:
            parent.close()
            raise WorkerGone(f"cannot start the unit worker: {err}") from err
        finally:
            child.close()
        self.starts += 1
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        try:
            async with asyncio.timeout(self.start_s):
                _id, ok, detail = await read_frame(reader)
        except BaseException as err:  # cancelled too: never leave a worker behind
            writer.close()
            self._reap()
            if isinstance(err, TimeoutError | asyncio.IncompleteReadError | WorkerGone):
                raise WorkerGone(f"the unit worker did not start: {err!r}") from err
            raise
        if not ok:
            writer.close()
            self._reap()
            raise WorkerCallError(*detail)
        self._writer = writer
        self._reading = asyncio.create_task(self._read(reader), name="unit-worker-replies")

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                request_id, ok, body = await read_frame(reader)
                future = self._pending.get(request_id)
                if future is None or future.done():
                    continue  # its caller gave up (timeout, cancel)
                if ok:
                    future.set_result(body)
                else:
                    future.set_exception(WorkerCallError(*body))
        except (
            asyncio.IncompleteReadError,
            ConnectionError,
            WorkerGone,
            ValueError,
            EOFError,
        ) as err:
            self._reading = None
            code = self._proc.poll() if self._proc is not None else None
            self._stop("the unit worker ended before it answered")
            if not self._closed:
                log.warning("unit worker ended (%r, exit %s); starting a new one", err, code)
                self._restarting = asyncio.create_task(self._restart(), name="unit-worker-restart")

    async def _restart(self) -> None:
        # At once, so that the next call does not pay the start; once, so that a bus that
        # is gone does not make a restart loop (the next call then tries again).
        try:
            await self.start()
        except (WorkerGone, WorkerCallError) as err:
            log.error("cannot restart the unit worker: %s (the next call tries again)", err)
        finally:
            self._restarting = None

    def _stop(self, why: str) -> None:
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for future in self._pending.values():
            if not future.done():
                future.set_exception(WorkerGone(why))
        self._pending.clear()
        self._reap()

    def _reap(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _launch(child: socket.socket, bus_address: str) -> subprocess.Popen[bytes]:
    # Forked from the loop's thread on purpose: PR_SET_PDEATHSIG fires when the thread
    # that forked the worker ends, so never from a pool thread. fork+exec returns in
    # about a millisecond; the slow part, the worker's start-up, is awaited on its hello.
    fd = child.fileno()
    return subprocess.Popen(
        [sys.executable, "-m", __name__, str(fd), str(os.getpid()), bus_address],
        pass_fds=(fd,),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env=_worker_env(),
    )


def _worker_env() -> dict[str, str]:
    # The worker imports this module by name: find it even when not installed.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p
    )
    return env


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
