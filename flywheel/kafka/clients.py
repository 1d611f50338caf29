"""Kafka clients configured from :class:`~flywheel.settings.KafkaSettings`, so no caller
hand-tunes kafka-python: producers, consumers, topic creation and one-off reads.

Producers are idempotent with ``acks=all``; consumers never auto-commit (each stage commits
offsets only after the effect they stand for is durable) and read ``read_committed`` (records of
open or aborted transactions are no input). Every consumer made here has the client patches
installed first (flywheel/kafka/patches.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaTimeoutError, TopicAlreadyExistsError

from flywheel.kafka.batches import require_codecs
from flywheel.kafka.patches import install_client_patches
from flywheel.kafka.security import check_access, kafka_python_options
from flywheel.settings import KafkaSettings

log = logging.getLogger(__name__)


def make_producer(cfg: KafkaSettings, role: str, **overrides: object) -> KafkaProducer:
    opts: dict[str, object] = {
        **kafka_python_options(cfg),
        "client_id": f"{cfg.client_id}-{role}",
        "acks": "all",
        "enable_idempotence": True,
        "linger_ms": cfg.linger_ms,
        "request_timeout_ms": cfg.request_timeout_ms,
        "delivery_timeout_ms": cfg.delivery_timeout_ms,
        "batch_size": 256 * 1024,
        "max_request_size": cfg.max_request_bytes,
        "key_serializer": lambda k: k.encode("utf-8") if isinstance(k, str) else k,
    }
    opts.update(overrides)
    return KafkaProducer(**opts)


def force_close(producer: KafkaProducer) -> None:
    """Close a kafka-python producer now, failing its unsent batches rather than waiting on them.

    kafka-python's ``close(timeout=0)`` flushes first and raises when batches are pending, so it
    never reaches its own force-close step; do that step here (the sender then fails the pending
    futures) and mark the producer closed so its finaliser does not try to flush again.
    """
    try:
        producer.close(timeout=0)
        return
    except Exception:
        log.debug("producer close(timeout=0) raised; forcing", exc_info=True)
    sender = getattr(producer, "_sender", None)
    if sender is not None:
        sender.force_close()
        # Its I/O thread fails the pending sends on its way out. Wait for that, so every send of
        # the old producer is reported before the next producer's: its callers then resend in
        # order of failure.
        sender.join(timeout=10.0)
    if hasattr(producer, "_closed"):
        producer._closed = True



def make_consumer(
    cfg: KafkaSettings, role: str, group_id: str | None, topics: Iterable[str] = (), **overrides: object
) -> KafkaConsumer:
    opts: dict[str, object] = {
        **kafka_python_options(cfg),
        "client_id": f"{cfg.client_id}-{role}",
        "group_id": group_id,
        "enable_auto_commit": False,
        # A product may write the input topics in transactions: the records of one still open
        # may yet be aborted, and aborted ones are no input (flywheel/kafka/ends.py).
        "isolation_level": "read_committed",
        "auto_offset_reset": "earliest",
        "session_timeout_ms": cfg.session_timeout_ms,
        "heartbeat_interval_ms": cfg.heartbeat_interval_ms,
        "max_poll_interval_ms": cfg.max_poll_interval_ms,
        "max_partition_fetch_bytes": cfg.max_request_bytes,
        "fetch_max_bytes": max(cfg.max_request_bytes, 50 * 1024 * 1024),
    }
    opts.update(overrides)
    require_codecs()
    install_client_patches()
    consumer = KafkaConsumer(**opts)
    topics = list(topics)
    if topics:
        consumer.subscribe(topics)
    return consumer


#: The id a broker gives when it has none for a topic (before Kafka 2.8, some compatible brokers).
NO_TOPIC_ID = "00000000-0000-0000-0000-000000000000"


def topic_ids(connection: Mapping[str, object], topics: Iterable[str], *, client_id: str) -> dict[str, str]:
    """Each topic's id: a UUID the broker gives a topic when it is created, so a topic deleted and
    created again under the same name has another. Topics that do not exist, or that the broker
    gives no id, are left out (whoever asks then cannot tell, and goes on as before).

    ``connection``: how to reach the brokers, :func:`kafka_python_options` of the settings or
    :func:`~flywheel.kafka.security.connection_of` a client that reaches them."""
    admin = KafkaAdminClient(**connection, client_id=client_id)
    try:
        described = admin.describe_topics(sorted(set(topics)))
    finally:
        admin.close()
    return {d["name"]: d["topic_id"] for d in described
            if not d.get("error_code") and d.get("topic_id") not in (None, "", NO_TOPIC_ID)}


def partitions_of(consumer: KafkaConsumer, topic: str, timeout_s: float = 30.0) -> set[int]:
    """``topic``'s partition numbers, waiting for its metadata; RuntimeError if it never comes."""
    deadline = time.monotonic() + timeout_s
    while not (parts := consumer.partitions_for_topic(topic)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no metadata for topic {topic}")
        time.sleep(0.1)
    return set(parts)


def read_to_end(cfg: KafkaSettings, starts: dict[TopicPartition, int | None], *, client_id: str,
                timeout_s: float = 60.0, max_fetch_bytes: int = 8 * 1024 * 1024,
                ) -> Iterator[tuple[TopicPartition, ConsumerRecord]]:
    """Every record of each partition from its start offset (None: its beginning) up to the high
    watermark the reads see; TimeoutError if the reads get no further for ``timeout_s`` (a
    partition without a leader, a broker that does not answer: the stages retry that turn).
    A start the partition no longer holds reads from its oldest record.

    No consumer group: a one-off read (``flywheel deadletters``).
    """
    install_client_patches()
    # A start offset the partition no longer holds reads from the oldest record left, never from
    # the end: a reader asked for everything after a point must not skip what is there. earliest covers a start that retention deleted (kafka-python's
    # default is the end); the loop below covers a start past the end.
    consumer = KafkaConsumer(**kafka_python_options(cfg), group_id=None, client_id=client_id,
                             enable_auto_commit=False, max_partition_fetch_bytes=max_fetch_bytes,
                             auto_offset_reset="earliest")
    try:
        consumer.assign(list(starts))
        for tp, offset in starts.items():
            if offset is None:
                consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, offset)
        remaining = set(starts)
        # a limit on going nowhere, not on the whole read: a read of a long partition takes as
        # long as it takes while records come
        deadline = time.monotonic() + timeout_s
        while remaining:
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {sorted(remaining)} to the end: no progress in {timeout_s:.0f}s")
            for tp, recs in consumer.poll(timeout_ms=200).items():
                if recs:
                    deadline = time.monotonic() + timeout_s
                for rec in recs:
                    yield tp, rec
            for tp in list(remaining):
                high = consumer.highwater(tp)
                if high is None:
                    continue
                position = consumer.position(tp)
                if position > high:
                    # a start past the end: the topic was recreated since the offset was kept, so
                    # every record in it is newer than that offset
                    log.warning("%s ends at offset %d, before the start %d: reading it from its beginning",
                                tp, high, position)
                    consumer.seek_to_beginning(tp)
                elif position >= high:
                    remaining.discard(tp)
    finally:
        consumer.close()


