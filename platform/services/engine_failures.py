"""When the engine ends a request unserved: what the tenant is told, and with which code."""

from __future__ import annotations

import logging

from loramux.engine import ErrorKind, RequestOutput

logger = logging.getLogger(__name__)


class EngineRequestFailed(RuntimeError):
    """The engine ended a request it could not serve; ``code`` says which way:

    ``adapter_unavailable``: its adapter could not be loaded or does not fit (may pass);
    ``adapter_failed``: the request failed while it ran, alone (its adapter raised or
    computed NaN/infinity; the engine's other requests went on).
    """

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def tenant_facing_error(model: str, out: RequestOutput) -> EngineRequestFailed:
    """What a tenant is told when the engine could not serve its request (``out`` ended
    with finish reason ``error``).

    The engine's own message names internal ids, store endpoints, buckets and object keys:
    it goes to the log for operators; the tenant gets the model's name and what to do.
    """
    logger.warning("request for %r failed in the engine: %s", model, out.error)
    kind = out.error_kind
    if kind in (ErrorKind.NON_FINITE, ErrorKind.STEP_FAILED):
        why = (
            "it computed non-finite values (NaN or infinity)"
            if kind == ErrorKind.NON_FINITE
            else "it raised an error"
        )
        return EngineRequestFailed(
            f"{model!r} failed while generating this request ({why}); the request was "
            "stopped and nothing else was affected. If it happens again, check the "
            "adapter's weights or ask your operator.",
            "adapter_failed",
        )
    if kind == ErrorKind.NOT_MIXABLE:
        return EngineRequestFailed(
            f"an adapter of {model!r} is not plain LoRA (DoRA, LoRA biases, its own "
            "embedding or head rows, or LoRA on experts), so it cannot be composed; call "
            "it alone",
            "adapter_not_composable",
        )
    if kind == ErrorKind.ADAPTER_TOO_LARGE:
        return EngineRequestFailed(
            f"adapter {model!r} is too large for this deployment's device memory; "
            "ask your operator to raise the adapter memory budget",
            "adapter_unavailable",
        )
    return EngineRequestFailed(
        f"adapter {model!r} could not be loaded from adapter storage right now; try again shortly",
        "adapter_unavailable",
    )
