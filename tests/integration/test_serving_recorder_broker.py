"""The recorder against the real broker: a stall while the producer has no metadata for a topic.

A producer fetches a topic's metadata on its first send to it, and each send waits up to the
ack timeout for it. A stalled broker then must not make a batch of sends take that wait once per
event (minutes for a few hundred), with the journal neither filled nor drained meanwhile.
"""

from __future__ import annotations

import time
import uuid

from flywheel.contracts import FeedbackEvent, decode
from flywheel.kafka.clients import ensure_topics
from flywheel.metrics import new_registry
from serving.journal import Journal
from serving.recorder import Recorder
from tests.conftest import read_all


def _fb(i: int) -> FeedbackEvent:
    return FeedbackEvent(feedback_id=f"f{i}", generation_id=f"g{i}", signal="accept", created_at=1.0,
                         received_at=1.0)


def test_a_stall_on_a_topic_without_metadata_journals_at_once_and_drains_after(broker, kafka_settings, tmp_path):
    first, later = (f"t{uuid.uuid4().hex[:10]}.feedback" for _ in range(2))
    ensure_topics(kafka_settings, [first])
    rec = Recorder(kafka_settings, Journal(tmp_path, 64 << 20), new_registry(), ack_timeout_s=0.5,
                   retry_interval_s=0.1).start()
    try:
        assert rec.record_feedback(first, _fb(-1)).result(10)  # the producer is up, with metadata
        ensure_topics(kafka_settings, [later])  # created after it: it has no metadata for this one
        n = 200
        broker.pause()
        try:
            started = time.monotonic()
            futures = [rec.record_feedback(later, _fb(i)) for i in range(n)]
            assert all(f.result(30) for f in futures)  # durable: every one journaled
            took = time.monotonic() - started
            journaled = rec.journal.records
        finally:
            broker.resume()
        # a few ack waits, not one per event (the old code took n x 0.5 s = 100 s)
        assert took < 10, f"{n} events took {took:.1f}s to be journaled"
        assert journaled > 0
        records = read_all(broker.bootstrap, later, expect=n, timeout_s=30)
        assert {decode(FeedbackEvent, r.value).feedback_id for r in records} == {f"f{i}" for i in range(n)}
        deadline = time.monotonic() + 15
        while rec.journal.records and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rec.journal.records == 0
    finally:
        rec.stop()
