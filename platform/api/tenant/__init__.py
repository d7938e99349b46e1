"""A tenant's own API: its adapters (``adapters``: upload, list, read, delete; and
``adapter_grants``: sharing them with other tenants; ``adapter_pins``: keeping one on the
device), its usage
(``usage``, with the operator's ``/admin/usage``) and who it is (``identity``:
``/v1/me``), each with its schemas (``*_schemas``)."""

from loramux.platform.api.tenant import adapter_grants, adapter_pins, adapters, identity, usage

ROUTERS = (
    usage.router,
    adapters.router,
    adapter_grants.router,
    adapter_pins.router,
    identity.router,
)
