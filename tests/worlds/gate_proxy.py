"""The gate proxy (:mod:`uapplace.sim.gateproxy`) as its own process: an outside proxy.

Used by the systemd tier's single-upstream demo (``tests/systemd/test_demo_single_upstream.py``);
and by the bus tier's proxy-token test (``tests/bus/test_proxy_token.py``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from uapplace.sim.gateproxy import READY_PREFIX

NO_CONTROLLER = "http://127.0.0.1:9"
"""A controller address nothing answers: these tests drive only the proxy's internal routes."""


@contextmanager
def gate_proxy_process(env: Mapping[str, str], *args: str) -> Iterator[str]:
    """Start the gate proxy with ``env`` (its ``PROXY_AUTH_TOKEN`` among it) and ``args``;
    its base URL, read from the ready line it prints. Terminated when the block ends."""
    argv = [sys.executable, "-m", "uapplace.sim.gateproxy", "--controller", NO_CONTROLLER, *args]
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(env),
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith(READY_PREFIX), line
        yield line[len(READY_PREFIX) :].strip()
    finally:
        process.terminate()
        process.wait(30)
