"""The auto-resolution policy file and the auto runner (docs/placement-rules.md §4.4.1).

The runner is driven against the real :class:`Admission` and a real policy file;
the enforcer is an in-process fake (``FakeEnforcer``) whose runs succeed, fail,
raise or wait on an event, as the test says. The systemd tier proves the real path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from uapplace.consent.auto import (
    COOLDOWN_S,
    AutoRunner,
    enforcement_envelope_s,
    option_envelope_s,
    pick_option,
)
from uapplace.controller.standing import Cooldowns
from uapplace.core.admission import Admission
from uapplace.core.errors import Failed, InvalidArgument
from uapplace.core.model import (
    Config,
    ConfigStatus,
    Model,
    Option,
    OptionKind,
    ParkReason,
    PendingEntry,
    Plan,
    PreviewReason,
    Registry,
    ResidentState,
    Victim,
)
from uapplace.files.autopolicy import (
    AutoPolicy,
    ConsentRequired,
    PolicyStore,
    apply_changes,
    load_auto_policy,
    save_policy,
)
from uapplace.files.timeouts import Timeouts

T0 = 1_800_000_000.0
ENVELOPE = 500.0


def _measured(key: str) -> Config:
    return Config(
        key,
        ConfigStatus.MEASURED,
        resident_gpu_mib=8000,
        host_rss_mib=4000,
        measured_at="2026-10-08T14:02:00Z",
        measured_on="gpu0",
    )


def _model(key: str, *, measured: bool = True, advertises: tuple[str, ...] = ()) -> Model:
    config = _measured(f"{key}-q4") if measured else Config(f"{key}-q4", ConfigStatus.UNMEASURED)
    return Model(key, key.title(), "llama.cpp", {config.key: config}, advertises=advertises)


REGISTRY = Registry(
    devices={},
    models={
        m.key: m
        for m in (
            _model("alpha", advertises=("alpha-chat",)),
            _model("beta"),
            _model("gamma"),
            _model("delta"),
            _model("raw", measured=False),
        )
    },
)


def alongside(model: str, device: str = "gpu0") -> Option:
    return Option(OptionKind.LOAD_ALONGSIDE, model, f"{model}-q4", device, 8000.0)


def displace(model: str, victim: str) -> Option:
    gone = Victim(
        victim,
        f"{victim}-q4",
        ResidentState.HOT,
        "gpu0",
        (),
        False,
        8000.0,
        "session idle, context lost, reload needed",
    )
    return Option(OptionKind.DISPLACE, model, f"{model}-q4", "gpu0", 8000.0, (gone,))


def plan_of(model: str, *options: Option) -> Plan:
    return Plan(model, PreviewReason.OK if options else PreviewReason.NO_FEASIBLE_OPTION, options)


# --------------------------------------------------------------------------- collaborators


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


async def _same_plan(entry: PendingEntry) -> Plan:
    return Plan(entry.requested_model, PreviewReason.OK, entry.options)


class Host:
    """The controller's side the runner uses, over a real Admission and real cooldowns.

    ``replan`` stands in for the planner: fresh options for the entry that asks."""

    def __init__(self, clock: Clock) -> None:
        self.admission = Admission(REGISTRY)
        self.cooldowns = Cooldowns(self.mark_dirty)
        self.resolved: list[tuple[str, str]] = []
        self.writes = 0
        self.clock = clock
        self.replan: Callable[[PendingEntry], Awaitable[Plan]] = _same_plan

    def mark_dirty(self, urgent: bool = True) -> None:
        self.writes += 1

    def pending_entry(self, placement_id: str) -> PendingEntry | None:
        return self.admission.get(placement_id)

    def replace_pending(self, entry: PendingEntry) -> None:
        self.admission.replace(entry)
        self.mark_dirty()

    def resolve_pending(
        self, entry: PendingEntry, outcome: str, already_removed: bool = False
    ) -> None:
        if not already_removed:
            self.admission.remove(entry.id)
        self.resolved.append((entry.id, outcome))

    async def plan_for(self, model: str, cells: int) -> Plan:
        asking = [e for e in self.admission.pending.values() if e.requested_model == model]
        return await self.replan(asking[0])

    def park(self, model: str, client: str = "x-uap-client-id:claude-code") -> PendingEntry:
        decision, entry = self.admission.decide(model, client, None, None, self.clock())
        assert decision.decision == "park" and entry is not None
        return entry

    def entry(self, placement_id: str) -> PendingEntry:
        found = self.admission.get(placement_id)
        assert found is not None, f"{placement_id} is no longer pending"
        return found


class FakeEnforcer:
    """Records every apply; per model, a run can wait on a gate, fail or raise.

    A successful run does what the real enforcer's resolve step does: it resolves
    the pending entries of the loaded model (unless ``resolves`` is false).
    """

    def __init__(self, host: Host) -> None:
        self.host = host
        self.calls: list[tuple[str, str, int, tuple[str, ...], bool]] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.outcomes: dict[str, bool | Exception] = {}
        self.started: dict[str, asyncio.Event] = {}
        self.active = 0
        self.most_active = 0
        self.resolves = True

    def gate(self, model: str) -> asyncio.Event:
        self.gates[model] = asyncio.Event()
        return self.gates[model]

    def on_start(self, model: str) -> asyncio.Event:
        return self.started.setdefault(model, asyncio.Event())

    async def apply(
        self, entry: PendingEntry, option: int, expected: Sequence[str], *, wait: bool = False
    ) -> Mapping[str, Any]:
        model = entry.options[option - 1].model
        self.calls.append((model, entry.id, option, tuple(expected), wait))
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        self.on_start(model).set()
        try:
            if model in self.gates:
                await self.gates[model].wait()
            outcome = self.outcomes.get(model, True)
            if isinstance(outcome, Exception):
                raise outcome
            if outcome and self.resolves:
                for pending in list(self.host.admission.pending.values()):
                    if pending.requested_model in (model, f"{model}-chat"):
                        self.host.resolve_pending(pending, "applied")
            result: dict[str, Any] = {"ok": outcome, "placementId": entry.id, "steps": []}
            if not outcome:
                result.update(rolledBack=True, error="verify-up: unit failed; rolled back")
            return result
        finally:
            self.active -= 1


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.clock = Clock()
        self.host = Host(self.clock)
        self.enforcer = FakeEnforcer(self.host)
        self.policy_path = tmp_path / "placement-auto.json"
        self.store = PolicyStore(self.policy_path, lambda: REGISTRY)
        self.runner = AutoRunner(
            self.host,
            self.enforcer,
            self.store,
            lambda: REGISTRY,
            envelope_s=ENVELOPE,
            clock=self.clock,
        )
        self.store.describe_runs = self.runner.status

    def write_policy(self, **knobs: Any) -> None:
        self.policy_path.write_text(json.dumps(knobs), encoding="utf-8")

    async def park(
        self, model: str, *options: Option, client: str = "x-uap-client-id:claude-code"
    ) -> tuple[PendingEntry, ParkReason | None]:
        entry = self.host.park(model, client)
        plan = plan_of(model, *options)
        entry = replace(entry, options=plan.options)
        self.host.admission.replace(entry)
        return entry, await self.runner.schedule(entry, plan)


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


async def _turns(count: int = 20) -> None:
    """Let every ready task run a few steps (no timing involved)."""
    for _ in range(count):
        await asyncio.sleep(0)


# --------------------------------------------------------------------------- the file: fail-closed


def test_a_missing_file_means_off_without_a_finding(tmp_path: Path) -> None:
    policy, findings = load_auto_policy(tmp_path / "placement-auto.json")
    assert policy == AutoPolicy()
    assert not policy.enabled and policy.idle_window_s is None
    assert findings == []


@pytest.mark.parametrize("text", ["{not json", "", "\xff\xfe", "[true]", '"enabled"'])
def test_a_corrupt_file_means_off_and_says_why(tmp_path: Path, text: str) -> None:
    path = tmp_path / "placement-auto.json"
    path.write_bytes(text.encode("latin-1"))
    policy, findings = load_auto_policy(path)
    assert policy == AutoPolicy()
    assert len(findings) == 1
    assert findings[0].startswith(f"{path}: ") and findings[0].endswith("auto is off")


@pytest.mark.parametrize("enabled", ["true", 1, "yes", None, [True]])
def test_enabled_must_be_literally_true(tmp_path: Path, enabled: object) -> None:
    path = tmp_path / "placement-auto.json"
    path.write_text(json.dumps({"enabled": enabled, "allow_displace": ["alpha"]}))
    policy, findings = load_auto_policy(path)
    assert policy.enabled is False
    assert policy.allow_displace == ("alpha",)  # the other knob still applies
    assert pick_option([alongside("beta")], policy, "beta") is None
    assert len(findings) == 1
    assert f"{path}: enabled: must be true or false" in findings[0]
    assert "auto is off" in findings[0]


def test_a_wake_that_displaces_nobody_is_taken_without_allow_displace(tmp_path: Path) -> None:
    """Issue 21 item 6: waking a paused resident in place stops nobody."""
    path = tmp_path / "placement-auto.json"
    path.write_text('{"enabled": true}')
    policy, _ = load_auto_policy(path)
    wake = Option(OptionKind.WAKE, "beta", "beta-q4", "gpu0", 8000.0)
    costly_wake = replace(displace("beta", "alpha"), kind=OptionKind.WAKE)
    assert pick_option([costly_wake, wake], policy, "beta") == 2
    assert pick_option([costly_wake], policy, "beta") is None


def test_enabled_true_turns_it_on(tmp_path: Path) -> None:
    path = tmp_path / "placement-auto.json"
    path.write_text('{"enabled": true}')
    policy, findings = load_auto_policy(path)
    assert (policy.enabled, findings) == (True, [])


GOOD = {
    "enabled": True,
    "allow_displace": ["alpha"],
    "unload_idle_after_secs": 900,
    "unload_allow": ["beta"],
}


@pytest.mark.parametrize(
    ("knob", "bad"),
    [
        ("allow_displace", "alpha"),
        ("allow_displace", ["alpha", 3]),
        ("allow_displace", {"alpha": True}),
        ("unload_allow", "beta"),
        ("unload_allow", [None]),
        ("unload_idle_after_secs", "900"),
        ("unload_idle_after_secs", 900.5),
        ("unload_idle_after_secs", True),
        ("unload_idle_after_secs", -1),
    ],
)
def test_each_invalid_knob_is_dropped_alone(tmp_path: Path, knob: str, bad: object) -> None:
    path = tmp_path / "placement-auto.json"
    path.write_text(json.dumps({**GOOD, knob: bad}))
    policy, findings = load_auto_policy(path)
    assert len(findings) == 1, findings
    assert findings[0].startswith(f"{path}: {knob}: ")
    assert "ignored" in findings[0]
    expected = {
        "enabled": True,
        "allow_displace": ("alpha",),
        "unload_idle_after_secs": 900,
        "unload_allow": ("beta",),
    }
    expected[knob] = None if knob == "unload_idle_after_secs" else ()
    seen = {k: getattr(policy, k) for k in expected}
    assert seen == expected


def test_unknown_keys_and_the_60s_floor_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "placement-auto.json"
    path.write_text(
        json.dumps({"enabled": True, "allow_unload": ["beta"], "unload_idle_after_secs": 5})
    )
    policy, findings = load_auto_policy(path)
    assert policy.enabled and policy.unload_idle_after_secs == 5 and policy.idle_window_s == 60
    assert policy.unload_allow == ()
    assert any("allow_unload: unknown key" in f for f in findings)
    assert any("under the 60 s floor" in f for f in findings)


def test_zero_seconds_is_off(tmp_path: Path) -> None:
    path = tmp_path / "placement-auto.json"
    path.write_text(json.dumps({"unload_idle_after_secs": 0, "unload_allow": ["beta"]}))
    policy, findings = load_auto_policy(path)
    assert (policy.idle_window_s, policy.may_unload("beta"), findings) == (None, False, [])


# --------------------------------------------------------------------------- edits


def test_consent_is_refused_without_yes_and_says_what_it_consents_to() -> None:
    policy = AutoPolicy(enabled=True)
    with pytest.raises(ConsentRequired) as refused:
        apply_changes(policy, {"allow_displace": ["alpha"]}, False, REGISTRY)
    text = str(refused.value)
    assert "allow_displace: not recorded" in text
    assert "alpha" in text and "evict" in text and "--yes" in text
    assert "Nothing was changed" in text
    assert isinstance(refused.value, InvalidArgument)

    with pytest.raises(ConsentRequired) as unload:
        apply_changes(
            policy, {"allow_unload": ["beta"], "unload_idle_after_secs": 900}, False, REGISTRY
        )
    assert "may stop beta" in str(unload.value) and "900 s" in str(unload.value)


def test_consent_given_records_it() -> None:
    policy = apply_changes(AutoPolicy(), {"allow_displace": ["alpha"]}, True, REGISTRY)
    assert policy.allow_displace == ("alpha",)
    assert not policy.enabled  # consent alone does not switch auto on


def test_taking_consent_back_needs_no_yes() -> None:
    policy = AutoPolicy(
        allow_displace=("alpha", "beta"), document={"allow_displace": ["alpha", "beta"]}
    )
    updated = apply_changes(policy, {"disallow_displace": ["alpha"]}, False, REGISTRY)
    assert updated.allow_displace == ("beta",)


def test_a_model_removed_from_the_registry_stays_removable() -> None:
    policy = AutoPolicy(unload_allow=("gone",), document={"unload_allow": ["gone"]})
    assert apply_changes(policy, {"disallow_unload": ["gone"]}, False, REGISTRY).unload_allow == ()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"allow_displace": ["nope"]}, "'nope' is not a model in the registry"),
        ({"allow_displace": ["alpha-chat"]}, "is an id of model 'alpha'"),
        ({"disallow_unload": ["nope"]}, "disallow_unload: 'nope' is not a model"),
        ({"allow_displace": "alpha"}, "allow_displace: expected a list of model keys"),
        ({"enable": True, "disable": True}, "send one of them, not both"),
        ({"enable": False}, "enable: only true is meaningful"),
        ({"allow_unload": ["beta"], "disallow_unload": ["beta"]}, "both name beta"),
        ({"unload_idle_after_secs": -5}, "unload_idle_after_secs: expected whole seconds"),
        ({"unload_idle_after_secs": True}, "unload_idle_after_secs: expected whole seconds"),
        ({"allowDisplace": ["alpha"]}, "unknown key(s) allowDisplace"),
    ],
)
def test_bad_changes_are_refused_naming_the_key(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        apply_changes(AutoPolicy(), changes, True, REGISTRY)
    assert message in str(refused.value)


async def test_edits_preserve_every_other_field(tmp_path: Path) -> None:
    path = tmp_path / "placement-auto.json"
    original = {
        "enabled": False,
        "allow_displace": ["alpha"],
        "unload_idle_after_secs": 900,
        "unload_allow": ["beta"],
        "note": "set up by the operator on 2026-10-08",
    }
    path.write_text(json.dumps(original))
    store = PolicyStore(path, lambda: REGISTRY)

    status = await store.set({"enable": True}, False)
    assert json.loads(path.read_text()) == {**original, "enabled": True}
    assert status["enabled"] is True and status["unload_allow"] == ["beta"]

    await store.set({"unload_idle_after_secs": None}, False)
    assert json.loads(path.read_text()) == {
        **original,
        "enabled": True,
        "unload_idle_after_secs": None,
    }


async def test_an_edit_keeps_an_invalid_untouched_knob_as_written(tmp_path: Path) -> None:
    path = tmp_path / "placement-auto.json"
    path.write_text(json.dumps({"enabled": True, "unload_allow": "beta"}))
    store = PolicyStore(path, lambda: REGISTRY)
    status = await store.set({"allow_displace": ["alpha"]}, True)
    assert json.loads(path.read_text())["unload_allow"] == "beta"
    assert any("unload_allow" in f for f in status["findings"])


async def test_save_is_atomic_and_0600(tmp_path: Path) -> None:
    home = tmp_path / "uap-home"
    path = home / "placement-auto.json"
    store = PolicyStore(path, lambda: REGISTRY)
    old_umask = os.umask(0o022)
    try:
        await store.set({"enable": True}, False)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert sorted(p.name for p in home.iterdir()) == ["placement-auto.json"]  # no tmp left
    assert json.loads(path.read_text()) == {
        "enabled": True,
        "allow_displace": [],
        "unload_idle_after_secs": None,
        "unload_allow": [],
    }
    inode = path.stat().st_ino
    save_policy(path, AutoPolicy(document={"enabled": False}))
    assert path.stat().st_ino != inode  # replaced by rename, never rewritten in place


async def test_a_write_that_fails_names_the_file(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    store = PolicyStore(blocker / "placement-auto.json", lambda: REGISTRY)
    with pytest.raises(Failed) as failed:
        await store.set({"enable": True}, False)
    assert f"cannot write the auto policy {blocker / 'placement-auto.json'}" in str(failed.value)


async def test_a_refused_edit_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "placement-auto.json"
    path.write_text('{"enabled": true}')
    store = PolicyStore(path, lambda: REGISTRY)
    with pytest.raises(ConsentRequired):
        await store.set({"allow_displace": ["alpha"]}, False)
    assert path.read_text() == '{"enabled": true}'


def _kept_aside(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.startswith("placement-auto.json.corrupt-")]


async def test_an_edit_over_a_corrupt_file_keeps_it_aside(tmp_path: Path) -> None:
    path = tmp_path / "placement-auto.json"
    path.write_text('{"enabled": true, "allow_displace": ["alpha"')
    store = PolicyStore(path, lambda: REGISTRY)
    status = await store.get()
    assert status["enabled"] is False and "not valid JSON" in status["findings"][0]
    await store.set({"disable": True}, False)
    kept = _kept_aside(tmp_path)
    assert len(kept) == 1 and "allow_displace" in kept[0].read_text()
    assert json.loads(path.read_text())["enabled"] is False


async def test_the_policy_is_re_read_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "placement-auto.json"
    store = PolicyStore(path, lambda: REGISTRY)
    assert (await store.refresh()).enabled is False

    path.write_text('{"enabled": true}')
    assert (await store.refresh()).enabled is True

    with path.open("r+") as same_inode:  # an in-place edit, as an editor may do
        same_inode.write('{"enabled": false, "allow_displace": ["alpha"]}')
    fresh = await store.refresh()
    assert (fresh.enabled, fresh.allow_displace) == (False, ("alpha",))

    path.unlink()
    assert await store.refresh() == AutoPolicy()


async def test_status_lists_runs_and_names_unknown_models(rig: Rig) -> None:
    rig.write_policy(enabled=True, allow_displace=["retired"])
    status = await rig.store.set({}, False)
    assert status["path"] == str(rig.policy_path) and status["exists"] is True
    assert status["runs"] == {"running": None, "queued": [], "cooldowns": {}}
    assert any("'retired' is not a model in the registry" in f for f in status["findings"])


def test_the_envelope_is_the_sum_of_the_enforcement_waits() -> None:
    t = Timeouts(drain_s=1, stop_s=2, verify_free_s=3, start_s=4, verify_up_s=5)
    assert enforcement_envelope_s(t) == 15


# --------------------------------------------------------------------------- picking


def test_non_displacing_options_are_taken_when_enabled() -> None:
    on = AutoPolicy(enabled=True)
    assert pick_option([alongside("beta")], on, "beta") == 1
    reuse = Option(OptionKind.REUSE, "beta", "beta-q4", "gpu0", 0.0)
    assert pick_option([reuse], on, "beta") == 1
    assert pick_option([alongside("beta")], AutoPolicy(), "beta") is None


def test_displacement_only_for_the_allowlisted_requested_model() -> None:
    options = [displace("beta", victim="alpha")]
    assert pick_option(options, AutoPolicy(enabled=True), "beta") is None
    # Consent names the model being loaded, not the victim.
    victim_listed = AutoPolicy(enabled=True, allow_displace=("alpha",))
    assert pick_option(options, victim_listed, "beta") is None
    listed = AutoPolicy(enabled=True, allow_displace=("beta",))
    assert pick_option(options, listed, "beta") == 1
    assert pick_option(options, replace(listed, enabled=False), "beta") is None


def test_the_first_eligible_option_in_the_operators_ranking_wins() -> None:
    listed = AutoPolicy(enabled=True, allow_displace=("beta",))
    options = [alongside("beta", "gpu1"), displace("beta", victim="alpha")]
    assert pick_option(options, listed, "beta") == 1


# --------------------------------------------------------------------------- the runner


async def test_auto_loading_only_when_a_run_is_scheduled(rig: Rig) -> None:
    entry, reason = await rig.park("beta", alongside("beta"))
    assert reason is None  # no policy file: off
    assert rig.host.entry(entry.id).reason is ParkReason.NOT_RESIDENT

    rig.write_policy(enabled=True)
    unknown, reason = await rig.park("nope", alongside("nope"))
    assert (unknown.reason, reason) == (ParkReason.UNKNOWN_MODEL, None)
    raw, reason = await rig.park("raw")
    assert (raw.reason, reason) == (ParkReason.NO_MEASURED_CONFIG, None)
    nothing, reason = await rig.park("gamma")
    assert reason is None and rig.host.entry(nothing.id).reason is ParkReason.NOT_RESIDENT
    only_displace, reason = await rig.park("delta", displace("delta", victim="alpha"))
    assert reason is None and rig.host.entry(only_displace.id).reason is ParkReason.NOT_RESIDENT
    assert rig.enforcer.calls == []

    scheduled, reason = await rig.park("beta", alongside("beta"), client="other")
    assert reason is ParkReason.AUTO_LOADING
    assert rig.host.entry(scheduled.id).reason is ParkReason.AUTO_LOADING
    assert rig.enforcer.calls == []  # the enforcement starts after the answer, on its own task
    await rig.runner.wait_idle()
    assert [c[0] for c in rig.enforcer.calls] == ["beta"]


async def test_one_run_per_model_under_a_burst_of_100_admits(rig: Rig) -> None:
    rig.write_policy(enabled=True)
    gate = rig.enforcer.gate("alpha")
    entries = []
    for n in range(100):
        entry, reason = await rig.park(
            "alpha" if n % 2 else "alpha-chat", alongside("alpha"), client=f"client-{n}"
        )
        assert reason is ParkReason.AUTO_LOADING
        entries.append(entry)
    await rig.enforcer.on_start("alpha").wait()
    await _turns()
    assert len(rig.enforcer.calls) == 1
    assert rig.runner.status()["running"] == "alpha"

    gate.set()
    await rig.runner.wait_idle()
    assert len(rig.enforcer.calls) == 1
    assert rig.host.admission.pending == {}
    assert {pid for pid, _ in rig.host.resolved} == {e.id for e in entries}


async def test_runs_are_single_flight_machine_wide(rig: Rig) -> None:
    rig.write_policy(enabled=True)
    gate = rig.enforcer.gate("alpha")
    await rig.park("alpha", alongside("alpha"))
    await rig.park("beta", alongside("beta", "gpu1"))
    await rig.enforcer.on_start("alpha").wait()
    await _turns()
    assert [c[0] for c in rig.enforcer.calls] == ["alpha"]
    assert rig.runner.status() == {"running": "alpha", "queued": ["beta"], "cooldowns": {}}

    gate.set()
    await rig.runner.wait_idle()
    assert [c[0] for c in rig.enforcer.calls] == ["alpha", "beta"]
    assert rig.enforcer.most_active == 1
    assert all(call[4] is True for call in rig.enforcer.calls)  # queue behind operator runs


async def test_at_most_two_runs_are_scheduled(rig: Rig) -> None:
    rig.write_policy(enabled=True)
    gate = rig.enforcer.gate("alpha")
    _, first = await rig.park("alpha", alongside("alpha"))
    _, second = await rig.park("beta", alongside("beta"))
    third, reason = await rig.park("gamma", alongside("gamma"))
    assert (first, second, reason) == (ParkReason.AUTO_LOADING, ParkReason.AUTO_LOADING, None)
    assert rig.host.entry(third.id).reason is ParkReason.NOT_RESIDENT

    gate.set()
    await rig.runner.wait_idle()
    assert [c[0] for c in rig.enforcer.calls] == ["alpha", "beta"]
    assert rig.host.entry(third.id).reason is ParkReason.NOT_RESIDENT


async def test_scheduling_extends_the_expiry_past_the_envelope(rig: Rig) -> None:
    rig.write_policy(enabled=True)
    gate = rig.enforcer.gate("alpha")
    running, _ = await rig.park("alpha", alongside("alpha"))
    queued, _ = await rig.park("beta", alongside("beta"))
    assert running.expires_at == T0 + 120  # admission's TTL
    assert rig.host.entry(running.id).expires_at >= T0 + ENVELOPE
    assert rig.host.entry(queued.id).expires_at >= T0 + 2 * ENVELOPE  # it waits its turn first

    await rig.enforcer.on_start("alpha").wait()
    rig.clock.now = T0 + 300
    late, _ = await rig.park("alpha", alongside("alpha"), client="late")
    assert rig.host.entry(late.id).expires_at >= T0 + 300 + ENVELOPE
    gate.set()
    await rig.runner.wait_idle()


def own_bounds_runner(rig: Rig, seen: list[frozenset[str]]) -> AutoRunner:
    """The rig's runner with a per-option envelope and the admission told of its runs,
    as ``wiring`` builds it."""
    timeouts = Timeouts()

    def on_runs(models: frozenset[str]) -> None:
        seen.append(models)
        rig.host.admission.set_auto_loading(models)

    return AutoRunner(
        rig.host,
        rig.enforcer,
        rig.store,
        lambda: REGISTRY_WITH_BOUND,
        envelope_s=ENVELOPE,
        clock=rig.clock,
        option_envelope=lambda o: option_envelope_s(timeouts, REGISTRY_WITH_BOUND, o),
        on_runs=on_runs,
    )


SLOW_START_S = 5_000.0
REGISTRY_WITH_BOUND = replace(
    REGISTRY,
    models={
        **REGISTRY.models,
        "alpha": replace(
            REGISTRY.models["alpha"],
            configs={"alpha-q4": replace(_measured("alpha-q4"), start_timeout_s=SLOW_START_S)},
        ),
    },
)


async def test_the_expiry_extension_uses_the_configs_own_bounds(rig: Rig) -> None:
    """Issue 21 item 8: alpha's config says its start may take 5,000 s; the entry must not
    expire under a run that is still within that bound (the global envelope is 500 s)."""
    rig.write_policy(enabled=True)
    runner = own_bounds_runner(rig, [])
    gate = rig.enforcer.gate("alpha")
    entry = rig.host.park("alpha")
    plan = plan_of("alpha", alongside("alpha"))
    rig.host.admission.replace(replace(entry, options=plan.options))
    assert await runner.schedule(entry, plan) is ParkReason.AUTO_LOADING
    bound = option_envelope_s(Timeouts(), REGISTRY_WITH_BOUND, alongside("alpha"))
    assert bound >= SLOW_START_S
    assert rig.host.entry(entry.id).expires_at >= T0 + bound
    await rig.enforcer.on_start("alpha").wait()
    assert rig.host.entry(entry.id).expires_at >= T0 + bound
    gate.set()
    await runner.wait_idle()


async def test_a_park_while_its_model_auto_loads_answers_auto_loading_first(rig: Rig) -> None:
    """Issue 21 item 8: the admit's own answer says ``auto_loading`` (the proxy's burst map
    repeats the first answer), not ``not_resident`` until the runner gets to it."""
    rig.write_policy(enabled=True)
    seen: list[frozenset[str]] = []
    runner = own_bounds_runner(rig, seen)
    gate = rig.enforcer.gate("alpha")
    entry = rig.host.park("alpha")
    plan = plan_of("alpha", alongside("alpha"))
    rig.host.admission.replace(replace(entry, options=plan.options))
    assert await runner.schedule(entry, plan) is ParkReason.AUTO_LOADING
    decision, joined = rig.host.admission.decide("alpha-chat", "codex", None, None, T0)
    assert (decision.reason, joined is not None) == ("auto_loading", True)
    other, _ = rig.host.admission.decide("beta", "codex", None, None, T0)
    assert other.reason == "not_resident"
    gate.set()
    await runner.wait_idle()
    assert seen == [frozenset({"alpha"}), frozenset()]
    after, _ = rig.host.admission.decide("alpha", "late", None, None, T0)
    assert after.reason == "not_resident"


async def test_a_failed_run_marks_auto_failed_and_cools_down(rig: Rig) -> None:
    rig.write_policy(enabled=True)
    rig.enforcer.outcomes["beta"] = False
    entry, _ = await rig.park("beta", alongside("beta"))
    await rig.runner.wait_idle()
    failed = rig.host.entry(entry.id)
    assert failed.reason is ParkReason.AUTO_FAILED
    assert rig.host.cooldowns == {"beta": T0 + COOLDOWN_S}
    # One attempt per entry: the same entry is never scheduled again.
    assert await rig.runner.schedule(failed, plan_of("beta", alongside("beta"))) is None
    assert len(rig.enforcer.calls) == 1


async def test_the_cooldown_holds_then_lapses_and_a_success_clears_it(rig: Rig) -> None:
    rig.write_policy(enabled=True)
    rig.enforcer.outcomes["beta"] = False
    await rig.park("beta", alongside("beta"))
    await rig.runner.wait_idle()

    rig.clock.now = T0 + COOLDOWN_S - 1
    during, reason = await rig.park("beta", alongside("beta"), client="second")
    assert reason is None and rig.host.entry(during.id).reason is ParkReason.NOT_RESIDENT

    rig.clock.now = T0 + COOLDOWN_S + 1
    rig.enforcer.outcomes["beta"] = True
    after, reason = await rig.park("beta", alongside("beta"), client="third")
    assert reason is ParkReason.AUTO_LOADING
    # The controller's tick would have dropped the lapsed cooldown; a success clears it anyway.
    await rig.runner.wait_idle()
    assert rig.host.cooldowns == {}
    assert rig.host.admission.get(after.id) is None


async def test_a_raising_run_does_not_crash_and_is_recorded(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.write_policy(enabled=True)
    rig.enforcer.outcomes["beta"] = RuntimeError("pystemd lost its bus")
    entry, _ = await rig.park("beta", alongside("beta"))
    with caplog.at_level(logging.ERROR, logger="uapplace.consent.auto"):
        await rig.runner.wait_idle()
    assert "the run for beta failed with an error" in caplog.text
    assert "pystemd lost its bus" in caplog.text
    assert rig.host.entry(entry.id).reason is ParkReason.AUTO_FAILED
    assert "beta" in rig.host.cooldowns
    assert rig.runner.status()["running"] is None
    # The runner still works.
    _, reason = await rig.park("gamma", alongside("gamma"))
    assert reason is ParkReason.AUTO_LOADING
    await rig.runner.wait_idle()
    assert [c[0] for c in rig.enforcer.calls] == ["beta", "gamma"]


async def test_displacement_runs_only_for_an_allowlisted_model(rig: Rig) -> None:
    rig.write_policy(enabled=True, allow_displace=["alpha"])  # the victim, not the requested
    entry, reason = await rig.park("beta", displace("beta", victim="alpha"))
    assert reason is None and rig.host.entry(entry.id).reason is ParkReason.NOT_RESIDENT

    rig.write_policy(enabled=True, allow_displace=["beta"])
    entry, reason = await rig.park("beta", displace("beta", victim="alpha"), client="b")
    assert reason is ParkReason.AUTO_LOADING
    await rig.runner.wait_idle()
    assert rig.enforcer.calls == [("beta", entry.id, 1, ("alpha/alpha-q4",), True)]


async def test_a_queued_run_uses_the_options_of_its_turn(rig: Rig) -> None:
    rig.write_policy(enabled=True)
    gate = rig.enforcer.gate("alpha")
    await rig.park("alpha", alongside("alpha"))
    queued, _ = await rig.park("beta", alongside("beta", "gpu0"))

    async def after_alpha(entry: PendingEntry) -> Plan:
        # alpha took gpu0's room: beta now only fits on gpu1.
        if entry.requested_model == "beta":
            return plan_of("beta", alongside("beta", "gpu1"))
        return await _same_plan(entry)

    rig.host.replan = after_alpha
    gate.set()
    rig.enforcer.resolves = False
    await rig.runner.wait_idle()
    assert [c[0] for c in rig.enforcer.calls] == ["alpha", "beta"]
    # Even when the enforcer left the entry, a success removes it.
    assert (queued.id, "applied") in rig.host.resolved
    assert rig.host.admission.get(queued.id) is None


async def test_a_run_whose_turn_comes_after_auto_was_disabled_does_not_happen(rig: Rig) -> None:
    rig.write_policy(enabled=True)
    gate = rig.enforcer.gate("alpha")
    await rig.park("alpha", alongside("alpha"))
    queued, _ = await rig.park("beta", alongside("beta"))
    await rig.enforcer.on_start("alpha").wait()
    await rig.store.set({"disable": True}, False)
    gate.set()
    await rig.runner.wait_idle()
    assert [c[0] for c in rig.enforcer.calls] == ["alpha"]
    assert rig.host.entry(queued.id).reason is ParkReason.NOT_RESIDENT  # honest again
    assert rig.host.cooldowns == {}


async def test_a_run_nobody_waits_for_any_more_does_not_happen(rig: Rig) -> None:
    rig.write_policy(enabled=True)
    gate = rig.enforcer.gate("alpha")
    await rig.park("alpha", alongside("alpha"))
    queued, _ = await rig.park("beta", alongside("beta"))
    rig.host.resolve_pending(queued, "dismissed")
    gate.set()
    await rig.runner.wait_idle()
    assert [c[0] for c in rig.enforcer.calls] == ["alpha"]
    assert rig.host.cooldowns == {}


async def test_a_stale_auto_loading_reason_from_a_restart_is_not_repeated(rig: Rig) -> None:
    rig.write_policy(enabled=True)
    entry = rig.host.park("beta")
    stale = replace(entry, reason=ParkReason.AUTO_LOADING, options=(alongside("beta"),))
    rig.host.admission.replace(stale)
    rig.enforcer.gate("beta")
    rig.host.cooldowns.start("beta", T0 + 60)  # so no new run can start for it
    assert await rig.runner.schedule(stale, plan_of("beta", alongside("beta"))) is None
    assert rig.host.entry(entry.id).reason is ParkReason.NOT_RESIDENT


async def test_close_lets_the_running_run_finish_and_drops_the_waiting_ones(rig: Rig) -> None:
    rig.write_policy(enabled=True)
    gate = rig.enforcer.gate("alpha")
    running, _ = await rig.park("alpha", alongside("alpha"))
    waiting, _ = await rig.park("beta", alongside("beta"))
    await rig.enforcer.on_start("alpha").wait()

    closing = asyncio.create_task(rig.runner.close())
    await _turns()
    assert not closing.done()  # an enforcement is never cut off mid-sequence
    assert rig.host.entry(waiting.id).reason is ParkReason.NOT_RESIDENT
    _, reason = await rig.park("gamma", alongside("gamma"))
    assert reason is None

    gate.set()
    await closing
    assert [c[0] for c in rig.enforcer.calls] == ["alpha"]
    assert rig.host.admission.get(running.id) is None
    assert rig.runner.status() == {"running": None, "queued": [], "cooldowns": {}}


async def test_the_store_refuses_a_grant_without_consent_and_writes_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "placement-auto.json"
    store = PolicyStore(path, lambda: REGISTRY)
    for knob in ("allow_displace", "allow_unload"):
        with pytest.raises(InvalidArgument, match=f"{knob} records standing consent"):
            await store.set({knob: ["alpha"]}, consent=False)
    assert not path.exists()
