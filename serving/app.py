"""The serving API: an app factory over an engine and a recorder.

``create_app(settings, fleet, recorder, registry)`` builds the FastAPI app over the engines a
:class:`~serving.versions.Fleet` holds (``Fleet([engine])`` for one); nothing in it
reaches for globals, so tests and the demo construct it in-process and run it on a loopback port
(see :mod:`serving.server`), and ``flywheel serve`` (:mod:`serving.main`) does the same in
production.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (OpenAI wire format, SSE
streaming included), ``GET /v1/models``, ``POST /v1/feedback`` (202 once the event is durable),
``GET /livez`` and ``GET /readyz`` (the probes: serving/readiness.py), ``GET /health`` (for
people), ``GET /metrics``, and ``GET /openapi.json``, the schema of all of them
(:mod:`serving.openapi`; there is no ``/docs`` page). Product routes need
``Authorization: Bearer <key>``; generation routes are rate limited per user and per API key
(feedback is not: refusing it would bias the reward signal, and abuse is judged downstream by the
reward guards).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from flywheel.contracts import MAX_FEEDBACK_BODY_BYTES, FeedbackEvent, Topics
from flywheel.logs import REQUEST_ID
from flywheel.settings import Settings
from flywheel.telemetry import Tracing
from serving import generate as gen
from serving import openapi
from serving.engine import Engine
from serving.follow import ReleaseFollower
from serving.identity import (
    Owner,
    RateLimiter,
    RateLimits,
    bearer_key,
    key_allowed,
    owner_of,
    pseudonymise,
    raw_user,
    retry_after_header,
)
from serving.journal import JournalFull
from serving.protocol import (
    ApiError,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatRequest,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    FeedbackAccepted,
    FeedbackRequest,
    Health,
    HealthProbe,
    ModelList,
    ProbeAnswer,
    error_body,
    parse,
    validation_error,
)
from serving.readiness import Readiness
from serving.recorder import Recorder
from serving.request_ids import RequestIds, scope_request_id
from serving.usage import TokenCounters
from serving.versions import Fleet

log = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/feedback")


class AppMetrics:
    def __init__(self, registry: CollectorRegistry, *, key_ids: bool = False) -> None:
        self.requests = Counter("serving_requests_total", "API requests by route, model version and status",
                                ["route", "model_version", "status"], registry=registry)
        self.latency = Histogram("serving_request_latency_seconds", "Time to the full response (or stream end)",
                                 ["route", "model_version"], registry=registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.tokens = TokenCounters.register(registry, by_key=key_ids)  # serve.metrics_key_ids: serving/usage.py
        # whether this deployment has product users to protect: the signing alert
        # (FlywheelRecordsNotVerified) fires only where it does
        self.api_keys = Gauge("serving_api_keys_configured", "Product API keys serving accepts (0: none, an "
                              "anonymous deployment)", registry=registry)
        self.feedback = Counter("serving_feedback_total", "Feedback events accepted (202), by signal",
                                ["signal"], registry=registry)
        self.other_user = Counter("serving_feedback_other_user_total", "Feedback naming another user than the one "
                                  "its generation was made for, by what serving did (serve.feedback_other_user)",
                                  ["action"], registry=registry)
        for action in ("refused", "recorded"):
            self.other_user.labels(action)
        self.rate_limited = Counter("serving_rate_limited_total", "Requests refused with 429, by the bucket that was empty",
                                    ["scope"], registry=registry)
        for scope in ("user", "key"):
            self.rate_limited.labels(scope)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than ``limit`` bytes whatever Content-Length claimed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        # the client went away, or was cut for a body too slow (http.body_timeout_s): its fault,
        # counted as 408, not a 500 with a traceback (no one reads the answer either way)
        raise ApiError(408, "the request body did not arrive in time") from None
    return b"".join(chunks)


class Gate:
    """Authentication, user pseudonyms and the rate limit, from the serve settings."""

    def __init__(self, settings: Settings, metrics: AppMetrics) -> None:
        s = settings.serve
        if not s.api_keys and not s.allow_anonymous:
            raise ValueError("serve.api_keys is empty: set FLYWHEEL_API_KEYS, or serve.allow_anonymous=true "
                             "for a deliberate unauthenticated deployment")
        self.serve = s
        self.limits = RateLimits(RateLimiter(s.rate_limit_per_minute, s.rate_limit_burst),
                                 RateLimiter(s.rate_limit_key_per_minute, s.rate_limit_key_burst))
        self.metrics = metrics

    def key(self, request: Request) -> str | None:
        key = bearer_key(request.headers.get("authorization"))
        if not key_allowed(key, self.serve.api_keys, self.serve.allow_anonymous):
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": 'Bearer realm="flywheel"'})  # RFC 9110: a 401 names its scheme
        return key

    def sees_details(self, request: Request) -> bool:
        """Whether the caller holds a product key (or the deployment has none): hosts, store URIs
        and errors are for such callers only, never for whoever can reach the port."""
        key = bearer_key(request.headers.get("authorization"))
        return key_allowed(key, self.serve.api_keys, self.serve.allow_anonymous)

    def user(self, request: Request, key: str | None, body_user: str | None) -> str:
        raw = raw_user(body_user, request.headers.get("x-flywheel-user"), key)
        return pseudonymise(self.serve.user_id_salt, raw)

    def rater(self, request: Request, body: FeedbackRequest) -> tuple[str | None, bool]:
        """Who sends ``body`` (a pseudonym, or None: the generation's own user), and whether that
        is another user than the one the generation was made for (serving/identity.py ``owner_of``)."""
        named = body.user or request.headers.get("x-flywheel-user")
        if not named:  # no user named: the answer's own user's, whoever the key would stand for
            return None, False
        user_id = pseudonymise(self.serve.user_id_salt, named)
        owner = owner_of(self.serve.user_id_salt, body.generation_id, user_id)
        if owner is Owner.UNKNOWN:
            # an id serving did not tag (made before tags, or not by serving): whose it is cannot be
            # told, so the feedback counts as the generation's user's, as with no user named, and
            # the user it named is not recorded: recorded, it would rate someone else's answer
            return None, False
        return user_id, owner is Owner.OTHER

    def limit(self, user_id: str, key: str | None) -> None:
        refused = self.limits.take(user_id, key)
        if refused is not None:
            self.metrics.rate_limited.labels(refused.scope).inc()
            who = "this user of this API key" if refused.scope == "user" else "this API key"
            raise ApiError(429, f"rate limit exceeded for {who}; retry in {refused.wait_s:.1f}s",
                           type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": retry_after_header(refused.wait_s)})


def create_app(settings: Settings, fleet: Fleet | Engine, recorder: Recorder, registry: CollectorRegistry,
               follower: ReleaseFollower | None = None, readiness: Readiness | None = None,
               tracing: Tracing | None = None) -> FastAPI:
    """The app over ``fleet`` (or one engine); ``follower`` adds the release state to ``/health``.
    ``readiness`` is what ``/readyz`` reads (``flywheel serve`` warms the engines up before it
    says ready); without one the app is ready while its engines live. ``tracing``: the process's
    spans (default: made from ``settings.telemetry``; the caller shuts it down, ``app.state.tracing``)."""
    metrics = AppMetrics(registry, key_ids=settings.serve.metrics_key_ids)
    metrics.api_keys.set(len(settings.serve.api_keys))
    readiness = readiness if readiness is not None else Readiness(
        warm=True, routing=follower.routing if follower is not None else None)
    gate = Gate(settings, metrics)
    if not isinstance(fleet, Fleet):
        fleet = Fleet([fleet], registry)
    tracing = tracing if tracing is not None else Tracing(settings.telemetry, "serving")
    ctx = gen.Ctx(settings.serve, fleet, recorder, Topics(settings.topic_prefix), metrics.tokens, tracing)
    app = FastAPI(title="flywheel serving", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.tracing = tracing
    app.add_middleware(Observe, metrics=metrics, default_version=lambda: str(fleet.version_of("stable")))
    # added last: outside Observe, so every answer but a crash's (the handler below) is stamped
    app.add_middleware(RequestIds, tracing=tracing,
                       routes=(*ROUTES, "/livez", "/readyz", "/health", "/metrics", "/openapi.json"))
    _errors(app)
    openapi.install(app, settings.serve, len(fleet.tokenizer))
    # Tokenizing (chat template and encode) takes over a second for a 1 MiB prompt: on the event
    # loop it stalled every request, /health included. One thread, as vLLM's own server does
    # (renderer_num_workers=1): the tokenizer is not shared across threads, and the encoder
    # releases the GIL while it works.
    tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="serving-tokenize")

    async def generation(request: Request, cls: type, prepare: Any) -> Response:
        key = gate.key(request)
        body = parse(cls, await read_body(request, settings.serve.max_body_bytes))
        user_id = gate.user(request, key, body.end_user())
        gate.limit(user_id, key)
        prep = await asyncio.get_running_loop().run_in_executor(tokenize, prepare, ctx, body, user_id)
        prep = gen.routed(ctx, prep, body.model, key)
        request.scope.setdefault("state", {})["model_version"] = str(prep.version)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(gen.stream_sse(ctx, prep, include_usage),
                                     media_type="text/event-stream")
        choices = await gen.run_all(ctx, prep)
        return JSONResponse(gen.response_body(ctx, prep, choices))

    @app.post("/v1/completions", openapi_extra=openapi.body(CompletionRequest),
              responses=openapi.responses(CompletionResponse, 400, 401, 403, 404, 413, 429, chunk=CompletionChunk))
    async def completions(request: Request) -> Response:
        return await generation(request, CompletionRequest, gen.prepare_completion)

    @app.post("/v1/chat/completions", openapi_extra=openapi.body(ChatRequest),
              responses=openapi.responses(ChatCompletionResponse, 400, 401, 403, 404, 413, 429,
                                          chunk=ChatCompletionChunk))
    async def chat(request: Request) -> Response:
        return await generation(request, ChatRequest, gen.prepare_chat)

    @app.get("/v1/models", responses=openapi.responses(ModelList, 401))
    async def models(request: Request) -> Response:
        key = gate.key(request)
        name, versions = settings.serve.model_name, fleet.served_versions()
        if not ctx.sees_versions(key):  # the deployment alone: which versions run would tell a canary runs
            return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                                             "owned_by": "flywheel"}]})
        # the deployment (routed by user), then each loaded version a request may pin
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "flywheel",
                 "version": versions["stable"], "root": ctx.model_id(versions["stable"])}]
        data += [{"id": ctx.model_id(v), "object": "model", "created": 0, "owned_by": "flywheel",
                  "version": v, "route": r, "root": ctx.model_id(v), "parent": name} for r, v in versions.items()]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/feedback", status_code=202, openapi_extra=openapi.body(FeedbackRequest),
              responses=openapi.responses(FeedbackAccepted, 400, 401, 409, 413, 503, ok_status=202))
    async def feedback(request: Request) -> Response:
        gate.key(request)
        limit = min(settings.serve.max_body_bytes, MAX_FEEDBACK_BODY_BYTES)
        body = parse(FeedbackRequest, await read_body(request, limit))
        rater, other = gate.rater(request, body)
        if other and settings.serve.feedback_other_user == "refuse":
            metrics.other_user.labels("refused").inc()
            # the users are not named: a pseudonym would tell the caller whose answer it was
            raise ApiError(409, f"generation {body.generation_id!r} was made for another user than the one this "
                           "feedback names; feedback belongs to the answer's user: send it as that user, or "
                           "name no user", "user", code="feedback_user_mismatch")
        if other:
            metrics.other_user.labels("recorded").inc()
        return await _accept_feedback(ctx, body, rater, other, metrics)

    @app.get("/livez", responses=openapi.probe_responses(
        ProbeAnswer, "Every engine is alive", "An engine is dead: restart the process"))
    async def livez() -> Response:
        # answered on the event loop that runs the engines' output handlers: a loop that no
        # longer turns does not answer at all, which the probe counts as a failure too
        if fleet.healthy():
            return JSONResponse({"ok": True})
        return JSONResponse({"ok": False, "reason": "an engine is dead"}, status_code=503)

    @app.get("/readyz", responses=openapi.probe_responses(
        ProbeAnswer, "Takes traffic: every engine is alive and has answered its warm-up",
        "Warming up, waiting for a routing (serve.routing_wait_s), draining on SIGTERM, or an engine is dead"))
    async def readyz() -> Response:
        not_ready = readiness.check(fleet)
        if not_ready is None:
            return JSONResponse({"ok": True})
        return JSONResponse({"ok": False, "reason": not_ready.value}, status_code=503)

    @app.get("/health", responses=openapi.health_responses(Health | HealthProbe))
    async def health(request: Request) -> Response:
        ok = fleet.healthy()
        # a probe (no key) gets nothing it does not need; a product key that does not see versions
        # gets no more: the versions and the release state would tell it a canary runs
        if not gate.sees_details(request) or not ctx.sees_versions(bearer_key(request.headers.get("authorization"))):
            return JSONResponse({"ok": ok}, status_code=200 if ok else 503)
        versions = fleet.served_versions()
        state: dict[str, Any] = {
            "ok": ok, "engine": "ok" if ok else "dead", "model": ctx.model_id(versions["stable"]),
            "versions": versions, "engines": [{"slot": s.index, "version": s.version, "in_flight": s.in_flight,
                                               "loading": s.loading} for s in fleet.slots],
            **recorder.state()}
        if follower is not None:
            state["releases"] = follower.state()
        return JSONResponse(state, status_code=200 if ok else 503)

    if settings.serve.metrics_port is None:  # else on its own port (serving/main.py): 404 here
        @app.get("/metrics", response_class=PlainTextResponse,
                 responses={200: {"description": "Prometheus text format"}})
        async def prometheus() -> Response:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


class Observe:
    """ASGI middleware: count ``/v1/*`` requests by status and time them to the last body byte
    (so a streamed response is timed to its end). Plain ASGI, not ``BaseHTTPMiddleware``, which
    would re-wrap every streamed chunk."""

    def __init__(self, app: Any, metrics: AppMetrics, default_version: Any) -> None:
        # a generation names the version it ran on in the request's state; other routes count
        # under the stable version
        self.app, self.metrics, self.default_version = app, metrics, default_version

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        route = path if path in ROUTES else "other"  # bounded label values
        start, status = time.perf_counter(), [500]
        state = scope.setdefault("state", {})

        def version() -> str:
            return state.get("model_version") or self.default_version()

        async def watch(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            last = message["type"] == "http.response.body" and not message.get("more_body", False)
            if last and status[0] < 400:
                self.metrics.latency.labels(route, version()).observe(time.perf_counter() - start)

        try:
            await self.app(scope, receive, watch)
        finally:
            self.metrics.requests.labels(route, version(), str(status[0])).inc()


async def _accept_feedback(ctx: gen.Ctx, body: FeedbackRequest, user_id: str | None, other_user: bool,
                           metrics: AppMetrics) -> Response:
    received = time.time()
    event = FeedbackEvent(
        feedback_id=body.feedback_id, generation_id=body.generation_id, signal=body.signal,
        edited_text=body.edited_text, decision_ms=body.decision_ms, user_id=user_id,
        created_at=received if body.created_at is None else min(body.created_at, received),
        received_at=received, other_user=other_user,
    )
    durable = ctx.recorder.record_feedback(ctx.topics.feedback, event,
                                           ctx.tracing.record_headers("feedback", REQUEST_ID.get()))
    # the intake thread answers within about one ack timeout plus an fsync; wait a bit beyond it
    wait_s = ctx.recorder.ack_timeout_s * 3 + 5
    try:
        # shield: a timed-out wait must not cancel the future the publisher thread will resolve
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(durable)), timeout=wait_s)
    except JournalFull as exc:
        raise ApiError(503, f"feedback not recorded: {exc}; retry later with the same feedback_id",
                       type="server_error", code="journal_full", headers={"Retry-After": "5"}) from None
    except TimeoutError:
        raise ApiError(503, "feedback not yet durable; retry with the same feedback_id (duplicates are dropped)",
                       type="server_error", code="not_durable", headers={"Retry-After": "1"}) from None
    metrics.feedback.labels(body.signal).inc()
    return JSONResponse({"id": body.feedback_id, "object": "feedback", "status": "accepted",
                         "generation_id": body.generation_id}, status_code=202)


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        err = validation_error(list(exc.errors()))
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> Response:
        # an engine or server fault, not the client's: say so without leaking internals. Answered
        # outside the middleware (Starlette's outermost layer), so the request id is put on here.
        rid = scope_request_id(request.scope)
        log.error("request failed: %s", type(exc).__name__, exc_info=exc, extra={"request_id": rid})
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", type="server_error"),
                            status_code=500, headers={"X-Request-Id": rid} if rid else None)
