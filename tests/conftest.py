"""Shared fixtures: a real Kafka-protocol broker per test session, throwaway topics, a tiny model.

The broker is the embedded Tansu binary (see local/broker.py), started here by the tests
themselves. Each test that needs topics gets fresh uuid-prefixed ones, so tests never see each
other's records and the in-memory broker can drop them afterwards.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

log = logging.getLogger(__name__)

# Fast consumer-group joins on the embedded broker (it holds a join for half the session timeout).
TEST_SESSION_TIMEOUT_MS = 2000
TEST_HEARTBEAT_MS = 500


@pytest.fixture(scope="session")
def broker():
    from flywheel.kafka.patches import install_client_patches
    from local.broker import EmbeddedBroker

    install_client_patches()  # the tests' own readers read as every flywheel reader does

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

    from flywheel.contracts import Topics
    from flywheel.kafka.topics import ensure_declared

    t = Topics(topic_prefix)
    ensure_declared(kafka_settings, t)  # as every role makes them (flywheel/topology.py)
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


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A local S3 API on loopback (moto's server mode), and the standard AWS variables pointing
    every S3 client of this process at it, as a pod's env points it at MinIO or S3."""
    import socket

    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "flywheel-test",
           "AWS_SECRET_ACCESS_KEY": "flywheel-test", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env["AWS_ENDPOINT_URL"]
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_url(s3_endpoint) -> str:
    """``s3://<a new bucket>/checkpoints`` on the session's local S3 API."""
    import fsspec

    bucket = f"flywheel-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3").mkdir(bucket)
    return f"s3://{bucket}/checkpoints"


@pytest.fixture(scope="session")
def sharded_hf_dir(tmp_path_factory) -> Path:
    """The tiny model as a user's Hugging Face directory: six safetensors shards with their index,
    tied embeddings, tokenizer and chat template, no Flywheel manifest (tests/hf_helpers.py).
    Read-only: a test that breaks it works on a copy."""
    from hf_helpers import build_sharded_hf_dir

    return build_sharded_hf_dir(tmp_path_factory.mktemp("hf") / "model")


def small_generation(gid: str, t: float):
    """A two-token generation by user ``u1``, created and completed at ``t``."""
    from flywheel.contracts import GenerationEvent, SamplingParams

    return GenerationEvent(
        generation_id=gid, group_id=gid, model_name="m", model_version=0, user_id="u1", endpoint="chat",
        created_at=t, completed_at=t, latency_ms=5, prompt_text="p", prompt_token_ids=(1, 2),
        completion_text="c", completion_token_ids=(3, 4), logprobs=(-0.1, -0.2),
        sampling=SamplingParams(temperature=1, top_p=1, max_tokens=4), finish_reason="stop")


def accept_feedback(fid: str, gid: str, t: float):
    """An ``accept`` of generation ``gid`` given at ``t``."""
    from flywheel.contracts import FeedbackEvent

    return FeedbackEvent(feedback_id=fid, generation_id=gid, signal="accept", decision_ms=800.0,
                         created_at=t, received_at=t)


def read_all(bootstrap: str, topic: str, *, expect: int | None = None, timeout_s: float = 20.0):
    """Every record on ``topic`` (from the start), waiting until ``expect`` arrived or timeout;
    ``expect=0``: what is there now, read up to the end each partition's fetches report. (It
    stopped after two polls: a topic larger than two fetches, 2,958 generations of a swap test,
    was never read whole however long a caller waited.)"""
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
            if expect == 0:
                if _read_to_end(consumer):
                    break
                continue
            if expect is not None and len(out) >= expect:
                # one more short poll so a duplicate right behind would be seen too
                for records in consumer.poll(timeout_ms=500).values():
                    out.extend(records)
                break
    finally:
        consumer.close()
    return out


def _read_to_end(consumer) -> bool:
    """Whether ``consumer`` holds partitions and has read each to the high watermark its last
    fetch reported (the embedded broker answers end-offset requests wrongly)."""
    tps = consumer.assignment()
    return bool(tps) and all(
        (end := consumer.highwater(tp)) is not None and consumer.position(tp) >= end for tp in tps)


def stage_env(kafka_settings, topics, data_dir: Path, **extra: str) -> dict[str, str]:
    """``FLYWHEEL_*`` variables for a stage run by a test: its broker and topics, consumer groups
    of its own (the embedded broker's group quirk, local/broker.py), ops on free ports, and
    ``extra``."""
    return {
        "FLYWHEEL_KAFKA_BOOTSTRAP": kafka_settings.bootstrap,
        "FLYWHEEL_KAFKA_PARTITIONS": str(kafka_settings.partitions),
        "FLYWHEEL_KAFKA_SESSION_TIMEOUT_MS": str(kafka_settings.session_timeout_ms),
        "FLYWHEEL_KAFKA_HEARTBEAT_INTERVAL_MS": str(kafka_settings.heartbeat_interval_ms),
        "FLYWHEEL_TOPIC_PREFIX": topics.prefix,
        "FLYWHEEL_INGEST_GROUP_ID": f"{topics.prefix}ingest",
        "FLYWHEEL_REWARD_GROUP_ID": f"{topics.prefix}reward",
        "FLYWHEEL_DATA_DIR": str(data_dir),
        "FLYWHEEL_INGEST_PORT": "0",
        "FLYWHEEL_REWARD_PORT": "0",
        "FLYWHEEL_LOG_LEVEL": "WARNING",
        "FLYWHEEL_ARCHIVE_MAX_AGE_S": "0.5",  # archives follow the topics within a second
        **extra,
    }


def stage_settings(kafka_settings, topics, data_dir: Path, **extra: str):
    """:func:`stage_env` parsed, as the stage's own command would."""
    from flywheel.settings import load_settings

    return load_settings(env=stage_env(kafka_settings, topics, data_dir, **extra))


