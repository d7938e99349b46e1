"""The tenant adapter API under ``/v1/adapters``: upload, list, get, versions, alias, delete.

Routes translate between HTTP and ``loramux.platform.services.adapters`` /
``adapter_upload``. The body-limit middleware caps an upload's body at
``settings.max_upload_bytes`` (413 as soon as it passes the cap). Received files go to a
private folder under ``<data dir>/tmp/uploads`` (``UploadWorkspace``) that is removed when
the request ends, whatever happened, and at the next start should the process be killed.

An upload answers 201 with status ``ready`` when it was validated in the request (tasks
in-process, the embedded default), or 202 with status ``validating`` when validation was
queued to a worker: poll ``GET /v1/adapters/{name}`` until ``ready`` or ``failed``. Files a
ready version of the adapter already holds answer 200 with that version: the same bytes
are the same version.
"""

from __future__ import annotations

import shutil
from pathlib import Path, PurePosixPath
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.responses import JSONResponse

from loramux.platform.api.deps import (
    AdapterRuntimeDep,
    ContextDep,
    CurrentTenant,
    SessionDep,
)
from loramux.platform.api.errors import APIError
from loramux.platform.api.tenant.adapter_schemas import (
    AdapterList,
    AdapterOut,
    AliasIn,
    VersionList,
    VersionOut,
)
from loramux.platform.context import PlatformContext
from loramux.platform.db.models import Adapter
from loramux.platform.ingest.archive import ADAPTER_FILES, PICKLE_SUFFIXES
from loramux.platform.services import adapters as service
from loramux.platform.services.adapter_upload import ReceivedUpload, upload_adapter
from loramux.platform.services.upload_leases import QUEUED_LEASE
from loramux.platform.services.upload_workspace import UploadWorkspace
from loramux.platform.tasks.celery_app import VALIDATE_ADAPTER

router = APIRouter(prefix="/v1/adapters", tags=["adapters"])

MAX_FORM_PARTS = 8
COPY_CHUNK_BYTES = 1 << 20

_UPLOAD_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["name", "files"],
                    "properties": {
                        "name": {
                            "type": "string",
                            "pattern": f"^{service.NAME_PATTERN.pattern}$",
                            "description": "1-64 letters, digits, '.', '_' or '-', starting "
                            "with a letter or digit",
                        },
                        "files": {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                            "minItems": 1,
                            "maxItems": MAX_FORM_PARTS,
                            "description": "adapter_config.json and "
                            "adapter_model.safetensors, or one .tar.gz / .zip holding them",
                        },
                    },
                }
            }
        },
    }
}


def tenant_adapter(name: str, session: SessionDep, tenant: CurrentTenant) -> Adapter:
    """The caller's live adapter named in the path; 404 for unknown and others' names."""
    return service.live_adapter(session, tenant, name)


TenantAdapter = Annotated[Adapter, Depends(tenant_adapter)]


def _file_name(upload: UploadFile) -> str:
    """The base name the client gave a part (never a path), or a 400 if it gave none."""
    raw = (upload.filename or "").replace("\\", "/")
    name = PurePosixPath(raw).name
    if not name:
        raise APIError(400, "Every `files` part needs a file name.", code="malformed_upload")
    return name


async def _save(upload: UploadFile, dest: Path) -> None:
    await upload.seek(0)
    with dest.open("wb") as out:
        while chunk := await upload.read(COPY_CHUNK_BYTES):
            await run_in_threadpool(out.write, chunk)


