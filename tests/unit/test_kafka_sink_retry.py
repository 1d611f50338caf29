"""KafkaSink's bookkeeping of what Kafka still owes an ack for, against a producer whose futures
the test settles by hand (the real broker: tests/integration/test_kafka_sink.py)."""

from __future__ import annotations

from kafka.errors import KafkaTimeoutError

from flywheel.bus import KafkaSink


class Future:
    def __init__(self) -> None:
        self.is_done, self.exception = False, None

    def failed(self) -> bool:
        return self.exception is not None


class Producer:
    """Queues every send as a pending future, or refuses it while ``refuse`` is set."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, Future]] = []
        self.refuse = False

    def send(self, topic, key=None, value=None):
        if self.refuse:
            raise KafkaTimeoutError("no metadata")
        fut = Future()
        self.sent.append((topic, key, fut))
        return fut


def ack(fut: Future) -> None:
    fut.is_done = True


def fail(fut: Future) -> None:
    fut.is_done, fut.exception = True, KafkaTimeoutError("expired")


def test_a_failed_send_is_sent_again_and_owed_until_that_one_is_acked():
    producer = Producer()
    sink = KafkaSink(producer)
    sink.write("t", "a", b"1")
    sink.write("t", "b", b"2")
    ack(producer.sent[0][2])
    fail(producer.sent[1][2])
    assert not sink.settle()
    assert [k for _, k, _ in producer.sent] == ["a", "b", "b"]  # only the failed one again
    assert sink.unacked == 1
    ack(producer.sent[2][2])
    assert sink.settle() and sink.unacked == 0 and sink.stuck_s() == 0


def test_sends_that_cannot_be_queued_wait_and_go_out_in_order_once_one_can():
    producer = Producer()
    sink = KafkaSink(producer)
    producer.refuse = True
    sink.write("t", "a", b"1")
    sink.write("t", "b", b"2")  # not tried: the one before could not be queued
    assert not sink.settle() and sink.unacked == 2 and producer.sent == []
    producer.refuse = False
    assert not sink.settle()  # both queued now, not acked yet
    assert [k for _, k, _ in producer.sent] == ["a", "b"]
    for _, _, fut in producer.sent:
        ack(fut)
    assert sink.settle() and sink.unacked == 0
