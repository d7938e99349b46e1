"""``POST /v1/completions`` and ``POST /v1/adapters/{name}/completions`` (``router``)."""

from loramux.platform.api.completions import router

ROUTERS = (router.router,)
