"""Every path and environment knob uapplace reads, in one place.

Nothing else in the package reads ``os.environ`` for a path: modules take a
:class:`Paths` (built once by the daemon, the CLI or a test) so a test can point
the whole program at a temporary directory by building its own.

Knobs:

=========================  ==================================================
``UAP_HOME``               machine-local state, default ``~/.uap``: the ledger
                           ``placement.json``, the local registry
                           ``model-registry.json``, the auto policy
``UAP_PLACEMENT_AUTO``     auto policy file, default ``$UAP_HOME/placement-auto.json``
``UAPPLACE_CONFIG_DIR``    the shipped defaults (``model-registry.json``,
                           ``capacity-policy.json``), default the shipped ``config/``
                           (:mod:`uapplace.files.shipped`: the checkout's or the wheel's)
``UAPPLACE_SIM_GPU``       simulated GPU state file; when set, it replaces NVML
``XDG_RUNTIME_DIR``        the shim token lives in ``$XDG_RUNTIME_DIR/uapplace/token``,
                           uapplaced's Admit-only peer socket in ``…/uapplace/bus``
``XDG_CONFIG_HOME``        Conflicts= drop-ins go under ``$XDG_CONFIG_HOME/systemd/user``
                           (so does ``uapplaced.service`` from ``uapplace install``)
``XDG_DATA_HOME``          ``uapplace install`` writes the D-Bus activation file to
                           ``$XDG_DATA_HOME/dbus-1/services``
``UAP_PROXY_URL``          the proxy's base URL, default ``http://127.0.0.1:4000``
``PROXY_AUTH_TOKEN``       bearer token for the proxy's internal routes; else the last
                           ``PROXY_AUTH_TOKEN=`` line of ``~/.config/uap/anthropic-proxy.env``
``UAPPLACE_SHIM_PORT``     the shim's port, default 3847
``UAPPLACE_SYSTEM_BUS_ADDRESS``  the system bus asked for polkit; else
                           ``DBUS_SYSTEM_BUS_ADDRESS``, else the standard socket;
                           set but empty → no system bus (same-uid checks only)
``UAPPLACE_TEST_CRASH_AT``  tests only: SIGKILL uapplaced right after the enforcement
                           journal records this step (crash-recovery tests)
``UAPPLACE_TEST_PENDING_TTL_S``  tests and bench only: pending entries live this many
                           seconds instead of 120 (docs/http-contract.md §1); ignored unless > 0
=========================  ==================================================
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from uapplace.files import shipped

BUS_NAME = "org.uap.Placement1"
OBJECT_PATH = "/org/uap/Placement1"
INTERFACE = "org.uap.Placement1"
DEFAULT_SHIM_PORT = 3847
DEFAULT_PROXY_URL = "http://127.0.0.1:4000"
DEFAULT_SYSTEM_BUS_ADDRESS = "unix:path=/run/dbus/system_bus_socket"


@dataclass(frozen=True)
class Paths:
    uap_home: Path
    config_dir: Path
    runtime_dir: Path
    config_home: Path
    auto_policy: Path
    sim_gpu: Path | None
    proxy_url: str
    proxy_env_file: Path
    proxy_token_env: str | None
    shim_port: int
    system_bus_address: str | None = DEFAULT_SYSTEM_BUS_ADDRESS
    """Where polkit is asked; ``None`` → no system bus, only the daemon's own uid may mutate."""
    data_home: Path = field(default_factory=lambda: Path.home() / ".local" / "share")
    """``XDG_DATA_HOME``: ``uapplace install`` puts the D-Bus activation file under it."""
    test_crash_at: str | None = None
    """``UAPPLACE_TEST_CRASH_AT``: tests only. The daemon SIGKILLs itself right after the
    enforcement journal records this step (:mod:`uapplace.files.journal`); unset in production."""
    test_pending_ttl_s: float | None = None
    """``UAPPLACE_TEST_PENDING_TTL_S``: tests and ``bench/flood_rss.py`` only (watch state
    shrink after expiry without waiting 120 s); ``None`` → the contract's 120 s."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Paths:
        env = os.environ if env is None else env
        home = Path(env.get("HOME") or Path.home())
        uap_home = Path(env.get("UAP_HOME") or home / ".uap")
        runtime_dir = Path(env.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}")
        config_home = Path(env.get("XDG_CONFIG_HOME") or home / ".config")
        sim = env.get("UAPPLACE_SIM_GPU")
        port_text = env.get("UAPPLACE_SHIM_PORT", "")
        return cls(
            uap_home=uap_home,
            config_dir=Path(env.get("UAPPLACE_CONFIG_DIR") or shipped.path("config")),
            runtime_dir=runtime_dir,
            config_home=config_home,
            auto_policy=Path(env.get("UAP_PLACEMENT_AUTO") or uap_home / "placement-auto.json"),
            sim_gpu=Path(sim) if sim else None,
            proxy_url=(env.get("UAP_PROXY_URL") or DEFAULT_PROXY_URL).rstrip("/"),
            proxy_env_file=config_home / "uap" / "anthropic-proxy.env",
            proxy_token_env=env.get("PROXY_AUTH_TOKEN") or None,
            shim_port=int(port_text) if port_text.isdigit() else DEFAULT_SHIM_PORT,
            system_bus_address=_system_bus_address(env),
            data_home=Path(env.get("XDG_DATA_HOME") or home / ".local" / "share"),
            test_crash_at=env.get("UAPPLACE_TEST_CRASH_AT") or None,
            test_pending_ttl_s=_positive_seconds(env.get("UAPPLACE_TEST_PENDING_TTL_S")),
        )

    @property
    def ledger(self) -> Path:
        return self.uap_home / "placement.json"

    @property
    def local_registry(self) -> Path:
        return self.uap_home / "model-registry.json"

    @property
    def repo_registry(self) -> Path:
        return self.config_dir / "model-registry.json"

    @property
    def capacity_policy(self) -> Path:
        return self.config_dir / "capacity-policy.json"

    @property
    def dbus_services_dir(self) -> Path:
        """Where the session bus looks for activation files of the user's own services."""
        return self.data_home / "dbus-1" / "services"

    @property
    def enforcement_timeouts(self) -> Path:
        """Optional overrides of the enforcement timeouts (``timeouts.Timeouts.load``)."""
        return self.uap_home / "enforcement-timeouts.json"

    @property
    def enforcement_journal(self) -> Path:
        """The fsynced record of the enforcement run in progress (:mod:`uapplace.files.journal`)."""
        return self.uap_home / "enforcement-journal.json"

    @property
    def token_file(self) -> Path:
        return self.runtime_dir / "uapplace" / "token"

    @property
    def peer_socket(self) -> Path:
        """uapplaced's peer-to-peer D-Bus socket for ``Admit`` (:mod:`uapplace.bus.peer`)."""
        return self.runtime_dir / "uapplace" / "bus"

    @property
    def user_unit_dir(self) -> Path:
        """Where Conflicts= drop-ins are written; nothing is ever written elsewhere."""
        return self.config_home / "systemd" / "user"

    def proxy_token(self) -> str | None:
        """``PROXY_AUTH_TOKEN`` from the environment, else the env file's last line for it."""
        if self.proxy_token_env:
            return self.proxy_token_env
        try:
            lines = self.proxy_env_file.read_text(encoding="utf-8").splitlines()
        except OSError:
            return None
        token: str | None = None
        for line in lines:
            if line.startswith("PROXY_AUTH_TOKEN="):
                token = line.split("=", 1)[1].strip().strip('"').strip("'") or None
        return token


def _positive_seconds(text: str | None) -> float | None:
    try:
        value = float(text or "")
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def _system_bus_address(env: Mapping[str, str]) -> str | None:
    if "UAPPLACE_SYSTEM_BUS_ADDRESS" in env:
        return env["UAPPLACE_SYSTEM_BUS_ADDRESS"] or None
    return env.get("DBUS_SYSTEM_BUS_ADDRESS") or DEFAULT_SYSTEM_BUS_ADDRESS
