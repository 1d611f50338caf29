"""The trainer's consumer group rebalances while it runs, and no reward is lost or trained twice.

A rebalance takes the trainer's partitions away and gives them back to the same process: its
session was evicted after a long step, or another consumer joined its group id (here: an
operator's console consumer with auto-commit, which reads and commits while it holds a
partition, then leaves). The trainer runs in this process on the CPU against the session's
broker; the tests drive its loop one turn at a time (what ``Trainer.run`` does on one rank), so
they can say exactly when the other consumer joins and leaves and when a version is published.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_helpers import make_trainer, reward_event

from flywheel.contracts import RewardEvent, encode
from flywheel.kafka.clients import make_consumer, make_producer

pytestmark = pytest.mark.integration


def produce(kafka_settings, topics, records: dict[int, int]) -> None:
    """``{i: partition}``: reward ``gen-i`` to that partition of the rewards topic."""
    producer = make_producer(kafka_settings, "test")
    for i, part in records.items():
        producer.send(topics.rewards, key=f"gen-{i}", value=encode(reward_event(i)), partition=part)
    producer.flush()
    producer.close()


def trainer(kafka_settings, topics, model_dir: Path, data_dir: Path, group: str, batch: int):
    """A trainer on a real consumer, subscribed as ``flywheel train`` subscribes it. Versions are
    published only when a test says so."""
    consumer = make_consumer(kafka_settings, "trainer", group, max_poll_records=256)
    tr = make_trainer(model_dir, data_dir, {"consumer": consumer}, topic_prefix=topics.prefix, loss="reinforce",
                      batch_size=batch, max_seq_len=256, publish_every_steps=10_000, publish_every_s=3600.0)
    tr.start()
    tr.subscribe()
    return tr


def turn(tr) -> None:
    """One turn of ``Trainer.run`` on the leader of one rank: decide, then do it."""
    kind, payload = tr._decide()
    if kind == "train":
        tr._train([RewardEvent.model_validate(e) for e in payload["events"]], payload["pos"])
    elif kind == "publish":
        tr.publish()


def pump(tr, until, timeout_s: float, what: str, other: Foreign | None = None) -> None:
    """Turn the trainer's loop until ``until()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not until():
        if other is not None and other.error is not None:
            raise AssertionError(f"the other consumer failed while waiting for {what}") from other.error
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        turn(tr)


def reads_to_end(tr, ends: dict[int, int]) -> bool:
    """The trainer holds every partition again and has taken in each one up to ``ends``."""
    tps = tr.consumer.assignment()
    if {tp.partition for tp in tps} != set(ends):
        return False
    return all(tr.consumer.position(tp) == ends[tp.partition] for tp in tps)


class Foreign:
    """An operator's console consumer with the trainer's group id and auto-commit: it joins (a
    rebalance), reads whatever partition it is given, commits, and leaves when told (another)."""

    def __init__(self, kafka_settings, topics, group: str, strategy, ends: dict[int, int]) -> None:
        self.ends, self.error = ends, None
        self.read: list = []
        self.assigned: set[int] = set()
        self.caught_up, self.leave, self.left = threading.Event(), threading.Event(), threading.Event()
        self.consumer = make_consumer(kafka_settings, "console", group, topics=[topics.rewards],
                                      enable_auto_commit=True, auto_commit_interval_ms=200,
                                      partition_assignment_strategy=strategy)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        c = self.consumer
        try:
            while not self.leave.is_set():
                for records in c.poll(timeout_ms=100).values():
                    self.read.extend(records)
                tps = c.assignment()
                if not self.caught_up.is_set() and tps and all(c.position(tp) == self.ends[tp.partition] for tp in tps):
                    self.assigned = {tp.partition for tp in tps}
                    c.commit()  # past everything it read: what the trainer must not take as its own
                    self.caught_up.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            c.close()  # leaves the group: another rebalance
            self.left.set()


def trained_and_dropped(tr) -> tuple[list[str], dict[str, list[str]]]:
    ls = [tr.store.ledger(v) for v in tr.store.versions()]
    dropped: dict[str, list[str]] = {}
    for x in ls:
        for reason, ids in x["dropped"].items():
            dropped.setdefault(reason, []).extend(ids)
    return [g for x in ls for g in x["trained"]], dropped


