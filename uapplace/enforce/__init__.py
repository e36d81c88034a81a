"""Enforcement: the switch sequence of docs/placement-rules.md ("Enforcement").

``enforcer.Enforcer`` drives one run machine-wide: revalidate (``revalidate``),
preflight (``preflight``), the forward steps (``steps``), pause and wake
(``pause``), rollback (``rollback``), the journal record before each unit change
(``journaling``); ``measuring`` the consent, drain and journal around
``measure --envelope``; ``run`` holds a run's bookkeeping (the step names are
``core.steps``'s), ``host`` the controller as enforcement sees it.

May import: ``core``, ``files``, ``bus``, ``io``, ``controller``, ``publish``.
"""
