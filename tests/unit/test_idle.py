"""The idle-resident unload sweep (docs/placement-rules.md §4.4.2).

Each rule is driven with an injected clock (``tick(now)``), a real policy file,
the real :class:`Admission` for pending entries, and a fake unloader that records
calls (a test double for the enforcer). The "unknown means busy" connection check
runs against a real TCP listener and a real client connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from uapplace.consent.auto import COOLDOWN_S
from uapplace.consent.idle import IdleSweep, endpoint_port, established_local_ports
from uapplace.controller.standing import Cooldowns, UsageClocks
from uapplace.core.admission import Admission
from uapplace.core.errors import NotFound
from uapplace.core.model import (
    Config,
    ConfigStatus,
    Holder,
    Model,
    PendingEntry,
    Registry,
    Resident,
    ResidentState,
)
from uapplace.files.autopolicy import PolicyStore

T0 = 1_800_000_000.0
WINDOW = 300


def _model(key: str) -> Model:
    config = Config(
        f"{key}-q4",
        ConfigStatus.MEASURED,
        resident_gpu_mib=8000,
        host_rss_mib=4000,
        measured_at="2026-10-08T14:02:00Z",
        measured_on="gpu0",
    )
    return Model(key, key.title(), "llama.cpp", {config.key: config}, advertises=(f"{key}-chat",))


REGISTRY = Registry(devices={}, models={m.key: m for m in (_model("alpha"), _model("beta"))})


def resident(model: str, port: int | None, *, since: str = "2026-10-08T14:00:00Z") -> Resident:
    return Resident(
        model=model,
        config=f"{model}-q4",
        device="gpu0",
        engine="llama.cpp",
        endpoint=f"http://127.0.0.1:{port}" if port is not None else None,
        unit=f"{model}.service",
        state=ResidentState.HOT,
        gpu_mib=8000,
        host_rss_mib=4000,
        since=since,
    )


class Host:
    """The controller's side the sweep reads and writes."""

    def __init__(self) -> None:
        self.admission = Admission(REGISTRY)
        self.residents: list[Resident] = []
        self.usage = UsageClocks(self.mark_dirty)
        self.cooldowns = Cooldowns(self.mark_dirty)
        self.holds: dict[str, Holder] = {}
        self.writes = 0

    def pending_entries(self) -> list[PendingEntry]:
        return list(self.admission.pending.values())

    def residents_with_holders(
        self, inflight: Mapping[str, Sequence[Holder]] | None
    ) -> list[Resident]:
        assert inflight is None
        return [
            replace(r, holders=(self.holds[r.model],)) if r.model in self.holds else r
            for r in self.residents
        ]

    def mark_dirty(self, urgent: bool = True) -> None:
        self.writes += 1


