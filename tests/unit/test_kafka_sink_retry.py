"""KafkaSink's bookkeeping of what Kafka still owes an ack for, against a producer whose futures
the test settles by hand (the real broker: tests/integration/test_kafka_sink.py)."""

from __future__ import annotations

from kafka.errors import KafkaTimeoutError

from flywheel.kafka.producers import KafkaSink


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
        self.closed = False
        self.headers: dict[str, object] = {}  # by key: what each record was sent with

    def close(self, timeout=None):
        self.closed = True

    def send(self, topic, key=None, value=None, headers=None):
        if self.refuse:
            raise KafkaTimeoutError("no metadata")
        fut = Future()
        self.sent.append((topic, key, fut))
        self.headers[key] = headers
        return fut


def ack(fut: Future) -> None:
    fut.is_done = True


def fail(fut: Future) -> None:
    fut.is_done, fut.exception = True, KafkaTimeoutError("expired")


def test_a_failed_send_retires_the_producer_and_what_is_owed_goes_out_again_through_a_new_one():
    made = [Producer()]
    sink = KafkaSink(lambda: made[-1])
    sink.write("t", "a", b"1")
    sink.write("t", "b", b"2")
    sink.write("t", "c", b"3")
    old = made[0]
    ack(old.sent[0][2])
    made.append(Producer())  # the next one the factory makes
    fail(old.sent[1][2])  # "c" is still pending on the old producer
    assert not sink.settle()
    assert old.closed and sink.producer.retired == 1
    assert [k for _, k, _ in made[1].sent] == ["b", "c"]  # the acked "a" is not sent again
    assert sink.unacked == 2
    ack(made[1].sent[0][2])
    assert not sink.settle() and sink.unacked == 1
    ack(made[1].sent[1][2])
    assert sink.settle() and sink.unacked == 0 and sink.stuck_s() == 0
    assert sink.producer.made == 2 and sink.producer.retired == 1


def test_sends_that_cannot_be_queued_wait_and_go_out_in_order_once_one_can():
    producer = Producer()
    sink = KafkaSink(lambda: producer)
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
    assert sink.producer.retired == 0 and not producer.closed  # refusals are no failure of the producer


def test_a_record_sent_again_keeps_its_headers():
    # a checkpoint announcement's signature is in its headers (flywheel/signing.py): a resend
    # without them would be refused by the controller as unsigned
    made = [Producer()]
    sink = KafkaSink(lambda: made[-1])
    sig = [("flywheel-key-id", b"k"), ("flywheel-sig", b"s" * 64)]
    sink.write("t", "a", b"1", headers=sig)
    sink.write("t", "b", b"2")
    made.append(Producer())
    fail(made[0].sent[0][2])
    assert not sink.settle()
    assert made[1].headers == {"a": sig, "b": None}
