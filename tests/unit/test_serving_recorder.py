"""Recorder protocol with an in-memory producer: direct sends, journal fallback, ordered replay.

The real broker version (a SIGSTOP'd Tansu) is in tests/integration/test_serving_api.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from flywheel.contracts import FeedbackEvent, decode
from flywheel.metrics import new_registry
from flywheel.settings import KafkaSettings
from serving.journal import Journal, JournalFull
from serving.recorder import Recorder


class _Fut:
    def __init__(self, ok: bool) -> None:
        self.ok = ok

    def get(self, timeout: float) -> None:
        if not self.ok:
            raise TimeoutError("no ack")


class FakeBroker:
    """Accepts sends while up; while down every send times out. Records what was acked."""

    def __init__(self) -> None:
        self.up = True
        self.acked: list[bytes] = []
        self.lock = threading.Lock()

    def producer(self) -> FakeBroker._P:
        return FakeBroker._P(self)

    class _P:
        def __init__(self, broker: FakeBroker) -> None:
            self.b = broker

        def send(self, topic, key, value, headers=None):
            with self.b.lock:
                if self.b.up:
                    self.b.acked.append(value)
                return _Fut(self.b.up)

        def close(self, timeout=None):
            pass


def fb(i: int) -> FeedbackEvent:
    return FeedbackEvent(feedback_id=f"f{i}", generation_id=f"g{i}", signal="accept",
                         created_at=1.0, received_at=1.0)


def recorder(tmp_path, broker: FakeBroker, max_bytes: int = 1 << 20) -> Recorder:
    return Recorder(KafkaSettings(), Journal(tmp_path, max_bytes), new_registry(), ack_timeout_s=0.05,
                    retry_interval_s=0.02, producer_factory=broker.producer).start()


def ids(values: list[bytes]) -> list[str]:
    return [decode(FeedbackEvent, v).feedback_id for v in values]


def wait_until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_direct_publish_resolves_feedback_futures(tmp_path):
    broker = FakeBroker()
    rec = recorder(tmp_path, broker)
    futs = [rec.record_feedback("t.feedback", fb(i)) for i in range(20)]
    assert all(f.result(2) for f in futs)
    rec.stop()
    assert ids(broker.acked) == [f"f{i}" for i in range(20)]
    assert rec.journal.records == 0


def test_outage_journals_then_replays_in_order(tmp_path):
    broker = FakeBroker()
    rec = recorder(tmp_path, broker)
    broker.up = False
    futs = [rec.record_feedback("t.feedback", fb(i)) for i in range(10)]
    assert all(f.result(2) for f in futs)  # durable in the journal while the broker is down
    assert rec.journal.records == 10 and rec.state()["publisher"] == "degraded"
    broker.up = True
    futs += [rec.record_feedback("t.feedback", fb(i)) for i in range(10, 15)]
    wait_until(lambda: len(broker.acked) == 15)
    rec.stop()
    assert ids(broker.acked) == [f"f{i}" for i in range(15)]  # new events queued behind the journal


def test_journal_left_by_previous_process_is_replayed_first(tmp_path):
    broker = FakeBroker()
    broker.up = False
    rec = recorder(tmp_path, broker)
    [rec.record_feedback("t.feedback", fb(i)).result(2) for i in range(3)]
    rec.stop()
    broker.up = True
    again = recorder(tmp_path, broker)
    again.record_feedback("t.feedback", fb(3)).result(2)
    wait_until(lambda: len(broker.acked) == 4)
    again.stop()
    assert ids(broker.acked) == ["f0", "f1", "f2", "f3"]


def test_full_journal_refuses_feedback_and_counts_dropped_generations(tmp_path):
    broker = FakeBroker()
    broker.up = False
    rec = recorder(tmp_path, broker, max_bytes=4096)
    results = []
    for i in range(60):
        try:
            results.append(rec.record_feedback("t.feedback", fb(i)).result(2))
        except JournalFull as exc:
            results.append(exc)
    rec.stop()
    refused = [r for r in results if isinstance(r, JournalFull)]
    assert refused and "full" in str(refused[0])
    assert results.index(refused[0]) == len(results) - len(refused)  # accepted ones came first
    assert rec.journal.size_bytes <= 4096


def test_queue_full_refuses_feedback_at_once(tmp_path):
    rec = Recorder(KafkaSettings(), Journal(tmp_path, 1 << 20), new_registry(), ack_timeout_s=0.05,
                   queue_max=1, producer_factory=FakeBroker().producer)  # not started: nothing drains
    assert rec.record_feedback("t.feedback", fb(0)).done() is False
    with pytest.raises(JournalFull):
        rec.record_feedback("t.feedback", fb(1)).result(0)


def test_drop_counters_are_exported_at_zero_before_any_drop(tmp_path):
    """The page on dropped events uses increase(), which needs a sample before the first drop."""
    registry = new_registry()
    Recorder(KafkaSettings(), Journal(tmp_path, 1 << 20), registry, ack_timeout_s=0.05,
             producer_factory=FakeBroker().producer)
    for reason in ("invalid", "queue_full", "journal_full"):
        labels = {"kind": "generation", "reason": reason}
        assert registry.get_sample_value("serving_dropped_events_total", labels) == 0.0


class ColdBroker(FakeBroker):
    """Up, but each new producer's first acks take ``warmup_s`` (metadata, connect): longer than
    the recorder's ack timeout."""

    def __init__(self, warmup_s: float) -> None:
        super().__init__()
        self.warmup_s = warmup_s
        self.producers = 0

    def producer(self) -> ColdBroker._P:
        self.producers += 1
        return ColdBroker._P(self, time.monotonic() + self.warmup_s)

    class _P(FakeBroker._P):
        def __init__(self, broker: ColdBroker, ready_at: float) -> None:
            super().__init__(broker)
            self.ready_at = ready_at

        def send(self, topic, key, value, headers=None):
            producer, broker = self, self.b

            class _Slow:
                def get(self, timeout: float) -> None:
                    wait = producer.ready_at - time.monotonic()
                    if wait > timeout:
                        time.sleep(timeout)
                        raise TimeoutError("no ack yet")
                    time.sleep(max(0.0, wait))
                    with broker.lock:
                        broker.acked.append(value)

            return _Slow()


def test_a_broker_slower_than_the_ack_timeout_still_drains_the_journal(tmp_path):
    # a fixed ack timeout shorter than a fresh producer's first ack discarded the producer on every
    # replay and started the next one cold: the journal never drained while the broker was up
    broker = FakeBroker()
    broker.up = False
    rec = recorder(tmp_path, broker)
    [rec.record_feedback("t.feedback", fb(i)).result(2) for i in range(30)]
    rec.stop()
    cold = ColdBroker(warmup_s=0.3)  # six times the 0.05 s ack timeout
    again = recorder(tmp_path, cold)
    wait_until(lambda: again.journal.records == 0, timeout_s=10)
    again.stop()
    assert sorted(set(ids(cold.acked))) == sorted(f"f{i}" for i in range(30))
