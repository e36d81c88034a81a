"""Measuring footprints and the enforcement envelope from the live engine.

``reading`` picks the config and reads the unit's PIDs and device, ``measurer``
records a footprint, ``geometry`` derives the KV geometry from what the engine
reports (``/metrics``, llama.cpp's ``/props`` and the unit's ``ExecStart``),
``envelope`` times stop, memory back, cold and warm start, sleep and wake (inside the
consented window the daemon hands it), ``launch`` reads what each unit runs now (its
``ExecStart``, its engine's build) for the stale-measurement rule.

May import: ``core``, ``files``, ``bus``, ``io``, ``publish``.
"""
