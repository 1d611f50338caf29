"""``/livez`` apart from ``/readyz``, per role, on real servers on loopback.

A reward stage inside a long labeling turn is alive and not ready (with one ``/health`` for both,
a liveness probe restarted it in a loop); a stage whose broker does not answer is alive and not
ready; the release controller's ``/livez`` follows its loop, its ``/readyz`` its database.
Serving's probes are tested with its engines in tests/integration/test_serving_drain.py.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest
from conftest import running, stage_settings

from flywheel.contracts import EpisodeEvent, GenerationEvent, SamplingParams, encode
from flywheel.kafka.clients import make_producer
from local.broker import free_port

pytestmark = pytest.mark.integration

#: A verifier that holds its labeling turn until the test lets it go.
PLUGIN = """
import threading
from reward.labelers import register_verifier
release = threading.Event()
entered = threading.Event()
def _slow(ep):
    entered.set()
    release.wait(120)
    return 1.0
register_verifier("slow", _slow)
"""


def probe(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def until(check, what: str, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = check()
        except OSError:  # the port is not open yet
            got = None
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"never: {what}")


def episode(gid: str) -> EpisodeEvent:
    t = time.time()
    g = GenerationEvent(
        generation_id=gid, group_id=gid, model_name="m", model_version=0, user_id=f"u-{gid}", endpoint="chat",
        created_at=t, completed_at=t, latency_ms=5, prompt_text="p", prompt_token_ids=(1,),
        completion_text="ok", completion_token_ids=(2, 3), logprobs=(-0.1, -0.2),
        sampling=SamplingParams(temperature=1, top_p=1, max_tokens=4), finish_reason="stop")
    return EpisodeEvent(generation=g, signal="accept", feedback_ids=(f"f-{gid}",), resolved_at=t)


def test_reward_is_alive_and_not_ready_during_a_long_labeling_turn(kafka_settings, topics, tmp_path, monkeypatch):
    from reward.main import run as run_reward

    module = f"flyslow_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    port = free_port()
    settings = stage_settings(kafka_settings, topics, tmp_path / "data", FLYWHEEL_REWARD_PLUGINS=module,
                              FLYWHEEL_REWARD_LABELERS="signal,verifier:slow", FLYWHEEL_REWARD_PORT=str(port),
                              FLYWHEEL_PROBES_STALE_S="1")
    with running(run_reward, settings):
        until(lambda: probe(port, "/readyz")[0] == 200, "reward ready before any episode")
        assert probe(port, "/livez")[0] == 200
        producer = make_producer(kafka_settings, "test")
        producer.send(topics.episodes, key=b"g1", value=encode(episode("g1"))).get(timeout=10)
        producer.close()
        plugin = sys.modules[module]
        assert plugin.entered.wait(60), "the labeler was never called"
        # inside the turn: past probes.stale_s it is not ready, and still alive
        code, body = until(lambda: (r := probe(port, "/readyz"))[0] == 503 and r, "readyz 503 in the long turn")
        assert body["ok"] is False and body["loop_age_s"] >= 1
        assert probe(port, "/health")[0] == 503
        code, body = probe(port, "/livez")
        assert (code, body["ok"]) == (200, True) and body["turn_age_s"] < body["hung_after_s"]
        plugin.release.set()
        until(lambda: probe(port, "/readyz")[0] == 200, "reward ready again after the turn")


def test_a_stage_waiting_for_its_broker_is_alive_and_not_ready(kafka_settings, topics, tmp_path):
    from ingest.main import run as run_ingest

    port = free_port()
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    settings = stage_settings(kafka_settings, topics, tmp_path / "data", FLYWHEEL_INGEST_PORT=str(port),
                              FLYWHEEL_KAFKA_BOOTSTRAP=dead)
    with running(run_ingest, settings):
        code, body = until(lambda: probe(port, "/readyz"), "the ops port opens before the broker answers")
        assert (code, body) == (503, {"ok": False, "starting": "waiting for the broker"})
        assert probe(port, "/livez") == (200, {"ok": True, "starting": "waiting for the broker"})


def test_release_livez_follows_its_loop_and_readyz_its_database(tmp_path):
    from flywheel.probes import Heartbeat, alive
    from flywheel.settings import ReleaseSettings
    from release.api import make_app
    from release.main import ApiServer
    from release.store import ReleaseStore

    store = ReleaseStore(f"sqlite:///{tmp_path / 'release.sqlite3'}")
    heartbeat = Heartbeat()
    api = ApiServer(make_app(store, ReleaseSettings(), live=alive(heartbeat, hung_s=600)), "127.0.0.1", 0).start()
    try:
        assert probe(api.port, "/livez") == (200, {"ok": True})
        assert probe(api.port, "/readyz") == (200, {"ok": True})
        heartbeat.last -= 601  # the loop has not turned for longer than probes.hung_s
        assert probe(api.port, "/livez") == (503, {"ok": False})
        assert probe(api.port, "/readyz") == (200, {"ok": True})  # readiness is the database's
        heartbeat.beat()
        store.close()  # the database stops answering
        assert probe(api.port, "/readyz") == (503, {"ok": False})
        assert probe(api.port, "/livez") == (200, {"ok": True})
    finally:
        api.stop()
