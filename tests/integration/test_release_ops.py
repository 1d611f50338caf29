"""What on-call and release engineers get from the release controller beyond its state machine,
through the real API on loopback (release/api.py on uvicorn) over a real SQLite file:

- ``/metrics``: candidates by state, the live canary's evidence, seconds in a state, decisions by
  outcome and by who made them, the routing revision, and the database's own health;
- ``release undo --to N``: stable back to an earlier promoted version, rebuilt and verified from a
  real checkpoint store first (a damaged one is refused), audited;
- webhooks: a real HTTP receiver on loopback gets a JSON body with a ``text`` for every decision,
  after failed attempts are retried; a receiver that never answers is given up and counted;
- ``-o json`` on every read command and ``status --watch`` (a real process, stopped by SIGINT).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import test_release_api as shared
from prometheus_client.parser import text_string_to_metric_families
from test_release_api import TOKENS, seed

from cli.main import main
from release.controller import verify_version
from release.states import State
from release.store import Routing
from release.webhooks import Webhooks

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

release_db_url = shared.release_db_url
store = shared.store
api = shared.api


def scrape(a) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` as {(sample name, sorted labels): value}."""
    r = a.get("/metrics", who=None)
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def value(samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["release", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- metrics ------------------------------------------------------------------------------------

def test_metrics_follow_a_canary_from_its_evidence_to_a_persons_approval(api, store):
    seed(store, 1, State.PROMOTED)
    seed(store, 2, State.AWAITING_APPROVAL, parent=1)
    store.save(2, analysis={"outcome": "pass", "reasons": ["canary accepted more often"], "e_better": 41.5,
                            "e_worse": 0.02, "band": [0.61, 0.83],
                            "stable": {"accept_rate": 0.3, "outcomes": 120, "accepts": 36, "per_user": {"users": 130}},
                            "canary": {"accept_rate": 0.55, "outcomes": 60, "accepts": 33, "per_user": {"users": 66}},
                            "sample_ratio_e": 3.5})
    a = api()
    before = scrape(a)
    assert value(before, "release_database_up") == 1
    assert value(before, "release_candidates", state="awaiting_approval") == 1
    assert value(before, "release_candidates", state="promoted") == 1
    assert value(before, "release_canary_version") == 2
    assert value(before, "release_canary_e_value", direction="better") == 41.5
    assert (value(before, "release_canary_band", bound="lower"), value(before, "release_canary_band", bound="upper")) \
        == (0.61, 0.83)
    assert value(before, "release_canary_accept_rate", arm="canary") == 0.55
    assert (value(before, "release_canary_outcomes", arm="stable"), value(before, "release_canary_accepts", arm="stable")) \
        == (120, 36)
    # the sample-ratio check's evidence: users per arm, and its e-value (held at 1/srm_alpha)
    assert (value(before, "release_canary_users", arm="stable"), value(before, "release_canary_users", arm="canary")) \
        == (130, 66)
    assert value(before, "release_canary_sample_ratio_e_value") == 3.5
    assert value(before, "release_state_seconds", state="awaiting_approval") > 0
    assert value(before, "release_state_seconds", state="held") == 0
    decided = value(before, "release_routing_revision", phase="decided")
    assert decided == store.latest_revision().revision and value(before, "release_routing_revision", phase="published") == 0
    assert value(before, "release_decisions_total", outcome="promoted", actor_kind="person") is None

    assert a.post("/api/candidates/2/approve", "abe", json={"reason": "looks right"}).status_code == 200
    after = scrape(a)
    assert value(after, "release_decisions_total", outcome="promoted", actor_kind="person") == 1
    assert value(after, "release_candidates", state="promoted") == 2
    assert value(after, "release_candidates", state="awaiting_approval") == 0
    assert value(after, "release_canary_version") == -1
    assert value(after, "release_state_seconds", state="awaiting_approval") == 0
    assert value(after, "release_canary_e_value", direction="better") is None  # no canary, no evidence
    assert value(after, "release_routing_revision", phase="decided") == decided + 1
    store.mark_published([decided + 1])  # as the controller does once the broker acked it
    assert value(scrape(a), "release_routing_revision", phase="published") == decided + 1


def test_a_refused_action_is_no_decision_and_a_rollback_counts_once(api, store):
    seed(store, 1, State.CANARY)
    a = api()
    assert a.post("/api/candidates/1/approve", "abe", json={}).status_code == 409  # still running
    assert a.post("/api/rollback", "abe", json={"version": 1}).status_code == 200
    assert a.post("/api/rollback", "abe", json={"version": 1}).status_code == 409
    got = scrape(a)
    assert value(got, "release_decisions_total", outcome="rolled_back", actor_kind="person") == 1
    assert value(got, "release_decisions_total", outcome="promoted", actor_kind="person") is None


# -- undo ---------------------------------------------------------------------------------------

def commit_versions(st, model_dir: Path, versions: tuple[int, ...]) -> dict[int, str]:
    """Versions of ``model_dir`` committed to checkpoint store ``st`` (the first a snapshot, each
    next a delta on the one before, its weights differing in their last byte); each one's
    manifest hash."""
    shas = {}
    base = (model_dir / "model.safetensors").read_bytes()
    parent = None
    for v in versions:
        tmp = st.staging_dir(v)
        data = bytearray(base)
        data[-1] ^= v  # each version's weights differ in their last byte
        (tmp / "model.safetensors").write_bytes(bytes(data))
        shas[v], _ = st.commit(tmp, version=v, parent=parent, source_dir=model_dir, extra={}, ledger={})
        parent = v
    return shas


@pytest.fixture
def checkpoints(tmp_path, tiny_model_dir):
    """A real checkpoint store with versions 1 and 2 (1 a snapshot, 2 a delta on it), and each
    version's manifest hash."""
    from flywheel.checkpoints import CheckpointStore

    st = CheckpointStore(tmp_path / "checkpoints", full_every=10, keep_full=2)
    return st, commit_versions(st, tiny_model_dir, (1, 2))


def promote_real(store, version: int, sha: str, parent: int | None) -> None:
    store.add_candidate({"version": version, "parent": parent, "uri": f"file:///ckpt/v{version}",
                         "manifest_sha256": sha, "step": version}, "controller:test")
    store.transition(version, State.GATING, "controller:test", "gate")
    store.transition(version, State.CANARY, "controller:test", "canary", routing=Routing(store.stable_version(), version, 0.1))
    store.transition(version, State.AWAITING_APPROVAL, "controller:test", "passed")
    store.transition(version, State.PROMOTED, "abe", "approved", routing=Routing(version, None, 0.0))


def test_undo_returns_stable_to_an_earlier_version_verified_and_audited(api, store, checkpoints, capsys):
    st, shas = checkpoints
    promote_real(store, 1, shas[1], None)
    promote_real(store, 2, shas[2], 1)
    a = api(verify=partial(verify_version, st))
    code, out, err = cli(capsys, "undo", "--to", "1", "--reason", "v2 answers worse in French",
                         "--url", a.url, "--token", TOKENS["abe"])
    assert (code, err) == (0, "") and out.startswith("stable is v1 again")
    rev = store.latest_revision()
    assert (rev.stable_version, rev.canary_version, rev.published) == (1, None, False)  # the controller publishes it
    entry = store.audit(1)[0]
    assert entry.actor == "abe" and "undo: stable back to v1 from v2: v2 answers worse in French" == entry.reason
    assert entry.evidence == {"undo": {"from": 2, "to": 1}}
    assert store.get(2).state == State.PROMOTED  # its history stands; only the routing moved
    assert value(scrape(a), "release_decisions_total", outcome="undone", actor_kind="person") == 1
    # and forward again: v2 was promoted too
    assert a.post("/api/undo", "abe", json={"to": 2}).status_code == 200
    assert store.stable_version() == 2


def test_undo_refuses_a_damaged_version_a_viewer_and_what_the_rules_forbid(api, store, checkpoints, capsys):
    st, shas = checkpoints
    promote_real(store, 1, shas[1], None)
    promote_real(store, 2, shas[2], 1)
    seed(store, 3, State.SUPERSEDED, parent=2)
    a = api(verify=partial(verify_version, st))
    assert a.post("/api/undo", "vera", json={"to": 1}).status_code == 403
    r = a.post("/api/undo", "abe", json={"to": 2})
    assert (r.status_code, r.json()["detail"]) == (409, "version 2 is already stable")
    r = a.post("/api/undo", "abe", json={"to": 3})
    assert r.status_code == 409 and "superseded" in r.json()["detail"]
    assert a.post("/api/undo", "abe", json={"to": 9}).status_code == 409
    assert a.post("/api/undo", "abe", json={"to": "1"}).status_code == 400
    # the store lost v1's bytes since it was promoted: serving must never be sent to it
    weights = st.path(1) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")
    code, _, err = cli(capsys, "undo", "--to", "1", "--url", a.url, "--token", TOKENS["abe"])
    assert code == 1 and "version 1 failed verification, stable stays" in err
    assert store.stable_version() == 2
    assert any(e.reason.startswith("undo refused: version 1 failed verification") and e.actor == "abe"
               for e in store.audit(1))
    # a live canary: roll it back first
    seed(store, 4, State.CANARY, parent=2)
    r = a.post("/api/undo", "abe", json={"to": 1})
    assert r.status_code == 409 and "roll it back first" in r.json()["detail"]


def test_undo_without_a_checkpoint_store_is_refused(api, store, checkpoints):
    _, shas = checkpoints
    promote_real(store, 1, shas[1], None)
    promote_real(store, 2, shas[2], 1)
    r = api().post("/api/undo", "abe", json={"to": 1})
    assert r.status_code == 409 and "cannot verify" in r.json()["detail"]
    assert store.stable_version() == 2


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_an_undo_refused_by_verification_shows_approvers_no_server_path(api, store, checkpoints, caplog, damage):
    """The 409 an approver reads (and the audit note anyone with a token reads) quoted the
    verification error whole: the checkpoint store's directory, or the temporary directory the
    version was rebuilt in. They name the failure and the file; the controller's log keeps the
    rest for the operator."""
    st, shas = checkpoints
    promote_real(store, 1, shas[1], None)
    promote_real(store, 2, shas[2], 1)
    weights = st.path(1) / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-1])
    else:
        weights.unlink()
    a = api(verify=partial(verify_version, st))
    with caplog.at_level("WARNING", logger="release.api"):
        r = a.post("/api/undo", "abe", json={"to": 1})
    detail = r.json()["detail"]
    assert r.status_code == 409 and detail.startswith("version 1 failed verification, stable stays: "), detail
    assert "/" not in detail and str(st.root) not in detail and "model.safetensors" in detail, detail
    note = next(e.reason for e in store.audit(1) if e.reason.startswith("undo refused"))
    assert "/" not in note, note
    assert str(st.root) in caplog.text or "flywheel-verify-" in caplog.text  # the operator still sees where
    assert store.stable_version() == 2

