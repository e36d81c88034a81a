"""The enforcement steps a test expects, written out once as the contract (docs/http-contract.md §4)
rather than read back from the code under test."""

from __future__ import annotations

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
