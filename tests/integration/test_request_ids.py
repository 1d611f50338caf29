"""A request's id and trace, from its answer to the trainer's ledger (flywheel/telemetry.py).

A real serving app on the session's shared vLLM engine answers a request that names its
``X-Request-Id``; the real ingest and reward stages (threads of this process) and a real trainer
(DeepSpeed on the CPU, in this process) take its records from the session's broker. The id is in
the answer, a JSON log line, and the Kafka headers of the generation, episode and reward records,
and the trainer's ledger names it. With ``telemetry.otlp_endpoint`` set to an in-process OTLP
collector (tests/otlp_collector.py), the request's span and the stages' spans for its records are
in one trace, the collector named by the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` read through the
settings. Traces off (``FLYWHEEL_TELEMETRY_OTLP_ENDPOINT`` empty, beside that variable) export
nothing, and a collector that fails fails no request.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import read_all, running, stage_settings
from otlp_collector import Collector

from flywheel.logs import ContextIds, JsonFormatter
from flywheel.settings import OTEL_ENDPOINT_ENV, TelemetrySettings, load_settings
from flywheel.telemetry import REQUEST_ID_HEADER, TRACEPARENT, Tracing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_helpers import ROOT, make_trainer

pytestmark = pytest.mark.integration

RID = "req-e2e.1:a"
CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def header(record, name: str) -> str | None:
    values = [v.decode() for n, v in record.headers or () if n == name]
    assert len(values) <= 1, record.headers
    return values[0] if values else None


class JsonLines(logging.Handler):
    """The JSON lines a process configured with ``--log-format json`` would write."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(JsonFormatter())
        self.addFilter(ContextIds())
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


