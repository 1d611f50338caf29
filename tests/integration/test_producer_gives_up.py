"""A producer that gave up on a send (a broker stall longer than ``delivery_timeout_ms``) must not
stop the process from delivering once the broker answers again.

kafka-python's idempotent producer drops its producer id when it expires a batch that was already
on the wire, and then never asks for a new one: every later send waits forever. Flywheel's senders
retire such a producer and make a new one. Short timeouts here stand for the two-minute default.
"""

from __future__ import annotations

import time

import pytest

from flywheel.kafka.clients import make_producer
from flywheel.kafka.producers import KafkaSink, make_output_producer
from tests.conftest import read_all

pytestmark = pytest.mark.integration

STALL_S = 15.0  # the longest the broker is held: a send gives up after about 3 s


def _short(kafka_settings, **update):
    return kafka_settings.model_copy(update={
        "request_timeout_ms": 1000, "delivery_timeout_ms": 3000, "linger_ms": 0, **update})


def _wait(cond, timeout_s: float, what: str, step=lambda: None) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        step()
        time.sleep(0.1)


@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_stage_output_delivers_again_after_its_producer_gave_up_on_a_send(broker, kafka_settings, topics,
                                                                           client):
    cfg = _short(kafka_settings, producer_client=client)
    out = make_output_producer(cfg, "gives-up")
    reports: dict[int, BaseException | None] = {}

    def collect():
        for token, error in out.reports():
            reports[token] = error

    out.send(1, topics.episodes, "k1", b"v1")
    _wait(lambda: 1 in reports, 10, "first send not acked", collect)
    assert reports[1] is None

    broker.pause()
    try:
        out.send(2, topics.episodes, "k2", b"v2")
        _wait(lambda: 2 in reports, STALL_S, "the producer never gave up on the send", collect)
        assert reports[2] is not None  # reported failed: the outbox sends it again
    finally:
        broker.resume()

    # as the outbox does: a send reported failed is sent again (here each try has a token of its
    # own, so the reports of tries that fail while the broker comes back are told apart)
    token = 3
    out.send(token, topics.episodes, "k3", b"v3")
    deadline = time.monotonic() + 30
    while reports.get(token, False) is not None:
        assert time.monotonic() < deadline, f"nothing delivered after the broker came back: {reports}"
        if token in reports:
            token += 1
            out.send(token, topics.episodes, "k3", b"v3")
        collect()
        time.sleep(0.1)
    retired = out.producer.retired if client == "kafka-python" else out.retired
    assert retired == 1  # the producer that gave up was replaced, and the new one delivers
    out.close()
    keys = [r.key for r in read_all(kafka_settings.bootstrap, topics.episodes, expect=2)]
    assert b"k1" in keys and b"k3" in keys


def test_sink_delivers_what_it_owes_after_its_producer_gave_up_on_a_send(broker, kafka_settings, topics):
    cfg = _short(kafka_settings)
    sink = KafkaSink(lambda: make_producer(cfg, "sink-gives-up", max_block_ms=1000,
                                                  bootstrap_timeout_ms=1000))
    sink.write(topics.deadletter, "k0", b"v0")
    assert sink.settle(10)

    broker.pause()
    try:
        sink.write(topics.deadletter, "k1", b"v1")
        _wait(lambda: sink.producer.retired == 1, STALL_S, "the producer never gave up on the send", sink.settle)
        assert sink.unacked == 1 and sink.producer.made == 1  # the next one needs the broker
    finally:
        broker.resume()

    sink.write(topics.deadletter, "k2", b"v2")
    _wait(lambda: sink.settle(1.0), 30, f"{sink.unacked} records still owed after the broker came back")
    assert sink.producer.made == 2
    sink.close()
    keys = [r.key for r in read_all(kafka_settings.bootstrap, topics.deadletter, expect=3)]
    # at least once: the paused broker may still append the request it held when it resumes
    assert set(keys) == {b"k0", b"k1", b"k2"} and keys.count(b"k0") == keys.count(b"k2") == 1

