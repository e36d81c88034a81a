"""Admit's two messages framed by hand: the ``AdmitBy`` call and the ``ssss`` reply.

Every client request of every agent is one admit, so both of its messages skip
dbus-fast's generic marshaller (a ``Marshaller`` over ``yyyyuua(yv)`` with a
``Variant`` per header field, some 4 µs a message here; docs/performance.md, "Admit's
reply framed by hand"). Each function returns the exact bytes dbus-fast writes for the
same message, little-endian (D-Bus specification, "Message Format"); the unit tests
compare the two byte for byte (tests/unit/test_frames.py, tests/unit/test_peer_link.py).

- :func:`admit_by_message`: the shim's call on the peer socket
  (:mod:`uapplace.bus.peerlink`), from a header built once;
- :func:`admit_return`: the daemon's answer to ``Admit``/``AdmitBy``, on the bus and on
  the peer socket (:func:`uapplace.bus.peer.reply_to_admit`, which
  :func:`uapplace.bus.peer.admit_only` and :func:`uapplace.daemon.service.track_senders`
  both call).
"""

from __future__ import annotations

import struct

from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH

__all__ = [
    "ERROR",
    "HEADER_ERROR_NAME",
    "HEADER_REPLY_SERIAL",
    "HEADER_SIGNATURE",
    "METHOD_CALL",
    "METHOD_RETURN",
    "NO_REPLY_EXPECTED",
    "admit_by_message",
    "admit_return",
]

METHOD_CALL = 1
METHOD_RETURN = 2
ERROR = 3
HEADER_ERROR_NAME = 4
HEADER_REPLY_SERIAL = 5
HEADER_DESTINATION = 6
HEADER_SIGNATURE = 8
NO_REPLY_EXPECTED = 0x1
"""The header flag of a call whose sender wants no reply (compare with ``int(flags)``: an
``IntFlag`` ``&`` builds a new enum member per call)."""

_PAD = tuple(b"\0" * n for n in range(8))
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_LENGTH_SERIAL = struct.Struct("<II")


def _string(value: bytes, offset: int) -> bytes:
    """A D-Bus ``s``/``o`` at ``offset``: padding to 4, the length, the bytes, a NUL."""
    return _PAD[-offset % 4] + _U32.pack(len(value)) + value + b"\0"


# --------------------------------------------------------------------------- the call


def _call_fields() -> bytes:
    """The header-field array of every ``AdmitBy`` (its length first), padded to the body."""
    fields = b""
    for code, kind, value in (
        (1, b"o", OBJECT_PATH),
        (2, b"s", INTERFACE),
        (3, b"s", "AdmitBy"),
        (HEADER_DESTINATION, b"s", BUS_NAME),
        (HEADER_SIGNATURE, b"g", "sssut"),
    ):
        fields += _PAD[-(16 + len(fields)) % 8] + bytes((code, 1)) + kind + b"\0"
        raw = value.encode()
        if kind == b"g":
            fields += bytes((len(raw),)) + raw + b"\0"
        else:
            fields += _string(raw, 16 + len(fields))
    return _U32.pack(len(fields)) + fields + _PAD[-(16 + len(fields)) % 8]


_CALL_START = bytes((0x6C, METHOD_CALL, 0, 1))
_CALL_FIELDS = _call_fields()


def admit_by_message(
    serial: int, model: str, client: str, session: str, cells: int, deadline_us: int
) -> bytes:
    """``org.uap.Placement1.AdmitBy(sssut)`` as the bytes on the wire."""
    body = _string(model.encode(), 0)
    body += _string(client.encode(), len(body))
    body += _string(session.encode(), len(body))
    body += _PAD[-len(body) % 4] + _U32.pack(cells)
    body += _PAD[-len(body) % 8] + _U64.pack(deadline_us)
    return _CALL_START + _LENGTH_SERIAL.pack(len(body), serial) + _CALL_FIELDS + body


# --------------------------------------------------------------------------- the reply

_RETURN_START = bytes((0x6C, METHOD_RETURN, 0, 1))
_REPLY_SERIAL_FIELD = bytes((HEADER_REPLY_SERIAL, 1)) + b"u\0"
"""Always the first field, at offset 16: no padding before it, its ``u`` right after."""
_DESTINATION_FIELD = bytes((HEADER_DESTINATION, 1)) + b"s\0"
_SIGNATURE_FIELD = bytes((HEADER_SIGNATURE, 1)) + b"g\0" + bytes((4,)) + b"ssss\0"


def admit_return(
    serial: int, reply_serial: int, destination: str | None, answer: tuple[str, ...]
) -> bytes:
    """The ``METHOD_RETURN`` of signature ``ssss`` carrying ``answer`` (decision, target id,
    placement id, reason) to call ``reply_serial`` from ``destination`` (``None`` on a
    peer-to-peer connection, where a call has no sender and the reply names none)."""
    decision, target_id, placement_id, reason = answer
    body = _string(decision.encode(), 0)
    body += _string(target_id.encode(), len(body))
    body += _string(placement_id.encode(), len(body))
    body += _string(reason.encode(), len(body))
    fields = _REPLY_SERIAL_FIELD + _U32.pack(reply_serial)  # 16 + 8: aligned to 8 again
    if destination:
        fields += _DESTINATION_FIELD + _string(destination.encode(), 16 + len(fields) + 4)
        fields += _PAD[-len(fields) % 8]
    fields += _SIGNATURE_FIELD
    return (
        _RETURN_START
        + _LENGTH_SERIAL.pack(len(body), serial)
        + _U32.pack(len(fields))
        + fields
        + _PAD[-len(fields) % 8]
        + body
    )
