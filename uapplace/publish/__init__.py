"""Publication: when a resident may be called serving.

``verify`` is the one publication check (health, served id, ``metricsMustMatch``),
``publication`` verifies until a resident may be published ``hot`` and re-checks every
hot one while it serves (``SleepWatch``: shown asleep while its engine sleeps on its own,
unpublished when it is asleep for good, gone or serving another id), ``unitsync`` makes
residents follow unit states (units started by hand included).

May import: ``core``, ``files``, ``bus``, ``io``.
"""
