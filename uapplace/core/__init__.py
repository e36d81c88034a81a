"""The core: shared types and the pure decisions of docs/placement-rules.md.

Owns the frozen dataclasses every layer speaks (``model``), the domain errors
(``errors``), the admission table (``admission``), the planner and what it is made
of (``planner``, ``eviction``, ``ranking``, ``victims``, ``conflicts``), the
proxy's topology rules (``topology``), alerts (``alerts``), the rule that makes a
measurement stale (``staleness``), the enforcement steps' names (``steps``), what a bus
client shares with the daemon without the model (``conventions``: timestamps, the
default context, option numbers) and three small text helpers (``validation``,
``textsafe``, ``unitnames``).

May import: nothing of uapplace outside ``core``. Everything here is testable
without a bus, a GPU, a file or systemd (docs/architecture.md, "Layers").

Why 16 modules: each is one table or rule of docs/placement-rules.md; splitting the
planner from eviction and ranking would put one decision in two packages, and a
sub-package for the three text helpers would hold less than it costs to find;
``conventions`` is apart from ``model`` so that the light CLI loads neither the model's
dataclasses nor the admission table (docs/performance.md, "The light CLI on click").
"""
