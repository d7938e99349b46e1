"""OpenAI's Responses API: ``POST /v1/responses`` and ``POST /v1/adapters/{name}/responses``
(``router``), its request (``schemas``, ``input``) and its answer (``render``)."""

from loramux.platform.api.responses import router

ROUTERS = (router.router,)
