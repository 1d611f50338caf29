"""Releases are level-triggered: the controller sends its current routing again, and a serving
that finds none waits for it, unready, instead of serving the model directory.

Real broker, the real controller on SQLite ticked by the test, and for the serving side the real
release follower and app on the session's vLLM engine. The releases topic is deleted and made
again under a controller that holds a promoted version (what retention does to an uncompacted
topic, all at once); a new serving pod (a fresh data dir: its emptyDir) then starts with no record
to read, answers ``/readyz`` 503 (no routing yet), and serves the controller's stable version as
soon as the controller's next announcement arrives (slow: 16 s). In the default suite: the
controller's announcements at start, per period and never from a standby, and a serving past its
wait taking traffic marked unconfirmed.
"""

from __future__ import annotations

import hashlib
import time
from contextlib import closing

import httpx
import pytest

from flywheel.checkpoints import MANIFEST_NAME, CheckpointStore
from flywheel.contracts import ReleaseEvent, decode
from flywheel.kafka.clients import ensure_topics
from flywheel.metrics import new_registry
from flywheel.settings import KafkaSettings, ReleaseSettings, ServeSettings, Settings
from release.controller import Controller
from release.states import State
from release.store import ReleaseStore, Routing
from release.streams import Streams
from tests.conftest import read_all

pytestmark = pytest.mark.integration

KEY = "sk-reannounce"


def releases(bootstrap: str, topic: str, expect: int) -> list[tuple[int, int, int | None]]:
    """(revision, stable, canary) of every record on the releases topic, in the order of the topic."""
    return [(ev.revision, ev.stable_version, ev.canary_version)
            for ev in (decode(ReleaseEvent, r.value) for r in read_all(bootstrap, topic, expect=expect))]


def controller_on(settings: Settings) -> Controller:
    registry = new_registry()
    ctl = Controller(settings, ReleaseStore(settings.release.database_url), Streams(settings, registry), None, registry)
    ctl.registry = registry  # the test reads the controller's metrics from it
    return ctl


class Clock:
    """The controllers' announcement clock, moved by the test: a period passes at once."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def close(ctl: Controller) -> None:
    ctl.streams.close()
    ctl.store.close()


def settings_for(kafka_settings: KafkaSettings, prefix: str, model_dir, data_dir, db: str, **release) -> Settings:
    cfg = {"database_url": db, "tick_s": 0.1, "lease_ttl_s": 30, "eval_questions": 20,  # a gate of seconds
           "group_id": f"release-{prefix}", **release}
    return Settings(model_dir=model_dir, data_dir=data_dir, topic_prefix=prefix, kafka=kafka_settings,
                    serve=ServeSettings(api_keys=(KEY,), user_id_salt="test-salt", version_visible_keys=(KEY,)),
                    release=ReleaseSettings(**cfg))


def test_the_controller_announces_its_routing_at_start_and_every_period_and_a_standby_never(
        kafka_settings, topics, tiny_model_dir, tmp_path):
    db = f"sqlite:///{tmp_path / 'release.sqlite3'}"
    settings = settings_for(kafka_settings, topics.prefix, tiny_model_dir, tmp_path, db)
    leader, standby = controller_on(settings), controller_on(settings)
    leader.clock = standby.clock = clock = Clock()

    def sent(ctl: Controller) -> float:  # acked announcements; the topic is read once, at the end
        return ctl.registry.get_sample_value("release_routing_announcements_total", {"outcome": "sent"})

    try:
        leader.tick()  # a deployment's first start: nothing decided, so revision 0, every user on v0
        standby.tick()
        assert leader.active and not standby.active and (sent(leader), sent(standby)) == (1, 0)
        clock.t += settings.release.reannounce_s - 1
        leader.tick()  # within the period: nothing sent
        assert sent(leader) == 1
        clock.t += 1
        standby.tick()
        leader.tick()  # the period is up: the same routing again, and only from the lease holder
        assert (sent(leader), sent(standby)) == (2, 0)
        with closing(ReleaseStore(db)) as person:  # a canary decided: published, and it is the announcement
            person.add_candidate({"version": 1, "parent": 0, "uri": str(tmp_path / "v1"), "manifest_sha256": "a" * 64,
                                  "step": 1}, "test")
            person.transition(1, State.GATING, "test", "gate")
            person.transition(1, State.CANARY, "test", "canary", routing=Routing(0, 1, 0.5))
        leader.tick()
        assert sent(leader) == 2
        clock.t += settings.release.reannounce_s
        leader.tick()  # and its record is what the next period repeats
        assert releases(kafka_settings.bootstrap, topics.releases, 4) == [(0, 0, None)] * 2 + [(1, 0, 1)] * 2
        assert (sent(leader), sent(standby)) == (3, 0)
    finally:
        close(leader)
        close(standby)


def versions_store(model_dir, root) -> CheckpointStore:
    """Version 1: the model directory's weights plus a little noise (so it is not v0)."""
    import torch
    from safetensors.torch import load_file, save_file

    store = CheckpointStore(root, full_every=100, keep_full=1)
    weights = load_file(str(model_dir / "model.safetensors"))
    for v in (0, 1):
        tmp = store.staging_dir(v)
        weights = {k: t + 1e-2 * torch.randn_like(t) for k, t in weights.items()} if v else weights
        save_file(weights, str(tmp / "model.safetensors"))
        store.commit(tmp, version=v, parent=v - 1 if v else None, source_dir=model_dir, extra={}, ledger={})
    return store