async def _receive_upload(request: Request, folder: Path) -> tuple[str, ReceivedUpload]:
    """Parse the form: the adapter name and its files, written under ``folder``."""
    form = await request.form(max_files=MAX_FORM_PARTS, max_fields=MAX_FORM_PARTS)
    try:
        name = form.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(422, "The form field `name` is required.", code="invalid_upload")
        service.check_adapter_name(name)
        files = [part for part in form.getlist("files") if isinstance(part, UploadFile)]
        if not files:
            raise APIError(
                422,
                "Send the adapter as `files`: adapter_config.json and "
                "adapter_model.safetensors, or one .tar.gz / .zip holding them.",
                code="invalid_upload",
            )
        names = [_file_name(part) for part in files]
        for file_name in names:
            if PurePosixPath(file_name).suffix.lower() in PICKLE_SUFFIXES:
                raise APIError(
                    422,
                    f"Adapter rejected: {file_name} is a pickle file and is refused unopened; "
                    "save the adapter with safetensors (adapter_model.safetensors).",
                    code="invalid_adapter",
                )
        if len(files) == 1 and names[0] not in ADAPTER_FILES:
            archive = folder / "upload.archive"
            await _save(files[0], archive)
            return name, ReceivedUpload(folder=folder, archive=archive)
        adapter_dir = folder / "adapter"
        adapter_dir.mkdir()
        for part, file_name in zip(files, names, strict=True):
            if file_name not in ADAPTER_FILES:
                raise APIError(
                    422,
                    f"Adapter rejected: unexpected file {file_name!r}; send "
                    "adapter_config.json and adapter_model.safetensors, or one archive.",
                    code="invalid_adapter",
                )
            if (adapter_dir / file_name).exists():
                raise APIError(
                    422, f"Adapter rejected: {file_name} was sent twice.", code="invalid_adapter"
                )
            await _save(part, adapter_dir / file_name)
        return name, ReceivedUpload(folder=adapter_dir)
    finally:
        await form.close()


def _validation_queue(context: PlatformContext):
    """Where an upload's validation goes: a worker through the broker, or ``None`` (inline)."""
    if not context.tasks_queued:
        return None

    def enqueue(version_id: str, target) -> None:
        # A task no worker starts while the queue holds the version is dropped: by then the
        # sweep fails the version (upload_cleanup), and a late start would find it failed.
        context.tasks.send_task(
            VALIDATE_ADAPTER,
            args=[version_id, target.to_json()],
            expires=QUEUED_LEASE.total_seconds(),
        )

    return enqueue


@router.post(
    "",
    status_code=201,
    openapi_extra=_UPLOAD_DOC,
    responses={
        200: {
            "model": AdapterOut,
            "description": "The files of a ready version of this adapter: that version.",
        },
        202: {"model": AdapterOut, "description": "Accepted; validation queued."},
    },
)
async def upload(request: Request, tenant: CurrentTenant, context: ContextDep) -> AdapterOut:
    workspace: UploadWorkspace = request.app.state.upload_workspace
    folder = await run_in_threadpool(workspace.new_folder)
    try:
        name, received = await _receive_upload(request, folder)
        view = await run_in_threadpool(
            upload_adapter,
            context.sessions,
            context.store,
            context.validation_target(),
            tenant.id,
            name,
            received,
            owner=workspace.owner,
            enqueue=_validation_queue(context),
        )
    finally:
        await run_in_threadpool(shutil.rmtree, folder, True)
    out = AdapterOut.from_view(view)
    if view.reused:  # the same bytes as a ready version: nothing new was made
        return JSONResponse(out.model_dump(mode="json"), status_code=200)
    if out.status != "ready":  # queued: the worker decides
        return JSONResponse(out.model_dump(mode="json"), status_code=202)
    return out


@router.get("")
def list_adapters(session: SessionDep, tenant: CurrentTenant) -> AdapterList:
    return AdapterList(
        data=[AdapterOut.from_view(view) for view in service.list_adapters(session, tenant)]
    )


@router.get("/{name}")
def get_adapter(adapter: TenantAdapter, session: SessionDep) -> AdapterOut:
    return AdapterOut.from_view(service.get_adapter(session, adapter))


@router.get("/{name}/versions")
def list_versions(adapter: TenantAdapter, session: SessionDep) -> VersionList:
    """Every version of the adapter, newest first, and the one its bare name reaches."""
    versions = service.versions_of(session, adapter)
    return VersionList(
        alias_version=adapter.alias_version, data=[VersionOut.of(v) for v in versions]
    )


@router.put("/{name}/alias")
def set_alias(name: str, body: AliasIn, session: SessionDep, tenant: CurrentTenant) -> AdapterOut:
    """Point the bare name at one ready version (a rollback), or back at the newest (null).
    Requests resolved after the answer reach it; those already running finish on theirs."""
    adapter = service.set_alias(session, tenant, name, body.version)
    return AdapterOut.from_view(service.get_adapter(session, adapter))


@router.delete("/{name}", status_code=204)
async def delete_adapter(
    adapter: TenantAdapter, session: SessionDep, runtime: AdapterRuntimeDep
) -> None:
    versions = await run_in_threadpool(service.delete_adapter, session, adapter)
    # After the commit: no new request can resolve the name while its versions go.
    for version in versions:
        await runtime.unload(version)
