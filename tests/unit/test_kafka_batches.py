"""kafka-python's fetch reader with flywheel's stand-in for unreadable batches
(flywheel/kafka/batches.py), on batches built by kafka-python's own builder and then broken. The
real-broker story is in tests/integration/test_unreadable_batches.py."""

from __future__ import annotations

import base64
import struct

import pytest
from broken_batches import BREAKAGES, build, reseal
from kafka import TopicPartition
from kafka.consumer.fetcher import ConsumerRecord, Fetcher
from kafka.record.default_records import DefaultRecordBatch
from kafka.record.memory_records import MemoryRecords

from cli.deadletters import Letter, plan_replay
from flywheel.contracts import DeadLetterEvent, GenerationEvent, decode
from flywheel.kafka import batches as kafka_batches
from flywheel.kafka.batches import UnreadableBatch, require_codecs, unreadable_batch
from flywheel.kafka.patches import install_client_patches
from flywheel.metrics import new_registry
from flywheel.stream.deadletters import DeadLetters
from flywheel.stream.runner import decode_keyed

# the tolerant reader, as every factory that makes a consumer installs it (this module makes none:
# alone, before any test that does, it read kafka-python's unpatched fetcher)
install_client_patches()
TP = TopicPartition("t", 0)
RECORDS = [(b"k%d" % i, b"v%d" % i) for i in range(3)]


def _read(*batches: bytearray, fetch_offset: int = 10) -> tuple[list, Fetcher.PartitionRecords]:
    """Every record kafka-python's fetch reader hands out for one fetch holding ``batches``."""
    part = Fetcher.PartitionRecords(fetch_offset, TP, MemoryRecords(b"".join(bytes(b) for b in batches)))
    got = part.take()
    return got, part


@pytest.mark.parametrize("compression", [0, DefaultRecordBatch.CODEC_GZIP, DefaultRecordBatch.CODEC_LZ4,
                                         DefaultRecordBatch.CODEC_SNAPPY, DefaultRecordBatch.CODEC_ZSTD])
def test_readable_batches_of_every_codec_are_read_as_they_were(compression):
    got, part = _read(build(RECORDS, compression, base=10), build(RECORDS[:1], compression, base=13))
    assert [(r.offset, r.key, r.value, r.headers) for r in got] == [
        (10, b"k0", b"v0", []), (11, b"k1", b"v1", []), (12, b"k2", b"v2", []), (13, b"k0", b"v0", [])]
    assert part.next_fetch_offset == 14


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_an_unreadable_batch_comes_out_as_one_stand_in_and_the_reader_moves_past_it(breakage):
    broken = BREAKAGES[breakage](build(RECORDS, base=10))
    got, part = _read(build(RECORDS[:1], base=9), broken, build(RECORDS[:1], base=13), fetch_offset=9)
    # the first record of a batch whose second record is malformed was read: it is kept
    read = [9, 10] if breakage == "record" else [9]
    assert [r.offset for r in got] == [*read, 12, 13]
    stand_in = got[-2]
    marker = unreadable_batch(stand_in.headers)
    assert isinstance(marker, UnreadableBatch)
    assert (marker.first, marker.last) == (read[-1] + 1, 12)
    assert stand_in.key is None and stand_in.value  # the bytes, for the dead letter
    assert got[-1].value == b"v0" and unreadable_batch(got[-1].headers) is None
    assert part.next_fetch_offset == 14
    assert not part  # drained: nothing left in line (the spin came from a failed batch still in line)


def test_the_stand_in_says_why_and_where():
    crc, codec, gzip, record = (unreadable_batch(_read(BREAKAGES[b](build(RECORDS, base=10)))[0][-1].headers)
                                for b in ("crc", "codec", "decompress", "record"))
    assert "CRC" in crc.reason and "does not match" in crc.reason
    assert "Unrecognized compression type: 5" in codec.reason
    assert "compression codec 1" in gzip.reason
    assert "Invalid record size" in record.reason
    assert crc.describe("gens", 3) == f"records at offsets 10-12 of gens[3] could not be read: {crc.reason}"
    assert UnreadableBatch(7, 7, "x").describe("gens", 0) == "records at offset 7 of gens[0] could not be read: x"


def test_a_record_cannot_pass_for_a_stand_in():
    # a producer can send a header named like the marker: the marker is an object, not a name
    assert unreadable_batch([("unreadable-batch", None)]) is None
    assert unreadable_batch([(UnreadableBatch(1, 2, "x"), None), ("more", b"")]) is None
    assert unreadable_batch(None) is None and unreadable_batch([]) is None


def test_trailing_bytes_after_every_record_cost_no_stand_in():
    batch = build(RECORDS, base=10)
    batch += b"\x00\x00"  # after the last record
    struct.pack_into(">i", batch, 8, len(batch) - 12)
    got, part = _read(reseal(batch))
    assert [r.offset for r in got] == [10, 11, 12]
    assert all(unreadable_batch(r.headers) is None for r in got)
    assert part.next_fetch_offset == 13


def test_a_consumer_will_not_start_without_every_codec(monkeypatch):
    require_codecs()  # the dependencies are installed
    monkeypatch.setitem(kafka_batches.CODECS, "lz4", lambda: False)
    monkeypatch.setitem(kafka_batches.CODECS, "snappy", lambda: False)
    with pytest.raises(RuntimeError, match="cannot read snappy, lz4-compressed batches"):
        require_codecs()


class _Sink:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str | None, bytes]] = []

    def write(self, topic: str, key: str | None, value: bytes) -> None:
        self.rows.append((topic, key, value))


def test_the_stages_dead_letter_a_stand_in_with_its_offsets_and_bytes():
    got, _ = _read(BREAKAGES["crc"](build(RECORDS, base=10)))
    stand_in = got[0]
    rec = ConsumerRecord("gens", 2, -1, stand_in.offset, stand_in.timestamp, 0, stand_in.key, stand_in.value,
                         stand_in.headers, None, -1, len(stand_in.value), -1)
    sink = _Sink()
    dead = DeadLetters(sink, "dl", "ingest", new_registry())
    assert decode_keyed(GenerationEvent, rec, dead) is None
    (topic, key, value), = sink.rows
    letter = decode(DeadLetterEvent, value)
    # keyed by its source coordinates, so a repeat of it lands where it did (outboxes are at least once)
    assert (topic, key, letter.reason, letter.source_topic, letter.source_partition, letter.source_offset) == (
        "dl", "gens[2]@10", "unreadable_batch", "gens", 2, 10)
    assert "offsets 10-12 of gens[2]" in letter.detail and "CRC" in letter.detail
    assert base64.b64decode(letter.value_b64) == stand_in.value
    assert dead.counter.labels("unreadable_batch")._value.get() == 1
    # the replay tool refuses it: the bytes are a batch, not a record its source topic would take
    go, refused, _ = plan_replay([Letter(0, 0, letter)], frozenset({"gens"}))
    assert go == [] and "not a record" in refused[0][1]
