"""Publication: when a resident may be called serving.

``verify`` is the one publication check (health, served id, ``metricsMustMatch``),
``publication`` verifies until a resident may be published ``hot`` and shows a hot one
asleep while its engine sleeps on its own (``SleepWatch``), ``unitsync`` makes
residents follow unit states (units started by hand included).

May import: ``core``, ``files``, ``bus``, ``io``.
"""
