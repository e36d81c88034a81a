"""The project's programs as the tests start them: ``python -m`` under this interpreter."""

from __future__ import annotations

import sys


def shim_argv(bus_address: str, *args: str) -> list[str]:
    """``uapplace-shim`` on an OS-picked loopback port (``--port 0``) against ``bus_address``."""
    program = [sys.executable, "-m", "uapplace.shim"]
    return [*program, "--port", "0", "--bus-address", bus_address, *args]
