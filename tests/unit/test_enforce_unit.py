"""Enforcement logic that needs no systemd: timeouts, marks, results, revalidation refusals.

The revalidation tests drive a real :class:`Enforcer` over the in-memory host of
``enforce_fakes`` (the real planner, plain lists for residents and pending entries) with a
:class:`UnitManager` that is never connected: every case here refuses before
any unit is touched, which is the point of revalidation.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from enforce_fakes import (
    FakeUnits,
    ListHost,
    measured,
    resident,
    static_readings,
    swap_registry,
)

from uapplace.core.errors import Busy, Drifted, Failed, InvalidArgument, NotFound, UnknownModel
from uapplace.core.model import (
    Config,
    ConfigStatus,
    Holder,
    Model,
    ParkReason,
    PendingEntry,
    Registry,
    ResidentState,
)
from uapplace.core.planner import PlanInput, plan
from uapplace.enforce.enforcer import Enforcer
from uapplace.enforce.run import EnforcementResult, StepRecord, normalize_signature
from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.timeouts import Timeouts
from uapplace.io.engines import ProxyTokenRejected
from uapplace.io.units import UnitManager
from uapplace.publish.unitsync import EnforcementMarks, default_device, registry_units

# --------------------------------------------------------------------------- timeouts


def test_timeouts_defaults_are_positive_and_poll_fast_enough() -> None:
    timeouts = Timeouts()
    assert all(value > 0 for value in timeouts.to_json().values())
    assert timeouts.drain_poll_s <= 0.25
    assert timeouts.health_first_poll_s <= 0.05


def test_timeouts_file_overrides_only_what_it_names(tmp_path: Path) -> None:
    path = tmp_path / "enforcement-timeouts.json"
    path.write_text(json.dumps({"drain_s": 120, "verify_up_s": 30.5}), encoding="utf-8")

    loaded = Timeouts.load(path)

    assert (loaded.drain_s, loaded.verify_up_s) == (120.0, 30.5)
    assert loaded.stop_s == Timeouts().stop_s


def test_timeouts_without_a_file_are_the_defaults(tmp_path: Path) -> None:
    assert Timeouts.load(tmp_path / "missing.json") == Timeouts()
    assert Timeouts.load(None) == Timeouts()


@pytest.mark.parametrize(
    ("content", "where", "says"),
    [
        ({"drain_secs": 5}, "$.drain_secs", "Extra inputs are not permitted"),
        ({"stop_s": -1}, "$.stop_s", "greater than 0"),
        ({"stop_s": "10"}, "$.stop_s", "valid number"),
        ({"drain_poll_s": 1}, "$.drain_poll_s", "less than or equal to 0.25"),
    ],
)
def test_a_bad_timeouts_file_names_file_and_key(
    tmp_path: Path, content: object, where: str, says: str
) -> None:
    path = tmp_path / "enforcement-timeouts.json"
    path.write_text(json.dumps(content), encoding="utf-8")

    with pytest.raises(ConfigFileError) as caught:
        Timeouts.load(path)

    assert caught.value.file == path and caught.value.json_path == where
    assert says in caught.value.message


def test_timeouts_refuse_a_non_positive_value_in_code() -> None:
    with pytest.raises(ValueError, match=r"Timeouts\.drain_s: must be a positive number"):
        Timeouts(drain_s=0)


# --------------------------------------------------------------------------- small parts


def test_signature_normalizes_to_a_sorted_tuple() -> None:
    assert normalize_signature(None) is None
    assert normalize_signature([]) == ()
    assert normalize_signature(["b/2", "a/1"]) == ("a/1", "b/2")


def test_marks_overlay_keeps_a_marked_resident_draining_until_its_run_clears() -> None:
    marks = EnforcementMarks()
    alpha = resident("alpha", "a1")
    marks.mark_draining(("alpha", "a1", "gpu0"), "run-1")
    marks.mark_draining(("beta", "b1", "gpu0"), "run-2")
    marks.expect_unit("gamma", ("gamma", "g1", "gpu0"), "run-1")

    assert marks.overlay(alpha).state is ResidentState.DRAINING
    assert marks.overlay(resident("delta", "d1")).state is ResidentState.HOT
    assert marks.expected_for_unit("gamma.service") == ("gamma", "g1", "gpu0")

    assert marks.clear_run("run-1") == [("alpha", "a1", "gpu0")]
    assert marks.overlay(alpha) == alpha
    assert marks.expected_for_unit("gamma") is None
    assert marks.draining == frozenset({("beta", "b1", "gpu0")})


def test_result_json_is_the_contract_shape() -> None:
    steps = (StepRecord("revalidate", True, "ok"), StepRecord("drain", False, "busy"))
    ok = EnforcementResult(True, "run-1", "plc-abcdef", steps[:1])
    failed = EnforcementResult(False, "run-2", None, steps, rolled_back=False, error="x")

    assert ok.to_json() == {
        "ok": True,
        "placementId": "plc-abcdef",
        "runId": "run-1",
        "steps": [{"name": "revalidate", "ok": True, "detail": "ok"}],
    }
    assert failed.to_json()["rolledBack"] is False
    assert failed.to_json()["error"] == "x"
    assert failed.to_json()["placementId"] is None


# --------------------------------------------------------------------------- an in-memory host


def park(host: ListHost, model: str = "beta") -> PendingEntry:
    options = plan(PlanInput(host.reg, host.live, static_readings()), model).options
    entry = PendingEntry(
        "plc-000001", model, "client", None, 0.0, 1e12, ParkReason.NOT_RESIDENT, options=options
    )
    host.entries[entry.id] = entry
    return entry


@pytest.fixture
async def units() -> AsyncIterator[UnitManager]:
    manager = UnitManager("unix:path=/nonexistent/bus")  # never connected, never called
    yield manager
    manager.close()


@pytest.fixture
def host() -> ListHost:
    return ListHost(live=[resident("alpha", "a1", unit="alpha.service")])


async def test_apply_refuses_a_changed_victim_set_before_touching_anything(
    host: ListHost, units: UnitManager
) -> None:
    entry = park(host)
    assert [o.signature for o in entry.options] == [("alpha/a1",)]

    with pytest.raises(
        Drifted, match=r"victim set changed: approved \[gamma/g1\], now \[alpha/a1\]"
    ):
        await Enforcer(host, units).apply(entry, 1, ["gamma/g1"])

    assert [(s[1], s[2]) for s in host.steps] == [("revalidate", False)]
    assert [r.state for r in host.live] == [ResidentState.HOT]


async def test_reusing_a_warming_resident_leaves_the_entry_pending(units: UnitManager) -> None:
    """Issue 21 item 8: admission still parks ``warming``, so ``applied`` would be false;
    the entry resolves ``forwarded`` once the resident is published."""
    host = ListHost(live=[resident("beta", "b1", ResidentState.WARMING)])
    entry = park(host)
    assert [o.kind.value for o in entry.options][:1] == ["reuse"]

    result = await Enforcer(host, units).apply(entry, 1, [])

    assert result["ok"] is True, result
    assert host.resolved == [] and entry.id in host.entries
    resolve = next(s for s in host.steps if s[1] == "resolve")
    assert "beta/b1 is warming: the entry stays until it is published" in resolve[3]
    hot = ListHost(live=[resident("beta", "b1")])
    served = park(hot)
    assert (await Enforcer(hot, units).apply(served, 1, []))["ok"] is True
    assert hot.resolved == [(served.id, "applied")]


async def test_apply_refuses_an_option_that_no_longer_exists(
    host: ListHost, units: UnitManager
) -> None:
    entry = park(host)
    host.bus_holds.append(("alpha", Holder("editor", "hold", "writing a book")))  # a pin

    with pytest.raises(Drifted, match=r"the approved option .* no longer exists"):
        await Enforcer(host, units).apply(entry, 1, None)

    assert host.steps[-1][1:3] == ("revalidate", False)


async def test_apply_without_a_signature_compares_with_the_stored_option(
    host: ListHost, units: UnitManager
) -> None:
    entry = park(host)
    stale = replace(entry, options=(replace(entry.options[0], victims=()),))
    host.entries[entry.id] = stale

    with pytest.raises(Drifted, match=r"approved \[none\], now \[alpha/a1\]"):
        await Enforcer(host, units).apply(stale, 1)


async def test_apply_checks_the_option_index(host: ListHost, units: UnitManager) -> None:
    entry = park(host)
    enforcer = Enforcer(host, units)

    with pytest.raises(InvalidArgument, match=r"option 2 is out of range: .* options 1\.\.1"):
        await enforcer.apply(entry, 2)
    with pytest.raises(InvalidArgument, match="option 0 is out of range"):
        await enforcer.apply(entry, 0)


async def test_unload_refuses_a_model_that_is_not_resident_or_unknown(
    host: ListHost, units: UnitManager
) -> None:
    enforcer = Enforcer(host, units)

    with pytest.raises(NotFound, match="beta is not resident"):
        await enforcer.unload("beta", [])
    with pytest.raises(UnknownModel):
        await enforcer.unload("nope", [])


async def test_unload_refuses_a_held_resident(host: ListHost, units: UnitManager) -> None:
    host.bus_holds.append(("alpha", Holder("ide", "hold", "pairing")))

    with pytest.raises(Busy, match=r"held on the bus by ide \(pairing\)"):
        await Enforcer(host, units).unload("alpha", ["alpha/a1"])


async def test_an_unitless_victim_is_refused(units: UnitManager) -> None:
    host = ListHost(live=[resident("alpha", "a1", unit=None)])
    entry = park(host)

    with pytest.raises(Failed, match="run without a systemd unit"):
        await Enforcer(host, units).apply(entry, 1, ["alpha/a1"])


async def test_a_second_operator_call_is_busy_while_one_runs(
    host: ListHost, units: UnitManager
) -> None:
    entry = park(host)
    host.gate = asyncio.Event()
    enforcer = Enforcer(host, units)
    first = asyncio.create_task(enforcer.apply(entry, 1, ["gamma/g1"]))
    await asyncio.sleep(0)  # the first run holds the lock, waiting in revalidate
    assert enforcer.running is not None and "apply plc-000001 option 1" in enforcer.running

    with pytest.raises(Busy, match="another enforcement is running"):
        await enforcer.load("beta", [])
    waiting = asyncio.create_task(enforcer.unload("beta", [], wait=True))  # queues instead
    host.gate.set()

    with pytest.raises(Drifted):
        await first
    with pytest.raises(NotFound):  # it ran after the first, and refused on its own terms
        await waiting
    assert enforcer.running is None


# --------------------------------------------------------------------------- unit sync mapping


def test_registry_units_map_units_to_their_configs() -> None:
    reg = swap_registry()
    shared = Model(
        "gamma",
        "Gamma",
        "vllm",
        {"g1": measured("g1", 1000), "g2": measured("g2", 2000, unit="gamma-big.service")},
        unit="gamma",
    )
    reg = Registry(reg.devices, {**reg.models, "gamma": shared})

    mapped = {
        unit: [(m.key, c.key) for m, c in pairs] for unit, pairs in registry_units(reg).items()
    }

    assert mapped == {
        "alpha.service": [("alpha", "a1")],
        "beta.service": [("beta", "b1")],
        "gamma.service": [("gamma", "g1")],
        "gamma-big.service": [("gamma", "g2")],
    }


def test_default_device_prefers_measured_on_then_affinity_then_first_gpu() -> None:
    reg = swap_registry()
    model = reg.models["alpha"]
    config = model.configs["a1"]
    assert default_device(reg, model, config) == "gpu0"
    unmeasured = Config("u", ConfigStatus.UNMEASURED)
    assert default_device(reg, model, unmeasured) == "gpu0"
    pinned = replace(model, affinity_devices=("cpu0",))
    assert default_device(reg, pinned, unmeasured) == "cpu0"


# --------------------------------------------------------------------------- load/unload signatures


async def test_load_that_would_evict_refuses_an_empty_signature_touching_nothing(
    host: ListHost, units: UnitManager
) -> None:
    # beta only fits by stopping alpha; [] approves stopping nothing.
    with pytest.raises(Drifted, match=r"approved \[none\], now \[alpha/a1\]"):
        await Enforcer(host, units).load("beta", [])

    assert [(s[1], s[2]) for s in host.steps] == [("revalidate", False)]
    assert [r.state for r in host.live] == [ResidentState.HOT]


async def test_load_refuses_a_stale_signature(host: ListHost, units: UnitManager) -> None:
    with pytest.raises(Drifted, match=r"approved \[gamma/g1\], now \[alpha/a1\]"):
        await Enforcer(host, units).load("beta", ["gamma/g1"])


async def test_unload_refuses_a_signature_that_is_not_what_would_stop(
    host: ListHost, units: UnitManager
) -> None:
    enforcer = Enforcer(host, units)
    with pytest.raises(Drifted, match=r"approved \[none\], now \[alpha/a1\]"):
        await enforcer.unload("alpha", [])
    with pytest.raises(Drifted, match=r"approved \[alpha/a0\], now \[alpha/a1\]"):
        await enforcer.unload("alpha", ["alpha/a0"])

    assert [r.state for r in host.live] == [ResidentState.HOT]


# --------------------------------------------------------------------------- proxy token (issue 13)


@dataclass
class TokenRejectingHost(ListHost):
    """The proxy answers 401 on its in-flight route: our token is not its token."""

    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        raise ProxyTokenRejected("the proxy at http://127.0.0.1:9 refused ... (HTTP 401)")


async def test_a_proxy_token_mismatch_fails_the_drain_at_once_and_stops_nothing() -> None:
    host = TokenRejectingHost(live=[resident("alpha", "a1", unit="alpha.service")])
    entry = park(host)
    units = FakeUnits(active={"alpha.service": "active"})
    enforcer = Enforcer(host, units)  # the default 60 s drain

    result = await enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["ok"] is False
    assert "drain: the proxy at http://127.0.0.1:9 refused" in result["error"]
    assert "HTTP 401" in result["error"] and "nothing was stopped" in result["error"]
    names = [(s[1], s[2]) for s in host.steps]
    assert ("drain", False) in names
    assert not any(name == "stop" for name, _ in names)
    assert [r.state for r in host.live] == [ResidentState.HOT]  # the draining mark is gone
    assert units.jobs == []
