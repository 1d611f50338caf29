"""The release controller's REST API: what the console, the CLI (``flywheel release ...``) and
people's tools read and do.

``make_app(store, settings, status)`` builds the FastAPI app; ``flywheel release serve``
(release/main.py) runs it next to the controller loop, and tests run it on a loopback port.

Routes and the least role each needs (release/auth.py; a higher role may do what a lower may):

=======  ===================================  ========  =============================================
method   path                                 role      what
=======  ===================================  ========  =============================================
GET      /api/status                          viewer    stable, live canary, pause, revision, lease,
                                                        and the controller's own ``status()``
GET      /api/candidates                      viewer    every candidate with verdict summaries
GET      /api/candidates/{version}            viewer    one, with gate, live analysis and audit
POST     /api/candidates/{version}/approve    approver  promote it (``{"reason"}`` optional)
POST     /api/candidates/{version}/reject     approver  turn it down (``{"reason"}`` optional)
POST     /api/rollback                        approver  end the live canary (``{"reason", "version"}``)
POST     /api/undo                            approver  stable back to an earlier promoted version
                                                        (``{"to", "reason"}``), verified again first
POST     /api/pause                           admin     stop starting gates and canaries (``{"reason"}``)
POST     /api/resume                          admin     start them again (``{"reason"}``)
GET      /api/audit?version=&limit=           viewer    the audit log, newest first
GET      /livez, /readyz, /health             none      probes (liveness, readiness) and people's check
GET      /metrics, /openapi.json              none      Prometheus and the schema
=======  ===================================  ========  =============================================

Every error is ``{"detail": "<a sentence for a person>"}``: 401 (with ``WWW-Authenticate:
Bearer``) without a valid token, 403 naming the role needed, 404 for a candidate never seen, 409 for
an action the rules refuse now (an unknown, superseded or decided version, a promotion inside
``release.promotion_interval_s``: release/actions.py says why), 413 for a body over 16 KiB, and
400 for a request that does not fit the route: a body that is not JSON (or is nested too deeply to
parse: flywheel/jsonbody.py), a field of the wrong type or out of bounds, a reason that is not one
line of plain text (flywheel/terminal.py), a path or query parameter that is not a version or a
limit; the message names what is wrong (400, not FastAPI's 422, as serving's API answers). The
token is checked before the body is read, so a caller without one learns nothing about what the
route expects. While the database refuses (not answering, read-only after a failover, full) the
answer is 503 with ``Retry-After``, naming the error's code and kind (flywheel/dberrors.py), not a
500: the store replaces a connection the error made useless, and the same call works again once
the database does.

``/openapi.json`` describes exactly this (release/openapi.py): each route's body and answers, the
bearer scheme, and no 422; tests/integration/test_release_fuzz.py holds the app to it.

The store is used by one request at a time (a lock): SQLite and psycopg connections must not run
two transactions at once. Give the app a :class:`ReleaseStore` of its own, not the controller
loop's, so the two never share a connection.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from flywheel.dberrors import Bug, classify
from flywheel.jsonbody import BodyError, load_body
from flywheel.metrics import new_registry
from flywheel.probes import HealthFn
from flywheel.settings import ReleaseSettings
from flywheel.terminal import ONE_LINE, check_one_line
from release import actions
from release.actions import ActionRefused
from release.auth import STATE_KEY, Role, parse_tokens, require
from release.decisions import DecisionCounter
from release.metrics import StoreCollector
from release.openapi import (
    AuditList,
    CandidateDetail,
    CandidateList,
    Health,
    Pipeline,
    Promoted,
    Rejected,
    RolledBack,
    Status,
    Undone,
    route,
)
from release.openapi import install as install_openapi
from release.store import AuditEntry, Candidate, ReleaseStore, Revision

log = logging.getLogger(__name__)

#: Longest reason a person may give (the audit log keeps it whole; routing reasons are cut there too).
MAX_REASON_CHARS = 2000
#: Largest request body read: a reason and a version fit many times over.
MAX_BODY_BYTES = 16 * 1024
#: Versions are BIGINT in the store; a larger number would fail in the database, not here.
MAX_VERSION = 2**63 - 1

Version = Annotated[int, Path(ge=0, le=MAX_VERSION, description="a published checkpoint version")]
Viewer = Annotated[str, Depends(require(Role.VIEWER))]
Approver = Annotated[str, Depends(require(Role.APPROVER))]
Admin = Annotated[str, Depends(require(Role.ADMIN))]


# -- request bodies (client -> release API) -----------------------------------------------------

#: A reason: one line of text (flywheel/terminal.py). Line breaks, C1 and bidirectional controls
#: forged rows of the audit log in a terminal, and PostgreSQL refuses NUL in text. The check is a
#: validator, for a message naming the character; the schema publishes the same set as a pattern.
Reason = Annotated[str, AfterValidator(check_one_line), Field(json_schema_extra={"pattern": ONE_LINE})]


class ReasonBody(BaseModel):
    """Body of approve and reject: why, for the audit log (optional)."""

    # forbid: a misspelt field ("reson") would otherwise be dropped and the action logged without it;
    # strict: "3", true or 3.0 is no version (lax mode took them as 3, 1 and 3)
    model_config = ConfigDict(extra="forbid", strict=True, str_strip_whitespace=True)
    reason: Reason | None = Field(default=None, max_length=MAX_REASON_CHARS)


class RollbackBody(ReasonBody):
    """Body of rollback; ``version`` makes it refuse unless that version is the live canary (so a
    person rolls back the canary they looked at, not one that started since)."""

    version: int | None = Field(default=None, ge=0, le=MAX_VERSION)


class UndoBody(ReasonBody):
    """Body of undo: the earlier promoted version stable goes back to."""

    to: int = Field(ge=0, le=MAX_VERSION)


class RequiredReasonBody(BaseModel):
    """Body of pause and resume: an admin says why the pipeline stops or starts."""

    model_config = ConfigDict(extra="forbid", strict=True, str_strip_whitespace=True)
    reason: Reason = Field(min_length=1, max_length=MAX_REASON_CHARS)


B = TypeVar("B", bound=BaseModel)


def _body(model: type[B]) -> Callable[[Request], Awaitable[B]]:
    """A dependency reading the JSON body into ``model``. Declared after the role dependency, so it
    runs only for a caller with a valid token (FastAPI solves dependencies in declaration order;
    a body parameter would be parsed before any of them)."""

    async def read(request: Request) -> B:
        raw = await _read_capped(request)
        try:
            data = load_body(raw) if raw.strip() else {}
        except BodyError as exc:  # not JSON, nested too deeply to parse, or a lone surrogate
            raise HTTPException(400, str(exc)) from None
        if not isinstance(data, dict):
            raise HTTPException(400, "the body must be a JSON object, e.g. {\"reason\": \"...\"}")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise HTTPException(400, _explain(exc.errors())) from None

    return read


async def _read_capped(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise HTTPException(413, f"the body is over {MAX_BODY_BYTES} bytes")
    raw = bytearray()
    try:
        async for chunk in request.stream():  # chunked bodies carry no length: count as they come
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise HTTPException(413, f"the body is over {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:
        # the caller went away, or was cut for a body too slow (http.body_timeout_s): a 408 in the
        # request counter, not a 500 with a traceback
        raise HTTPException(408, "the body did not arrive in time") from None
    return bytes(raw)


def _explain(errors: Any) -> str:
    """Pydantic's errors as one sentence: ``reason: String should have at most 2000 characters``."""
    parts = []
    for err in errors:
        loc = list(err.get("loc", ()))
        if loc and loc[0] in ("body", "path", "query", "header"):
            loc = loc[1:]  # the caller knows where they put it; the name is what matters
        where = ".".join(str(p) for p in loc)
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")  # a validator's own sentence
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request"


