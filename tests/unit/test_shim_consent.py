"""The shim's operator routes carry the approval signature (docs/http-contract.md §4)."""

from __future__ import annotations

from typing import TypeVar

import pytest

from uapplace.bus.client import PlacementError
from uapplace.shim.bodies import (
    MISSING_SIGNATURE,
    ModelBody,
    ResolveBody,
    VictimRefBody,
    signature_of,
)
from uapplace.shim.gateway import BusGateway, BusWork, PeerWork
from uapplace.shim.handlers import Shim
from uapplace.shim.metrics import ShimMetrics
from uapplace.shim.responses import HttpError
from uapplace.shim.settings import ShimSettings

T = TypeVar("T")

DRIFTED = "victim set changed: approved [none], now [alpha/alpha-q4]; look at the preview again"


class DriftedGateway(BusGateway):
    """The daemon's answer to a call that would stop something nobody approved."""

    def __init__(self) -> None:
        super().__init__("unix:path=/nonexistent", ShimMetrics())

    async def call(
        self,
        method: str,
        deadline: float,
        work: BusWork[T],
        *,
        peer_work: PeerWork[T] | None = None,
    ) -> T:
        raise PlacementError("org.uap.Placement1.Error.Drifted", DRIFTED)


def shim() -> Shim:
    return Shim(
        ShimSettings(token="t" * 32, bus_address="unix:path=/nonexistent"), DriftedGateway()
    )


def test_expected_victims_become_the_bus_signature() -> None:
    refs = [
        VictimRefBody(model="beta", config="b1", action="stop"),
        VictimRefBody(model="alpha", config="a1", action="stop"),
    ]
    assert signature_of(refs) == ["alpha/a1", "beta/b1"]
    assert signature_of([]) == []
    # Omitted approves stopping nothing; it is never "skip the check".
    assert signature_of(None) == []


def test_load_and_unload_bodies_take_expected_victims() -> None:
    body = ModelBody.model_validate(
        {
            "model": "beta",
            "expected_victims": [
                {"model": "alpha", "config": "a1", "action": "stop", "state": "hot"}
            ],
        }
    )
    assert signature_of(body.expected_victims) == ["alpha/a1"]
    assert ModelBody.model_validate({"model": "beta"}).expected_victims is None
    resolve = ResolveBody.model_validate({"placement_id": "plc-000001", "option": 1})
    assert resolve.expected_victims is None


@pytest.mark.parametrize(("verb", "method"), [("load", "Load"), ("resolve", "Apply")])
async def test_an_omitted_signature_that_would_stop_something_is_409_saying_it_is_required(
    verb: str, method: str
) -> None:
    with pytest.raises(HttpError) as answered:
        await shim().enforcement(verb, method, "", lambda c: c.load("beta", []), signed=False)
    assert answered.value.status == 409
    assert answered.value.message.startswith(MISSING_SIGNATURE)
    assert "now [alpha/alpha-q4]" in answered.value.message


async def test_a_stale_signature_is_409_without_the_missing_hint() -> None:
    with pytest.raises(HttpError) as answered:
        await shim().enforcement("load", "Load", "", lambda c: c.load("beta", ["x/y"]))
    assert answered.value.status == 409
    assert answered.value.message == DRIFTED
