"""A relay stage and its feed: the cheapest harness for the stages' shared loop on the real broker
(test_ingest_recovery.py, test_stage_events.py). No stage logic, so what a test sees is the
exactly-once machinery's own behaviour."""

from __future__ import annotations

import time

from kafka import KafkaProducer

from ingest.exactly_once import StateStore


class Crash(Exception):
    """A process "killed" at the point a test makes a call raise it."""


class Relay:
    """A stage that sends every input record on unchanged (``slow_s``: each of its first
    ``slow_batches`` batches takes that long, as with a slow labeler inside the turn)."""

    def __init__(self, store: StateStore, out: str, slow_s: float = 0.0, slow_batches: int = 0) -> None:
        self.store, self.out, self.slow_s, self.slow_batches, self.batches = store, out, slow_s, slow_batches, 0

    def process(self, records, now: float) -> None:
        self.batches += 1
        if self.batches <= self.slow_batches:
            time.sleep(self.slow_s)
        for rec in records:
            self.store.append(rec.partition, self.out, rec.key.decode(), rec.value)

    def tick(self, shards: set[int], now: float) -> None:
        return None


def feed(kafka_settings, topic: str, n: int, key: str = "g", value: str = "v") -> list[bytes]:
    """``n`` records on ``topic``, keyed ``<key><i>`` with value ``<value><i>``; their values."""
    producer = KafkaProducer(bootstrap_servers=kafka_settings.bootstrap)
    values = [f"{value}{i}".encode() for i in range(n)]
    for i, v in enumerate(values):
        producer.send(topic, key=f"{key}{i}".encode(), value=v)
    producer.flush()
    producer.close()
    return values
