"""The configuration in force while ``uapplaced`` runs: the registry, the capacity
policy and the device probe made for them, each kept at its last good version (a broken
machine-local registry or capacity policy on a reload keeps the version read before, and
says so: ``registry_load.local_kept``, :attr:`ConfigState.policy_state`).

The controller owns one :class:`ConfigState` and swaps it on reload; ``wiring.build``
reads the first one before the bus is touched (a bad repo registry is exit 2), and
the auto-policy store and the drop-in writer read the registry of the moment through
:class:`LiveConfig`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from uapplace.core.alerts import AlertBoard, AlertKind, Severity
from uapplace.core.errors import UnknownModel
from uapplace.core.model import DeviceKind, Model, Registry, Resident, ResidentState, iso
from uapplace.core.staleness import LiveLaunch, Staleness, gate_on_launch
from uapplace.core.victims import config_of
from uapplace.files.capacity import (
    CapacityPolicy,
    Finding,
    ServicePolicy,
    load_capacity_policy,
    refusing_policy,
    topology_findings,
)
from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.paths import Paths
from uapplace.files.registry import RegistryLoad, gate_on_devices, load_registry
from uapplace.files.registry_schema import LocalRegistryDoc
from uapplace.io.devices import Probe, make_probe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConfigState:
    """One consistent reading of the config files (immutable: a reload makes a new one)."""

    paths: Paths
    registry_load: RegistryLoad
    probe: Probe
    policy: CapacityPolicy | None
    policy_error: ConfigFileError | None = None
    policy_loaded_at: float | None = None
    """When the policy in force was read (it outlives a broken file: ``policy_state``)."""

    @classmethod
    def read(
        cls,
        paths: Paths,
        clock: Callable[[], float] = time.time,
        last_good_local: LocalRegistryDoc | None = None,
    ) -> ConfigState:
        """Blocking: read registry and policy, probe the devices once.

        Raises :class:`ConfigFileError` when the repo registry is invalid. A local
        registry that is invalid is not taken (its errors are in ``registry_load.errors``):
        ``last_good_local`` stays merged when given (:meth:`reread`), else the repo
        defaults; a capacity policy that is missing or invalid is reported by ``validate``
        and makes every verify-up refuse (:meth:`policy_refusal`).
        """
        load = load_registry(
            paths.repo_registry, paths.local_registry, last_good_local, paths.proxy_env_file
        )
        kept = "keeping the last good one" if load.local_kept else "using the repo defaults"
        for err in load.errors:
            log.error("machine-local registry not taken, %s: %s", kept, err)
        policy, policy_error = _read_policy(paths)
        probe = make_probe(paths, load.registry)
        return cls(
            paths,
            _gated(load, probe),
            probe,
            policy,
            policy_error,
            clock() if policy is not None else None,
        )

    def reread(self, clock: Callable[[], float] = time.time) -> ConfigState:
        """Blocking: the files as they are now; a broken policy or machine-local registry
        keeps the last good one.

        Raises :class:`ConfigFileError` when the repo registry is invalid (the caller
        keeps this state)."""
        fresh = ConfigState.read(self.paths, clock, self.registry_load.local_doc)
        if fresh.policy is None and self.policy is not None:
            log.error(
                "capacity policy reload failed, keeping the last good one: %s", fresh.policy_error
            )
            return replace(fresh, policy=self.policy, policy_loaded_at=self.policy_loaded_at)
        return fresh

    @property
    def registry(self) -> Registry:
        return self.registry_load.registry

    def model_named(self, model: str) -> Model:
        """The registry model a model key, config key or served id names (``UnknownModel``)."""
        resolved = self.registry.lookup(model)
        if resolved is None:
            load = self.registry_load
            raise UnknownModel(
                f"model {model!r} is in no registry file ({load.repo_path}"
                + (f", {load.local_path}" if load.local_path else "")
                + ")"
            )
        return resolved[0]

    @property
    def policy_state(self) -> str:
        """``loaded`` (the file as it is now), ``last-good`` (the file is broken; the policy
        read before stays in force) or ``none`` (no good policy was ever read: every
        verify-up refuses, see :func:`uapplace.files.capacity.refusing_policy`)."""
        if self.policy is None:
            return "none"
        return "last-good" if self.policy_error is not None else "loaded"

    def policy_refusal(self) -> str | None:
        """Why verify-up must refuse every engine now, or ``None`` when a policy is in force."""
        if self.policy is not None:
            return None
        why = str(self.policy_error) if self.policy_error else str(self.paths.capacity_policy)
        return f"no good capacity policy was ever loaded ({why}); verify-up fails closed"

    def service_policy(self, model: Model) -> ServicePolicy | None:
        """The capacity policy's service entry for ``model``; a refusing one when no good
        policy was ever loaded (fail closed, never silently off)."""
        refusal = self.policy_refusal()
        if refusal is not None:
            return refusing_policy(refusal)
        if self.policy is None or model.service is None:
            return None
        return self.policy.services.get(model.service)

    def policy_json(self) -> dict[str, object]:
        """Which capacity policy is in force, for ``validate`` (never silently off)."""
        loaded = self.policy_loaded_at
        return {
            "state": self.policy_state,
            "file": str(self.paths.capacity_policy),
            "loaded_at": iso(loaded) if loaded is not None else None,
            "refusal": self.policy_refusal(),
        }

    def policy_findings(self) -> list[Finding]:
        """The broken capacity policy file's problems, each saying what stays in force."""
        if self.policy_error is None:
            return []
        if self.policy is not None and self.policy_loaded_at is not None:
            kept = (
                "the last good capacity policy, read at "
                f"{iso(self.policy_loaded_at)}, stays in force"
            )
        else:
            kept = "no good capacity policy was ever loaded: every verify-up refuses"
        return [
            Finding("error", str(err.file), err.json_path, f"{err.message} ({kept})")
            for err in self.policy_error.every()
        ]


