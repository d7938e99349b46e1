"""``GET /v1/models`` (``router``)."""

from loramux.platform.api.models import router

ROUTERS = (router.router,)
