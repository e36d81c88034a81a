"""frames.py: Admit's reply framed by hand is what dbus-fast writes for it, byte for byte.

The daemon answers every ``Admit`` and ``AdmitBy`` (on the bus and on the peer socket)
with :func:`uapplace.bus.frames.admit_return`; the caller reads it with dbus-fast (the
CLI, the proxy's own client) or with :mod:`uapplace.bus.peerlink` (the shim). Here the
bytes are compared with dbus-fast's own marshalling of the same reply, over lengths that
cross every padding boundary, with and without a destination, and read back by dbus-fast's
unmarshaller. (The call, :func:`~uapplace.bus.frames.admit_by_message`, is checked in
test_peer_link.py.)
"""

from __future__ import annotations

import itertools
import socket

import pytest
from dbus_fast import Message
from dbus_fast._private.unmarshaller import Unmarshaller

from tests.bus.burst import admit_call
from uapplace.bus.frames import admit_return


def call_from(sender: str | None, serial: int) -> Message:
    call = admit_call("alpha", "client", "session", 0)
    call.serial = serial
    if sender is not None:  # a peer-to-peer call has none: the reply then names no destination
        call.sender = sender
    return call


def dbus_fast_reply(call: Message, serial: int, answer: tuple[str, str, str, str]) -> bytes:
    reply = Message.new_method_return(call, "ssss", list(answer))
    reply.serial = serial
    return bytes(reply._marshall(False))


ANSWERS = [
    ("forward", "gpu0:http://127.0.0.1:18080", "", ""),
    ("park", "", "plc-000042", "not_resident"),
    ("park", "", "", "deadline_passed"),
    ("", "", "", ""),
    ("forward", "gpu0:http://[::1]:8080/é-ü", "", "raison"),
]
SENDERS = [None, ":1.7", ":1.1234", ":1.12345678", "org.example.Long.Name"]


@pytest.mark.parametrize(("answer", "sender"), list(itertools.product(ANSWERS, SENDERS)))
def test_the_reply_is_what_dbus_fast_writes(
    answer: tuple[str, str, str, str], sender: str | None
) -> None:
    call = call_from(sender, 9)
    ours = admit_return(77, call.serial, call.sender, answer)
    assert ours == dbus_fast_reply(call, 77, answer)


@pytest.mark.parametrize("length", range(0, 17))
def test_every_padding_of_each_string_and_destination(length: int) -> None:
    text = "x" * length
    answer = (text, text + "y", text + "yy", text + "yyy")
    for sender in (f":1.{'9' * (length + 1)}", None):
        call = call_from(sender, 2**32 - 1)
        assert admit_return(2**31, call.serial, sender, answer) == dbus_fast_reply(
            call, 2**31, answer
        )


def test_dbus_fast_reads_it_back() -> None:
    answer = ("park", "", "plc-000001", "not_resident")
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(admit_return(5, 41, ":1.3", answer))
        unmarshaller = Unmarshaller(None, theirs)
        message = unmarshaller.unmarshall()
    assert message is not None
    assert (message.reply_serial, message.destination, message.signature) == (41, ":1.3", "ssss")
    assert tuple(message.body) == answer
