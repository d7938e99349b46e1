"""Request input no route can use, refused at the edge with an OpenAI-style error.

An ASGI middleware in front of every route:

- a request target (path and query) over ``MAX_URL_BYTES`` is a 414, request headers over
  ``MAX_HEADER_BYTES`` in all a 431;
- a NUL character in the path is a 404 (no resource is named with one);
- a NUL character or a lone surrogate in a query parameter is a 422 naming the parameter;
- the same in a JSON body's strings or keys is a 422 naming the field
  (``messages.0.content``);
- a JSON body that is not UTF-8 text, or nested deeper than the JSON parser goes, is a 422
  (FastAPI would answer an undocumented 400 "There was an error parsing the body");
- a body that is not JSON at all is a 400 ``malformed_request`` saying where it stops being
  JSON, by line and column (FastAPI's 422 said "5491: JSON decode error").

Why one check here rather than a string type in every schema: PostgreSQL refuses NUL in
text (psycopg raises, which was a 500), and UTF-8 cannot encode a lone surrogate (half of a
UTF-16 pair, which JSON's ``\\ud800`` escape can carry), so the tokenizer, the database
drivers and the JSON encoder fail on it. Checked here, no route, present or future, can
forget. Multipart bodies (adapter uploads) are binary and pass untouched: the upload route
checks its one text field by a pattern that allows neither, and file names are decoded
without surrogates and used as base names only.

The request head itself is capped by uvicorn (``UVICORN_LIMITS``, passed by ``loramux
serve``) far above these limits, so an over-long URL reaches this middleware and gets its
414 instead of a dropped connection.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loramux.platform.api.errors import error_response
from loramux.platform.api.middleware.body_limit import DEFAULT_MAX_BODY_BYTES

MAX_URL_BYTES = 8 * 1024
"""The longest request target (path, ``?`` and query) answered; longer ones are a 414."""

MAX_HEADER_BYTES = 64 * 1024
"""The most header bytes (names and values) a request may carry; more is a 431."""

UVICORN_LIMITS = {"h11_max_incomplete_event_size": 256 * 1024}
"""uvicorn options for the platform's server. h11 drops a request whose head (request line
and headers) passes its limit, 16 KiB by default, with a bare 400 and a closed connection
the client often sees as a reset; above the caps here, such requests get a proper answer."""

MAX_CHECKED_JSON_BYTES = DEFAULT_MAX_BODY_BYTES
"""JSON bodies up to this size are checked. A longer one can only reach a route with a larger
cap of its own (adapter uploads), which reads a multipart form and never parses it."""

_BAD_CHARACTER = re.compile("[\x00\ud800-\udfff]")


def bad_character(text: str) -> str | None:
    """What is wrong with ``text`` for a loramux field, or ``None`` when nothing is.

    A valid surrogate pair in JSON (an emoji as ``\\ud83d\\ude00``) is decoded into one
    character, so any surrogate left in a ``str`` is a lone one.
    """
    found = _BAD_CHARACTER.search(text)
    if found is None:
        return None
    if found.group() == "\x00":
        return "contains a NUL character (\\u0000), which no field accepts; remove it"
    return (
        f"contains a lone surrogate (\\u{ord(found.group()):04x}), which is not a character: "
        "send text as UTF-8, or escape a character outside the BMP as a surrogate pair"
    )


def _json_problems(document: Any) -> Iterator[tuple[str, str]]:
    """(where, problem) for each bad string in a parsed JSON document, keys included.

    Iterative, not recursive: a body may nest as deep as the JSON parser allows.
    """
    pending: list[tuple[tuple[str, ...], Any]] = [((), document)]
    while pending:
        where, value = pending.pop()
        if isinstance(value, str):
            problem = bad_character(value)
            if problem:
                yield ".".join(where) or "body", problem
        elif isinstance(value, dict):
            for key, item in value.items():
                problem = bad_character(key)
                if problem:
                    yield ".".join(where) or "body", f"a key {problem}"
                pending.append(((*where, key), item))
        elif isinstance(value, list):
            pending.extend(((*where, str(index)), item) for index, item in enumerate(value))


def _is_json(scope: Scope) -> bool:
    """Whether FastAPI would parse this body as JSON (no content type, or a JSON one)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media_type = value.split(b";", 1)[0].strip().lower()
            return (
                not media_type
                or media_type == b"application/json"
                or (media_type.startswith(b"application/") and media_type.endswith(b"+json"))
            )
    return True


