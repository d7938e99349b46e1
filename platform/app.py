"""The FastAPI app factory: routes over a ``PlatformContext`` built by the caller."""

from __future__ import annotations

from fastapi import FastAPI

from loramux.platform.api import health, models
from loramux.platform.api.errors import install_error_handlers
from loramux.platform.context import PlatformContext


def create_app(context: PlatformContext) -> FastAPI:
    app = FastAPI(
        title="loramux",
        description="Multi-tenant LoRA serving on one shared base model.",
        version="0.1.0",
    )
    app.state.context = context
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(models.router)
    return app
