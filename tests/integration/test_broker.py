"""The embedded broker speaks Kafka: produce/consume through the project's own client factories."""

import pytest

from flywheel.kafka.clients import make_consumer, make_producer

pytestmark = pytest.mark.integration


def test_round_trip_and_group_commit(kafka_settings, topics):
    producer = make_producer(kafka_settings, "test")
    for i in range(20):
        producer.send(topics.feedback, key=f"k{i}", value=f"v{i}".encode())
    producer.flush()
    producer.close()

    consumer = make_consumer(kafka_settings, "test", "g1", [topics.feedback])
    seen = []
    for _ in range(40):
        for recs in consumer.poll(timeout_ms=250).values():
            seen.extend(r.value for r in recs)
        if len(seen) >= 20:
            break
    consumer.commit()
    consumer.close()
    assert sorted(seen) == sorted(f"v{i}".encode() for i in range(20))

    # a new member of the same group resumes after the committed offsets: nothing is re-read
    again = make_consumer(kafka_settings, "test", "g1", [topics.feedback])
    more = []
    for _ in range(12):
        for recs in again.poll(timeout_ms=250).values():
            more.extend(recs)
    again.close()
    assert more == []


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_flywheel_broker_stops_the_broker_it_started_on_sigterm_and_sigint(sig):
    """A supervisor or ``kill`` sends SIGTERM: the broker process must not outlive the command,
    re-parented and still holding its port."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    from local.broker import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cli", "broker", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "broker listening" in proc.stdout.readline()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        proc.send_signal(getattr(signal, sig))
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while True:  # nothing answers on the port any more: the broker went with the command
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            break
        assert time.monotonic() < deadline, "the broker still holds its port after the command stopped"
        time.sleep(0.2)


def test_the_tests_reader_reads_a_topic_larger_than_a_fetch_to_its_end(kafka_settings, topics):
    """``read_all(expect=0)`` is every record there: it stopped after two polls, and a swap test
    waited 240 s for generations that were on the topic past what two fetches return."""
    from tests.conftest import read_all

    producer = make_producer(kafka_settings, "test", linger_ms=20)
    for i in range(3000):
        producer.send(topics.generations, key=b"%04d" % i, value=b"%04d" % i + b"x" * 2000)
    producer.flush()
    producer.close()
    got = read_all(kafka_settings.bootstrap, topics.generations, expect=0)
    assert sorted(r.key for r in got) == [b"%04d" % i for i in range(3000)]
