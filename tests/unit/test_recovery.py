"""The start-up repair table of :mod:`uapplace.recovery.recover`, row by row, over fakes.

The units, engines and controller are in-memory fakes with the interfaces the
repair uses (:class:`~uapplace.io.seams.UnitControl`,
:class:`~uapplace.io.seams.EngineProbe`, :class:`~uapplace.recovery.checks.RecoveryHost`);
the journal is the real file. The fake units log every job, so the order
"the new unit is down before a victim starts" is checked, not assumed. The same
table against real units and a real SIGKILL: ``tests/systemd/test_crash_recovery.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from tests.worlds.builders import gpu_reading
from uapplace.core.alerts import Alert, AlertBoard, AlertKind, Severity
from uapplace.core.model import (
    Config,
    ConfigStatus,
    DeviceReading,
    Model,
    ProcessUsage,
    Registry,
    Resident,
    ResidentState,
)
from uapplace.files.capacity import ServicePolicy
from uapplace.files.journal import Journal, RunRecord
from uapplace.files.timeouts import Timeouts
from uapplace.io.engines import EngineError
from uapplace.io.units import JobOutcome, UnitState
from uapplace.recovery.recover import recover
from uapplace.recovery.repair import Outcome, RecoveryReport

FAST = Timeouts(
    verify_up_s=0.3,
    verify_free_s=0.2,
    verify_free_poll_s=0.01,
    rollback_up_s=0.3,
    stop_s=1.0,
    start_s=1.0,
    http_s=0.1,
)
ALPHA_URL = "http://127.0.0.1:1001"
BETA_URL = "http://127.0.0.1:1002"
GAMMA_URL = "http://127.0.0.1:1003"


def resident(model: str, config: str, endpoint: str, mib: float = 8000.0) -> Resident:
    return Resident(
        model=model,
        config=config,
        device="gpu0",
        engine="llama.cpp",
        endpoint=endpoint,
        unit=f"{model}.service",
        state=ResidentState.HOT,
        gpu_mib=mib,
        host_rss_mib=64.0,
        since="2026-10-08T14:02:00Z",
    )


ALPHA = resident("alpha", "a1", ALPHA_URL)
GAMMA = resident("gamma", "g1", GAMMA_URL)
BETA = resident("beta", "b1", BETA_URL, mib=16000.0)


def run_record(
    step: str,
    *,
    kind: str = "apply",
    victims: Sequence[Resident] = (ALPHA,),
    new: Resident | None = BETA,
    paused: Sequence[Resident] = (),
    wake: Resident | None = None,
) -> RunRecord:
    requested = "beta-latest" if new is not None else "alpha"
    if wake is not None:
        requested = wake.model
    return RunRecord(
        run_id="run-cafe",
        kind=kind,  # type: ignore[arg-type]
        requested=requested,
        device="gpu0",
        placement_id="plc-000001" if kind == "apply" else None,
        victims=tuple(victims),
        new=new,
        accepted_ids=("beta-latest", "beta", "b1") if new is not None and wake is None else (),
        step=step,
        started_at=1_790_000_000.0,
        updated_at=1_790_000_001.0,
        detail="verify-up: beta.service not healthy after 600s" if "rollback" in step else "",
        victim_actions={v.signature: "pause" if v in paused else "stop" for v in victims},
        paused=tuple(v.signature for v in paused),
        wake=wake,
    )


# --------------------------------------------------------------------------- fakes


@dataclass
class FakeUnits:
    states: dict[str, str]
    refuse_start: set[str] = field(default_factory=set)
    refuse_stop: set[str] = field(default_factory=set)
    jobs: list[str] = field(default_factory=list)

    async def state(self, name: str) -> UnitState:
        active = self.states.get(name, "inactive")
        sub = {"active": "running", "inactive": "dead", "failed": "failed"}.get(active, active)
        return UnitState(active, sub, "loaded", 100 if active == "active" else 0, "")

    async def start_unit(self, name: str, timeout: float) -> JobOutcome:  # noqa: ASYNC109
        self.jobs.append(f"start {name}")
        if name in self.refuse_start:
            self.states[name] = "failed"
            return JobOutcome(name, "failed")
        self.states[name] = "active"
        return JobOutcome(name, "done", "/job/1")

    async def stop_unit(self, name: str, timeout: float) -> JobOutcome:  # noqa: ASYNC109
        self.jobs.append(f"stop {name}")
        if name in self.refuse_stop:
            return JobOutcome(name, "timeout")
        self.states[name] = "inactive"
        return JobOutcome(name, "done", "/job/2")

    async def pids(self, name: str) -> list[int]:
        return [100] if self.states.get(name) == "active" else []

    def on_change(self, callback: Callable[[str, UnitState], None]) -> None:
        pass  # the repair reads states; it never follows them


@dataclass
class FakeEngines:
    """Each endpoint is healthy only while its unit is active (like a real engine)."""

    units: FakeUnits
    served: dict[str, list[str]] = field(
        default_factory=lambda: {ALPHA_URL: ["alpha"], BETA_URL: ["beta"], GAMMA_URL: ["gamma"]}
    )
    never_healthy: set[str] = field(default_factory=set)
    kv: str = "int8"
    asleep: set[str] = field(default_factory=set)
    """Endpoints whose engine sleeps (vLLM: still healthy, still lists its id)."""
    refuse_wake: set[str] = field(default_factory=set)
    refuse_sleep: set[str] = field(default_factory=set)
    levers: list[str] = field(default_factory=list)

    def _unit(self, endpoint: str) -> str:
        return {ALPHA_URL: "alpha", BETA_URL: "beta", GAMMA_URL: "gamma"}[endpoint] + ".service"

    async def health(self, endpoint: str, timeout_s: float) -> bool:
        up = self.units.states.get(self._unit(endpoint)) == "active"
        return up and endpoint not in self.never_healthy

    async def served_ids(self, endpoint: str, timeout_s: float) -> list[str]:
        if not await self.health(endpoint, timeout_s):
            raise EngineError(f"{endpoint}/v1/models: connection refused")
        return self.served[endpoint]

    async def metrics(self, endpoint: str, timeout_s: float) -> dict[str, float | str]:
        return {"kv": self.kv}

    async def is_sleeping(self, endpoint: str, timeout_s: float) -> bool | None:
        if not await self.health(endpoint, timeout_s):
            return None
        return endpoint in self.asleep

    async def sleep(self, endpoint: str, level: int, timeout_s: float) -> None:
        self.levers.append(f"sleep {endpoint}")
        if endpoint in self.refuse_sleep:
            raise EngineError(f"{endpoint}/sleep: 500")
        self.asleep.add(endpoint)

    async def wake(self, endpoint: str, timeout_s: float) -> None:
        self.levers.append(f"wake {endpoint}")
        if endpoint in self.refuse_wake:
            raise EngineError(f"{endpoint}/wake_up: 500")
        self.asleep.discard(endpoint)

    async def get_reply(
        self, endpoint: str, route: str, timeout_s: float
    ) -> tuple[int | None, str]:
        raise AssertionError(f"recovery never asks {endpoint}{route}: only a drain does")


@dataclass
class FakeHost:
    residents_now: list[Resident]
    pending_ids: set[str] = field(default_factory=lambda: {"plc-000001"})
    free_mib: float = 24576.0
    processes: tuple[ProcessUsage, ...] = ()
    alerts: list[tuple[AlertKind, Severity, str, str, dict[str, Any]]] = field(default_factory=list)
    alert_board: AlertBoard = field(init=False)
    resolved: list[tuple[str, str]] = field(default_factory=list)
    replans: int = 0
    policy: ServicePolicy | None = None
    configs: dict[str, Config] = field(default_factory=dict)
    """Model key → its one config, where a test needs the config's facts."""

    def __post_init__(self) -> None:
        self.alert_board = AlertBoard(lambda: 0.0, self._note_alert)

    def registry(self) -> Registry:
        models = {
            key: Model(
                key=key,
                display=key,
                engine="llama.cpp",
                configs={self.configs[key].key: self.configs[key]} if key in self.configs else {},
                service=f"{key}-srv",
            )
            for key in ("alpha", "beta", "gamma")
        }
        return Registry(devices={}, models=models)

    def residents(self) -> Sequence[Resident]:
        return tuple(self.residents_now)

    def put_resident(self, resident: Resident) -> None:
        key = (resident.model, resident.config, resident.device)
        self.residents_now = [
            r for r in self.residents_now if (r.model, r.config, r.device) != key
        ] + [resident]

    def drop_resident(self, resident: Resident) -> None:
        self.residents_now = [r for r in self.residents_now if r is not resident]

    def resolve_entry(self, placement_id: str, outcome: str) -> bool:
        if placement_id not in self.pending_ids:
            return False
        self.pending_ids.discard(placement_id)
        self.resolved.append((placement_id, outcome))
        return True

    def resolve_served(self, resident: Resident, outcome: str) -> list[str]:
        return []

    def service_policy(self, model: Model) -> ServicePolicy | None:
        return self.policy if self.policy is not None and model.key == "beta" else None

    async def read_devices(self) -> Mapping[str, DeviceReading]:
        return {"gpu0": gpu_reading(24576.0, self.free_mib, processes=self.processes)}

    def _note_alert(self, alert: Alert) -> None:
        self.alerts.append(
            (alert.kind, alert.severity, alert.subject, alert.message, dict(alert.detail))
        )

    async def replan_pending(self) -> None:
        self.replans += 1

    def states(self) -> dict[str, str]:
        return {r.model: r.state.value for r in self.residents_now}