def _head_problem(scope: Scope) -> Response | None:
    """The error response for an over-long target or header block, or a bad path/query."""
    query_bytes = len(scope.get("query_string", b""))
    path_bytes = len(scope.get("raw_path") or scope["path"].encode())
    target_bytes = path_bytes + (1 + query_bytes if query_bytes else 0)  # with the "?"
    if target_bytes > MAX_URL_BYTES:
        return error_response(
            414,
            f"Request URL too long ({target_bytes} bytes; the limit is {MAX_URL_BYTES}): send "
            "long values in a JSON body instead.",
            "uri_too_long",
        )
    header_bytes = sum(len(name) + len(value) for name, value in scope.get("headers", ()))
    if header_bytes > MAX_HEADER_BYTES:
        return error_response(
            431,
            f"Request headers too large ({header_bytes} bytes; the limit is {MAX_HEADER_BYTES}).",
            "headers_too_large",
        )
    if bad_character(scope["path"]):
        return error_response(
            404,
            "Not found: no resource has a NUL character or a lone surrogate in its path.",
            "not_found",
        )
    query = scope.get("query_string", b"").decode("latin-1")
    # Parsed as Starlette parses it, so what is checked is what a route would see.
    for key, value in parse_qsl(query, keep_blank_values=True):
        for shown, text in (
            (f"query parameter name {key!r}", key),
            (f"query parameter {key}", value),
        ):
            problem = bad_character(text)
            if problem:
                return error_response(422, f"{shown}: {problem}.", "invalid_characters")
    return None


class InputGuardMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = _head_problem(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if not _is_json(scope):
            await self.app(scope, receive, send)
            return

        received = await _read_json_body(receive)
        if received.body is not None:
            refusal = _body_problem(received.body)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, received.replay(receive), send)


class _ReadBody:
    """The messages read ahead of the app, replayed to it before the live ``receive``."""

    def __init__(self, messages: list[Message], body: bytes | None):
        self.messages = messages
        self.body = body  # the whole body, or None when it was not read to the end

    def replay(self, receive: Receive) -> Receive:
        queued = list(self.messages)

        async def replaying_receive() -> Message:
            if queued:
                return queued.pop(0)
            return await receive()

        return replaying_receive


async def _read_json_body(receive: Receive) -> _ReadBody:
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return _ReadBody(messages, None)  # the client went away: the app will see it
        size += len(message.get("body", b""))
        if size > MAX_CHECKED_JSON_BYTES:
            return _ReadBody(messages, None)  # no JSON route takes it: the app refuses it
        if not message.get("more_body", False):
            body = b"".join(m.get("body", b"") for m in messages)
            return _ReadBody([{"type": "http.request", "body": body, "more_body": False}], body)


def _body_problem(body: bytes) -> Response | None:
    if not body:
        return None
    try:
        document = json.loads(body)
    except UnicodeDecodeError:
        # FastAPI would answer these two with a bare 400 ("There was an error parsing the
        # body"), which no route documents; they are bad input like any other: a 422.
        return error_response(
            422, "body: is not UTF-8 text, which a JSON body must be.", "invalid_characters"
        )
    except RecursionError:
        return error_response(422, "body: JSON nested too deeply.", "invalid_parameters")
    except json.JSONDecodeError as exc:
        # FastAPI's own answer gives only an offset ("5491: JSON decode error").
        return error_response(
            400,
            f"The body is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno} "
            f"(character {exc.pos}).",
            "malformed_request",
        )
    except ValueError as exc:  # an integer of more digits than Python converts
        reason = str(exc).split(";")[0]
        return error_response(
            400, f"The body cannot be read as JSON: {reason}.", "malformed_request"
        )
    for where, problem in _json_problems(document):
        return error_response(422, f"{where}: {problem}.", "invalid_characters")
    return None
