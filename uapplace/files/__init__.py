"""Every file uapplace reads or writes, and its schema.

Owns the paths and environment knobs (``paths``), the one JSON reader and atomic
writer (``jsonfile``), the registry (``registry``, ``registry_schema``,
``registry_write``), the capacity policy (``capacity``), the ledger
``placement.json`` (``ledger``, ``ledger_schema``), the enforcement journal
(``journal``), the timeouts file (``timeouts``), the standing-consent policy
(``autopolicy``), the shim's dashboard token (``token``) and the stock proxy's one
upstream as its environment file names it (``proxyenv``); a backend's unit from its
tracked template (``unit_template``) and its machine-local registry entry
(``backend_entry``); the files shipped beside the code, in a checkout or a wheel
(``shipped``). Pydantic lives here, at
the edge; what a file holds is handed inward as ``core.model`` dataclasses. Every file
uapplaced takes orders from is read ``trusted`` (owned by its user or root, writable by
no one else) and every number in it has a range (docs/placement-rules.md §4.7).

May import: ``core``.

Why 16 modules: one module per file and concern (the registry's and the ledger's
pydantic schemas apart from their readers and writers, so that a schema reads whole on
one page); a sub-package per file would hold one to three modules each and spread one
edge of the system over several folders.
"""
