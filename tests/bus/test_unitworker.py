"""The unit worker process against a real bus: calls, refusals, supervision (issue 23).

The worker (:mod:`uapplace.io.unitworker`) only needs a bus to talk to; here it is the
tier's private ``dbus-daemon`` and its ``org.freedesktop.DBus`` methods, so the wire,
the restart after a death, the failure of calls in flight, ``close`` and the death with
its parent are checked without systemd (tests/systemd/test_units.py drives units
through it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from uapplace.io.unitworker import Call, UnitWorker, WorkerCallError, WorkerGone

DBUS = (b"org.freedesktop.DBus", b"/org/freedesktop/DBus", b"org.freedesktop.DBus")
ROOT = Path(__file__).resolve().parents[2]


def dbus_call(method: bytes, signature: bytes = b"", *args: bytes) -> Call:
    destination, path, interface = DBUS
    return (destination, path, interface, method, signature, list(args))


def gone(pid: int) -> bool:
    """No such process, or only its zombie (a reaper that is not ours owns it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


def wait_gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.02)
    return gone(pid)


async def test_calls_answer_in_one_round_trip(bus_address: str) -> None:
    worker = UnitWorker(bus_address)
    try:
        owned, bus_id = await worker.calls(
            [dbus_call(b"NameHasOwner", b"s", b"org.freedesktop.DBus"), dbus_call(b"GetId")]
        )
    finally:
        worker.close()
    assert owned is True
    assert len(bus_id) == 32


async def test_a_refusal_names_the_dbus_error_and_the_method(bus_address: str) -> None:
    worker = UnitWorker(bus_address)
    try:
        with pytest.raises(WorkerCallError) as refused:
            await worker.calls([dbus_call(b"GetNameOwner", b"s", b"org.uap.NoSuchName")])
        (still,) = await worker.calls([dbus_call(b"GetId")])  # the worker lives on
    finally:
        worker.close()
    assert refused.value.kind == "DBusNameHasNoOwnerError"  # how UnitError spots NoSuchUnit
    assert refused.value.method == "GetNameOwner"
    assert still


async def test_a_worker_that_died_is_replaced_at_once(bus_address: str) -> None:
    worker = UnitWorker(bus_address)
    try:
        await worker.start()
        first = worker.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        for _ in range(1000):  # until the supervisor started another (10 s at most)
            if worker.pid not in (None, first):
                break
            await asyncio.sleep(0.01)
        second = worker.pid
        (bus_id,) = await worker.calls([dbus_call(b"GetId")])
    finally:
        worker.close()
    assert second is not None and second != first  # without waiting for a call
    assert worker.starts == 2
    assert bus_id
    assert gone(first)


async def test_calls_in_flight_fail_when_the_worker_dies(bus_address: str) -> None:
    worker = UnitWorker(bus_address)
    try:
        await worker.start()
        pid = worker.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # the call cannot be answered before the kill
        waiting = asyncio.create_task(worker.calls([dbus_call(b"GetId")]))
        await asyncio.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerGone, match="ended before it answered"):
            await asyncio.wait_for(waiting, 5)
    finally:
        worker.close()


async def test_close_kills_the_worker(bus_address: str) -> None:
    worker = UnitWorker(bus_address)
    await worker.start()
    pid = worker.pid
    assert pid is not None
    worker.close()
    assert worker.pid is None
    assert gone(pid)  # killed and reaped before close returned
    with pytest.raises(WorkerGone, match="closed"):
        await worker.calls([dbus_call(b"GetId")])


PARENT = """
import asyncio, sys, time
from uapplace.io.unitworker import UnitWorker

async def main():
    worker = UnitWorker(sys.argv[1])
    await worker.start()
    print(worker.pid, flush=True)
    time.sleep(60)

asyncio.run(main())
"""


def test_the_worker_dies_with_its_parent(bus_address: str) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, bus_address],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        pid = int(line)
        assert not gone(pid)
        parent.kill()  # SIGKILL: no clean-up code of the parent runs
        parent.wait(timeout=5)
        assert wait_gone(pid), f"unit worker {pid} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=5)