# -- webhooks -----------------------------------------------------------------------------------

class Receiver:
    """A webhook receiver on loopback: answers 500 to the first ``fail_first`` requests, then 200;
    over TLS with ``certs`` (a certificate for ``localhost``), noting the server name each client
    asked for (SNI)."""

    def __init__(self, fail_first: int = 0, certs=None) -> None:
        self.bodies: list[dict] = []
        self.hosts: list[str] = []  # each request's Host header
        self.server_names: list[str | None] = []
        self.attempts = 0
        self.fail_first = fail_first
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.hosts.append(self.headers["Host"])
                receiver.attempts += 1
                ok = receiver.attempts > receiver.fail_first
                if ok:
                    receiver.bodies.append(json.loads(body))
                self.send_response(200 if ok else 500)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}/hooks/T000/SECRET"
        if certs is not None:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.load_cert_chain(certs.server_cert, certs.server_key)
            tls.sni_callback = lambda sock, name, ctx: receiver.server_names.append(name)
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
            self.url = f"https://localhost:{self.port}/hooks/T000/SECRET"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class DeadReceiver:
    """A webhook receiver on loopback that takes each connection and never answers."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/hooks/T000/DEAD"
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # closed
            while True:
                self.held.append(self.listener.accept()[0])

    def close(self) -> None:
        """Closes every connection held: a client waiting on one gets an error at once."""
        self.listener.close()
        for conn in self.held:
            conn.close()


def wait_for(check, what: str, limit_s: float = 30.0):
    deadline = time.monotonic() + limit_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"waited {limit_s:.0f} s for {what}"
        time.sleep(0.02)
    return got


def test_every_decision_reaches_the_webhook_with_a_text_after_retries(api, store):
    from flywheel.metrics import new_registry

    receiver = Receiver(fail_first=2)
    registry = new_registry()
    hooks = Webhooks((receiver.url,), "prod-eu", registry, attempts=5, backoff_s=0.01, allow_internal=True)
    try:
        seed(store, 1, State.PROMOTED)
        seed(store, 2, State.AWAITING_APPROVAL, parent=1)
        seed(store, 3, State.CANDIDATE, parent=1)
        a = api(notify=(hooks,))
        assert a.post("/api/candidates/3/reject", "abe", json={"reason": "wrong tone"}).status_code == 200
        assert a.post("/api/candidates/2/approve", "abe", json={"reason": "ship it"}).status_code == 200
        assert a.post("/api/pause", "ada", json={"reason": "holiday"}).status_code == 200  # no decision
        bodies = wait_for(lambda: receiver.bodies if len(receiver.bodies) == 2 else None, "two webhook bodies")
        assert [(b["version"], b["outcome"], b["actor"], b["actor_kind"]) for b in bodies] == [
            (3, "rejected", "abe", "person"), (2, "promoted", "abe", "person")]
        assert bodies[0]["text"] == "[prod-eu] v3 rejected by abe: wrong tone"
        assert bodies[1]["text"] == "[prod-eu] v2 promoted to stable by abe: ship it"
        assert bodies[0]["deployment"] == "prod-eu" and bodies[0]["audit_id"] < bodies[1]["audit_id"]
        wait_for(lambda: deliveries(registry, "delivered") == 2, "two deliveries counted")
        counts = {outcome: deliveries(registry, outcome) for outcome in ("delivered", "retried", "failed")}
        assert counts == {"delivered": 2, "retried": 2, "failed": 0}
        assert receiver.attempts == 4
    finally:
        hooks.close()
        receiver.close()


def test_a_webhook_that_never_answers_is_given_up_and_counted(api, store):
    from flywheel.metrics import new_registry

    receiver = Receiver(fail_first=10**6)
    registry = new_registry()
    hooks = Webhooks((receiver.url,), "flywheel", registry, attempts=3, backoff_s=0.01, allow_internal=True)
    try:
        seed(store, 1, State.CANARY)
        a = api(notify=(hooks,))
        assert a.post("/api/rollback", "abe", json={}).status_code == 200  # the action does not wait for it

        def failed() -> float:
            return registry.get_sample_value("release_webhook_deliveries_total", {"outcome": "failed"})

        wait_for(lambda: failed() == 1, "the body to be given up")
        assert receiver.attempts == 3 and receiver.bodies == []
        assert registry.get_sample_value("release_webhook_deliveries_total", {"outcome": "retried"}) == 2
        assert store.get(1).state == State.ROLLED_BACK
    finally:
        hooks.close()
        receiver.close()


def test_a_webhook_url_that_cannot_be_sent_to_fails_alone_and_later_ones_are_delivered(api, store):
    """Settings refuse such a URL; one that reaches the sender anyway (httpx.InvalidURL is not an
    HTTPError) ended the delivery thread, so no later decision reached any receiver."""
    from flywheel.metrics import new_registry

    receiver = Receiver(fail_first=0)
    registry = new_registry()
    hooks = Webhooks(("https://hooks.example:abc/services/T0/B0/secret", receiver.url), "flywheel", registry,
                     attempts=2, backoff_s=0.01, allow_internal=True)
    try:
        seed(store, 1, State.PROMOTED)
        seed(store, 2, State.CANDIDATE, parent=1)
        seed(store, 3, State.CANDIDATE, parent=1)
        a = api(notify=(hooks,))
        assert a.post("/api/candidates/2/reject", "abe", json={"reason": "one"}).status_code == 200
        assert a.post("/api/candidates/3/reject", "abe", json={"reason": "two"}).status_code == 200
        bodies = wait_for(lambda: receiver.bodies if len(receiver.bodies) == 2 else None, "two webhook bodies")
        assert [b["version"] for b in bodies] == [2, 3]
        wait_for(lambda: registry.get_sample_value("release_webhook_deliveries_total", {"outcome": "failed"}) == 2,
                 "the unparseable URL's two bodies given up")
        assert all(r.thread.is_alive() for r in hooks.receivers)
    finally:
        hooks.close()
        receiver.close()


def deliveries(registry, outcome: str) -> float:
    return registry.get_sample_value("release_webhook_deliveries_total", {"outcome": outcome})


def test_a_dead_webhook_receiver_delays_only_itself_and_its_full_queue_drops(api, store):
    """One queue for every receiver: a receiver that never answers held each decision for every
    other one for its attempts' timeouts and backoffs (about 65 s a decision at the defaults).
    Now each has its own queue and thread: the healthy one gets every decision while the dead one
    still waits on its first, and the dead one's queue (2 bodies here) drops the rest, counted."""
    from flywheel.metrics import new_registry

    dead, healthy = DeadReceiver(), Receiver()
    registry = new_registry()
    hooks = Webhooks((dead.url, healthy.url), "flywheel", registry, attempts=5, backoff_s=1.0, timeout_s=120.0,
                     allow_internal=True, max_queued=2)
    try:
        seed(store, 1, State.PROMOTED)
        for v in range(2, 7):
            seed(store, v, State.CANDIDATE, parent=1)
        a = api(notify=(hooks,))
        assert a.post("/api/candidates/2/reject", "abe", json={"reason": "r2"}).status_code == 200
        wait_for(lambda: dead.held, "the dead receiver to hold the first body")
        for v in range(3, 7):
            assert a.post(f"/api/candidates/{v}/reject", "abe", json={"reason": f"r{v}"}).status_code == 200
        bodies = wait_for(lambda: healthy.bodies if len(healthy.bodies) == 5 else None, "five bodies", limit_s=20)
        assert [b["version"] for b in bodies] == [2, 3, 4, 5, 6]
        assert len(dead.held) == 1  # still on its first attempt at its first body
        # The receiver keeps a body before its answer reaches the sender, which counts it after.
        wait_for(lambda: deliveries(registry, "delivered") == 5, "five deliveries counted")
        assert deliveries(registry, "dropped") == 2  # 5 and 6
        assert deliveries(registry, "failed") == 0
    finally:
        dead.close()
        hooks.close()
        healthy.close()


