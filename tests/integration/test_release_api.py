"""The release API over real HTTP on loopback (uvicorn on port 0), against a real SQLite file and a
real PostgreSQL schema (``release_db_url``: every test runs once on each; the PostgreSQL runs
with the slow tests).

The app gets a store (a database connection) of its own, as in production; the tests seed and check
through another one, so whatever they see was committed by the API, not merely held in its
connection. Candidates are seeded through the store the way the controller records them:
``add_candidate`` with a checkpoint event, then the state machine's own transitions.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from conftest import release_database

from flywheel.contracts import CheckpointEvent
from flywheel.settings import ReleaseSettings, SettingsError
from release.api import MAX_REASON_CHARS, make_app
from release.auth import Role, parse_tokens
from release.states import State
from release.store import ReleaseStore, Routing

pytestmark = pytest.mark.integration

#: who -> token; each name has the role it is called after
TOKENS = {"vera": "tok-viewer", "abe": "tok-approver", "ada": "tok-admin"}
ROLE_OF = {"vera": Role.VIEWER, "abe": Role.APPROVER, "ada": Role.ADMIN}
TOKEN_SETTING = tuple(f"{who}:{ROLE_OF[who].label}:{tok}" for who, tok in TOKENS.items())

#: The security spec of the API, written out independently of release/api.py: every /api route and
#: the least role it needs. A route the app has and this table lacks fails the enumeration test.
API_ROLES: dict[tuple[str, str], Role] = {
    ("GET", "/api/status"): Role.VIEWER,
    ("GET", "/api/candidates"): Role.VIEWER,
    ("GET", "/api/candidates/{version}"): Role.VIEWER,
    ("GET", "/api/audit"): Role.VIEWER,
    ("POST", "/api/candidates/{version}/approve"): Role.APPROVER,
    ("POST", "/api/candidates/{version}/reject"): Role.APPROVER,
    ("POST", "/api/rollback"): Role.APPROVER,
    ("POST", "/api/undo"): Role.APPROVER,
    ("POST", "/api/pause"): Role.ADMIN,
    ("POST", "/api/resume"): Role.ADMIN,
}
PUBLIC = {"/health", "/livez", "/readyz", "/metrics", "/openapi.json"}


def checkpoint(version: int, parent: int | None) -> dict[str, Any]:
    """A checkpoint event as the trainer publishes it, as the dict the store records."""
    return CheckpointEvent(version=version, parent=parent, step=version * 10, uri=f"file:///ckpt/v{version}",
                           manifest_sha256=f"{version:064x}", dtype="float32", full_snapshot=parent is None,
                           samples=64, metrics={"loss": 0.5, "entropy": 1.2}, created_at=time.time()).model_dump()


#: The controller's path to each state a test needs (release/states.py).
PATHS: dict[State, tuple[State, ...]] = {
    State.CANDIDATE: (),
    State.CANARY: (State.GATING, State.CANARY),
    State.AWAITING_APPROVAL: (State.GATING, State.CANARY, State.AWAITING_APPROVAL),
    State.HELD: (State.GATING, State.CANARY, State.HELD),
    State.SUPERSEDED: (State.SUPERSEDED,),  # superseded before its gate: a newer one came first
    State.PROMOTED: (State.GATING, State.CANARY, State.AWAITING_APPROVAL, State.PROMOTED),
}


def seed(store: ReleaseStore, version: int, state: State, parent: int | None = None) -> None:
    """Record ``version`` and walk it to ``state`` as the controller would, with the routing each
    step implies (a canary at 10 %, a promotion to stable)."""
    store.add_candidate(checkpoint(version, parent), "controller:test")
    for target in PATHS[state]:
        routing = None
        if target == State.CANARY:
            routing = Routing(store.stable_version(), version, 0.1)
        elif target in (State.PROMOTED, State.SUPERSEDED):
            routing = Routing(version if target == State.PROMOTED else store.stable_version(), None, 0.0)
        store.transition(version, target, "controller", f"test: to {target.value}", routing=routing)


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` on a uvicorn server on a free loopback port, in a thread; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, name="release-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive(), "the API server exited during start"
        assert time.monotonic() < deadline, "the API server did not start"
        time.sleep(0.005)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@dataclass
class Api:
    """A running API and a handle on its database that is not the app's own connection."""

    url: str
    store: ReleaseStore
    app: Any
    http: httpx.Client  # one client: a fresh one per request costs tens of ms in TLS set-up alone

    def call(self, method: str, path: str, who: str | None = None, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {TOKENS[who]}"} if who else {}
        headers.update(kw.pop("headers", {}))
        return self.http.request(method, self.url + path, headers=headers, **kw)

    def get(self, path: str, who: str | None = "vera", **kw: Any) -> httpx.Response:
        return self.call("GET", path, who, **kw)

    def post(self, path: str, who: str | None, **kw: Any) -> httpx.Response:
        return self.call("POST", path, who, **kw)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def release_db_url(request, tmp_path) -> Iterator[str]:
    """The API on each backend; over PostgreSQL with the slow tests, to keep the default suite short
    (the store's own tests, tests/integration/test_release_store.py, run on both by default)."""
    with release_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture
def store(release_db_url) -> Iterator[ReleaseStore]:
    s = ReleaseStore(release_db_url)
    yield s
    s.close()


@pytest.fixture
def api(release_db_url, store) -> Iterator[Callable[..., Api]]:
    """Factory: start the API over the test's database with ``ReleaseSettings`` overrides (no
    promotion interval unless given) and an optional controller ``status``; stopped afterwards."""
    with ExitStack() as stack:
        http = stack.enter_context(httpx.Client(timeout=10))

        def start(status: Callable[[], dict[str, Any]] | None = None, verify: Callable[..., None] | None = None,
                  notify: tuple[Callable[..., None], ...] = (), **overrides: Any) -> Api:
            settings = ReleaseSettings(**{"tokens": TOKEN_SETTING, "promotion_interval_s": 0.0, **overrides})
            app_store = ReleaseStore(release_db_url)  # the app's own connection, as in production
            stack.callback(app_store.close)
            app = make_app(app_store, settings, status, verify=verify, notify=notify)
            return Api(stack.enter_context(serving(app)), store, app, http)

        yield start


#: A body every action route accepts; a role check comes before it is read either way.
BODY = {"reason": "route check"}


def test_every_api_route_answers_401_without_a_token_and_403_below_its_role(api):
    a = api()
    routes = {(m, r.path) for r in a.app.routes if r.path.startswith("/api")
              for m in getattr(r, "methods", ()) if m != "HEAD"}
    assert routes == set(API_ROLES), "every /api route must be in the spec table, and only those"
    for (method, path), needed in API_ROLES.items():
        # a well-formed call, and one with a junk version and body: who may call comes first, so
        # a caller without the role learns nothing about what the route expects
        calls = ((path.replace("{version}", "9999"), {"json": BODY}),  # 9999: nobody published it
                 (path.replace("{version}", "junk"), {"content": b"{not json"}))
        for url, kw in calls:
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic dmVyYTp4"},
                            {"Authorization": "Bearer"}):
                r = a.call(method, url, None, headers=headers, **kw)
                assert r.status_code == 401, (method, url, headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.json()["detail"], (method, path)
            for who, role in ROLE_OF.items():
                if role < needed:
                    r = a.call(method, url, who, **kw)
                    assert r.status_code == 403, (method, url, who, r.text)
                    assert f"needs the {needed.label} role" in r.json()["detail"]
                    assert f"{who} is a {role.label}" in r.json()["detail"]
        for who, role in ROLE_OF.items():
            if role >= needed:  # the role suffices, and so does any higher one
                r = a.call(method, calls[0][0], who, **calls[0][1])
                assert r.status_code not in (401, 403), (method, path, who, r.text)
                assert r.status_code < 500, (method, path, who, r.text)


def test_only_probes_schema_and_console_are_public(api):
    a = api()
    try:
        from release import console
        console_paths = {r.path for r in console.router.routes}
    except ModuleNotFoundError:
        console_paths = set()
    public = {r.path for r in a.app.routes if not r.path.startswith("/api")}
    assert public - console_paths == PUBLIC
    for path in PUBLIC:
        assert a.get(path, who=None).status_code == 200, path
    assert a.get("/openapi.json", who=None).json()["paths"].keys() >= {p for _, p in API_ROLES}
    assert a.get("/docs", who=None).status_code == 404
    assert a.get("/redoc", who=None).status_code == 404


def test_without_configured_tokens_every_route_answers_401(api):
    a = api(tokens=())
    r = a.get("/api/status", who="ada")
    assert r.status_code == 401
    assert "no API tokens are configured" in r.json()["detail"]


def test_token_parsing_names_the_bad_entry_and_never_the_secret():
    tokens = parse_tokens(["ann:viewer:s3cret", "bo:ADMIN:with:colons"])
    assert tokens.lookup("s3cret").name == "ann"
    assert tokens.lookup("with:colons").role == Role.ADMIN  # the token is everything after the 2nd colon
    assert tokens.lookup("s3cre") is None and tokens.lookup("") is None
    cases = {
        "ann:viewer": "not name:role:token",
        "ann::tok": "not name:role:token",
        ":viewer:tok": "not name:role:token",
        "ann:owner:hunter2": "unknown role 'owner'",
        "ann:viewer:two words": "must not contain spaces",
    }
    for entry, message in cases.items():
        with pytest.raises(SettingsError, match=message) as err:
            parse_tokens(["ok:viewer:fine", entry])
        assert "entry 2" in str(err.value)
        assert "hunter2" not in str(err.value) and "words" not in str(err.value)
    with pytest.raises(SettingsError, match="reuses the token of ann"):
        parse_tokens(["ann:viewer:same", "bo:admin:same"])
    with pytest.raises(SettingsError, match="unknown role"):
        make_app(None, ReleaseSettings(tokens=("ann:root:x",)))  # type: ignore[arg-type]


def test_status_candidates_and_detail_show_what_the_store_holds(api, store):
    seed(store, 1, State.PROMOTED)
    seed(store, 2, State.SUPERSEDED, parent=1)
    seed(store, 3, State.AWAITING_APPROVAL, parent=1)
    analysis = {"outcome": "pass", "reasons": ["canary accepted more often (e-value 25.0 >= 20)"],
                "arms": {"stable": {"outcomes": 60, "accepts": 30}, "canary": {"outcomes": 61, "accepts": 45}},
                "e_better": 25.0, "band": [[10, 0.4, 0.9], [20, 0.55, 0.85]], "excluded_users": 2,
                "pass_alpha": 0.025}
    store.save(3, gate={"outcome": "pass", "reasons": ["24 held-out prompts: every check within its limit"],
                        "kl_from_stable": 0.02}, analysis=analysis)
    store.take_lease("controller-a", ttl_s=30)
    a = api(status=lambda: {"ok": True, "phase": "measuring"})

    status = a.get("/api/status").json()
    assert status["stable_version"] == 1 and status["paused"] is False
    # the newest routing: v3's canary, with the users its analysis left out and its PASS level
    assert status["canary"] == {"version": 3, "share": 0.1, "excluded_users": 2, "pass_alpha": 0.025}
    assert status["revision"]["canary_version"] == 3 and status["revision"]["published"] is False
    assert status["lease"]["holder"] == "controller-a" and status["lease"]["live"] is True
    assert status["controller"] == {"ok": True, "phase": "measuring"}
    assert status["candidates"] == {"promoted": 1, "superseded": 1, "awaiting_approval": 1}

    rows = a.get("/api/candidates").json()["candidates"]
    assert [(r["version"], r["parent"], r["state"]) for r in rows] == [
        (1, None, "promoted"), (2, 1, "superseded"), (3, 1, "awaiting_approval")]
    assert rows[2]["gate_summary"] == {"outcome": "pass", "reason": "24 held-out prompts: every check within its limit"}
    assert rows[2]["analysis_summary"]["outcome"] == "pass" and rows[0]["gate_summary"] is None
    assert "band" not in rows[2]  # the list stays small; the history is in the detail

    detail = a.get("/api/candidates/3").json()
    assert detail["analysis"] == analysis and detail["gate"]["kl_from_stable"] == 0.02
    assert detail["manifest_sha256"] == f"{3:064x}" and detail["checkpoint"]["step"] == 30
    changes = [(e["from_state"], e["to_state"]) for e in detail["audit"]]
    assert changes == [("canary", "awaiting_approval"), ("gating", "canary"), ("candidate", "gating"),
                       (None, "candidate")]  # newest first
    missing = a.get("/api/candidates/77")
    assert missing.status_code == 404 and "no version 77" in missing.json()["detail"]


def test_approval_promotes_records_the_approver_and_publishes_a_revision(api, store):
    seed(store, 1, State.PROMOTED)
    seed(store, 2, State.AWAITING_APPROVAL, parent=1)
    before = store.latest_revision()
    a = api()
    r = a.post("/api/candidates/2/approve", "abe", json={"reason": "accept rate up, guardrails quiet"})
    assert r.status_code == 200, r.text
    assert r.json()["revision"]["stable_version"] == 2

    assert store.get(2).state == State.PROMOTED
    rev = store.latest_revision()
    assert rev.revision == before.revision + 1
    assert (rev.stable_version, rev.canary_version, rev.canary_share) == (2, None, 0.0)
    assert [u.revision for u in store.unpublished()][-1] == rev.revision  # the controller publishes it
    entry = store.audit(version=2, limit=1)[0]
    assert (entry.actor, entry.from_state, entry.to_state) == ("abe", "awaiting_approval", "promoted")
    assert entry.reason == "accept rate up, guardrails quiet"
    assert a.get("/api/status").json()["stable_version"] == 2
    listed = a.get("/api/audit", params={"version": 2, "limit": 1}).json()["entries"]
    assert [(e["actor"], e["to_state"]) for e in listed] == [("abe", "promoted")]


def test_an_admin_may_approve_and_an_empty_body_is_a_default_reason(api, store):
    seed(store, 1, State.AWAITING_APPROVAL)
    a = api()
    assert a.post("/api/candidates/1/approve", "ada").status_code == 200
    entry = store.audit(version=1, limit=1)[0]
    assert entry.actor == "ada" and entry.to_state == "promoted" and "no reason given" in entry.reason


@pytest.mark.parametrize("case", ["unknown", "superseded", "promoted", "rejected"])
def test_approving_what_cannot_be_promoted_is_409_with_the_reason(api, store, case):
    seed(store, 1, State.PROMOTED)
    seed(store, 2, State.SUPERSEDED, parent=1)
    seed(store, 3, State.AWAITING_APPROVAL, parent=1)
    store.transition(3, State.REJECTED, "abe", "test: turned down")
    version, says = {"unknown": (99, "no version 99 was ever published"),
                     "superseded": (2, "version 2 is superseded"),
                     "promoted": (1, "version 1 is promoted"),
                     "rejected": (3, "version 3 is rejected")}[case]
    revision = store.latest_revision()
    a = api()
    r = a.post(f"/api/candidates/{version}/approve", "abe", json={"reason": "ship it"})
    assert r.status_code == 409 and says in r.json()["detail"], r.text
    assert store.latest_revision() == revision  # routing untouched
    note = store.audit(version=version, limit=1)[0]  # the attempt is on record, with who and why not
    assert note.actor == "abe" and note.to_state is None and note.reason.startswith("approve refused: ")


def test_approval_inside_the_promotion_interval_is_409_saying_when(api, store):
    seed(store, 1, State.AWAITING_APPROVAL)
    seed(store, 2, State.AWAITING_APPROVAL, parent=1)
    a = api(promotion_interval_s=3600)
    assert a.post("/api/candidates/1/approve", "abe").status_code == 200
    r = a.post("/api/candidates/2/approve", "abe", json={"reason": "also good"})
    assert r.status_code == 409
    detail = r.json()["detail"]
    assert "the next promotion is allowed in" in detail and "promotion_interval_s = 3600" in detail
    wait_s = float(detail.split("allowed in ")[1].split("s")[0])
    assert 3590 <= wait_s <= 3600
    assert store.get(2).state == State.AWAITING_APPROVAL and store.stable_version() == 1
    status = a.get("/api/status").json()
    assert status["next_promotion_at"] == pytest.approx(status["last_promotion_at"] + 3600)


def test_reject_and_rollback_send_users_back_to_stable_and_refuse_when_nothing_is_live(api, store):
    seed(store, 1, State.PROMOTED)
    seed(store, 2, State.CANARY, parent=1)
    a = api()
    r = a.post("/api/rollback", "abe", json={"reason": "wrong one", "version": 5})
    assert r.status_code == 409 and "version 5 is not serving canary traffic" in r.json()["detail"]
    assert store.get(2).state == State.CANARY
    r = a.post("/api/rollback", "abe", json={"reason": "answers got worse"})
    assert r.status_code == 200 and r.json()["version"] == 2
    assert store.get(2).state == State.ROLLED_BACK
    assert (store.latest_revision().stable_version, store.latest_revision().canary_version) == (1, None)
    assert (store.audit(version=2, limit=1)[0].actor, store.audit(version=2, limit=1)[0].reason) == (
        "abe", "answers got worse")

    seed(store, 3, State.AWAITING_APPROVAL, parent=1)  # a new canary, serving 10 %
    assert store.latest_revision().canary_version == 3
    r = a.post("/api/candidates/3/reject", "abe", json={"reason": "too long answers"})
    assert r.status_code == 200, r.text
    assert store.get(3).state == State.REJECTED and store.audit(version=3, limit=1)[0].actor == "abe"
    assert (store.latest_revision().stable_version, store.latest_revision().canary_version) == (1, None)
    r = a.post("/api/rollback", "abe", json={})
    assert r.status_code == 409 and "no canary is live" in r.json()["detail"]
    r = a.post("/api/candidates/3/reject", "abe")
    assert r.status_code == 409 and "already rejected" in r.json()["detail"]


def test_pause_and_resume_are_audited_and_repeats_change_nothing(api, store):
    a = api()
    r = a.post("/api/pause", "ada", json={"reason": "kafka maintenance"})
    assert r.json() == {"paused": True, "changed": True}
    assert store.paused() is True
    entry = store.audit(limit=1)[0]
    assert (entry.actor, entry.version, entry.reason) == ("ada", None, "paused: kafka maintenance")
    assert a.post("/api/pause", "ada", json={"reason": "again"}).json() == {"paused": True, "changed": False}
    assert store.audit(limit=1)[0].id == entry.id  # nothing new on record
    assert a.get("/api/status").json()["paused"] is True
    r = a.post("/api/resume", "ada", json={"reason": "maintenance over"})
    assert r.json() == {"paused": False, "changed": True} and store.paused() is False
    entry = store.audit(limit=1)[0]
    assert (entry.actor, entry.reason) == ("ada", "resumed: maintenance over")


BAD_REQUESTS: list[tuple[str, str, dict[str, Any], int, str]] = [
    # method, path, httpx kwargs, status, words the detail must hold
    ("POST", "/api/candidates/1/approve", {"content": b"{not json"}, 400, "not valid JSON"),
    ("POST", "/api/candidates/1/approve", {"content": b"\xff\xfe"}, 400, "not valid JSON"),
    ("POST", "/api/candidates/1/approve", {"json": ["reason"]}, 400, "JSON object"),
    ("POST", "/api/candidates/1/approve", {"json": {"reason": "x" * (MAX_REASON_CHARS + 1)}}, 400, "2000"),
    ("POST", "/api/candidates/1/approve", {"json": {"reason": 5}}, 400, "reason"),
    ("POST", "/api/candidates/1/approve", {"json": {"reson": "typo"}}, 400, "reson"),
    ("POST", "/api/candidates/1/approve", {"content": b"{" + b" " * 20_000 + b"}"}, 413, "bytes"),
    ("POST", "/api/candidates/abc/approve", {}, 400, "version"),
    ("POST", "/api/candidates/-1/approve", {}, 400, "version"),
    ("POST", f"/api/candidates/{2**70}/approve", {}, 400, "version"),
    ("GET", "/api/candidates/1.5", {}, 400, "version"),
    ("POST", "/api/rollback", {"json": {"version": "two"}}, 400, "version"),
    # strict: a number in a string, a boolean or a float is no version (pydantic's lax mode took them)
    ("POST", "/api/rollback", {"json": {"version": "3"}}, 400, "version: Input should be a valid integer"),
    ("POST", "/api/rollback", {"json": {"version": True}}, 400, "version: Input should be a valid integer"),
    ("POST", "/api/rollback", {"json": {"version": 3.0}}, 400, "version: Input should be a valid integer"),
    ("POST", "/api/pause", {"json": {"reason": True}}, 400, "reason: Input should be a valid string"),
    ("POST", "/api/pause", {}, 400, "reason"),
    ("POST", "/api/pause", {"json": {"reason": "   "}}, 400, "reason"),
    ("POST", "/api/resume", {"json": {}}, 400, "reason"),
    ("GET", "/api/audit?limit=0", {}, 400, "limit"),
    ("GET", "/api/audit?limit=lots", {}, 400, "limit"),
    ("GET", "/api/audit?version=x", {}, 400, "version"),
    ("GET", "/api/nothing-here", {}, 404, "Not Found"),
    ("DELETE", "/api/pause", {}, 405, "Method Not Allowed"),
]


def test_bad_requests_get_4xx_with_a_message_and_change_nothing(api, store):
    seed(store, 1, State.AWAITING_APPROVAL)
    audit_before = store.audit()
    a = api()
    for method, path, kw, status, words in BAD_REQUESTS:
        r = a.call(method, path, "ada", **kw)
        assert r.status_code == status, (method, path, kw.keys(), r.text)
        assert words in r.json()["detail"], (path, r.json())
    assert store.get(1).state == State.AWAITING_APPROVAL and store.paused() is False
    assert store.audit() == audit_before
    ok = a.post("/api/candidates/1/approve", "abe", json={"reason": "y" * MAX_REASON_CHARS})  # the limit itself
    assert ok.status_code == 200 and store.audit(version=1, limit=1)[0].reason == "y" * MAX_REASON_CHARS


BODY_ROUTES = [(m, p) for (m, p) in API_ROLES if m == "POST"]


@pytest.mark.parametrize("body", [b"[" * 2000 + b"]" * 2000, b'{"reason": ' + b"[" * 2000 + b"]" * 2000 + b"}",
                                  b'{"reason": "\\ud800"}'],
                         ids=["deep-array", "deep-in-an-object", "lone-surrogate"])
def test_a_body_json_cannot_parse_or_store_is_a_400_on_every_route_that_takes_one(api, store, body):
    # 2,000 nested arrays: a RecursionError escaped body parsing as a 500
    seed(store, 1, State.AWAITING_APPROVAL)
    audit_before = store.audit()
    a = api()
    for method, path in BODY_ROUTES:
        r = a.call(method, path.replace("{version}", "1"), "ada", content=body,
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        assert any(w in r.json()["detail"] for w in ("nested too deeply", "surrogate")), (path, r.json())
    assert store.audit() == audit_before and store.get(1).state == State.AWAITING_APPROVAL


#: Reasons that would forge what a person reads in the audit log: a line break starts a fake row,
#: C1 controls (U+009B is CSI to 8-bit terminals, U+0085 a line break) and bidirectional controls
#: rewrite or reorder what is shown; line and paragraph separators break lines in many viewers.
FORGING_REASONS = {
    "newline": "ok\n2026-01-01 00:00:00Z  alice  1  held -> promoted  approved",
    "carriage-return": "ok\rforged",
    "tab": "ok\tforged",
    "escape": "ok \x1b[2J",
    "c1-csi": "ok \x9b2J",
    "c1-next-line": "ok\x85forged",
    "bidi-override": "approved \u202edevorppa ton",
    "bidi-isolate": "ok \u2066forged\u2069",
    "rlm": "ok \u200f",
    "line-separator": "ok\u2028forged",
    "paragraph-separator": "ok\u2029forged",
}


@pytest.mark.parametrize("reason", FORGING_REASONS.values(), ids=FORGING_REASONS.keys())
def test_a_reason_that_could_forge_the_audit_log_is_refused_on_every_route(api, store, reason):
    seed(store, 1, State.AWAITING_APPROVAL)
    audit_before = store.audit()
    a = api()
    for method, path in BODY_ROUTES:
        r = a.call(method, path.replace("{version}", "1"), "ada", json={"reason": reason})
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert r.json()["detail"].startswith("reason: "), r.json()
        assert "one line of text" in r.json()["detail"], r.json()
        assert "U+" in r.json()["detail"], r.json()  # which character, named so a person can find it
    assert store.audit() == audit_before and store.get(1).state == State.AWAITING_APPROVAL
    # text in other scripts, emoji and their joiners is a reason like any other
    ok = a.post("/api/candidates/1/approve", "abe", json={"reason": "gut so, très bien, 很好 👩‍💻"})
    assert ok.status_code == 200, ok.text


def test_health_and_metrics_are_open_and_report_what_they_see(api, store):
    # /health is for probes, without a token: ok or not, and nothing a stranger could use
    # (hostnames, lease holders, errors naming a database URL); the details are for a viewer
    seed(store, 1, State.AWAITING_APPROVAL)
    store.take_lease("ctrl-host-7:1a2b", ttl_s=30)
    healthy = api(status=lambda: {"ok": True, "controller": "ctrl-host-7:1a2b"})
    r = healthy.get("/health", who=None)
    assert (r.status_code, r.json()) == (200, {"ok": True})
    assert healthy.get("/api/status").json()["controller"] == {"ok": True, "controller": "ctrl-host-7:1a2b"}
    sick = api(status=lambda: {"ok": False, "error": "postgresql://release:pw@db-7/release unreachable"})
    r = sick.get("/health", who=None)
    assert (r.status_code, r.json()) == (503, {"ok": False})
    assert "db-7" in sick.get("/api/status").json()["controller"]["error"]  # a viewer sees why

    def broken() -> dict[str, Any]:
        raise RuntimeError("controller thread died")

    crashed = api(status=broken)
    r = crashed.get("/health", who=None)
    assert (r.status_code, r.json()) == (503, {"ok": False})
    status = crashed.get("/api/status")  # the database's view still shows, with the failure named
    assert status.status_code == 200 and "controller thread died" in status.json()["controller"]["error"]
    for probe in (healthy, sick, crashed):  # a token changes nothing: /health stays a probe
        assert probe.get("/health", who="ada").json().keys() == {"ok"}

    healthy.get("/api/candidates/1")
    healthy.get("/api/candidates/2")
    healthy.post("/api/candidates/9/approve", "abe")
    text = healthy.get("/metrics", who=None).text
    assert ('release_api_requests_total{method="GET",route="/api/candidates/{version}",status="200"} 1.0'
            in text)  # labelled by route template: one series however many versions are asked for
    assert 'release_api_requests_total{method="GET",route="/api/candidates/{version}",status="404"} 1.0' in text
    assert 'release_api_actions_total{action="approve",outcome="refused"} 1.0' in text
    # /metrics needs no token: it names none, and no person (actors are counted by kind only)
    assert not [tok for tok in TOKENS.values() if tok in text]
    assert not re.search('="(?:' + '|'.join(TOKENS) + ')"', text)
