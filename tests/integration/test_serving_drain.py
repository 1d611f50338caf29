"""Serving's probes and its drain, on the session's shared engine (tests/conftest.py ``engine``).

``/readyz`` answers 503 until the engines have answered a warm-up, and again once the drain
starts; ``/livez`` stays 200. On stop (what SIGTERM does in ``flywheel serve``) the port closes
to new requests and the streams in flight run to their last token, each recorded. The process
itself, SIGTERM and all, is tested in tests/integration/test_serving_cli.py (slow).
"""

from __future__ import annotations

import json
import threading
import uuid

import httpx
import pytest
from serving_helpers import KEY, SALT, Served, generations

pytestmark = pytest.mark.integration

#: Long enough that every stream is still generating when the stop comes (the tiny model's
#: context is 512 tokens); sampling goes on past EOS so each runs to exactly this many.
STREAM_TOKENS = 200
STREAMS = 4


@pytest.fixture
def app_on_engine(engine, broker, tiny_model_dir, tmp_path):
    """An app with a :class:`Readiness` of its own, as ``flywheel serve`` builds it."""
    from flywheel.contracts import Topics
    from flywheel.kafka.clients import ensure_topics
    from flywheel.metrics import new_registry
    from flywheel.settings import KafkaSettings, ServeSettings, Settings
    from serving.app import create_app
    from serving.main import make_recorder
    from serving.readiness import Readiness
    from serving.server import AppServer
    from serving.versions import Fleet

    loop, eng = engine
    topics = Topics(f"t{uuid.uuid4().hex[:10]}.")
    kafka = KafkaSettings(bootstrap=broker.bootstrap, partitions=2)
    ensure_topics(kafka, [topics.generations, topics.feedback])
    settings = Settings(model_dir=tiny_model_dir, data_dir=tmp_path, topic_prefix=topics.prefix, kafka=kafka,
                        serve=ServeSettings(api_keys=(KEY,), user_id_salt=SALT))
    registry = new_registry()
    recorder = make_recorder(settings, registry)
    fleet, readiness = Fleet([eng], registry), Readiness()
    server = AppServer(create_app(settings, fleet, recorder, registry, readiness=readiness), loop,
                       drain_s=settings.serve.drain_s).start()
    try:
        yield loop, fleet, readiness, server, Served(server.url, settings, recorder, topics)
    finally:
        server.stop()
        recorder.stop()


def test_ready_only_after_the_engines_answered_a_warm_up_and_not_while_draining(app_on_engine):
    from serving.readiness import NotReady, warm_up

    loop, fleet, readiness, _server, served = app_on_engine
    ready = httpx.get(served.url + "/readyz", timeout=10)
    assert (ready.status_code, ready.json()) == (503, {"ok": False, "reason": NotReady.WARMING.value})
    assert httpx.get(served.url + "/livez", timeout=10).json() == {"ok": True}
    took = loop.call(lambda: warm_up(fleet), timeout_s=120)
    assert took > 0
    readiness.warm = True
    assert httpx.get(served.url + "/readyz", timeout=10).json() == {"ok": True}
    readiness.draining = True
    ready = httpx.get(served.url + "/readyz", timeout=10)
    assert (ready.status_code, ready.json()["reason"]) == (503, NotReady.DRAINING.value)
    assert httpx.get(served.url + "/livez", timeout=10).status_code == 200


def _stream(url: str, started: threading.Event, out: dict) -> None:
    body = {"model": "flywheel", "prompt": "tell me a story", "max_tokens": STREAM_TOKENS, "stream": True,
            "ignore_eos": True, "user": f"u{uuid.uuid4().hex[:6]}"}
    chunks, done = [], False
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunks.append(json.loads(line[6:]))
                started.set()
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out.update(chunks=chunks, done=done)


def test_stop_refuses_new_requests_and_finishes_the_streams_in_flight(app_on_engine, broker):
    _loop, fleet, readiness, server, served = app_on_engine
    readiness.warm = True
    results = [{} for _ in range(STREAMS)]
    started = [threading.Event() for _ in range(STREAMS)]
    threads = [threading.Thread(target=_stream, args=(served.url, s, r)) for s, r in zip(started, results)]
    for t in threads:
        t.start()
    assert all(s.wait(120) for s in started), "a stream never started"
    assert sum(s.in_flight for s in fleet.slots) == STREAMS  # every stream is mid-generation
    stopping = threading.Thread(target=server.stop)
    stopping.start()
    # the port closes while the streams run on: a new request finds no one listening
    refused = None
    while refused is None and stopping.is_alive():
        try:
            httpx.get(served.url + "/v1/models", timeout=5, headers={"Authorization": f"Bearer {KEY}"})
        # refused, or reset unanswered: a connection still in the listening socket's backlog when
        # it closes is reset, and no request on it was served
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            refused = sum(s.in_flight for s in fleet.slots)
    stopping.join()
    for t in threads:
        t.join()
    assert refused is not None and refused > 0, "the port stayed open until the streams had ended"
    for r in results:
        assert "error" not in r and r["done"], r.get("error")
        text_chunks = [c for c in r["chunks"] if c["choices"]]
        assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    served.recorder.stop()
    gens = generations(broker, served, expect=STREAMS)
    assert sorted(len(g.completion_token_ids) for g in gens.values()) == [STREAM_TOKENS] * STREAMS
