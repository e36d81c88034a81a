"""``uapplace demo``: the embedded walkthrough and its sandbox.

``sandbox`` builds a contained user manager, the simulated GPU, engines as units,
a fake proxy, the daemon and the shim; ``walkthrough`` is what the operator sees.
Also used by ``bench/``.

May import: ``core``, ``files``, ``bus``, ``io``, ``sim``. The daemon and the shim
run as processes, never as imports.
"""
