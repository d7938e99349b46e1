"""The FastAPI app factory: routes over a ``PlatformContext`` built by the caller."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from loramux.platform.api import adapters, admin, completions, health, models, usage
from loramux.platform.api.errors import install_error_handlers
from loramux.platform.context import PlatformContext
from loramux.platform.services.adapter_runtime import AdapterRuntime


def create_app(context: PlatformContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The in-process engine's step thread lives exactly as long as the app.
        if context.engine is not None:
            await context.engine.start()
        try:
            yield
        finally:
            if context.engine is not None:
                await context.engine.stop()

    app = FastAPI(
        lifespan=lifespan,
        title="loramux",
        description="Multi-tenant LoRA serving on one shared base model.",
        version="0.1.0",
    )
    app.state.context = context
    app.state.adapter_runtime = AdapterRuntime(context)
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(models.router)
    app.include_router(admin.router)
    app.include_router(usage.router)
    app.include_router(completions.router)
    app.include_router(adapters.router)
    return app
