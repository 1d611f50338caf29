"""The state store's outbox bookkeeping, on a real SQLite file."""

from __future__ import annotations

import pytest

from ingest.exactly_once import StateStore, seq_runs


@pytest.mark.parametrize(("seqs", "runs"), [
    ([], []),
    ([5], [(5, 5)]),
    ([1, 2, 3], [(1, 3)]),
    ([3, 1, 2, 2], [(1, 3)]),
    ([1, 2, 4, 5, 9], [(1, 2), (4, 5), (9, 9)]),
    ([10, 8, 7, 12], [(7, 8), (10, 10), (12, 12)]),
])
def test_seq_runs(seqs, runs):
    assert seq_runs(seqs) == runs


def test_mark_delivered_deletes_exactly_the_given_rows_and_moves_marks(tmp_path):
    store = StateStore(tmp_path / "s.sqlite3")
    with store.txn():
        for i in range(12):
            store.append(i % 2, "out", f"k{i}", b"v%d" % i)
    seqs = [r.seq for r in store.pending({0, 1})]
    gone = [seqs[i] for i in (0, 1, 2, 5, 7, 8, 11)]  # runs and gaps, as acks arrive
    store.mark_delivered(reversed(gone), {(0, "out", 1): 40, (1, "out", 0): 7})
    assert [r.seq for r in store.pending({0, 1})] == [s for s in seqs if s not in gone]
    store.mark_delivered([], {(0, "out", 1): 30})  # a confirmed point never moves back
    assert store.out_mark(0, "out", 1) == 40 and store.out_mark(1, "out", 0) == 7
