"""Serving follows releases: real trainer versions, a real broker, two real vLLM engines.

One app for the module, on the session's shared engine plus a second one, follows the releases
topic of its own topic prefix; each test publishes releases with the next revision and waits for
serving to apply (or refuse) them. The shared engine gets the initial weights back at the end.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import http.server
import json
import shutil
import sys
import threading
import time
import uuid
from functools import partial
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_helpers import ENGINE, KEY, SALT, Served, generations
from trainer_helpers import make_trainer, reward_event

from flywheel.checkpoints import MANIFEST_NAME, CheckpointStore
from flywheel.contracts import DeadLetterEvent, ReleaseEvent, Topics, VersionRef, decode, encode
from flywheel.kafka.clients import ensure_topics
from flywheel.metrics import new_registry
from flywheel.settings import KafkaSettings, ReleaseSettings, ServeSettings, Settings
from flywheel.signing import Signer, generate_key_pair
from local.broker import free_port
from serving.arms import split_salt
from serving.identity import pseudonymise
from serving.routing import arm_of
from tests.conftest import read_all

ROUTING_SECRET = "the-routing-secret-serving-and-release-share"
PRODUCT = "sk-product"  # a product's key: not told which version answered (serve.version_visible_keys)

pytestmark = pytest.mark.integration


# -- the module's rig -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """Versions 0-3 from real DeepSpeed steps (v1 kept only as a delta from v0), and the trainer,
    whose policy now holds v3's weights."""
    tr = make_trainer(tiny_model_dir, tmp_path_factory.mktemp("trainer"), loss="reinforce", lr=5e-3,
                      full_every=2, keep_full=1)
    tr.start()
    i = 0
    for _ in range(3):
        for _ in range(2):
            tr._train([reward_event(i + k) for k in range(8)], [("t", 0, i + k) for k in range(8)])
            i += 8
        tr.publish()
    assert tr.store.versions() == [0, 1, 2, 3] and not (tr.store.path(1) / "model.safetensors").exists()
    return tr


@pytest.fixture(scope="module")
def release_keys(tmp_path_factory) -> Path:
    """The controller's key pairs ``release-1`` and ``release-2`` (before and after a rotation),
    an ``attacker``'s, and ``impostor/release-1``: another key under the trusted name. Serving
    trusts ``trusted/``, which holds release-1's public key."""
    root = tmp_path_factory.mktemp("release-keys")
    for key_id in ("release-1", "release-2", "attacker"):
        generate_key_pair(root / "pairs", key_id)
    generate_key_pair(root / "impostor", "release-1")
    (root / "trusted").mkdir()
    shutil.copy(root / "pairs" / "release-1.pub", root / "trusted")
    return root


