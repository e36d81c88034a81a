"""In-memory llama.cpp routers for the enforcement unit tier (issue 19).

- :class:`FakeRouters`: a :class:`~uapplace.io.router.RouterProbe` over a dict of model
  statuses per router endpoint. A router answers only while its unit is active (in
  :class:`~enforce_fakes.FakeUnits`); when its unit goes down every model is
  ``unloaded`` (the router takes its children with it). Loads and unloads are
  scripted: a load that fails (``failed``, exit code 1), one that never ends
  (``loading``), an unload the child ignores.
- :class:`RouterWorld`: one router unit hosting ``ra`` (14,000 MiB) and ``rb``
  (16,000 MiB) on a 24 GiB gpu0 where they never fit together (and, when asked, small
  sibling models beside them), the enforcement fakes around it, gpu0's reading derived
  from the loaded models, and a real :class:`~uapplace.enforce.enforcer.Enforcer` with
  tiny bounds. The start-up repair of a router run over it: ``test_recovery_router``.

The same flows on a contained ``systemd --user`` with the fake router as a real unit:
``tests/systemd/test_router_pause.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from enforce_fakes import (
    GPU,
    HOST,
    FakeEngines,
    FakeUnits,
    ListHost,
    assert_ended_cleanly,
    fast_enforcer,
    host_reading,
    measured,
    park_on,
)

from tests.worlds.builders import MEASURED_AT
from uapplace.core.model import (
    DeviceKind,
    DeviceReading,
    Model,
    PendingEntry,
    ProbeSource,
    ProcessUsage,
    Registry,
    Resident,
    ResidentState,
)
from uapplace.files.journal import Journal
from uapplace.io.router import RouterError, RouterModel

ROUTER_UNIT = "router.service"
ROUTER = "http://127.0.0.1:18080"
MIB = {"ra": 14000.0, "rb": 16000.0}


@dataclass
class FakeRouters:
    """A :class:`~uapplace.io.router.RouterProbe` over in-memory statuses."""

    units: FakeUnits
    unit_of: dict[str, str]
    """Router endpoint → its unit."""
    ids: dict[str, list[str]]
    """Router endpoint → the model ids it knows."""
    status: dict[str, str] = field(default_factory=dict)
    """Model id → ``unloaded`` / ``loading`` / ``loaded`` (absent: unloaded)."""
    failed: dict[str, int] = field(default_factory=dict)
    """Model id → the exit code of its last child, when that was a failure."""
    fail_load: set[str] = field(default_factory=set)
    never_loads: set[str] = field(default_factory=set)
    ignores_unload: set[str] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)
    """``load <id>`` / ``unload <id>``, in order."""
    child: dict[str, int] = field(default_factory=dict)
    """Model id → its child's PID while it runs."""
    _pids: itertools.count[int] = field(default_factory=lambda: itertools.count(7000))

    def __post_init__(self) -> None:
        self.units.on_change(self._unit_changed)

    def _unit_changed(self, unit: str, state: Any) -> None:
        if state.active_state == "active":
            return
        for endpoint, router_unit in self.unit_of.items():
            if router_unit == unit:
                for model_id in self.ids[endpoint]:
                    self.status[model_id] = "unloaded"
                    self.child.pop(model_id, None)

    def _answering(self, endpoint: str) -> list[str]:
        unit = self.unit_of.get(endpoint, "")
        if self.units.active.get(unit, "inactive") != "active":
            raise RouterError(f"GET {endpoint}/models: connection refused")
        return self.ids[endpoint]

    def loaded_ids(self) -> list[str]:
        return sorted(k for k, v in self.status.items() if v == "loaded")

    async def models(self, endpoint: str, timeout_s: float) -> dict[str, RouterModel]:
        return {
            model_id: RouterModel(
                model_id,
                self.status.get(model_id, "unloaded"),
                failed=model_id in self.failed,
                exit_code=self.failed.get(model_id),
            )
            for model_id in self._answering(endpoint)
        }

    async def load(self, endpoint: str, model_id: str, timeout_s: float) -> None:
        self.calls.append(f"load {model_id}")
        if model_id not in self._answering(endpoint):
            raise RouterError(f"POST {endpoint}/models/load: HTTP 404 (File Not Found)")
        if self.status.get(model_id, "unloaded") != "unloaded":
            return
        self.failed.pop(model_id, None)
        if model_id in self.fail_load:
            self.status[model_id], self.failed[model_id] = "unloaded", 1
        elif model_id in self.never_loads:
            self.status[model_id] = "loading"
            self.child[model_id] = next(self._pids)
        else:
            self.status[model_id] = "loaded"
            self.child[model_id] = next(self._pids)

    async def unload(self, endpoint: str, model_id: str, timeout_s: float) -> None:
        self.calls.append(f"unload {model_id}")
        self._answering(endpoint)
        if model_id in self.ignores_unload:
            return
        self.status[model_id] = "unloaded"
        self.child.pop(model_id, None)

    async def children(self, pids: Sequence[int], model_id: str) -> list[int]:
        return [self.child[model_id]] if model_id in self.child else []

    async def metrics(
        self, endpoint: str, model_id: str, timeout_s: float
    ) -> dict[str, float | str]:
        return {}


