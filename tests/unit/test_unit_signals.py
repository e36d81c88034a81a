"""Which ``PropertiesChanged`` the unit manager parses (issue 23).

pystemd turns every property of a signal into Python objects on the loop that answers
``Admit``; a contained manager sends hundreds for ``app.slice`` and the targets during a
swap. :func:`uapplace.io.units.followed_path` decides from the header alone: units of a kind
that can run an engine are followed, targets, slices, devices, mounts, automounts and
swaps are not, nor anything that is not a unit. The real manager: tests/systemd/test_units.py.
"""

from __future__ import annotations

import pytest
from pystemd.dbuslib import path_encode

from uapplace.io.units import UNIT_PATH_PREFIX, followed_path


def unit_path(name: str) -> bytes:
    encoded: bytes = path_encode(UNIT_PATH_PREFIX, name.encode())
    return encoded


@pytest.mark.parametrize(
    "name",
    [
        "uapplace-demo-coder.service",
        "uap-llama@tiny-b.service",
        "engine.socket",
        "run-u42.scope",
        "a_b.c-d.service",
        "target-host.service",  # "target" inside the name, not its kind
    ],
)
def test_units_that_can_run_an_engine_are_followed(name: str) -> None:
    assert followed_path(unit_path(name))


@pytest.mark.parametrize(
    "name",
    [
        "basic.target",
        "shutdown.target",
        "app.slice",
        "dev-sda.device",
        "home.mount",
        "proc-sys-fs-binfmt_misc.automount",
        "swapfile.swap",
    ],
)
def test_units_that_run_no_engine_are_not(name: str) -> None:
    assert not followed_path(unit_path(name))


@pytest.mark.parametrize(
    "path",
    [
        b"/org/freedesktop/systemd1",
        b"/org/freedesktop/systemd1/job/42",
        b"/org/freedesktop/systemd1/unit",
        b"/org/freedesktop/systemd1/unitx/a_2eservice",
        None,
        "/org/freedesktop/systemd1/unit/a_2eservice",
    ],
)
def test_what_is_not_a_unit_path_is_not(path: object) -> None:
    assert not followed_path(path)
