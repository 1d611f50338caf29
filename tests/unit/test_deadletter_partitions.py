"""A stage's dead letter is a row of the outbox of the partition its record came from
(flywheel/stream/runner.py ``OutboxDeadLetters``): taken from the letter, never from a cursor set
before each record, so a letter raised after other partitions' records were handled still goes
with its own partition, whose owner alone delivers it (and after a crash recovers it)."""

from __future__ import annotations

import pytest
from conftest import consumer_record
from kafka.consumer.fetcher import ConsumerRecord
from prometheus_client import CollectorRegistry

from flywheel.contracts import (
    MAX_DEADLETTER_BYTES,
    DeadLetterEvent,
    FeedbackEvent,
    GenerationEvent,
    SamplingParams,
    Topics,
    decode,
    encode,
)
from flywheel.settings import IngestSettings
from flywheel.stream.runner import OutboxDeadLetters
from flywheel.stream.store import StateStore
from ingest.stage import SCHEMA, IngestStage

T = Topics("t")
PARTITIONS = range(4)


def rec(topic: str, partition: int, key: str, value: bytes, offset: int) -> ConsumerRecord:
    return consumer_record(topic, partition, offset, key, value)


def gen(gid: str, t: float, text: str = "c") -> GenerationEvent:
    return GenerationEvent(
        generation_id=gid, group_id=gid, model_name="m", model_version=1, user_id="u", endpoint="chat",
        created_at=t, completed_at=t, latency_ms=1, prompt_text="p", prompt_token_ids=(1,),
        completion_text=text, completion_token_ids=(2,), logprobs=(-1.0,),
        sampling=SamplingParams(temperature=1, top_p=1, max_tokens=4), finish_reason="stop")


def letters_by_row(store: StateStore) -> list[tuple[int, DeadLetterEvent]]:
    """(outbox shard, letter) of every dead letter owed, for every partition."""
    return [(r.shard, decode(DeadLetterEvent, r.value, max_bytes=MAX_DEADLETTER_BYTES))
            for r in store.pending(PARTITIONS) if r.topic == T.deadletter]


@pytest.fixture
def ingest(tmp_path):
    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    yield IngestStage(IngestSettings(window_s=10, orphan_wait_s=10, grace_s=1), T, store, CollectorRegistry()), store
    store.close()


def test_a_record_letter_goes_to_its_partition_when_other_partitions_came_between(ingest):
    stage, store = ingest
    batch = [
        rec(T.generations, 2, "g2", encode(gen("g2", 100.0)), 10),
        rec(T.generations, 0, "g0", b"{not json", 11),  # undecodable: a letter while decoding
        rec(T.generations, 3, "g3", encode(gen("g3", 100.0)), 12),
        # another completion under g2's id: its letter comes after partitions 0 and 3 were handled
        rec(T.generations, 2, "g2", encode(gen("g2", 100.0, text="other")), 13),
        rec(T.feedback, 1, "g1", b"", 14),  # empty: a letter, handled last while decoding
    ]
    with store.txn():
        stage.process(batch, now=100.0)
    got = {(shard, dl.reason, dl.source_partition, dl.source_offset) for shard, dl in letters_by_row(store)}
    assert got == {(0, "undecodable", 0, 11), (2, "reused_generation_id", 2, 13), (1, "empty", 1, 14)}


def test_a_window_letter_goes_to_its_feedback_partition_whatever_shard_ticked_before(ingest):
    stage, store = ingest
    orphan = FeedbackEvent(feedback_id="f", generation_id="gone", signal="accept", created_at=100.0,
                           received_at=100.0)
    with store.txn():
        stage.process([rec(T.feedback, 3, "gone", encode(orphan), 7)], now=100.0)
    with store.txn():
        stage.tick({0, 1, 2, 3}, now=200.0)  # 3's orphan, among partitions ticked in order
    [(shard, dl)] = letters_by_row(store)
    assert (shard, dl.reason, dl.source_partition, dl.source_offset) == (3, "orphan_feedback", 3, 7)


def test_outbox_letters_take_the_partition_each_names_and_refuse_none(tmp_path):
    store = StateStore(tmp_path / "s.sqlite3", SCHEMA)
    dead = OutboxDeadLetters(store, T.deadletter, "ingest", CollectorRegistry())
    with store.txn():
        for offset, partition in enumerate([1, 3, 0, 3, 1]):
            dead.send("invalid", "x", source_topic=T.feedback, value=b"v", key=b"k", partition=partition,
                      offset=offset)
    assert [(shard, dl.source_partition) for shard, dl in letters_by_row(store)] == [
        (1, 1), (3, 3), (0, 0), (3, 3), (1, 1)]
    with pytest.raises(ValueError, match="partition"), store.txn():
        dead.send("invalid", "x", source_topic=T.feedback, value=b"v")
    store.close()