def router_model(key: str, mib: float) -> Model:
    config = measured(f"{key}-q4", mib, pause_lever="llamacpp-router")
    return Model(
        key, key.upper(), "llama.cpp", {config.key: config}, unit="router", endpoint=ROUTER
    )


def router_registry(mib: Mapping[str, float] = MIB) -> Registry:
    models = {key: router_model(key, size) for key, size in mib.items()}
    return Registry({GPU.key: GPU, HOST.key: HOST}, models)


def router_resident(
    model: str, state: ResidentState = ResidentState.HOT, mib: float | None = None
) -> Resident:
    paused = state is ResidentState.PAUSED
    return Resident(
        model=model,
        config=f"{model}-q4",
        device="gpu0",
        engine="llama.cpp",
        endpoint=ROUTER,
        unit=ROUTER_UNIT,
        state=state,
        gpu_mib=0.0 if paused else (mib if mib is not None else MIB[model]),
        host_rss_mib=0.0 if paused else 64.0,
        since=MEASURED_AT,
    )


class RouterWorld:
    """The router unit, ``ra``/``rb`` (and ``siblings``: model key → MiB, more models of
    the same router), the fakes around them and an enforcer."""

    def __init__(
        self,
        tmp_path: Path,
        running: Sequence[Resident],
        *,
        router_up: bool = True,
        extra: Sequence[Model] = (),
        siblings: Mapping[str, float] = MappingProxyType({}),
    ) -> None:
        self.mib = {**MIB, **siblings}
        registry = router_registry(self.mib)
        if extra:
            registry = replace(registry, models={**registry.models, **{m.key: m for m in extra}})
        self.journal = Journal(tmp_path / "enforcement-journal.json")
        self.units = FakeUnits(journal=self.journal)
        if router_up:
            self.units.already_running(ROUTER_UNIT)
        endpoints = {ROUTER: ROUTER_UNIT}
        for model in extra:
            assert model.endpoint is not None and model.unit is not None
            endpoints[model.endpoint] = f"{model.unit}.service"
        self.engines = FakeEngines(self.units, endpoints, journal=self.journal)
        self.engines.served[ROUTER] = sorted(self.mib)
        self.routers = FakeRouters(self.units, {ROUTER: ROUTER_UNIT}, {ROUTER: sorted(self.mib)})
        for resident in running:
            if resident.unit != ROUTER_UNIT:
                self.units.already_running(resident.unit or "")
            elif resident.state is not ResidentState.PAUSED:
                self.routers.status[resident.model] = "loaded"
                self.routers.child[resident.model] = next(self.routers._pids)
        self.host = ListHost(reg=registry, live=list(running), readings=self.readings)
        self.enforcer = fast_enforcer(
            self.host, self.units, self.journal, self.engines, routers=self.routers
        )

    def readings(self) -> dict[str, DeviceReading]:
        """gpu0 holds what the loaded router models (and running extra units) hold."""
        processes = [
            ProcessUsage(self.routers.child[m], self.mib[m], f"llama-server --alias {m}")
            for m in self.routers.loaded_ids()
            if m in self.routers.child
        ]
        for model in self.host.reg.models.values():
            if model.unit == "router" or model.unit is None:
                continue
            state = self.units.state_now(f"{model.unit}.service")
            if state.active_state == "active":
                config = next(iter(model.configs.values()))
                processes.append(ProcessUsage(state.main_pid, config.resident_gpu_mib or 0.0))
        used = sum(p.used_mib for p in processes)
        gpu = DeviceReading(
            "gpu0", DeviceKind.GPU, GPU.total_mib, GPU.total_mib - used, ProbeSource.SIM
        )
        return {"gpu0": replace(gpu, processes=tuple(processes)), "cpu0": host_reading(100000.0)}

    def park(self, model: str) -> PendingEntry:
        return park_on(self.host, self.readings(), model, f"plc-{model}")

    def states(self) -> dict[str, str]:
        return self.host.states()

    def assert_ended_cleanly(self) -> None:
        assert_ended_cleanly(self.journal, self.enforcer)
