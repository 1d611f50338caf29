"""The outbox's partitioner hashes exactly as Kafka's default partitioner (ingest/partitioner.py).

kafka-python's ``murmur2`` is the reference: it is what the project used before, what the Java
client computes, and where every producer that keys by generation_id puts a generation.
"""

from __future__ import annotations

import random

import pytest
from kafka.partitioner.default import murmur2 as reference

from ingest.partitioner import murmur2, murmur2_many, out_partition, out_partitions

RNG = random.Random(20261124)
#: Every length from empty to past 16 words, random bytes (high bits set included), and the
#: shapes real keys have: generation ids, outbox ids, non-ASCII ids.
KEYS = ([RNG.randbytes(n) for n in range(70) for _ in range(40)]
        + [f"gen-{i:08x}-{RNG.getrandbits(64):016x}".encode() for i in range(500)]
        + [f"a1b2c3d4e5f6:{i}".encode() for i in range(500)]
        + ["génération-ü-€-😀".encode(), b"\xff" * 9, b"\x00" * 7])


def test_one_key_at_a_time_hashes_as_kafka_python():
    assert [murmur2(k) for k in KEYS] == [reference(k) for k in KEYS]


def test_a_batch_hashes_as_kafka_python_whatever_the_mix_of_lengths():
    shuffled = RNG.sample(KEYS, len(KEYS))
    assert murmur2_many(shuffled).tolist() == [reference(k) for k in shuffled]


@pytest.mark.parametrize("keys", [[b""], [b"a"], [b"abcd"], [b"abc", b""], [b"x" * 129]])
def test_edge_batches(keys):
    assert murmur2_many(keys).tolist() == [reference(k) for k in keys]


def test_partitions_follow_the_default_partitioner_for_each_record_count():
    counts = [RNG.choice([1, 2, 3, 7, 12, 100]) for _ in KEYS]
    want = [(reference(k) & 0x7FFFFFFF) % n for k, n in zip(KEYS, counts, strict=True)]
    assert out_partitions(KEYS, counts) == want
    assert out_partitions([], []) == []


def test_a_record_without_a_key_hashes_its_outbox_id():
    assert out_partition(None, "abc:7", 5) == (reference(b"abc:7") & 0x7FFFFFFF) % 5
    assert out_partition("g-1", "abc:7", 5) == (reference(b"g-1") & 0x7FFFFFFF) % 5
