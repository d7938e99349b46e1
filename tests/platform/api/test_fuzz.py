"""Schemathesis fuzzes the whole HTTP API, once as the operator and once as a tenant.

The platform runs for real: ``create_app`` over a context on PostgreSQL (where a NUL byte
reaching a query used to be a 500) with the in-process engine and a tiny random model whose
context is ``CONTEXT_TOKENS`` (so no request, whatever its ``max_tokens``, ``n`` or
``stream``, costs more than a few hundred cheap engine steps), served by uvicorn on a free
port. The schema is the one the app serves at ``/openapi.json``.

Each role's test walks every operation of that schema and runs schemathesis's Hypothesis
strategies under a fixed seed: ``OWN_EXAMPLES`` positive and as many negative cases for each
operation the role may call (``/admin/*`` for the operator, ``/v1/*`` for a tenant, and the
public ones), ``FOREIGN_EXAMPLES`` for the other role's (each must be a documented 401).
Every response goes through these checks:

- ``not_a_server_error``: no 5xx at all (not even the documented ``500 adapter_failed``: the
  fuzz's adapter is healthy);
- ``status_code_conformance``, ``content_type_conformance``, ``response_schema_conformance``,
  ``response_headers_conformance``: the answer is what ``/openapi.json`` documents;
- negative cases, ``negative_data_rejection``: what the schema forbids is refused (4xx);
- positive cases, ``positive_data_acceptance``: what the schema allows is never refused as
  malformed (422, 408, 413). Statuses that depend on what values mean rather than on their
  shape are accepted (400 for a prompt over the context or a ``top_p`` of 7, 404 for a model
  that does not exist, 409 for a taken name, 402 and 429 for limits): the schema cannot say
  which model exists. Uploads are left out of this check (``CONTENT_BEYOND_SCHEMA``), and a
  few rules JSON Schema cannot state are applied to positive cases first
  (:func:`within_contract`);
- bad characters: the refusal docs/api.md documents, exactly (below).

Bad characters. Schemathesis never generates lone surrogates (it leaves out Unicode category
Cs, since UTF-8 cannot carry them), and the NULs it generates (``allow-x00``) would land in
most requests, so that few would get past the input guard. So its NULs are turned off, and
the test adds both itself: a share of the cases (``INJECT_SHARE``) gets one NUL or lone
surrogate at a spot drawn from the case, in a JSON string or key (sent as the ``\\u0000`` or
``\\ud800`` escapes a hostile client's JSON would carry), a query value or a path parameter
(NUL as ``%00``; the surrogate as ``%ED%A0%80``, the bytes UTF-8 would give it were it
allowed, the only form a URL can carry). After the fuzz, a sweep sends both characters into
every string field the schema declares (each JSON body field, nested ones and free-form
objects' keys included, each query and path parameter, the upload form's text field) of each
operation the role may call, on top of a request the server accepted, plus a body that is
not UTF-8 and one nested too deep to parse. docs/api.md: a NUL is a 404 in the path; either is a
422 naming the field in a query or a body.

Real values. Random strings name nothing, so most cases would only ever reach a 404: a
string that names a resource often gets a real one instead (``REAL_VALUE_SHARE``): a real
tenant, key or adapter id for the operator; for the tenant, its ready adapter, the base model, the
adapter another tenant shares with it (``fuzz-owner/...``) and the tenant it shares its own
with (the path's ``grantee``). The tenant has generous rate limits (the fuzz is not about 429s), prices and usage.

Destructive operations. The operator's ``DELETE /admin/tenants/{id}`` and ``DELETE
/admin/api-keys/{id}`` only ever get the ids of a throwaway tenant and its key (the tenant
with usage is never offered to them); when one is deleted, a new throwaway takes its place
at once. The tenant's ``DELETE /v1/adapters/{name}`` may delete its adapter: it is uploaded
(and shared) again at once, so later cases find it; a revoked grant is granted again. Each
test makes its own tenants, so the two roles never see each other's state.

Failures do not stop the run: every one is collected and the test fails at the end with the
first of each kind (operation, check, status; a curl command; the server's answer; uvicorn's
traceback is in the captured log). Each test prints how many requests it sent per operation
and in all, the statuses, the 5xx and the schema violations seen, and how many requests
carried bad characters; it asserts a minimum per operation, so an empty or cut-short run
cannot pass.
"""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from loramux.platform.api.middleware.input_guard import bad_character
from loramux.platform.app import create_app
from loramux.platform.context import build_context
from loramux.platform.settings import Settings
from tests.fixtures.browser import ServerThread
from tests.fixtures.models import build_tiny_model
from tests.fixtures.services import fresh_postgres_database

