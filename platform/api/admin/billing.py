"""The operator's billing routes: run the usage roll-up, export usage now, list and download
the exports (admin token required, router-wide).

* ``POST /admin/usage/rollup``: roll up every closed UTC day not rolled up yet (body
  ``{"day": "YYYY-MM-DD"}``: that closed day again), and say which days are still open.
* ``POST /admin/billing/exports``: export ``{"day": ...}`` or ``{"start": ..., "end": ...}``
  (both inclusive) with an optional ``group_by``: 201 with the new export, or 200 with the
  one that stands (a closed period's final export). Open periods export provisional.
* ``GET /admin/billing/exports``: the exports, newest first.
* ``GET /admin/billing/exports/{export_id}/download``: the CSV, verified against its sha256
  before the first byte is sent.

Routes only translate between HTTP and ``loramux.platform.services.billing_exports`` /
``rollups`` (the rules are there); the CLI's ``loramux usage`` and ``loramux billing`` use
the same services.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Annotated, BinaryIO

from fastapi import APIRouter, Body, Depends, Query, Response
from fastapi.responses import StreamingResponse

from loramux.platform.api.admin.billing_schemas import (
    ExportCreatedOut,
    ExportOut,
    ExportRequest,
    RollupOut,
    RollupRequest,
)
from loramux.platform.api.deps import ContextDep, SessionDep, require_admin
from loramux.platform.api.errors import APIError, ErrorBody
from loramux.platform.db.types import utc_now
from loramux.platform.services.billing_exports import (
    DEFAULT_LIST_LIMIT,
    ExportNotFound,
    export_file_name,
    export_period,
    get_export,
    list_exports,
    read_export,
)
from loramux.platform.services.rollups import InvalidPeriod, run_rollup
from loramux.platform.store import ChecksumMismatch, ObjectNotFound, StoreUnavailable
from loramux.platform.store.base import CHUNK_SIZE

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/admin", tags=["billing"], dependencies=[Depends(require_admin)])

MAX_LIST_LIMIT = 1000
MAX_LIST_OFFSET = 1_000_000
STORE_RETRY_AFTER_S = 5

EXISTING_EXPORT = {
    200: {
        "model": ExportCreatedOut,
        "description": "An existing export stands for the period (`created` false): its "
        "final export, or its last provisional one when no usage changed since.",
    }
}
CSV_DOWNLOAD = {
    200: {
        "content": {"text/csv": {"schema": {"type": "string"}}},
        "description": "The CSV, verified against the export's sha256 before it is sent.",
    },
    500: {
        "model": ErrorBody,
        "description": "The stored file is missing or does not match the recorded sha256 "
        "(code export_corrupt); `GET /admin/usage?format=csv` rebuilds the same rows from "
        "the usage records.",
    },
}


def _invalid_period(what: str, exc: InvalidPeriod) -> APIError:
    return APIError(400, f"{what}: {exc}.", code="invalid_period")


def _store_unavailable(exc: StoreUnavailable) -> APIError:
    return APIError(
        503,
        f"The object store cannot be reached ({exc}); nothing was changed. Try again shortly.",
        code="store_unavailable",
        headers={"Retry-After": str(STORE_RETRY_AFTER_S)},
    )


# --- usage roll-up ---------------------------------------------------------------------------


@router.post("/usage/rollup")
def rollup_usage(
    context: ContextDep, body: Annotated[RollupRequest | None, Body()] = None
) -> RollupOut:
    """Roll up the closed UTC days not rolled up yet (oldest first, at most 31 a run), or
    with ``day`` that closed day again. Today's day, and yesterday's for 5 minutes after
    midnight, are open: they are not rolled up (the answer says until when)."""
    try:
        run = run_rollup(context.sessions, now=utc_now(), day=body.day if body else None)
    except InvalidPeriod as exc:
        raise _invalid_period("Cannot roll that day up", exc) from None
    return RollupOut.from_run(run)


# --- billing exports -------------------------------------------------------------------------


@router.post("/billing/exports", status_code=201, responses=EXISTING_EXPORT)
def create_export(
    body: Annotated[ExportRequest, Body()], context: ContextDep, response: Response
) -> ExportCreatedOut:
    """Export every tenant's usage over a day or a range of days now, as a CSV in the
    object store. A period that is not closed yet (today) is exported *provisional*; a
    closed period is exported once (final), and asking again returns that export (200)."""
    group_by = body.group_by or context.settings.billing_export_group_by
    try:
        outcome = export_period(
            context.sessions, context.store, body.period(), group_by=group_by, now=utc_now()
        )
    except InvalidPeriod as exc:
        raise _invalid_period("This period cannot be exported", exc) from None
    except StoreUnavailable as exc:
        raise _store_unavailable(exc) from None
    if not outcome.created:
        response.status_code = 200
    return ExportCreatedOut.from_outcome(outcome)


@router.get("/billing/exports")
def list_billing_exports(
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = DEFAULT_LIST_LIMIT,
    offset: Annotated[int, Query(ge=0, le=MAX_LIST_OFFSET)] = 0,
) -> list[ExportOut]:
    """Billing exports, newest first: every version of every period (provisional ones too)."""
    return [ExportOut.from_export(e) for e in list_exports(session, limit=limit, offset=offset)]


def _chunks(copy: BinaryIO) -> Iterator[bytes]:
    try:
        while chunk := copy.read(CHUNK_SIZE):
            yield chunk
    finally:
        copy.close()


@router.get(
    "/billing/exports/{export_id}/download",
    response_class=StreamingResponse,
    responses=CSV_DOWNLOAD,
)
def download_export(export_id: str, session: SessionDep, context: ContextDep) -> StreamingResponse:
    """The export's CSV as an attachment named like ``billing-2026-11-24.by-request.csv``."""
    try:
        export = get_export(session, export_id)
    except ExportNotFound as exc:
        raise APIError(404, str(exc), code="export_not_found") from None
    try:
        copy = read_export(context.store, export)
    except (ChecksumMismatch, ObjectNotFound) as exc:
        logger.error("billing export %s (%s) cannot be read: %s", export.id, export.store_key, exc)
        raise APIError(
            500,
            f"The stored file of export {export.id} is missing or corrupt ({exc}). "
            "GET /admin/usage?format=csv with the same period and grouping rebuilds its rows "
            "from the usage records.",
            code="export_corrupt",
        ) from None
    except StoreUnavailable as exc:
        raise _store_unavailable(exc) from None
    return StreamingResponse(
        _chunks(copy),
        media_type="text/csv; charset=utf-8",
        headers={
            "Content-Disposition": f'attachment; filename="{export_file_name(export)}"',
            "Content-Length": str(export.size_bytes),
            "ETag": f'"{export.sha256}"',
        },
    )
