"""Record batches broken the ways a reader can meet them (flywheel/kafka/batches.py), built by
kafka-python's own batch builder and then damaged: used by the unit tests on batches and by the
real-broker tests, which send them through a producer whose builder is made to break them."""

from __future__ import annotations

import struct
from collections.abc import Callable

from kafka import KafkaProducer
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder
from kafka.record.util import calc_crc32c, decode_varint, encode_varint


def build(records: list[tuple[bytes | None, bytes]], compression: int = 0, base: int = 0) -> bytearray:
    """A batch of ``(key, value)`` records at offsets ``base``, ``base + 1``, ..."""
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=compression, is_transactional=False,
                                        producer_id=-1, producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
    for i, (key, value) in enumerate(records):
        builder.append(i, 1_000 + i, key, value, [])
    batch = builder.build()
    struct.pack_into(">q", batch, 0, base)
    return batch


def reseal(batch: bytearray) -> bytearray:
    """Write the CRC of the damaged batch, so that only the damage itself is wrong."""
    crc = calc_crc32c(memoryview(batch)[DefaultRecordBatch.ATTRIBUTES_OFFSET:])
    struct.pack_into(">I", batch, DefaultRecordBatch.CRC_OFFSET, crc)
    return batch


def flip_a_byte(batch: bytearray) -> bytearray:
    """Damage on a disk or a wire: one byte of the records changed, the CRC left as it was."""
    batch[-3] ^= 0xFF
    return batch


def unknown_codec(batch: bytearray) -> bytearray:
    """Compression bits naming no codec Kafka defines (5), under a CRC that matches."""
    attrs_at = DefaultRecordBatch.ATTRIBUTES_OFFSET
    attrs = struct.unpack_from(">h", batch, attrs_at)[0]
    struct.pack_into(">h", batch, attrs_at, (attrs & ~0x07) | 5)
    return reseal(batch)


def garbled_compression(batch: bytearray) -> bytearray:
    """A gzip payload that does not decompress, under a CRC that matches."""
    attrs_at = DefaultRecordBatch.ATTRIBUTES_OFFSET
    attrs = struct.unpack_from(">h", batch, attrs_at)[0]
    struct.pack_into(">h", batch, attrs_at, (attrs & ~0x07) | DefaultRecordBatch.CODEC_GZIP)
    start = DefaultRecordBatch.HEADER_STRUCT.size
    batch[start:] = b"\x00not a compressed stream" * 4
    struct.pack_into(">i", batch, 8, len(batch) - 12)  # the batch length field
    return reseal(batch)


def second_record_malformed(batch: bytearray) -> bytearray:
    """The second record's length overstated by one, under a CRC that matches: the first record
    reads, the rest of the batch does not."""
    pos = DefaultRecordBatch.HEADER_STRUCT.size
    length, after = decode_varint(batch, pos)
    second = after + length
    length2, after2 = decode_varint(batch, second)
    out = bytearray()
    encode_varint(length2 + 1, out.append)
    assert len(out) == after2 - second  # same varint width: the batch keeps its size
    batch[second:after2] = out
    return reseal(batch)


BREAKAGES: dict[str, Callable[[bytearray], bytearray]] = {
    "crc": flip_a_byte, "codec": unknown_codec, "decompress": garbled_compression, "record": second_record_malformed,
}


def send_broken(producer: KafkaProducer, topic: str, partition: int, records: list[tuple[bytes, bytes]],
                breakage: str) -> list[int]:
    """Send ``records`` as one batch that ``BREAKAGES[breakage]`` breaks on its way out of
    ``producer`` (a kafka-python producer: its batch builder is wrapped while they are sent).
    Returns their offsets: the broker takes the batch as it is (a real cluster checks some of it)."""
    producer.flush()  # nothing else may be in the broken batch
    intact = DefaultRecordBatchBuilder.build
    DefaultRecordBatchBuilder.build = lambda self: BREAKAGES[breakage](intact(self))  # type: ignore[method-assign]
    try:
        sent = [producer.send(topic, key=k, value=v, partition=partition) for k, v in records]
        producer.flush()
    finally:
        DefaultRecordBatchBuilder.build = intact  # type: ignore[method-assign]
    return [f.get(10).offset for f in sent]
