"""The shim's route table: one path per route name.

Read by :func:`uapplace.shim.app.create_app` (what is served),
:func:`uapplace.shim.access.check_access` (admit's own access rule) and the OpenAPI
document (:mod:`uapplace.shim.openapi`), so the three cannot name different paths.
"""

from __future__ import annotations

ROUTES = {
    "admit": "/api/placement/admit",
    "state": "/api/placement/state",
    "pending": "/api/placement/pending",
    "preview": "/api/placement/preview",
    "resolve": "/api/placement/resolve",
    "dismiss": "/api/placement/dismiss",
    "load": "/api/placement/load",
    "unload": "/api/placement/unload",
    "auto": "/api/placement/auto",
    "targets": "/api/placement/targets",
    "events": "/api/placement/events",
    "metrics": "/metrics",
    "openapi": "/openapi.json",
}