def test_a_webhook_name_that_resolves_to_an_internal_address_is_refused_at_send(api, store, caplog):
    """Settings refuse a literal internal address; a name is only known at send time. Refused
    (not retried), counted, logged; allowed, it is sent to the address checked under its own
    name, and the chat text arrives escaped while ``reason`` stays as written."""
    from flywheel.metrics import new_registry

    receiver = Receiver()
    url = receiver.url.replace("127.0.0.1", "localhost")
    registry, allowed_registry = new_registry(), new_registry()
    refused = Webhooks((url,), "flywheel", registry, attempts=3, backoff_s=0.01)
    allowed = Webhooks((url,), "flywheel", allowed_registry, attempts=3, backoff_s=0.01, allow_internal=True)
    hostile = "<!channel> approve at <https://evil.example|the console> @here [here](https://evil.example)"
    try:
        seed(store, 1, State.PROMOTED)
        seed(store, 2, State.CANDIDATE, parent=1)
        with caplog.at_level("ERROR", logger="release.webhooks"):
            a = api(notify=(refused, allowed))
            assert a.post("/api/candidates/2/reject", "abe", json={"reason": hostile}).status_code == 200
            wait_for(lambda: deliveries(registry, "refused") == 1, "the body to be refused")
            body = wait_for(lambda: receiver.bodies[0] if receiver.bodies else None, "the allowed body")
        assert receiver.attempts == 1 and receiver.hosts == [f"localhost:{receiver.port}"]
        assert deliveries(registry, "retried") == 0 and deliveries(registry, "delivered") == 0
        assert "localhost resolves to an internal address (loopback)" in caplog.text
        assert "/hooks/T000/SECRET" not in caplog.text
        assert body["reason"] == hostile
        assert "<" not in body["text"] and "](" not in body["text"] and "@here" not in body["text"]
        assert "&lt;!channel&gt; approve at &lt;https://evil.example|the console&gt;" in body["text"]
    finally:
        refused.close()
        allowed.close()
        receiver.close()


