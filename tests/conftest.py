"""Shared fixtures: a real Kafka-protocol broker per test session, throwaway topics, a tiny model.

The broker is the embedded Tansu binary (see flywheel/broker.py), started here by the tests
themselves. Each test that needs topics gets fresh uuid-prefixed ones, so tests never see each
other's records and the in-memory broker can drop them afterwards.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import pytest

log = logging.getLogger(__name__)

# Fast consumer-group joins on the embedded broker (it holds a join for half the session timeout).
TEST_SESSION_TIMEOUT_MS = 2000
TEST_HEARTBEAT_MS = 500


@pytest.fixture(scope="session")
def broker():
    from flywheel.broker import EmbeddedBroker

    with EmbeddedBroker() as b:
        yield b


@pytest.fixture
def topic_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}."


@pytest.fixture
def kafka_settings(broker):
    from flywheel.settings import KafkaSettings

    return KafkaSettings(
        bootstrap=broker.bootstrap,
        session_timeout_ms=TEST_SESSION_TIMEOUT_MS,
        heartbeat_interval_ms=TEST_HEARTBEAT_MS,
        partitions=2,
    )


@pytest.fixture
def topics(kafka_settings, topic_prefix):
    """Fresh topics for one test (created up front, deleted afterwards)."""
    from kafka import KafkaAdminClient

    from flywheel.bus import ensure_topics
    from flywheel.contracts import Topics

    t = Topics(topic_prefix)
    ensure_topics(kafka_settings, t.all())
    yield t
    admin = KafkaAdminClient(bootstrap_servers=kafka_settings.bootstrap)
    try:
        admin.delete_topics(list(t.all()))
    except Exception:  # noqa: BLE001 - best effort: the broker is in memory and dies with the session
        log.debug("could not delete test topics %s", t.all())
    finally:
        admin.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama + BPE tokenizer built locally and saved in Hugging Face format (version 0)."""
    from flywheel.modelinit import ModelSpec, init_model

    return init_model(tmp_path_factory.mktemp("model"), ModelSpec())


def read_all(bootstrap: str, topic: str, *, expect: int | None = None, timeout_s: float = 20.0):
    """Every record on ``topic`` (from the start), waiting until ``expect`` arrived or timeout."""
    import time

    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        consumer_timeout_ms=500,
    )
    out = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=300).values():
                out.extend(records)
            if expect is not None and len(out) >= expect:
                # one more short poll so a duplicate right behind would be seen too
                for records in consumer.poll(timeout_ms=500).values():
                    out.extend(records)
                break
    finally:
        consumer.close()
    return out


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
