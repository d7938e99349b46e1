"""The operator's API under ``/admin`` (admin token): tenants, keys, adapters and the
engine (``router``, ``schemas``, ``engine_schemas``), usage roll-ups and billing exports
(``billing``, ``billing_schemas``), pins (``pins``); and the admin UI's pages (``ui``, outside the OpenAPI
document)."""

from loramux.platform.api.admin import billing, pins, router, ui

ROUTERS = (router.router, pins.router, billing.router)
__all__ = ["ROUTERS", "billing", "pins", "router", "ui"]