def high_watermarks(cfg: KafkaSettings, tps: Iterable[TopicPartition], *, client_id: str,
                    timeout_s: float = 30.0) -> dict[TopicPartition, int]:
    """Each partition's end (the offset its next record will get), from a fetch response.

    A fetch's high watermark, not ``end_offsets``: it is what the brokers report to consumers
    as they read, and the embedded development broker answers offset requests wrongly
    (local/broker.py). TimeoutError if some partition gives none in ``timeout_s`` (no leader).
    """
    install_client_patches()
    tps = list(tps)
    # One byte per partition and fetch: the answer carries the watermark, the records are not
    # read. Short waits, broker and client side: an empty partition's fetch would otherwise be
    # held for fetch_max_wait_ms (500 ms), and the stage's loop waits with this call.
    consumer = KafkaConsumer(**kafka_python_options(cfg), group_id=None, client_id=client_id,
                             enable_auto_commit=False, max_partition_fetch_bytes=1, fetch_max_wait_ms=5)
    try:
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + timeout_s
        while (missing := [tp for tp in tps if consumer.highwater(tp) is None]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no high watermark for {sorted(missing)} in {timeout_s:.0f}s")
            consumer.poll(timeout_ms=10)
        return {tp: consumer.highwater(tp) for tp in tps}
    finally:
        consumer.close()



def ensure_topics(cfg: KafkaSettings, names: Iterable[str], partitions: int | None = None) -> None:
    """Create the topics that do not exist yet, all alike; existing ones are left alone.

    For topics of no deployment (tests, benches): the deployment's own topics are made as
    flywheel/topology.py declares them, by :func:`~flywheel.kafka.topics.ensure_declared`.

    Each takes records as large as a produce request (``kafka.max_request_bytes``): Kafka's
    default ``max.message.bytes`` (about 1 MB) is below the largest valid episode, and a record
    the broker refuses is refused at every try (the outbox then reports a stall). Topics created
    by other means need the same setting (docs/exactly-once.md).

    The first broker call of every role, so it first checks the security settings
    (:func:`~flywheel.kafka.security.check_access`): a wrong password, an untrusted authority or
    the wrong protocol raises :class:`~flywheel.kafka.security.KafkaAccessError` naming the
    setting, where the admin client would retry until its timeout and say only that no broker
    answered.
    """
    if not check_access(cfg, timeout_s=cfg.request_timeout_ms / 1000):
        raise KafkaTimeoutError(f"no broker of kafka.bootstrap={cfg.bootstrap} answered in {cfg.request_timeout_ms} ms")
    # (the configured request timeout, not kafka-python's 30 s: a start while the broker does
    # not answer says so after it, flywheel/stream/runner.py until_the_broker_answers)
    admin = KafkaAdminClient(**kafka_python_options(cfg), client_id=f"{cfg.client_id}-admin",
                             request_timeout_ms=cfg.request_timeout_ms, bootstrap_timeout_ms=cfg.request_timeout_ms)
    try:
        existing = set(admin.list_topics())
        new = [
            NewTopic(n, partitions or cfg.partitions, cfg.replication_factor,
                     topic_configs={"max.message.bytes": str(cfg.max_request_bytes)})
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


#: How much of the key and of the value a dead letter keeps of a record larger than