"""The published API description: ``GET /openapi.json`` (OpenAPI 3.1; no ``/docs`` page).

The app reads request bodies itself (:func:`serving.protocol.parse`, for OpenAI-style errors), so
FastAPI cannot see them; this module puts them in: each body is the JSON schema of the pydantic
model that validates it, refused OpenAI parameters included with the only values they accept.
Responses are the models in :mod:`serving.protocol`, streamed ones as ``text/event-stream``
whose ``data:`` lines are the ``*Chunk`` schemas. This deployment's own bounds (the served model's
name, ``serve.max_n``, ``serve.max_tokens_limit``, the vocabulary for prompt token ids) are written
into the schema, so a client (or the fuzz test, ``tests/integration/test_serving_fuzz.py``) sees the
limits the server enforces; what no schema can say (a prompt's length in tokens against the
context) is still a 400. The product
routes (``/v1/*``) declare the bearer-key scheme; ``/health`` and ``/metrics`` need no key (without
one ``/health`` says only ``ok``). Every error is documented with what it means on that route, its
body (``ErrorResponse``, the shape every 4xx and 5xx has) and the headers it always carries
(``WWW-Authenticate`` on a 401, ``Retry-After`` on a 429 or 503); no route answers 422 (a body that
fails validation is a 400), so none is documented. Every answer carries ``X-Request-Id``
(serving/request_ids.py).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from flywheel.openapi import base_schema
from flywheel.settings import ServeSettings
from flywheel.telemetry import HTTP_REQUEST_ID
from serving.protocol import (
    ChatCompletionChunk,
    ChatRequest,
    CompletionChunk,
    CompletionRequest,
    ErrorResponse,
    FeedbackRequest,
)

BEARER = "bearerAuth"
_REF = "#/components/schemas/{model}"
_REQUESTS = (CompletionRequest, ChatRequest, FeedbackRequest)
_CHUNKS = (CompletionChunk, ChatCompletionChunk)


def body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body ``model`` validates."""
    ref = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def responses(ok: type[BaseModel], *errors: int, ok_status: int = 200,
              chunk: type[BaseModel] | None = None) -> dict[int | str, Any]:
    """FastAPI ``responses=``: ``ok`` as JSON (and, with ``chunk``, as an SSE stream) plus errors."""
    out: dict[int | str, Any] = {ok_status: {"model": ok}}
    if chunk is not None:
        out[ok_status]["content"] = {"text/event-stream": {"schema": _sse_event(chunk)}}
    for status in errors:
        out[status] = {"model": ErrorResponse, "description": _ERRORS.get(status, "Error")}
        if status in _HEADERS:
            out[status]["headers"] = {_HEADERS[status][0]: {"required": True, "schema": {"type": "string"},
                                                            "description": _HEADERS[status][1]}}
    return out


#: What each error status means on these routes; the body is always an ErrorResponse.
_ERRORS = {
    400: "The request is invalid: not JSON, a parameter out of range or not supported (``param`` names it)",
    401: "No product key, or not a valid one",
    403: "This key may not do that (pin a version: ``serve.pin_api_keys``)",
    404: "No such model, or that version is not loaded",
    409: "The feedback names another user than the one its generation was made for (``feedback_user_mismatch``)",
    413: "The body is larger than ``serve.max_body_bytes``",
    429: "The user's or the API key's rate limit: retry after ``Retry-After`` seconds",
    503: "Not recorded yet (the journal is full, or the broker slow): retry with the same ``feedback_id``",
}
#: Headers an error status always carries.
_HEADERS = {
    401: ("WWW-Authenticate", "``Bearer``: the scheme to authenticate with"),
    429: ("Retry-After", "Seconds until the limit allows a request again"),
    503: ("Retry-After", "Seconds to wait before sending the feedback again"),
}


