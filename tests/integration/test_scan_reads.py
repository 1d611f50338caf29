"""The one-off partition reader behind the outbox recovery scan, on the real broker.

A scan starts at a confirmed point the store kept. When that offset is no longer in the
partition (retention deleted it, or the topic was recreated and is shorter now), the read must
start from the oldest record left: starting from the end would skip every record that landed,
and recovery would send them again.
"""

from __future__ import annotations

from contextlib import closing

import pytest
from kafka import TopicPartition

from flywheel.bus import make_producer, read_to_end

pytestmark = pytest.mark.integration


def test_a_start_offset_the_partition_no_longer_holds_reads_what_is_left(kafka_settings, topics):
    with closing(make_producer(kafka_settings, "test")) as producer:
        for i in range(3):
            producer.send(topics.episodes, key=f"k{i}", value=b"v%d" % i, partition=0)
        producer.flush()
    tp = TopicPartition(topics.episodes, 0)
    read = [(t, rec.offset, rec.value) for t, rec in read_to_end(kafka_settings.bootstrap, {tp: 100},
                                                                 client_id="test", timeout_s=20)]
    assert read == [(tp, 0, b"v0"), (tp, 1, b"v1"), (tp, 2, b"v2")]
