"""Services speak the platform's own errors, never HTTP; the API alone maps them.

* No module under ``platform/services/`` or ``platform/tasks/`` imports FastAPI, Starlette
  or the API layer (an AST walk), and the Celery worker, started in a fresh interpreter,
  loads neither framework.
* Every platform error a module raises names a code of the API's table whose status is one
  its kind allows (a ``NotFound`` is never answered with a 503): ``api/test_error_codes.py``
  walks every error site.
* Over the app, a service's error arrives as the OpenAI error of its code, with
  ``Retry-After`` where it says when to retry.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient

from loramux.platform import errors
from loramux.platform.api.errors import install_error_handlers

ROOT = Path(__file__).resolve().parents[2]
PLATFORM = ROOT / "platform"
HTTP_PACKAGES = ("fastapi", "starlette", "loramux.platform.api")


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def test_services_and_tasks_import_nothing_of_http():
    modules = sorted((PLATFORM / "services").glob("*.py")) + sorted(
        (PLATFORM / "tasks").glob("*.py")
    )
    assert len(modules) > 10
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in [*modules, PLATFORM / "errors.py"]
        for line, module in _imports(path)
        if module.startswith(HTTP_PACKAGES)
    ]
    assert not found, "services raise loramux.platform.errors; HTTP stays in api/:\n" + (
        "\n".join(found)
    )


def test_the_worker_loads_no_web_framework():
    probe = (
        "import json, sys\n"
        "import loramux.platform.tasks.worker, loramux.platform.tasks.celery_app\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('fastapi', 'starlette') or m.startswith('loramux.platform.api'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded == [], f"the worker imports {loaded[:5]}..."


def test_the_api_answers_a_service_error_with_its_codes_status():
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/busy")
    def busy():
        raise errors.Unavailable(
            "The store is down; try again.", code="store_unavailable", retry_after_s=7
        )

    @app.get("/over")
    def over():
        raise errors.QuotaExceeded("Monthly budget exhausted.", code="budget_exceeded")

    @app.get("/bad")
    def bad():
        raise errors.Invalid("The adapter has no weights.", code="invalid_adapter")

    with TestClient(app) as client:
        busy_response, over_response, bad_response = (
            client.get(path) for path in ("/busy", "/over", "/bad")
        )
    assert busy_response.status_code == 503
    assert busy_response.headers["retry-after"] == "7"
    assert busy_response.json() == {
        "error": {
            "message": "The store is down; try again.",
            "type": "server_error",
            "code": "store_unavailable",
        }
    }
    assert over_response.status_code == 402
    assert over_response.json()["error"]["type"] == "insufficient_quota"
    assert "retry-after" not in over_response.headers
    assert bad_response.status_code == 422
    assert bad_response.json()["error"]["code"] == "invalid_adapter"
