"""Every request's id, on its answer, its log lines and its span (flywheel/telemetry.py).

:class:`RequestIds` is the app's outermost middleware of its own. It takes the client's
``X-Request-Id`` when it is a safe one, else makes one; puts it in the request's context (every
line logged while the request is served carries it: flywheel/logs.py) and in ``scope["state"]``
(where the error handler that answers a crash finds it); answers with it in ``X-Request-Id``,
errors included; runs the request in its span when traces are on; and logs one line per API
request (method, path, status, seconds).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import Any

from starlette.datastructures import Headers

from flywheel.logs import REQUEST_ID
from flywheel.telemetry import HTTP_REQUEST_ID, Tracing, new_request_id, valid_request_id

log = logging.getLogger(__name__)

_HEADER = HTTP_REQUEST_ID.lower().encode("latin-1")


def scope_request_id(scope: Any) -> str | None:
    """The id :class:`RequestIds` gave the request of ``scope``."""
    return (scope.get("state") or {}).get("request_id")


class RequestIds:
    """ASGI middleware (plain ASGI: a streamed body passes through untouched)."""

    def __init__(self, app: Any, tracing: Tracing, routes: Collection[str]) -> None:
        # ``routes``: the paths spans and log lines name as they are; any other is "other", so a
        # client cannot make a span name (or a metric derived from it) per URL it invents
        self.app, self.tracing, self.routes = app, tracing, routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        rid = valid_request_id(headers.get(HTTP_REQUEST_ID)) or new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        path = scope.get("path", "")
        route = path if path in self.routes else "other"
        status = [500]

        async def stamped(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (_HEADER, rid.encode("ascii"))]}
            await send(message)

        token = REQUEST_ID.set(rid)
        start = time.perf_counter()
        try:
            with self.tracing.request_span(f"{scope.get('method', 'GET')} {route}", headers) as span:
                span.set_attribute("flywheel.request_id", rid)
                span.set_attribute("http.route", route)
                try:
                    await self.app(scope, receive, stamped)
                finally:
                    span.set_attribute("http.response.status_code", status[0])
        finally:
            if path.startswith("/v1/"):  # the API's requests, not the probes and scrapes
                log.info("%s %s %d in %.3f s", scope.get("method"), route, status[0], time.perf_counter() - start)
            REQUEST_ID.reset(token)