class FakeUnloader:
    """Records unloads; a success removes the model's residents, as the enforcer does."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.calls: list[tuple[str, bool]] = []
        self.signatures: list[list[str]] = []
        """The approval signature each unload carried (what the tick judged idle)."""
        self.outcome: bool | Exception = True
        self.gate: asyncio.Event | None = None
        self.started = asyncio.Event()

    async def unload(
        self, model: str, expected: Sequence[str], *, wait: bool = False
    ) -> Mapping[str, Any]:
        self.calls.append((model, wait))
        self.signatures.append(list(expected))
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if isinstance(self.outcome, Exception):
            raise self.outcome
        if self.outcome:
            self.host.residents = [r for r in self.host.residents if r.model != model]
            return {"ok": True, "placementId": None, "steps": []}
        return {"ok": False, "steps": [], "error": "drain: gen-7 still in flight; rolled back"}


class Rig:
    def __init__(self, tmp_path: Path, scan: Any = established_local_ports) -> None:
        self.host = Host()
        self.unloader = FakeUnloader(self.host)
        self.policy_path = tmp_path / "placement-auto.json"
        self.sweep = IdleSweep(
            self.host,
            self.unloader,
            PolicyStore(self.policy_path, lambda: REGISTRY),
            lambda: REGISTRY,
            scan=scan,
            clock=lambda: self.now,
        )
        self.now = T0

    def policy(self, **knobs: Any) -> None:
        self.policy_path.write_text(json.dumps(knobs), encoding="utf-8")

    def arm(self, *models: str, window: int = WINDOW) -> None:
        self.policy(unload_idle_after_secs=window, unload_allow=list(models))

    async def tick(self, at: float) -> Any:
        self.now = at
        return await self.sweep.tick(at)

    def unloaded(self) -> list[str]:
        return [model for model, _ in self.unloader.calls]


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


# Ports nothing listens on: the connection check sees no ESTABLISHED socket there.
QUIET_A, QUIET_B = 1, 2


# --------------------------------------------------------------------------- off, window, consent


async def test_off_by_default(rig: Rig) -> None:
    rig.host.residents = [resident("beta", QUIET_B)]
    report = await rig.tick(T0 + 10 * 86400)
    assert (report.ran, report.window_s) == (True, None)
    assert rig.unloader.calls == [] and rig.host.usage == {}

    rig.policy(enabled=True, unload_allow=["beta"])  # consent, but no window: still off
    await rig.tick(T0 + 20 * 86400)
    assert rig.unloader.calls == [] and rig.host.usage == {}


async def test_only_a_consented_model_is_unloaded(rig: Rig) -> None:
    rig.host.residents = [resident("alpha", QUIET_A), resident("beta", QUIET_B)]
    rig.arm("beta")
    await rig.tick(T0)
    report = await rig.tick(T0 + 10 * WINDOW)
    assert report.unloaded == ["beta"] and rig.unloaded() == ["beta"]
    await rig.tick(T0 + 100 * WINDOW)
    assert rig.unloaded() == ["beta"]
    assert [r.model for r in rig.host.residents] == ["alpha"]


async def test_the_window_floors_at_60_seconds(rig: Rig) -> None:
    rig.host.residents = [resident("beta", QUIET_B)]
    rig.arm("beta", window=10)
    first = await rig.tick(T0)
    assert first.window_s == 60
    await rig.tick(T0 + 59)
    assert rig.unloader.calls == []
    await rig.tick(T0 + 60)
    assert rig.unloaded() == ["beta"]


async def test_a_gated_forward_resets_the_clock(rig: Rig) -> None:
    rig.host.residents = [resident("beta", QUIET_B)]
    rig.arm("beta")
    await rig.tick(T0)
    rig.host.usage.touch("beta", T0 + 200)  # the controller's touch on a forward
    await rig.tick(T0 + WINDOW + 10)
    assert rig.unloader.calls == []
    await rig.tick(T0 + 200 + WINDOW)
    assert rig.unloaded() == ["beta"]


# --------------------------------------------------------------------------- the usage clock


async def test_a_missing_clock_is_seeded_never_evicting_the_already_idle(rig: Rig) -> None:
    rig.host.residents = [resident("beta", QUIET_B)]
    rig.arm("beta")
    report = await rig.tick(T0)
    assert rig.host.usage == {"beta": T0}
    assert rig.unloader.calls == [] and "used 0 s ago" in report.skipped["beta"]
    await rig.tick(T0 + WINDOW)
    assert rig.unloaded() == ["beta"]


async def test_an_old_clock_counts_only_from_when_the_sweep_watched(rig: Rig) -> None:
    # A usage record restored from the ledger, from long before this sweep was armed.
    rig.host.residents = [resident("beta", QUIET_B)]
    rig.host.usage.touch("beta", T0 - 86400)
    rig.arm("beta")
    await rig.tick(T0)
    assert rig.unloader.calls == []
    await rig.tick(T0 + WINDOW - 1)
    assert rig.unloader.calls == []
    await rig.tick(T0 + WINDOW)
    assert rig.unloaded() == ["beta"]


async def test_consent_granted_later_starts_a_fresh_window(rig: Rig) -> None:
    rig.host.residents = [resident("beta", QUIET_B)]
    rig.host.usage.touch("beta", T0 - 86400)
    rig.arm("alpha")
    await rig.tick(T0)
    rig.arm("alpha", "beta")
    await rig.tick(T0 + WINDOW)  # first look at beta under consent
    assert rig.unloader.calls == []
    await rig.tick(T0 + 2 * WINDOW)
    assert rig.unloaded() == ["beta"]


async def test_a_successful_unload_clears_the_clock_and_a_reload_starts_fresh(rig: Rig) -> None:
    rig.host.residents = [resident("beta", QUIET_B)]
    rig.arm("beta")
    await rig.tick(T0)
    await rig.tick(T0 + WINDOW)
    assert rig.unloaded() == ["beta"] and "beta" not in rig.host.usage

    rig.host.residents = [resident("beta", QUIET_B, since="2026-10-08T15:00:00Z")]
    await rig.tick(T0 + WINDOW + 5)
    assert rig.host.usage == {"beta": T0 + WINDOW + 5}
    await rig.tick(T0 + 2 * WINDOW)
    assert rig.unloaded() == ["beta"]


async def test_clocks_of_models_with_no_resident_are_pruned(rig: Rig) -> None:
    rig.host.residents = [resident("beta", QUIET_B)]
    for model, used in {"alpha": T0 - 5, "retired": T0 - 50, "beta": T0}.items():
        rig.host.usage.touch(model, used)
    rig.arm("beta")
    await rig.tick(T0 + 1)
    assert rig.host.usage == {"beta": T0}


# --------------------------------------------------------------------------- what keeps a model


async def test_a_live_pending_entry_keeps_the_model(rig: Rig) -> None:
    rig.host.residents = [resident("alpha", QUIET_A)]
    rig.arm("alpha")
    await rig.tick(T0)
    at = T0 + WINDOW
    # A request for it parked (advertised id: still this model).
    rig.host.admission.decide("alpha-chat", "client", None, None, at - 10)
    report = await rig.tick(at)
    assert rig.unloader.calls == [] and report.skipped["alpha"] == "a pending request wants it"
    # Once the entry has expired (120 s TTL) the demand is gone.
    await rig.tick(at + 200)
    assert rig.unloaded() == ["alpha"]


async def test_a_model_in_cooldown_is_skipped(rig: Rig) -> None:
    rig.host.residents = [resident("beta", QUIET_B)]
    rig.arm("beta")
    await rig.tick(T0)
    rig.host.cooldowns.start("beta", T0 + WINDOW + 30)
    report = await rig.tick(T0 + WINDOW)
    assert rig.unloader.calls == [] and "cooldown" in report.skipped["beta"]
    await rig.tick(T0 + WINDOW + 30)
    assert rig.unloaded() == ["beta"]


async def test_a_held_resident_is_never_unloaded_and_its_clock_resets(rig: Rig) -> None:
    rig.host.residents = [resident("beta", QUIET_B)]
    rig.host.holds["beta"] = Holder("org.example.Editor", "hold", "pinned for a session")
    rig.arm("beta")
    await rig.tick(T0)
    report = await rig.tick(T0 + 5 * WINDOW)
    assert rig.unloader.calls == [] and report.skipped["beta"] == "held on the bus"
    assert rig.host.usage["beta"] == T0 + 5 * WINDOW
    del rig.host.holds["beta"]
    await rig.tick(T0 + 6 * WINDOW)
    assert rig.unloaded() == ["beta"]


@pytest.mark.parametrize("state", [ResidentState.WARMING, ResidentState.DRAINING])
async def test_residents_mid_change_are_never_unloaded(rig: Rig, state: ResidentState) -> None:
    rig.host.residents = [replace(resident("beta", QUIET_B), state=state)]
    rig.arm("beta")
    await rig.tick(T0)
    report = await rig.tick(T0 + 5 * WINDOW)
    assert rig.unloader.calls == [] and report.skipped["beta"] == f"beta/beta-q4 is {state.value}"


async def test_a_paused_resident_is_unloaded_with_the_same_consent(rig: Rig) -> None:
    """Issue 21 item 6: a paused resident holds host RAM; past its window, under
    ``unload_allow``, it goes like a hot one (and not without consent)."""
    rig.host.residents = [
        replace(resident("alpha", QUIET_A), state=ResidentState.PAUSED),
        replace(resident("beta", QUIET_B), state=ResidentState.PAUSED),
    ]
    rig.arm("beta")
    await rig.tick(T0)
    report = await rig.tick(T0 + 5 * WINDOW)
    assert report.unloaded == ["beta"] and rig.unloaded() == ["beta"]
    assert [r.model for r in rig.host.residents] == ["alpha"]


async def test_a_resident_without_an_endpoint_counts_as_busy(rig: Rig) -> None:
    rig.host.residents = [resident("beta", None)]
    rig.arm("beta")
    await rig.tick(T0)
    report = await rig.tick(T0 + 5 * WINDOW)
    assert rig.unloader.calls == [] and "unknown counts as busy" in report.skipped["beta"]


# --------------------------------------------------------------------------- open connections


class Listener:
    """A real TCP server on 127.0.0.1 that keeps each client until it hangs up."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port = 0
        self.accepted = asyncio.Event()
        self.hung_up = asyncio.Event()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted.set()
        await reader.read()  # until the client closes
        writer.close()
        await writer.wait_closed()
        self.hung_up.set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    serving = Listener()
    await serving.start()
    yield serving
    assert serving.server is not None
    serving.server.close()
    await serving.server.wait_closed()


