"""The bus's JSON forms (docs/bus-api.md, "JSON shapes") that the CLI's tests feed it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def displace(
    model: str, config: str, cost_mib: float, *victims: Mapping[str, Any], **extra: Any
) -> dict[str, Any]:
    """A ``displace`` option (``ListPending``): ``model/config`` onto ``gpu0`` for
    ``cost_mib``, displacing ``victims``; ``extra``: more keys (``signature``,
    ``frees_mib``)."""
    return {
        "kind": "displace",
        "model": model,
        "config": config,
        "device": "gpu0",
        "cost_mib": cost_mib,
        "victims": [dict(victim) for victim in victims],
        **extra,
    }