def test_a_rebalance_does_not_settle_buffered_records_as_duplicates(kafka_settings, topics, tiny_model_dir, tmp_path):
    """Records waiting in the batcher are read again when a rebalance seeks their partition back:
    they must not be dropped (and settled) as duplicates of themselves, or a version published
    before they train settles them, and the restart from it never trains them."""
    group = f"{topics.prefix}trainer"
    first = {0: 0, 1: 1, 2: 0}  # three rewards, fewer than a batch: they wait in the batcher
    produce(kafka_settings, topics, first)
    tr = trainer(kafka_settings, topics, tiny_model_dir, tmp_path, group, batch=4)
    pump(tr, lambda: len(tr.batcher.waiting()) == len(first), 30, "the first rewards taken in")
    assert tr.step == 0

    other = Foreign(kafka_settings, topics, group, tr.consumer.config["partition_assignment_strategy"], {0: 2, 1: 1})
    try:
        pump(tr, other.caught_up.is_set, 30, "the other consumer to read its partition", other)
        other.leave.set()
        pump(tr, lambda: other.left.is_set() and reads_to_end(tr, {0: 2, 1: 1}), 30,
             "the trainer to hold both partitions again and read them to their ends", other)
    finally:
        other.leave.set()
        other.thread.join(10)
    assert other.error is None and other.read, "the other consumer read nothing"
    waiting = sorted(s.event.generation_id for s in tr.batcher.waiting())
    assert waiting == sorted(f"gen-{i}" for i in first), "the rebalance took records in twice"
    tr.publish()  # a version while the first rewards still wait for a batch
    tr.consumer.close(autocommit=False)  # ... and the process dies (no later version)

    more = {3: 1, 4: 0, 5: 1, 6: 0, 7: 1}  # with the first three: two batches
    produce(kafka_settings, topics, more)
    # a group of its own: the embedded broker may never complete a join of a group whose members
    # all just left (local/broker.py); a restart resumes from the manifest, not the group
    tr2 = trainer(kafka_settings, topics, tiny_model_dir, tmp_path, f"{group}-2", batch=4)
    pump(tr2, lambda: reads_to_end(tr2, {0: 4, 1: 4}) and len(tr2.batcher.ready) < 4, 30,
         "the restarted trainer to read every partition to its end")
    tr2.publish()
    tr2.consumer.close(autocommit=False)

    trained, dropped = trained_and_dropped(tr2)
    ids = sorted(f"gen-{i}" for i in (*first, *more))
    lost = sorted(set(ids) - set(trained))
    assert not lost and sorted(trained) == ids, f"lost {lost}, trained {sorted(trained)}, dropped {dropped}"
    assert dropped == {}  # not one of them was a duplicate
    assert tr.m.dropped.labels("duplicate")._value.get() == 0


@pytest.mark.slow  # a fault run (a second group member takes a partition), 7 s
def test_a_partition_held_by_another_member_is_read_from_where_the_trainer_started_it(
        kafka_settings, topics, tiny_model_dir, tmp_path):
    """A partition the trainer has read nothing from yet (no floor) is taken by another member of
    its group, which reads and commits past records there. When the trainer gets it back it must
    read those records itself, not resume at the other member's commit."""
    group = f"{topics.prefix}trainer"
    tr = trainer(kafka_settings, topics, tiny_model_dir, tmp_path, group, batch=2)
    pump(tr, lambda: len(tr.consumer.assignment()) == 2, 30, "the trainer to join its group")
    until = time.monotonic() + 1.0
    pump(tr, lambda: time.monotonic() > until, 5, "a second of turns on an empty topic")

    other = Foreign(kafka_settings, topics, group, tr.consumer.config["partition_assignment_strategy"], {0: 2, 1: 2})
    try:
        pump(tr, lambda: len(tr.consumer.assignment()) == 1 and other.consumer.assignment(), 30,
             "the other consumer to take one partition", other)
        produce(kafka_settings, topics, {0: 0, 1: 1, 2: 0, 3: 1})  # two per partition: a batch each
        pump(tr, lambda: other.caught_up.is_set() and tr.step == 1, 30,
             "both to read their partition (the trainer training its batch)", other)
        other.leave.set()
        pump(tr, lambda: other.left.is_set() and reads_to_end(tr, {0: 2, 1: 2}) and not tr.batcher.ready, 30,
             "the trainer to hold both partitions again and read them to their ends", other)
    finally:
        other.leave.set()
        other.thread.join(10)
    assert other.error is None and len(other.read) == 2 and len(other.assigned) == 1
    tr.publish()
    tr.consumer.close(autocommit=False)

    trained, dropped = trained_and_dropped(tr)
    ids = [f"gen-{i}" for i in range(4)]
    lost = sorted(set(ids) - set(trained))
    assert not lost and sorted(trained) == ids, f"lost {lost} (read by the other member), trained {sorted(trained)}"
    assert dropped == {}
    offsets = tr.store.manifest(tr.version)["offsets"][topics.rewards]
    assert {p: o["floor"] for p, o in offsets.items()} == {"0": 2, "1": 2}
