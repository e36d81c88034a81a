"""Simulators: what stands in for the machine in tests, the demo and the benchmarks.

``gpu`` is the simulated GPU state file the device probe reads instead of NVML;
``engine`` a fake llama.cpp-like engine (with vLLM's sleep API); ``proxy`` a fake of
the proxy's internal routes; ``gateproxy`` a small proxy built on :mod:`uapplace.gate`;
``usermanager`` a contained ``systemd --user``; ``serving`` what they share to serve on
loopback. See docs/architecture.md ("Simulated GPU and fake engine") and
docs/architecture.md ("Contained user manager").

May import: ``core``, ``files``, ``bus``, ``gate``. Imported by ``io`` (the simulated
GPU file), the demo, the tests and the benchmarks.
"""
