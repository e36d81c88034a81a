"""Helpers any tier may use, so that no tier imports another's tests.

One module a concern: the documents worlds are seeded with (``seed_docs``, ``registries``),
core model builders (``builders``), the apply steps (``steps``), waiting on what nothing
signals (``polling``), and the programs the tests start (``commands``, ``gate_proxy``).
"""
