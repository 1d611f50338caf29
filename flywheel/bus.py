"""Kafka plumbing behind a small interface: make producers and consumers, create topics,
route dead letters, and measure consumer lag.

Every client is configured here from :class:`~flywheel.settings.KafkaSettings`, so stages never
hand-tune kafka-python. Producers are idempotent with ``acks=all``; consumers never auto-commit:
each stage commits offsets only after the effect they stand for is durable (see the stage docs).

Lag is computed from the *fetch high watermark* (``consumer.highwater``), not from
``end_offsets``: the embedded broker reports a wrong end offset, and the fetch response's
watermark is what a real cluster reports too.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Iterable, Protocol

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import TopicAlreadyExistsError
from prometheus_client import CollectorRegistry, Counter, Gauge

from flywheel.contracts import DeadLetterEvent, Topics, encode, now
from flywheel.settings import KafkaSettings

log = logging.getLogger(__name__)


class EventSink(Protocol):
    """Where a stage writes records. Kafka in production and tests; a list in pure unit tests."""

    def write(self, topic: str, key: str | None, value: bytes) -> None: ...

    def flush(self, timeout_s: float | None = None) -> None: ...

    def close(self) -> None: ...


def make_producer(cfg: KafkaSettings, role: str, **overrides: object) -> KafkaProducer:
    opts: dict[str, object] = dict(
        bootstrap_servers=cfg.bootstrap.split(","),
        client_id=f"{cfg.client_id}-{role}",
        acks="all",
        enable_idempotence=True,
        linger_ms=cfg.linger_ms,
        batch_size=256 * 1024,
        max_request_size=cfg.max_request_bytes,
        key_serializer=lambda k: k.encode("utf-8") if isinstance(k, str) else k,
    )
    opts.update(overrides)
    return KafkaProducer(**opts)


def make_consumer(
    cfg: KafkaSettings, role: str, group_id: str | None, topics: Iterable[str] = (), **overrides: object
) -> KafkaConsumer:
    opts: dict[str, object] = dict(
        bootstrap_servers=cfg.bootstrap.split(","),
        client_id=f"{cfg.client_id}-{role}",
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=cfg.session_timeout_ms,
        heartbeat_interval_ms=cfg.heartbeat_interval_ms,
        max_partition_fetch_bytes=cfg.max_request_bytes,
        fetch_max_bytes=max(cfg.max_request_bytes, 50 * 1024 * 1024),
    )
    opts.update(overrides)
    consumer = KafkaConsumer(**opts)
    topics = list(topics)
    if topics:
        consumer.subscribe(topics)
    return consumer


class KafkaSink:
    """:class:`EventSink` over an idempotent producer."""

    def __init__(self, producer: KafkaProducer) -> None:
        self.producer = producer

    def write(self, topic: str, key: str | None, value: bytes) -> None:
        self.producer.send(topic, key=key, value=value)

    def flush(self, timeout_s: float | None = None) -> None:
        self.producer.flush(timeout=timeout_s)

    def close(self) -> None:
        self.producer.close()


def ensure_topics(cfg: KafkaSettings, names: Iterable[str], partitions: int | None = None) -> None:
    """Create the topics that do not exist yet; existing ones are left alone."""
    admin = KafkaAdminClient(bootstrap_servers=cfg.bootstrap.split(","), client_id=f"{cfg.client_id}-admin")
    try:
        existing = set(admin.list_topics())
        new = [
            NewTopic(n, partitions or cfg.partitions, cfg.replication_factor)
            for n in names
            if n not in existing
        ]
        if new:
            try:
                admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass  # another process won the race; the topic is there either way
            log.info("created topics %s", [t.name for t in new])
    finally:
        admin.close()


def topics_for(prefix: str) -> Topics:
    return Topics(prefix)


class DeadLetters:
    """Routes records a stage cannot use to the dead-letter topic, with the original bytes."""

    def __init__(self, sink: EventSink, topic: str, stage: str, registry: CollectorRegistry) -> None:
        self.sink = sink
        self.topic = topic
        self.stage = stage
        self.counter = Counter(
            f"{stage}_deadletters_total",
            "Records sent to the dead-letter topic, by reason",
            ["reason"],
            registry=registry,
        )

    def send(
        self,
        reason: str,
        detail: str,
        *,
        source_topic: str,
        value: bytes | None,
        key: bytes | None = None,
        partition: int | None = None,
        offset: int | None = None,
    ) -> DeadLetterEvent:
        event = DeadLetterEvent(
            stage=self.stage,
            reason=reason,
            detail=detail[:2000],
            source_topic=source_topic,
            source_partition=partition,
            source_offset=offset,
            key_b64=base64.b64encode(key).decode() if key is not None else None,
            value_b64=base64.b64encode(value or b"").decode(),
            failed_at=now(),
        )
        dl_key = key.decode("utf-8", "replace") if key is not None else None
        self.sink.write(self.topic, dl_key, encode(event))
        self.counter.labels(reason).inc()
        return event

    def send_record(self, record: ConsumerRecord, reason: str, detail: str) -> DeadLetterEvent:
        return self.send(
            reason,
            detail,
            source_topic=record.topic,
            value=record.value,
            key=record.key,
            partition=record.partition,
            offset=record.offset,
        )


class LagGauge:
    """``<stage>_consumer_lag_records{topic,partition}`` from the fetch high watermark."""

    def __init__(self, stage: str, registry: CollectorRegistry) -> None:
        self.gauge = Gauge(
            f"{stage}_consumer_lag_records",
            "Records between the consumer's position and the partition's high watermark",
            ["topic", "partition"],
            registry=registry,
        )
        self._last = 0.0

    def update(self, consumer: KafkaConsumer, every_s: float = 1.0) -> None:
        if time.monotonic() - self._last < every_s:
            return
        self._last = time.monotonic()
        for tp in consumer.assignment():
            high = consumer.highwater(tp)
            if high is None:
                continue
            try:
                pos = consumer.position(tp, timeout_ms=100)
            except Exception:  # position unknown during a rebalance; try next time
                continue
            if pos is not None:
                self.gauge.labels(tp.topic, str(tp.partition)).set(max(0, high - pos))


__all__ = [
    "DeadLetters",
    "EventSink",
    "KafkaSink",
    "LagGauge",
    "TopicPartition",
    "ensure_topics",
    "make_consumer",
    "make_producer",
]
