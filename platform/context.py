"""What a running platform holds: built once by the CLI (or a test), handed to the app.

No globals: routes reach it through ``request.app.state.context`` via a dependency.
"""

from __future__ import annotations

from dataclasses import dataclass

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from loramux.engine import Engine
from loramux.platform.admin_token import load_or_create_admin_token
from loramux.platform.base_model import ResolvedBaseModel, resolve_base_model
from loramux.platform.data_dir import make_data_dir_private
from loramux.platform.db.migrate import upgrade
from loramux.platform.db.session import create_engine_for, session_factory
from loramux.platform.engine_fleet.client import EngineClient, LocalEngine
from loramux.platform.engine_settings import engine_config
from loramux.platform.limits import RateLimiter, build_rate_limiter
from loramux.platform.services.adapter_upload import ValidationTarget
from loramux.platform.settings import Settings
from loramux.platform.store import ObjectStore, build_store
from loramux.platform.tasks.celery_app import make_celery


@dataclass
class PlatformContext:
    settings: Settings
    base_model: ResolvedBaseModel
    admin_token: str
    sessions: sessionmaker[Session]  # metadata database (migrated to head at start)
    store: ObjectStore  # adapter files
    rate_limiter: RateLimiter  # per-tenant token buckets
    tasks: Celery  # background tasks: queued to a broker, or run in-process (eager)
    admin_token_created: bool = False
    # The engine(s): in this process (embedded default) or engine processes behind routing;
    # None in processes that serve no requests (workers).
    engine: EngineClient | None = None

    @property
    def tasks_queued(self) -> bool:
        """Whether tasks go to a broker (and workers) rather than run in the caller."""
        return not self.tasks.conf.task_always_eager

    def validation_target(self) -> ValidationTarget:
        """What uploads are validated against: this platform's base model and limits."""
        return ValidationTarget.for_model_dir(
            self.base_model.path,
            base_model_id=self.base_model.model_id,
            max_rank=self.settings.max_adapter_rank,
            max_bytes=self.settings.max_upload_bytes,
        )


def build_engine_client(
    settings: Settings, base_model: ResolvedBaseModel, store: ObjectStore
) -> EngineClient:
    """The engine in this process, or, with ``engine_mode=remote``, the registered engine
    processes behind routing."""
    if settings.engine_mode == "remote":
        from loramux.platform.engine_fleet.routed import build_routed_engines

        return build_routed_engines(settings, base_model)
    return LocalEngine(Engine(engine_config(settings, base_model, shares_process=True)), store)


def build_context(settings: Settings, *, log=print, with_engine: bool = True) -> PlatformContext:
    make_data_dir_private(settings.data_dir, log=log)
    # Only an engine in this process reads the weights; otherwise the config and the
    # tokenizer are all the platform needs.
    runs_model = with_engine and settings.engine_mode == "local"
    base_model = resolve_base_model(settings, log=log, weights=runs_model)
    token = load_or_create_admin_token(settings)
    database_url = settings.resolved_database_url
    upgrade(database_url)  # the schema is always at head before anything serves
    store = build_store(settings)
    return PlatformContext(
        settings=settings,
        base_model=base_model,
        admin_token=token.value,
        admin_token_created=token.created,
        sessions=session_factory(create_engine_for(database_url)),
        store=store,
        rate_limiter=build_rate_limiter(settings.redis_url),
        tasks=make_celery(settings),
        engine=build_engine_client(settings, base_model, store) if with_engine else None,
    )