def test_a_request_id_rides_from_the_answer_to_the_trainers_ledger_in_one_trace(
        serve, broker, kafka_settings, topics, tiny_model_dir, tmp_path):
    from ingest.main import run as run_ingest
    from reward.main import run as run_reward

    logs, served_logs = JsonLines(), logging.getLogger("serving")
    level = served_logs.level
    served_logs.addHandler(logs)
    served_logs.setLevel(logging.INFO)
    try:
        with Collector() as collector:
            # the SDK's standard variable, read as production reads it, turns traces on
            telemetry = load_settings(env={OTEL_ENDPOINT_ENV: collector.url}).telemetry
            assert telemetry.otlp_endpoint == collector.url
            app = serve(prefix=topics.prefix, telemetry=telemetry)
            r = app.post("/v1/completions", {"model": "flywheel", "prompt": "the river", "max_tokens": 3},
                         headers={"X-Request-Id": RID})
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == RID
            gid = r.json()["choices"][0]["generation_id"]
            # a client's own trace: the feedback request's span joins it
            fb = app.post("/v1/feedback", {"feedback_id": "fb-1", "generation_id": gid, "signal": "accept"},
                          headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
            assert fb.status_code == 202, fb.text
            feedback_rid = fb.headers["x-request-id"]
            assert re.fullmatch(r"[0-9a-f]{32}", feedback_rid)  # none given: one made

            # the episode leaves as soon as the accept arrives (emit_after_signal_s 0)
            settings = stage_settings(kafka_settings, topics, tmp_path / "stages", FLYWHEEL_INGEST_WINDOW_S="5",
                                      FLYWHEEL_INGEST_GRACE_S="0", FLYWHEEL_INGEST_EMIT_AFTER_SIGNAL_S="0",
                                      FLYWHEEL_TELEMETRY_OTLP_ENDPOINT=collector.url)
            with running(run_ingest, settings), running(run_reward, settings):
                rewards = read_all(broker.bootstrap, topics.rewards, expect=1, timeout_s=60)
            app.tracing.flush()  # (the stages' spans were exported as they stopped)
            spans = {name: collector.named(name) for name in
                     ("POST /v1/completions", "publish generation", "ingest generation", "ingest episode",
                      "reward label", "POST /v1/feedback", "publish feedback")}
    finally:
        served_logs.removeHandler(logs)
        served_logs.setLevel(level)

    [generation] = read_all(broker.bootstrap, topics.generations, expect=0)  # (all there: a reward came of them)
    [feedback] = read_all(broker.bootstrap, topics.feedback, expect=0)
    [episode] = read_all(broker.bootstrap, topics.episodes, expect=0)
    [reward] = rewards
    assert [header(rec, REQUEST_ID_HEADER) for rec in (generation, episode, reward)] == [RID] * 3
    assert header(feedback, REQUEST_ID_HEADER) == feedback_rid  # its own request's
    [line] = [x for x in logs.lines if x.get("request_id") == RID]
    assert line["logger"] == "serving.request_ids" and line["message"].startswith("POST /v1/completions 200")

    # the trainer's ledger: the reward record as the broker gave it
    trainer = make_trainer(tiny_model_dir, tmp_path / "trainer", topic_prefix=topics.prefix, loss="reinforce")
    trainer.start()
    trainer._intake(reward)
    [sample] = trainer.batcher.waiting()
    trainer._train([sample.event], [sample.pos])
    assert trainer.publish()
    ledger = trainer.store.ledger(trainer.version)
    assert ledger["trained"] == [gid] and ledger["requests"] == {gid: RID}

    # one trace, from the request's span through the stages' spans for its records
    assert all(len(found) == 1 for found in spans.values()), {n: len(f) for n, f in spans.items()}
    request, published, ingested, episode_span, labeled = (spans[n][0] for n in (
        "POST /v1/completions", "publish generation", "ingest generation", "ingest episode", "reward label"))
    assert {s.trace_id for s in (request, published, ingested, episode_span, labeled)} == {request.trace_id}
    assert (published.parent_id, ingested.parent_id, episode_span.parent_id, labeled.parent_id) == (
        request.span_id, published.span_id, ingested.span_id, episode_span.span_id)
    assert (request.service, ingested.service, labeled.service) == ("flywheel-serving", "flywheel-ingest",
                                                                     "flywheel-reward")
    assert request.attributes["flywheel.request_id"] == RID and labeled.attributes["flywheel.generation_id"] == gid
    assert header(reward, TRACEPARENT).split("-")[1:3] == [request.trace_id, labeled.span_id]
    fb_span = spans["POST /v1/feedback"][0]
    assert (fb_span.trace_id, fb_span.parent_id) == (CLIENT_TRACE, CLIENT_SPAN)
    assert spans["publish feedback"][0].trace_id == CLIENT_TRACE


def test_every_answer_names_its_request_id_and_no_trace_leaves_when_traces_are_off(serve, broker, topics,
                                                                                    monkeypatch):
    """A safe id is kept, an unsafe one replaced; a 401, a 404 and a probe are stamped too.

    Traces off while the SDK's standard variable names a collector: set, the variable turns
    traces on (the settings read it as ``telemetry.otlp_endpoint``, the first test), so off here is
    ``FLYWHEEL_TELEMETRY_OTLP_ENDPOINT`` set empty, which wins over it. The variable stays in the
    process's environment too, where the OpenTelemetry SDK's exporter would read it: no span is
    exported all the same (only the settings turn export on), and records carry the request id
    without a trace."""
    with Collector() as collector:
        env = {OTEL_ENDPOINT_ENV: collector.url, "FLYWHEEL_TELEMETRY_OTLP_ENDPOINT": ""}
        monkeypatch.setenv(OTEL_ENDPOINT_ENV, collector.url)
        telemetry = load_settings(env=env).telemetry
        assert telemetry.otlp_endpoint == ""
        app = serve(prefix=topics.prefix, telemetry=telemetry)
        body = {"model": "flywheel", "prompt": "the river", "max_tokens": 2}
        for sent, kept in (("a" * 128, True), ("a" * 129, False), ("two words", False), ("<script>", False)):
            r = app.post("/v1/completions", body, headers={"X-Request-Id": sent})
            assert r.status_code == 200, r.text
            assert (r.headers["x-request-id"] == sent) is kept
            assert kept or re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
        assert app.post("/v1/completions", body, key=None, headers={"X-Request-Id": "k-1"}).headers["x-request-id"] == "k-1"
        import httpx

        for path in ("/nowhere", "/health", "/metrics"):
            assert httpx.get(app.url + path, headers={"X-Request-Id": "p-1"}).headers["x-request-id"] == "p-1"
        records = read_all(broker.bootstrap, topics.generations, expect=4)
        assert len(records) == 4 and all(header(rec, REQUEST_ID_HEADER) for rec in records)
        assert all(header(rec, TRACEPARENT) is None for rec in records)
        app.tracing.flush()
        alone = Tracing(TelemetrySettings(), "serving")
        with alone.request_span("GET /x", {}):
            assert alone.record_headers("generation", "r-1") == [(REQUEST_ID_HEADER, b"r-1")]
        alone.shutdown()
        assert collector.posts == 0


def test_a_collector_that_fails_fails_no_request(serve, topics):
    with Collector(status=503) as collector:
        app = serve(prefix=topics.prefix,
                    telemetry=TelemetrySettings(otlp_endpoint=collector.url, export_timeout_s=1.0))
        r = app.post("/v1/completions", {"model": "flywheel", "prompt": "the river", "max_tokens": 2})
        assert r.status_code == 200, r.text
        gid = r.json()["choices"][0]["generation_id"]
        assert app.post("/v1/feedback", {"feedback_id": "f", "generation_id": gid, "signal": "accept"}).status_code == 202
        app.tracing.flush(timeout_s=5)
        assert collector.posts >= 1  # it was asked, and refused
    app.tracing.flush(timeout_s=2)  # and gone: still nothing raised
    assert app.post("/v1/completions", {"model": "flywheel", "prompt": "again", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("how", ["flag", "env"])
def test_json_logs_from_the_command_line(broker, how):
    """Every stderr line is a JSON object, the settings' own warning (logged while they load,
    before they say which format) included."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    # a prefix of its own: `flywheel topics` makes the topics as declared (the tests' topics
    # fixture makes them with the session's partition count, which it would report as drift, exit 1)
    env.update(FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap, FLYWHEEL_TOPIC_PREFIX=f"t{uuid.uuid4().hex[:10]}.",
               FLYWHEEL_NO_SUCH_SETTING="1", PYTHONPATH=str(ROOT))
    args = ["--log-format", "json"] if how == "flag" else []
    if how == "env":
        env["FLYWHEEL_LOG_FORMAT"] = "json"
    out = subprocess.run([sys.executable, "-m", "cli", *args, "topics"], env=env, capture_output=True, text=True, check=False,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert {"time", "level", "logger", "message"} <= set(lines[0])
    assert any("FLYWHEEL_NO_SUCH_SETTING" in x["message"] and x["level"] == "WARNING" for x in lines)
    assert any(x["message"].startswith("settings {") for x in lines)
