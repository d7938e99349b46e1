"""The FastAPI app factory: routes over a ``PlatformContext`` built by the caller."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from loramux.platform.api import admin, chat, completions, models, ops, responses, tenant
from loramux.platform.api.errors import install_error_handlers
from loramux.platform.api.middleware.body_limit import (
    DEFAULT_MAX_BODY_BYTES,
    UPLOAD_ROUTE,
    BodyDeadline,
    BodyLimitMiddleware,
)
from loramux.platform.api.middleware.input_guard import InputGuardMiddleware
from loramux.platform.api.openapi_errors import install_error_docs
from loramux.platform.api.ops.metrics import HTTPMetricsMiddleware, PlatformMetrics
from loramux.platform.context import PlatformContext
from loramux.platform.services.adapter_pins import stored_pins
from loramux.platform.services.adapter_runtime import AdapterRuntime
from loramux.platform.services.load_shedding import (
    LoadControl,
    LoadMetrics,
    QueueLimits,
    ServiceRates,
)
from loramux.platform.services.metering import Meter
from loramux.platform.services.running import RunningRequests
from loramux.platform.services.tenants import push_all_scheduling
from loramux.platform.services.upload_cleanup import (
    sweep_abandoned_uploads,
    sweep_periodically,
)
from loramux.platform.services.upload_workspace import UploadWorkspace
from loramux.platform.services.usage_journal import UsageJournal


def create_app(
    context: PlatformContext, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> FastAPI:
    """The app over ``context``; request bodies over ``max_body_bytes`` are refused with
    413 (adapter uploads have their own cap, ``settings.max_upload_bytes``)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Uploads cut off by a crash or restart leave nothing behind: this replica's scratch
        # folder is emptied, the versions it held are removed now, and any version whose
        # owner died is swept now and every few seconds while the app runs.
        await run_in_threadpool(uploads.clear)
        await run_in_threadpool(
            sweep_abandoned_uploads,
            context.sessions,
            context.store,
            restarted_owner=uploads.owner,
        )
        # The in-process engine's step thread lives exactly as long as the app.
        if context.engine is not None:
            await context.engine.start()
        sweeper = asyncio.create_task(sweep_periodically(context.sessions, context.store))
        try:
            if context.engine is not None:
                # The engine holds tenant shares in memory only: restore the stored ones.
                await push_all_scheduling(context.sessions, context.engine)
                # ...and the pins, which the engines hold in memory only too.
                pinned = await run_in_threadpool(stored_pins, context.sessions)
                await app.state.adapter_runtime.restore_pins(pinned)
            await journal.start()  # running requests' usage survives a crash
            yield
        finally:
            sweeper.cancel()
            await journal.stop()
            if context.engine is not None:
                await context.engine.stop()

    app = FastAPI(
        lifespan=lifespan,
        title="loramux",
        description="Multi-tenant LoRA serving on one shared base model.",
        version="0.1.0",
    )
    app.state.context = context
    uploads = UploadWorkspace.in_data_dir(context.settings.data_dir)
    app.state.upload_workspace = uploads
    journal = UsageJournal(
        Meter(context.sessions), interval_s=context.settings.usage_journal_interval_s
    )
    app.state.usage_journal = journal
    app.state.running_requests = RunningRequests()  # what a shutdown stops past its grace
    app.state.adapter_runtime = AdapterRuntime(context)
    app.state.platform_metrics = PlatformMetrics()
    app.state.platform_metrics.watch_dependencies(context)
    app.state.load_control = LoadControl(
        QueueLimits(
            total=context.settings.max_queued_requests,
            per_tenant=context.settings.max_queued_requests_per_tenant,
        ),
        ServiceRates(
            slots=context.engine.capacity
            if context.engine is not None
            else lambda: context.settings.engine.scheduler.max_num_seqs
        ),
        LoadMetrics(app.state.platform_metrics.registry),
    )
    install_error_handlers(app)
    # The last added is the outermost: metrics see every request, the 413s included; the
    # input guard reads JSON bodies through the body limit's counting receive.
    app.add_middleware(InputGuardMiddleware)
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=max_body_bytes,
        route_limits={UPLOAD_ROUTE: context.settings.max_upload_bytes},
        deadline=BodyDeadline(
            context.settings.request_body_timeout_s, context.settings.request_body_min_bytes_per_s
        ),
    )
    app.add_middleware(HTTPMetricsMiddleware, metrics=app.state.platform_metrics)
    for package in (ops, models, admin, tenant, completions, chat, responses):
        for router in package.ROUTERS:
            app.include_router(router)
    app.include_router(admin.ui.router)
    app.mount("/ui/static", admin.ui.UIStaticFiles(), name="ui-static")
    install_error_docs(app)  # after every router: /openapi.json declares each one's errors
    return app
