"""The API's documentation: the bearer scheme in the OpenAPI document, and its two viewers.

FastAPI's own /docs and /redoc pages load Swagger UI and ReDoc from a CDN (jsDelivr), and fonts from
Google: blank pages in an air-gapped cluster. Here both pages load the same tools' distribution
files from this server, taken from the `fastapi-offline` package (PyPI; it depends on FastAPI alone
and refreshes the Swagger UI and ReDoc bundles it ships; only its files are used, the pages are
FastAPI's). Swagger UI's online validator badge is off too, so a page reaches no host but this one.
Without that package the pages say how to read /openapi.json instead.

With an API key the document declares an HTTP bearer scheme and marks the routes that need the key,
so Swagger UI's "Authorize" button sends it.
"""

from __future__ import annotations

import importlib.resources
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

log = logging.getLogger("vitserve.http")

ASSETS_URL = "/docs/static"
BEARER = "bearerAuth"
UNAVAILABLE = """<!doctype html><html><head><title>{title}</title></head><body>
<p>The interactive documentation needs the <code>fastapi-offline</code> package, which is not installed.</p>
<p>The OpenAPI document is at <a href="{openapi}">{openapi}</a>: <code>curl -s http://HOST:PORT{openapi}</code>,
or open it in any OpenAPI viewer.</p></body></html>"""


def asset_folder() -> Path | None:
    """The Swagger UI and ReDoc files of the installed `fastapi-offline`, or None."""
    try:
        folder = Path(str(importlib.resources.files("fastapi_offline") / "static"))
    except ModuleNotFoundError:
        return None
    return folder if (folder / "swagger-ui-bundle.js").is_file() else None


def add_bearer_auth(schema: dict[str, Any], routes: dict[str, str]) -> None:
    """Declare the bearer scheme and require it on `routes` ({path: method})."""
    schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes[BEARER] = {"type": "http", "scheme": "bearer",
                       "description": "the server's --api-key (VITSERVE_API_KEY), as 'Authorization: Bearer <key>'"}
    for path, method in routes.items():
        schema["paths"][path][method]["security"] = [{BEARER: []}]


def install_pages(app: FastAPI) -> None:
    """GET /docs (Swagger UI) and GET /redoc (ReDoc), with their files under ASSETS_URL."""
    folder = asset_folder()
    if folder is None:
        log.warning("fastapi-offline is not installed: /docs and /redoc only point at /openapi.json")
    else:
        app.mount(ASSETS_URL, StaticFiles(directory=folder), name="docs-assets")

    def page(request: Request, viewer: str) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        openapi = f"{root}{app.openapi_url}"
        title = f"{app.title} - {viewer}"
        if folder is None:
            return HTMLResponse(UNAVAILABLE.format(title=title, openapi=openapi))
        assets = f"{root}{ASSETS_URL}"
        if viewer == "ReDoc":
            return get_redoc_html(openapi_url=openapi, title=title, redoc_js_url=f"{assets}/redoc.standalone.js",
                                  redoc_favicon_url=f"{assets}/favicon.png", with_google_fonts=False)
        return get_swagger_ui_html(openapi_url=openapi, title=title, swagger_js_url=f"{assets}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{assets}/swagger-ui.css",
                                   swagger_favicon_url=f"{assets}/favicon.png",
                                   swagger_ui_parameters={"validatorUrl": None})

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        return page(request, "Swagger UI")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        return page(request, "ReDoc")
