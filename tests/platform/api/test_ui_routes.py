"""The admin UI's server side: page shells, static files from the installed package, and
that every file a page or script refers to exists."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator
from importlib import resources

import pytest
from fastapi.testclient import TestClient

from loramux.platform.api.admin.ui import NAV, PAGES
from loramux.platform.app import create_app
from loramux.platform.context import build_context
from loramux.platform.settings import Settings

PAGE_PATHS = [
    "/ui",
    "/ui/signin",
    "/ui/operator/tenants",
    "/ui/operator/tenants/some-tenant-id",
    "/ui/operator/adapters",
    "/ui/operator/usage",
    "/ui/operator/billing",
    "/ui/operator/engine",
    "/ui/tenant/adapters",
    "/ui/tenant/adapters/some-adapter",
    "/ui/tenant/playground",
    "/ui/tenant/usage",
]
STATIC_URL = re.compile(r"""(?:src|href)="(/ui/static/[^"?]+)\?v=[0-9a-f]{12}""")
JS_IMPORT = re.compile(r"""^import .* from "(\.{1,2}/[^"]+)";$""", re.MULTILINE)


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_model_dir) -> Iterator[TestClient]:
    """The UI needs neither a database nor an engine of its own: the light embedded app."""
    settings = Settings(data_dir=tmp_path_factory.mktemp("ui"), model=str(tiny_model_dir))
    context = build_context(settings, log=lambda _: None, with_engine=False)
    with TestClient(create_app(context)) as test_client:
        yield test_client


def test_root_redirects_to_the_ui(client):
    response = client.get("/", follow_redirects=False)
    assert response.status_code == 307 and response.headers["location"] == "/ui"


def test_every_page_is_covered():
    assert len(PAGE_PATHS) == len(PAGES)
    for items in NAV.values():
        assert {item.href for item in items} <= set(PAGE_PATHS)


@pytest.mark.parametrize("path", PAGE_PATHS)
def test_pages_render_with_their_files_and_a_strict_policy(client, path):
    response = client.get(path)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/html")
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "default-src 'self'" in policy
    assert response.headers["cache-control"] == "no-store"
    html = response.text
    assert "<script>" not in html and " style=" not in html  # nothing inline (the policy)
    urls = STATIC_URL.findall(html)
    assert any(url.endswith(".js") for url in urls) and any(url.endswith(".css") for url in urls)
    for url in urls:
        assert client.get(url).status_code == 200, url


def test_tenant_page_carries_its_id_escaped(client):
    html = client.get('/ui/operator/tenants/a"b<c').text
    assert 'data-tenant-id="a&#34;b&lt;c"' in html


def test_adapter_page_carries_its_name_escaped(client):
    html = client.get("/ui/tenant/adapters/a%22b%3Cc").text
    assert 'data-adapter-name="a&#34;b&lt;c"' in html


def test_static_files_have_types_etags_and_revalidate(client):
    response = client.get("/ui/static/js/lib/api.js")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/javascript")
    etag = response.headers["etag"]
    again = client.get("/ui/static/js/lib/api.js", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""
    css = client.get("/ui/static/css/base.css")
    assert css.headers["content-type"].startswith("text/css")


@pytest.mark.parametrize(
    "path",
    [
        "/ui/static/../templates/base.html",
        "/ui/static/js/../../templates/base.html",
        "/ui/static/.hidden.js",
        "/ui/static/js/lib/nope.js",
        "/ui/static/css",
        "/ui/static/templates/base.html",
        "/ui/static/js/lib/api.py",
    ],
)
def test_only_static_files_are_served(client, path):
    response = client.get(path)
    assert response.status_code == 404, path
    assert "error" in response.json()


def test_unknown_pages_are_404(client):
    assert client.get("/ui/operator/nope").status_code == 404
    assert client.get("/ui/root/tenants").status_code == 404


def test_every_script_import_resolves():
    """ES module imports are relative paths: each must name a file the package ships."""
    static = resources.files("loramux.admin_ui") / "static"
    scripts = [
        f"js/{folder}/{node.name}"
        for folder in ("lib", "pages")
        for node in (static / "js" / folder).iterdir()
        if node.name.endswith(".js")
    ]
    assert len(scripts) >= 10
    checked = 0
    for script in scripts:
        source = static.joinpath(*script.split("/")).read_text()
        for target in JS_IMPORT.findall(source):
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(script), target))
            assert static.joinpath(*resolved.split("/")).is_file(), (script, target)
            checked += 1
    assert checked >= 30  # the pattern still finds the imports
