"""systemd unit names: which are safe to hand to systemd, and the full ``.service`` name.

Every unit name uapplace passes to systemd comes from a registry file or a bus call;
:func:`valid_unit_name` is the one check (never a shell: names go to D-Bus only), and
:func:`unit_file_name` the one spelling (``name`` → ``name.service``). Used by the
registry schema, the unit manager (:mod:`uapplace.io.units`), enforcement, the journal,
the unit sync and the capacity policy.
"""

from __future__ import annotations

import re

UNIT_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]*$")
_UNIT_NAME_MAX = 255
_UNIT_SUFFIXES = frozenset(
    {
        "service",
        "socket",
        "target",
        "device",
        "mount",
        "automount",
        "swap",
        "timer",
        "path",
        "slice",
        "scope",
    }
)


ENGINELESS_KINDS = ("target", "slice", "device", "mount", "automount", "swap")
"""Unit kinds that run no process of their own to serve a model: a registry refuses them
as a model's unit, and the unit manager does not follow their changes."""


def engineless_kind(name: str) -> str | None:
    """The kind of unit ``name`` names when it is one of :data:`ENGINELESS_KINDS`."""
    _, dot, suffix = name.rpartition(".")
    return suffix if dot and suffix in ENGINELESS_KINDS else None


def valid_unit_name(name: str) -> bool:
    """Safe to hand to systemd as a user unit name (never to a shell)."""
    return (
        0 < len(name) <= _UNIT_NAME_MAX
        and UNIT_NAME_RE.fullmatch(name) is not None
        and ".." not in name
        and "/" not in name
    )


def unit_file_name(name: str) -> str:
    """``uap-strata-server`` → ``uap-strata-server.service``; a typed name stays as it is."""
    _, dot, suffix = name.rpartition(".")
    if dot and suffix in _UNIT_SUFFIXES:
        return name
    return f"{name}.service"
