"""What a running platform holds: built once by the CLI (or a test), handed to the app.

No globals: routes reach it through ``request.app.state.context`` via a dependency.
"""

from __future__ import annotations

from dataclasses import dataclass

from loramux.platform.admin_token import load_or_create_admin_token
from loramux.platform.base_model import BaseModel, resolve_base_model
from loramux.platform.settings import Settings


@dataclass
class PlatformContext:
    settings: Settings
    base_model: BaseModel
    admin_token: str
    admin_token_created: bool = False


def build_context(settings: Settings, *, log=print) -> PlatformContext:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    base_model = resolve_base_model(settings, log=log)
    token = load_or_create_admin_token(settings)
    return PlatformContext(
        settings=settings,
        base_model=base_model,
        admin_token=token.value,
        admin_token_created=token.created,
    )
