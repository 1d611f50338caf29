"""The release API's published description: ``GET /openapi.json`` (OpenAPI 3.1; no ``/docs`` page).

Written to say what the app really answers, route by route (tests/integration/test_release_fuzz.py
checks real answers against it with schemathesis' conformance checks):

- the response bodies, as the models below (release -> client; the handlers build the same keys
  in release/api.py, and a key added there without a field here fails the conformance test,
  since every model forbids extra keys);
- every error a route can give, each as :class:`ErrorBody` (``{"detail": "<sentence>"}``): 400
  for a request that does not fit it (the app answers 400 where FastAPI would answer 422, and no
  422 is published), 401 with ``WWW-Authenticate: Bearer``, 403 below the route's role, 404, 409
  for an action the rules refuse now, 413 for a body over 16 KiB;
- the bearer scheme, and on each ``/api`` route the security it needs (the role is in the
  route's description).

Request bodies are read by a dependency (release/api.py ``_body``, after the token check), which
FastAPI does not describe by itself: :func:`route` puts each one in.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from flywheel.openapi import base_schema
from release.states import State

BEARER = "bearerAuth"


class _Out(BaseModel):
    # every key the app writes is a field here: one it adds and this lacks fails the fuzz test
    model_config = ConfigDict(extra="forbid")


class ErrorBody(_Out):
    """Every error: a sentence for a person, saying what is wrong and, where it can, what to do."""

    detail: str


class Health(_Out):
    """``/health`` and ``/readyz``: whether the database answers and the controller, if it reports,
    is ok; ``/livez``: whether the controller loop is not hung."""

    ok: bool


class VerdictSummary(_Out):
    """A gate result or a canary analysis cut to its verdict and first reason."""

    outcome: str | None
    reason: str | None


class CandidateRow(_Out):
    version: int
    parent: int | None
    state: State
    created_at: float
    updated_at: float
    step: int | None
    gate_summary: VerdictSummary | None
    analysis_summary: VerdictSummary | None


class AuditRow(_Out):
    """One audit entry: who (a token's name, ``controller:<holder>``), what, when, why."""

    id: int
    version: int | None
    from_state: State | None
    to_state: State | None
    actor: str
    reason: str
    evidence: dict[str, Any] | None
    at: float


class CandidateDetail(CandidateRow):
    uri: str
    manifest_sha256: str
    checkpoint: dict[str, Any]
    gate: dict[str, Any] | None
    analysis: dict[str, Any] | None
    audit: list[AuditRow]


class CandidateList(_Out):
    candidates: list[CandidateRow]


class AuditList(_Out):
    entries: list[AuditRow]


class RevisionRow(_Out):
    """A routing revision, as published on ``flywheel.releases`` (or waiting to be)."""

    revision: int
    stable_version: int
    canary_version: int | None
    canary_share: float
    reason: str
    at: float
    published: bool
    skipped: bool


class CanaryRouting(_Out):
    version: int
    share: float
    #: users reward's abuse guards flagged, left out of the canary's comparison (None: no analysis yet)
    excluded_users: int | None
    #: the level the canary's PASS is tested at: the deployment's budget across canaries
    pass_alpha: float | None


class LeaseRow(_Out):
    holder: str
    expires_at: float
    live: bool


class Status(_Out):
    time: float
    stable_version: int
    canary: CanaryRouting | None
    paused: bool
    revision: RevisionRow | None
    lease: LeaseRow | None
    last_promotion_at: float | None
    next_promotion_at: float | None
    promotion_interval_s: float
    auto_promote: bool
    candidates: dict[str, int]
    #: the controller loop's own report (release/controller.py ``status()``), or why it failed
    controller: dict[str, Any] | None


class Promoted(_Out):
    version: int
    state: Literal["promoted"]
    revision: RevisionRow | None


class Rejected(_Out):
    version: int
    state: Literal["rejected"]


class RolledBack(_Out):
    version: int
    #: rolled_back, or the decided state of a version only its stray routing was taken from
    state: State
    revision: RevisionRow | None


class Undone(_Out):
    """Stable is back on an earlier promoted version (``release undo``)."""

    version: int
    state: Literal["stable"]
    revision: RevisionRow | None


class Pipeline(_Out):
    paused: bool
    changed: bool


#: What each error status means on this API (the body is always :class:`ErrorBody`).
ERRORS: dict[int, str] = {
    400: "The request does not fit the route: the body is not JSON (or is nested too deeply), a field "
         "or parameter has the wrong type or is out of bounds, or a reason is not one line of text.",
    401: "No valid bearer token (or no tokens are configured on this controller).",
    403: "The token's role is below the one this route needs.",
    404: "No such version was ever published to this controller, or no such path.",
    409: "The rules refuse the action now; the detail says why (its state, the promotion interval).",
    413: "The body is over 16 KiB.",
}


def route(ok: type[BaseModel], *errors: int, body: type[BaseModel] | None = None, body_required: bool = False,
          role: str | None = None) -> dict[str, Any]:
    """Keyword arguments for a route decorator: its 200 body, its errors, and the request body read
    by a dependency (``body``), which FastAPI would not describe."""
    responses: dict[int | str, Any] = {200: {"model": ok, "description": ok.__doc__ or "OK"}}
    for status in errors:
        responses[status] = {"model": ErrorBody, "description": ERRORS[status]}
    if 401 in errors:
        responses[401]["headers"] = {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}}
    out: dict[str, Any] = {"response_model": None, "responses": responses}
    if role is not None:
        out["description"] = f"Needs the {role} role (or a higher one)."
    if body is not None:
        out["openapi_extra"] = {"requestBody": {
            "required": body_required, "content": {"application/json": {"schema": body.model_json_schema()}}}}
    return out


def install(app: FastAPI) -> None:
    """Serve the schema built here (once, then cached) at the app's ``openapi_url``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build(app: FastAPI) -> dict[str, Any]:
    schema = base_schema(app, __doc__)
    components = schema.setdefault("components", {})
    components["securitySchemes"] = {BEARER: {
        "type": "http", "scheme": "bearer",
        "description": "A token from release.tokens (FLYWHEEL_RELEASE_TOKENS): `Authorization: Bearer <token>`.",
    }}
    for path, operations in schema["paths"].items():
        for op in operations.values():
            # the app answers a request that does not fit with 400 and ErrorBody (release/api.py
            # _errors), never FastAPI's 422 list
            op["responses"].pop("422", None)
            if path.startswith("/api/"):
                op["security"] = [{BEARER: []}]
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    return schema


__all__ = ["BEARER", "ErrorBody", "install", "route"]
