"""Liveness: ``GET /healthz`` answers as long as the process serves HTTP."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}