@dataclass
class Scene:
    journal: Journal
    units: FakeUnits
    engines: FakeEngines
    host: FakeHost

    async def recover(self) -> RecoveryReport | None:
        return await recover(self.journal, self.host, self.units, timeouts=FAST, probe=self.engines)

    def only_alert(self) -> tuple[AlertKind, Severity, str, str, dict[str, Any]]:
        assert len(self.host.alerts) == 1, self.host.alerts
        return self.host.alerts[0]


def scene(
    tmp_path: Path,
    record: RunRecord | None,
    units: Mapping[str, str],
    residents: Sequence[Resident] = (),
) -> Scene:
    journal = Journal(tmp_path / "enforcement-journal.json")
    if record is not None:
        journal.write(record)
    fake_units = FakeUnits(dict(units))
    return Scene(journal, fake_units, FakeEngines(fake_units), FakeHost(list(residents)))


DRAINING_ALPHA = replace(ALPHA, state=ResidentState.DRAINING)
PAUSED_GAMMA = replace(GAMMA, state=ResidentState.PAUSED, gpu_mib=500.0)

NEW_UP = MappingProxyType({"alpha.service": "inactive", "beta.service": "active"})
"""The victim down and the new unit running: the swap got as far as its start."""
VICTIM_UP = MappingProxyType({"alpha.service": "active", "beta.service": "inactive"})
"""The victim still running and the new unit down: the swap stopped nothing yet."""
BOTH_UP = MappingProxyType({"alpha.service": "active", "beta.service": "active"})
BOTH_DOWN = MappingProxyType({"alpha.service": "inactive", "beta.service": "inactive"})


