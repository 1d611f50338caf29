"""The trainer rides out a broker that stops answering, and loses no dead letter or announcement.

The trainer runs in this process on the CPU against the session's broker, which is paused
(SIGSTOP: connections stay open, nothing is answered) for longer than any of the trainer's
broker waits. A version settles the offsets of the records it dead-lettered, so it may only
become durable once those letters are acked; and a version committed while the broker cannot
take its announcement is announced once it can, by this run or by the next one.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_helpers import make_trainer, reward_event

from flywheel.checkpoints.manifest import MANIFEST_NAME, sha256_file
from flywheel.contracts import CheckpointEvent, DeadLetterEvent, decode, encode
from flywheel.kafka.clients import make_consumer, make_producer
from flywheel.kafka.producers import KafkaSink
from flywheel.metrics import new_registry
from flywheel.stream.deadletters import DeadLetters
from tests.conftest import read_all
from trainer.announce import announced
from trainer.batching import DEADLETTER_REASONS

pytestmark = pytest.mark.integration

#: Longer than the trainer ever waited on the broker before it learned to ride out a stall
#: (a 10 s flush of each announcement, after which it died).
STALL_S = 12.0


def produce(kafka_settings, topics, records: dict[str, bytes]) -> None:
    producer = make_producer(kafka_settings, "test")
    for key, value in records.items():
        producer.send(topics.rewards, key=key, value=value)
    producer.flush()
    producer.close()


def trainer(kafka_settings, topics, model_dir: Path, data_dir: Path, **cfg):
    sink = KafkaSink(lambda: make_producer(kafka_settings, "trainer"))
    consumer = make_consumer(kafka_settings, "trainer", f"{topics.prefix}trainer", max_poll_records=256)
    dead = DeadLetters(sink, topics.deadletter, "trainer", new_registry(), DEADLETTER_REASONS)
    tr = make_trainer(model_dir, data_dir, {"consumer": consumer, "sink": sink, "deadletters": dead},
                      topic_prefix=topics.prefix, loss="reinforce", batch_size=4, max_seq_len=256, **cfg)
    tr.start()
    tr.subscribe()
    return tr


class Loop:
    """``trainer.run()`` on a thread, keeping whatever it raised."""

    def __init__(self, tr) -> None:
        self.tr, self.error = tr, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.tr.run()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def stop(self, timeout_s: float) -> None:
        self.tr.stop_event.set()
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the trainer did not stop within {timeout_s}s"
        self.tr.consumer.close(autocommit=False, timeout_ms=5000)
        self.tr.sink.close()


def wait_for(pred, timeout_s: float, what: str, loop: Loop | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := pred():
            return got
        if loop is not None and loop.error is not None:
            raise AssertionError(f"the trainer failed while waiting for {what}") from loop.error
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def ledgers(tr) -> list[dict]:
    return [tr.store.ledger(v) for v in tr.store.versions()]


def announcements(kafka_settings, topics, expect: int) -> list[CheckpointEvent]:
    return [decode(CheckpointEvent, r.value) for r in read_all(kafka_settings.bootstrap, topics.checkpoints, expect=expect)]


@pytest.mark.slow  # 15-18 s each: the default suite must stay under 15 minutes on 2 cores
def test_a_stall_holds_versions_until_their_dead_letters_are_acked_and_loses_nothing(
        broker, kafka_settings, topics, tiny_model_dir, tmp_path):
    n = 40
    produce(kafka_settings, topics, {**{f"gen-{i}": encode(reward_event(i)) for i in range(n)},
                                     "bad-1": b"{not json"})
    tr = trainer(kafka_settings, topics, tiny_model_dir, tmp_path, publish_every_steps=5, publish_every_s=1.0)
    assert tr.store.versions() == [0]

    # The broker stops answering the moment the trainer dead-letters the bad record: the letter
    # is queued and cannot be acked until the broker is back.
    write = tr.sink.write
    paused = threading.Event()

    def pause_then_write(topic, key, value, **kw):
        if topic == topics.deadletter and not paused.is_set():
            broker.pause()
            paused.set()
        write(topic, key, value, **kw)

    tr.sink.write = pause_then_write
    loop = Loop(tr)
    try:
        wait_for(paused.is_set, 60, "the bad record's dead letter", loop)
        try:
            time.sleep(STALL_S)
            assert loop.error is None and loop.thread.is_alive(), f"the trainer died in the stall: {loop.error!r}"
            # training went on (on what was fetched), but no version may settle the bad record's
            # offset while its dead letter is unacked
            assert tr.step > 0
            assert tr.store.versions() == [0]
            assert tr.stalled_s() > STALL_S / 2
            assert tr.healthy()[1]["stalled_s"] > STALL_S / 2
        finally:
            broker.resume()

        def all_durable():
            ls = ledgers(tr)
            return (sum(len(x["trained"]) for x in ls) == n
                    and sum(len(v) for x in ls for v in x["dropped"].values()) == 1)
        wait_for(all_durable, 90, "every record in a durable version", loop)
        wait_for(lambda: tr.stalled_s() == 0, 30, "the trainer to catch up with the broker", loop)
    finally:
        if paused.is_set():
            broker.resume()  # idempotent: never leave the session's broker stopped
        loop.stop(30)
    assert loop.error is None

    trained = [g for x in ledgers(tr) for g in x["trained"]]
    assert sorted(trained) == sorted(f"gen-{i}" for i in range(n))  # each exactly once
    assert {r: ids for x in ledgers(tr) for r, ids in x["dropped"].items()} == {"undecodable": ["bad-1"]}
    letters = [decode(DeadLetterEvent, r.value) for r in read_all(kafka_settings.bootstrap, topics.deadletter, expect=1)]
    assert [(x.reason, x.key_b64) for x in letters] == [("undecodable", "YmFkLTE=")]
    versions = tr.store.versions()
    events = announcements(kafka_settings, topics, len(versions))
    assert sorted(e.version for e in events) == versions  # each version announced, once
    for e in events:
        assert e.manifest_sha256 == sha256_file(tr.store.path(e.version) / MANIFEST_NAME)


@pytest.mark.slow  # 15-18 s each: the default suite must stay under 15 minutes on 2 cores
def test_versions_the_broker_could_not_take_are_announced_by_the_next_run(
        broker, kafka_settings, topics, tiny_model_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainer.loop")
    produce(kafka_settings, topics, {f"gen-{i}": encode(reward_event(i)) for i in range(8)})
    # no version but the one a stop publishes
    cfg = {"publish_every_steps": 1000, "publish_every_s": 3600.0}
    first = trainer(kafka_settings, topics, tiny_model_dir, tmp_path, **cfg)
    loop = Loop(first)
    wait_for(lambda: first.step == 2, 60, "both batches trained", loop)
    broker.pause()
    try:
        # a stop in the stall still publishes the trained work (no dead letter is owed), and
        # returns although the announcement cannot be acked
        start = time.monotonic()
        loop.stop(30)
        assert loop.error is None
        assert time.monotonic() - start < 30
        assert first.store.versions() == [0, 1]
        assert announced(first.store) == 0
    finally:
        broker.resume()

    second = trainer(kafka_settings, topics, tiny_model_dir, tmp_path, **cfg)
    assert second.version == 1
    assert "versions [1] were never announced" in caplog.text
    loop = Loop(second)
    try:
        events = {e.version: e for e in announcements(kafka_settings, topics, 2)}
    finally:
        loop.stop(30)
    assert set(events) == {0, 1}, "version 1 was never announced"
    assert events[1].manifest_sha256 == sha256_file(second.store.path(1) / MANIFEST_NAME)
    assert events[1].samples == 8 and events[1].step == 2
    assert announced(second.store) == 1