# -- responses (release API -> client) ----------------------------------------------------------

def verdict_summary(result: dict[str, Any] | None) -> dict[str, Any] | None:
    """A gate result or live analysis cut to its verdict: ``{"outcome", "reason"}`` (the first
    reason). Both are saved by the controller as a :class:`release.judge.Verdict`'s ``outcome`` and
    ``reasons`` next to their measurements; anything else yields None fields, never an error."""
    if not result:
        return None
    reasons = result.get("reasons")
    first = reasons[0] if isinstance(reasons, list | tuple) and reasons else result.get("reason")
    return {"outcome": result.get("outcome", result.get("verdict")), "reason": first}


def candidate_row(c: Candidate) -> dict[str, Any]:
    return {"version": c.version, "parent": c.parent, "state": c.state.value,
            "created_at": c.created_at, "updated_at": c.updated_at, "step": c.checkpoint.get("step"),
            "gate_summary": verdict_summary(c.gate), "analysis_summary": verdict_summary(c.analysis)}


def candidate_detail(c: Candidate, store: ReleaseStore) -> dict[str, Any]:
    return {**candidate_row(c), "uri": c.uri, "manifest_sha256": c.manifest_sha256,
            "checkpoint": c.checkpoint, "gate": c.gate,
            # the tally is the controller's working state (every id it has measured): not for people
            "analysis": {k: v for k, v in c.analysis.items() if k != "tally"} if c.analysis else None,
            "audit": [asdict(a) for a in store.audit(version=c.version)]}


