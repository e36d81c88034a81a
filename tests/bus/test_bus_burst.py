"""Bursts of concurrent ``Admit`` calls against the real uapplaced, over the bus and the shim.

Issue 11: 1,000 concurrent admits over 10 connections used to fill uapplaced's
socket to ``dbus-daemon``; dbus-fast took ``EAGAIN`` for a dead connection and
the daemon exited. :mod:`uapplace.bus.connection` waits for writability instead. Here,
five runs each of 2,000 concurrent admits over 20 connections must all be
answered by the same daemon process, straight on the bus and through the shim
(over the peer socket and with ``--no-peer``) without a single 5xx. The
before/after figures and throughput are ``bench/bench_burst.py``'s job.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.bus import shim_fixtures
from tests.bus.burst import BurstResult, bus_burst, http_burst, owner_pid
from tests.bus.conftest import DaemonProcess, UapEnv
from tests.bus.shim_fixtures import ShimProcess, start_shim

pytestmark = pytest.mark.bus

RUNS = 5
CALLS = 2000
CONNECTIONS = 20


daemon = shim_fixtures.daemon


def shim_with(uap_env: UapEnv, *args: str) -> Iterator[ShimProcess]:
    started = start_shim(uap_env.env, uap_env.bus_address, uap_env.root, *args)
    try:
        yield started
    finally:
        assert started.stop() == 0, started.log()


@pytest.fixture(scope="module")
def peer_shim(uap_env: UapEnv, daemon: DaemonProcess) -> Iterator[ShimProcess]:
    yield from shim_with(uap_env)


@pytest.fixture(scope="module")
def bus_shim(uap_env: UapEnv, daemon: DaemonProcess) -> Iterator[ShimProcess]:
    yield from shim_with(uap_env, "--no-peer")


def assert_same_daemon(daemon: DaemonProcess, address: str, run: int) -> None:
    assert daemon.process.poll() is None, f"run {run}: uapplaced exited\n{daemon.log()}"
    assert owner_pid(address) == daemon.pid, f"run {run}: another process owns the name"
    assert "lost the bus connection" not in daemon.log()


def assert_all_answered(result: BurstResult, run: int) -> None:
    assert result.answered == result.calls, f"run {run}: {dict(result.outcomes)} {result.samples}"


def test_bus_burst_is_answered_in_full_by_the_same_daemon(
    daemon: DaemonProcess, uap_env: UapEnv
) -> None:
    for run in range(1, RUNS + 1):
        result = asyncio.run(bus_burst(uap_env.bus_address, CALLS, CONNECTIONS))
        assert_all_answered(result, run)
        assert_same_daemon(daemon, uap_env.bus_address, run)


def test_shim_burst_over_the_peer_socket_has_no_5xx(
    daemon: DaemonProcess, uap_env: UapEnv, peer_shim: ShimProcess
) -> None:
    for run in range(1, RUNS + 1):
        result = asyncio.run(http_burst(peer_shim.base_url, CALLS, CONNECTIONS))
        assert_all_answered(result, run)
        assert_same_daemon(daemon, uap_env.bus_address, run)
    assert "admits go over the peer socket" in peer_shim.log()
    assert "peer socket lost" not in peer_shim.log()


def test_shim_burst_over_the_bus_has_no_5xx(
    daemon: DaemonProcess, uap_env: UapEnv, bus_shim: ShimProcess
) -> None:
    for run in range(1, RUNS + 1):
        result = asyncio.run(http_burst(bus_shim.base_url, CALLS, CONNECTIONS))
        assert_all_answered(result, run)
        assert_same_daemon(daemon, uap_env.bus_address, run)
    assert "peer socket" not in bus_shim.log()


@pytest.mark.parametrize("shim_kind", ["peer", "bus"])
def test_shim_burst_of_long_ids_over_many_connections_has_no_5xx(
    daemon: DaemonProcess,
    uap_env: UapEnv,
    peer_shim: ShimProcess,
    bus_shim: ShimProcess,
    shim_kind: str,
) -> None:
    """The issue's flood shape: 1 KB model ids, 200 connections at once (under the cap)."""
    shim = peer_shim if shim_kind == "peer" else bus_shim
    result = asyncio.run(http_burst(shim.base_url, CALLS, 200, model="m" * 1000))
    assert_all_answered(result, 1)
    assert_same_daemon(daemon, uap_env.bus_address, 1)
