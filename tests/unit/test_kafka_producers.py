"""Which send failures replace a stage's producer (flywheel/kafka/producers.py).

A failure that breaks the producer (a delivery timeout: kafka-python's idempotent producer then
sends nothing more, librdkafka's is fenced by the embedded broker) replaces it, failing every
other send in flight so that they are sent again. A refusal of one record (too large for its
topic, not allowed) must not: the other sends would be sent twice for nothing. The embedded broker
enforces no topic's record limit, so the refusals are handed to the report paths directly here.
"""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError as RdKafkaError
from kafka.errors import KafkaTimeoutError, MessageSizeTooLargeError, TopicAuthorizationFailedError

from flywheel.kafka.producers import ConfluentOutput, KafkaPythonOutput
from flywheel.settings import KafkaSettings


@pytest.mark.parametrize(("error", "replaced"), [
    (MessageSizeTooLargeError("too large for the topic"), False),
    (TopicAuthorizationFailedError("not allowed"), False),
    (KafkaTimeoutError("expired after the delivery timeout"), True),
])
def test_kafka_python_replaces_its_producer_only_when_it_is_broken(error, replaced):
    out = KafkaPythonOutput(lambda: object())  # no broker: the report path alone
    current = out.producer.get()
    out._failed(current, 1, error)
    assert out._failed_current is replaced
    assert out.reports() == [(1, error)]  # the record itself is reported failed either way
    assert out.producer.retired == int(replaced)


@pytest.mark.parametrize(("code", "replaced"), [
    (RdKafkaError.MSG_SIZE_TOO_LARGE, False),
    (RdKafkaError.TOPIC_AUTHORIZATION_FAILED, False),
    (RdKafkaError._MSG_TIMED_OUT, True),
    (RdKafkaError._FENCED, True),
])
def test_confluent_replaces_its_producer_only_when_it_is_broken(code, replaced):
    out = ConfluentOutput(KafkaSettings(bootstrap="127.0.0.1:9"), "t")  # connects lazily: nothing answers
    try:
        out._report(out.made, 1, RdKafkaError(code), None)
        assert out._failed_current is replaced
        (token, err), = out.reports()
        assert token == 1 and err is not None
        assert out.retired == int(replaced)
    finally:
        out.producer.purge()
