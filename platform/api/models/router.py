"""OpenAI-compatible ``GET /v1/models``: the base model, plus the caller's ready adapters.

The operator (admin token) sees the base model; a tenant (API key) sees the base model,
each of its adapters with a ready version, named as the tenant named them, then each
adapter other tenants shared with it that can serve, as ``<owner>/<name>`` (``owned_by``:
the owner's name).
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from loramux.platform.api.deps import AdminOrTenant, ContextDep, SessionDep
from loramux.platform.services import adapter_grants, adapters

router = APIRouter(tags=["models"])


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "loramux"
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


@router.get("/v1/models", response_model=ModelList)
def list_models(context: ContextDep, session: SessionDep, caller: AdminOrTenant) -> ModelList:
    base = context.base_model.model_id
    cards = [ModelCard(id=base, root=base)]
    if caller is not None:
        for view in adapters.ready_adapters(session, caller):
            if view.adapter.name == base:
                continue  # named before such names were refused: requests reach the base
            created = int(view.version.created_at.timestamp()) if view.version else 0
            cards.append(
                ModelCard(
                    id=view.adapter.name,
                    created=created,
                    owned_by="tenant",
                    root=base,
                    parent=base,
                )
            )
        for shared in adapter_grants.shared_with(session, caller):
            cards.append(
                ModelCard(
                    id=shared.name,
                    created=int(shared.version.created_at.timestamp()),
                    owned_by=shared.owner.name,
                    root=base,
                    parent=base,
                )
            )
    return ModelList(data=cards)