async def test_an_established_connection_resets_the_clock_and_skips(
    rig: Rig, listener: Listener
) -> None:
    rig.host.residents = [resident("beta", listener.port)]
    rig.arm("beta")
    await rig.tick(T0)
    _reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    await listener.accepted.wait()
    assert listener.port in established_local_ports()

    report = await rig.tick(T0 + WINDOW)
    assert rig.unloader.calls == []
    assert report.skipped["beta"] == f"ESTABLISHED connection on port {listener.port}"
    assert rig.host.usage["beta"] == T0 + WINDOW

    writer.close()
    await writer.wait_closed()
    await listener.hung_up.wait()
    await rig.tick(T0 + WINDOW + 10)  # the client has gone, but the window restarted
    assert rig.unloader.calls == []
    await rig.tick(T0 + 2 * WINDOW)
    assert rig.unloaded() == ["beta"]


async def test_a_listening_socket_alone_is_not_a_connection(rig: Rig, listener: Listener) -> None:
    rig.host.residents = [resident("beta", listener.port)]
    rig.arm("beta")
    await rig.tick(T0)
    await rig.tick(T0 + WINDOW)
    assert rig.unloaded() == ["beta"]


def _denied() -> Collection[int]:
    raise psutil.AccessDenied(pid=None, name="net_connections")