class LiveConfig:
    """The :class:`ConfigState` in force: swapped by the controller's reload only, read by
    everyone that needs the registry of the moment (auto-policy store, drop-in writer)."""

    def __init__(self, state: ConfigState) -> None:
        self._read = state
        """The files as read (before the stale-measurement gate)."""
        self._live: Mapping[str, LiveLaunch] = {}
        self._stale: tuple[Staleness, ...] = ()
        self._state = state

    @property
    def state(self) -> ConfigState:
        """The state in force: stale measurements are unknown in its registry."""
        return self._state

    @property
    def paths(self) -> Paths:
        return self._state.paths

    def registry(self) -> Registry:
        return self._state.registry

    def swap(self, state: ConfigState) -> None:
        self._read = state
        self._gate()

    @property
    def stale(self) -> tuple[Staleness, ...]:
        """Measured configs whose launch changed since (:mod:`uapplace.core.staleness`)."""
        return self._stale

    @property
    def live(self) -> Mapping[str, LiveLaunch]:
        """Unit file name → what it runs now, as last read (empty before enforcement)."""
        return self._live

    def use_launch(self, live: Mapping[str, LiveLaunch]) -> None:
        """What each unit runs now (``ExecStart``, engine build): a measurement taken
        under another launch is unknown from now on (docs/placement-rules.md §4.1.1)."""
        self._live = live
        self._gate()

    def _gate(self) -> None:
        load = self._read.registry_load
        registry, self._stale = gate_on_launch(load.registry, self._live)
        if not self._stale:
            self._state = self._read
            return
        for stale in self._stale:
            log.error("measurement not used: %s/%s: %s", stale.model, stale.config, stale.message)
        self._state = replace(self._read, registry_load=replace(load, registry=registry))