def swap_scene(
    tmp_path: Path,
    step: str,
    units: Mapping[str, str],
    residents: Sequence[Resident] = (DRAINING_ALPHA,),
    paused: Sequence[Resident] = (),
) -> Scene:
    """The swap most rows start from: ALPHA gives way to BETA, cut short at ``step``."""
    return scene(tmp_path, run_record(step, paused=paused), units, residents)


def wake_scene(tmp_path: Path, step: str) -> Scene:
    """A wake run for the paused GAMMA that stopped ALPHA to make room, cut short at ``step``."""
    record = run_record(step, victims=(ALPHA,), new=None, wake=PAUSED_GAMMA)
    return scene(
        tmp_path,
        record,
        {"alpha.service": "inactive", "gamma.service": "active"},
        [DRAINING_ALPHA, PAUSED_GAMMA],
    )


async def recovered(s: Scene, outcome: Outcome) -> RecoveryReport:
    """Run the repair once; every row names the outcome it must end in."""
    report = await s.recover()
    assert report is not None and report.outcome is outcome
    return report


# --------------------------------------------------------------------------- rows 0 and 1


async def test_row0_no_journal_repairs_nothing_raises_nothing_and_replans(tmp_path: Path) -> None:
    s = scene(tmp_path, None, {"alpha.service": "active"}, [ALPHA])

    assert await s.recover() is None

    assert s.host.alerts == [] and s.units.jobs == []
    assert s.host.replans == 1


