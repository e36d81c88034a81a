"""Simulators: what stands in for the machine in tests, the demo and the benchmarks.

``gpu`` is the simulated GPU state file the device probe reads instead of NVML;
``engine`` a fake llama.cpp-like engine (llama.cpp's idle sleep, vLLM's sleep API),
``completions`` its llama.cpp slot and completion shapes; ``router`` a fake llama.cpp
router (``--models-dir``: each model loaded as a child process of the fake engine);
``proxy`` a fake of the proxy's internal routes; ``gateproxy`` a small proxy built on
:mod:`uapplace.gate`; ``usermanager`` a contained ``systemd --user``; ``serving`` what they
share to serve on loopback. For the real engine: ``llamacpp`` says where the pinned
``llama-server`` that ``make engine`` builds is cached, and how one is started (it runs
nothing); ``gguf_models`` writes tiny GGUF models for it (needs the ``engines`` extra,
``gguf``).
See docs/architecture.md ("Simulated GPU and fake engine"), docs/architecture.md
("Contained user manager") and docs/architecture.md ("Test tiers").

May import: ``core``, ``files``, ``bus``, ``gate``. Imported by ``io`` (the simulated
GPU file), the demo, the tests and the benchmarks.
"""
