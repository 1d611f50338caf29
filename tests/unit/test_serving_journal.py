"""The serving journal: order, torn tails, the byte bound, reopening after a crash."""

from __future__ import annotations

import pytest

from serving.journal import Journal, JournalFull


def items(n: int, start: int = 0) -> list[tuple[str, str | None, bytes]]:
    return [("t.feedback", f"g{i}" if i % 3 else None, f"value-{i}".encode()) for i in range(start, start + n)]


def test_append_then_replay_in_order(tmp_path):
    j = Journal(tmp_path, 1 << 20)
    j.append(items(5))
    j.append(items(5, start=5))
    got = j.peek(100)
    assert [e.value for e in got] == [f"value-{i}".encode() for i in range(10)]
    assert [e.key for e in got[:4]] == [None, "g1", "g2", None]
    assert j.records == 10


def test_advance_moves_head_and_compacts_when_drained(tmp_path):
    j = Journal(tmp_path, 1 << 20)
    j.append(items(6))
    first = j.peek(4)
    j.advance(first)
    assert j.records == 2
    assert [e.value for e in j.peek(10)] == [b"value-4", b"value-5"]
    j.advance(j.peek(10))
    assert j.records == 0 and j.size_bytes == 0 and j.empty()
    assert (tmp_path / "journal.log").stat().st_size == 0


def test_survives_reopen_and_resumes_at_head(tmp_path):
    j = Journal(tmp_path, 1 << 20)
    j.append(items(6))
    j.advance(j.peek(2))
    j.close()
    again = Journal(tmp_path, 1 << 20)
    assert again.records == 4
    assert [e.value for e in again.peek(10)] == [f"value-{i}".encode() for i in range(2, 6)]


@pytest.mark.parametrize("cut", [1, 5, 9, 20])
def test_torn_tail_is_truncated_on_open(tmp_path, cut):
    j = Journal(tmp_path, 1 << 20)
    j.append(items(3))
    good = j.size_bytes
    j.append(items(1, start=3))
    j.close()
    log = tmp_path / "journal.log"
    data = log.read_bytes()
    log.write_bytes(data[: len(data) - cut])  # crash mid-write of the last frame
    again = Journal(tmp_path, 1 << 20)
    assert again.records == 3
    assert again.truncated_bytes == len(data) - cut - good
    assert log.stat().st_size == good
    again.append(items(1, start=9))  # appends continue cleanly after the cut
    assert [e.value for e in again.peek(10)][-1] == b"value-9"


def test_corrupt_frame_ends_the_journal(tmp_path):
    j = Journal(tmp_path, 1 << 20)
    j.append(items(2))
    j.close()
    log = tmp_path / "journal.log"
    data = bytearray(log.read_bytes())
    data[-1] ^= 0xFF  # flip a payload byte of the last frame: crc mismatch
    log.write_bytes(bytes(data))
    assert Journal(tmp_path, 1 << 20).records == 1


def test_bound_is_enforced_all_or_nothing(tmp_path):
    j = Journal(tmp_path, 4096)
    big = [("t", "k", b"x" * 1000)]
    for _ in range(4):
        j.append(big)
    with pytest.raises(JournalFull, match="full"):
        j.append(big)
    assert j.records == 4
    with pytest.raises(JournalFull):
        j.append([("t", "k", b"x" * 10)] * 20)  # a batch that does not fit is refused whole
    assert j.records == 4
    j.advance(j.peek(10))
    j.append(big)  # room again once delivered
    assert j.records == 1