SEED = 14  # the issue that asked for this test
# Seeds tried when schemathesis's generator fails (fuzz_operation): CI once met 4 seeds in
# a row whose negative draws for one operation all hit that bug.
GENERATOR_ATTEMPTS = 12
OWN_EXAMPLES = 40  # per generation mode, per operation the role may call (80 took 96 s of CI)
FOREIGN_EXAMPLES = 5  # per generation mode, per operation of the other role
# The fuzz model's context: a bound on any request's generation. A generation case without
# max_tokens (most drawn chat and responses cases) generates what the context leaves, so
# this sets most of the tenant fuzz's time: 128 holds what the drawn prompts need (at 80
# examples, one chat case more than at 256 is refused as over the context, every other
# status is the same) and halves those generations (tenant fuzz 127 s -> 63 s here).
CONTEXT_TOKENS = 128
REQUEST_TIMEOUT_S = 30  # a request that hangs is a failure, not a hung run
INJECT_SHARE = 0.25  # the share of cases given one more bad character
GRANTEE = "fuzz-grantee"  # a tenant the fuzzed tenant shares its adapter with
OWNER = "fuzz-owner"  # a tenant that shares its adapter with the fuzzed tenant
REAL_VALUE_SHARE = 0.75  # how often a string that can name a resource names a real one

NUL = "\x00"
SURROGATE = "\ud800"
# A lone surrogate as a URL carries it: the 3 bytes UTF-8 would give it, were it allowed.
SURROGATE_URL = quote(SURROGATE.encode("utf-8", "surrogatepass"), safe="")
DEEP_JSON = b"[" * 100_000 + b"]" * 100_000  # deeper than Python's JSON parser goes

BASE_CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
# What a schema-valid request may get for what its values mean (see the module docstring);
# a 5xx is reported once, by not_a_server_error.
POSITIVE_STATUSES = ["2xx", "400", "401", "402", "404", "409", "429", "5xx"]
# Whose valid requests the schema cannot describe: an upload's files must hold a PEFT adapter,
# and one that does not is refused with 422 and the reason (docs/api.md), whatever the form's shape.
CONTENT_BEYOND_SCHEMA = {"POST /v1/adapters"}
PUBLIC = ("/health", "/healthz", "/readyz", "/metrics", "/v1/me")
ADAPTER_NAME = "fuzz-adapter"
MONEY_FIELDS = ("_usd", "_per_mtok")


# --- the server ------------------------------------------------------------------------------


@dataclass
class Server:
    url: str
    admin_token: str
    model_id: str
    adapter_dir: Path
    session: requests.Session = field(default_factory=requests.Session)

    def call(self, method: str, path: str, token: str, **kwargs: Any) -> requests.Response:
        headers = {"Authorization": f"Bearer {token}"}
        return self.session.request(
            method, self.url + path, headers=headers, timeout=REQUEST_TIMEOUT_S, **kwargs
        )

    def admin(self, method: str, path: str, expected: int, **kwargs: Any) -> Any:
        response = self.call(method, path, self.admin_token, **kwargs)
        assert response.status_code == expected, response.text
        return response.json()

    def new_tenant(self, name: str, **fields: Any) -> tuple[str, str, str]:
        """A tenant with one API key: (tenant id, key, key id)."""
        tenant = self.admin("POST", "/admin/tenants", 201, json={"name": name, **fields})
        key = self.admin("POST", f"/admin/tenants/{tenant['id']}/api-keys", 201, json={})
        return tenant["id"], key["key"], key["id"]

    def upload_adapter(self, key: str) -> None:
        files = [
            ("files", (name, (self.adapter_dir / name).read_bytes()))
            for name in ("adapter_config.json", "adapter_model.safetensors")
        ]
        response = self.call("POST", "/v1/adapters", key, data={"name": ADAPTER_NAME}, files=files)
        assert response.status_code == 201, response.text
        assert response.json()["status"] == "ready", response.text

    def rich_tenant(self, name: str) -> tuple[str, str]:
        """A tenant with generous limits, prices, a pin quota, a ready adapter and usage:
        (id, key)."""
        tenant_id, key, _ = self.new_tenant(
            name,
            requests_per_minute=1_000_000,
            tokens_per_minute=100_000_000,
            input_price_per_mtok=1.5,
            output_price_per_mtok=2.0,
            pin_quota_bytes=1 << 30,  # so that a tenant's pin can be accepted
        )
        self.upload_adapter(key)
        for model in (self.model_id, ADAPTER_NAME):
            body = {"model": model, "prompt": "Hello", "max_tokens": 2}
            response = self.call("POST", "/v1/completions", key, json=body)
            assert response.status_code == 200, response.text
        return tenant_id, key


@pytest.fixture(scope="module")
def fuzz_model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("fuzz-model"),
        tokenizer_dir,
        max_position_embeddings=CONTEXT_TOKENS,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory, fuzz_model_dir, make_adapter, postgres_url) -> Iterator[Server]:
    adapter_dir = make_adapter(fuzz_model_dir, rank=4, targets=("q_proj", "v_proj"))
    with fresh_postgres_database(postgres_url) as database_url:
        settings = Settings(
            data_dir=tmp_path_factory.mktemp("fuzz-data"),
            model=str(fuzz_model_dir),
            database_url=database_url,
            admin_token=None,
        )
        context = build_context(settings, log=lambda _: None)
        try:
            with ServerThread(create_app(context)) as running:
                yield Server(
                    running.url, context.admin_token, context.base_model.model_id, adapter_dir
                )
        finally:
            context.sessions.kw["bind"].dispose()


