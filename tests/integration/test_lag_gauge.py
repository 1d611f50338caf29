"""``<stage>_consumer_lag_records{topic,partition}`` on the real broker: the records between the
consumer's position and the fetch high watermark (the broker's reported end offsets are wrong,
see docs/architecture.md), per partition, falling to 0 once the consumer has read everything."""

from __future__ import annotations

import time
from contextlib import closing

import pytest
from kafka import TopicPartition
from prometheus_client import CollectorRegistry

from flywheel.kafka.clients import make_consumer, make_producer
from flywheel.kafka.lag import LagGauge

pytestmark = pytest.mark.integration


def test_lag_is_what_each_partition_has_left_to_read(kafka_settings, topics):
    with closing(make_producer(kafka_settings, "test")) as producer:
        for i in range(10):
            producer.send(topics.episodes, key=f"k{i}", value=b"v", partition=0)
        for i in range(3):
            producer.send(topics.episodes, key=f"k{i}", value=b"v", partition=1)
        producer.flush()
    registry = CollectorRegistry()
    lag = LagGauge("ingest", registry)
    tps = [TopicPartition(topics.episodes, p) for p in (0, 1)]

    def sample(p: int) -> float | None:
        return registry.get_sample_value("ingest_consumer_lag_records", {"topic": topics.episodes, "partition": str(p)})

    with closing(make_consumer(kafka_settings, "test", None, max_poll_records=4)) as consumer:
        consumer.assign(tps)
        consumer.seek(tps[0], 0)
        consumer.seek(tps[1], 0)
        read: dict[int, int] = {0: 0, 1: 0}
        deadline = time.monotonic() + 20
        # read a few records, until a fetch has told the high watermark of each partition
        while (sum(read.values()) < 4 or None in map(consumer.highwater, tps)) and time.monotonic() < deadline:
            for tp, recs in consumer.poll(timeout_ms=200, max_records=2).items():
                read[tp.partition] += len(recs)
        lag.update(consumer, every_s=0)
        assert 4 <= sum(read.values()) < 13
        assert {p: sample(p) for p in (0, 1)} == {0: 10 - read[0], 1: 3 - read[1]}
        while sum(read.values()) < 13 and time.monotonic() < deadline:
            for tp, recs in consumer.poll(timeout_ms=200).items():
                read[tp.partition] += len(recs)
        lag.update(consumer, every_s=0)
        assert (sample(0), sample(1)) == (0.0, 0.0)
        # partition 1 moves to another member: its lag is that member's to report, not a value
        # frozen here (a lagging partition taken away would keep a lag alert firing)
        consumer.seek(tps[0], 5)
        consumer.assign([tps[0]])
        lag.update(consumer, every_s=0)
        assert (sample(0), sample(1)) == (5.0, None)
