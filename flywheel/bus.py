"""Kafka plumbing behind a small interface: make producers and consumers, create topics,
route dead letters, and measure consumer lag.

Every client is configured here from :class:`~flywheel.settings.KafkaSettings`, so stages never
hand-tune kafka-python. Producers are idempotent with ``acks=all``; consumers never auto-commit
(each stage commits offsets only after the effect they stand for is durable: see the stage docs)
and read ``read_committed`` (records of open or aborted transactions are no input).

Stage outputs that must arrive exactly once (ingest/exactly_once.py's outbox) go through
:class:`OutputProducer`, made by :func:`make_output_producer`: either confluent-kafka
(librdkafka, the default: several times less CPU per record) or kafka-python, chosen by
``KafkaSettings.producer_client``. Both are idempotent with ``acks=all``, send to the explicit
partition they are given, carry headers, and report each record's partition and offset.

Lag is computed from the *fetch high watermark* (``consumer.highwater``), not from
``end_offsets``: the embedded broker reports a wrong end offset, and the fetch response's
watermark is what a real cluster reports too. For a read_committed consumer the end is the
fetch response's last stable offset where that is lower (flywheel/kafka_ends.py).
"""

from __future__ import annotations

import base64
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaError, MessageSizeTooLargeError, TopicAlreadyExistsError
from prometheus_client import CollectorRegistry, Counter, Gauge

from flywheel.contracts import (
    DEADLETTER_QUOTE_BYTES,
    DeadLetterEvent,
    encode,
    now,
)
from flywheel.kafka_batches import UnreadableBatch, require_codecs, tolerate_unreadable_batches
from flywheel.kafka_ends import readable_end, record_last_stable_offsets
from flywheel.kafka_headers import tolerate_bad_header_keys
from flywheel.settings import KafkaSettings

log = logging.getLogger(__name__)

# Every process that reads Kafka imports this module: none of its readers may be stopped by a
# record whose header key is not UTF-8 (flywheel/kafka_headers.py), nor by a batch that cannot be
# unpacked (flywheel/kafka_batches.py); and a read_committed reader must know where it can read
# to (flywheel/kafka_ends.py).
tolerate_bad_header_keys()
tolerate_unreadable_batches()
record_last_stable_offsets()


class EventSink(Protocol):
    """Where a stage writes records. Kafka in production and tests; a list in pure unit tests."""

    def write(self, topic: str, key: str | None, value: bytes) -> None: ...

    def flush(self, timeout_s: float | None = None) -> None: ...

    def close(self) -> None: ...


