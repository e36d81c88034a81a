"""The live daemon's introspection is exactly the checked-in contract."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dbus_fast.introspection import Interface, Node

from tests.bus.conftest import DaemonProcess, busctl
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH

pytestmark = pytest.mark.bus

CONTRACT = Path(__file__).resolve().parents[2] / "dbus" / "org.uap.Placement1.xml"


def interface_of(node: Node) -> Interface:
    found = [i for i in node.interfaces if i.name == INTERFACE]
    assert len(found) == 1, [i.name for i in node.interfaces]
    return found[0]


def shape(interface: Interface) -> dict[str, Any]:
    """Everything a client can rely on: names, signatures, directions, access, annotations."""

    def args(items: list[Any]) -> list[tuple[str | None, str]]:
        return [(a.name, a.signature) for a in items]

    return {
        "annotations": dict(interface.annotations),
        "methods": {
            m.name: (args(m.in_args), args(m.out_args), dict(m.annotations))
            for m in interface.methods
        },
        "signals": {s.name: (args(s.args), dict(s.annotations)) for s in interface.signals},
        "properties": {
            p.name: (p.signature, p.access.value, dict(p.annotations)) for p in interface.properties
        },
    }


def test_live_introspection_matches_the_contract(daemon: DaemonProcess) -> None:
    done = busctl(daemon.uap.bus_address, "introspect", "--xml-interface", BUS_NAME, OBJECT_PATH)
    assert done.returncode == 0, done.stderr
    live = shape(interface_of(Node.parse(done.stdout)))
    contract = shape(interface_of(Node.parse(CONTRACT.read_text(encoding="utf-8"))))
    assert live == contract


def test_the_contract_names_every_argument() -> None:
    contract = shape(interface_of(Node.parse(CONTRACT.read_text(encoding="utf-8"))))
    for name, (inputs, outputs, _) in contract["methods"].items():
        assert all(arg_name for arg_name, _ in inputs + outputs), name
    for name, (arguments, _) in contract["signals"].items():
        assert all(arg_name for arg_name, _ in arguments), name
