"""What a running platform holds: built once by the CLI (or a test), handed to the app.

No globals: routes reach it through ``request.app.state.context`` via a dependency.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from loramux.engine import AsyncEngine, Engine, EngineConfig
from loramux.platform.admin_token import load_or_create_admin_token
from loramux.platform.base_model import BaseModel, resolve_base_model
from loramux.platform.db.migrate import upgrade
from loramux.platform.db.session import create_engine_for, session_factory
from loramux.platform.limits import RateLimiter, build_rate_limiter
from loramux.platform.settings import Settings
from loramux.platform.store import ObjectStore, build_store


@dataclass
class PlatformContext:
    settings: Settings
    base_model: BaseModel
    admin_token: str
    sessions: sessionmaker[Session]  # metadata database (migrated to head at start)
    store: ObjectStore  # adapter files
    rate_limiter: RateLimiter  # per-tenant token buckets
    admin_token_created: bool = False
    engine: AsyncEngine | None = None  # the in-process engine of the embedded default


def build_engine(settings: Settings, base_model: BaseModel) -> AsyncEngine:
    config = EngineConfig(
        model=str(base_model.path),
        kv_cache_bytes=settings.kv_cache_bytes,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        device=settings.device,
    )
    return AsyncEngine(Engine(config))


def build_context(settings: Settings, *, log=print, with_engine: bool = True) -> PlatformContext:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    base_model = resolve_base_model(settings, log=log)
    token = load_or_create_admin_token(settings)
    database_url = settings.resolved_database_url
    upgrade(database_url)  # the schema is always at head before anything serves
    return PlatformContext(
        settings=settings,
        base_model=base_model,
        admin_token=token.value,
        admin_token_created=token.created,
        sessions=session_factory(create_engine_for(database_url)),
        store=build_store(settings),
        rate_limiter=build_rate_limiter(settings.redis_url),
        engine=build_engine(settings, base_model) if with_engine else None,
    )
