"""The enforcement steps a test expects, written out once as the contract (docs/http-contract.md §4)
rather than read back from the code under test."""

from __future__ import annotations

from typing import Any

APPLY_STEPS = [
    "revalidate",
    "preflight",
    "mark-draining",
    "drain",
    "stop",
    "verify-free",
    "start",
    "verify-up",
    "refresh-proxy",
    "resolve",
]
"""The steps of a successful apply that displaces a resident, in the order they are reported."""

UNLOAD_STEPS = [step for step in APPLY_STEPS if step not in ("start", "verify-up")]
"""The steps of a successful unload: an apply's, less starting and verifying a new model."""

_THROUGH_VERIFY_UP = APPLY_STEPS[: APPLY_STEPS.index("verify-up") + 1]

ROLLED_BACK_STEPS = [
    *_THROUGH_VERIFY_UP,
    "rollback-stop",
    "rollback-start",
    "rollback-verify",
    "rollback-clear",
]
"""A displacing apply whose new engine fails verify-up: the victim is started again."""

LOAD_FAILED_STEPS = [*_THROUGH_VERIFY_UP, "rollback-stop", "rollback-clear"]
"""A load that displaces nothing, whose new engine dies while loading."""


def detail(result: dict[str, Any], name: str) -> str:
    """The detail of the enforcement result's one step ``name`` (it must have run once)."""
    [step] = [s for s in result["steps"] if s["name"] == name]
    assert isinstance(step["detail"], str)
    return step["detail"]