@contextmanager
def running(stage_run, settings) -> Iterator[threading.Thread]:
    """A stage's ``run(settings, args, stop)`` on a thread of this process until the block ends."""
    stop = threading.Event()
    thread = threading.Thread(target=stage_run, args=(settings, None, stop), daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(timeout=30)


#: The PostgreSQL database the release store's tests use (each test gets a schema of its own in it).
#: Not a FLYWHEEL_* name: settings parsing refuses unknown ones.
RELEASE_TEST_POSTGRES_URL = os.environ.get("RELEASE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(params=["sqlite", "postgres"])
def release_db_url(request, tmp_path) -> Iterator[str]:
    """A fresh, empty release database, once per backend the store supports (:func:`release_database`)."""
    with release_database(request.param, tmp_path) as url:
        yield url


def postgres_admin(url: str):
    """An autocommit connection to ``url`` for a test's setup and cleanup; the test is skipped,
    saying why, when no PostgreSQL answers there."""
    import psycopg

    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.skip(f"no PostgreSQL at {url}: {exc}")


def consumer_record(topic: str, partition: int, offset: int, key: str, value: bytes):
    """A record as the consumer hands it to a stage, for tests that drive a stage's rules directly."""
    from kafka.consumer.fetcher import ConsumerRecord

    return ConsumerRecord(topic=topic, partition=partition, leader_epoch=-1, offset=offset, timestamp=0,
                          timestamp_type=0, key=key.encode(), value=value, headers=[], checksum=None,
                          serialized_key_size=0, serialized_value_size=len(value), serialized_header_size=0)


@contextmanager
def release_database(backend: str, tmp_path: Path) -> Iterator[str]:
    """An SQLite file under ``tmp_path``, or a throwaway schema in PostgreSQL (``search_path`` set
    through the URL, so the store's unqualified table names land in it), dropped afterwards.
    Skipped, saying why, when no PostgreSQL answers at ``RELEASE_TEST_POSTGRES_URL``."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'release.sqlite3'}"
        return
    admin = postgres_admin(RELEASE_TEST_POSTGRES_URL)
    schema = f"release_test_{uuid.uuid4().hex[:12]}"
    admin.execute(f'CREATE SCHEMA "{schema}"')
    sep = "&" if "?" in RELEASE_TEST_POSTGRES_URL else "?"
    try:
        yield f"{RELEASE_TEST_POSTGRES_URL}{sep}options=-csearch_path%3D{schema}&application_name={schema}"
    finally:
        # a killed test process's backend may hold its locks a moment longer: end it before the drop
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                      (schema,))
        admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
        admin.close()


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# -- serving: one engine for the session, apps on loopback ports ---------------------------------
@pytest.fixture
def engine(tiny_model_dir):
    """``(loop, engine)``: the session's one vLLM engine and the event loop it runs on
    (tests/serving_helpers.py); shut down right after the last test that uses it."""
    from serving_helpers import ENGINE

    return ENGINE.get(tiny_model_dir)


@pytest.fixture
def serve(engine, broker, tiny_model_dir, tmp_path):
    """Factory: start an app on the shared engine with ``ServeSettings`` overrides (and
    ``telemetry``: its ``TelemetrySettings``; ``http``: its ``HttpSettings``), its own recorder,
    journal and uuid topics, on a fresh loopback port; stopped after the test."""
    from serving_helpers import KEY, SALT, Served

    from flywheel.contracts import Topics
    from flywheel.kafka.clients import ensure_topics
    from flywheel.metrics import new_registry
    from flywheel.settings import KafkaSettings, ServeSettings, Settings, TelemetrySettings
    from serving.app import create_app
    from serving.main import make_recorder
    from serving.server import AppServer

    loop, eng = engine
    started = []

    def start(prefix: str | None = None, telemetry: TelemetrySettings | None = None, http=None,
              **overrides) -> Served:
        topics = Topics(prefix or f"t{uuid.uuid4().hex[:10]}.")
        kafka = KafkaSettings(bootstrap=broker.bootstrap, partitions=2)
        ensure_topics(kafka, [topics.generations, topics.feedback])
        serve_cfg = ServeSettings(**{"api_keys": (KEY,), "user_id_salt": SALT, "version_visible_keys": (KEY,),
                                     **overrides})
        settings = Settings(model_dir=tiny_model_dir, data_dir=tmp_path, topic_prefix=topics.prefix,
                            kafka=kafka, serve=serve_cfg, telemetry=telemetry or TelemetrySettings())
        registry = new_registry()
        recorder = make_recorder(settings, registry)
        app = create_app(settings, eng, recorder, registry)
        server = AppServer(app, loop, limits=http, registry=registry).start()
        started.append((server, recorder, app.state.tracing))
        return Served(server.url, settings, recorder, topics, app.state.tracing)

    yield start
    for server, recorder, tracing in started:
        server.stop()
        recorder.stop()
        tracing.shutdown()


_last_engine_user: dict[int, object] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the test's own fixtures (its apps) are torn down first
    session = item.session
    if id(session) not in _last_engine_user:
        users = [it for it in session.items if "engine" in getattr(it, "fixturenames", ())]
        _last_engine_user[id(session)] = users[-1] if users else None
    if _last_engine_user[id(session)] is item:
        from serving_helpers import ENGINE

        ENGINE.close()  # the stages' and trainer's tests after it get the cores and memory back


def pytest_sessionfinish(session):
    import sys

    helpers = sys.modules.get("serving_helpers")
    if helpers is not None:  # a run stopped early (-x, Ctrl-C) never reached the last user
        helpers.ENGINE.close()
