"""A relay stage and its feed: the cheapest harness for the stages' shared loop on the real broker
(test_ingest_recovery.py, test_stage_events.py). No stage logic, so what a test sees is the
delivery machinery's own behaviour: at least once, every repeat the resend of a row that was
sent before (docs/exactly-once.md)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

from kafka import KafkaProducer

from flywheel.stream.store import StateStore


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


def count_sends(outbox) -> Counter[bytes]:
    """Count each value ``outbox`` hands its producer from now on, resends included (a send the
    client refused or could not queue is not counted): a value may reach its topic at most as
    many times as it was sent."""
    sent: Counter[bytes] = Counter()
    real = outbox.producer.send

    def send(token: int, topic: str, key: str | None, value: bytes, headers=None) -> None:
        real(token, topic, key, value, headers)
        sent[value] += 1

    outbox.producer.send = send
    return sent


def assert_at_least_once(on_topic: Iterable[bytes], owed: Iterable[bytes], sent: Counter[bytes],
                         others: Iterable[bytes] = ()) -> None:
    """What at-least-once delivery promises a topic: every ``owed`` value is there, nothing but
    those and ``others`` (written by someone else, once each), and no owed value more often than
    it was ``sent``, so a repeat is always the resend of a row that was sent before."""
    got, owed, others = Counter(on_topic), set(owed), Counter(others)
    missing = sorted(owed - set(got))
    stray = sorted(set(got) - owed - set(others))
    assert not missing and not stray, f"{len(missing)} owed values missing (e.g. {missing[:3]}), {len(stray)} " \
                                      f"values nobody owed (e.g. {stray[:3]})"
    extra = {v: n for v, n in got.items() if v in owed and n > sent[v]}
    assert not extra, f"values on the topic more often than they were sent: {dict(list(extra.items())[:3])}"
    assert {v: got[v] for v in others} == dict(others), "records of other writers lost or repeated"
