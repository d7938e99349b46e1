"""A database that cannot be reached answers a JSON 503 ``database_unavailable`` on any
route; any other database error is still a bug (500)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import exc as sa_exc

from loramux.platform.api.errors import install_error_handlers


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/down")
    def down():
        raise sa_exc.OperationalError("SELECT 1", {}, ConnectionRefusedError("refused"))

    @app.get("/bug")
    def bug():
        raise sa_exc.ProgrammingError("SELEKT", {}, Exception("syntax error"))

    return app


def test_an_unreachable_database_is_a_json_503():
    client = TestClient(_app(), raise_server_exceptions=False)
    response = client.get("/down")
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/json"
    assert response.headers["retry-after"] == "5"
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("database_unavailable", "server_error")
    assert "try again" in error["message"] and "SELECT" not in error["message"]


def test_another_database_error_is_still_a_500():
    client = TestClient(_app(), raise_server_exceptions=False)
    assert client.get("/bug").status_code == 500
