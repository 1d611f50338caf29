"""kafka-python, made to read past a record batch it cannot unpack instead of stalling on it.

A fetched record batch can be unreadable: its CRC does not match (corruption on a broker's disk
or on the way), its compression codec is not one Kafka defines, it does not decompress, or a
record inside it is malformed. kafka-python 3 raises the error out of ``poll()`` once; every
later ``poll()`` then spins at full CPU inside the consumer without returning, because the
failed batch's iterator stays in line with nothing left to give. A SIGTERM cannot stop the loop
(it never leaves ``poll()``), and whichever group member takes the partition over stalls on the
same batch: one bad batch would stop every reader of its partition for good.

:func:`tolerate_unreadable_batches` makes such a batch come out of ``poll()`` as one stand-in
record in place of the records that could not be read:

- its offset is the batch's last offset, so a reader's position moves past the batch;
- its key is None and its value the batch's bytes as they were held when reading failed (as
  fetched, or decompressed where a record inside failed to parse);
- its only header key is an :class:`UnreadableBatch` naming the first and last offsets it stands
  for and why they could not be read. No producer can write that key: it is a Python object,
  not wire bytes.

Readers then handle it as any record they cannot use: the stages and the trainer dead-letter it
as ``unreadable_batch`` with the offsets (:meth:`flywheel.stream.deadletters.DeadLetters.send_unreadable`), so
on-call sees which records are gone and where the bytes are.

Batches compressed with any codec Kafka defines (gzip, snappy, lz4, zstd) are readable: their
libraries are dependencies, and :func:`require_codecs` refuses to start a consumer without them,
rather than dead-letter good batches a missing library could not read.

The hook replaces the batch class kafka-python's fetch reader builds (a subclass of its own);
tests/unit/test_kafka_batches.py reads broken batches built by kafka-python itself and
tests/integration/test_unreadable_batches.py through a real broker, so a kafka-python release
that moves these internals fails those tests rather than production.
"""

from __future__ import annotations

import logging
from typing import Self

from kafka import codec
from kafka.record import default_records, memory_records

log = logging.getLogger(__name__)

#: kafka-python's check for each compression codec Kafka defines, by the name operators know.
CODECS = {"gzip": codec.has_gzip, "snappy": codec.has_snappy, "lz4": codec.has_lz4, "zstd": codec.has_zstd}


class UnreadableBatch(str):
    """The header key of a stand-in record: ``unreadable-batch`` plus the offsets and the cause."""

    first: int
    last: int
    reason: str

    def __new__(cls, first: int, last: int, reason: str) -> Self:
        key = super().__new__(cls, "unreadable-batch")
        key.first, key.last, key.reason = first, last, reason
        return key

    def describe(self, topic: str, partition: int) -> str:
        span = f"offset {self.first}" if self.first == self.last else f"offsets {self.first}-{self.last}"
        return f"records at {span} of {topic}[{partition}] could not be read: {self.reason}"


def unreadable_batch(headers: list[tuple[str, bytes | None]] | None) -> UnreadableBatch | None:
    """The marker of a stand-in record, or None for a record that was read."""
    if headers and len(headers) == 1 and isinstance(headers[0][0], UnreadableBatch):
        return headers[0][0]
    return None


def require_codecs() -> None:
    """Raise unless kafka-python can decompress every codec a producer may use."""
    missing = [name for name, available in CODECS.items() if not available()]
    if missing:
        raise RuntimeError(f"kafka-python cannot read {', '.join(missing)}-compressed batches: the libraries "
                           f"are missing (reinstall flywheel: they are among its dependencies)")


class _TolerantBatch(default_records.DefaultRecordBatch):
    """kafka-python's record batch, whose failure to read becomes a stand-in record."""

    __slots__ = ("_failure", "_stood_in", "_unread_from")

    def __init__(self, buffer: bytes | bytearray | memoryview) -> None:
        super().__init__(buffer)
        self._failure: str | None = None
        self._unread_from = self.base_offset  # the first offset not handed out yet
        self._stood_in = False

    def validate_crc(self) -> bool:
        if not super().validate_crc():
            self._failure = f"the batch's CRC {self.crc} does not match its bytes"
        return True  # (a mismatch comes out as the stand-in record, not as an error)

    def __iter__(self) -> Self:
        if self._failure is None:
            try:
                self._maybe_uncompress()
            except Exception as exc:  # noqa: BLE001 - UnsupportedCodecError, zlib/lz4/zstd errors...
                self._failure = f"{_why(exc)} (compression codec {self.compression_type})"
        return self

    def __next__(self) -> default_records.DefaultRecord:
        if self._failure is None:
            try:
                record = super().__next__()
            except StopIteration:
                raise
            except Exception as exc:  # noqa: BLE001 - CorruptRecordError, whatever a malformed record raises
                self._failure = _why(exc)
            else:
                self._unread_from = record.offset + 1
                return record
        if self._stood_in or self._unread_from > self.last_offset:
            # every offset was handed out (only trailing bytes were wrong), or the stand-in was
            if not self._stood_in:
                log.warning("batch ending at offset %d: %s; every record in it was read", self.last_offset,
                            self._failure)
                self._stood_in = True
            raise StopIteration
        self._stood_in = True
        marker = UnreadableBatch(self._unread_from, self.last_offset, self._failure)
        log.error("a fetched batch could not be read: offsets %d-%d: %s", marker.first, marker.last, marker.reason)
        value = bytes(self._buffer)
        return default_records.DefaultRecord(len(value), self.last_offset, self.max_timestamp,
                                             self.timestamp_type, None, value, [(marker, None)])

    next = __next__


def _why(exc: Exception) -> str:
    text = str(exc)  # (kafka-python's errors name their class themselves)
    return text if type(exc).__name__ in text else f"{type(exc).__name__}: {text}"


def tolerate_unreadable_batches() -> None:
    """Make kafka-python's fetch reader build :class:`_TolerantBatch` (once per process)."""
    memory_records.DefaultRecordBatch = _TolerantBatch
