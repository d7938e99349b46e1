"""The OpenAPI document keeps its shape while the code behind it is reorganized: every
path, method, parameter, request and response schema as committed in
``openapi_shape.json``. Descriptions and summaries are left out (wording may improve).

After a deliberate API change, write the new shape with
``LORAMUX_WRITE_OPENAPI_SHAPE=1 pytest tests/platform/api/test_openapi_shape.py`` and
commit it with the change.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

SNAPSHOT = Path(__file__).with_name("openapi_shape.json")
WORDING = {"description", "summary"}


def shape(node):
    """``node`` without its wording (descriptions, summaries), anywhere in it. A schema
    property *named* description stays: only a string under that key is wording."""
    if isinstance(node, dict):
        return {
            key: shape(value)
            for key, value in node.items()
            if not (key in WORDING and isinstance(value, str))
        }
    if isinstance(node, list):
        return [shape(item) for item in node]
    return node


def test_the_openapi_document_keeps_its_paths_methods_and_schemas(client):
    response = client.get("/openapi.json")
    assert response.status_code == 200, response.text
    got = shape(response.json())
    if os.environ.get("LORAMUX_WRITE_OPENAPI_SHAPE") == "1":
        SNAPSHOT.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"wrote {SNAPSHOT.name}")
    want = json.loads(SNAPSHOT.read_text())
    assert sorted(got["paths"]) == sorted(want["paths"])
    for path, item in want["paths"].items():
        assert sorted(got["paths"][path]) == sorted(item), path
        for method, operation in item.items():
            assert got["paths"][path][method] == operation, (method, path)
    assert sorted(got["components"]["schemas"]) == sorted(want["components"]["schemas"])
    for name, schema in want["components"]["schemas"].items():
        assert got["components"]["schemas"][name] == schema, name
    assert got == want  # and the rest (info, security schemes, tags)


def test_wording_is_all_that_shape_leaves_out():
    document = {
        "paths": {"/x": {"get": {"summary": "S", "description": "D", "responses": {}}}},
        "components": {
            "schemas": {
                "Thing": {
                    "description": "a thing",
                    "properties": {"description": {"type": "string", "description": "its text"}},
                }
            }
        },
    }
    assert shape(document) == {
        "paths": {"/x": {"get": {"responses": {}}}},
        "components": {"schemas": {"Thing": {"properties": {"description": {"type": "string"}}}}},
    }
