"""What both APIs' published descriptions start from (serving/openapi.py, release/openapi.py).

Each stage then adds what its app really answers; this holds only the part that is the same:
FastAPI's schema of the routes, versioned by the installed package and described by the first
paragraph of the stage's own module docstring.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi


def base_schema(app: FastAPI, doc: str | None) -> dict[str, Any]:
    """FastAPI's OpenAPI document for ``app``, at the installed flywheel's version ("0" from a
    source tree that was never installed)."""
    try:
        version = metadata.version("flywheel")
    except metadata.PackageNotFoundError:
        version = "0"
    return get_openapi(title=app.title, version=version, routes=app.routes,
                       description=(doc or "").split("\n\n")[0])
