"""Where the outbox sends a record: Kafka's default key partitioner, computed by the stage.

The outbox picks every output's partition itself rather than leaving it to the producer, so that
a recovery scan knows exactly which partition to read back (ingest/exactly_once.py). A keyed
record goes where Kafka's default partitioner puts it (``murmur2(key) & 0x7fffffff`` modulo the
partition count, as the Java client and kafka-python compute it), so an episode or a reward lands
on the partition number its generation has; an unkeyed one (a dead letter) hashes its outbox id.

The hash runs once per output record. kafka-python's ``murmur2`` takes the key a byte at a time
in Python, which cost more than all the rest of an output's delivery; :func:`out_partitions`
hashes a whole batch of keys with numpy, word by word across the batch, and :func:`murmur2` is
the one-key form. tests/unit/test_partitioner.py checks both against kafka-python's on thousands
of keys.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

_SEED = 0x9747B28C
_M = 0x5BD1E995  # murmur2's mixing constant
_MASK = 0xFFFFFFFF


def out_partition(key: str | None, outbox_id: str, partitions: int) -> int:
    """The partition a record goes to: the default key partitioner, or a stable hash of its id."""
    data = (key if key is not None else outbox_id).encode("utf-8")
    return (murmur2(data) & 0x7FFFFFFF) % partitions


def out_partitions(keys: Sequence[bytes], partitions: Sequence[int]) -> list[int]:
    """:func:`out_partition` of each key (UTF-8 bytes) with its partition count, in one pass."""
    if not keys:
        return []
    hashes = murmur2_many(keys)
    return ((hashes & 0x7FFFFFFF) % np.asarray(partitions, dtype=np.uint64)).tolist()


def murmur2(data: bytes) -> int:
    """Java's ``Utils.murmur2`` of ``data``, as kafka-python returns it (unsigned 32 bits).

    Words are read four bytes at a time (little-endian, as Java assembles them) and masked once
    per multiplication.
    """
    length = len(data)
    h = _SEED ^ length
    words = length >> 2
    for k in struct.unpack_from(f"<{words}I", data):
        k = (k * _M) & _MASK
        k = ((k ^ (k >> 24)) * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = length & 3
    if tail:
        end = words << 2
        if tail == 3:
            h ^= data[end + 2] << 16
        if tail >= 2:
            h ^= data[end + 1] << 8
        h = ((h ^ data[end]) * _M) & _MASK
    h = ((h ^ (h >> 13)) * _M) & _MASK
    return h ^ (h >> 15)


def murmur2_many(keys: Sequence[bytes]) -> np.ndarray:
    """:func:`murmur2` of every key, as an array of uint64 (each below 2**32).

    The keys are laid end to end; step ``w`` mixes the ``w``-th word of every key that has one,
    so the Python work is one step per word of the longest key, not one per byte of every key.
    Products of two 32-bit numbers fit uint64, so each multiplication is masked back to 32 bits.
    """
    n = len(keys)
    lengths = np.fromiter(map(len, keys), dtype=np.uint64, count=n)
    # 4 zero bytes past the end: the gathers below may read a word past a short key (masked out)
    data = np.frombuffer(b"".join(keys) + b"\0\0\0\0", dtype=np.uint8).astype(np.uint64)
    starts = np.zeros(n, dtype=np.uint64)
    np.cumsum(lengths[:-1], out=starts[1:])
    m, mask = np.uint64(_M), np.uint64(_MASK)
    h = np.uint64(_SEED) ^ lengths
    words = lengths >> np.uint64(2)
    for w in range(int(words.max(initial=0))):
        at = starts + np.uint64(4 * w)
        np.minimum(at, np.uint64(len(data) - 4), out=at)
        k = data[at] | (data[at + 1] << np.uint64(8)) | (data[at + 2] << np.uint64(16)) | (data[at + 3] << np.uint64(24))
        k = (k * m) & mask
        k = ((k ^ (k >> np.uint64(24))) * m) & mask
        h = np.where(words > w, ((h * m) & mask) ^ k, h)
    tail = lengths & np.uint64(3)
    end = np.minimum(starts + (words << np.uint64(2)), np.uint64(len(data) - 4))
    h = np.where(tail == 3, h ^ (data[end + np.uint64(2)] << np.uint64(16)), h)
    h = np.where(tail >= 2, h ^ (data[end + np.uint64(1)] << np.uint64(8)), h)
    h = np.where(tail >= 1, ((h ^ data[end]) * m) & mask, h)
    h = ((h ^ (h >> np.uint64(13))) * m) & mask
    return h ^ (h >> np.uint64(15))
