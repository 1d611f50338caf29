"""Pure judging and bookkeeping between the rewards topic and an optimizer step.

* :func:`reject_reason` - why a decoded :class:`RewardEvent` cannot be trained on (dead-letter).
* :func:`is_stale` - the staleness bound (valid data, dropped and counted, not dead-lettered).
* :class:`Batcher` - forms batches; for grouped losses with active sampling it waits for complete
  groups with non-zero reward variance and drops zero-advantage groups.
* :class:`OffsetBook` - which offsets of which partitions are *settled* (trained or declared
  dropped) so a checkpoint can store exactly where a restart resumes.

No Kafka, no torch: all of it is table-tested in tests/unit/test_trainer_batching.py.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from flywheel.contracts import CONTRACT_REASONS, RewardEvent


@dataclass(frozen=True)
class Sample:
    """One trainable record and where it came from (topic, partition, offset)."""

    event: RewardEvent
    topic: str
    partition: int
    offset: int

    @property
    def pos(self) -> tuple[str, int, int]:
        return (self.topic, self.partition, self.offset)


#: Every reason :func:`reject_reason` gives.
REJECT_REASONS: tuple[str, ...] = ("length_mismatch", "empty_completion", "unknown_version", "nan_reward",
                                   "reward_out_of_range", "bad_logprob", "too_long", "token_out_of_range")
#: The trainer computes in float32, where a reward of 1e308 is infinite and so is every
#: advantage normalised with it: no labeler means a reward this large.
MAX_ABS_REWARD = 1e6
#: Lowest behaviour logprob trained on. float32 holds nothing below about -3.4e38, and a sampler's
#: logprob of the token it drew is far above this (float32 probabilities end near e^-104).
MIN_LOGPROB = -1e4
#: Every reason the trainer dead-letters a reward record for: its contract, the checks above, and
#: a batch whose loss was not finite (trainer/loop.py; no step is taken on it).
DEADLETTER_REASONS: tuple[str, ...] = (*CONTRACT_REASONS, *REJECT_REASONS, "nonfinite_loss", "unreadable_batch")


def reject_reason(ev: RewardEvent, *, trainer_version: int, max_seq_len: int, vocab_size: int) -> tuple[str, str] | None:
    """``(reason, detail)`` for records that go to the dead-letter topic, else None."""
    if len(ev.logprobs) != len(ev.completion_token_ids):
        return "length_mismatch", f"{len(ev.logprobs)} logprobs for {len(ev.completion_token_ids)} tokens"
    if not ev.completion_token_ids:
        return "empty_completion", "no completion tokens to train on"
    if ev.model_version > trainer_version:
        return "unknown_version", f"model_version {ev.model_version} is newer than the trainer's {trainer_version}"
    if not math.isfinite(ev.reward):
        return "nan_reward", f"reward {ev.reward!r} is not finite"
    if abs(ev.reward) > MAX_ABS_REWARD:
        return "reward_out_of_range", f"reward {ev.reward!r} is beyond +-{MAX_ABS_REWARD:g}"
    if not all(MIN_LOGPROB <= x <= 1e-6 for x in ev.logprobs):  # NaN fails both comparisons
        return "bad_logprob", f"logprobs must be finite and within [{MIN_LOGPROB:g}, 0]"
    n = len(ev.prompt_token_ids) + len(ev.completion_token_ids)
    if n > max_seq_len:
        return "too_long", f"{n} tokens > max_seq_len {max_seq_len}"
    if any(t < 0 or t >= vocab_size for t in (*ev.prompt_token_ids, *ev.completion_token_ids)):
        return "token_out_of_range", f"token id outside [0, {vocab_size})"
    return None


def is_stale(trainer_version: int, model_version: int, max_staleness: int) -> bool:
    return trainer_version - model_version > max_staleness


@dataclass
class Batcher:
    """Collects samples into batches of ``batch_size``.

    Ungrouped (``grouped=False``): first come, first batched. Grouped: samples wait in their
    ``group_id`` until the group has ``group_size`` members (or, with ``group_size`` 0, are
    batched as they come); with ``active`` a complete group whose rewards are all equal is
    returned by :meth:`add` as dropped (``zero_advantage``) instead of being queued.
    """

    batch_size: int
    grouped: bool = False
    group_size: int = 0
    active: bool = True
    pending: OrderedDict[str, list[Sample]] = field(default_factory=OrderedDict)
    ready: list[Sample] = field(default_factory=list)

    def add(self, s: Sample) -> list[tuple[Sample, str]]:
        """Queue ``s``; return samples dropped as a result, each with its reason."""
        if not (self.grouped and self.group_size > 0):
            self.ready.append(s)
            return []
        group = self.pending.setdefault(s.event.group_id, [])
        group.append(s)
        if len(group) < self.group_size:
            return []
        del self.pending[s.event.group_id]
        if self.active and len({m.event.reward for m in group}) == 1:
            return [(m, "zero_advantage") for m in group]
        self.ready.extend(group)
        return []

    def next_batch(self) -> list[Sample] | None:
        """A batch when enough samples are ready (whole groups, so a group is never split)."""
        if len(self.ready) < self.batch_size:
            return None
        n = self.batch_size
        if self.grouped and self.group_size > 0:
            n = max(self.group_size, (self.batch_size // self.group_size) * self.group_size)
        batch, self.ready = self.ready[:n], self.ready[n:]
        return batch

    def evict_stale(self, trainer_version: int, max_staleness: int) -> list[tuple[Sample, str]]:
        """After a version bump: queued samples now beyond the staleness bound are dropped."""
        out: list[tuple[Sample, str]] = []
        keep = []
        for s in self.ready:
            (out if is_stale(trainer_version, s.event.model_version, max_staleness) else keep).append(s)
        self.ready = keep
        for gid in list(self.pending):
            if any(is_stale(trainer_version, s.event.model_version, max_staleness) for s in self.pending[gid]):
                out.extend(self.pending.pop(gid))
        return [(s, "stale") for s in out]

    def waiting(self) -> list[Sample]:
        return [s for g in self.pending.values() for s in g] + list(self.ready)


@dataclass
class OffsetBook:
    """Per-partition settled offsets, compressed to a floor plus the settled offsets above it.

    ``floor`` is the lowest offset not yet settled; every offset below it is settled. Offsets
    above the floor that are settled (trained while an earlier record still waits for its group)
    are listed, so a restart that seeks to the floor skips exactly those.
    """

    floors: dict[tuple[str, int], int] = field(default_factory=dict)
    above: dict[tuple[str, int], set[int]] = field(default_factory=dict)
    last: dict[tuple[str, int], int] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> OffsetBook:
        book = cls()
        for topic, parts in data.items():
            for part, entry in parts.items():
                key = (topic, int(part))
                book.floors[key] = int(entry["floor"])
                book.above[key] = set(entry.get("settled_above", []))
        return book

    def to_json(self) -> dict:
        out: dict[str, dict[str, dict]] = {}
        for (topic, part), floor in sorted(self.floors.items()):
            out.setdefault(topic, {})[str(part)] = {"floor": floor, "settled_above": sorted(self.above.get((topic, part), ()))}
        return out

    def is_settled(self, topic: str, partition: int, offset: int) -> bool:
        key = (topic, partition)
        return offset < self.floors.get(key, 0) or offset in self.above.get(key, ())

    def seen(self, topic: str, partition: int, offset: int) -> None:
        """A record arrived. Offsets skipped since the last one (transaction markers, compaction)
        hold no record and are settled, so they can never pin the floor."""
        key = (topic, partition)
        if key not in self.floors:
            self.floors[key] = offset  # first contact: nothing before it is ours to track
        last = self.last.get(key, self.floors[key] - 1)
        for gap in range(last + 1, offset):
            self.settle(topic, partition, gap)
        self.last[key] = max(last, offset)

    def start(self, topic: str, partition: int, offset: int) -> None:
        """This process reads a partition that has no floor yet from ``offset`` on (recorded
        before any record of it arrives). A partition the group takes away and later gives back
        then resumes here, not at an offset another member committed meanwhile."""
        self.floors.setdefault((topic, partition), offset)

    def taken(self, topic: str, partition: int, offset: int) -> bool:
        """Whether this process already took in the record at ``offset``: it is settled or waits
        in the batcher, so reading it again (after a rebalance) must change nothing."""
        last = self.last.get((topic, partition))
        return last is not None and offset <= last

    def resume_at(self, topic: str, partition: int) -> int | None:
        """Where this process reads a partition on: after the last record it took in, else the
        floor (a restart's, from a version); None for a partition it knows nothing of."""
        key = (topic, partition)
        if key in self.last:
            return self.last[key] + 1
        return self.floors.get(key)

    def settle(self, topic: str, partition: int, offset: int) -> None:
        key = (topic, partition)
        floor = self.floors.get(key, 0)
        if offset < floor:
            return
        above = self.above.setdefault(key, set())
        above.add(offset)
        while floor in above:  # advance over the contiguous settled run
            above.discard(floor)
            floor += 1
        self.floors[key] = floor

    def copy(self) -> OffsetBook:
        return OffsetBook(dict(self.floors), {k: set(v) for k, v in self.above.items()}, dict(self.last))
