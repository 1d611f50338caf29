"""The embedded broker speaks Kafka: produce/consume through the project's own client factories."""

import pytest

from flywheel.kafka.clients import make_consumer, make_producer

pytestmark = pytest.mark.integration


def test_round_trip_and_group_commit(kafka_settings, topics):
    producer = make_producer(kafka_settings, "test")
    for i in range(20):
        producer.send(topics.feedback, key=f"k{i}", value=f"v{i}".encode())
    producer.flush()
    producer.close()

    consumer = make_consumer(kafka_settings, "test", "g1", [topics.feedback])
    seen = []
    for _ in range(40):
        for recs in consumer.poll(timeout_ms=250).values():
            seen.extend(r.value for r in recs)
        if len(seen) >= 20:
            break
    consumer.commit()
    consumer.close()
    assert sorted(seen) == sorted(f"v{i}".encode() for i in range(20))

    # a new member of the same group resumes after the committed offsets: nothing is re-read
    again = make_consumer(kafka_settings, "test", "g1", [topics.feedback])
    more = []
    for _ in range(12):
        for recs in again.poll(timeout_ms=250).values():
            more.extend(recs)
    again.close()
    assert more == []