@pytest.fixture(scope="module")
def schema(server):
    # An explicit config, so no schemathesis.toml on the machine changes the run.
    config = schemathesis.Config.from_dict(
        {
            "generation": {"allow-x00": False},  # NULs come from inject(), in a known share
            "checks": {"positive_data_acceptance": {"expected-statuses": POSITIVE_STATUSES}},
        }
    )
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config)


# --- roles -----------------------------------------------------------------------------------


def _utc_today() -> str:
    return datetime.now(UTC).date().isoformat()


@dataclass
class Role:
    """Who sends the requests, what it may call, and the real values its cases may use."""

    name: str
    token: str
    owns: Callable[[str], bool]  # path template -> whether this role may call it
    # (method, location, name) -> real values for that parameter ("body": a top-level JSON
    # field); none for parameters that name no resource
    known: Callable[[str, str, str], list[str]]
    # (path template) after a successful DELETE: put back what it removed
    restore: Callable[[str], None]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def operator_role(server: Server) -> Role:
    rich_id, _ = server.rich_tenant("fuzz-rich")
    adapters = server.admin("GET", f"/admin/adapters?tenant_id={rich_id}", 200)["data"]
    adapter_id = adapters[0]["id"]  # for the operator's pins
    # A billing export of today (with the rich tenant's usage), for the download route.
    export = server.admin("POST", "/admin/billing/exports", 201, json={"day": _utc_today()})
    throwaway: dict[str, str] = {}
    made = Counter[str]()

    def new_throwaway() -> None:
        made["tenants"] += 1
        tenant_id, _, key_id = server.new_tenant(f"fuzz-throwaway-{made['tenants']}")
        throwaway.update(tenant=tenant_id, key=key_id)

    def known(method: str, location: str, name: str) -> list[str]:
        if name == "tenant_id" and location in ("path", "query"):
            # The tenant with usage is never deleted: later cases still read its rows.
            return [throwaway["tenant"]] if method == "DELETE" else [rich_id, throwaway["tenant"]]
        if name == "key_id" and location == "path":
            return [throwaway["key"]]
        if name == "export_id" and location == "path":
            return [export["id"]]
        if name == "adapter_id" and location == "path":
            return [adapter_id]
        return []

    def restore(path: str) -> None:
        if path == "/admin/tenants/{tenant_id}":
            new_throwaway()
        elif path == "/admin/api-keys/{key_id}":
            key = server.admin("POST", f"/admin/tenants/{throwaway['tenant']}/api-keys", 201)
            throwaway["key"] = key["id"]

    new_throwaway()
    return Role(
        "operator",
        server.admin_token,
        owns=lambda path: path.startswith("/admin/") or path in PUBLIC,
        known=known,
        restore=restore,
    )


def tenant_role(server: Server) -> Role:
    _, key = server.rich_tenant("fuzz-tenant")
    # Sharing both ways: the tenant grants its adapter to one tenant, and calls another's.
    server.new_tenant(GRANTEE)
    _, owner_key, _ = server.new_tenant(OWNER)
    server.upload_adapter(owner_key)
    grant = f"/v1/adapters/{ADAPTER_NAME}/grants/fuzz-tenant"
    assert server.call("PUT", grant, owner_key, json={}).status_code == 200

    def grant_to_grantee() -> None:
        path = f"/v1/adapters/{ADAPTER_NAME}/grants/{GRANTEE}"
        assert server.call("PUT", path, key, json={}).status_code == 200

    def known(method: str, location: str, name: str) -> list[str]:
        if location == "path" and name == "name":
            return [ADAPTER_NAME]
        if location == "path" and name == "grantee":
            return [GRANTEE]
        if location == "body" and name == "model":
            return [server.model_id, ADAPTER_NAME, f"{OWNER}/{ADAPTER_NAME}"]
        return []

    def restore(path: str) -> None:
        if path == "/v1/adapters/{name}":
            server.upload_adapter(key)
            grant_to_grantee()
        elif path == "/v1/adapters/{name}/grants/{grantee}":
            grant_to_grantee()

    grant_to_grantee()

    return Role(
        "tenant",
        key,
        owns=lambda path: path.startswith("/v1/") or path in PUBLIC,
        known=known,
        restore=restore,
    )


# --- JSON documents --------------------------------------------------------------------------


KEY = "{}"  # the last step of a "where" that names an object's keys rather than a value