async def test_row1_an_unreadable_journal_is_moved_aside_and_needs_a_human(
    tmp_path: Path,
) -> None:
    s = scene(tmp_path, None, {})
    s.journal.path.write_text('{"version": 1, "run_id": ', encoding="utf-8")

    await recovered(s, Outcome.NEEDS_HUMAN)

    kind, severity, subject, message, _ = s.only_alert()
    assert (kind, severity, subject) == (
        AlertKind.RECOVERY_NEEDED,
        Severity.CRITICAL,
        "enforcement-journal",
    )
    assert "invalid JSON" in message and ".broken" in message
    assert not s.journal.path.exists()
    assert s.journal.path.with_name("enforcement-journal.json.broken").exists()
    assert s.host.replans == 1 and s.units.jobs == []


# --------------------------------------------------------------------------- row 2: finish


@pytest.mark.parametrize("step", ["start", "verify-up"])
async def test_row2_a_new_unit_up_and_verified_with_its_victims_down_finishes_the_run(
    tmp_path: Path, step: str
) -> None:
    s = swap_scene(tmp_path, step, NEW_UP)

    await recovered(s, Outcome.FINISHED)

    assert s.host.states() == {"beta": "hot"}
    assert s.host.resolved == [("plc-000001", "applied")]
    assert s.units.jobs == []  # nothing to start or stop
    kind, severity, subject, message, detail = s.only_alert()
    assert (kind, severity, subject) == (AlertKind.RECOVERY_DONE, Severity.WARNING, "run-cafe")
    assert "finished" in message and "published beta/b1 hot" in message
    assert detail["outcome"] == "finished" and detail["step"] == step
    assert detail["journal"]["run_id"] == "run-cafe"
    assert not s.journal.path.exists()
    assert s.host.replans == 1


async def test_row2_an_unload_whose_victims_are_all_down_is_finished(tmp_path: Path) -> None:
    record = run_record("verify-free", kind="unload", victims=(ALPHA, GAMMA), new=None)
    s = scene(
        tmp_path,
        record,
        {"alpha.service": "inactive", "gamma.service": "inactive"},
        [DRAINING_ALPHA, GAMMA],
    )

    await recovered(s, Outcome.FINISHED)

    assert s.host.states() == {}
    assert s.units.jobs == []


# --------------------------------------------------------------------------- rows 3, 4: roll back


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (lambda e: e.served.update({BETA_URL: ["wrong-beta"]}), "serves [wrong-beta]"),
        (lambda e: e.never_healthy.add(BETA_URL), "not healthy after 0.3s"),
        (lambda e: setattr(e, "kv", "f16"), "metricsMustMatch"),
    ],
)
async def test_row3_a_new_unit_that_fails_verify_up_is_stopped_before_the_victim_restarts(
    tmp_path: Path, spoil: Any, why: str
) -> None:
    s = swap_scene(tmp_path, "verify-up", NEW_UP)
    s.host.policy = ServicePolicy("beta-srv", None, {"kv": "int8"}, (), None)
    spoil(s.engines)

    await recovered(s, Outcome.ROLLED_BACK)

    assert s.units.jobs == ["stop beta.service", "start alpha.service"]
    assert s.host.states() == {"alpha": "hot"}
    assert s.host.resolved == []
    _, _, _, message, _ = s.only_alert()
    assert why in message and "restarted alpha.service" in message
    assert "plc-000001 stays pending, re-planned" in message


async def test_row3_a_victim_running_beside_the_new_unit_keeps_the_device_and_the_new_stops(
    tmp_path: Path,
) -> None:
    s = swap_scene(tmp_path, "verify-up", BOTH_UP)

    report = await recovered(s, Outcome.ROLLED_BACK)

    assert s.units.jobs == ["stop beta.service"]
    assert s.host.states() == {"alpha": "hot"}  # the draining mark is lifted
    assert "two residents on one device" in report.message


@pytest.mark.parametrize("step", ["rollback-stop", "rollback-start"])
async def test_row4_a_run_that_was_rolling_back_is_rolled_back_even_if_the_new_unit_is_fine(
    tmp_path: Path, step: str
) -> None:
    s = swap_scene(tmp_path, step, NEW_UP)

    report = await recovered(s, Outcome.ROLLED_BACK)

    assert s.units.jobs == ["stop beta.service", "start alpha.service"]
    assert "already rolling back (verify-up: beta.service not healthy" in report.message


