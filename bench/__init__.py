"""Benchmarks and the chaos harness, run by hand (``make bench``), never as tests.

A package so that ``tests/systemd/test_chaos.py`` imports :mod:`bench.chaos` under
one name and mypy checks each script once (``files`` in pyproject's ``[tool.mypy]``).
"""