def _json_sites(value: Any, where: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Where a JSON document holds a string, and each object's keys (``(*path, KEY)``)."""
    if isinstance(value, str):
        yield where
    elif isinstance(value, dict):
        yield (*where, KEY)
        for key, item in value.items():
            yield from _json_sites(item, (*where, str(key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _json_sites(item, (*where, str(index)))


def _get_at(document: Any, where: tuple[str, ...]) -> Any:
    for step in where:
        document = document[int(step)] if isinstance(document, list) else document[step]
    return document


def _set_at(document: Any, where: tuple[str, ...], value: Any) -> Any:
    """A copy of ``document`` with ``value`` at ``where``, containers made where missing."""
    if not where:
        return value
    head, rest = where[0], where[1:]
    if head.isdigit():
        items = list(document) if isinstance(document, list) and document else [None]
        index = min(int(head), len(items) - 1)
        items[index] = _set_at(items[index], rest, value)
        return items
    fields = dict(document) if isinstance(document, dict) else {}
    fields[head] = _set_at(fields.get(head), rest, value)
    return fields


def _with_bad(document: Any, where: tuple[str, ...], bad: str) -> Any:
    """``document`` with ``bad`` in the string at ``where``, or a key holding it."""
    if where and where[-1] == KEY:
        return _set_at(document, (*where[:-1], f"key{bad}"), 1)
    try:
        current = _get_at(document, where)
    except (KeyError, IndexError, TypeError):  # not in the document yet: _set_at adds it
        current = None
    return _set_at(document, where, (current if isinstance(current, str) else "x") + bad)


def _json_body(case: Case) -> Any | None:
    """The case's JSON body, or ``None`` when it sends none (or not JSON)."""
    if case.media_type is not None and "json" not in case.media_type:
        return None
    return case.body if isinstance(case.body, dict | list | str) else None


# --- bad characters --------------------------------------------------------------------------


def expected_refusal(case: Case) -> int | None:
    """The status docs/api.md promises for the bad characters ``case`` carries, if any.

    The input guard refuses a NUL in the path with 404, then a NUL or lone surrogate in a
    query parameter (name or value) or a JSON body (string or key) with 422. A surrogate sent
    in a URL as bytes reaches the app as replacement characters: nothing to refuse.
    """
    for value in (case.path_parameters or {}).values():
        if isinstance(value, str) and NUL in unquote(value):
            return 404
    for name, value in (case.query or {}).items():
        if isinstance(value, bytes):  # as the server decodes it
            value = value.decode("utf-8", "replace")
        if any(isinstance(text, str) and bad_character(text) for text in (name, value)):
            return 422
    body = _json_body(case)
    for where in _json_sites(body) if body is not None else ():
        if where and where[-1] == KEY:
            texts = list(_get_at(body, where[:-1]))
        else:
            texts = [_get_at(body, where)]
        if any(bad_character(text) for text in texts):
            return 422
    return None


def inject(case: Case, chance: random.Random) -> str | None:
    """Maybe put one NUL or lone surrogate somewhere in ``case``: what and where, or None."""
    if chance.random() >= INJECT_SHARE:
        return None
    sites: list[tuple[str, Any]] = [("path", name) for name in case.path_parameters or {}]
    sites += [
        ("query", name) for name, value in (case.query or {}).items() if isinstance(value, str)
    ]
    body = _json_body(case)
    # A body is changed in place: schemathesis revalidates a case whose body is replaced,
    # with a validator that cannot hold a surrogate. So a body that is one string has no site.
    sites += [("body", where) for where in _json_sites(body) if where] if body is not None else []
    if not sites:
        return None
    location, where = chance.choice(sites)
    bad = chance.choice([NUL, SURROGATE])
    kind = "NUL" if bad == NUL else "surrogate"
    if location == "path":  # sent as it is: already percent-encoded
        case.path_parameters[where] += "%00" if bad == NUL else SURROGATE_URL
    elif location == "query":  # requests sends a str as UTF-8 (no surrogates), bytes as given
        value = case.query[where] + bad
        case.query[where] = value if bad == NUL else value.encode("utf-8", "surrogatepass")
    elif where[-1] == KEY:
        _get_at(body, where[:-1])[f"key{bad}"] = 1
        return f"{kind} in a body key"
    else:
        container = _get_at(body, where[:-1])
        step = int(where[-1]) if isinstance(container, list) else where[-1]
        container[step] += bad
    return f"{kind} in {location}"


# --- making cases meaningful -----------------------------------------------------------------


MIN_TIMEOUT_S = 600.0  # see within_contract
RULED_FIELDS = (
    "logit_bias",
    "best_of",
    "suffix",
    "echo",
    "response_format",
    "text",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "user",
)


def within_contract(case: Case) -> None:
    """Make a schema-valid case meet the rules JSON Schema cannot state.

    - Money is whole micro-dollars (422 otherwise, ``admin/schemas.py``); ``multipleOf:
      0.000001`` would be inexact on floats (it refuses 0.15), so amounts are rounded to 6
      decimal places.
    - Request bodies take JSON types as they are (strict models: ``admin/schemas.py``,
      ``openai/schemas.py``): an integer is written ``5``, while JSON Schema also counts ``5.0``
      as one; integral floats at the top of a body are sent as ints.
    - A usage range starts no later than it ends (422 otherwise): ``start`` and ``end`` are
      swapped when drawn the wrong way round.
    - A request's ``timeout`` is a deadline the server may not be able to meet: a tiny one
      is answered 503 ``deadline_unattainable`` or 504 ``deadline_exceeded``, documented
      5xx that say nothing of the server's health, so a positive case's is at least
      ``MIN_TIMEOUT_S``.
    - The generation fields whose rules reach beyond their JSON type (``RULED_FIELDS``: a
      ``logit_bias`` key must be a token id, ``best_of`` at least ``n``, a ``suffix``
      empty, ``echo``, a ``response_format``'s schema must
      compile, ``tools`` and ``tool_choice`` must agree, ``user`` at most 256 characters)
      are left out of a positive case: drawn at random they are refused with a 400 that
      names them (their own tests check each rule), and the route would never see a
      positive case it accepts.
    """
    body = _json_body(case)
    if isinstance(body, dict) and ("prompt" in body or "messages" in body or "input" in body):
        for name in RULED_FIELDS:
            body.pop(name, None)
        if body.get("max_tokens") == 0:  # 0 only scores a prompt, with echo
            body["max_tokens"] = 1
        prompt = body.get("prompt")
        if "prompt" in body and not (isinstance(prompt, str) and prompt):
            # Drawn lists hold empty prompts and token ids past the vocab (400s naming them).
            body["prompt"] = "Hello"
    if isinstance(body, dict) and isinstance(body.get("timeout"), int | float):
        body["timeout"] = max(body["timeout"], MIN_TIMEOUT_S)
    if isinstance(body, dict):
        for name, value in body.items():
            if isinstance(value, float) and name.endswith(MONEY_FIELDS):
                body[name] = round(value, 6)
            elif isinstance(value, float) and value.is_integer():
                body[name] = int(value)
    query = case.query or {}
    if isinstance(query.get("start"), str) and isinstance(query.get("end"), str):
        try:
            start, end = (datetime.fromisoformat(query[name]) for name in ("start", "end"))
            if start > end:
                query["start"], query["end"] = query["end"], query["start"]
        except (ValueError, TypeError):  # not read by Python, or naive against aware
            pass


def with_real_values(case: Case, role: Role, chance: random.Random) -> None:
    """Often put a real value where the case has a string that names a resource."""
    method = case.method.upper()
    places = [("path", case.path_parameters), ("query", case.query)]
    if isinstance(_json_body(case), dict):
        places.append(("body", case.body))
    for location, values in places:
        for name, value in (values or {}).items():
            known = role.known(method, location, name)
            if known and isinstance(value, str) and chance.random() < REAL_VALUE_SHARE:
                values[name] = chance.choice(known)


# --- sending and checking --------------------------------------------------------------------


@dataclass
class Tally:
    """What one role's run sent and saw."""

    role: Role
    server: Server
    requests: Counter[str] = field(default_factory=Counter)  # per "METHOD /path phase"
    statuses: dict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    injected: Counter[str] = field(default_factory=Counter)
    swept: Counter[str] = field(default_factory=Counter)
    failures: dict[tuple[str, ...], str] = field(default_factory=dict)  # the first of a kind
    failure_count: int = 0
    schema_violations: int = 0
    accepted: dict[str, Case] = field(default_factory=dict)  # a 2xx positive case per operation
    generator_retries: Counter[str] = field(default_factory=Counter)  # see fuzz_operation

    def fail(self, key: tuple[str, ...], text: str) -> None:
        self.failure_count += 1
        self.failures.setdefault(key, text)

    def send(self, case: Case, checks: list, expected: int | None, label: str) -> int | None:
        """Send ``case`` as the role, run ``checks`` and the bad-character expectation."""
        operation = case.operation.label
        self.requests[label] += 1
        try:
            response = case.call(
                base_url=self.server.url,
                session=self.server.session,
                headers=self.role.headers,
                timeout=REQUEST_TIMEOUT_S,
            )
        except requests.RequestException as exc:  # a timeout, a dropped connection
            curl = case.as_curl_command(headers=self.role.headers, base_url=self.server.url)
            self.fail((operation, type(exc).__name__), f"{operation}: {exc!r}\n{curl}")
            return None
        self.statuses[label][response.status_code] += 1
        try:
            case.validate_response(response, checks=checks, headers=self.role.headers)
        except FailureGroup as group:
            for failure in group.exceptions:
                if failure.title != "Server error":
                    self.schema_violations += 1
                key = (operation, failure.title, str(response.status_code))
                self.fail(key, f"{group}\nthe server said: {response.text[:2000]}")
        if expected is not None and response.status_code != expected:
            curl = case.as_curl_command(headers=self.role.headers, base_url=self.server.url)
            self.fail(
                (operation, "bad characters not refused", str(response.status_code)),
                f"{operation}: expected {expected}, got {response.status_code}: "
                f"{response.text[:2000]}\n{curl}",
            )
        if case.method.upper() == "DELETE" and 200 <= response.status_code < 300:
            self.role.restore(case.operation.path)
        return response.status_code

    @property
    def server_errors(self) -> int:
        return sum(n for counts in self.statuses.values() for s, n in counts.items() if s >= 500)


def fuzz_operation(tally: Tally, operation: Any, mode: GenerationMode, examples: int) -> None:
    """Up to ``examples`` cases of ``operation`` in ``mode``, each sent and checked."""
    label = f"{operation.label} {mode.value}"
    checks = [*BASE_CHECKS]
    if mode.is_negative:
        checks.append(negative_data_rejection)
    elif operation.label not in CONTENT_BEYOND_SCHEMA:
        checks.append(positive_data_acceptance)
    # The choices the test makes itself (a real value? a bad character?) come from a plain
    # random source with a fixed seed: Hypothesis' draws favour their bounds, which would
    # skew the shares.
    chance = random.Random(f"{SEED} {label}")

    @hypothesis.settings(
        max_examples=examples,
        derandomize=False,  # the seed decides, under Hypothesis' CI profile too
        database=None,
        deadline=None,
        phases=[Phase.generate],  # failures are collected, not shrunk
        suppress_health_check=list(HealthCheck),
        verbosity=hypothesis.Verbosity.quiet,
    )
    @hypothesis.given(case=operation.as_strategy(mode))
    def fuzz(case: Case) -> None:
        if mode.is_positive:
            within_contract(case)
        with_real_values(case, tally.role, chance)
        injected = inject(case, chance)
        if injected:
            tally.injected[injected] += 1
        expected = expected_refusal(case)
        # A bad character changes what the case's mode says about it (a surrogate sent in a
        # URL arrives as replacement characters: an enum value no longer matches, an empty
        # string no longer is), so only the checks that hold for any request judge it.
        status = tally.send(case, BASE_CHECKS if injected else checks, expected, label)
        if status is not None and 200 <= status < 300 and mode.is_positive and not injected:
            tally.accepted.setdefault(operation.label, case)

    # Schemathesis's negative mutations can draw a lone surrogate that its own validator
    # (jsonschema_rs) then fails to encode while *generating* the case: a bug of the
    # generator, raised before anything is sent, not a finding about the server. That
    # draw ends Hypothesis' run, so the run goes on under the next seed (the cases sent
    # before it were checked like any).
    for attempt in range(GENERATOR_ATTEMPTS):
        try:
            hypothesis.seed(SEED + attempt)(fuzz)()
            return
        except UnicodeEncodeError as exc:
            if "surrogates not allowed" not in str(exc) or attempt + 1 == GENERATOR_ATTEMPTS:
                raise
            tally.generator_retries[label] += 1


# --- the sweep -------------------------------------------------------------------------------


def _resolve(spec: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def string_fields(spec: dict, schema: dict, where: tuple[str, ...] = ()) -> Iterator[tuple]:
    """Each place a JSON document of ``schema`` may hold a string (list items as "0") and
    each object's keys (``(*path, KEY)``), through every branch of an ``anyOf``."""
    schema = _resolve(spec, schema)
    if len(where) > 8:
        return
    for branch in schema.get("anyOf", []) + schema.get("oneOf", []):
        yield from string_fields(spec, branch, where)
    kind = schema.get("type")
    if kind == "string" or "enum" in schema:
        yield where
    if kind == "array" and "items" in schema:
        yield from string_fields(spec, schema["items"], (*where, "0"))
    if kind == "object" or "properties" in schema:
        yield (*where, KEY)
        for name, item in schema.get("properties", {}).items():
            yield from string_fields(spec, item, (*where, name))
        if schema.get("additionalProperties"):  # free-form: any name, any value
            yield (*where, "extra")


def sweep_base(tally: Tally, operation: Any) -> Case:
    """A request of ``operation`` to put bad characters into: one the server accepted."""
    base = tally.accepted.get(operation.label)
    if base is not None:
        return base
    if operation.method.upper() == "DELETE":
        # Every sweep request of a DELETE has a bad path parameter: it deletes nothing.
        names = [parameter.name for parameter in operation.path_parameters]
        return operation.Case(path_parameters=dict.fromkeys(names, "x"))
    if any(body.media_type == "multipart/form-data" for body in operation.body):
        # No fuzzed upload holds a real adapter; the route checks the form's text first.
        body = {"name": "x", "files": [b"\x00"]}
        return operation.Case(body=body, media_type="multipart/form-data")
    raise AssertionError(f"no accepted request to build the sweep on: {operation.label}")


def sweep_variants(spec: dict, operation: Any, bad: str) -> Iterator[tuple[str, dict, int | None]]:
    """(where, the parts of the request that change, expected status) for ``bad`` in each
    string field ``operation`` declares."""
    declared = spec["paths"][operation.path][operation.method.lower()]
    for parameter in declared.get("parameters", []):
        name, location = parameter["name"], parameter["in"]
        if location == "path":
            value = "x" + ("%00" if bad == NUL else SURROGATE_URL)
            yield "path", {"path_parameters": {name: value}}, 404 if bad == NUL else None
        elif location == "query":
            value = f"x{bad}".encode("utf-8", "surrogatepass")
            yield "query", {"query": {name: value}}, 422 if bad == NUL else None
    content = declared.get("requestBody", {}).get("content", {})
    if "application/json" in content:
        for where in dict.fromkeys(string_fields(spec, content["application/json"]["schema"])):
            yield "body", {"body": where}, 422
    if "multipart/form-data" in content:
        properties = _resolve(spec, content["multipart/form-data"]["schema"])["properties"]
        for name, schema in properties.items():
            if schema.get("type") == "string" and "format" not in schema:  # not a file
                value = f"x{bad}".encode("utf-8", "surrogatepass")  # a form field is bytes
                yield "form", {"form": (name, value)}, 422


def sweep(tally: Tally, spec: dict, operation: Any, base: Case) -> None:
    """Both bad characters in each string field of ``operation``, on top of ``base``."""
    label = f"{operation.label} sweep"
    parts = {
        "path_parameters": base.path_parameters,
        "query": base.query,
        "body": base.body,
        "media_type": base.media_type,
    }
    for bad in (NUL, SURROGATE):
        kind = "NUL" if bad == NUL else "surrogate"
        for location, change, expected in sweep_variants(spec, operation, bad):
            request = dict(parts)
            if location == "body":
                request["body"] = _with_bad(base.body, change["body"], bad)
            elif location == "form":
                name, value = change["form"]
                request["body"] = {**base.body, name: value}
            else:
                part = next(iter(change))
                request[part] = {**(parts[part] or {}), **change[part]}
            tally.swept[f"{kind} in {location}"] += 1
            tally.send(operation.Case(**request), BASE_CHECKS, expected, label)
    if any(body.media_type == "application/json" for body in operation.body):
        # JSON no parser reads: FastAPI's own answer would be an undocumented 400.
        for name, raw in (("not UTF-8", b'{"x": "\xff"}'), ("nested too deep", DEEP_JSON)):
            request = {**parts, "body": raw, "media_type": "application/json"}
            tally.swept[f"body {name}"] += 1
            tally.send(operation.Case(**request), BASE_CHECKS, 422, label)


# --- the tests -------------------------------------------------------------------------------


def _has_inputs(operation: Any) -> bool:
    return bool(operation.path_parameters or operation.query or operation.body)


def run_role(server: Server, schema: Any, role: Role) -> None:
    started = time.monotonic()
    tally = Tally(role, server)
    spec = server.session.get(f"{server.url}/openapi.json", timeout=REQUEST_TIMEOUT_S).json()
    operations = [result.ok() for result in schema.get_all_operations()]
    minimums: dict[str, int] = {}
    for operation in operations:
        examples = OWN_EXAMPLES if role.owns(operation.path) else FOREIGN_EXAMPLES
        modes = [GenerationMode.POSITIVE]
        if _has_inputs(operation):
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            try:
                fuzz_operation(tally, operation, mode, examples)
            except hypothesis.errors.Unsatisfiable:
                # Nothing of it can be made invalid (a path parameter that may be any string,
                # no query, no body): schemathesis rejects every negative case it draws.
                assert mode is GenerationMode.NEGATIVE, operation.label
                continue
            # Without inputs an operation has one request to send; with, Hypothesis may stop
            # early only once it has tried everything there is.
            label = f"{operation.label} {mode.value}"
            minimums[label] = examples // 2 if _has_inputs(operation) else 1
    fuzzed = sum(tally.requests.values())
    for operation in operations:
        if role.owns(operation.path) and _has_inputs(operation):
            sweep(tally, spec, operation, sweep_base(tally, operation))
    elapsed = time.monotonic() - started

    total = sum(tally.requests.values())
    print(
        f"\n== fuzz as {role.name}: {len(operations)} operations, {total} requests in "
        f"{elapsed:.1f} s ({fuzzed} fuzzed, {total - fuzzed} in the bad-character sweep)"
    )
    for label, count in sorted(tally.requests.items()):
        statuses = " ".join(f"{s}x{n}" for s, n in sorted(tally.statuses[label].items()))
        print(f"   {count:4d}  {label:50s} {statuses}")
    print(f"   bad characters injected into fuzzed requests: {dict(tally.injected)}")
    print(f"   bad-character sweep: {dict(tally.swept)}")
    print(f"   schemathesis generator failures, run again: {dict(tally.generator_retries)}")
    print(
        f"   5xx seen: {tally.server_errors}; schema violations seen: "
        f"{tally.schema_violations}; failures: {tally.failure_count}"
    )

    assert not tally.failures, "\n\n".join(tally.failures.values())
    # The run really ran: each operation got its requests, and both characters went out,
    # in fuzzed requests and into every kind of field in the sweep.
    for label, minimum in minimums.items():
        assert tally.requests[label] >= minimum, (label, tally.requests[label], minimum)
    assert all(f"{operation.label} positive" in minimums for operation in operations)
    for kind in ("NUL", "surrogate"):
        assert sum(n for what, n in tally.injected.items() if what.startswith(kind)) >= 20
        for location in ("path", "query", "body"):
            assert tally.swept[f"{kind} in {location}"] > 0, (kind, location, tally.swept)


# --- big numbers in schemas -----------------------------------------------------------------

# Where a tenant's JSON schema travels on each route (issue 33): a schema goes in at "{}".
SCHEMA_SITES = {
    "chat response_format": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}},
        },
        ("response_format", "json_schema", "schema"),
        "response_format.json_schema.schema",
    ),
    "chat tools": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        },
        ("tools", "0", "function", "parameters"),
        "tools[0].function.parameters",
    ),
    "completions response_format": (
        "/v1/completions",
        {
            "prompt": "Hi",
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}},
        },
        ("response_format", "json_schema", "schema"),
        "response_format.json_schema.schema",
    ),
    "responses text.format": (
        "/v1/responses",
        {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "s", "schema": {}}}},
        ("text", "format", "schema"),
        "text.format.schema",
    ),
}
NUMBER_KEYWORDS = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minItems",
    "maxItems",
    "maxLength",
    "const",
    "enum",
    "default",
)
# Past 2**53 (what the grammar compiler holds exactly), up to far past 64 bits; floats too,
# some of which (an integer enum near -2**63) crashed the grammar library's process.
BIG_NUMBERS = hypothesis.strategies.one_of(
    hypothesis.strategies.integers(min_value=2**53, max_value=2**200),
    hypothesis.strategies.integers(min_value=-(2**200), max_value=-(2**53)),
    hypothesis.strategies.floats(min_value=2.0**53, allow_infinity=False),
    hypothesis.strategies.floats(max_value=-(2.0**53), allow_infinity=False),
)


