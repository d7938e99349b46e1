"""``POST /v1/chat/completions`` (``router``), with tool calling: the tools told to the
model (``chat/tool_messages.py``), their grammar (``chat/tool_params.py``), and the ``tool_calls`` in the
answer (``chat/tool_render.py``)."""

from loramux.platform.api.chat import router

ROUTERS = (router.router,)