def report_topology(load: RegistryLoad, alerts: AlertBoard) -> None:
    """Log every model the proxy cannot reach after a switch as an error and raise one
    ``config_error`` alert naming them (at start and after each reload; ``validate`` lists
    them as errors too): with ``proxy.single_upstream``, the endpoints that are not it;
    without, the ones that are not the stock proxy's own ``LLAMA_CPP_BASE``
    (:mod:`uapplace.files.proxyenv`), before a swap makes its clients get 529. The
    warning for several ports with no word on the proxy is ``validate``'s only."""
    findings = [f for f in topology_findings(load) if f.severity == "error"]
    for finding in findings:
        log.error("%s", finding)
    if findings:
        names = "; ".join(f"{f.json_path}: {f.message}" for f in findings[:3])
        more = f" (and {len(findings) - 3} more)" if len(findings) > 3 else ""
        stock = load.registry.single_upstream is None and load.proxy_upstream is not None
        what = "the stock proxy's one upstream" if stock else "the single-upstream proxy"
        alerts.raise_alert(
            AlertKind.CONFIG_ERROR,
            Severity.WARNING,
            f"{load.repo_path}: proxy.single_upstream",
            f"{len(findings)} model(s) unreachable through {what}: {names}{more}",
            {"findings": [f.to_json() for f in findings[:20]]},
        )


def measured_footprint(registry: Registry, resident: Resident) -> Resident:
    """``resident`` with the footprint its config's measurement in ``registry`` records.

    A resident's ``gpu_mib`` and ``host_rss_mib`` are copied from its config when it is
    loaded; a re-measure (``uapplace measure``, then the reload) must not leave the old
    figure in the ledger, where the planner and the reserve check read it (issue 19:
    285.5 MiB kept after 813.7 MiB was measured). So after every reload, a resident whose
    config counts on this machine and was measured on the resident's own device takes
    the new figures (on a CPU device its GPU figure stays 0). A ``paused`` resident keeps
    what its pause left (a residual, or nothing for a router model), and a resident whose
    config is gone or unmeasured keeps what it had. Returns ``resident`` itself when
    nothing changes.

    A resident adopted while its config was unmeasured (no figure at all) sits on a
    guessed device (:func:`uapplace.publish.unitsync.default_device`: the first GPU);
    its first measurement, read from its own PIDs, says where it really is, so it moves
    to ``measured_on`` (issue 19: a llama-server measured on ``cpu0`` stayed a ``gpu0``
    resident of unknown footprint)."""
    if resident.state is ResidentState.PAUSED:
        return resident
    config = config_of(registry, resident)
    if config is None or not config.is_measured:
        return resident
    guessed = resident.gpu_mib is None and resident.host_rss_mib is None
    where, measured_on = resident.device, config.measured_on
    if measured_on != where:
        if not guessed or measured_on is None or measured_on not in registry.devices:
            return resident
        where = measured_on
    device = registry.devices.get(where)
    on_gpu = device is None or device.kind is DeviceKind.GPU
    gpu_mib = config.resident_gpu_mib if on_gpu else 0.0
    if (where, gpu_mib, config.host_rss_mib) == (
        resident.device,
        resident.gpu_mib,
        resident.host_rss_mib,
    ):
        return resident
    return replace(resident, device=where, gpu_mib=gpu_mib, host_rss_mib=config.host_rss_mib)


def reload_findings(err: ConfigFileError | None) -> list[Finding]:
    """A failed registry reload's problems (the last good registry stays in force)."""
    if err is None:
        return []
    return [
        Finding(
            "error",
            str(e.file),
            e.json_path,
            f"{e.message} (uapplaced keeps running on the registry it loaded before)",
        )
        for e in err.every()
    ]


def _gated(load: RegistryLoad, probe: Probe) -> RegistryLoad:
    """Blocking: measurements whose recorded device is not the one the probe sees are unknown."""
    gated = gate_on_devices(load, probe.read())
    for err in gated.device_mismatches:
        log.error("measurement not used on this machine: %s", err)
    return gated


def _read_policy(paths: Paths) -> tuple[CapacityPolicy | None, ConfigFileError | None]:
    try:
        return load_capacity_policy(paths.capacity_policy), None
    except ConfigFileError as err:
        log.warning("capacity policy not used: %s", err)
        return None, err
