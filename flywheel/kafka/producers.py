"""Producers that keep what they were given until Kafka acks it.

:class:`OutputProducer` is what the stream runtime's outbox sends through (flywheel/stream/outbox.py):
either confluent-kafka (librdkafka, the default: several times less CPU per record) or
kafka-python, chosen by ``KafkaSettings.producer_client``. Both are idempotent with ``acks=all``,
partition by key with Kafka's default murmur2 partitioner (so a record sent twice lands where it
landed the first time), and report each record's ack or failure by the token it was sent with.

:class:`KafkaSink` is the simpler :class:`EventSink` for callers that keep records in memory
until acked (the trainer's dead letters).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from kafka import KafkaProducer
from kafka import errors as kafka_errors
from kafka.errors import KafkaError, MessageSizeTooLargeError

from flywheel.kafka.clients import force_close, make_producer
from flywheel.kafka.security import librdkafka_options
from flywheel.settings import KafkaSettings

log = logging.getLogger(__name__)


class EventSink(Protocol):
    """Where a stage writes records. Kafka in production and tests; a list in pure unit tests."""

    def write(self, topic: str, key: str | None, value: bytes) -> None: ...

    def flush(self, timeout_s: float | None = None) -> None: ...

    def close(self) -> None: ...


#: One delivery report: (token, error); ``error`` is None when the record was acked. Plain
#: tuples: one per output record.
Delivery = tuple[int, "BaseException | None"]


#: Errors about one record (the broker refused it: too large for its topic, not allowed, no such
#: topic), after which the producer goes on as before. Only other errors (a delivery timeout, a
#: fenced or fatal producer) replace it: replacing it for these failed every other send in
#: flight too, and sent them all again.
_RECORD_ERRORS: tuple[type[BaseException], ...] = (
    MessageSizeTooLargeError, kafka_errors.TopicAuthorizationFailedError, kafka_errors.RecordListTooLargeError,
    kafka_errors.InvalidRecordError, kafka_errors.CorruptRecordError)


@functools.cache
def _rdkafka_record_errors() -> frozenset[int]:
    from confluent_kafka import KafkaError as RdKafkaError

    return frozenset({RdKafkaError.MSG_SIZE_TOO_LARGE, RdKafkaError.TOPIC_AUTHORIZATION_FAILED,
                      RdKafkaError.RECORD_LIST_TOO_LARGE, RdKafkaError.INVALID_RECORD})


class RecordRefused(Exception):
    """The client refused a record before sending it (larger than ``kafka.max_request_bytes``):
    it never reached the broker and will be refused again until the limit is raised."""


class OutputProducer(Protocol):
    """Sends keyed records and reports each one's ack or failure (the outbox's producer)."""

    def send(self, token: int, topic: str, key: str | None, value: bytes,
             headers: list[tuple[str, bytes]] | None = None) -> None:
        """Queue one record (with ``headers``: its request id and trace context), partitioned by
        its key; its report (tagged with ``token``) comes from :meth:`reports`. Raises
        :class:`RecordRefused` for a record the client will not send at all."""

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
    append and popleft are atomic, so no report is lost between the two threads. A send that
    failed for another reason than its own record (``_RECORD_ERRORS``) retires the producer
    (:class:`RenewableProducer`); its other pending sends fail with it, and the outbox sends them
    again.
    """

    def __init__(self, factory: Callable[[], KafkaProducer]) -> None:
        self.producer = RenewableProducer(factory)
        self._done: deque[Delivery] = deque()
        self._failed_current = False  # a send of the current producer failed: retire it

    def send(self, token: int, topic: str, key: str | None, value: bytes,
             headers: list[tuple[str, bytes]] | None = None) -> None:
        producer = self.producer.get()  # KafkaError while none can be made: the turn is retried
        try:
            fut = producer.send(topic, key=key, value=value, headers=headers)
        except MessageSizeTooLargeError as exc:
            raise RecordRefused(str(exc)) from exc
        fut.add_callback(self._acked, token)
        fut.add_errback(self._failed, producer, token)

    def _acked(self, token: int, md: object) -> None:
        self._done.append((token, None))

    def _failed(self, producer: KafkaProducer, token: int, exc: BaseException) -> None:
        # not the failures a retired producer's close causes, nor a refusal of one record
        if producer is self.producer.current and not isinstance(exc, _RECORD_ERRORS):
            self._failed_current = True
        self._done.append((token, exc))

    def reports(self) -> list[Delivery]:
        if self._failed_current:  # retired here, on the caller's thread, not on the I/O thread
            self._failed_current = False
            log.warning("a send failed; replacing the producer (its pending sends fail and are sent again)")
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

    A send that failed for another reason than its own record retires the producer for a new one,
    as in :class:`KafkaPythonOutput`. After
    giving up on a send, librdkafka bumps its producer epoch to go on; the embedded broker answers
    that bump by fencing the producer, which then fails every later send with PRODUCER_FENCED
    (not even flagged fatal). The retired producer's pending sends are purged and reported failed,
    and the outbox sends them again.
    """

    def __init__(self, cfg: KafkaSettings, role: str) -> None:
        self._conf = {
            **librdkafka_options(cfg),
            "client.id": f"{cfg.client_id}-{role}",
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": cfg.linger_ms,
            "request.timeout.ms": cfg.request_timeout_ms,
            "message.timeout.ms": cfg.delivery_timeout_ms,
            "message.max.bytes": cfg.max_request_bytes,
            # Java's and kafka-python's partitioner (librdkafka's default hashes with CRC32): a
            # key lands in the same partition whichever client sent it, and a resend where the
            # first send landed.
            "partitioner": "murmur2_random",
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

    def send(self, token: int, topic: str, key: str | None, value: bytes,
             headers: list[tuple[str, bytes]] | None = None) -> None:
        report = functools.partial(self._report, self.made, token)
        while True:
            try:
                self.producer.produce(topic, value, key, on_delivery=report, headers=headers)
                return
            except BufferError:  # librdkafka's local queue is full: serve acks, then retry
                self.producer.poll(0.05)
            except Exception as exc:
                from confluent_kafka import KafkaError as RdKafkaError
                from confluent_kafka import KafkaException

                if isinstance(exc, KafkaException) and exc.args[0].code() == RdKafkaError.MSG_SIZE_TOO_LARGE:
                    raise RecordRefused(str(exc)) from exc
                raise

    def _report(self, made: int, token: int, err: object, msg: object) -> None:
        if err is None:
            self._done.append((token, None))
        else:
            from confluent_kafka import KafkaException

            # not the purged sends of a retired producer, nor a refusal of one record
            if made == self.made and err.code() not in _rdkafka_record_errors():  # type: ignore[attr-defined]
                self._failed_current = True
            self._done.append((token, KafkaException(err)))

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
        log.warning("a send failed; replacing the producer (its pending sends fail and are sent again)")
        old.purge()  # what it still holds is reported failed, by the poll below
        old.poll(0)
        old.close()

    def flush(self, timeout_s: float) -> None:
        left = self.producer.flush(timeout_s)
        if left:
            raise TimeoutError(f"{left} records still unacknowledged after {timeout_s}s")

    def close(self) -> None:
        # Bounded, unlike librdkafka's close alone: what is still unacked stays in the outbox,
        # and the next start sends it again.
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

#: A record a :class:`KafkaSink` still owes Kafka: (future or None while not queued, topic, key,
#: value, headers).
_Owed = tuple[object | None, str, str | None, bytes, list[tuple[str, bytes]] | None]


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
        # (future or None while not queued, topic, key, value, headers), in write order
        self._unacked: list[_Owed] = []
        self._progress = time.monotonic()  # the last ack seen, or when records began to be owed
        self._queueing = True  # False after a send could not be queued, until the next settle

    def write(self, topic: str, key: str | None, value: bytes,
              headers: list[tuple[str, bytes]] | None = None) -> None:
        """Send ``value`` (with ``headers``: a signature, flywheel/signing.py) and keep it until acked."""
        if not self._unacked:
            self._progress = time.monotonic()
        # after a send that could not be queued, later ones wait for the next settle: each try
        # blocks for the producer's max_block_ms
        fut = self._send(topic, key, value, headers) if self._queueing else None
        self._queueing = fut is not None
        self._unacked.append((fut, topic, key, value, headers))

    def _send(self, topic: str, key: str | None, value: bytes,
              headers: list[tuple[str, bytes]] | None) -> object | None:
        try:
            return self.producer.get().send(topic, key=key, value=value, headers=headers)
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
        owed: list[_Owed] = []
        acked, failed = False, None
        for fut, topic, key, value, headers in self._unacked:
            if fut is not None and fut.is_done and not fut.failed():  # type: ignore[attr-defined]
                acked = True
                continue
            if fut is not None and fut.failed():  # type: ignore[attr-defined]
                failed, fut = failed or fut.exception, None  # type: ignore[attr-defined]
            owed.append((fut, topic, key, value, headers))
        if failed is not None:  # what the old producer still held is failed by its close: all of it again
            log.warning("a send failed (%s); replacing the producer, the %d records owed go out through "
                        "the new one", failed, len(owed))
            self.producer.retire()
            owed = [(None, *rest) for _, *rest in owed]
        if acked:
            self._progress = time.monotonic()
        # (re)send what is not queued, in write order, until one cannot be queued
        left: list[_Owed] = []
        queueing = True
        for fut, topic, key, value, headers in owed:
            if fut is None and queueing:
                fut = self._send(topic, key, value, headers)
                queueing = fut is not None
            left.append((fut, topic, key, value, headers))
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

