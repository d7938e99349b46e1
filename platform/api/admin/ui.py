"""The admin UI at ``/ui``: server-rendered page shells, and their static files under
``/ui/static`` (:class:`UIStaticFiles`, mounted by the app factory).

Every page is a template from the installed package ``loramux.admin_ui`` (found with
``importlib.resources``, never by a path into the repository) that renders at once with a
skeleton of what it will show; its script then asks the public JSON API for the data,
with the bearer token the user signed in with (kept in the browser's ``sessionStorage``).
So nothing here reads the database or needs a token: whatever the UI does, a script
holding the same token can do through the API.

Pages belong to a role (``operator`` or ``tenant``); the script sends a signed-in user of
the other role to their own home page, and a signed-out one to ``/ui/signin``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.staticfiles import StaticFiles

from loramux.platform.api.errors import APIError

PACKAGE = "loramux.admin_ui"

router = APIRouter(include_in_schema=False)

# Pages run only our own files: no inline script or style, nothing from elsewhere.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
    "form-action 'self'"
)


@dataclass(frozen=True)
class NavItem:
    key: str
    label: str
    href: str
    icon: str  # a symbol id in static/img/icons.svg


NAV = {
    "operator": (
        NavItem("tenants", "Tenants", "/ui/operator/tenants", "tenants"),
        NavItem("adapters", "Adapters", "/ui/operator/adapters", "adapters"),
        NavItem("usage", "Usage & billing", "/ui/operator/usage", "usage"),
        NavItem("billing", "Billing exports", "/ui/operator/billing", "billing"),
        NavItem("engine", "Engine", "/ui/operator/engine", "engine"),
    ),
    "tenant": (
        NavItem("adapters", "Adapters", "/ui/tenant/adapters", "adapters"),
        NavItem("playground", "Playground", "/ui/tenant/playground", "playground"),
        NavItem("usage", "Usage", "/ui/tenant/usage", "usage"),
    ),
}


@dataclass(frozen=True)
class Page:
    template: str
    title: str
    role: str | None  # None: open to anyone (sign-in, the home redirect)
    section: str | None = None  # the nav item it highlights


PAGES = {
    "home": Page("home.html", "loramux", None),
    "signin": Page("signin.html", "Sign in", None),
    "operator/tenants": Page("operator/tenants.html", "Tenants", "operator", "tenants"),
    "operator/tenant": Page("operator/tenant.html", "Tenant", "operator", "tenants"),
    "operator/adapters": Page("operator/adapters.html", "Adapters", "operator", "adapters"),
    "operator/usage": Page("operator/usage.html", "Usage & billing", "operator", "usage"),
    "operator/billing": Page("operator/billing.html", "Billing exports", "operator", "billing"),
    "operator/engine": Page("operator/engine.html", "Engine", "operator", "engine"),
    "tenant/adapters": Page("tenant/adapters.html", "Adapters", "tenant", "adapters"),
    "tenant/adapter": Page("tenant/adapter.html", "Adapter", "tenant", "adapters"),
    "tenant/playground": Page("tenant/playground.html", "Playground", "tenant", "playground"),
    "tenant/usage": Page("tenant/usage.html", "Usage", "tenant", "usage"),
}


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


class UIAssets:
    """The package's templates and static files, read once per app."""

    def __init__(self) -> None:
        self.static_root: Traversable = resources.files(PACKAGE) / "static"
        self._versions: dict[str, str] = {}
        self.env = Environment(
            loader=PackageLoader(PACKAGE, "templates"),
            autoescape=select_autoescape(default=True),
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.globals["static"] = self.static_url

    def version(self, path: str) -> str:
        """A short digest of the file's content (remembered): page URLs carry it, so a
        changed file gets a new URL."""
        if path not in self._versions:
            node = self.static_root.joinpath(*path.split("/"))
            self._versions[path] = digest(node.read_bytes() if node.is_file() else b"")
        return self._versions[path]

    def static_url(self, path: str) -> str:
        return f"/ui/static/{path}?v={self.version(path)}"


class UIStaticFiles(StaticFiles):
    """The UI's CSS, scripts and icons, from the installed package. Revalidated on every
    use (``no-cache`` and an ETag: a 304 costs one round trip, and pages link each file
    with ``?v=<digest>`` anyway) and never type-sniffed."""

    def __init__(self) -> None:
        super().__init__(packages=[(PACKAGE, "static")])

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response


def ui_assets(request: Request) -> UIAssets:
    """This app's assets, built on first use (nothing is read at import)."""
    state = request.app.state
    assets = getattr(state, "ui_assets", None)
    if assets is None:
        assets = state.ui_assets = UIAssets()
    return assets


def _render(request: Request, key: str, **extra: object) -> HTMLResponse:
    page = PAGES[key]
    assets = ui_assets(request)
    html = assets.env.get_template(page.template).render(
        page=key,
        title=page.title,
        role=page.role,
        section=page.section,
        nav=NAV.get(page.role or "", ()),
        script=f"js/pages/{key.replace('/', '_')}.js",
        **extra,
    )
    return HTMLResponse(
        html,
        headers={
            "Content-Security-Policy": CONTENT_SECURITY_POLICY,
            "Cache-Control": "no-store",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "same-origin",
        },
    )


@router.get("/")
def root() -> RedirectResponse:
    return RedirectResponse("/ui", status_code=307)


@router.get("/ui")
def home(request: Request) -> HTMLResponse:
    return _render(request, "home")


@router.get("/ui/signin")
def signin(request: Request) -> HTMLResponse:
    return _render(request, "signin")


@router.get("/ui/operator/tenants/{tenant_id}")
def tenant_page(request: Request, tenant_id: str) -> HTMLResponse:
    return _render(request, "operator/tenant", tenant_id=tenant_id)


@router.get("/ui/tenant/adapters/{adapter_name}")
def adapter_page(request: Request, adapter_name: str) -> HTMLResponse:
    return _render(request, "tenant/adapter", adapter_name=adapter_name)


@router.get("/ui/{role}/{name}")
def role_page(request: Request, role: str, name: str) -> HTMLResponse:
    key = f"{role}/{name}"
    if key not in PAGES or key in ("operator/tenant", "tenant/adapter"):
        raise APIError(404, f"No UI page /ui/{key}.", code="not_found")
    return _render(request, key)