async def test_an_unanswerable_connection_check_means_busy(tmp_path: Path) -> None:
    rig = Rig(tmp_path, scan=_denied)
    rig.host.residents = [resident("beta", QUIET_B)]
    rig.arm("beta")
    await rig.tick(T0)
    report = await rig.tick(T0 + 5 * WINDOW)
    assert rig.unloader.calls == []
    assert "connection table unreadable (AccessDenied)" in report.skipped["beta"]
    assert rig.host.usage["beta"] == T0  # a refusal to guess, not a use


# --------------------------------------------------------------------------- ticks and failures


async def test_an_overlapping_tick_is_dropped(rig: Rig) -> None:
    rig.host.residents = [resident("beta", QUIET_B)]
    rig.arm("beta")
    await rig.tick(T0)
    rig.unloader.gate = asyncio.Event()
    first = asyncio.create_task(rig.tick(T0 + WINDOW))
    await rig.unloader.started.wait()
    second = await rig.sweep.tick(T0 + WINDOW + 20)
    assert second.ran is False
    rig.unloader.gate.set()
    report = await first
    assert report.unloaded == ["beta"] and rig.unloaded() == ["beta"]
    third = await rig.sweep.tick(T0 + WINDOW + 40)  # the guard was released
    assert third.ran is True