def status_body(store: ReleaseStore, settings: ReleaseSettings,
                status: Callable[[], dict[str, Any]] | None) -> dict[str, Any]:
    now = time.time()
    rev = store.latest_revision()
    lease = store.lease_holder()
    last = store.last_promotion_at()
    counts: dict[str, int] = {}
    for c in store.candidates():
        counts[c.state.value] = counts.get(c.state.value, 0) + 1
    return {
        "time": now,  # the server's clock, so a console can show ages without trusting its own
        "stable_version": rev.stable_version if rev else 0,
        "canary": _canary(store, rev),
        "paused": store.paused(),
        "revision": asdict(rev) if rev else None,
        "lease": {"holder": lease[0], "expires_at": lease[1], "live": lease[1] > now} if lease else None,
        "last_promotion_at": last,
        "next_promotion_at": last + settings.promotion_interval_s if last is not None else None,
        "promotion_interval_s": settings.promotion_interval_s,
        "auto_promote": settings.auto_promote,
        "candidates": counts,
        "controller": _controller(status),
    }


def _canary(store: ReleaseStore, rev: Revision | None) -> dict[str, Any] | None:
    """The newest routing's canary, with what its analysis says of who counts: the users reward's
    guards flagged and the comparison left out, and the level its PASS is tested at (None until
    an analysis says)."""
    if rev is None or rev.canary_version is None:
        return None
    cand = store.get(rev.canary_version)
    analysis = (cand.analysis if cand else None) or {}
    return {"version": rev.canary_version, "share": rev.canary_share,
            "excluded_users": analysis.get("excluded_users"), "pass_alpha": analysis.get("pass_alpha")}


def _controller(status: Callable[[], dict[str, Any]] | None) -> dict[str, Any] | None:
    """The controller's own report; a failing report is shown as one, not as a 500 that would
    also hide everything the database knows."""
    if status is None:
        return None
    try:
        return dict(status())
    except Exception as exc:  # any failure of the callback is reported (and logged), not raised
        log.exception("the controller's status() failed")
        return {"ok": False, "error": f"status() failed: {type(exc).__name__}: {exc}"}


# -- the app ------------------------------------------------------------------------------------

