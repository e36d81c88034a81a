"""``uapplace demo``: the embedded walkthrough and its sandbox.

``sandbox`` builds a contained user manager, the simulated GPU, engines as units
from the tracked templates ``uapplace unit add`` fills (the fake engine, or real
llama.cpp ``llama-server`` units on the CPU tier), a fake proxy, the daemon and the
shim; ``walkthrough`` is what the operator sees; ``real_engine`` is ``uapplace demo
--engine llama.cpp`` (measure, swap, unload and load on real servers). Also used by
``bench/``.

May import: ``core``, ``files``, ``bus``, ``io``, ``sim``. The daemon and the shim
run as processes, never as imports.
"""