@pytest.mark.parametrize("outcome", [False, RuntimeError("stop job timed out")])
async def test_a_refused_or_failed_unload_cools_down_for_ten_minutes(
    rig: Rig, outcome: bool | Exception
) -> None:
    rig.host.residents = [resident("beta", QUIET_B)]
    rig.arm("beta")
    await rig.tick(T0)
    rig.unloader.outcome = outcome
    report = await rig.tick(T0 + WINDOW)
    assert report.failed == ["beta"]
    assert rig.host.cooldowns == {"beta": T0 + WINDOW + COOLDOWN_S}
    assert rig.host.usage["beta"] == T0  # kept: the model is still there
    await rig.tick(T0 + WINDOW + COOLDOWN_S - 1)
    assert rig.unloaded() == ["beta"]  # no second try during the cooldown


async def test_a_model_already_gone_when_its_unload_runs_is_no_failure(rig: Rig) -> None:
    rig.host.residents = [resident("beta", QUIET_B)]
    rig.arm("beta")
    await rig.tick(T0)
    rig.unloader.outcome = NotFound("beta is not resident: nothing to unload")
    report = await rig.tick(T0 + WINDOW)
    assert report.failed == [] and rig.host.cooldowns == {}
    assert report.skipped["beta"] == "no longer resident when its unload ran"


async def test_close_starts_no_further_unload(rig: Rig) -> None:
    rig.host.residents = [resident("alpha", QUIET_A), resident("beta", QUIET_B)]
    rig.arm("alpha", "beta")
    await rig.tick(T0)
    rig.unloader.gate = asyncio.Event()
    sweeping = asyncio.create_task(rig.tick(T0 + WINDOW))
    await rig.unloader.started.wait()
    rig.sweep.close()
    rig.unloader.gate.set()
    report = await sweeping
    assert report.unloaded == ["alpha"] and rig.unloaded() == ["alpha"]
    await rig.sweep.run(interval_s=0)  # returns at once: the sweep is closed


async def test_the_unload_queues_behind_a_running_enforcement(rig: Rig) -> None:
    rig.host.residents = [resident("beta", QUIET_B)]
    rig.arm("beta")
    await rig.tick(T0)
    await rig.tick(T0 + WINDOW)
    assert rig.unloader.calls == [("beta", True)]
    # It carries the signature of what the tick judged idle (Drifted if that changed).
    assert rig.unloader.signatures == [["beta/beta-q4"]]


async def test_the_policy_file_is_re_read_every_tick(rig: Rig) -> None:
    rig.host.residents = [resident("beta", QUIET_B)]
    rig.arm("beta")
    await rig.tick(T0)
    rig.policy(unload_idle_after_secs=WINDOW, unload_allow=[])  # consent taken back
    await rig.tick(T0 + 5 * WINDOW)
    assert rig.unloader.calls == []
    rig.arm("beta")
    await rig.tick(T0 + 6 * WINDOW)
    assert rig.unloaded() == ["beta"]


async def test_run_keeps_ticking_past_a_failing_tick(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    ticks: list[float | None] = []
    done = asyncio.Event()

    async def tick(now: float | None = None) -> None:
        ticks.append(now)
        if len(ticks) == 1:
            raise OSError("disk full")
        done.set()

    monkeypatch.setattr(rig.sweep, "tick", tick)
    runner = asyncio.create_task(rig.sweep.run(interval_s=0.001))
    await done.wait()
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert len(ticks) == 2


@pytest.mark.parametrize(
    ("endpoint", "port"),
    [
        ("http://127.0.0.1:8080", 8080),
        ("http://127.0.0.1:8080/v1", 8080),
        ("http://[::1]:9000", 9000),
        ("http://localhost", 80),
        ("https://gpu-box", 443),
        ("unix:/run/engine.sock", None),
        ("http://127.0.0.1:99999", None),
        (None, None),
        ("", None),
    ],
)
def test_endpoint_port(endpoint: str | None, port: int | None) -> None:
    assert endpoint_port(endpoint) == port
