"""What a tenant is told when the engine ends its request unserved, by the engine's kind of
failure: the code the API answers with, and a message without the engine's internals."""

from __future__ import annotations

import pytest

from loramux.engine import ErrorKind, RequestOutput
from loramux.platform.services.engine_failures import tenant_facing_error

INTERNALS = "source s3://loramux-bucket/sha256/ab/cd at http://10.0.0.5:9000"


def failed(kind: ErrorKind | None) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt_token_ids=[1],
        token_ids=[],
        text="",
        finished=True,
        finish_reason="error",
        error=f"adapter 'v1' failed: {INTERNALS}",
        error_kind=None if kind is None else kind.value,
    )


@pytest.mark.parametrize(
    ("kind", "code", "words"),
    [
        (ErrorKind.NON_FINITE, "adapter_failed", "non-finite values"),
        (ErrorKind.STEP_FAILED, "adapter_failed", "raised an error"),
        (ErrorKind.ADAPTER_TOO_LARGE, "adapter_unavailable", "too large"),
        (ErrorKind.ADAPTER_LOAD_FAILED, "adapter_unavailable", "could not be loaded"),
        (None, "adapter_unavailable", "could not be loaded"),
    ],
)
def test_each_kind_of_failure_has_its_code_and_hides_the_engines_internals(kind, code, words):
    error = tenant_facing_error("support-bot", failed(kind))
    assert error.code == code
    assert "'support-bot'" in str(error) and words in str(error)
    assert "s3://" not in str(error) and "10.0.0.5" not in str(error)
