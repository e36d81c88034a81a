"""The shim's peer uids (:mod:`uapplace.shim.peers`): the kernel's answer over netlink and
over ``/proc/net/tcp{,6}``, and the gate that serves the shim's own user only.

Real sockets on the loopback throughout; the other user is a client process run under
``setpriv --reuid 65534`` with the system Python (root only: the CI runs as root). The
end-to-end test against the real shim is ``tests/bus/test_shim_users.py``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from uapplace.shim import peers
from uapplace.shim.peers import (
    PROC_TABLES,
    PeerUnknown,
    UserGate,
    diag_uid,
    open_diag_socket,
    peer_uid,
    row_key,
    scan_table,
)

OTHER_UID = 65534
SYSTEM_PYTHON = "/usr/bin/python3"
"""The client runs the system Python: the test's own may sit under a directory only root
may enter (``/root/.pyenv``)."""
AS_OTHER_USER = ("setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups")
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="running a client as another uid needs root (the CI runs as root)"
)
Address = tuple[str, int]


@contextmanager
def connected(host: str = "127.0.0.1") -> Iterator[tuple[Address, Address]]:
    """A loopback connection of our own: ``(peer as the server sees it, our server end)``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as server:
        server.bind((host, 0))
        server.listen()
        with socket.create_connection(server.getsockname()[:2]):
            accepted, _ = server.accept()
            with accepted:
                yield accepted.getpeername()[:2], accepted.getsockname()[:2]


@contextmanager
def foreign_client(port: int, host: str = "127.0.0.1") -> Iterator[subprocess.Popen[bytes]]:
    """A client process as uid :data:`OTHER_UID`, connected to ``port`` for a few seconds."""
    code = f"import socket,time; s=socket.create_connection(({host!r},{port})); time.sleep(5)"
    process = subprocess.Popen([*AS_OTHER_USER, SYSTEM_PYTHON, "-c", code])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


# --------------------------------------------------------------------------- the lookups


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_row_key_is_how_the_kernel_prints_the_peers_row(host: str) -> None:
    with connected(host) as (peer, ours):
        version, key = row_key(peer, ours)
        assert key in PROC_TABLES[version].read_bytes()
        assert peer_uid(peer, ours) == os.geteuid()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_netlink_names_our_own_uid_and_no_one_for_a_socket_that_does_not_exist(host: str) -> None:
    with connected(host) as (peer, ours), open_diag_socket() as netlink:
        assert diag_uid(netlink, peer, ours, 1) == os.geteuid()
        assert diag_uid(netlink, (host, 1), ours, 2) is None


def test_a_row_nobody_has_is_peer_unknown_naming_the_tables() -> None:
    with connected() as (_peer, ours), pytest.raises(PeerUnknown, match="/proc/net/tcp"):
        peer_uid(("127.0.0.1", 1), ours)


def test_scan_table_reads_only_the_matching_rows_uid(tmp_path: Path) -> None:
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
    rows = [
        f"{i:4d}: 0100007F:{1000 + i:04X} 0100007F:0F07 01 00000000:00000000 00:00000000 "
        f"00000000  {2000 + i:5d}        0 {i} 1 0000000000000000 20 4 30 10 -1\n"
        for i in range(3000)  # past one read chunk
    ]
    table = tmp_path / "tcp"
    table.write_text(header + "".join(rows))
    _version, key = row_key(("127.0.0.1", 1000 + 2999), ("127.0.0.1", 0x0F07))
    assert scan_table(table, key) == 2000 + 2999
    _version, key = row_key(("127.0.0.1", 99), ("127.0.0.1", 0x0F07))
    assert scan_table(table, key) is None


def test_netlink_is_thousands_of_times_cheaper_than_the_proc_table() -> None:
    """Why the gate asks netlink: the kernel writes /proc/net/tcp by walking its whole
    established hash (milliseconds); the netlink lookup is one hash probe."""
    with connected() as (peer, ours), open_diag_socket() as netlink:
        started = time.perf_counter()
        for seq in range(200):
            diag_uid(netlink, peer, ours, seq + 1)
        per_netlink = (time.perf_counter() - started) / 200
        started = time.perf_counter()
        for _ in range(20):
            peer_uid(peer, ours)
        per_proc = (time.perf_counter() - started) / 20
    assert per_netlink < 0.001, f"netlink lookup took {per_netlink * 1e6:.0f} µs"
    assert per_netlink < per_proc


@needs_root
@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_both_lookups_name_another_users_socket(host: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as server:
        server.bind((host, 0))
        server.listen()
        with foreign_client(server.getsockname()[1], host):
            accepted, _ = server.accept()
            with accepted, open_diag_socket() as netlink:
                peer, ours = accepted.getpeername()[:2], accepted.getsockname()[:2]
                assert diag_uid(netlink, peer, ours, 7) == OTHER_UID
                assert peer_uid(peer, ours) == OTHER_UID


# --------------------------------------------------------------------------- the gate


class Served(asyncio.Protocol):
    """The protocol a served connection gets: answers ``served`` to anything."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(b"served")
        self.transport.close()


async def gated_server(gate: UserGate) -> tuple[asyncio.Server, int]:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: gate.protocol(Served), "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def own_request(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


async def foreign_request(port: int) -> bytes:
    code = (
        f"import socket,sys; s=socket.create_connection(('127.0.0.1',{port})); "
        "s.sendall(b'GET / HTTP/1.1\\r\\n\\r\\n'); s.settimeout(5); d=b''\n"
        "while (c := s.recv(4096)): d += c\n"
        "sys.stdout.buffer.write(d)"
    )
    process = await asyncio.create_subprocess_exec(
        *AS_OTHER_USER,
        SYSTEM_PYTHON,
        "-c",
        code,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 15)
    return out


@pytest.fixture(params=["netlink", "proc"])
def gate(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[UserGate]:
    """A gate serving only us, asking netlink, or (netlink refused) the /proc tables."""
    if request.param == "proc":

        def refused() -> socket.socket:
            raise PermissionError(13, "netlink refused in this sandbox")

        monkeypatch.setattr(peers, "open_diag_socket", refused)
    refusals: list[str] = []
    made = UserGate({os.geteuid()}, on_refusal=refusals.append)
    yield made
    made.close()


async def test_the_gate_serves_our_own_connections(gate: UserGate) -> None:
    server, port = await gated_server(gate)
    async with server:
        assert await own_request(port) == b"served"
        assert await own_request(port) == b"served"
    assert gate.refused == 0


@needs_root
async def test_the_gate_refuses_another_user_with_a_named_403(gate: UserGate) -> None:
    server, port = await gated_server(gate)
    async with server:
        answer = await foreign_request(port)
        assert await own_request(port) == b"served"  # and goes on serving us
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert body == (
        b'{"error":"uapplace-shim serves its own user only: this connection comes from '
        b'uid 65534 (nobody); it serves uid 0 (root)"}'
    )
    assert gate.refused == 1


async def test_a_connection_whose_socket_cannot_be_found_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fail closed: no row for the peer (here: every lookup says so) is a 403."""
    gate = UserGate({os.geteuid()})
    monkeypatch.setattr(gate, "uid_now", lambda _peer, _ours: None)
    server, port = await gated_server(gate)
    async with server:
        answer = await own_request(port)
    gate.close()
    assert answer.startswith(b"HTTP/1.1 403 Forbidden")
    assert b"cannot tell which user opened this connection" in answer