def test_an_https_webhook_is_sent_to_the_address_checked_under_its_name(api, store, tmp_path):
    """The request goes to the address the check resolved (no second lookup to rebind), while TLS
    asks for the URL's host by name (SNI) and checks the certificate against it."""
    from secured_kafka import make_certs

    from flywheel.metrics import new_registry

    certs = make_certs(tmp_path / "certs")
    receiver = Receiver(certs=certs)
    registry = new_registry()
    hooks = Webhooks((receiver.url,), "flywheel", registry, attempts=2, backoff_s=0.01, allow_internal=True,
                     verify=ssl.create_default_context(cafile=certs.ca))
    try:
        seed(store, 1, State.PROMOTED)
        seed(store, 2, State.CANDIDATE, parent=1)
        assert api(notify=(hooks,)).post("/api/candidates/2/reject", "abe", json={"reason": "x"}).status_code == 200
        wait_for(lambda: receiver.bodies, "the body over TLS")
        assert receiver.server_names == ["localhost"] and receiver.hosts == [f"localhost:{receiver.port}"]
        wait_for(lambda: deliveries(registry, "delivered") == 1, "the delivery counted")
    finally:
        hooks.close()
        receiver.close()


# -- -o json and --watch ------------------------------------------------------------------------

@pytest.mark.parametrize("argv, key", [(("status",), "stable_version"), (("list",), "candidates"),
                                       (("show", "2"), "audit"), (("audit", "--version", "2"), "entries")])
