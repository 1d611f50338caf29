"""The release controller's Kafka side with production consumer settings: a controller that polls
briefly once a tick still joins its group and sees the checkpoints (it once never did)."""

from __future__ import annotations

import time

import pytest

from flywheel.contracts import CheckpointEvent, encode
from flywheel.kafka.clients import make_producer
from flywheel.metrics import new_registry
from flywheel.settings import KafkaSettings, ReleaseSettings, Settings
from release.streams import Streams

pytestmark = pytest.mark.integration


def test_a_controller_ticking_once_a_second_joins_its_group_and_reads_checkpoints(broker, topics):
    kafka = KafkaSettings(bootstrap=broker.bootstrap)  # the defaults: a 10 s session, as deployed
    settings = Settings(kafka=kafka, topic_prefix=topics.prefix,
                        release=ReleaseSettings(group_id=f"release-{topics.prefix}"))
    streams = Streams(settings, new_registry())
    try:
        producer = make_producer(kafka, "test")
        event = CheckpointEvent(version=1, parent=0, step=1, uri="/store/v00000001", manifest_sha256="a" * 64,
                                dtype="F32", full_snapshot=False, samples=16, created_at=time.time())
        producer.send(topics.checkpoints, key=b"1", value=encode(event)).get(timeout=10)
        producer.close()
        got, deadline = [], time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            got = streams.new_checkpoints()  # what each controller turn does, a tick apart
            time.sleep(1.0)
        assert [c["version"] for c in got] == [1]
    finally:
        streams.close()
