"""OpenAI-compatible ``GET /v1/models``: the base model (tenants' adapters join later)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from loramux.platform.api.deps import AdminDep, ContextDep

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
def list_models(context: ContextDep, _: AdminDep) -> ModelList:
    base = context.base_model
    return ModelList(data=[ModelCard(id=base.model_id, root=base.model_id)])
