"""Every error code the HTTP API answers with: its status, OpenAI's error ``type`` and what
it means. One table, so a code always comes with the same status and type, whether it is a
JSON response or an error event inside a stream (docs/api.md, "Errors", lists it).

A client should branch on ``code`` (stable) and show ``message`` (prose, may change).
"""

from __future__ import annotations

from dataclasses import dataclass

# HTTP status -> OpenAI's error `type`.
_TYPES_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "insufficient_quota",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
}


def error_type(status: int) -> str:
    """OpenAI's ``type`` for an HTTP status: ``server_error`` for every 5xx."""
    return _TYPES_BY_STATUS.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )


@dataclass(frozen=True)
class ErrorCode:
    status: int
    meaning: str  # what a client should make of it (the table in docs/api.md)

    @property
    def type(self) -> str:
        return error_type(self.status)


ERROR_CODES: dict[str, ErrorCode] = {
    # 400: the request cannot be served as sent
    "malformed_request": ErrorCode(400, "The body could not be parsed."),
    "malformed_upload": ErrorCode(400, "The upload form is malformed (a part has no file name)."),
    "invalid_prompt": ErrorCode(
        400, "The prompt is empty or holds token ids outside the vocabulary."
    ),
    "invalid_messages": ErrorCode(
        400, "The chat messages cannot be rendered by the chat template."
    ),
    "context_length_exceeded": ErrorCode(
        400, "The prompt and `max_tokens` do not fit the model's context."
    ),
    "invalid_sampling_parameters": ErrorCode(
        400, "The sampling parameters contradict each other or the model."
    ),
    "invalid_request": ErrorCode(400, "The engine refused the request as sent."),
    "invalid_model": ErrorCode(
        400,
        "`model` names an adapter in a form not read (`name@3`, `name@sha256:<hex>`, "
        "`owner/name`).",
    ),
    "invalid_grant": ErrorCode(400, "A tenant cannot grant its own adapter to itself."),
    "invalid_adapters": ErrorCode(
        400,
        "A composition of adapters is malformed: its form, too many parts, a version twice "
        "or a weight out of range.",
    ),
    "adapter_not_composable": ErrorCode(
        400, "An adapter of the composition is not plain LoRA (DoRA, biases, token rows)."
    ),
    "invalid_period": ErrorCode(
        400, "A billing period is backwards, over 31 days or in the future (or, to roll up, open)."
    ),
    # 401
    "missing_api_key": ErrorCode(401, "No `Authorization: Bearer` header."),
    "invalid_api_key": ErrorCode(401, "The key or admin token is unknown or revoked."),
    # 402
    "budget_exceeded": ErrorCode(402, "The tenant's monthly budget cannot cover the request."),
    # 404
    "not_found": ErrorCode(404, "No such route or resource."),
    "model_not_found": ErrorCode(404, "No such model, or not the caller's."),
    "adapter_not_found": ErrorCode(404, "No such adapter, or not the caller's."),
    "adapter_version_not_found": ErrorCode(404, "The adapter has no version of that number."),
    "grantee_not_found": ErrorCode(404, "No live tenant of that name to grant the adapter to."),
    "grant_not_found": ErrorCode(404, "The adapter is not granted to that tenant."),
    "pin_not_found": ErrorCode(404, "The adapter has no pinned version."),
    "api_key_not_found": ErrorCode(404, "No API key with that id."),
    "tenant_not_found": ErrorCode(404, "No tenant with that id."),
    "export_not_found": ErrorCode(404, "No billing export with that id."),
    # 405, 408
    "method_not_allowed": ErrorCode(405, "The route exists but not with this HTTP method."),
    "request_timeout": ErrorCode(408, "The request body arrived too slowly."),
    # 409
    "adapter_name_conflict": ErrorCode(409, "The adapter name is taken (the base model's name)."),
    "tenant_name_taken": ErrorCode(409, "A tenant of that name exists or existed."),
    "adapter_version_not_ready": ErrorCode(
        409, "The version is not ready, so it cannot take the name or a grant."
    ),
    "pin_quota_exceeded": ErrorCode(
        409, "Pinning the version would pass the tenant's pin quota (bytes)."
    ),
    "pinned_by_operator": ErrorCode(409, "An operator pinned the adapter; only one can lift it."),
    "adapter_upload_conflict": ErrorCode(
        409, "Too many uploads of one adapter at once; nothing was kept, try again."
    ),
    # 413, 414, 431: sizes
    "request_too_large": ErrorCode(413, "The body is over its cap."),
    "uri_too_long": ErrorCode(414, "The URL is over 8 KiB."),
    "headers_too_large": ErrorCode(431, "The headers are over 64 KiB."),
    # 422: a field is invalid
    "invalid_parameters": ErrorCode(422, "A field has the wrong type or is out of range."),
    "invalid_characters": ErrorCode(
        422, "A string holds a NUL or a lone surrogate, or a body is not UTF-8."
    ),
    "invalid_adapter_name": ErrorCode(422, "The adapter name does not match the pattern."),
    "invalid_upload": ErrorCode(422, "The upload form lacks its name or files."),
    "invalid_adapter": ErrorCode(422, "The adapter was rejected; the message says why."),
    # 429
    "rate_limit_exceeded": ErrorCode(429, "Over a rate limit; retry after `Retry-After`."),
    "queue_full": ErrorCode(
        429, "Too many requests of the tenant (or of all) are queued; retry after `Retry-After`."
    ),
    # 500: a fault of the server or of the tenant's own adapter
    "adapter_failed": ErrorCode(
        500, "The adapter raised or computed NaN/infinity on this request; it alone was stopped."
    ),
    "internal_error": ErrorCode(500, "A bug: the platform's log has the details."),
    "export_corrupt": ErrorCode(
        500, "A billing export's stored file is missing or fails its sha256 check."
    ),
    # 503: a part is unavailable for now; retry (after `Retry-After` where given)
    "database_unavailable": ErrorCode(503, "The database is down or restarting."),
    "limits_unavailable": ErrorCode(
        503, "Rate limits cannot be checked (Redis down) and limits fail closed."
    ),
    "store_unavailable": ErrorCode(503, "The adapter store cannot be reached."),
    "task_queue_unavailable": ErrorCode(503, "The task broker cannot be reached."),
    "upload_interrupted": ErrorCode(503, "The upload lost its lease (swept); upload again."),
    "adapter_unavailable": ErrorCode(
        503, "The adapter cannot be loaded or does not fit right now; nothing was generated."
    ),
    "engine_unavailable": ErrorCode(
        503, "No engine can take the request now (none running or reachable); nothing started."
    ),
    "engine_error": ErrorCode(
        503,
        "The engine running the request stopped; what was streamed is billed, nothing else.",
    ),
    "deadline_unattainable": ErrorCode(
        503,
        "The request's predicted time to first token already passes its deadline; nothing ran.",
    ),
    # 504
    "deadline_exceeded": ErrorCode(
        504,
        "The request passed its deadline; the tokens sent before it (a stream's chunks, or "
        "`partial` in the body) are billed.",
    ),
}

# Starlette's own HTTPExceptions (routing, form parsing) carry no code: these stand in.
HTTP_EXCEPTION_CODES = {400: "malformed_request", 404: "not_found", 405: "method_not_allowed"}


def error_detail(status: int, message: str, code: str) -> dict[str, str]:
    """The ``error`` object of a response or a stream's error event."""
    known = ERROR_CODES.get(code)
    error_type_ = known.type if known is not None else error_type(status)
    return {"message": message, "type": error_type_, "code": code}
