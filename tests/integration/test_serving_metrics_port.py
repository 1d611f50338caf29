"""serve.metrics_port: serving's ``/metrics`` on a port of its own, the API port answering it 404.

``/metrics`` on the API port answered anyone who reached the product's API, with the deployment's
traffic, versions and (with ``serve.metrics_key_ids``) per-key token counts. Run on the session's
engine (tests/serving_helpers.py): the real app on loopback, and the metrics server
``flywheel serve`` starts beside it.
"""

from __future__ import annotations

import uuid

import httpx
from serving_helpers import KEY, SALT

from flywheel.contracts import Topics
from flywheel.kafka.clients import ensure_topics
from flywheel.metrics import new_registry
from flywheel.settings import KafkaSettings, ServeSettings, Settings
from serving.app import create_app
from serving.main import make_recorder, metrics_server
from serving.readiness import Readiness
from serving.server import AppServer
from serving.versions import Fleet


def test_metrics_leave_the_api_port_for_their_own(engine, broker, tiny_model_dir, tmp_path):
    loop, eng = engine
    topics = Topics(f"t{uuid.uuid4().hex[:10]}.")
    kafka = KafkaSettings(bootstrap=broker.bootstrap, partitions=2)
    ensure_topics(kafka, [topics.generations, topics.feedback])
    settings = Settings(model_dir=tiny_model_dir, data_dir=tmp_path, topic_prefix=topics.prefix, kafka=kafka,
                        serve=ServeSettings(api_keys=(KEY,), user_id_salt=SALT, metrics_port=0))
    registry = new_registry()
    recorder = make_recorder(settings, registry)
    fleet = Fleet([eng], registry)
    app = create_app(settings, fleet, recorder, registry)
    server = AppServer(app, loop, registry=registry).start()
    ops = metrics_server(settings, registry, Readiness(warm=True), fleet)
    try:
        models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert models.status_code == 200
        assert httpx.get(server.url + "/metrics", timeout=10).status_code == 404
        assert httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=10).status_code == 404
        metrics_url = f"http://127.0.0.1:{ops.server_port}"
        text = httpx.get(metrics_url + "/metrics", timeout=10).text
        assert 'serving_requests_total{model_version="0",route="/v1/models",status="200"} 1.0' in text
        assert "serving_api_keys_configured 1.0" in text
        assert httpx.get(metrics_url + "/readyz", timeout=10).json() == {"ok": True}
        assert httpx.get(metrics_url + "/v1/models", timeout=10).status_code == 404  # metrics, not the API
    finally:
        if ops is not None:
            ops.shutdown()
        server.stop()
        recorder.stop()
        app.state.tracing.shutdown()
