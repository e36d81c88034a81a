"""Admit over uapplaced's peer-to-peer socket (``uapplace.bus.peer``), real daemon, real shim.

The proof that admits skip the bus is behavioural: with the private
``dbus-daemon`` frozen (SIGSTOP, by the PID the bus itself reports), a shim on
the peer socket still answers admit, and one started with ``--no-peer`` cannot.
The shim trusts the socket only when its listener is the process that owns
``org.uap.Placement1`` on the bus: an impostor listening there is refused, and
admits go over the bus.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from tests.bus import shim_fixtures
from tests.bus.conftest import (
    SEEDED_ENDPOINT,
    DaemonProcess,
    UapEnv,
    ask_bus,
    make_env,
    start_daemon,
    wait_published,
)
from tests.bus.dbusmock_fixtures import private_bus
from tests.bus.shim_fixtures import SEEDED_LEDGER, ShimProcess, request, start_shim, without_guid
from uapplace.bus.peer import PeerListener
from uapplace.files.paths import BUS_NAME
from uapplace.shim import gateway as gateway_module
from uapplace.shim.gateway import BusGateway
from uapplace.shim.metrics import ShimMetrics

pytestmark = pytest.mark.bus

ADMIT = "/api/placement/admit"
FORWARD_ALPHA = f'{{"decision":"forward","target_id":"gpu0:{SEEDED_ENDPOINT}"}}'.encode()
ON_PEER = "admits go over the peer socket"


daemon = shim_fixtures.daemon


def peer_socket(uap: UapEnv) -> Path:
    return Path(uap.env["XDG_RUNTIME_DIR"]) / "uapplace" / "bus"


def admit(shim: ShimProcess, client: str) -> tuple[int, bytes]:
    reply = request(shim.base_url, "POST", ADMIT, {"model_id": "alpha", "client": client})
    return reply.status, reply.raw


def bus_daemon_pid(address: str) -> int:
    """The ``dbus-daemon`` serving ``address``: the bus answers for its own name."""
    done = ask_bus(address, "GetConnectionUnixProcessID", "org.freedesktop.DBus", "--json=short")
    assert done.returncode == 0, done.stderr
    return int(json.loads(done.stdout)["data"][0])


def test_the_daemon_listens_privately(daemon: DaemonProcess, uap_env: UapEnv) -> None:
    path = peer_socket(uap_env)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert f"Admit also answered on {path}" in daemon.log()


def test_admits_skip_the_bus_on_the_peer_socket(
    daemon: DaemonProcess, uap_env: UapEnv, tmp_path: Path
) -> None:
    on_peer = start_shim(uap_env.env, uap_env.bus_address, tmp_path)
    bus_only = start_shim(uap_env.env, uap_env.bus_address, tmp_path, "--no-peer")
    try:
        assert admit(on_peer, "peer-warm") == (200, FORWARD_ALPHA)
        assert admit(bus_only, "bus-warm") == (200, FORWARD_ALPHA)
        bus_pid = bus_daemon_pid(uap_env.bus_address)
        os.kill(bus_pid, signal.SIGSTOP)
        try:
            through_peer = admit(on_peer, "peer-while-bus-frozen")
            through_bus = admit(bus_only, "bus-while-bus-frozen")
        finally:
            os.kill(bus_pid, signal.SIGCONT)
        after = admit(bus_only, "bus-after-thaw")
    finally:
        assert on_peer.stop() == 0
        assert bus_only.stop() == 0
    assert through_peer == (200, FORWARD_ALPHA)
    assert through_bus[0] == 503
    assert after == (200, FORWARD_ALPHA)
    assert f"{ON_PEER} {peer_socket(uap_env)} (uapplaced pid {daemon.pid})" in on_peer.log()
    assert ON_PEER not in bus_only.log()


def test_a_listener_that_is_not_the_daemon_is_not_trusted(tmp_path: Path) -> None:
    """Someone else holds the socket first: the daemon keeps off it, the shim too."""

    async def scenario() -> tuple[tuple[int, bytes], list[str], str, str]:
        impostor_calls: list[str] = []

        def impostor(
            model: str, client: str, session: str, cells: int, deadline_us: int = 0
        ) -> tuple[str, str, str, str]:
            impostor_calls.append(client)
            return ("forward", "gpu0:http://impostor.invalid", "", "")

        with private_bus("session", tmp_path) as address:
            uap = make_env(tmp_path / "world", address)
            uap.seed_ledger(SEEDED_LEDGER)
            listener = PeerListener(peer_socket(uap), impostor)
            await listener.start()
            daemon = await asyncio.to_thread(start_daemon, uap)
            try:
                await asyncio.to_thread(wait_published, address)
                shim = await asyncio.to_thread(start_shim, uap.env, address, tmp_path)
                try:
                    answer = await asyncio.to_thread(admit, shim, "wary")
                finally:
                    await asyncio.to_thread(shim.stop)
                shim_log = shim.log()
            finally:
                await asyncio.to_thread(daemon.stop)
                await listener.close()
            return answer, impostor_calls, shim_log, daemon.log()

    answer, impostor_calls, shim_log, daemon_log = asyncio.run(scenario())
    assert answer == (200, FORWARD_ALPHA)
    assert impostor_calls == []
    assert "another process is listening on it" in daemon_log
    assert "admits go over the bus (peer socket" in shim_log
    assert f"listened on by pid {os.getpid()}" in shim_log


# --------------------------------------------------------------------------- the gateway's fallback


Decision = tuple[str, str, str, str]


class FakeOwner:
    """This test process as ``uapplaced``: owns the name on a private bus, and a peer socket.

    Its bus answers forward to ``bus:…``, its peer socket to ``peer:…``, so each
    answer says which way it came. ``cut_next`` makes the peer socket drop the
    connection instead of answering the next admit.
    """

    def __init__(self, socket_path: Path) -> None:
        self.listener = PeerListener(socket_path, self.peer_answer)
        self.cut_next = False
        self.bus: MessageBus | None = None

    def peer_answer(
        self, model: str, client: str, session: str, cells: int, deadline_us: int = 0
    ) -> Decision:
        if self.cut_next:
            self.cut_next = False
            self.listener.drop_peers()
        return ("forward", f"peer:{client}", "", "")

    @staticmethod
    def bus_answer(message: Message) -> Message | None:
        if message.member != "Admit" or message.message_type is not MessageType.METHOD_CALL:
            return None
        return Message.new_method_return(
            message, "ssss", ["forward", f"bus:{message.body[1]}", "", ""]
        )

    async def start(self, address: str) -> None:
        self.bus = await MessageBus(bus_address=address).connect()
        self.bus.add_message_handler(self.bus_answer)
        await self.bus.request_name(BUS_NAME)
        await self.listener.start()

    async def stop(self) -> None:
        await self.listener.close()
        if self.bus is not None:
            self.bus.disconnect()


async def gateway_admit(gateway: BusGateway, client: str) -> str:
    reply = await gateway.call(
        "Admit",
        1.5,
        lambda c: c.admit("alpha", client, "", 1),
        peer_work=lambda p: p.admit("alpha", client, "", 1),
    )
    return str(reply["target_id"])


@pytest.fixture
def short_runtime() -> Iterator[Path]:
    """A runtime directory whose socket path fits ``sun_path`` (107 bytes)."""
    runtime = Path(f"/tmp/uap-gw-{os.getpid()}")
    runtime.mkdir(mode=0o700)
    yield runtime
    shutil.rmtree(runtime)


async def test_the_gateway_falls_back_to_the_bus_and_comes_back(
    tmp_path: Path, short_runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer link cut mid-call: that call is answered over the bus; the next one re-links."""
    monkeypatch.setattr(gateway_module, "PEER_RETRY_S", 0.0)
    owner = FakeOwner(short_runtime / "uapplace" / "bus")
    try:
        with private_bus("session", tmp_path) as address:
            await owner.start(address)
            gateway = BusGateway(without_guid(address), ShimMetrics(), owner.listener.path)
            try:
                first = await gateway_admit(gateway, "one")
                owner.cut_next = True
                cut = await gateway_admit(gateway, "cut-mid-call")
                again = await gateway_admit(gateway, "two")
            finally:
                await gateway.close()
    finally:
        await owner.stop()
    assert (first, cut, again) == ("peer:one", "bus:cut-mid-call", "peer:two")


async def test_a_peer_socket_that_never_answers_costs_an_admit_little(
    tmp_path: Path, short_runtime: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It accepts (the kernel does) but never speaks: the admit still gets the bus's answer."""
    caplog.set_level(logging.INFO, logger="uapplace.shim")
    silent = short_runtime / "uapplace" / "bus"
    silent.parent.mkdir(mode=0o700)
    owner = FakeOwner(short_runtime / "unused" / "bus")
    with socket.socket(socket.AF_UNIX) as mute:
        mute.bind(str(silent))
        mute.listen(4)
        try:
            with private_bus("session", tmp_path) as address:
                await owner.start(address)
                gateway = BusGateway(without_guid(address), ShimMetrics(), silent)
                try:
                    answer = await gateway_admit(gateway, "patient")
                finally:
                    await gateway.close()
        finally:
            await owner.stop()
    assert answer == "bus:patient"
    assert f"admits go over the bus (peer socket {silent}: TimeoutError)" in caplog.text
