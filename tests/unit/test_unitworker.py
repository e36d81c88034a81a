"""The unit worker's wire and the worker side of it, without a bus (issue 23).

pystemd's calls run in a worker process (:mod:`uapplace.io.unitworker`); these check the
frames, how one request is answered (body, systemd's refusal, a body the wire cannot
carry), the serve loop over a real socketpair, and that a worker that cannot open its
bus is reported and reaped. The worker against a real bus: tests/bus/test_unitworker.py.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest

from uapplace.io import unitworker
from uapplace.io.units import UnitError, UnitManager
from uapplace.io.unitworker import (
    MAX_FRAME,
    Call,
    UnitWorker,
    WorkerCallError,
    WorkerGone,
    answer,
    encode_frame,
    read_frame,
    serve,
)

MANAGER = (b"org.freedesktop.systemd1", b"/org/freedesktop/systemd1")


class NoSuchUnit(Exception):
    """Shaped like pystemd's ``DBusNoSuchUnitError``: ``err_name`` and ``err_message``."""

    err_name = b"org.freedesktop.systemd1.NoSuchUnit"
    err_message = b"Unit x.service not found."


class Reply:
    def __init__(self, body: Any) -> None:
        self.body = body


class FakeBus:
    """Answers ``call_method`` from a table; records every call."""

    def __init__(self, answers: dict[bytes, Any]) -> None:
        self.answers = answers
        self.calls: list[tuple[bytes, list[Any]]] = []

    def call_method(
        self, destination: bytes, path: bytes, interface: bytes, method: bytes, args: list[Any]
    ) -> Reply:
        self.calls.append((method, args))
        value = self.answers[method]
        if isinstance(value, Exception):
            raise value
        return Reply(value)


class RecordingPaths(FakeBus):
    """Also records the object path of every call."""

    def __init__(self, answers: dict[bytes, Any]) -> None:
        super().__init__(answers)
        self.paths: list[bytes] = []

    def call_method(
        self, destination: bytes, path: bytes, interface: bytes, method: bytes, args: list[Any]
    ) -> Reply:
        self.paths.append(path)
        return super().call_method(destination, path, interface, method, args)


def call(
    method: bytes, signature: bytes = b"", *args: Any, path: bytes | None = MANAGER[1]
) -> Call:
    return (MANAGER[0], path, b"org.freedesktop.systemd1.Manager", method, signature, list(args))


def request(request_id: int, method: bytes, signature: bytes = b"", *args: Any) -> tuple[Any, ...]:
    return (request_id, [call(method, signature, *args)])


async def frames_of(data: bytes) -> list[Any]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    values = []
    with pytest.raises(asyncio.IncompleteReadError):
        while True:
            values.append(await read_frame(reader))
    return values


async def test_frames_carry_dbus_values_exactly() -> None:
    state = {b"ActiveState": b"active", b"MainPID": 4242, b"ExecStart": [(b"/bin/x", [b"x"])]}
    values = [(1, True, state), (2, False, ("DBusError", "", "no")), (3, True, None)]
    data = b"".join(encode_frame(v) for v in values)
    assert await frames_of(data) == values


async def test_an_oversized_frame_is_a_broken_worker() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data((MAX_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(WorkerGone, match="frame"):
        await read_frame(reader)


def test_answer_returns_the_body_with_the_signature_applied() -> None:
    bus = FakeBus({b"StartUnit": b"/org/freedesktop/systemd1/job/7"})
    reply = answer(bus, request(5, b"StartUnit", b"ss", b"a.service", b"replace"))
    assert reply == (5, True, [b"/org/freedesktop/systemd1/job/7"])
    ((method, args),) = bus.calls
    assert method == b"StartUnit"
    assert [value for _kind, value in args] == [b"a.service", b"replace"]


def test_answer_carries_systemds_refusal_with_its_kind_and_name() -> None:
    bus = FakeBus({b"LoadUnit": NoSuchUnit()})
    reply = answer(bus, request(6, b"LoadUnit", b"s", b"x.service"))
    assert reply == (
        6,
        False,
        (
            "NoSuchUnit",
            "org.freedesktop.systemd1.NoSuchUnit",
            "Unit x.service not found.",
            "LoadUnit",
        ),
    )


def test_a_sequence_runs_later_calls_on_the_first_calls_path_in_one_request() -> None:
    unit_path = b"/org/freedesktop/systemd1/unit/a_2eservice"
    bus = RecordingPaths({b"LoadUnit": unit_path, b"GetAll": {b"ActiveState": b"active"}})
    calls = [call(b"LoadUnit", b"s", b"a.service"), call(b"GetAll", b"s", b"x", path=None)]
    assert answer(bus, (8, calls)) == (8, True, [unit_path, {b"ActiveState": b"active"}])
    assert bus.paths == [MANAGER[1], unit_path]


def test_a_refusal_stops_the_sequence() -> None:
    bus = FakeBus({b"LoadUnit": NoSuchUnit(), b"GetAll": {}})
    calls = [call(b"LoadUnit", b"s", b"x.service"), call(b"GetAll", path=None)]
    assert answer(bus, (9, calls))[1] is False
    assert [method for method, _args in bus.calls] == [b"LoadUnit"]


def test_a_body_the_wire_cannot_carry_is_that_calls_error() -> None:
    bus = FakeBus({b"GetAll": {b"X": object()}})
    request_id, ok, (kind, _name, message, _method) = answer(bus, request(7, b"GetAll"))
    assert (request_id, ok, kind) == (7, False, "ValueError")
    assert "unmarshallable" in message


async def test_serve_answers_in_order_until_end_of_file() -> None:
    bus = FakeBus({b"Reload": None, b"LoadUnit": NoSuchUnit()})
    ours, theirs = socket.socketpair()
    server = threading.Thread(target=serve, args=(theirs, bus))
    server.start()
    try:
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        writer.write(encode_frame(request(1, b"Reload")))
        writer.write(encode_frame(request(2, b"LoadUnit", b"s", b"x.service")))
        first, second = await read_frame(reader), await read_frame(reader)
        writer.close()
        await writer.wait_closed()
    finally:
        server.join(timeout=5)
        theirs.close()
    assert not server.is_alive()  # end of file ended it
    assert first == (1, True, [None])
    assert second[:2] == (2, False)


async def test_a_worker_that_cannot_open_its_bus_says_why_and_is_reaped() -> None:
    worker = UnitWorker("unix:path=/nonexistent/uapplace-test-bus")
    with pytest.raises(WorkerCallError, match="Could not open a bus"):
        await worker.start()
    assert worker.pid is None
    assert worker.starts == 1
    worker.close()
    with pytest.raises(WorkerGone, match="closed"):
        await worker.start()


async def test_the_unit_manager_names_the_bus_it_could_not_reach() -> None:
    manager = UnitManager("unix:path=/nonexistent/uapplace-test-bus")
    assert manager.unit_worker is not None  # out of process by default
    with pytest.raises(UnitError, match="cannot connect to the user bus unix:path=/nonexistent"):
        await manager.connect()
    manager.close()
    assert manager.unit_worker.pid is None


def test_in_process_has_no_worker() -> None:
    manager = UnitManager("unix:path=/nonexistent/uapplace-test-bus", in_process=True)
    assert manager.unit_worker is None
    manager.close()


def test_the_worker_runs_as_this_module() -> None:
    assert unitworker.__name__ == "uapplace.io.unitworker"  # what _launch passes to -m
