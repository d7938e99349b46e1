"""A tenant's own API: its adapters (``adapters``: upload, list, read, delete; and
``adapter_grants``: sharing them with other tenants), its usage
(``usage``, with the operator's ``/admin/usage``) and who it is (``identity``:
``/v1/me``), each with its schemas (``*_schemas``)."""

from loramux.platform.api.tenant import adapter_grants, adapters, identity, usage

ROUTERS = (usage.router, adapters.router, adapter_grants.router, identity.router)
