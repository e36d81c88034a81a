"""Consent is bound to the action (issue 20): the signature names stop or pause, every option
carries one, and an option whose signature is not the one sent is ``Drifted``.

A real :class:`~uapplace.enforce.enforcer.Enforcer` over :mod:`enforce_fakes`: coder (vLLM,
pausable) runs on gpu0 and beta only fits once coder stops or sleeps, so the planner offers
both forms of one displacement. The shim's side: an ``expected_victims`` entry without its
``action`` is a 400 naming the field, never a default stop (docs/http-contract.md §4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from enforce_fakes import (
    GPU,
    Scene,
    endpoint_of,
    host_reading,
    measured,
    resident,
    swap_registry,
    vllm,
)
from pydantic import ValidationError

from tests.worlds.bus_forms import displace
from uapplace.cli.enforce import apply_impact
from uapplace.core.errors import Drifted
from uapplace.core.model import (
    PAUSE_SUFFIX,
    DeviceKind,
    DeviceReading,
    OptionKind,
    ProbeSource,
    Registry,
    ResidentState,
)
from uapplace.core.planner import PlanInput, plan
from uapplace.shim.bodies import ModelBody, ResolveBody, VictimRefBody

CODER = endpoint_of("coder")
STOP = "coder/c1"
PAUSE = f"coder/c1{PAUSE_SUFFIX}"


def pause_registry() -> Registry:
    coder = vllm("coder", measured("c1", 16000, pause_lever="vllm-sleep-2"))
    base = swap_registry()
    return Registry(base.devices, {"coder": coder, "beta": base.models["beta"]})


@pytest.fixture
def scene(tmp_path: Path) -> Scene:
    running = [resident("coder", "c1", ResidentState.HOT, engine="vllm", gpu_mib=16000.0)]
    return Scene(tmp_path, pause_registry(), running)


def index_of(scene: Scene, signature: str) -> int:
    """The 1-based option whose signature is ``[signature]``."""
    entry = scene.host.entries["plc-000001"]
    return next(i for i, o in enumerate(entry.options, 1) if o.signature == (signature,))


def assert_untouched(scene: Scene) -> None:
    assert [(s[1], s[2]) for s in scene.host.steps] == [("revalidate", False)]
    assert scene.units.jobs == [] and scene.engines.asleep == set()
    assert scene.host.states() == {"coder/c1": "hot"}
    scene.assert_ended_cleanly()


@pytest.mark.parametrize(
    ("form", "sent", "says"),
    [
        pytest.param(
            PAUSE,
            STOP,
            r"approved \[coder/c1\], now \[coder/c1@pause\] for the chosen",
            id="stop-signature-on-the-pause-form",
        ),
        pytest.param(
            STOP,
            PAUSE,
            r"approved \[coder/c1@pause\], now \[coder/c1\] for the chosen",
            id="pause-signature-on-the-stop-form",
        ),
    ],
)
async def test_the_other_forms_signature_is_drifted_and_neither_stops_nor_pauses(
    scene: Scene, form: str, sent: str, says: str
) -> None:
    entry = scene.park("beta")

    with pytest.raises(Drifted, match=says):
        await scene.enforcer.apply(entry, index_of(scene, form), [sent])

    assert_untouched(scene)


async def test_each_form_with_its_own_signature_does_exactly_its_action(tmp_path: Path) -> None:
    for signature, unit_jobs, state in (
        (STOP, ["stop coder.service", "start beta.service"], None),
        (PAUSE, ["start beta.service"], "paused"),
    ):
        running = [resident("coder", "c1", ResidentState.HOT, engine="vllm", gpu_mib=16000.0)]
        scene = Scene(tmp_path / signature.replace("/", "-"), pause_registry(), running)
        entry = scene.park("beta")

        result = await scene.enforcer.apply(entry, index_of(scene, signature), [signature])

        assert result["ok"] is True, result
        assert scene.units.jobs == unit_jobs
        assert scene.host.states().get("coder/c1") == state
        assert scene.engines.asleep == ({CODER} if state else set())


async def test_load_runs_the_form_its_signature_names(tmp_path: Path) -> None:
    running = [resident("coder", "c1", ResidentState.HOT, engine="vllm", gpu_mib=16000.0)]
    scene = Scene(tmp_path, pause_registry(), running)

    result = await scene.enforcer.load("beta", [STOP])

    assert result["ok"] is True, result
    assert scene.units.jobs == ["stop coder.service", "start beta.service"]
    assert scene.engines.asleep == set()


def test_every_option_kind_carries_its_signature() -> None:
    registry = pause_registry()
    coder = resident("coder", "c1", ResidentState.HOT, engine="vllm", gpu_mib=16000.0)
    readings = {"gpu0": gpu_reading(GPU.total_mib - 16000), "cpu0": host_reading()}
    displace = plan(PlanInput(registry, [coder], readings), "beta").options
    reuse = plan(PlanInput(registry, [coder], readings), "coder").options
    empty = {"gpu0": gpu_reading(GPU.total_mib), "cpu0": host_reading()}
    alongside = plan(PlanInput(registry, [], empty), "beta")
    by_kind = {o.kind: o.to_json() for o in (*displace, *reuse, *alongside.options)}

    assert set(by_kind) == {OptionKind.DISPLACE, OptionKind.REUSE, OptionKind.LOAD_ALONGSIDE}
    assert by_kind[OptionKind.REUSE]["signature"] == []
    assert by_kind[OptionKind.LOAD_ALONGSIDE]["signature"] == []
    signed = sorted(o.to_json()["signature"][0] for o in displace)
    assert signed == [STOP, PAUSE]


def gpu_reading(free: float) -> DeviceReading:
    return DeviceReading("gpu0", DeviceKind.GPU, GPU.total_mib, free, ProbeSource.SIM)


# --------------------------------------------------------------------------- the shim


def test_an_expected_victim_without_its_action_is_refused_naming_the_field() -> None:
    unsigned = [{"model": "c", "config": "q"}]
    with pytest.raises(ValidationError, match=r"expected_victims\.0\.action"):
        ResolveBody.model_validate(
            {"placement_id": "plc-000001", "option": 1, "expected_victims": unsigned}
        )
    with pytest.raises(ValidationError, match=r"expected_victims\.0\.action"):
        ModelBody.model_validate({"model": "b", "expected_victims": unsigned})
    with pytest.raises(ValidationError, match="action"):
        VictimRefBody.model_validate({"model": "c", "config": "q"})


# --------------------------------------------------------------------------- the CLI


class PendingClient:
    """The one call ``apply_impact`` makes: ``ListPending`` with a pause form as option 2."""

    def __init__(self, options: list[dict[str, Any]]) -> None:
        self.options = options

    async def list_pending(self) -> dict[str, Any]:
        entry = {"id": "plc-000001", "requested_model": "beta", "client": "c", "options": []}
        return {"pending": [{**entry, "options": self.options}]}


async def test_the_cli_sends_the_full_signature_it_previewed() -> None:
    victim = {"model": "coder", "config": "c1", "action": "pause", "frees_mib": 16000}
    pause_form = displace("beta", "b1", 16000, victim, signature=[PAUSE])
    stop_form = {**pause_form, "victims": [{**victim, "action": "stop"}], "signature": [STOP]}
    client: Any = PendingClient([stop_form, pause_form])

    prepared = await apply_impact(client, "plc-000001", 2)

    assert getattr(prepared, "signature", None) == [PAUSE]
