"""kafka-python's record reader with flywheel's lenient header keys (flywheel/kafka/headers.py),
on record batches built by kafka-python's own builder. The real-broker story is in
tests/integration/test_unreadable_headers.py."""

from __future__ import annotations

import pytest
from kafka.errors import CorruptRecordError
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from flywheel.kafka.headers import UnreadableHeaderKey, unreadable_header
from flywheel.kafka.patches import install_client_patches

install_client_patches()  # the lenient reader, as every reader in a flywheel process has it


class _NotUtf8(str):
    def encode(self, *args: object, **kwargs: object) -> bytes:
        return b"\xc3\x28k"  # an invalid two-byte sequence


RECORDS = [
    (0, 1_000, b"k0", b"v0", []),
    (1, 1_007, None, b"v1", [(_NotUtf8("x"), b"h"), ("fine", None)]),
    (2, 1_009, b"k2", None, [("fine", b"")]),
]


def _batch(compression: int = 0) -> bytearray:
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=compression, is_transactional=False,
                                        producer_id=-1, producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
    for offset, ts, key, value, headers in RECORDS:
        builder.append(offset, ts, key, value, headers)
    return builder.build()


@pytest.mark.parametrize("compression", [0, DefaultRecordBatch.CODEC_GZIP])
def test_a_bad_header_key_is_read_with_every_other_field_intact(compression):
    got = list(DefaultRecordBatch(bytes(_batch(compression))))
    assert [(r.offset, r.timestamp, r.key, r.value) for r in got] == [rec[:4] for rec in RECORDS]
    assert got[0].headers == [] and got[2].headers == [("fine", b"")]
    name, value = got[1].headers[0]
    assert (type(name), name, name.raw, value) == (UnreadableHeaderKey, "\\xc3(k", b"\xc3\x28k", b"h")
    assert got[1].headers[1] == ("fine", None)
    assert unreadable_header(got[1].headers) is name
    assert [unreadable_header(r.headers) for r in (got[0], got[2])] == [None, None]


def test_a_bad_header_key_in_a_truncated_record_is_still_a_corrupt_record():
    data = bytes(_batch())
    cut = data[:data.index(b"\xc3\x28k") + 2]  # ends inside the bad key
    with pytest.raises(CorruptRecordError):
        list(DefaultRecordBatch(cut))