class Rig:
    """The app, its follower and the releases it was sent, signed as the controller signs them."""

    def __init__(self, broker, served: Served, follower, fleet, store: CheckpointStore, signer: Signer) -> None:
        from kafka import KafkaProducer

        self.broker, self.served, self.follower, self.fleet, self.store = broker, served, follower, fleet, store
        self.producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
        self.revision = 0
        self.signer = signer

    def ref(self, version: int, store: CheckpointStore | None = None, uri: str | None = None) -> VersionRef | None:
        if version == 0:
            return None
        store = store or self.store
        sha = hashlib.sha256((store.path(version) / MANIFEST_NAME).read_bytes()).hexdigest()
        return VersionRef(version=version, uri=uri or str(store.path(version)), manifest_sha256=sha)

    def release(self, stable: int, canary: int | None = None, share: float = 0.0, *, wait: bool = True,
                salt: str = "", **refs: VersionRef | None) -> int:
        self.revision += 1
        ev = ReleaseEvent(revision=self.revision, stable_version=stable, canary_version=canary, canary_share=share,
                          canary_salt=salt,
                          stable_ref=refs.get("stable_ref", self.ref(stable)),
                          canary_ref=refs.get("canary_ref", self.ref(canary) if canary else None),
                          reason="test", updated_at=time.time())
        self.send(encode(ev))
        if wait:
            self.wait_for(lambda: self.follower.applied is not None and self.follower.applied.revision == ev.revision)
        return ev.revision

    def send(self, value: bytes, key: str = "flywheel", *, sign: bool = True, signer: Signer | None = None) -> None:
        headers = (signer or self.signer).headers(value) if sign else []
        self.producer.send(self.served.topics.releases, key=key.encode(), value=value, headers=headers).get(timeout=10)

    def wait_for(self, cond, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, f"timed out; follower: {self.follower.state()}"
            time.sleep(0.05)

    def health(self) -> dict:
        return httpx.get(self.served.url + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()

    def deadletters(self, expect: int) -> list[DeadLetterEvent]:
        recs = read_all(self.broker.bootstrap, self.served.topics.deadletter, expect=expect)
        return [decode(DeadLetterEvent, r.value) for r in recs]


def _start(settings: Settings, fleet, loop, registry, recorder, wait_s: float = 20.0):
    from serving.app import create_app
    from serving.follow import ReleaseFollower
    from serving.server import AppServer

    follower = ReleaseFollower(settings, fleet, lambda fn: loop.call(fn, timeout_s=300), registry)
    follower.catch_up(wait_s)
    follower.start()
    server = AppServer(create_app(settings, fleet, recorder, registry, follower), loop).start()
    return follower, server


@pytest.fixture(scope="module")
def rig(broker, tiny_model_dir, trained, tmp_path_factory, release_keys):
    from serving_helpers import _make_engine, _shutdown

    from serving.main import make_recorder
    from serving.versions import Fleet

    loop, first = ENGINE.get(tiny_model_dir)
    second = loop.call(lambda: _make_engine(tiny_model_dir), timeout_s=300)
    topics = Topics(f"t{uuid.uuid4().hex[:10]}.")
    kafka = KafkaSettings(bootstrap=broker.bootstrap, partitions=2)
    ensure_topics(kafka, topics.all())
    settings = Settings(model_dir=tiny_model_dir, data_dir=tmp_path_factory.mktemp("serving"), topic_prefix=topics.prefix,
                        kafka=kafka, routing_secret=ROUTING_SECRET,
                        serve=ServeSettings(api_keys=(KEY, PRODUCT), user_id_salt=SALT, version_visible_keys=(KEY,),
                                            max_num_seqs=32,
                                                         trusted_release_keys=(release_keys / "trusted",)),
                        release=ReleaseSettings(deployment="flywheel"))
    registry = new_registry()
    recorder = make_recorder(settings, registry)
    fleet = Fleet([first, second], registry)
    follower, server = _start(settings, fleet, loop, registry, recorder)
    r = Rig(broker, Served(server.url, settings, recorder, topics), follower, fleet, trained.store,
            Signer.load(release_keys / "pairs" / "release-1.key"))
    r.settings, r.loop, r.registry = settings, loop, registry
    yield r
    server.stop()
    follower.stop()
    recorder.stop()
    r.producer.close()
    loop.call(lambda: first.reload(tiny_model_dir, 0), timeout_s=120)  # the shared engine as it came
    loop.call(lambda: _shutdown(second), timeout_s=60)


def _events(r: Rig, ids: list[str], timeout_s: float = 60.0, repeats_ok: bool = False) -> dict:
    """The generation events of ``ids`` (each recorded exactly once, or at least once with
    ``repeats_ok``: serving_helpers.generations), once all have arrived."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = generations(r.broker, r.served, expect=0, repeats_ok=repeats_ok)
        missing = set(ids) - set(events)
        if not missing:
            return events
        assert time.monotonic() < deadline, f"{len(missing)} generations never recorded"
        time.sleep(0.5)


def _complete(r: Rig, user: str, prompt: str, **kw) -> dict:
    body = {"model": "flywheel", "prompt": prompt, "max_tokens": 4, "temperature": 0, "user": user, **kw}
    resp = r.served.post("/v1/completions", body)
    assert resp.status_code == 200, resp.text
    return resp.json()


# -- tests ---------------------------------------------------------------------------------------------
def test_a_trained_canary_at_half_splits_users_and_serves_the_trainers_weights(engine, rig, trained):
    rig.release(0, 3, 0.5)
    assert rig.health()["versions"] == {"stable": 0, "canary": 3}
    users = [f"person-{i}" for i in range(40)]
    answers = {u: _complete(rig, u, "the same prompt for everyone") for u in users}
    # split by the release's salt under the routing secret (serving/arms.py), which no topic carries
    expected = {u: 3 if arm_of(pseudonymise(SALT, u), 0.5, split_salt(ROUTING_SECRET, "")) == "canary" else 0
                for u in users}
    assert {u: a["model"] for u, a in answers.items()} == {u: f"flywheel@v{v}" for u, v in expected.items()}
    # a product key is not told which arm answered it, whichever it was; the record says
    told = {u: rig.served.post("/v1/completions", {"model": "flywheel", "prompt": "hi", "max_tokens": 1, "user": u},
                               key=PRODUCT).json() for u in users[:6]}
    assert {a["model"] for a in told.values()} == {"flywheel"}
    assert [m["id"] for m in httpx.get(rig.served.url + "/v1/models",
                                       headers={"Authorization": f"Bearer {PRODUCT}"}).json()["data"]] == ["flywheel"]
    told_events = _events(rig, [a["id"] for a in told.values()])
    assert {u: told_events[a["id"]].model_version for u, a in told.items()} == {u: expected[u] for u in told}
    assert 8 < sum(v == 3 for v in expected.values()) < 32  # both arms got users
    again = {u: _complete(rig, u, "another prompt")["model"] for u in users[:10]}
    assert again == {u: answers[u]["model"] for u in users[:10]}  # each user keeps their version
    events = _events(rig, [a["id"] for a in answers.values()])
    for u, a in answers.items():
        ev = events[a["id"]]
        assert ev.model_version == expected[u] and ev.route == ("canary" if expected[u] == 3 else "stable")

    # the canary is v3 itself: greedy text differs from stable's, and the first token's logprob is
    # what the trainer's own forward pass on v3 gives it
    prompts = ["once upon a time", "the answer is", "hello there", "a b c d"]
    pinned = {v: [rig.served.post("/v1/completions", {"model": f"flywheel@v{v}", "prompt": p, "max_tokens": 6,
                                                      "temperature": 0}).json() for p in prompts] for v in (0, 3)}
    assert [c["choices"][0]["text"] for c in pinned[0]] != [c["choices"][0]["text"] for c in pinned[3]]
    sampled = rig.served.post("/v1/completions", {"model": "flywheel@v3", "prompt": prompts[0], "max_tokens": 1,
                                                  "temperature": 1.0, "seed": 7, "logprobs": 0}).json()
    ev = _events(rig, [sampled["id"]])[sampled["id"]]
    with torch.no_grad():
        logits = trained.policy.module(input_ids=torch.tensor([list(ev.prompt_token_ids)])).logits[0, -1].float()
    want = torch.log_softmax(logits, -1)[ev.completion_token_ids[0]].item()
    assert ev.logprobs[0] == pytest.approx(want, abs=1e-3)

    # the next canary comes with a salt of its own: the same users split afresh (no reload), and
    # each keeps the version the salted hash gives while that canary runs
    rig.release(0, 3, 0.5, salt="flywheel/v3/another-canary")
    resplit = {u: 3 if arm_of(pseudonymise(SALT, u), 0.5, split_salt(ROUTING_SECRET, "flywheel/v3/another-canary"))
               == "canary" else 0 for u in users}
    assert resplit != expected  # a fresh split, not the one every canary used to share
    for _ in range(2):
        got = {u: _complete(rig, u, "a third prompt")["model"] for u in users}
        assert got == {u: f"flywheel@v{v}" for u, v in resplit.items()}
    assert sampled["choices"][0]["logprobs"]["token_logprobs"][0] == pytest.approx(ev.logprobs[0])


def test_versions_swap_under_load_without_a_failed_or_truncated_response(engine, rig):
    rig.release(0)
    stop, results, errors = threading.Event(), [], []

    def worker(n: int) -> None:
        with httpx.Client(base_url=rig.served.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
            i = 0
            while not stop.is_set():
                body = {"model": "flywheel", "prompt": f"load {n} {i}", "max_tokens": 24, "temperature": 1.0,
                        "user": f"load-{n}-{i % 3}"}
                try:
                    if n % 2:
                        results.append(_stream(c, body))
                    else:
                        resp = c.post("/v1/completions", json=body)
                        assert resp.status_code == 200, resp.text
                        ch = resp.json()["choices"][0]
                        results.append((resp.json()["id"], ch["finish_reason"], resp.json()["usage"]["completion_tokens"]))
                except Exception as exc:  # noqa: BLE001 - collected and asserted on below
                    errors.append(repr(exc))
                i += 1

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(worker, n) for n in range(12)]
        time.sleep(1.0)
        # idle loads and relabels, then both slots reloaded in place, twice, under traffic
        for stable, canary in ((1, None), (0, 1), (2, 3), (0, 1), (2, 3), (3, None), (0, None)):
            rig.release(stable, canary, 0.5 if canary else 0.0)
            time.sleep(0.3)
        stop.set()
        for f in futures:
            f.result()
    assert errors == []
    assert len(results) > 40
    # every answer ran to its end: its length, or the model's own stop; none aborted or cut short
    done = [(reason == "length" and tokens == 24) or (reason == "stop" and 0 < tokens <= 24)
            for _, reason, tokens in results]
    assert all(done), [r for r, ok in zip(results, done) if not ok][:5]
    # swaps under load can hold an ack past the recorder's timeout: a generation may then be
    # recorded twice, the same bytes (at least once), and ingest drops the repeat by its id
    # and a journal fallen back to under that load drains after it: wait as long as a replay takes
    events = _events(rig, [rid for rid, _, _ in results], timeout_s=240.0, repeats_ok=True)
    load = [events[rid] for rid, _, _ in results]
    assert [(e.finish_reason, len(e.completion_token_ids)) for e in load] == [(r, n) for _, r, n in results]
    straddled = [e for e in load if e.version_spans]
    assert all({s.version for s in e.version_spans} <= {0, 1, 2, 3} for e in straddled)
    text = httpx.get(rig.served.url + "/metrics").text
    assert 'serving_swaps_total{outcome="ok"}' in text and 'serving_swaps_total{outcome="failed"} 0.0' in text
    in_flight = float(next(line.split()[-1] for line in text.splitlines()
                           if line.startswith("serving_swap_requests_in_flight_sum")))
    assert in_flight > 0  # some loads really happened with requests running on that engine


def _stream(c: httpx.Client, body: dict) -> tuple[str, str, int]:
    rid, reason, n, done = None, None, 0, False
    with c.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                   "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            rid = chunk["id"]
            for ch in chunk["choices"]:
                reason = ch["finish_reason"] or reason
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    assert done, "stream ended without [DONE]"
    return rid, reason, n


def test_tampered_and_misannounced_versions_are_refused_and_never_served(engine, rig, tmp_path):
    rig.release(0, 2, 0.5)
    before = rig.health()["versions"]
    bad = CheckpointStore(tmp_path / "bad")
    shutil.copytree(rig.store.root, bad.root, dirs_exist_ok=True)
    delta = bad.path(1) / "delta.fwd"  # v1 is only a delta: flip one byte of it
    raw = bytearray(delta.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    delta.write_bytes(bytes(raw))
    refused_at = time.time()
    rig.release(0, 1, 0.5, wait=False, canary_ref=rig.ref(1, uri=str(bad.path(1))))
    rig.wait_for(lambda: rig.follower.refused_revision == rig.revision)
    assert rig.follower.last_refusal["reason"] == "verification_failed"
    wrong = rig.ref(3).model_copy(update={"manifest_sha256": "ab" * 32})
    rig.release(0, 3, 0.5, wait=False, canary_ref=wrong)
    rig.wait_for(lambda: rig.follower.refused_revision == rig.revision)
    health = rig.health()
    assert health["ok"] and health["versions"] == before  # still serving what it served
    assert health["releases"]["last_refusal"]["reason"] == "manifest_mismatch"
    assert _complete(rig, "still-served", "hello")["model"] in {f"flywheel@v{v}" for v in before.values()}

    # a malformed record, another deployment's release and an old revision change nothing either
    rig.send(b'{"kind": "release", "revision": "soon"}')
    other = ReleaseEvent(revision=999, deployment="elsewhere", stable_version=0, updated_at=time.time())
    rig.send(encode(other), key="elsewhere")
    stale = ReleaseEvent(revision=1, stable_version=0, updated_at=time.time())
    rig.send(encode(stale))
    rig.release(0, 2, 0.25)  # and the next good release still applies
    assert rig.health()["versions"] == {"stable": 0, "canary": 2}
    letters = [d for d in rig.deadletters(expect=3) if d.failed_at >= refused_at]
    assert sorted(d.reason for d in letters) == ["invalid", "version_refused", "version_refused"]
    refusals = sorted(d.detail for d in letters if d.reason == "version_refused")
    assert "version 1 verification_failed" in refusals[0] and "delta.fwd fails hash verification" in refusals[0]
    assert "version 3 manifest_mismatch" in refusals[1]
    text = httpx.get(rig.served.url + "/metrics").text
    assert 'serving_versions_refused_total{reason="verification_failed"} 1.0' in text
    assert 'serving_versions_refused_total{reason="manifest_mismatch"} 1.0' in text
    assert 'serving_releases_total{outcome="other_deployment"} 1.0' in text


def test_an_unreachable_store_is_retried_while_serving_keeps_answering(engine, rig):
    rig.release(0)
    v = min({1, 2, 3} - {s.version for s in rig.fleet.slots})  # one no engine holds: it must be fetched
    port = free_port()
    rig.release(v, wait=False, stable_ref=rig.ref(v, uri=f"http://127.0.0.1:{port}/{rig.store.path(v).name}"))
    rig.wait_for(lambda: "checkpoint store" in (rig.follower.last_error or ""))
    assert rig.health()["versions"] == {"stable": 0}
    assert _complete(rig, "meanwhile", "hello")["model"] == "flywheel@v0"
    handler = partial(_Quiet, directory=str(rig.store.root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rig.wait_for(lambda: rig.follower.applied.revision == rig.revision, timeout_s=90)
    finally:
        server.shutdown()
        server.server_close()
    assert rig.health()["versions"] == {"stable": v} and rig.follower.last_error is None


def test_a_version_on_an_object_store_is_fetched_verified_and_served(engine, rig, s3_url):
    """The trainer's versions on an ``s3://`` store (moto's S3 server on loopback), nothing shared
    with serving: the release names the URL, serving fetches v1 (a delta from v0 there) into its
    own cache, rebuilds and verifies it, and answers with it."""
    from flywheel.checkpoints import ObjectStore

    remote = ObjectStore(s3_url)
    for v in rig.store.versions():
        remote.publish(rig.store.path(v))
    assert not remote.fs.exists(f"{remote.base}/v00000001/model.safetensors")  # v1 is only its delta there
    rig.release(0)
    v = min({1, 2, 3} - {s.version for s in rig.fleet.slots})  # one no engine holds: it must be fetched
    assert not rig.follower.cache.path(v).exists()
    rig.release(v, stable_ref=rig.ref(v, uri=remote.uri(v)))
    assert rig.health()["versions"] == {"stable": v}
    assert _complete(rig, "from-s3", "hello")["model"] == f"flywheel@v{v}"
    cached = rig.follower.cache.path(v) / "model.safetensors"
    assert cached.read_bytes() == rig.store.materialize_bytes(v)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.slow  # a serving restart with its engines: 90 s of the default suite's 15 minutes
def test_a_restart_comes_back_on_the_released_versions_before_it_answers(engine, rig):
    """A new follower on the same engines (set back to the model directory, as a new process's
    would be) applies the newest release in ``catch_up``, before any port opens; with the broker
    gone it comes back on the release it saved."""
    from serving.follow import ReleaseFollower
    from serving.versions import Fleet

    rig.release(1, 3, 0.5)
    engines = [s.engine for s in rig.fleet.slots]
    for e in engines:
        rig.loop.call(lambda e=e: e.reload(rig.settings.model_dir, 0), timeout_s=120)
    fresh = Fleet(engines)
    follower = ReleaseFollower(rig.settings, fresh, lambda fn: rig.loop.call(fn, timeout_s=300), new_registry())
    try:
        follower.catch_up(20)
        assert fresh.served_versions() == {"stable": 1, "canary": 3} and follower.applied.revision == rig.revision
    finally:
        follower.stop()

    for e in engines:
        rig.loop.call(lambda e=e: e.reload(rig.settings.model_dir, 0), timeout_s=120)
    offline = rig.settings.model_copy(update={"kafka": KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}")})
    fresh = Fleet(engines)
    follower = ReleaseFollower(offline, fresh, lambda fn: rig.loop.call(fn, timeout_s=300), new_registry())
    try:
        follower.catch_up(3)  # no broker: the saved release, verified again from the local cache
        assert fresh.served_versions() == {"stable": 1, "canary": 3}
        assert "unreadable at start" in follower.last_error
    finally:
        follower.stop()
    # the module's app goes on from where the engines are now
    rig.fleet.routing = fresh.routing


def test_malformed_release_records_are_dead_lettered_once_and_serving_starts_and_keeps_serving(
        engine, rig, tmp_path):
    """Records serving cannot act on, before it starts and while it runs: not JSON, another kind,
    a canary version of -1 (once an assertion that stopped every start), a canary whose files are
    not in the store, one whose manifest is not the announced one, and URIs that made the store's
    client raise what no refusal foresaw (ValueError, TypeError: they too escaped the follower).
    Each is dead-lettered once with its reason; serving starts, answers and keeps its routing; a
    good release after them still applies. A fresh follower and app on the module's engines, on
    topics of their own."""
    from serving.app import create_app
    from serving.follow import ReleaseFollower
    from serving.server import AppServer
    from serving.versions import Fleet

    topics = Topics(f"t{uuid.uuid4().hex[:10]}.")
    ensure_topics(rig.settings.kafka, topics.all())
    settings = rig.settings.model_copy(update={"topic_prefix": topics.prefix, "data_dir": tmp_path})
    fleet = Fleet([s.engine for s in rig.fleet.slots])
    stable = fleet.slots[0].version  # a good release of it loads nothing: the module's engines stay as they are
    canary = min({1, 2, 3} - {s.version for s in fleet.slots})  # one no engine holds: it must be fetched
    revision = iter(range(1, 100))

    def send(value: bytes) -> None:
        # signed as the controller signs, where serving verifies signatures: a genuine but
        # malformed record is what must not stop serving (an unsigned one never gets this far)
        signer = getattr(rig, "signer", None)
        headers = signer.headers(value) if signer is not None else []
        rig.producer.send(topics.releases, key=b"flywheel", value=value, headers=headers).get(timeout=10)

    def release(canary_version: int | None, canary_ref: VersionRef | dict | None) -> bytes:
        # as JSON, not through ReleaseEvent: the contract must refuse some of these
        return json.dumps({"kind": "release", "revision": next(revision), "deployment": "flywheel",
                           "stable_version": stable, "canary_version": canary_version, "canary_share": 0.5,
                           "stable_ref": rig.ref(stable).model_dump() if stable else None,
                           "canary_ref": canary_ref.model_dump() if isinstance(canary_ref, VersionRef) else canary_ref,
                           "updated_at": time.time()}).encode()

    def letters(expect: int) -> list[DeadLetterEvent]:
        recs = read_all(rig.broker.bootstrap, topics.deadletter, expect=expect)
        return [decode(DeadLetterEvent, r.value) for r in recs]

    missing = rig.ref(canary, uri=str(tmp_path / "nowhere" / rig.store.path(canary).name))
    wrong_hash = rig.ref(canary).model_copy(update={"manifest_sha256": "cd" * 32})
    bad_port, no_fs = (rig.ref(canary).model_copy(update={"uri": uri}) for uri in ("http://:99999/x", "reference://x"))
    wrong_kind = json.dumps({"kind": "checkpoint", "revision": 50, "stable_version": 0}).encode()
    # at a start only the newest valid release is tried: here the one with the port out of range
    before = [b"{not json", wrong_kind, release(canary, bad_port), release(-1, None)]
    for value in before:
        send(value)

    registry = new_registry()
    follower = ReleaseFollower(settings, fleet, lambda fn: rig.loop.call(fn, timeout_s=300), registry)
    follower.catch_up(20)  # raised AssertionError on the canary of -1, and serving never opened its port
    follower.start()
    server = AppServer(create_app(settings, fleet, rig.served.recorder, registry, follower), rig.loop).start()
    served = Served(server.url, settings, rig.served.recorder, topics)
    try:
        assert fleet.served_versions() == {"stable": stable}
        assert served.post("/v1/completions", {"model": "flywheel", "prompt": "hi", "max_tokens": 2}).status_code == 200
        got = letters(expect=4)
        assert sorted(d.reason for d in got) == sorted(["undecodable", "wrong_kind", "invalid", "version_refused"])
        assert "canary_version" in next(d.detail for d in got if d.reason == "invalid")
        assert "fetch_failed" in next(d.detail for d in got if d.reason == "version_refused")

        # while it runs: each bad record gets its letter (the follower thread once dropped the
        # canary of -1 silently), and the routing stays as it was
        while_running = [b"[1, 2", wrong_kind, release(-1, None), release(canary, missing),
                         release(canary, wrong_hash), release(canary, no_fs)]
        for n, value in enumerate(while_running, start=len(before) + 1):
            send(value)
            rig.wait_for(lambda n=n: len(letters(expect=n)) >= n, timeout_s=60)
            assert fleet.served_versions() == {"stable": stable}
            assert served.post("/v1/completions", {"model": "flywheel", "prompt": "hi", "max_tokens": 2}).status_code == 200
        send(release(None, None))  # and a good release still applies
        rig.wait_for(lambda: follower.applied is not None and follower.applied.revision == 7)
        assert httpx.get(server.url + "/health", timeout=10).json()["ok"]

        got = letters(expect=10)
        assert len(got) == 10 and len({(d.source_partition, d.source_offset) for d in got}) == 10  # each once
        assert sorted(d.reason for d in got) == sorted(["undecodable", "wrong_kind", "invalid"] * 2
                                                       + ["version_refused"] * 4)
        assert all(d.stage == "serving" and d.detail and d.source_topic == topics.releases for d in got)
        refusals = sorted((d for d in got if d.reason == "version_refused"), key=lambda d: d.failed_at)
        assert [d.detail.split(":")[0] for d in refusals] == [
            f"version {canary} {reason}" for reason in ("fetch_failed", "absent", "manifest_mismatch", "fetch_failed")]
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'serving_versions_refused_total{reason="fetch_failed"} 2.0' in text
    finally:
        server.stop()
        follower.stop()


# -- who may route serving: signed releases (flywheel/signing.py) -----------------------------------
def _letters(rig: Rig, since: float, n: int, timeout_s: float = 30.0) -> list[DeadLetterEvent]:
    """The first ``n`` dead letters serving sent since ``since`` (wall clock), once they arrived."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = [d for d in rig.deadletters(expect=0) if d.failed_at >= since]
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_a_forged_release_is_refused_dead_lettered_and_serving_keeps_its_routing(engine, rig, release_keys):
    """Whoever may write the topic but holds no trusted key: with the trainer's real files and a
    manifest hash that matches them, its routing would pass every check but the signature."""
    rig.release(1)
    since = time.time()
    revision = rig.revision + 1
    forged = ReleaseEvent(revision=revision, stable_version=2, stable_ref=rig.ref(2), reason="forged",
                          updated_at=time.time())
    rig.send(encode(forged), sign=False)
    attacker = Signer.load(release_keys / "pairs" / "attacker.key")
    rig.send(encode(forged.model_copy(update={"revision": revision + 1})), signer=attacker)
    impostor = Signer.load(release_keys / "impostor" / "release-1.key")  # the attacker's key, the trusted name
    rig.send(encode(forged.model_copy(update={"revision": revision + 2})), signer=impostor)
    letters = _letters(rig, since, 3)
    assert sorted(d.reason for d in letters) == ["bad_signature", "unknown_key", "unsigned"]
    assert all(d.stage == "serving" and d.source_topic == rig.served.topics.releases for d in letters)
    assert rig.follower.applied.revision == revision - 1 and rig.health()["versions"] == {"stable": 1}
    assert _complete(rig, "after-forgery", "hello")["model"] == "flywheel@v1"
    rig.revision += 3
    rig.release(3)  # a genuine one after them is followed
    assert rig.health()["versions"] == {"stable": 3}
    text = httpx.get(rig.served.url + "/metrics").text
    for reason in ("unsigned", "unknown_key", "bad_signature"):
        assert f'serving_deadletters_total{{reason="{reason}"}} 1.0' in text


def test_rotating_the_release_key_needs_no_restart_of_serving(engine, rig, release_keys):
    """Trust the new key beside the old, switch the controller to it, remove the old key: the
    old key's releases are then refused, and serving follows the new key's."""
    old, new = rig.signer, Signer.load(release_keys / "pairs" / "release-2.key")
    trusted = release_keys / "trusted"
    shutil.copy(release_keys / "pairs" / "release-2.pub", trusted)
    rig.signer = new
    rig.release(2)
    rig.signer = old  # a controller not switched yet: still trusted
    rig.release(1)
    (trusted / "release-1.pub").unlink()
    since = time.time()
    rig.release(3, wait=False)
    [letter] = _letters(rig, since, 1)
    assert letter.reason == "unknown_key" and "release-1" in letter.detail
    assert rig.health()["versions"] == {"stable": 1}
    rig.signer = new
    rig.release(2)
    assert rig.health()["versions"] == {"stable": 2}


def test_a_malformed_public_key_is_refused_loudly_at_start_and_while_running(engine, rig, release_keys, caplog):
    """A rotation's new ``.pub`` half written beside the trusted key: a running serving refused it
    in one log line only, and a restart stopped on it. Now both refuse the file loudly (an error
    naming it, ``serving_release_key_files_refused``, ``/health``) and go on verifying with the
    keys they have; a serving with no trusted keys says so on ``/health`` and ``/metrics``."""
    from serving.follow import ReleaseFollower

    trusted = release_keys / "trusted"
    good = sorted(p.name.removesuffix(".pub") for p in trusted.glob("*.pub"))
    junk = trusted / "release-3.pub"
    junk.write_text("-----BEGIN PUBLIC KEY-----\nhalf a key\n")
    try:
        # while running: shown at the next scrape, before any release makes the verifier look
        text = httpx.get(rig.served.url + "/metrics", timeout=10).text
        assert "serving_release_key_files_refused 1.0" in text and "serving_release_signatures_verified 1.0" in text
        assert f"serving_release_trusted_keys {len(good)}.0" in text
        health = rig.health()
        signatures = health["releases"]["signatures"]
        # ids and a count: any product key holder reads /health, the file and why go to the log only
        assert signatures == {"verified": True, "trusted_key_ids": good, "key_files_refused": 1}
        assert str(release_keys) not in json.dumps(health)
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "release-3.pub" in r.getMessage()]
        assert len(errors) == 1 and str(junk) in errors[0] and "serve.trusted_release_keys" in errors[0], errors
        rig.release(1)  # a release the trusted key signed is still followed
        assert rig.health()["versions"] == {"stable": 1}

        # at start: a restart's follower (Verifier.load raised, and serving exited 2) trusts the good key
        registry = new_registry()
        follower = ReleaseFollower(rig.settings, rig.fleet, lambda fn: rig.loop.call(fn, timeout_s=300), registry)
        try:
            assert follower.state()["signatures"] == signatures
            assert registry.get_sample_value("serving_release_key_files_refused") == 1
            value = encode(ReleaseEvent(revision=1, stable_version=0, updated_at=time.time()))
            assert follower.verifier.check(value, rig.signer.headers(value)) == rig.signer.key_id
        finally:
            follower.stop()
    finally:
        junk.unlink()
    assert "serving_release_key_files_refused 0.0" in httpx.get(rig.served.url + "/metrics", timeout=10).text

    # no trusted keys: nothing is verified, and serving says so where people and alerts look
    registry = new_registry()
    unverified = rig.settings.model_copy(update={"serve": rig.settings.serve.model_copy(
        update={"trusted_release_keys": ()})})
    follower = ReleaseFollower(unverified, rig.fleet, lambda fn: rig.loop.call(fn, timeout_s=300), registry)
    try:
        assert follower.state()["signatures"] == {"verified": False, "trusted_key_ids": [], "key_files_refused": 0}
        assert registry.get_sample_value("serving_release_signatures_verified") == 0
    finally:
        follower.stop()
