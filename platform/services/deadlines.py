"""Every inference request's deadline, and the error of a request that passed it.

A deadline is counted from the request's admission and is the shortest of three:

- the server's maximum (``LORAMUX_REQUEST_TIMEOUT_S``), which every request has;
- the tenant's default (``request_timeout_s``, set by an operator), when it has one;
- the request's own ``timeout`` field (seconds), which can only shorten the other two (a
  longer one is cut to them: the operator's limit is not the client's to lift).

A request past its deadline is ended wherever it is (queued, prefilling, decoding, or
being streamed out): ``InferenceService`` aborts its engine work, which frees its KV blocks,
and bills exactly the tokens the client received. A stream then ends with an error event
(``deadline_exceeded``) and ``[DONE]``; a non-streamed request gets a 504 whose body also
carries the partial response it is billed for.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from loramux.platform.errors import PlatformError

SERVER_MAXIMUM = "the server's maximum"
TENANT_DEFAULT = "the tenant's default"
REQUEST_TIMEOUT = "the request's timeout"
DEADLINE_FINISH = "deadline"  # the finish reason on the usage record of an expired request


@dataclass(frozen=True)
class Deadline:
    """When a request must be done by (``time.monotonic()``), and which limit set it."""

    seconds: float  # the budget counted from admission
    source: str  # SERVER_MAXIMUM, TENANT_DEFAULT or REQUEST_TIMEOUT
    expires_at: float  # time.monotonic() value

    def remaining(self, now: float | None = None) -> float:
        """Seconds left (negative once passed)."""
        return self.expires_at - (time.monotonic() if now is None else now)

    def describe(self) -> str:
        return f"{self.seconds:g} s ({self.source})"


def request_deadline(
    server_maximum_s: float,
    tenant_default_s: float | None,
    request_timeout_s: float | None,
    *,
    admitted_at: float | None = None,
) -> Deadline:
    """The shortest of the limits that apply (ties go to the more specific one)."""
    limits = [(server_maximum_s, SERVER_MAXIMUM)]
    if tenant_default_s is not None:
        limits.append((tenant_default_s, TENANT_DEFAULT))
    if request_timeout_s is not None:
        limits.append((request_timeout_s, REQUEST_TIMEOUT))
    for seconds, source in limits:
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"{source} must be a positive number of seconds, got {seconds}")
    seconds, source = min(reversed(limits), key=lambda limit: limit[0])
    start = time.monotonic() if admitted_at is None else admitted_at
    return Deadline(seconds=seconds, source=source, expires_at=start + seconds)


class DeadlineExceeded(PlatformError):
    """The request passed its deadline; ``completion_tokens`` reached the client."""

    def __init__(self, deadline: Deadline, completion_tokens: int):
        where = (
            "before its first token"
            if completion_tokens == 0
            else f"after {completion_tokens} generated tokens, which are billed"
        )
        super().__init__(
            f"The request passed its deadline of {deadline.describe()} {where}. Send a "
            "longer `timeout` (up to the tenant's and the server's limits), a shorter "
            "`max_tokens`, or retry when the server is less busy.",
            code="deadline_exceeded",
        )
        self.deadline = deadline
        self.completion_tokens = completion_tokens
