"""The platform's own errors: what went wrong, in words a person reads, and a stable code.

Services raise these, and nothing that knows HTTP. The API layer alone turns them into
responses (``loramux.platform.api.errors``): the status and OpenAI error ``type`` come from
the code's row in ``loramux.platform.api.error_codes``; the Celery worker and the CLI meet
them as ordinary exceptions whose text is the message.

| class | when | what the API answers |
|---|---|---|
| :class:`NotFound` | no such thing, or not the caller's (the two are never told apart) | 404 |
| :class:`Conflict` | it clashes with what exists; nothing was changed | 409 |
| :class:`Invalid` | the request, as sent, cannot be served | 400 or 422 |
| :class:`QuotaExceeded` | over a budget or a rate limit | 402 or 429 |
| :class:`Unavailable` | a part is down or full for now; the same request may pass later | 503 |

``code`` is one of the API's error codes (docs/api.md, "Errors"), so a client can branch on it;
``retry_after_s``, where given, is when trying again makes sense (``Retry-After``).
"""

from __future__ import annotations


class PlatformError(Exception):
    """A failure the caller is told about (a subclass says which kind)."""

    def __init__(self, message: str, *, code: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.retry_after_s = retry_after_s


class NotFound(PlatformError):
    """No such resource, or not the caller's."""


class Conflict(PlatformError):
    """The change clashes with what exists; nothing was changed."""


class Invalid(PlatformError):
    """The request cannot be served as sent; sending it again will not help."""


class QuotaExceeded(PlatformError):
    """Over a budget or a rate limit."""


class Unavailable(PlatformError):
    """A part the request needs is down or full for now; it may pass if retried."""