# --------------------------------------------------------------------------- row 5


async def test_row5_a_new_unit_that_will_not_stop_leaves_the_victims_down_for_a_human(
    tmp_path: Path,
) -> None:
    s = swap_scene(tmp_path, "rollback-stop", NEW_UP, residents=())
    s.units.refuse_stop.add("beta.service")

    await recovered(s, Outcome.NEEDS_HUMAN)

    assert s.units.jobs == ["stop beta.service"]  # alpha NOT started beside it
    kind, severity, _, message, _ = s.only_alert()
    assert (kind, severity) == (AlertKind.RECOVERY_NEEDED, Severity.CRITICAL)
    assert "beta.service is active/running after its stop job (timeout)" in message
    assert not s.journal.path.exists()


# --------------------------------------------------------------------------- row 6


@pytest.mark.parametrize("step", ["stop", "verify-free", "start"])
async def test_row6_victims_all_running_and_the_new_unit_down_means_nothing_changed(
    tmp_path: Path, step: str
) -> None:
    s = swap_scene(tmp_path, step, VICTIM_UP)

    await recovered(s, Outcome.NOTHING_CHANGED)

    assert s.units.jobs == []
    assert s.host.states() == {"alpha": "hot"}
    kind, severity, _, message, _ = s.only_alert()
    assert (kind, severity) == (AlertKind.RECOVERY_DONE, Severity.WARNING)
    assert "nothing to repair" in message


async def test_row6_a_load_alongside_whose_unit_never_started_changed_nothing(
    tmp_path: Path,
) -> None:
    record = run_record("start", kind="load", victims=())
    s = scene(tmp_path, record, {"beta.service": "inactive"})

    await recovered(s, Outcome.NOTHING_CHANGED)

    assert s.units.jobs == [] and s.host.states() == {}


# --------------------------------------------------------------------------- rows 7 (unload) and 8


async def test_row8_an_unload_cut_short_with_one_victim_still_up_restarts_the_other(
    tmp_path: Path,
) -> None:
    record = run_record("stop", kind="unload", victims=(ALPHA, GAMMA), new=None)
    s = scene(
        tmp_path,
        record,
        {"alpha.service": "inactive", "gamma.service": "active"},
        [DRAINING_ALPHA, replace(GAMMA, state=ResidentState.DRAINING)],
    )

    await recovered(s, Outcome.ROLLED_BACK)

    assert s.units.jobs == ["start alpha.service"]
    assert s.host.states() == {"alpha": "hot", "gamma": "hot"}


@pytest.mark.parametrize("step", ["verify-free", "start"])
async def test_row8_a_stopped_victim_is_restarted_and_verified_when_the_new_never_started(
    tmp_path: Path, step: str
) -> None:
    # no residents: the ledger may already have dropped it; the journal still knows it
    s = swap_scene(tmp_path, step, BOTH_DOWN, residents=())

    report = await recovered(s, Outcome.ROLLED_BACK)

    assert s.units.jobs == ["start alpha.service"]
    assert s.host.states() == {"alpha": "hot"}
    assert "restarted alpha.service (alpha/a1 healthy again)" in report.message


# --------------------------------------------------------------------------- rows 9 and 10


async def test_row9_memory_that_does_not_free_keeps_the_victims_down_and_names_the_holder(
    tmp_path: Path,
) -> None:
    s = swap_scene(tmp_path, "verify-free", BOTH_DOWN, residents=())
    s.host.free_mib = 2000.0
    s.host.processes = (ProcessUsage(777, 22000.0, "orphan-engine"),)

    report = await recovered(s, Outcome.NEEDS_HUMAN)

    assert s.units.jobs == []
    assert "pid 777 `orphan-engine` 22,000 MiB" in report.message
    kind, severity, _, _, _ = s.only_alert()
    assert (kind, severity) == (AlertKind.RECOVERY_NEEDED, Severity.CRITICAL)


