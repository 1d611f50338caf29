"""Dead-letter routing: a record a consumer cannot use goes to the dead-letter topic with its
original bytes, the reason, and its source coordinates (topic, partition, offset), which are the
dead letter's idempotency key: a letter sent twice names the same source record.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterable

from kafka.consumer.fetcher import ConsumerRecord
from prometheus_client import CollectorRegistry, Counter

from flywheel.contracts import (
    DEADLETTER_QUOTE_BYTES,
    DeadLetterEvent,
    encode,
    now,
)
from flywheel.kafka.batches import UnreadableBatch
from flywheel.kafka.producers import EventSink

log = logging.getLogger(__name__)


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

    def __init__(self, sink: EventSink | None, topic: str, stage: str, registry: CollectorRegistry,
                 reasons: Iterable[str] = ()) -> None:
        """``sink``: where letters are written; None only for a subclass that writes them itself
        (:meth:`_write`: flywheel/stream/runner.py ``OutboxDeadLetters``)."""
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
        # The dead letter's own Kafka key spreads letters over partitions and puts a letter sent
        # twice (outboxes are at least once) where the first one went: the source's key (a
        # bounded prefix, so a huge key does not double the letter's size), or for a record
        # without one its source coordinates (a keyless letter would land anywhere each time).
        if key is not None:
            dl_key: str | None = key[:1024].decode("utf-8", "replace")
        elif partition is not None and offset is not None:
            dl_key = f"{source_topic}[{partition}]@{offset}"
        else:
            dl_key = None
        self._write(partition, dl_key, encode(event))
        self.counter.labels(reason).inc()
        return event

    def _write(self, partition: int | None, key: str | None, value: bytes) -> None:
        """Write one letter about a record of source ``partition``. To a producer, the letter's
        key alone places it (above); an outbox keeps it as a row of that partition."""
        if self.sink is None:
            raise TypeError("DeadLetters(None, ...) is for subclasses that write their letters themselves")
        self.sink.write(self.topic, key, value)

    def send_unreadable(self, record: ConsumerRecord, marker: UnreadableBatch) -> DeadLetterEvent:
        """Dead-letter the stand-in for a batch that could not be read (flywheel/kafka/batches.py):
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


