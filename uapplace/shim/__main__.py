"""``python -m uapplace.shim``: the ``uapplace-shim`` command, for the demo and the tests,
which start the shim with the running interpreter rather than an installed script."""

from __future__ import annotations

import contextlib

from uapplace.shim.server import main

if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
