"""Judging and bookkeeping between the rewards topic and a step: rejects, staleness, groups, offsets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from trainer_helpers import reward_event

from trainer.batching import REJECT_REASONS, Batcher, OffsetBook, Sample, is_stale, reject_reason


def ev(i=0, **kw):
    return reward_event(i, **kw)


_REJECT_CASES = [
    (ev(), None),
    (ev(completion=(5, 6, 7), logprobs=(-1.0, -1.0)), "length_mismatch"),
    (ev(version=3), "unknown_version"),
    (ev(reward=float("nan")), "nan_reward"),
    (ev(reward=float("inf")), "nan_reward"),
    (ev(completion=tuple(range(10, 40)), logprobs=tuple([-1.0] * 30)), "too_long"),
    (ev(completion=(5, 9999), logprobs=(-1.0, -1.0)), "token_out_of_range"),
    (ev(completion=(5, 6), logprobs=(-1.0, float("nan"))), "bad_logprob"),
    (ev(completion=(5, 6), logprobs=(-1.0, 0.5)), "bad_logprob"),
    (ev(completion=(5, 6), logprobs=(-1.0, -1e308)), "bad_logprob"),  # -inf in float32
    (ev(completion=(5, 6), logprobs=(-1.0, -1e4 - 1)), "bad_logprob"),
    (ev(completion=(5, 6), logprobs=(-1e4, -100.0)), None),  # unlikely, and trainable
    (ev(reward=1e308), "reward_out_of_range"),  # inf in float32
    (ev(reward=-2e6), "reward_out_of_range"),
    (ev(reward=-1e6), None),
    (ev(completion=(), logprobs=()), "empty_completion"),
]


@pytest.mark.parametrize("event, reason", _REJECT_CASES)
def test_reject_reasons(event, reason):
    got = reject_reason(event, trainer_version=2, max_seq_len=20, vocab_size=512)
    assert (got[0] if got else None) == reason
    assert reason is None or reason in REJECT_REASONS  # declared, so its count is exported at 0


def test_every_declared_reject_reason_is_tested():
    assert {reason for _, reason in _REJECT_CASES} - {None} == set(REJECT_REASONS)


@pytest.mark.parametrize("trainer, sample, bound, stale", [(5, 5, 0, False), (5, 4, 0, True), (5, 1, 4, False), (5, 0, 4, True)])
def test_staleness(trainer, sample, bound, stale):
    assert is_stale(trainer, sample, bound) is stale


def s(i, off, **kw):
    return Sample(ev(i, **kw), "t", 0, off)


def test_ungrouped_batches_in_arrival_order():
    b = Batcher(batch_size=2)
    assert b.add(s(0, 0)) == [] and b.next_batch() is None
    b.add(s(1, 1))
    assert [x.offset for x in b.next_batch()] == [0, 1]


def test_active_sampling_waits_for_full_groups_and_drops_zero_variance():
    b = Batcher(batch_size=4, grouped=True, group_size=2, active=True)
    b.add(s(0, 0, group="a", reward=1.0))
    b.add(s(1, 1, group="b", reward=0.0))
    assert b.next_batch() is None
    dropped = b.add(s(2, 2, group="b", reward=0.0))  # group b complete, all rewards equal
    assert [(x.offset, r) for x, r in dropped] == [(1, "zero_advantage"), (2, "zero_advantage")]
    b.add(s(3, 3, group="a", reward=0.0))
    b.add(s(4, 4, group="c", reward=1.0))
    assert b.next_batch() is None  # only one complete group ready
    b.add(s(5, 5, group="c", reward=0.5))
    assert sorted(x.offset for x in b.next_batch()) == [0, 3, 4, 5]


def test_evict_stale_after_version_bump():
    b = Batcher(batch_size=10, grouped=True, group_size=2)
    b.add(s(0, 0, group="a", version=0))
    b.add(s(1, 1, group="b", version=2))
    out = b.evict_stale(trainer_version=3, max_staleness=2)
    assert [(x.offset, r) for x, r in out] == [(0, "stale")]
    assert [x.offset for x in b.waiting()] == [1]


def test_offset_book_floor_and_settled_above():
    book = OffsetBook()
    for o in range(5):
        book.seen("t", 0, o)
    book.settle("t", 0, 0)
    book.settle("t", 0, 2)  # 1 still waits for its group
    book.settle("t", 0, 3)
    assert book.floors[("t", 0)] == 1
    assert book.to_json() == {"t": {"0": {"floor": 1, "settled_above": [2, 3]}}}
    restored = OffsetBook.from_json(book.to_json())
    assert [restored.is_settled("t", 0, o) for o in range(5)] == [True, False, True, True, False]
    book.settle("t", 0, 1)
    assert book.floors[("t", 0)] == 4 and book.to_json()["t"]["0"]["settled_above"] == []


def test_offset_gaps_do_not_pin_the_floor():
    book = OffsetBook()
    book.seen("t", 1, 10)  # first contact: earlier offsets are not ours
    book.settle("t", 1, 10)
    book.seen("t", 1, 13)  # 11 and 12 hold no records (e.g. transaction markers)
    book.settle("t", 1, 13)
    assert book.floors[("t", 1)] == 14


def test_a_rebalance_resumes_after_what_this_process_took_in():
    book = OffsetBook.from_json({"t": {"0": {"floor": 3, "settled_above": [5]}}})
    assert book.resume_at("t", 0) == 3  # a restart: the version's floor
    assert book.resume_at("t", 1) is None  # no floor: the group positions it
    for o in (3, 4, 6):
        book.seen("t", 0, o)
    book.settle("t", 0, 4)  # 3 and 6 wait in the batcher
    assert book.resume_at("t", 0) == 7
    assert [book.taken("t", 0, o) for o in (2, 3, 6, 7)] == [True, True, True, False]
    assert not book.taken("t", 1, 0)
    assert OffsetBook.from_json(book.to_json()).resume_at("t", 0) == 3  # a restart reads 3 and 6 again


def test_a_started_partition_keeps_its_start_as_floor():
    book = OffsetBook()
    book.start("t", 1, 8)  # assigned, nothing read yet
    assert book.resume_at("t", 1) == 8 and book.to_json() == {"t": {"1": {"floor": 8, "settled_above": []}}}
    book.seen("t", 1, 10)  # 8 and 9 hold no records
    book.settle("t", 1, 10)
    assert book.floors[("t", 1)] == 11
    book.start("t", 1, 20)  # a floor is never moved by a later start
    assert book.floors[("t", 1)] == 11


@pytest.mark.parametrize("steps, since, now, due", [
    (0, None, 1000.0, False),  # nothing trained or dropped: never due, however long it idled
    (3, 100.0, 105.0, False),
    (3, 100.0, 110.0, True),  # every_s after the first entry
    (4, 109.0, 110.0, True),  # every_steps reached
    (0, 100.0, 110.0, True),  # only drops: they are recorded too, on the same clock
])
def test_publish_due_counts_from_the_first_unpublished_entry(steps, since, now, due):
    from trainer.loop import Ledger, publish_due

    assert publish_due(Ledger(steps=steps, since=since), now, every_steps=4, every_s=10.0) is due
