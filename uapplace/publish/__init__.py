"""Publication: when a resident may be called serving.

``verify`` is the one publication check (health, served id, ``metricsMustMatch``),
``publication`` verifies until a resident may be published ``hot``, ``unitsync`` makes
residents follow unit states (units started by hand included).

May import: ``core``, ``files``, ``bus``, ``io``.
"""