@hypothesis.strategies.composite
def big_number_schemas(draw) -> tuple[dict, str]:
    """(a schema with a number out of range, the JSON pointer of that number)."""
    keyword = draw(hypothesis.strategies.sampled_from(NUMBER_KEYWORDS))
    number = draw(BIG_NUMBERS)
    kind = "array" if "Items" in keyword else "string" if "Length" in keyword else "integer"
    leaf: dict[str, Any] = {"type": kind, keyword: [1, number] if keyword == "enum" else number}
    pointer = f"/{keyword}/1" if keyword == "enum" else f"/{keyword}"
    if draw(hypothesis.strategies.booleans()):  # one property down
        return {"type": "object", "properties": {"n": leaf}}, f"/properties/n{pointer}"
    return leaf, pointer


def test_big_numbers_in_schemas_are_400s_naming_them(server):
    """Every route a schema reaches: a number past the grammar's range is a 400 naming the
    field, never a 5xx, and the kept-alive connection serves the next request."""
    _, key, _ = server.new_tenant("fuzz-big-numbers")
    session = requests.Session()  # one connection, kept alive across the cases
    headers = {"Authorization": f"Bearer {key}"}
    statuses = Counter[int]()

    @hypothesis.settings(
        max_examples=60,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
    )
    @hypothesis.given(
        site=hypothesis.strategies.sampled_from(sorted(SCHEMA_SITES)),
        drawn=big_number_schemas(),
        strict=hypothesis.strategies.booleans(),
        stream=hypothesis.strategies.booleans(),
    )
    def send(site: str, drawn: tuple[dict, str], strict: bool, stream: bool) -> None:
        path, body, where, field_name = SCHEMA_SITES[site]
        schema, pointer = drawn
        body = _set_at(body, where, schema)
        strict_at = (*where[:-1], "strict")
        body = _set_at(body, strict_at, strict)
        body = {**body, "model": server.model_id, "max_tokens": 2, "stream": stream}
        response = session.post(server.url + path, json=body, headers=headers, timeout=30)
        statuses[response.status_code] += 1
        assert response.status_code == 400, (site, body, response.text)
        message = response.json()["error"]["message"]
        assert message.startswith(f"{field_name}: {pointer} is "), message
        after = session.get(server.url + "/v1/models", headers=headers, timeout=30)
        assert after.status_code == 200, after.text

    hypothesis.seed(SEED)(send)()
    print(f"\n== big numbers in schemas: {dict(statuses)}")
    assert sum(statuses.values()) >= 30


def test_fuzz_as_operator(server, schema):
    run_role(server, schema, operator_role(server))


def test_fuzz_as_tenant(server, schema):
    run_role(server, schema, tenant_role(server))
