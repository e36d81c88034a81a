"""The real ``uapplaced`` on a private session bus, in a throwaway directory.

Owns the world the daemon benchmarks start it in: the registry files (the repo file
and its machine-local measurements), an empty capacity policy, an optional seeded
ledger, one simulated 24 GiB GPU, the environment that points the daemon at all of
it, and starting and stopping the processes. The bus itself is the bus tier's
:func:`tests.bus.dbusmock_fixtures.private_bus`, so tests and benchmarks run on one
bus configuration. Called by ``bench_bus.py`` and ``flood_rss.py``; each keeps the
registry it measures against (its models from :mod:`tests.worlds.seed_docs`) and
passes it in.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any

from uapplace.files.registry import local_measurements
from uapplace.sim.gpu import SimGpu

SIM_GPU_MIB = 24576
STOP_TIMEOUT_S = 15.0


def daemon_env(
    directory: Path,
    address: str,
    registry: Mapping[str, Any],
    *,
    ledger: Mapping[str, Any] | None = None,
    extra: Mapping[str, str] = MappingProxyType({}),
) -> dict[str, str]:
    """Write the daemon's files under ``directory``; the environment that points it there.

    Nothing of the caller's bus, ``UAP*`` or ``XDG_*`` settings leaks in; there is no
    system bus (same-uid authorization) and the proxy URL is one where nothing listens.
    """
    config, home = directory / "config", directory / "home"
    config.mkdir()
    home.mkdir()
    (config / "model-registry.json").write_text(json.dumps(registry))
    # Measured figures count only from the machine-local file (docs/placement-rules.md §4.1).
    (home / "model-registry.json").write_text(json.dumps(local_measurements(registry)))
    (config / "capacity-policy.json").write_text(json.dumps({"services": []}))
    if ledger is not None:
        (home / "placement.json").write_text(json.dumps(ledger))
    SimGpu(directory / "sim.json").create([("bench GPU", SIM_GPU_MIB)])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DBUS_", "UAP", "XDG_"))}
    env.update(
        {
            "DBUS_SESSION_BUS_ADDRESS": address,
            "UAP_HOME": str(home),
            "UAPPLACE_CONFIG_DIR": str(config),
            "UAPPLACE_SIM_GPU": str(directory / "sim.json"),
            "UAPPLACE_SYSTEM_BUS_ADDRESS": "",
            "UAP_PROXY_URL": "http://127.0.0.1:9",
            "XDG_RUNTIME_DIR": str(directory),
            **extra,
        }
    )
    return env


def spawn_daemon(env: Mapping[str, str], log: IO[bytes] | None = None) -> subprocess.Popen[bytes]:
    """``python -m uapplace.daemon`` in ``env``; its output to ``log`` (else inherited)."""
    return subprocess.Popen(
        [sys.executable, "-m", "uapplace.daemon", "--log-level", "WARNING"],
        env=dict(env),
        stdout=log,
        stderr=subprocess.STDOUT if log is not None else None,
    )


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM by PID, then SIGKILL if it has not exited within :data:`STOP_TIMEOUT_S`."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
