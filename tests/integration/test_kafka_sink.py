"""flywheel.kafka.producers.KafkaSink on the real broker: a record is owed until Kafka acks it, whatever fails.

The broker is paused (SIGSTOP): a queued send waits for its ack, and a send to a topic the producer
has no metadata for cannot even be queued. That one is sent again once the broker answers, and
``settle`` says all is acked only then. (A send the producer gives up on is sent again too:
tests/unit/test_kafka_sink_retry.py.)
"""

from __future__ import annotations

import time

import pytest

from flywheel.kafka.clients import ensure_topics, make_producer
from flywheel.kafka.producers import KafkaSink
from tests.conftest import read_all

pytestmark = pytest.mark.integration


def test_sends_that_fail_or_cannot_be_queued_are_kept_and_sent_again(broker, kafka_settings, topics):
    sends = []

    def counted_producer():
        producer = make_producer(kafka_settings, "sink-test", max_block_ms=1000, linger_ms=0)
        real_send = producer.send
        producer.send = lambda topic, **kw: sends.append(topic) or real_send(topic, **kw)
        return producer

    sink = KafkaSink(counted_producer)
    sink.write(topics.deadletter, "k0", b"v0")
    assert sink.settle(10) and sink.stuck_s() == 0
    fresh = f"{topics.prefix}fresh"  # created after the producer's last metadata: unknown to it
    ensure_topics(kafka_settings, [fresh])

    broker.pause()
    try:
        sink.write(topics.deadletter, "k1", b"v1")  # queued, not acked in the stall
        sink.write(fresh, "k2", b"v2")  # no metadata for this topic: cannot be queued
        sink.write(fresh, "k3", b"v3")  # not even tried: it would block as long again
        assert sends == [topics.deadletter, topics.deadletter, fresh]
        time.sleep(2.0)
        assert not sink.settle()
        assert sink.unacked == 3 and sink.stuck_s() > 1.5
        assert sends[3:] == [fresh]  # tried again (and not queued again), k3 still waits its turn
    finally:
        broker.resume()

    deadline = time.monotonic() + 30
    while not sink.settle(1.0):
        assert time.monotonic() < deadline, f"{sink.unacked} records still owed after the broker came back"
    assert sink.stuck_s() == 0
    sink.close()
    assert sorted(r.key for r in read_all(kafka_settings.bootstrap, fresh, expect=2)) == [b"k2", b"k3"]
    assert sorted(r.key for r in read_all(kafka_settings.bootstrap, topics.deadletter, expect=2)) == [b"k0", b"k1"]
