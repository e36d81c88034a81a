"""Standing consent: the runs no human clicks.

``auto`` takes auto-load runs the operator allowed in ``placement-auto.json``;
``idle`` is the idle unload sweep.

May import: ``core``, ``files``, ``bus``, ``io``, ``controller``.
"""
