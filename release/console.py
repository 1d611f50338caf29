"""The release controller's web console: one page that polls the JSON API and draws it.

The page (``GET /`` and ``GET /console``) is static HTML; its script and stylesheet are served by
this router too (``/console.js``, ``/console.css``, from ``release/static/``), so the page needs no
CDN, no build step and nothing outside this server. Every response carries a Content-Security-Policy
that allows scripts, styles and fetches from this origin only: no inline script or style runs, no
other host is contacted, and the page cannot be framed. The script reads the API with the bearer
token a person types in (kept in ``sessionStorage``, so it leaves with the tab) and writes every
string it gets back as text, never as markup.

The API (release/api.py) includes :data:`router`; nothing here needs a token, since the page holds
no data until the API gives it some. Try it with ``flywheel release serve`` and open
``http://127.0.0.1:8100/``.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

STATIC = Path(__file__).parent / "static"

#: Only this origin, for scripts, styles, fetches and images; no inline code (the page has none),
#: no plugins, no <base> rewriting, no form posts anywhere, no framing by other sites.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # A new release of the controller must not run against a stale script in someone's cache.
    "Cache-Control": "no-cache",
}

_FILES = {
    "console.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}

router = APIRouter(tags=["console"])


def _asset(name: str) -> Response:
    # Read per request (three small files): an edited asset shows on reload, and a packaging
    # mistake shows as an error on the first request rather than at import in every process.
    return Response((STATIC / name).read_bytes(), media_type=_FILES[name], headers=_HEADERS)


@router.get("/", include_in_schema=False)
@router.get("/console", include_in_schema=False)
def page() -> Response:
    return _asset("console.html")


@router.get("/console.js", include_in_schema=False)
def script() -> Response:
    return _asset("console.js")


@router.get("/console.css", include_in_schema=False)
def style() -> Response:
    return _asset("console.css")