async def test_row10_a_victim_that_will_not_restart_needs_a_human_and_the_others_restart(
    tmp_path: Path,
) -> None:
    record = run_record("verify-free", victims=(ALPHA, GAMMA))
    s = scene(tmp_path, record, {**BOTH_DOWN, "gamma.service": "inactive"})
    s.units.refuse_start.add("alpha.service")

    report = await recovered(s, Outcome.NEEDS_HUMAN)

    assert s.units.jobs == ["start alpha.service", "start gamma.service"]
    assert s.host.states() == {"gamma": "hot"}
    assert "alpha.service: start job failed; unit failed/failed" in report.message


async def test_row10_a_victim_that_restarts_but_never_turns_healthy_needs_a_human(
    tmp_path: Path,
) -> None:
    s = swap_scene(tmp_path, "rollback-start", BOTH_DOWN, residents=())
    s.engines.never_healthy.add(ALPHA_URL)

    report = await recovered(s, Outcome.NEEDS_HUMAN)

    assert "alpha.service not healthy after 0.3s" in report.message
    assert s.host.states() == {}


# --------------------------------------------------------------------------- rows 11-14: pause


@pytest.mark.parametrize("step", ["pause", "verify-free", "start"])
async def test_row11_a_victim_the_run_put_to_sleep_is_woken_and_verified_before_it_is_hot(
    tmp_path: Path, step: str
) -> None:
    s = swap_scene(tmp_path, step, VICTIM_UP, paused=(ALPHA,))
    s.engines.asleep.add(ALPHA_URL)

    report = await recovered(s, Outcome.ROLLED_BACK)

    assert s.engines.levers == [f"wake {ALPHA_URL}"] and s.units.jobs == []
    assert ALPHA_URL not in s.engines.asleep
    assert s.host.states() == {"alpha": "hot"}
    assert "woke alpha/a1 (the run had paused it)" in report.message


async def test_row11_a_sleeping_victim_that_will_not_wake_stays_paused_and_needs_a_human(
    tmp_path: Path,
) -> None:
    s = swap_scene(tmp_path, "verify-free", VICTIM_UP, paused=(ALPHA,))
    s.engines.asleep.add(ALPHA_URL)
    s.engines.refuse_wake.add(ALPHA_URL)

    await recovered(s, Outcome.NEEDS_HUMAN)

    assert s.host.states() == {"alpha": "paused"}  # never hot while asleep
    kind, severity, subject, message, _ = s.only_alert()
    assert (kind, severity, subject) == (
        AlertKind.RECOVERY_NEEDED,
        Severity.CRITICAL,
        "run-cafe",
    )
    assert "alpha/a1: wake_up" in message and "stays paused" in message


async def test_row11_a_woken_victim_that_fails_the_check_is_not_published(
    tmp_path: Path,
) -> None:
    s = swap_scene(tmp_path, "start", VICTIM_UP, paused=(ALPHA,))
    s.engines.asleep.add(ALPHA_URL)
    s.engines.served[ALPHA_URL] = ["someone-else"]

    report = await recovered(s, Outcome.NEEDS_HUMAN)

    assert s.host.states() == {}  # out of the ledger: the unit sync re-verifies it
    assert "alpha/a1 not published" in report.message and "serves [someone-else]" in report.message


async def test_a_running_victim_is_never_lifted_back_to_hot_without_passing_the_check(
    tmp_path: Path,
) -> None:
    s = swap_scene(tmp_path, "stop", VICTIM_UP)
    s.engines.never_healthy.add(ALPHA_URL)

    report = await recovered(s, Outcome.NEEDS_HUMAN)

    assert s.host.states() == {}
    assert "alpha/a1 not published: alpha.service not healthy after 0.3s" in report.message


async def test_row12_a_victim_asleep_beside_the_verified_new_model_stays_paused(
    tmp_path: Path,
) -> None:
    s = swap_scene(tmp_path, "verify-up", BOTH_UP, paused=(ALPHA,))
    s.engines.asleep.add(ALPHA_URL)

    report = await recovered(s, Outcome.FINISHED)

    assert s.host.states() == {"alpha": "paused", "beta": "hot"}
    assert s.engines.levers == [] and ALPHA_URL in s.engines.asleep  # not woken
    assert s.host.resolved == [("plc-000001", "applied")]
    assert "kept alpha/a1 paused (seen asleep; not woken)" in report.message


