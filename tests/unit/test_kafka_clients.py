"""flywheel/kafka/clients.py: read_to_end's time limit is on going nowhere, not on the whole read; topics are
created to take the records the stages write.

Fakes stand in for Kafka here: what is tested is the loop's clock, which a real broker
cannot be made to pace, and the settings a topic is created with, which the embedded broker does not
report back. tests/integration/test_scan_reads.py reads the real broker.
"""

from __future__ import annotations

import time

import pytest
from kafka import TopicPartition

from flywheel.kafka import clients as bus
from flywheel.settings import KafkaSettings

TP = TopicPartition("t", 0)


class _Trickle:
    """A partition of ``n`` records that arrive one per poll, each after ``gap_s``; no high
    watermark at all when ``n`` is None (a partition without a leader)."""

    def __init__(self, n: int | None, gap_s: float) -> None:
        self.n, self.gap_s, self.pos = n, gap_s, 0

    def __call__(self, **_: object) -> _Trickle:
        return self

    def assign(self, tps) -> None: ...

    def seek(self, tp, offset) -> None:
        self.pos = offset

    def poll(self, timeout_ms: int):
        time.sleep(self.gap_s)
        if self.n is None or self.pos >= self.n:
            return {}
        self.pos += 1
        return {TP: [self.pos - 1]}

    def highwater(self, tp):
        return self.n

    def position(self, tp):
        return self.pos

    def close(self) -> None: ...


def test_a_read_that_keeps_getting_records_runs_past_the_limit(monkeypatch):
    monkeypatch.setattr(bus, "KafkaConsumer", _Trickle(8, 0.1))
    started = time.monotonic()
    got = [rec for _, rec in bus.read_to_end(KafkaSettings(bootstrap="b:9092"), {TP: 0}, client_id="t", timeout_s=0.35)]
    assert got == list(range(8)) and time.monotonic() - started > 0.35


def test_a_read_that_gets_nowhere_is_a_timeout_the_stages_retry(monkeypatch):
    monkeypatch.setattr(bus, "KafkaConsumer", _Trickle(None, 0.05))
    with pytest.raises(TimeoutError, match="no progress in 0s"):
        list(bus.read_to_end(KafkaSettings(bootstrap="b:9092"), {TP: 0}, client_id="t", timeout_s=0.3))


def test_topics_are_created_to_take_records_as_large_as_a_produce_request(monkeypatch):
    """Kafka's default limit (about 1 MB) refuses valid episodes, at every try."""
    created = []

    class Admin:
        def __init__(self, **_: object) -> None: ...

        def list_topics(self):
            return ["old"]

        def create_topics(self, topics):
            created.extend(topics)

        def close(self) -> None: ...

    monkeypatch.setattr(bus, "KafkaAdminClient", Admin)
    monkeypatch.setattr(bus, "check_access", lambda cfg, timeout_s: True)  # no broker here
    bus.ensure_topics(KafkaSettings(max_request_bytes=9 << 20), ["old", "new"])
    assert [(t.name, t.topic_configs) for t in created] == [("new", {"max.message.bytes": str(9 << 20)})]