def recreate(kafka_settings: KafkaSettings, topic: str) -> None:
    """Delete ``topic`` through the admin API, wait until the broker no longer lists it, make it again."""
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=kafka_settings.bootstrap)
    try:
        admin.delete_topics([topic])
        deadline = time.monotonic() + 30
        while topic in admin.list_topics():
            assert time.monotonic() < deadline, f"{topic} still listed after its deletion"
            time.sleep(0.1)
    finally:
        admin.close()
    ensure_topics(kafka_settings, [topic])


def wait_for(cond, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


@pytest.mark.slow  # 16 s on the session engine (a version made, loaded, answered, the engine put back)
def test_a_serving_pod_started_after_the_releases_topic_lost_its_records_serves_the_controllers_routing(
        engine, broker, kafka_settings, topics, tiny_model_dir, tmp_path):
    from serving.app import create_app
    from serving.follow import ReleaseFollower
    from serving.main import make_recorder
    from serving.readiness import NotReady, RoutingState
    from serving.server import AppServer
    from serving.versions import Fleet

    loop, eng = engine
    kafka = kafka_settings
    store = versions_store(tiny_model_dir, tmp_path / "checkpoints")
    db = f"sqlite:///{tmp_path / 'release.sqlite3'}"
    # the controller has promoted v1: revisions 1 (its canary) and 2 (stable v1) are on the topic
    ctl = controller_on(settings_for(kafka, topics.prefix, tiny_model_dir, tmp_path / "release", db))
    ctl.clock = clock = Clock()
    with closing(ReleaseStore(db)) as person:
        sha = hashlib.sha256((store.path(1) / MANIFEST_NAME).read_bytes()).hexdigest()
        person.add_candidate({"version": 1, "parent": 0, "uri": str(store.path(1)), "manifest_sha256": sha,
                              "step": 1}, "test")
        person.transition(1, State.GATING, "test", "gate")
        person.transition(1, State.CANARY, "test", "canary", routing=Routing(0, 1, 0.5))
        person.transition(1, State.PROMOTED, "test", "promoted", routing=Routing(1, None, 0.0))
    server = follower = recorder = None
    try:
        ctl.tick()
        assert releases(broker.bootstrap, topics.releases, 2) == [(1, 0, 1), (2, 1, None)]
        recreate(kafka, topics.releases)  # every record gone, as retention leaves an uncompacted topic
        # a new serving pod: its data dir (an emptyDir) holds no saved release either
        settings = settings_for(kafka, topics.prefix, tiny_model_dir, tmp_path / "pod", db)
        registry = new_registry()
        fleet = Fleet([eng], registry)
        follower = ReleaseFollower(settings, fleet, lambda fn: loop.call(fn, timeout_s=300), registry)
        follower.catch_up(10)
        follower.start()
        recorder = make_recorder(settings, registry)
        server = AppServer(create_app(settings, fleet, recorder, registry, follower), loop).start()
        ready = httpx.get(server.url + "/readyz", timeout=10)
        assert (ready.status_code, ready.json()) == (503, {"ok": False, "reason": NotReady.NO_ROUTING.value})
        assert follower.routing() is RoutingState.WAITING and fleet.served_versions() == {"stable": 0}
        # the controller's next period: its routing again, which the pod applies
        clock.t += ctl.cfg.reannounce_s
        ctl.tick()
        wait_for(lambda: follower.applied is not None, "serving to apply the announced routing")
        assert httpx.get(server.url + "/readyz", timeout=10).json() == {"ok": True}
        health = httpx.get(server.url + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
        assert (health["versions"], health["releases"]["revision"], health["releases"]["routing"]) == (
            {"stable": 1}, 2, "applied")
        gen = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                         json={"model": "flywheel", "prompt": "hello", "max_tokens": 2}).json()
        assert gen["model"] == "flywheel@v1"
        assert registry.get_sample_value("serving_release_routing_unconfirmed") == 0
    finally:
        if server is not None:
            server.stop()
        if follower is not None:
            follower.stop()
        if recorder is not None:
            recorder.stop()
        close(ctl)
        loop.call(lambda: eng.reload(tiny_model_dir, 0), timeout_s=120)  # the shared engine as it came


def test_past_its_wait_a_serving_with_no_routing_takes_traffic_marked_unconfirmed(engine, broker, topics,
                                                                                   kafka_settings, tiny_model_dir,
                                                                                   tmp_path):
    from serving.follow import ReleaseFollower
    from serving.readiness import Readiness, RoutingState
    from serving.versions import Fleet

    loop, eng = engine
    settings = settings_for(kafka_settings, topics.prefix, tiny_model_dir, tmp_path, "sqlite://")
    settings = settings.model_copy(update={"serve": settings.serve.model_copy(update={"routing_wait_s": 1.0})})
    registry = new_registry()
    fleet = Fleet([eng], registry)
    follower = ReleaseFollower(settings, fleet, lambda fn: loop.call(fn, timeout_s=300), registry)
    follower.catch_up(10)  # no controller ever announces here
    readiness = Readiness(warm=True, routing=follower.routing)
    try:
        assert readiness.check(fleet) is not None and registry.get_sample_value(
            "serving_release_routing_unconfirmed") == 0
        follower.start()
        wait_for(lambda: follower.routing() is RoutingState.UNCONFIRMED, "the wait to run out", 10)
        assert readiness.check(fleet) is None  # ready, on the model directory, and says so
        assert registry.get_sample_value("serving_release_routing_unconfirmed") == 1
        assert follower.state()["routing"] == "unconfirmed" and fleet.served_versions() == {"stable": 0}
    finally:
        follower.stop()