async def test_row12_a_paused_victim_found_awake_beside_the_new_unit_keeps_the_device(
    tmp_path: Path,
) -> None:
    s = swap_scene(tmp_path, "verify-up", BOTH_UP, paused=(ALPHA,))

    report = await recovered(s, Outcome.ROLLED_BACK)

    assert s.units.jobs == ["stop beta.service"]
    assert s.host.states() == {"alpha": "hot"}
    assert "alpha/a1 is running too" in report.message


async def test_row13_a_wake_run_whose_woken_engine_verifies_is_finished(tmp_path: Path) -> None:
    s = wake_scene(tmp_path, "wake")

    report = await recovered(s, Outcome.FINISHED)

    assert s.host.states() == {"gamma": "hot"}
    assert s.host.resolved == [("plc-000001", "applied")]
    assert "published gamma/g1 hot" in report.message


async def test_row14_a_wake_run_cut_short_before_the_wake_keeps_it_paused_and_rolls_back(
    tmp_path: Path,
) -> None:
    s = wake_scene(tmp_path, "wake")
    s.engines.asleep.add(GAMMA_URL)

    report = await recovered(s, Outcome.ROLLED_BACK)

    assert s.host.states() == {"alpha": "hot", "gamma": "paused"}
    assert s.units.jobs == ["start alpha.service"]
    assert "gamma/g1 is asleep: kept paused" in report.message


async def test_row14_a_wake_run_cut_short_before_the_wake_never_waits_for_it(
    tmp_path: Path,
) -> None:
    s = wake_scene(tmp_path, "verify-free")
    s.engines.asleep.add(GAMMA_URL)

    report = await recovered(s, Outcome.ROLLED_BACK)

    assert "cut short at verify-free, before the wake" in report.message
    assert s.engines.levers == [] and s.host.states() == {"alpha": "hot", "gamma": "paused"}


async def test_row14_a_woken_engine_failing_its_check_goes_back_to_sleep_first(
    tmp_path: Path,
) -> None:
    s = wake_scene(tmp_path, "rollback-sleep")

    await recovered(s, Outcome.ROLLED_BACK)

    assert s.engines.levers == [f"sleep {GAMMA_URL}"]
    assert s.host.states() == {"alpha": "hot", "gamma": "paused"}


async def test_row14_a_woken_engine_that_will_not_sleep_keeps_the_victims_down(
    tmp_path: Path,
) -> None:
    s = wake_scene(tmp_path, "wake")
    s.engines.served[GAMMA_URL] = ["not-gamma"]
    s.engines.refuse_sleep.add(GAMMA_URL)

    report = await recovered(s, Outcome.NEEDS_HUMAN)

    assert s.units.jobs == []  # alpha NOT started beside an awake gamma
    assert s.host.states() == {}
    assert "gamma/g1 could not be seen asleep" in report.message


async def test_a_journal_written_before_the_pause_fields_still_reads(tmp_path: Path) -> None:
    s = scene(tmp_path, run_record("verify-free"), {"alpha.service": "inactive"})
    old = json.loads(s.journal.path.read_text(encoding="utf-8"))
    for key in ("victim_actions", "paused", "wake"):
        del old[key]
    s.journal.path.write_text(json.dumps(old), encoding="utf-8")

    record = s.journal.read()

    assert record is not None and record.victim_actions == {} and record.wake is None
    assert record.action_of(ALPHA) == "stop" and record.pausing == ()


def test_the_pause_fields_survive_the_round_trip(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "enforcement-journal.json")
    written = run_record("rollback-wake", victims=(ALPHA, GAMMA), paused=(GAMMA,), wake=BETA)
    journal.write(written)

    assert journal.read() == written


async def test_the_new_unit_is_waited_for_within_its_configs_own_bound(tmp_path: Path) -> None:
    s = swap_scene(tmp_path, "verify-up", NEW_UP)
    s.host.configs["beta"] = Config("b1", ConfigStatus.MEASURED, start_timeout_s=0.5)
    s.engines.never_healthy.add(BETA_URL)

    report = await recovered(s, Outcome.ROLLED_BACK)

    assert "not healthy after 0.5s" in report.message  # not FAST.verify_up_s (0.3 s)
    assert "start_timeout_s of beta/b1" in report.message