def make_producer(cfg: KafkaSettings, role: str, **overrides: object) -> KafkaProducer:
    opts: dict[str, object] = {
        "bootstrap_servers": cfg.bootstrap.split(","),
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
        # Its I/O thread fails the pending sends on its way out. Wait for that: a send of the
        # next producer must not be acked and counted before an older send to the same
        # partition is reported failed (the outbox would confirm past a record that may have
        # landed, and its recovery scan would then miss it).
        sender.join(timeout=10.0)
    if hasattr(producer, "_closed"):
        producer._closed = True


#: One delivery report: (token, topic, partition, offset, error). ``error`` is None when the
#: record was acked; then ``offset`` is its offset, else -1. Plain tuples: one per output record.
Delivery = tuple[int, str, int, int, "BaseException | None"]


class RecordRefused(Exception):
    """The client refused a record before sending it (larger than ``kafka.max_request_bytes``):
    it never reached the broker and will be refused again until the limit is raised."""


class OutputProducer(Protocol):
    """Sends records to explicit partitions and reports each one's ack (the outbox's producer)."""

    def partitions(self, topic: str) -> int | None:
        """Partition count of ``topic`` from the cluster metadata; None while it is unknown
        (the broker not answering included: the outbox retries on its next turn)."""

    def send(self, token: int, topic: str, partition: int, key: str | None, value: bytes,
             headers: list[tuple[str, bytes]]) -> None:
        """Queue one record; its report (tagged with ``token``) comes from :meth:`reports`.
        Raises :class:`RecordRefused` for a record the client will not send at all."""

    def reports(self) -> list[Delivery]:
        """Reports that arrived since the last call, without waiting for more."""

    def flush(self, timeout_s: float) -> None:
        """Wait until every queued record is acked or failed; raise ``TimeoutError`` if
        ``timeout_s`` passes first."""

    def close(self) -> None: ...


class RenewableProducer:
    """A kafka-python producer that is made when first needed and replaced after a failed send.

    kafka-python's idempotent producer sends nothing more after it gives up on a batch that was
    already on the wire (a broker stall longer than ``delivery_timeout_ms``): it drops its
    producer id and never asks for a new one, so every later send waits forever. The senders
    below therefore :meth:`retire` a producer whose send failed; the next :meth:`get` makes a new
    one. Making one needs the broker: while it does not answer, :meth:`get` raises
    :class:`~kafka.errors.KafkaError` (after the factory's ``bootstrap_timeout_ms``).
    """

    def __init__(self, factory: Callable[[], KafkaProducer]) -> None:
        self._factory = factory
        self.current: KafkaProducer | None = None
        self.made = 0  # producers made so far
        self.retired = 0  # producers retired after a failed send

    def get(self) -> KafkaProducer:
        if self.current is None:
            self.current = self._factory()
            self.made += 1
        return self.current

    def retire(self) -> None:
        """Close the current producer now, failing what it still holds (its senders resend)."""
        if self.current is not None:
            old, self.current = self.current, None
            self.retired += 1
            force_close(old)

    def close(self, timeout_s: float) -> None:
        """Deliver what the current producer holds within ``timeout_s``, else fail it."""
        if self.current is not None:
            try:
                self.current.close(timeout=timeout_s)
            except KafkaError:  # its close() flushes first and raises on the timeout, closing nothing
                force_close(self.current)
            self.current = None


class KafkaPythonOutput:
    """:class:`OutputProducer` over kafka-python (:func:`make_producer`).

    Acks arrive on kafka-python's I/O thread; they are handed over through a deque, whose
    append and popleft are atomic, so no report is lost between the two threads. A failed send
    retires the producer (:class:`RenewableProducer`); its other pending sends fail with it, and
    the outbox settles their shard before it sends them again.
    """

    def __init__(self, factory: Callable[[], KafkaProducer]) -> None:
        self.producer = RenewableProducer(factory)
        self._done: deque[Delivery] = deque()
        self._failed_current = False  # a send of the current producer failed: retire it

    def partitions(self, topic: str) -> int | None:
        try:
            parts = self.producer.get().partitions_for(topic)  # waits up to max_block_ms for metadata
        except KafkaError as exc:
            log.debug("no metadata for %s: %s", topic, exc)
            return None
        return len(parts) if parts else None

    def send(self, token: int, topic: str, partition: int, key: str | None, value: bytes,
             headers: list[tuple[str, bytes]]) -> None:
        producer = self.producer.get()  # KafkaError while none can be made: the turn is retried
        try:
            fut = producer.send(topic, key=key, value=value, partition=partition, headers=headers)
        except MessageSizeTooLargeError as exc:
            raise RecordRefused(str(exc)) from exc
        fut.add_callback(self._acked, token)
        fut.add_errback(self._failed, producer, token, topic, partition)

    def _acked(self, token: int, md: object) -> None:
        self._done.append((token, md.topic, md.partition, md.offset, None))  # type: ignore[attr-defined]

    def _failed(self, producer: KafkaProducer, token: int, topic: str, partition: int,
                exc: BaseException) -> None:
        if producer is self.producer.current:  # not the failures a retired producer's close causes
            self._failed_current = True
        self._done.append((token, topic, partition, -1, exc))

    def reports(self) -> list[Delivery]:
        if self._failed_current:  # retired here, on the caller's thread, not on the I/O thread
            self._failed_current = False
            log.warning("a send failed; replacing the producer (its pending sends fail and are settled)")
            self.producer.retire()
        done, pop = [], self._done.popleft
        for _ in range(len(self._done)):
            done.append(pop())
        return done

    def flush(self, timeout_s: float) -> None:
        if self.producer.current is None:  # a retired producer's sends are failed, not flushed
            return
        try:
            self.producer.current.flush(timeout=timeout_s)
        except KafkaError as exc:  # KafkaTimeoutError: the same condition as librdkafka's below
            raise TimeoutError(f"records still unacknowledged after {timeout_s}s ({exc})") from exc

    def close(self) -> None:
        self.producer.close(5.0)


class ConfluentOutput:
    """:class:`OutputProducer` over confluent-kafka (librdkafka).

    librdkafka batches, sends and retries on its own C threads; delivery callbacks run on this
    thread inside ``poll``/``flush``, so reports need no lock. Idempotence (``acks=all``,
    sequence numbers per partition) is librdkafka's, as in kafka-python.

    A failed send retires the producer for a new one, as in :class:`KafkaPythonOutput`. After
    giving up on a send, librdkafka bumps its producer epoch to go on; the embedded broker answers
    that bump by fencing the producer, which then fails every later send with PRODUCER_FENCED
    (not even flagged fatal). The retired producer's pending sends are purged and reported failed,
    and the outbox settles their shard before it sends them again.
    """

    def __init__(self, cfg: KafkaSettings, role: str) -> None:
        self._conf = {
            "bootstrap.servers": cfg.bootstrap,
            "client.id": f"{cfg.client_id}-{role}",
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": cfg.linger_ms,
            "request.timeout.ms": cfg.request_timeout_ms,
            "message.timeout.ms": cfg.delivery_timeout_ms,
            "message.max.bytes": cfg.max_request_bytes,
            "logger": logging.getLogger("confluent_kafka"),
        }
        self._done: list[Delivery] = []
        self.made = self.retired = 0
        self._failed_current = False  # a send of the current producer failed: retire it
        self.producer = self._make()

    def _make(self) -> Any:
        from confluent_kafka import Producer  # imported here: only stage outputs need it

        self.made += 1
        return Producer(self._conf)  # connects in the background: never blocks here

    def partitions(self, topic: str) -> int | None:
        from confluent_kafka import KafkaException

        try:
            meta = self.producer.list_topics(topic, timeout=5.0).topics.get(topic)
        except KafkaException as exc:  # the broker did not answer in time
            log.debug("no metadata for %s: %s", topic, exc)
            return None
        if meta is None or meta.error is not None or not meta.partitions:
            return None
        return len(meta.partitions)

    def send(self, token: int, topic: str, partition: int, key: str | None, value: bytes,
             headers: list[tuple[str, bytes]]) -> None:
        report = functools.partial(self._report, self.made, token, topic, partition)
        while True:
            try:
                self.producer.produce(topic, value, key, partition=partition, headers=headers,
                                      on_delivery=report)
                return
            except BufferError:  # librdkafka's local queue is full: serve acks, then retry
                self.producer.poll(0.05)
            except Exception as exc:
                from confluent_kafka import KafkaError as RdKafkaError
                from confluent_kafka import KafkaException

                if isinstance(exc, KafkaException) and exc.args[0].code() == RdKafkaError.MSG_SIZE_TOO_LARGE:
                    raise RecordRefused(str(exc)) from exc
                raise

    def _report(self, made: int, token: int, topic: str, partition: int, err: object, msg: object) -> None:
        if err is None:
            self._done.append((token, topic, partition, msg.offset(), None))  # type: ignore[attr-defined]
        else:
            from confluent_kafka import KafkaException

            if made == self.made:  # not the purged sends of a retired producer
                self._failed_current = True
            self._done.append((token, topic, partition, -1, KafkaException(err)))

    def reports(self) -> list[Delivery]:
        self.producer.poll(0)
        if self._failed_current:
            self._retire()
        done, self._done = self._done, []
        return done

    def _retire(self) -> None:
        old, self.producer = self.producer, self._make()
        self.retired += 1
        self._failed_current = False
        log.warning("a send failed; replacing the producer (its pending sends fail and are settled)")
        old.purge()  # what it still holds is reported failed, by the poll below
        old.poll(0)
        old.close()

    def flush(self, timeout_s: float) -> None:
        left = self.producer.flush(timeout_s)
        if left:
            raise TimeoutError(f"{left} records still unacknowledged after {timeout_s}s")

    def close(self) -> None:
        # Bounded, unlike librdkafka's close alone: what is still unacked stays in the outbox,
        # and the next owner's recovery scan finds whether it landed.
        self.producer.flush(5.0)
        self.producer.purge()
        self.producer.close()


def make_output_producer(cfg: KafkaSettings, role: str) -> OutputProducer:
    """The producer for exactly-once stage outputs, by ``cfg.producer_client``."""
    if cfg.producer_client == "confluent":
        return ConfluentOutput(cfg, role)
    # bounded like librdkafka's metadata wait above, so a broker that does not answer holds the
    # stage's loop for seconds per turn, not a minute (kafka-python's default max_block_ms)
    return KafkaPythonOutput(lambda: make_producer(cfg, role, max_block_ms=5000, bootstrap_timeout_ms=5000))


def make_consumer(
    cfg: KafkaSettings, role: str, group_id: str | None, topics: Iterable[str] = (), **overrides: object
) -> KafkaConsumer:
    opts: dict[str, object] = {
        "bootstrap_servers": cfg.bootstrap.split(","),
        "client_id": f"{cfg.client_id}-{role}",
        "group_id": group_id,
        "enable_auto_commit": False,
        # A product may write the input topics in transactions: the records of one still open
        # may yet be aborted, and aborted ones are no input (flywheel/kafka_ends.py).
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
    consumer = KafkaConsumer(**opts)
    topics = list(topics)
    if topics:
        consumer.subscribe(topics)
    return consumer


#: The id a broker gives when it has none for a topic (before Kafka 2.8, some compatible brokers).
NO_TOPIC_ID = "00000000-0000-0000-0000-000000000000"


def topic_ids(bootstrap: str, topics: Iterable[str], *, client_id: str) -> dict[str, str]:
    """Each topic's id: a UUID the broker gives a topic when it is created, so a topic deleted and
    created again under the same name has another. Topics that do not exist, or that the broker
    gives no id, are left out (whoever asks then cannot tell, and goes on as before)."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","), client_id=client_id)
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


def read_to_end(bootstrap: str, starts: dict[TopicPartition, int | None], *, client_id: str,
                timeout_s: float = 60.0, max_fetch_bytes: int = 8 * 1024 * 1024,
                ) -> Iterator[tuple[TopicPartition, ConsumerRecord]]:
    """Every record of each partition from its start offset (None: its beginning) up to the high
    watermark the reads see; TimeoutError if the reads get no further for ``timeout_s`` (a
    partition without a leader, a broker that does not answer: the stages retry that turn).
    A start the partition no longer holds reads from its oldest record.

    No consumer group: a one-off read (the outbox recovery scan, ``flywheel deadletters``).
    """
    # A start offset the partition no longer holds reads from the oldest record left, never from
    # the end: skipping what is there would hide rows that landed from the recovery scan, which
    # would send them again. earliest covers a start that retention deleted (kafka-python's
    # default is the end); the loop below covers a start past the end.
    consumer = KafkaConsumer(bootstrap_servers=bootstrap.split(","), group_id=None, client_id=client_id,
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
        # a limit on going nowhere, not on the whole read: a scan of a long partition (a store
        # from before confirmed points starts at 0) takes as long as it takes while records come
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


def high_watermarks(bootstrap: str, tps: Iterable[TopicPartition], *, client_id: str,
                    timeout_s: float = 30.0) -> dict[TopicPartition, int]:
    """Each partition's end (the offset its next record will get), from a fetch response.

    A fetch's high watermark, not ``end_offsets``: it is what the brokers report to consumers
    as they read, and the embedded development broker answers offset requests wrongly
    (flywheel/broker.py). TimeoutError if some partition gives none in ``timeout_s`` (no leader).
    """
    tps = list(tps)
    # One byte per partition and fetch: the answer carries the watermark, the records are not
    # read. Short waits, broker and client side: an empty partition's fetch would otherwise be
    # held for fetch_max_wait_ms (500 ms), and the stage's loop waits with this call.
    consumer = KafkaConsumer(bootstrap_servers=bootstrap.split(","), group_id=None, client_id=client_id,
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


class KafkaSink:
    """:class:`EventSink` over an idempotent producer that keeps each record until Kafka acks it.

    For callers that must not go on before what they wrote is in Kafka: the trainer commits a
    version, which settles the offsets of the records it dead-lettered, only once :meth:`settle`
    says those letters are acked. Nothing here blocks on a broker that does not answer: a send
    that cannot even be queued, or that the producer gave up on, is kept and sent again.

    A send the producer gave up on also retires that producer (:class:`RenewableProducer`), and
    every record still owed goes out again through the next one ``factory`` makes: delivery is
    at least once.
    """

    def __init__(self, factory: Callable[[], KafkaProducer]) -> None:
        self.producer = RenewableProducer(factory)
        # (future or None while not queued, topic, key, value), in write order
        self._unacked: list[tuple[object | None, str, str | None, bytes]] = []
        self._progress = time.monotonic()  # the last ack seen, or when records began to be owed
        self._queueing = True  # False after a send could not be queued, until the next settle

    def write(self, topic: str, key: str | None, value: bytes) -> None:
        if not self._unacked:
            self._progress = time.monotonic()
        # after a send that could not be queued, later ones wait for the next settle: each try
        # blocks for the producer's max_block_ms
        fut = self._send(topic, key, value) if self._queueing else None
        self._queueing = fut is not None
        self._unacked.append((fut, topic, key, value))

    def _send(self, topic: str, key: str | None, value: bytes) -> object | None:
        try:
            return self.producer.get().send(topic, key=key, value=value)
        except KafkaError as exc:  # no producer, no metadata or a full buffer: the broker does not answer
            log.debug("send to %s not queued (%s); retried on the next settle", topic, exc)
            return None

    def settle(self, timeout_s: float = 0.0) -> bool:
        """Whether every record written so far is acked, waiting up to ``timeout_s`` for it.

        Records whose send failed (or never got queued) are sent again; they count as unacked
        until that send is acked. Call it every loop turn: it is what notices acks.
        """
        if self._unacked and timeout_s > 0 and self.producer.current is not None:
            try:
                self.producer.current.flush(timeout=timeout_s)
            except KafkaError:  # KafkaTimeoutError: still owed, and reported below
                pass
        owed: list[tuple[object | None, str, str | None, bytes]] = []
        acked, failed = False, None
        for fut, topic, key, value in self._unacked:
            if fut is not None and fut.is_done and not fut.failed():  # type: ignore[attr-defined]
                acked = True
                continue
            if fut is not None and fut.failed():  # type: ignore[attr-defined]
                failed, fut = failed or fut.exception, None  # type: ignore[attr-defined]
            owed.append((fut, topic, key, value))
        if failed is not None:  # what the old producer still held is failed by its close: all of it again
            log.warning("a send failed (%s); replacing the producer, the %d records owed go out through "
                        "the new one", failed, len(owed))
            self.producer.retire()
            owed = [(None, topic, key, value) for _, topic, key, value in owed]
        if acked:
            self._progress = time.monotonic()
        # (re)send what is not queued, in write order, until one cannot be queued
        left: list[tuple[object | None, str, str | None, bytes]] = []
        queueing = True
        for fut, topic, key, value in owed:
            if fut is None and queueing:
                fut = self._send(topic, key, value)
                queueing = fut is not None
            left.append((fut, topic, key, value))
        self._unacked, self._queueing = left, queueing
        return not left

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    def stuck_s(self) -> float:
        """Seconds records have been owed with no ack seen (0 with none owed)."""
        return time.monotonic() - self._progress if self._unacked else 0.0

    def flush(self, timeout_s: float | None = None) -> None:
        if not self.settle(30.0 if timeout_s is None else timeout_s):
            raise TimeoutError(f"{len(self._unacked)} records still unacknowledged after {timeout_s}s")

    def close(self, timeout_s: float = 5.0) -> None:
        """Bounded, whatever the broker does: records still unacked then are given up, which
        the caller's own protocol must allow for (the trainer's does: docs/trainer.md)."""
        if self.settle(timeout_s):
            self.producer.close(timeout_s)
            return
        log.warning("closing with %d records unacknowledged by Kafka", len(self._unacked))
        self.producer.retire()


def ensure_topics(cfg: KafkaSettings, names: Iterable[str], partitions: int | None = None) -> None:
    """Create the topics that do not exist yet; existing ones are left alone.

    Each takes records as large as a produce request (``kafka.max_request_bytes``): Kafka's
    default ``max.message.bytes`` (about 1 MB) is below the largest valid episode, and a record
    the broker refuses is refused at every try (the outbox then reports a stall). Topics created
    by other means need the same setting (docs/exactly-once.md).
    """
    # (the configured request timeout, not kafka-python's 30 s: a start while the broker does
    # not answer says so after it, ingest/runner.py until_the_broker_answers)
    admin = KafkaAdminClient(bootstrap_servers=cfg.bootstrap.split(","), client_id=f"{cfg.client_id}-admin",
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
#: ``DEADLETTER_QUOTE_BYTES`` (flywheel/contracts.py).
DEADLETTER_PREFIX_BYTES = 64 * 1024


class DeadLetters:
    """Routes records a stage cannot use to the dead-letter topic, with the original bytes.

    ``reasons``: the reasons the stage can give, exported at 0 from the start. A series that
    first appears already holding a burst shows no ``rate()``/``increase()`` for it, so an alert
    on dead letters would miss the first burst of a reason the process had not seen yet. Any
    other reason is still counted, from its first record.
    """

    def __init__(self, sink: EventSink, topic: str, stage: str, registry: CollectorRegistry,
                 reasons: Iterable[str] = ()) -> None:
        self.sink = sink
        self.topic = topic
        self.stage = stage
        self.counter = Counter(
            f"{stage}_deadletters_total",
            "Records sent to the dead-letter topic, by reason",
            ["reason"],
            registry=registry,
        )
        for reason in reasons:
            self.counter.labels(reason)

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
        value = value or b""
        # the detail may quote the bad input (a labeler's message): keep it encodable
        detail = detail[:2000].encode("utf-8", "backslashreplace").decode("utf-8")
        truncated = len(value) + len(key or b"") > DEADLETTER_QUOTE_BYTES
        if truncated:  # quoted whole, the dead letter itself would be too large to send
            detail += (f" [record too large to quote: key {len(key or b'')} and value {len(value)} bytes; "
                       f"first {DEADLETTER_PREFIX_BYTES} of each kept, the whole record is in the source topic]")
            key = key[:DEADLETTER_PREFIX_BYTES] if key is not None else None
            value = value[:DEADLETTER_PREFIX_BYTES]
        event = DeadLetterEvent(
            stage=self.stage,
            reason=reason,
            detail=detail,
            source_topic=source_topic,
            source_partition=partition,
            source_offset=offset,
            key_b64=base64.b64encode(key).decode() if key is not None else None,
            value_b64=base64.b64encode(value).decode(),
            truncated=truncated,
            failed_at=now(),
        )
        # the dead letter's own Kafka key only spreads letters over partitions: a bounded prefix
        # keeps a record with a huge key from doubling the letter's size
        dl_key = key[:1024].decode("utf-8", "replace") if key is not None else None
        self.sink.write(self.topic, dl_key, encode(event))
        self.counter.labels(reason).inc()
        return event

    def send_unreadable(self, record: ConsumerRecord, marker: UnreadableBatch) -> DeadLetterEvent:
        """Dead-letter the stand-in for a batch that could not be read (flywheel/kafka_batches.py):
        ``unreadable_batch``, at the first offset it stands for, with the batch's bytes."""
        return self.send("unreadable_batch", marker.describe(record.topic, record.partition),
                         source_topic=record.topic, value=record.value, partition=record.partition,
                         offset=marker.first)

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
        self._shown: set[TopicPartition] = set()

    def update(self, consumer: KafkaConsumer, every_s: float = 1.0) -> None:
        if time.monotonic() - self._last < every_s:
            return
        self._last = time.monotonic()
        assigned = set(consumer.assignment())
        # a partition that moved to another member is that member's to report: its last value
        # here would stay forever, and keep a lag alert firing for a partition long caught up
        for tp in self._shown - assigned:
            self.gauge.remove(tp.topic, str(tp.partition))
        self._shown &= assigned
        for tp in assigned:
            high = readable_end(consumer, tp)
            if high is None:
                continue
            try:
                pos = consumer.position(tp, timeout_ms=100)
            except KafkaError as exc:  # position unknown during a rebalance; try next time
                log.debug("lag for %s not updated: %s", tp, exc)
                continue
            if pos is not None:
                self.gauge.labels(tp.topic, str(tp.partition)).set(max(0, high - pos))
                self._shown.add(tp)


__all__ = [
    "ConfluentOutput",
    "DeadLetters",
    "Delivery",
    "EventSink",
    "KafkaPythonOutput",
    "KafkaSink",
    "LagGauge",
    "OutputProducer",
    "TopicPartition",
    "ensure_topics",
    "high_watermarks",
    "make_consumer",
    "make_output_producer",
    "make_producer",
    "partitions_of",
    "read_to_end",
]