def test_every_read_command_prints_the_apis_json_with_o_json(api, store, capsys, argv, key):
    seed(store, 1, State.PROMOTED)
    seed(store, 2, State.HELD, parent=1)
    a = api()
    code, out, err = cli(capsys, *argv, "-o", "json", "--url", a.url, "--token", TOKENS["vera"])
    assert (code, err) == (0, "") and out.count("\n") == 1
    body = json.loads(out)
    path = {"status": "/api/status", "list": "/api/candidates", "show": "/api/candidates/2",
            "audit": "/api/audit?version=2"}[argv[0]]
    expected = a.get(path).json()
    if argv[0] == "status":  # its clock and the lease move between the two reads
        body.pop("time"), expected.pop("time")
    assert key in body and body == expected


def test_status_watch_prints_again_when_the_status_changes(api, store):
    seed(store, 1, State.PROMOTED)
    a = api()
    # started as a shell starts a background command, SIGINT ignored (inherited through exec):
    # the watch must still stop on it
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "release", "status", "--watch", "-o", "json",
                                 "--interval", "0.05", "--url", a.url, "--token", TOKENS["vera"]],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        first = json.loads(proc.stdout.readline())
        assert (first["stable_version"], first["paused"]) == (1, False)
        assert a.post("/api/pause", "ada", json={"reason": "freeze"}).status_code == 200
        second = json.loads(proc.stdout.readline())  # nothing in between: an unchanged status prints nothing
        assert (second["stable_version"], second["paused"]) == (1, True)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert proc.stdout.read() == "" and proc.stderr.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
