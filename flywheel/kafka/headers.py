"""kafka-python, made to read records whose header keys are not UTF-8.

Kafka header keys are strings, but brokers do not check them, so any producer can write a key that
is not UTF-8. kafka-python 3 decodes header keys strictly while it unpacks a fetched batch: the
error comes out of ``poll()`` once, and every later ``poll()`` on that partition then spins at full
CPU without returning. One such record would stop every reader of its partition for good, on every
restart: the stages, the trainer, the dead-letter tools.

Java clients decode header keys leniently. :func:`tolerate_bad_header_keys` does the same for
kafka-python: a record whose header key is not UTF-8 is read with that key as an
:class:`UnreadableHeaderKey`, a string with the bad bytes escaped (``\\xff``) that keeps the raw
bytes. Readers that only look for their own headers go on; the stages' edge dead-letters such a
record as ``undecodable`` (flywheel/stream/runner.py), because its producer is broken.

The hook wraps a private method of kafka-python's record reader. tests/unit/test_kafka_headers.py
reads such records from batches built by kafka-python itself, and
tests/integration/test_unreadable_headers.py through a real broker, so a kafka-python release
that moves the method fails those tests rather than production.
"""

from __future__ import annotations

import logging
from typing import Self

from kafka.errors import CorruptRecordError
from kafka.record import default_records
from kafka.record.util import decode_varint

log = logging.getLogger(__name__)


class UnreadableHeaderKey(str):
    """A header key that is not UTF-8: its text with the bad bytes escaped; ``raw`` holds the bytes."""

    raw: bytes

    def __new__(cls, raw: bytes) -> Self:
        key = super().__new__(cls, raw.decode("utf-8", "backslashreplace"))
        key.raw = raw
        return key


def unreadable_header(headers: list[tuple[str, bytes | None]] | None) -> UnreadableHeaderKey | None:
    """The first header key of a record that is not UTF-8, if any."""
    for name, _ in headers or ():
        if isinstance(name, UnreadableHeaderKey):
            return name
    return None


def tolerate_bad_header_keys() -> None:
    """Install the lenient fallback into kafka-python's record reader (once per process)."""
    batch_cls = default_records.DefaultRecordBatch
    if getattr(batch_cls._read_msg, "_flywheel_tolerant", False):
        return
    strict = batch_cls._read_msg

    def read_msg(self: default_records.DefaultRecordBatch, *args: object, **kwargs: object):
        start = self._pos
        try:
            return strict(self, *args, **kwargs)
        except UnicodeDecodeError:
            if self.is_control_batch:  # written by the broker itself: nothing to be lenient about
                raise
            self._pos = start
            return _read_record_lenient(self)

    read_msg._flywheel_tolerant = True  # type: ignore[attr-defined]
    batch_cls._read_msg = read_msg


def _read_record_lenient(batch: default_records.DefaultRecordBatch) -> default_records.DefaultRecord:
    """Read the record at the batch's position as the strict reader does, except for header keys.

    Record v2 layout (Kafka protocol): length, attributes, timestamp delta, offset delta, key,
    value, then a count of headers, each a key (string) and a value (nullable bytes); every
    integer is a zig-zag varint.
    """
    buf, pos = batch._buffer, batch._pos
    length, pos = decode_varint(buf, pos)
    start = pos
    _, pos = decode_varint(buf, pos)  # attributes: unused in record v2
    ts_delta, pos = decode_varint(buf, pos)
    offset_delta, pos = decode_varint(buf, pos)
    key, pos = _nullable_bytes(buf, pos)
    value, pos = _nullable_bytes(buf, pos)
    count, pos = decode_varint(buf, pos)
    if count < 0:
        raise CorruptRecordError(f"invalid number of record headers {count}")
    headers: list[tuple[str, bytes | None]] = []
    for _ in range(count):
        raw, pos = _nullable_bytes(buf, pos)
        if raw is None:
            raise CorruptRecordError("a record header key has a negative size")
        try:
            name: str = raw.decode("utf-8")
        except UnicodeDecodeError:
            name = UnreadableHeaderKey(raw)
        h_value, pos = _nullable_bytes(buf, pos)
        headers.append((name, h_value))
    if pos - start != length:
        raise CorruptRecordError(f"record size {length} does not match the {pos - start} bytes read")
    batch._pos = pos
    offset = batch.base_offset + offset_delta
    if batch.timestamp_type == batch.LOG_APPEND_TIME:
        timestamp = batch.max_timestamp
    else:
        timestamp = batch.first_timestamp + ts_delta
    log.warning("record at offset %d has a header key that is not UTF-8: %r", offset, unreadable_header(headers))
    return default_records.DefaultRecord(length, offset, timestamp, batch.timestamp_type, key, value, headers)


def _nullable_bytes(buf: bytes | bytearray | memoryview, pos: int) -> tuple[bytes | None, int]:
    size, pos = decode_varint(buf, pos)
    if size < 0:
        return None, pos
    return bytes(buf[pos:pos + size]), pos + size