class ApiMetrics:
    """``release_api_*`` on the app's own registry (``app.state.registry``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("release_api_requests_total", "Requests to the release API by route template and status",
                                ["route", "method", "status"], registry=registry)
        self.actions = Counter("release_api_actions_total",
                               "Actions asked of the release API, by outcome (done, noop, refused)",
                               ["action", "outcome"], registry=registry)


def make_app(store: ReleaseStore, settings: ReleaseSettings,
             status: Callable[[], dict[str, Any]] | None = None,
             registry: CollectorRegistry | None = None, live: HealthFn | None = None,
             verify: Callable[[Candidate], None] | None = None,
             notify: Sequence[Callable[[AuditEntry], None]] = ()) -> FastAPI:
    """The API over ``store`` (module docstring). ``status``, when given, is the controller loop's
    health report, shown under ``controller`` in ``/api/status``; ``/health`` says only whether it
    is ``ok``. ``registry``, when given, is the process's registry, so ``/metrics`` shows the
    controller's own metrics (its dead letters) beside the API's. ``live``, when given, is the
    controller loop's liveness (``/livez``; without it ``/livez`` says only that the API answers).
    ``verify`` checks a version against its manifest before ``/api/undo`` routes users back to it
    (the controller's :meth:`~release.controller.Controller.verify`; without it undo is refused).
    ``notify`` are audit listeners for the decisions people make here (release/webhooks.py); the
    decisions are counted on ``registry`` (``app.state.decisions``, which the process hands to the
    controller loop's store as well), and the database's gauges are read at each scrape. Raises
    :class:`~flywheel.settings.SettingsError` for malformed ``settings.tokens``."""
    app = FastAPI(title="flywheel release controller", docs_url=None, redoc_url=None)
    setattr(app.state, STATE_KEY, parse_tokens(settings.tokens))
    app.state.registry = registry = registry if registry is not None else new_registry()
    metrics = ApiMetrics(registry)
    app.add_middleware(CountRequests, metrics=metrics)
    _errors(app, store.db.errors)
    lock = threading.Lock()
    app.state.decisions = DecisionCounter(registry)
    store.listeners.extend((app.state.decisions, *notify))
    registry.register(StoreCollector(store, lock))
    _read_routes(app, store, settings, status, lock)
    _action_routes(app, store, settings, metrics, lock)
    _undo_route(app, store, metrics, lock, verify)
    _ops_routes(app, store, registry, status, lock, live)
    _console(app)
    install_openapi(app)
    return app


def _read_routes(app: FastAPI, store: ReleaseStore, settings: ReleaseSettings,
                 status: Callable[[], dict[str, Any]] | None, lock: threading.Lock) -> None:
    # plain ``def`` handlers: FastAPI runs them on its thread pool, so a slow database blocks a
    # worker thread and never the event loop that answers /health
    @app.get("/api/status", **route(Status, 401, role="viewer"))
    def get_status(_: Viewer) -> dict[str, Any]:
        with lock:
            return status_body(store, settings, status)

    @app.get("/api/candidates", **route(CandidateList, 401, role="viewer"))
    def list_candidates(_: Viewer) -> dict[str, Any]:
        with lock:
            return {"candidates": [candidate_row(c) for c in store.candidates()]}

    @app.get("/api/candidates/{version}", **route(CandidateDetail, 400, 401, 404, role="viewer"))
    def show_candidate(_: Viewer, version: Version) -> dict[str, Any]:
        with lock:
            cand = store.get(version)
            if cand is None:
                raise HTTPException(404, f"no version {version} was ever published to this controller")
            return candidate_detail(cand, store)

    @app.get("/api/audit", **route(AuditList, 400, 401, role="viewer"))
    def audit(_: Viewer, version: Annotated[int | None, Query(ge=0, le=MAX_VERSION)] = None,
              limit: Annotated[int, Query(ge=1, le=1000)] = 200) -> dict[str, Any]:
        with lock:
            return {"entries": [asdict(a) for a in store.audit(version=version, limit=limit)]}


def _action_routes(app: FastAPI, store: ReleaseStore, settings: ReleaseSettings,
                   metrics: ApiMetrics, lock: threading.Lock) -> None:
    @contextmanager
    def acting(action: str, actor: str, version: int | None) -> Iterator[None]:
        """One action at a time; a refusal is counted and written to the audit log (who tried
        what, and why not), then answered as 409."""
        with lock:
            try:
                yield
            except ActionRefused as exc:
                metrics.actions.labels(action, "refused").inc()
                store.note(version, actor, f"{action} refused: {exc}")
                raise
        metrics.actions.labels(action, "done").inc()

    @app.post("/api/candidates/{version}/approve",
              **route(Promoted, 400, 401, 403, 404, 409, 413, body=ReasonBody, role="approver"))
    def approve(actor: Approver, version: Version,
                body: Annotated[ReasonBody, Depends(_body(ReasonBody))]) -> dict[str, Any]:
        with acting("approve", actor, version):
            cand = store.get(version)
            evidence = ({"gate": verdict_summary(cand.gate), "analysis": verdict_summary(cand.analysis)}
                        if cand else None)  # what the approver saw, kept with the decision
            actions.promote(store, version, actor, body.reason or "approved (no reason given)",
                            settings.promotion_interval_s, evidence)
            rev = store.latest_revision()
        return {"version": version, "state": "promoted", "revision": asdict(rev) if rev else None}

    @app.post("/api/candidates/{version}/reject",
              **route(Rejected, 400, 401, 403, 404, 409, 413, body=ReasonBody, role="approver"))
    def reject(actor: Approver, version: Version,
               body: Annotated[ReasonBody, Depends(_body(ReasonBody))]) -> dict[str, Any]:
        with acting("reject", actor, version):
            actions.reject(store, version, actor, body.reason or "rejected (no reason given)")
        return {"version": version, "state": "rejected"}

    @app.post("/api/rollback", **route(RolledBack, 400, 401, 403, 409, 413, body=RollbackBody, role="approver"))
    def rollback(actor: Approver, body: Annotated[RollbackBody, Depends(_body(RollbackBody))]) -> dict[str, Any]:
        with acting("rollback", actor, body.version):
            version = actions.rollback(store, actor, body.reason or "rolled back (no reason given)",
                                       version=body.version)
            rev, cand = store.latest_revision(), store.get(version)
        # rolled_back, or the decided state of a version only its stray routing was taken from
        return {"version": version, "state": cand.state.value if cand else "rolled_back",
                "revision": asdict(rev) if rev else None}

    def pipeline(action: str, paused: bool, actor: str, reason: str) -> dict[str, Any]:
        with lock:
            changed = (actions.pause if paused else actions.resume)(store, actor, reason)
        metrics.actions.labels(action, "done" if changed else "noop").inc()
        return {"paused": paused, "changed": changed}

    @app.post("/api/pause", **route(Pipeline, 400, 401, 403, 413, body=RequiredReasonBody, body_required=True,
                                    role="admin"))
    def pause(actor: Admin, body: Annotated[RequiredReasonBody, Depends(_body(RequiredReasonBody))]) -> dict[str, Any]:
        return pipeline("pause", True, actor, body.reason)

    @app.post("/api/resume", **route(Pipeline, 400, 401, 403, 413, body=RequiredReasonBody, body_required=True,
                                     role="admin"))
    def resume(actor: Admin, body: Annotated[RequiredReasonBody, Depends(_body(RequiredReasonBody))]) -> dict[str, Any]:
        return pipeline("resume", False, actor, body.reason)


def _undo_route(app: FastAPI, store: ReleaseStore, metrics: ApiMetrics, lock: threading.Lock,
                verify: Callable[[Candidate], None] | None) -> None:
    @app.post("/api/undo", **route(Undone, 400, 401, 403, 409, 413, body=UndoBody, body_required=True,
                                   role="approver"))
    def undo(actor: Approver, body: Annotated[UndoBody, Depends(_body(UndoBody))]) -> dict[str, Any]:
        """Stable back to ``to``, a version promoted before (Argo Rollouts' ``undo``). The version
        is rebuilt from the checkpoint store and checked against its manifest first, outside the
        lock (seconds to minutes on a large model); serving checks it again as it loads it."""
        try:
            with lock:
                cand = actions.undo_target(store, body.to)
            if verify is None:
                raise ActionRefused("this API was started without the checkpoint store: it cannot verify a version")
            try:
                verify(cand)
            except Exception as exc:  # noqa: BLE001 - any failure to rebuild or verify refuses the undo
                # whole here, for the operator; approvers get it without the server's paths
                log.warning("undo to version %d refused by %s: verification failed: %s: %s", body.to, actor,
                            type(exc).__name__, exc)
                raise actions.verification_refused(body.to, exc) from None
            with lock:
                rev = actions.undo(store, body.to, actor, body.reason or "undo (no reason given)")
        except ActionRefused as exc:
            metrics.actions.labels("undo", "refused").inc()
            with lock:
                store.note(body.to if store.get(body.to) else None, actor, f"undo refused: {exc}")
            raise
        metrics.actions.labels("undo", "done").inc()
        return {"version": body.to, "state": "stable", "revision": asdict(rev)}


def _ops_routes(app: FastAPI, store: ReleaseStore, registry: CollectorRegistry,
                status: Callable[[], dict[str, Any]] | None, lock: threading.Lock,
                live: HealthFn | None) -> None:
    @app.get("/livez", response_model=None, responses={
        200: {"model": Health, "description": "The API answers and the controller loop turns."},
        503: {"model": Health, "description": "The controller loop has not started or finished a turn for "
                                              "probes.hung_s: restart the process."}})
    def livez() -> Response:
        """Liveness: 200 ``{"ok": true}`` while the controller loop is not hung (a gate or a
        canary turn in progress is not hung), else 503. The database is not asked: a database
        that does not answer makes the process unready (``/readyz``), and a restart would not
        bring it back."""
        ok = live is None or live()[0]
        return JSONResponse({"ok": ok}, status_code=200 if ok else 503)

    @app.get("/readyz", response_model=None, responses={
        200: {"model": Health, "description": "Ready: the database answers."},
        503: {"model": Health, "description": "The database does not answer, or the controller is not ok."}})
    def readyz() -> Response:
        """Readiness: as ``/health`` (the console and the API can serve a person)."""
        return health()

    @app.get("/health", response_model=None, responses={
        200: {"model": Health, "description": "Healthy."},
        503: {"model": Health, "description": "The database does not answer, or the controller is not ok."}})
    def health() -> Response:
        """200 ``{"ok": true}`` while the database answers (and the controller, when it reports
        ``ok``, says so), else 503 ``{"ok": false}``. Nothing more, token or not: a probe needs
        no hostname, lease holder or error text (which named database URLs); a viewer reads them
        in ``/api/status``. Both replicas of a deployment answer 200: the one without the lease
        serves the API and the console, and stands by."""
        try:
            with lock:
                store.paused()
            ok = True
        except Exception:  # any database failure makes the process unhealthy; the log says which
            log.warning("/health: the database did not answer", exc_info=True)
            ok = False
        controller = _controller(status)
        ok = ok and (controller is None or controller.get("ok", True) is not False)
        return JSONResponse({"ok": ok}, status_code=200 if ok else 503)

    @app.get("/metrics", response_model=None, responses={
        200: {"description": "Prometheus' text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    def prometheus() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _console(app: FastAPI) -> None:
    """Mount the web console (release/console.py) when it is installed; the API works without it."""
    try:
        from release import console
    except ModuleNotFoundError as exc:
        if exc.name != "release.console":
            raise  # the console exists but something it imports does not: that is a bug to see
        log.info("release/console.py is absent: serving the API without the web console")
        return
    app.include_router(console.router)


def _errors(app: FastAPI, db_errors: tuple[type[BaseException], ...]) -> None:
    """Every error as ``{"detail": "<sentence>"}`` (module docstring)."""

    async def database_failed(_: Request, exc: Exception) -> Response:
        # the database's state for now, not the caller's fault nor a bug: said as such, with the
        # code an operator looks up (dashboards/runbooks/stage-stalled.md), and no SQL or password
        outcome = classify(exc)
        if isinstance(outcome, Bug):  # the statement is wrong, not the database's state: a 500 with the trace
            log.error("an API request failed on a wrong statement (%s)", outcome.code, exc_info=exc)
            return JSONResponse({"detail": f"internal error: {type(exc).__name__}; see the controller's log"},
                                status_code=500)
        log.warning("an API request failed on the release database (%s)", outcome.code)
        return JSONResponse({"detail": f"the release database cannot serve this now ({outcome.code}: "
                                       f"{outcome.kind}); try again shortly"},
                            status_code=503, headers={"Retry-After": "5"})

    for error in db_errors:
        app.add_exception_handler(error, database_failed)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse({"detail": str(exc.detail)}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        return JSONResponse({"detail": _explain(exc.errors())}, status_code=400)

    @app.exception_handler(ActionRefused)
    async def refused(_: Request, exc: ActionRefused) -> Response:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(Exception)
    async def crash(_: Request, exc: Exception) -> Response:
        # the server's fault (a database gone away), not the caller's: say so, keep the details in the log
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}; see the controller's log"},
                            status_code=500)


class CountRequests:
    """ASGI middleware counting requests by route template (bounded labels: ``/api/candidates/
    {version}``, not each version) and status."""

    def __init__(self, app: Any, metrics: ApiMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def watch(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            route = scope.get("route")  # set by the router on the scope it was given, once matched
            label = getattr(route, "path", "other")
            self.metrics.requests.labels(label, scope.get("method", ""), str(status[0])).inc()


__all__ = ["MAX_REASON_CHARS", "make_app", "verdict_summary"]