def health_responses(model: Any) -> dict[int | str, Any]:
    """``GET /health``: ``model`` (the probe's body or, for a product key, the full state) with
    200 while every engine is alive and 503 when one is not. No ``security``: a probe sends no key."""
    return {200: {"model": model, "description": "Every engine is alive; the state in full for a product key"},
            503: {"model": model, "description": "An engine is dead"}}


def probe_responses(model: Any, ok: str, not_ok: str) -> dict[int | str, Any]:
    """``GET /livez`` and ``GET /readyz``: no ``security``, as ``/health``."""
    return {200: {"model": model, "description": ok}, 503: {"model": model, "description": not_ok}}


def _sse_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream (OpenAPI before 3.2 has ``schema`` describe each event):
    its ``data`` is a ``chunk`` as JSON, or ``[DONE]`` in the last event."""
    return {
        "type": "object", "required": ["data"],
        "description": f"With stream: true, each event's data is a {chunk.__name__}; the last is [DONE].",
        "properties": {
            "event": {"type": "string"},
            "data": {"anyOf": [
                {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"$ref": _REF.format(model=chunk.__name__)}},
                {"const": "[DONE]"},
            ]},
        },
    }


def install(app: FastAPI, serve: ServeSettings, vocab_size: int) -> None:
    """Serve the schema built here (once, then cached) at the app's ``openapi_url``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app, serve, vocab_size)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build(app: FastAPI, serve: ServeSettings, vocab_size: int) -> dict[str, Any]:
    schema = base_schema(app, __doc__)
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for model in _REQUESTS:
        _add(schemas, model, "validation")
    for model in _CHUNKS:
        _add(schemas, model, "serialization")
    for name in ("CompletionRequest", "ChatRequest"):
        _deployment_bounds(schemas[name]["properties"], serve, vocab_size)
    components["securitySchemes"] = {BEARER: {
        "type": "http", "scheme": "bearer",
        "description": "A product key (serve.api_keys, FLYWHEEL_API_KEYS): `Authorization: Bearer <key>`.",
    }}
    for path, operations in schema["paths"].items():
        for op in operations.values():
            if path.startswith("/v1/"):
                op["security"] = [{BEARER: []}]
            for answer in op.get("responses", {}).values():
                answer.setdefault("headers", {})[HTTP_REQUEST_ID] = _REQUEST_ID_HEADER
    return schema


#: On every answer (flywheel/telemetry.py): the request's own id when it sent a safe one.
_REQUEST_ID_HEADER = {
    "required": True, "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"},
    "description": "The request's id: the X-Request-Id it sent when that is at most 128 characters of "
                   "A-Z a-z 0-9 . _ : -, else a new one. Its records and log lines carry it."}


def _add(schemas: dict[str, Any], model: type[BaseModel], mode: Any) -> None:
    s = model.model_json_schema(ref_template=_REF, mode=mode)
    schemas.update(s.pop("$defs", {}))
    schemas[model.__name__] = s


def _deployment_bounds(props: dict[str, Any], serve: ServeSettings, vocab_size: int) -> None:
    """What this deployment accepts, beyond what the request models say for any deployment."""
    props["model"]["pattern"] = f"^{re.escape(serve.model_name)}(@v[0-9]+)?$"  # generate.pinned_version
    props["model"]["examples"] = [serve.model_name]
    for field in ("max_tokens", "max_completion_tokens", "min_tokens"):  # (min_tokens: at most max_tokens)
        if field in props:
            _maximum(props[field], serve.max_tokens_limit)
    _maximum(props["n"], serve.max_n)
    for field in ("prompt", "stop_token_ids"):
        for branch in props.get(field, {}).get("anyOf", []):
            if branch.get("type") == "array":  # token ids
                branch["items"] = {**branch.get("items", {}), "minimum": 0, "maximum": vocab_size - 1}


def _maximum(prop: dict[str, Any], limit: int) -> None:
    """Bound the integer branch of ``prop`` (``int`` or ``int | None``)."""
    for branch in [prop, *prop.get("anyOf", [])]:
        if branch.get("type") == "integer":
            branch["maximum"] = limit
