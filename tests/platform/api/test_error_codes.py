"""One table of error codes (``error_codes.ERROR_CODES``): every place that answers an
error uses a code from it with the table's status, and docs/api.md documents it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from loramux.engine import EngineError, UnknownAdapter
from loramux.platform.api.error_codes import ERROR_CODES, HTTP_EXCEPTION_CODES, error_detail
from loramux.platform.api.openai.respond import _engine_error
from loramux.platform.engine_fleet.remote import AdapterNotRegistered

ROOT = Path(__file__).resolve().parents[3]
_RAISERS = {"APIError": ("status_code", "message", "code"), "error_response": None}
# The platform's own errors (services raise them): the statuses the API may give each kind.
STATUSES_OF_KIND = {
    "NotFound": {404},
    "Conflict": {409},
    "Invalid": {400, 422},
    "QuotaExceeded": {402, 429},
    "Unavailable": {503},
}


def _literal(node: ast.AST | None):
    return node.value if isinstance(node, ast.Constant) else None


def _error_sites() -> list[tuple[str, int, object, object]]:
    """(file, line, status, code) of every APIError(...), error_response(...) and platform
    error (``NotFound(...)`` ...) in the platform, with the literal values (None where not a
    literal; for a platform error, the name of its kind stands for the statuses it allows)."""
    sites = []
    for path in sorted((ROOT / "platform").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            keywords = {k.arg: k.value for k in node.keywords}
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if name in STATUSES_OF_KIND:
                sites.append((where, node.lineno, ast.Constant(name), keywords.get("code")))
                continue
            if name not in _RAISERS:
                continue
            status = node.args[0] if node.args else keywords.get("status_code")
            code = keywords.get("code", node.args[2] if len(node.args) > 2 else None)
            sites.append((where, node.lineno, status, code))
    return sites


def test_every_error_site_uses_a_code_of_the_table_with_its_status():
    sites = _error_sites()
    assert len(sites) > 40  # the walk found them (APIError, error_response, platform errors)
    assert {_literal(s) for _, _, s, _ in sites} >= set(STATUSES_OF_KIND)
    checked = 0
    for where, _, status_node, code_node in sites:
        status, code = _literal(status_node), _literal(code_node)
        if status is None and code is None:
            continue  # a pass-through (status and code from variables): checked below
        assert code is not None, f"{where}: an error without a literal code"
        assert code in ERROR_CODES, f"{where}: code {code!r} is not in ERROR_CODES"
        if status in STATUSES_OF_KIND:  # a platform error: its code's status fits its kind
            assert ERROR_CODES[code].status in STATUSES_OF_KIND[status], (
                f"{where}: {status}(code={code!r}) would be answered with "
                f"{ERROR_CODES[code].status}"
            )
            checked += 1
        elif status is not None:
            assert ERROR_CODES[code].status == status, (
                f"{where}: {code!r} answered with {status}, the table says "
                f"{ERROR_CODES[code].status}"
            )
            checked += 1
    assert checked > 40


def test_pass_through_sites_are_the_known_ones():
    """The few sites that forward a status and code from variables take them from an
    APIError or the table itself (not made up)."""
    forwarding = [
        where
        for where, _, status, code in _error_sites()
        if _literal(status) is None and _literal(code) is None
    ]
    for where in forwarding:
        assert where.startswith(("platform/api/errors.py", "platform/api/openai/respond.py")), where


def test_engine_failure_codes_are_in_the_table():
    source = (ROOT / "platform/services/engine_failures.py").read_text()
    codes = set(re.findall(r'"(adapter_[a-z_]+)",\n', source))
    assert codes == {"adapter_failed", "adapter_unavailable", "adapter_not_composable"}
    assert codes <= ERROR_CODES.keys()


def test_types_follow_statuses():
    for code, entry in ERROR_CODES.items():
        expected = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
        if entry.status >= 500:
            assert entry.type == "server_error", code
        elif entry.status in expected:
            assert entry.type == expected[entry.status], code
    assert set(HTTP_EXCEPTION_CODES.values()) <= ERROR_CODES.keys()
    for status, code in HTTP_EXCEPTION_CODES.items():
        assert ERROR_CODES[code].status == status


@pytest.mark.parametrize("code", sorted(ERROR_CODES))
def test_the_api_page_documents_each_code(code):
    readme = (ROOT / "docs" / "api.md").read_text()
    row = re.search(rf"^\| `{code}` \| (\d{{3}}) \| `([a-z_]+)` \|", readme, re.MULTILINE)
    assert row is not None, f"docs/api.md's error table has no row for {code}"
    assert int(row.group(1)) == ERROR_CODES[code].status
    assert row.group(2) == ERROR_CODES[code].type


def test_error_detail_is_the_envelope():
    assert error_detail(503, "x", "engine_error") == {
        "message": "x",
        "type": "server_error",
        "code": "engine_error",
    }


@pytest.mark.parametrize("error", [UnknownAdapter, AdapterNotRegistered])
def test_an_adapter_deleted_before_the_engine_saw_the_request_is_a_404(error):
    """A delete that lands between a request's admission and the engine (a churning tenant's
    soak saw it): answered as if the delete had come first, in words without engine ids."""
    answer = _engine_error(error("unknown adapter 't-1-v2'; add_adapter() it first"))
    assert (answer.status_code, answer.code) == (404, "model_not_found")
    assert "t-1-v2" not in answer.message and "deleted" in answer.message
    refused = _engine_error(EngineError("request id 'x' is already in use"))
    assert (refused.status_code, refused.code) == (400, "invalid_request")
