"""Kafka security settings against a secured endpoint: every client kind reaches it, and a wrong
password, an untrusted authority or a plaintext client against TLS is a clear error naming the
setting, not a process waiting for a broker that "does not answer".

The endpoint is the embedded broker behind stunnel (TLS, client certificate required) and a
SASL/SCRAM login (tests/secured_kafka.py says why the broker cannot be secured by itself). The
whole loop over SASL_SSL is the slow test at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from kafka import TopicPartition
from secured_kafka import SecuredBroker, make_certs

from flywheel.kafka.clients import (
    ensure_topics,
    high_watermarks,
    make_consumer,
    make_producer,
    read_to_end,
    topic_ids,
)
from flywheel.kafka.producers import ConfluentOutput
from flywheel.kafka.security import KafkaAccessError, KafkaLoginRefused, connection_of
from flywheel.settings import KafkaSettings

pytestmark = pytest.mark.integration

USER, PASSWORD = "flywheel", "s3cret-" + uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


# SASL_SSL has both a login and TLS, so every refusal is tried on it in the default suite; the
# endpoints with one of the two run in the slow suite (each costs a broker, a tunnel and a gateway)
@pytest.fixture(scope="module", params=["SASL_SSL", pytest.param("SSL", marks=pytest.mark.slow),
                                        pytest.param("SASL_PLAINTEXT", marks=pytest.mark.slow)])
def secured(request, certs, tmp_path_factory):
    with SecuredBroker(request.param, certs, tmp_path_factory.mktemp("stunnel"), {USER: PASSWORD}) as b:
        yield b


def settings_for(b: SecuredBroker, mechanism: str = "SCRAM-SHA-512", **changes: object) -> KafkaSettings:
    kw: dict[str, object] = {"bootstrap": b.bootstrap, "security_protocol": b.protocol,
                             "session_timeout_ms": 2000, "heartbeat_interval_ms": 500, "partitions": 1}
    if b.protocol.startswith("SASL_"):
        kw.update(sasl_mechanism=mechanism, sasl_username=USER, sasl_password=PASSWORD)
    if b.protocol.endswith("SSL"):
        kw.update(ssl_cafile=b.certs.ca, ssl_certfile=b.certs.client_cert, ssl_keyfile=b.certs.client_key)
    return KafkaSettings(**{**kw, **changes})


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_every_client_kind_produces_and_consumes_over_the_secured_endpoint(secured, mechanism):
    cfg = settings_for(secured, mechanism)
    topic = f"t{uuid.uuid4().hex[:10]}.secured"
    ensure_topics(cfg, [topic])  # the admin client (and the access check)

    producer = make_producer(cfg, "test")  # kafka-python
    producer.send(topic, key="a", value=b"from kafka-python").get(timeout=30)
    producer.close()
    out = ConfluentOutput(cfg, "test")  # confluent-kafka (librdkafka)
    out.send(1, topic, "b", b"from confluent-kafka")
    out.flush(30)
    assert [(token, err) for token, err in out.reports()] == [(1, None)]
    out.close()

    tp = TopicPartition(topic, 0)
    assert high_watermarks(cfg, [tp], client_id="test")[tp] == 2
    assert [rec.value for _, rec in read_to_end(cfg, {tp: None}, client_id="test", timeout_s=30)] == \
        [b"from kafka-python", b"from confluent-kafka"]
    consumer = make_consumer(cfg, "test", f"g-{uuid.uuid4().hex[:8]}", [topic])  # a group member
    got: list[bytes] = []
    try:
        for _ in range(100):
            for recs in consumer.poll(timeout_ms=300).values():
                got += [r.value for r in recs]
            if len(got) == 2:
                break
        # another client made from a client's own connection options (the stages' runner does)
        assert topic in topic_ids(connection_of(consumer.config), [topic], client_id="test")
    finally:
        consumer.close()
    assert got == [b"from kafka-python", b"from confluent-kafka"]


def refused(cfg: KafkaSettings, kind: type[KafkaAccessError] = KafkaAccessError) -> str:
    """The refusal's message; only a refused login is a KafkaLoginRefused (``flywheel`` exits 77
    for it, 2 for the rest)."""
    with pytest.raises(KafkaAccessError) as caught:
        ensure_topics(cfg, [f"t{uuid.uuid4().hex[:10]}.never"])
    assert type(caught.value) is kind, caught.value
    return str(caught.value)


def test_a_wrong_password_is_refused_naming_the_password_setting(secured):
    if not secured.protocol.startswith("SASL_"):
        pytest.skip("no login on this endpoint")
    said = refused(settings_for(secured, sasl_password="not-" + PASSWORD), KafkaLoginRefused)
    assert "kafka.sasl_password" in said and f"kafka.sasl_username={USER!r}" in said
    assert PASSWORD not in said
    said = refused(settings_for(secured, sasl_username="nobody"), KafkaLoginRefused)  # a user it does not know
    assert "kafka.sasl_password" in said and "'nobody'" in said


def test_an_untrusted_authority_is_refused_naming_the_cafile_setting(secured):
    if not secured.protocol.endswith("SSL"):
        pytest.skip("no TLS on this endpoint")
    said = refused(settings_for(secured, ssl_cafile=secured.certs.other_ca))
    assert f"kafka.ssl_cafile={secured.certs.other_ca}" in said and "not signed" in said


def test_a_plaintext_client_against_tls_is_told_to_use_tls(secured):
    if not secured.protocol.endswith("SSL"):
        pytest.skip("no TLS on this endpoint")
    said = refused(KafkaSettings(bootstrap=secured.bootstrap))
    assert "speaks TLS" in said and "kafka.security_protocol=PLAINTEXT" in said and "set it to SSL" in said
    if secured.protocol == "SASL_SSL":
        said = refused(settings_for(secured, security_protocol="SASL_PLAINTEXT", ssl_cafile=None,
                                    ssl_certfile=None, ssl_keyfile=None))
        assert "kafka.security_protocol=SASL_PLAINTEXT" in said and "SASL_SSL" in said


def _env(b: SecuredBroker, tmp_path: Path, password: str) -> dict[str, str]:
    """The environment a deployment gives a process: the password as a mounted file."""
    secret = tmp_path / "kafka-password"
    secret.write_text(password + "\n")
    return {"FLYWHEEL_KAFKA_BOOTSTRAP": b.bootstrap, "FLYWHEEL_KAFKA_SECURITY_PROTOCOL": b.protocol,
            "FLYWHEEL_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256", "FLYWHEEL_KAFKA_SASL_USERNAME": USER,
            "FLYWHEEL_KAFKA_SASL_PASSWORD_FILE": str(secret), "FLYWHEEL_KAFKA_SSL_CAFILE": str(b.certs.ca),
            "FLYWHEEL_KAFKA_SSL_CERTFILE": str(b.certs.client_cert),
            "FLYWHEEL_KAFKA_SSL_KEYFILE": str(b.certs.client_key)}


def test_a_stage_and_the_deadletters_tool_exit_with_the_setting_to_fix(secured, tmp_path):
    """Whole processes: a stage started with a wrong password exits 77 (an authentication
    failure, as for a refused release token; 2 is a usage error) saying which setting, as
    ``flywheel deadletters`` does; neither waits for a broker that 'does not answer'."""
    if secured.protocol != "SASL_SSL":
        pytest.skip("one endpoint is enough for whole processes")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(_env(secured, tmp_path, "not-" + PASSWORD), FLYWHEEL_DATA_DIR=str(tmp_path),
               FLYWHEEL_TOPIC_PREFIX=f"t{uuid.uuid4().hex[:10]}.", FLYWHEEL_INGEST_PORT="0")
    for args in (["ingest"], ["deadletters", "summary"]):
        run = subprocess.run([sys.executable, "-m", "cli", *args], env=env, capture_output=True, text=True,
                             timeout=120, check=False)
        assert run.returncode == 77, (args, run.stdout[-2000:], run.stderr[-2000:])
        assert "kafka.sasl_password" in run.stderr and "refused the SASL login" in run.stderr, run.stderr[-2000:]


@pytest.mark.slow
def test_the_loop_runs_over_sasl_ssl(certs, tmp_path):
    """The short demo with every process on a SASL_SSL endpoint (client certificates too):
    serving records, ingest and reward label, the trainer publishes and a version is canaried."""
    from test_demo import run_demo

    for part in ("stunnel", "run"):
        (tmp_path / part).mkdir()
    with SecuredBroker("SASL_SSL", certs, tmp_path / "stunnel", {USER: PASSWORD}) as b:
        got = run_demo(tmp_path / "run", "--duration", "45", "--seed", "1",
                       env_extra={**_env(b, tmp_path, PASSWORD), "FLYWHEEL_TRAINER_PUBLISH_EVERY_STEPS": "2"})
        assert b.gateway is not None and b.gateway.refused == 0
    s = got["summary"]
    assert s["versions"]["0"]["requests"] > 0  # serving recorded generations and feedback
    assert s["canaried"], got["said"]  # ingest joined, reward labeled, the trainer published
    ledger = (got["root"] / "checkpoints" / f"v{s['canaried'][0]:08d}" / "ledger.json").read_text()
    assert '"trained"' in ledger
