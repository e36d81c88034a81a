"""The machine: systemd units, devices, engines.

Owns pystemd unit control (``units``; its method calls in a worker process,
``unitworker``, because pystemd holds the GIL while it waits for systemd), device
probes: NVML, the simulated GPU, the host (``devices``), engine and proxy HTTP probes
(``engines``), what an engine says of its own in-flight work (``busy``, the drain's
second source), llama.cpp routers' model load/unload and status (``router``), a unit's
own last lines from the journal or its log file (``unitlogs``), per-target rails
(``rails``), the daemon's counters (``counters``) and the Protocols enforcement and
recovery see these through (``seams``: fakes stand in for them in the unit tier).

May import: ``core``, ``files``, ``bus``, ``sim`` (the simulated GPU state file).
"""
